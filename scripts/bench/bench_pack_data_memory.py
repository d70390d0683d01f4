#!/usr/bin/env python
"""Where pack-data's peak RSS goes as its input grows (issue #20, part 5): anonymous memory
(RssAnon) against pages of memory-mapped files (RssFile, page cache the kernel can take back),
before and during the write phase.

    python scripts/bench/bench_pack_data_memory.py --mb 50,200

Each size: data/sample/instructions.jsonl replicated to MB megabytes (`bench_pack_data_long.replicate`),
packed by `run_pack_data` in a fresh process of its own (default --num-proc, --max-len 8192; a job
run after another in one process would inherit what the allocator kept) while a thread reads
/proc/self/status every 50 ms. "read" is everything up to the end of the read_tokenize phase, "write"
the rest (plan, write, verify), split by the job's own phase times. Worker processes are not counted.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `scripts.benchlib`, pipeline, trainer
from pipeline.engines.job import PackConfig, run_pack_data
from scripts.benchlib import LLAMA2, REPO, shared_dir  # noqa: E402
from scripts.benchlib.pack_data_runs import replicate  # noqa: E402

FIELDS = ("RssAnon", "RssFile")


def status_mb() -> dict[str, float]:
    """RssAnon and RssFile of this process, MB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in FIELDS:
                out[key] = int(line.split()[1]) / 1024
    return out


def measure(path: Path, tokenizer: str, out: Path) -> dict:
    """Peak RssAnon / RssFile before and during the write phase of one job."""
    samples: list[tuple[float, dict[str, float]]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append((time.perf_counter(), status_mb()))
            time.sleep(0.05)

    stats: dict = {}
    thread = threading.Thread(target=sample, daemon=True)
    start = time.perf_counter()
    thread.start()
    run_pack_data(
        PackConfig(inputs=[str(path)], tokenizer=tokenizer, max_len=8192, out=str(out), overwrite=True, progress=False), stats=stats
    )
    done.set()
    thread.join()
    split = start + stats["times"]["setup"] + stats["times"]["read_tokenize"]
    result = {"tokens": stats["tokens"], "shards": len(list(out.glob("shard-*.arrow")))}
    for phase, keep in (("read", lambda t: t <= split), ("write", lambda t: t > split)):
        for key in FIELDS:
            result[f"{phase}_{key}_mb"] = round(max((s[key] for t, s in samples if keep(t)), default=0.0))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", default="50,200", help="input sizes in MB")
    parser.add_argument("--tokenizer", default=None, help="default ../shared's Llama-2, else data/tokenizer")
    args = parser.parse_args()
    sizes = args.mb.split(",")
    if len(sizes) > 1:  # one fresh process per size
        for mb in sizes:
            subprocess.run([sys.executable, __file__, "--mb", mb] + (["--tokenizer", args.tokenizer] if args.tokenizer else []), check=True)
        return
    tokenizer = args.tokenizer or str(shared_dir() / LLAMA2 if (shared_dir() / LLAMA2).is_dir() else REPO / "data" / "tokenizer")
    tmp = Path(tempfile.mkdtemp(prefix="bench-memory-"))
    try:
        for mb in (int(x) for x in args.mb.split(",")):
            path = replicate(mb, tmp)
            print(json.dumps({"mb": mb, "tokenizer": tokenizer, **measure(path, tokenizer, tmp / "out")}), flush=True)
            path.unlink()
            shutil.rmtree(tmp / "out", ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
