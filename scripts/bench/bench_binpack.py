"""Benchmark the bin-packing planner against TRL's and Axolotl's packers on real lengths.

Lengths are resampled (seeded, with replacement) from CodeAlpaca tokenized with the Llama-2
tokenizer (instruction + input + output, BOS + EOS), or from a seeded lognormal when the shared
data (`$SHARED`, else `../shared`) is absent.
For every (n, max_len) it reports per strategy: seconds (best of --repeat, numba compile reported
separately), sequences/s, bins, the lower bound ceil(sum/max_len), bins/bound, efficiency
tokens/(bins*max_len) and the planner's peak extra memory (RSS high-water mark over the RSS before
the call, reset through /proc/self/clear_refs; includes the 8-byte-per-example output array).

    python scripts/bench/bench_binpack.py            # full run: 1M and 10M at 8192 and 2048 (minutes)
    python scripts/bench/bench_binpack.py --quick    # 20k and 100k examples (about a minute)
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

# a fresh numba cache, so the compile time printed is a real cold compile
os.environ.setdefault("NUMBA_CACHE_DIR", tempfile.mkdtemp(prefix="bench-binpack-numba-"))

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `scripts.benchlib`, pipeline, trainer
from pipeline.plan.binpack import STRATEGIES, assign_bins  # noqa: E402
from scripts.benchlib import (  # noqa: E402
    CODEALPACA,
    LLAMA2,
    best_of,
    cpu_model,
    fix_malloc,
    read_records,
    reset_rss_peak,
    rss_peak_extra_mb,
    shared_dir,
    timed,
)

# ------------------------------------------------------------------------------------ lengths


def base_lengths() -> tuple[np.ndarray, str]:
    """Token counts of the real dataset, or a seeded lognormal stand-in."""
    data, tokenizer = shared_dir() / CODEALPACA, shared_dir() / LLAMA2 / "tokenizer.json"
    if data.exists() and tokenizer.exists():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer))
        rows = read_records(data)
        texts = [f"{r['instruction']}\n{r.get('input', '')}\n{r['output']}" for r in rows]
        enc = tok.encode_batch(texts, add_special_tokens=True)  # BOS
        lengths = np.array([len(e.ids) + 1 for e in enc], dtype=np.int64)  # + EOS
        return lengths, f"CodeAlpaca ({len(rows)} examples) tokenized with llama2"
    rng = np.random.default_rng(1234)
    lengths = np.maximum(rng.lognormal(4.8, 0.6, 20_000).astype(np.int64), 1)
    return lengths, f"seeded lognormal(4.8, 0.6) stand-in ({data} or {tokenizer} absent)"


# ------------------------------------------------------------------------------------ runners


def run_ours(strategy: str, lengths: np.ndarray, max_len: int, repeat: int) -> dict:
    """Best of `repeat` plans; peak extra memory of the first."""

    def plan() -> np.ndarray:
        return assign_bins(lengths, max_len, strategy, seed=0)

    base = reset_rss_peak()
    seconds, bins = timed(plan)
    mem = rss_peak_extra_mb(base)
    n_bins = int(bins.max()) + 1
    del bins
    if repeat > 1:
        seconds = min(seconds, best_of(plan, repeat - 1)[0])
    return {"seconds": seconds, "bins": n_bins, "mem_mb": mem}


def trl_dataset(lengths: np.ndarray):
    """A `datasets.Dataset` with an `input_ids` list column of these lengths (zeros as tokens)."""
    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable

    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = pa.array(np.zeros(int(offsets[-1]), np.int32))
    column = pa.LargeListArray.from_arrays(pa.array(offsets), values)
    return datasets.Dataset(InMemoryTable(pa.table({"input_ids": column})))


def run_trl(lengths: np.ndarray, max_len: int) -> dict:
    import datasets
    import pyarrow.compute as pc
    from trl.data_utils import pack_dataset

    datasets.disable_progress_bars()
    ds = trl_dataset(lengths)  # not timed
    base = reset_rss_peak()
    dt, packed = timed(lambda: pack_dataset(ds, max_len, strategy="bfd"))  # TRL defaults otherwise
    mem = rss_peak_extra_mb(base)
    col = packed.data.column("input_ids")
    tokens = int(pc.sum(pc.list_value_length(col)).as_py())
    assert tokens == int(lengths.sum()), "TRL dropped tokens"
    return {"seconds": dt, "bins": len(packed), "mem_mb": mem}


def run_axolotl(lengths: np.ndarray, max_len: int) -> dict:
    from axolotl.utils.samplers.multipack import pack_group, pack_parallel

    lens32 = lengths.astype(np.int32)
    pack_group(lens32[:64], 0, max_len, 64, 200, True)  # compile its numba kernel before timing
    # Axolotl's trainer defaults: sample_packing_group_size=100_000, sample_packing_bin_size=200;
    # num_processes left to pack_parallel (min(n // group_size, cpu_count, 16) worker processes)
    dt, packed = timed(lambda: pack_parallel(lens32, bin_capacity=max_len, group_size=100_000, bin_size=200))
    placed = sum(len(b) for b in packed)
    assert placed == lengths.size, f"Axolotl placed {placed} of {lengths.size} examples"
    return {"seconds": dt, "bins": len(packed), "mem_mb": None}


def axolotl_available() -> str | None:
    try:
        from axolotl.utils.samplers.multipack import pack_parallel  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not measured"
        return f"{type(exc).__name__}: {exc}"
    return None


def trl_available() -> str | None:
    try:
        from trl.data_utils import pack_dataset  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None


# ------------------------------------------------------------------------------------ main


def fmt_row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="20k and 100k examples, TRL on 20k only")
    ap.add_argument("--sizes", default=None, help="comma-separated example counts (default 1M,10M)")
    ap.add_argument("--max-lens", default="8192,2048")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per strategy (best is kept)")
    ap.add_argument("--trl-max-n", type=int, default=1_000_000, help="largest n given to TRL")
    ap.add_argument("--axolotl-max-n", type=int, default=10_000_000, help="largest n for Axolotl")
    ap.add_argument("--no-baselines", action="store_true")
    args = ap.parse_args()
    if args.quick:
        sizes = [20_000, 100_000]
        args.trl_max_n = min(args.trl_max_n, 20_000)
        args.axolotl_max_n = min(args.axolotl_max_n, 100_000)
        args.repeat = min(args.repeat, 2)
    else:
        sizes = [1_000_000, 10_000_000]
    if args.sizes:
        sizes = [int(float(s)) for s in args.sizes.split(",")]
    max_lens = [int(s) for s in args.max_lens.split(",")]
    fix_malloc()

    print(f"command: python {' '.join(sys.argv)}")
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, load average at start {os.getloadavg()}")
    import numba

    print(f"numpy {np.__version__}, numba {numba.__version__}, python {platform.python_version()}")

    base, source = base_lengths()
    print(f"lengths: {source}: mean {base.mean():.1f}, median {np.median(base):.0f}, max {base.max()}")

    # cold numba compile of every strategy (int64 lengths), reported apart from the timings
    tiny = np.array([3, 5, 2, 7, 1], dtype=np.int64)
    print("numba compile (first call, cold cache):", end="")
    for s in STRATEGIES:
        t0 = time.perf_counter()
        assign_bins(tiny, 8, s)
        print(f" {s} {time.perf_counter() - t0:.2f}s", end="")
    print()

    trl_missing = None if args.no_baselines else trl_available()
    axo_missing = None if args.no_baselines else axolotl_available()
    if trl_missing:
        print(f"TRL not measured: {trl_missing}")
    if axo_missing:
        print(f"Axolotl not measured: {axo_missing}")

    header = ["n", "max_len", "method", "seconds", "seq/s", "bins", "lower", "bins/lower"]
    header += ["effic.", "peak MB", "B/ex"]
    results = []
    rng = np.random.default_rng(0)
    for n in sizes:
        lengths_n = base[rng.integers(0, base.size, n)]
        for max_len in max_lens:
            lengths = np.minimum(lengths_n, max_len)  # overlong policy: clip
            total = int(lengths.sum())
            lower = -(-total // max_len)
            rows = []
            for s in STRATEGIES:
                rows.append((s, run_ours(s, lengths, max_len, args.repeat)))
            if not args.no_baselines and not trl_missing and n <= args.trl_max_n:
                rows.append(("trl pack_dataset bfd", run_trl(lengths, max_len)))
            if not args.no_baselines and not axo_missing and n <= args.axolotl_max_n:
                rows.append(("axolotl pack_parallel", run_axolotl(lengths, max_len)))
            for name, r in rows:
                r.update(n=n, max_len=max_len, method=name, lower=lower, tokens=total)
                results.append(r)
            print(f"  done n={n:,} max_len={max_len} (load {os.getloadavg()[0]:.2f})", flush=True)

    widths = [11, 7, 22, 8, 12, 10, 10, 10, 7, 8, 6]
    print()
    print(fmt_row(header, widths))
    for r in results:
        mem = "n/a" if r["mem_mb"] is None else f"{r['mem_mb']:.1f}"
        bpe = "n/a" if r["mem_mb"] is None else f"{r['mem_mb'] * 2**20 / r['n']:.1f}"
        cells = [
            f"{r['n']:,}",
            str(r["max_len"]),
            r["method"],
            f"{r['seconds']:.3f}",
            f"{r['n'] / r['seconds']:,.0f}",
            f"{r['bins']:,}",
            f"{r['lower']:,}",
            f"{r['bins'] / r['lower']:.5f}",
            f"{r['tokens'] / (r['bins'] * r['max_len']):.4f}",
            mem,
            bpe,
        ]
        print(fmt_row(cells, widths))

    # speed of ffd against each baseline: same n where the baseline ran at that n, otherwise
    # against the baseline's largest n (sequences per second), labelled as such
    print()
    baselines = ("trl pack_dataset bfd", "axolotl pack_parallel")
    for ours in results:
        if ours["method"] != "ffd":
            continue
        for name in baselines:
            theirs = [r for r in results if r["method"] == name and r["max_len"] == ours["max_len"]]
            if not theirs:
                continue
            same = [r for r in theirs if r["n"] == ours["n"]]
            r = same[0] if same else max(theirs, key=lambda r: r["n"])
            ratio = (ours["n"] / ours["seconds"]) / (r["n"] / r["seconds"])
            note = "" if same else f" (baseline measured on n={r['n']:,} only)"
            print(f"ffd vs {name}, n={ours['n']:,}, max_len={ours['max_len']}: {ratio:,.0f}x the sequences/s{note}")
    print(f"load average at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
