"""Benchmark pack-data's Ray engine against its local engine on one machine, same run, and time the
planner at the example counts of a 100B-token job (the inputs of the projection in BENCHMARKS.md).

    python scripts/bench/bench_ray.py --workers 16 --json docs/results/bench_ray_16core.json
    python scripts/bench/bench_ray.py --workers 2 --tokens 20000000 --copies 1 --plan-tokens 1e8   # a quick look

Parts (`--parts`):
- `pretok`: --tokens synthetic pre-tokenized tokens (rows of 16..4096 ids, as bench_pack_data.py's
  `pretok`), as an uncompressed Arrow IPC file (read in place by either engine: only the write
  phase is spread) and as an uncompressed Parquet file of many row groups (decoded and spilled by
  the tokenize tasks).
- `text`: GSM8K and CodeAlpaca from ../shared, each record --copies times over (copy k's first
  field prefixed "k. ", so no text repeats), as two JSONL inputs of one job, Llama-2 tokenizer.
- `plan`: the driver's plan step (`apply_overlong` + `plan_rows`, ffd, --max-len) on synthetic
  lengths of --plan-tokens in all: mean 250 tokens (instruction data) and mean 2056 (the pretok rows).

Each job runs in a fresh child process, after an untimed small job that fills numba's cache: the
local engine with --num-proc WORKERS, then the Ray engine on a local Ray of WORKERS CPUs that the
job starts (its start counts in `setup`), both at --max-len 8192, ffd. Reported per job: tokens/s with and without setup, the phases, and peak memory
per process: the driver's own (VmHWM), and, sampled every 0.1 s from /proc, the largest Ray worker
process, the sum over all worker processes and Ray's own daemons (raylet, GCS, ...).
The two engines' shards are compared by sha256 (they must be equal).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `scripts.benchlib`, pipeline, trainer
from scripts.benchlib import CODEALPACA, GSM8K, LLAMA2, REPO, add_bench_args, check_output, machine_summary, require, shared_dir, write_json  # noqa: E402

SHARED = shared_dir()
TOKENIZER = SHARED / LLAMA2

CHILD = r"""
import json, sys, time
from scripts.benchlib.machine import vmhwm_mb
from pipeline.engines.job import PackConfig, run_pack_data
stats = {}
t = time.perf_counter()
m = run_pack_data(PackConfig(**json.loads(sys.argv[1])), stats=stats)
stats["wall"] = time.perf_counter() - t
stats["driver_peak_mb"] = vmhwm_mb()
print("STATS " + json.dumps(stats))
"""


class RayMemory:
    """Peak RSS of every Ray process on the machine, sampled from /proc while a job runs."""

    def __init__(self, every: float = 0.1) -> None:
        self.peaks: dict[int, tuple[str, float]] = {}
        self.every = every
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RayMemory:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                name = cmd.split()[0] if cmd.startswith("ray::") else Path(cmd).name if "ray" in cmd else None
                if not name:
                    continue
                rss = next((int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmRSS")), 0.0)
                old = self.peaks.get(int(pid), (name, 0.0))
                self.peaks[int(pid)] = (name if name.startswith("ray::") else old[0], max(old[1], rss))

    def summary(self) -> dict:
        workers = [mb for name, mb in self.peaks.values() if name.startswith("ray::") and "Agent" not in name]
        daemons = {name: round(mb) for name, mb in self.peaks.values() if not name.startswith("ray::") or "Agent" in name}
        return {
            "worker_processes": len(workers),
            "max_worker_peak_mb": round(max(workers, default=0.0)),
            "sum_worker_peaks_mb": round(sum(workers)),
            "daemon_peaks_mb": daemons,
        }


def run_job(config: dict) -> dict:
    """One pack-data job in a fresh interpreter; its stats, and Ray's processes' peaks."""
    with RayMemory() as memory:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps({"progress": False, "overwrite": True, **config})],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=False,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
        )
    if proc.returncode != 0:
        raise SystemExit(f"pack-data ({config.get('engine', 'local')}) failed:\n{proc.stderr[-3000:]}")
    stats = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("STATS "))[6:])
    if config.get("engine") == "ray":
        stats["ray_memory"] = memory.summary()
    return stats


def shard_digests(folder: Path) -> list[str]:
    return [hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.arrow"))]


def compare(name: str, inputs: list[str], tokenizer: str, args, tmp: Path) -> dict:
    """The same job on both engines; tokens/s, phases, memory, and whether the shards are equal."""
    out: dict = {}
    # untimed: a small job fills numba's on-disk cache of compiled kernels (both engines use it)
    run_job({"inputs": inputs, "tokenizer": tokenizer, "max_len": args.max_len, "out": str(tmp / "warm-up"), "num_proc": 1, "limit": 1000})
    for engine in ("local", "ray"):
        folder = tmp / f"out-{name}-{engine}"
        stats = run_job(
            {
                "inputs": inputs,
                "tokenizer": tokenizer,
                "max_len": args.max_len,
                "out": str(folder),
                "num_proc": args.workers,
                "engine": engine,
            }
        )
        total, setup = stats["times"]["total"], stats["times"].get("setup", 0.0)
        out[engine] = {**stats, "tokens_per_s": stats["tokens"] / total, "tokens_per_s_excl_setup": stats["tokens"] / (total - setup)}
        print(
            f"[{name} {engine}] {stats['tokens']:,} tokens: {out[engine]['tokens_per_s'] / 1e6:.2f}M tok/s "
            f"({out[engine]['tokens_per_s_excl_setup'] / 1e6:.2f}M excl. setup), driver peak "
            f"{stats['driver_peak_mb']:.0f} MB, phases {stats['times']}" + (f", Ray {stats['ray_memory']}" if engine == "ray" else ""),
            flush=True,
        )
    digests = [shard_digests(tmp / f"out-{name}-{engine}") for engine in ("local", "ray")]
    out["identical"] = digests[0] == digests[1]
    out["ray_vs_local"] = out["ray"]["tokens_per_s"] / out["local"]["tokens_per_s"]
    out["ray_vs_local_excl_setup"] = out["ray"]["tokens_per_s_excl_setup"] / out["local"]["tokens_per_s_excl_setup"]
    print(
        f"[{name}] shards identical: {out['identical']}; Ray/local {out['ray_vs_local']:.2f}x "
        f"({out['ray_vs_local_excl_setup']:.2f}x excl. setup)",
        flush=True,
    )
    for engine in ("local", "ray"):
        subprocess.run(["rm", "-rf", str(tmp / f"out-{name}-{engine}")], check=True)
    return out


def bench_pretok(args, tmp: Path) -> dict:
    from tokenizers import Tokenizer

    from scripts.benchlib.pack_data_runs import make_pretokenized

    tokenizer = str(TOKENIZER if TOKENIZER.exists() else REPO / "data" / "tokenizer")
    vocab = Tokenizer.from_file(str(Path(tokenizer) / "tokenizer.json")).get_vocab_size()  # ids it can hold
    out = {}
    for kind in ("arrow", "parquet"):
        src = tmp / f"pretok.{kind}"
        make_pretokenized(src, args.tokens, vocab=vocab)
        out[kind] = compare(f"pretok {kind}", [str(src)], tokenizer, args, tmp)
        src.unlink()
    return out


def bench_text(args, tmp: Path) -> dict:
    from scripts.benchlib.pack_data_runs import make_copies

    require(SHARED / GSM8K, SHARED / CODEALPACA, TOKENIZER)
    inputs = [
        str(make_copies(SHARED / path, args.copies, tmp / f"{name}-x{args.copies}.jsonl"))
        for name, path in (("gsm8k", GSM8K), ("codealpaca", CODEALPACA))
    ]
    out = compare(f"text x{args.copies}", inputs, str(TOKENIZER), args, tmp)
    out["input_bytes"] = sum(Path(p).stat().st_size for p in inputs)
    return out


def bench_plan(args) -> dict:
    """The driver's plan step on synthetic lengths, as a 100B-token job would give it."""
    import numpy as np

    from pipeline.plan.rows import Pieces, apply_overlong, plan_rows
    from pipeline.tokenize.spill import Spill

    out = {}
    rng = np.random.default_rng(0)
    for mean in (250, 2056):
        n = int(args.plan_tokens) // mean
        lengths = (
            np.clip(rng.exponential(mean, n), 1, args.max_len).astype(np.int64)
            if mean == 250
            else rng.integers(16, 4097, n).astype(np.int64)
        )
        spill = Spill(Path("unused"), None, lengths, np.arange(n, dtype=np.int64), n, 0)
        t = time.perf_counter()
        pieces: Pieces = apply_overlong(spill, args.max_len, "truncate")
        plan = plan_rows(pieces, args.max_len, "ffd", 0, 32)
        seconds = time.perf_counter() - t
        key = f"{n}x{mean}"
        out[key] = {
            "examples": n,
            "mean_tokens": float(lengths.mean()),
            "tokens": int(lengths.sum()),
            "rows": plan.n_rows,
            "seconds": seconds,
        }
        print(f"[plan {n:,} examples, mean {lengths.mean():.0f} tokens] {seconds:.1f} s, {plan.n_rows:,} rows", flush=True)
        del spill, pieces, plan, lengths
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="pretok,text,plan", help="comma list of: pretok, text, plan")
    parser.add_argument("--workers", type=int, default=16, help="local --num-proc and the local Ray's CPUs")
    parser.add_argument("--tokens", type=int, default=1_000_000_000, help="pretok: tokens of each synthetic file")
    parser.add_argument("--copies", type=int, default=20, help="text: copies of each dataset's records")
    parser.add_argument("--plan-tokens", type=float, default=100e9, help="plan: tokens of the synthetic job")
    add_bench_args(parser, max_len=8192, json=(str, "write the results here"))
    args = parser.parse_args()
    if args.json:
        check_output(args.json, "--json")
    result: dict = {"machine": machine_summary(), "workers": args.workers, "max_len": args.max_len}
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
        parts = args.parts.split(",")
        if "pretok" in parts:
            result["pretok"] = bench_pretok(args, Path(tmp))
        if "text" in parts:
            result["text"] = bench_text(args, Path(tmp))
        if "plan" in parts:
            result["plan"] = bench_plan(args)
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
