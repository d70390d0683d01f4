"""Whole `pack-data` processes as a user waits for them, this checkout against another, same run;
and a `pack-train` that refuses before importing torch (the answer to a mistake: `--dtype fp8` on
the CPU), which the tests check happens before torch is imported, and this script times.

    python scripts/bench/bench_startup.py                                  # this checkout alone
    python scripts/bench/bench_startup.py --other ../old-checkout --json docs/results/bench_startup_2core.json

Each run is a fresh interpreter from start to exit (imports, tokenizer load, the job, exit) running
a checkout's own `pack-data` console script (the entry point its pyproject.toml names), with that
checkout first on PYTHONPATH. Jobs: the README's sample job (data/sample with data/tokenizer) and,
where ../shared is here, GSM8K with the Llama-2 tokenizer, at --max-len 8192.

Every run gets a fresh empty XDG_CACHE_HOME (a first job, as on a new machine: no cache of any tool
helps); `--warm-cache` also times each checkout with one cache folder kept across its runs (for
code that caches its tokenizer there). The runs of the variants alternate, after untimed warm-up
runs (numba's kernel cache filled, files in the OS page cache), and the script checks that every
variant wrote the same shard bytes (sha256 over the shard files).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `scripts.benchlib`, pipeline, trainer
from scripts.benchlib import GSM8K, LLAMA2, REPO, add_bench_args, check_output, cpu_model, machine_summary, shared_dir, write_json  # noqa: E402


def entry_point(checkout: Path, command: str = "pack-data") -> str:
    """Python code that runs `checkout`'s console script `command` as its installed executable would."""
    scripts = tomllib.loads((checkout / "pyproject.toml").read_text())["project"]["scripts"]
    module, function = scripts[command].split(":")
    return f"import sys; sys.argv[0] = '{command}'; from {module} import {function}; sys.exit({function}())"


def refusal_once(checkout: Path, packed: Path, run: Path) -> float:
    """Seconds of one whole `pack-train` process of `checkout` that refuses `--dtype fp8` on the CPU
    (before torch is imported); exits if it did not refuse so."""
    argv = ["--data", str(packed), "--model", "tiny", "--out", str(run), "--dtype", "fp8", "--device", "cpu"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-P", "-c", entry_point(checkout, "pack-train"), *argv],
        cwd=run.parent,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    seconds = time.perf_counter() - t0
    if proc.returncode != 1 or "--dtype fp8 needs an NVIDIA GPU" not in proc.stderr or run.exists():
        raise SystemExit(f"pack-train of {checkout} did not refuse --dtype fp8 on the CPU:\n{proc.stderr[-3000:]}")
    return seconds


def jobs() -> dict[str, tuple[Path, Path]]:
    """Name -> (input, tokenizer folder)."""
    found = {"sample": (REPO / "data" / "sample" / "instructions.jsonl", REPO / "data" / "tokenizer")}
    shared = shared_dir()
    if (shared / GSM8K).is_file() and (shared / LLAMA2).is_dir():
        found["gsm8k"] = (shared / GSM8K, shared / LLAMA2)
    return found


def run_once(checkout: Path, data: Path, tokenizer: Path, out: Path, cache: Path) -> float:
    """Seconds of one whole pack-data process of `checkout`."""
    argv = [str(data), "--tokenizer", str(tokenizer), "--max-len", "8192", "--out", str(out), "--overwrite", "--no-progress"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")])),
        "XDG_CACHE_HOME": str(cache),
    }
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-P", "-c", entry_point(checkout), *argv], cwd=out.parent, env=env, capture_output=True, text=True, check=False
    )
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"pack-data of {checkout} failed:\n{proc.stderr[-3000:]}")
    return seconds


def shard_digest(out: Path) -> str:
    """sha256 over the shard files of a packed folder, in name order."""
    digest = hashlib.sha256()
    for path in sorted(out.glob("*.arrow")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", type=Path, help="another checkout (a folder with pyproject.toml and pipeline/)")
    parser.add_argument("--warm-cache", action="store_true", help="also time runs that keep their XDG cache")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per variant and job")
    add_bench_args(parser, warmup=(1, "untimed runs per variant and job first"), json=(str, "write the results here"))
    args = parser.parse_args()
    if args.json:
        check_output(args.json, "--json")

    checkouts = {"this": REPO, **({"other": args.other.resolve()} if args.other else {})}
    variants = [(name, path, False) for name, path in checkouts.items()]
    if args.warm_cache:
        variants += [(f"{name}, cache kept", path, True) for name, path in checkouts.items()]
    libraries = {name: metadata.version(name) for name in ("transformers", "tokenizers", "numba", "pyarrow")}
    results: dict = {"machine": f"{machine_summary()}; {cpu_model()}", "libraries": libraries, "runs": {}, "digests": {}}
    print(results["machine"], libraries)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        kept = {name: tmp / f"cache-{i}" for i, (name, _, keep) in enumerate(variants) if keep}
        for job, (data, tokenizer) in jobs().items():
            times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
            for k in range(args.warmup + args.runs):
                for name, path, keep in variants:
                    out = tmp / "out" / f"{job}-{name}"
                    out.parent.mkdir(exist_ok=True)
                    cache = kept[name] if keep else Path(tempfile.mkdtemp(dir=tmp, prefix="cache-"))
                    seconds = run_once(path, data, tokenizer, out, cache)
                    if k >= args.warmup:
                        times[name].append(seconds)
            digests = {name: shard_digest(tmp / "out" / f"{job}-{name}") for name, _, _ in variants}
            if len(set(digests.values())) != 1:
                raise SystemExit(f"{job}: the variants wrote different shards: {digests}")
            results["runs"][job] = times
            results["digests"][job] = next(iter(digests.values()))
            for name, secs in times.items():
                print(f"{job:7s} {name:18s} median {statistics.median(secs):6.2f} s  runs " + ", ".join(f"{s:.2f}" for s in secs))
            print(f"{job:7s} shards sha256 {results['digests'][job][:16]}... (same for every variant)")
        packed = tmp / "out" / "sample-this"
        results["pack_train_refusal"] = {}
        for name, path in checkouts.items():
            secs = [refusal_once(path, packed, tmp / "refused-run") for _ in range(args.warmup + args.runs)]
            results["pack_train_refusal"][name] = secs[args.warmup :]
            print(
                f"pack-train refusal {name:7s} median {statistics.median(secs[args.warmup :]):6.2f} s  runs "
                + ", ".join(f"{s:.2f}" for s in secs[args.warmup :])
            )
    results["checkouts"] = {name: str(path) for name, path in checkouts.items()}
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
