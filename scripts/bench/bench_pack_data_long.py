"""pack-data on long instruction texts against its tokenizer's ceiling, and its peak memory as the
input grows (issue #20, part 5).

    python scripts/bench/bench_pack_data_long.py --mb 50,200 --json docs/results/bench_pack_data_long_2core.json

Input: data/sample/instructions.jsonl (mean ~250 tokens per example) replicated to each --mb size,
every copy's instruction prefixed with its number (no text of one copy repeats in another). For each tokenizer (data/tokenizer
and, where ../shared is here, Llama-2's) and size:
- pack-data: the whole job in a fresh process (`run_pack_data`, default --num-proc), tokens/s over the
  job without its setup phase, and peak RSS (the job's own VmHWM; the largest worker's, pages shared
  with the job included);
- the ceiling: the same tokenizer's `encode_batch_fast` over exactly the whole texts pack-data encodes,
  in batches of CEILING_BATCH texts whose ids are counted and dropped (one call over all the texts
  would keep tens of millions of Python ints alive, and the garbage collector's passes over them
  slow it down more the larger the input: not the tokenizer's speed), best of 3, in this process,
  its Rust thread pool on every core.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `scripts.benchlib`, pipeline, trainer
from pipeline.tokenize.tokenizer import load_tokenizer
from scripts.benchlib import LLAMA2, REPO, add_bench_args, check_output, machine_summary, shared_dir, write_json  # noqa: E402
from scripts.benchlib import pack_data_runs as bpd  # noqa: E402
from scripts.benchlib.pack_data_runs import replicate  # noqa: E402

CEILING_BATCH = 4096


def ceiling(texts: list[str], tokenizer) -> float:
    """encode_batch_fast tokens/s over `texts` in CEILING_BATCH batches, best of 3."""
    import time

    backend, best, tokens = tokenizer.backend_tokenizer, float("inf"), 0
    for _ in range(3):
        start, tokens = time.perf_counter(), 0
        for i in range(0, len(texts), CEILING_BATCH):
            tokens += sum(len(e.ids) for e in backend.encode_batch_fast(texts[i : i + CEILING_BATCH], add_special_tokens=False))
        best = min(best, time.perf_counter() - start)
    return tokens / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", default="50,200", help="input sizes in MB")
    add_bench_args(parser, max_len=8192, json=str)
    args = parser.parse_args()
    if args.json:
        check_output(args.json, "--json")
    tokenizers = {"data/tokenizer": REPO / "data" / "tokenizer"}
    if (shared_dir() / LLAMA2).is_dir():
        tokenizers["llama2"] = shared_dir() / LLAMA2
    results: dict = {"machine": machine_summary(), "runs": []}
    tmp = Path(tempfile.mkdtemp(prefix="bench-long-"))
    try:
        for mb in (int(x) for x in args.mb.split(",")):
            path = replicate(mb, tmp)
            for name, folder in tokenizers.items():
                stats = bpd.pack_in_child(
                    inputs=[str(path)], tokenizer=str(folder), max_len=args.max_len, out=str(tmp / "out"), overwrite=True
                )
                seconds = stats["times"]["total"] - stats["times"]["setup"]
                tokenizer = load_tokenizer(str(folder))
                texts = bpd.rendered_texts(path, tokenizer)
                ceiling_tokens_per_s = ceiling(texts, tokenizer)
                del texts
                run = {
                    "mb": mb,
                    "tokenizer": name,
                    "rows": stats.get("rows"),
                    "tokens": stats["tokens"],
                    "pack_s": seconds,
                    "pack_tokens_per_s": stats["tokens"] / seconds,
                    "ceiling_tokens_per_s": ceiling_tokens_per_s,
                    "ratio": stats["tokens"] / seconds / ceiling_tokens_per_s,
                    "peak_rss_mb": stats["maxrss_self_mb"],
                    "peak_rss_worker_mb": stats["maxrss_children_mb"],
                    "times": stats["times"],
                }
                results["runs"].append(run)
                print(
                    f"{mb:>4} MB {name:<15} {run['tokens'] / 1e6:6.1f}M tokens: pack-data "
                    f"{run['pack_tokens_per_s'] / 1e6:.2f}M tok/s = {run['ratio']:.0%} of encode_batch_fast "
                    f"({run['ceiling_tokens_per_s'] / 1e6:.2f}M); peak RSS {run['peak_rss_mb']:.0f} MB "
                    f"(+ worker {run['peak_rss_worker_mb']:.0f} MB)",
                    flush=True,
                )
                shutil.rmtree(tmp / "out", ignore_errors=True)
            path.unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
