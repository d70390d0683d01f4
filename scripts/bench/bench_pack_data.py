"""Benchmark pack-data end to end against the raw tokenizer and a TRL-style pipeline, same run.

    python scripts/bench/bench_pack_data.py                      # all parts, GSM8K + CodeAlpaca, llama2 tokenizer
    python scripts/bench/bench_pack_data.py --parts pretok --tokens 1000000000
    python scripts/bench/bench_pack_data.py --parts scale --copies 20

Parts:
- `text`: pack-data on ../shared/datasets (GSM8K question/answer, CodeAlpaca instruction/input/output),
  one run per dataset (so each baseline is timed on the same file), at --max-len 8192; vs (a) the raw
  batch throughput of the same tokenizer on exactly the whole texts pack-data encodes (the ceiling), and two
  TRL pipelines producing packed input_ids/labels from the same rendered prompt/response texts:
  (b1) "TRL-style, batched map": one batched `Dataset.map` tokenizing with `tokenizer(texts)` and
  building labels (prompt and response tokenized apart: the cheaper way, whose ids differ from
  the whole text's at the cut for SentencePiece-style tokenizers such as Llama-2's), + `trl.data_utils.pack_dataset(strategy="bfd")` + `save_to_disk`;
  (b2) "TRL SFTTrainer-style, per-example map as TRL does": the steps `trl.SFTTrainer` runs on a
  prompt/completion dataset (trl/trainer/sft_trainer.py, `_prepare_dataset`): a per-example `add_eos`
  map, a per-example (`batched=False`) tokenize map calling TRL's own `_tokenize` on the prompt and on
  prompt+completion and `common_prefix_length` for the completion mask, a per-example `build_labels`
  map (a Python loop over tokens), `select_columns` + `pack_dataset(strategy="bfd")`, then
  `save_to_disk` like (b1). The prompt/completion columns are rendered beforehand with one batched
  map (cheap; SFTTrainer users prepare them themselves).
  Also shown, not a target: pack-data's tokenizer engine alone (the same texts encoded by its
  worker processes, nothing else), to tell pack-data's own overhead from the engine's gain.
  Cold: every contender's first pass in a fresh process, timed after its imports and tokenizer load
  (pack-data: without its `setup` phase; numba's on-disk cache of compiled kernels is filled
  beforehand by a small untimed job, as after any first run of an installation). Warm: the best of REPEATS passes after it. Whole process:
  a fresh interpreter from start to exit, imports and tokenizer load included, as a user waits for it
  (pack-data's console script, the click command `pipeline.cli:pack_data`; the TRL pipelines' cold
  child processes). pack-data keeps nothing of the tokenizer between processes: every job loads it
  in-process (`pipeline.tokenize.tokenizer.load_tokenizer`) before it reads any
  row, so each cold or whole-process run is a first job with this tokenizer, as any user's run is.
- `scale`: the first job on a larger text set, where fixed costs (a worker pool's start, writing
  the manifest) weigh less than on the 2-4 s datasets themselves: each dataset's records --copies
  times over, every copy's first field prefixed with its number (so that no text repeats and no
  cache of encoded texts can help), as JSONL. Timed cold only: pack-data's first job in a fresh
  process, a fresh tokenizer's first encode_batch_fast (and its best of REPEATS later ones,
  in this process) and the TRL-style batched map pipeline, each in a fresh process after its
  imports, and as whole processes. The SFTTrainer-style pipeline is left out: at this size it would
  take minutes, and its ratio is the largest on the small sets.
- `pretok`: a synthetic pre-tokenized dataset of --tokens tokens, generated in a temp dir as an
  uncompressed Arrow IPC file (which pack-data gathers in place, no spill) and/or an uncompressed
  Parquet file (decoded and spilled first), each packed in a child process; reports tokens/s, the
  phases and the child's peak RSS per file type (its own, VmHWM; and the largest of its forked
  children's, pages shared with it included).

Every pack-data run goes through `pipeline.engines.job.run_pack_data` in a fresh child process (so imports
and peak RSS are its own), or, for the whole-process times, through the `pack-data` command
itself; per-phase times come from the job itself (setup, read_tokenize, plan, write, verify, total;
setup holds the tokenizer's load and, for text input, the start of the tokenizer worker processes).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `scripts.benchlib`, pipeline, trainer
from scripts.benchlib import (  # noqa: E402
    CODEALPACA,
    GSM8K,
    REPO,
    add_bench_args,
    best_of,
    check_output,
    machine_summary,
    require,
    write_json,
)
from scripts.benchlib.pack_data_runs import (  # noqa: E402
    SHARED,
    TOKENIZER,
    baseline_in_child,
    child_env,
    make_copies,
    make_pretokenized,
    pack_in_child,
    rendered_texts,
    trl_pipeline,
    trl_sft_pipeline,
)

DATASETS = [("gsm8k", SHARED / GSM8K), ("codealpaca", SHARED / CODEALPACA)]
RAW_APIS = ("tokenizer(texts)", "encode_batch", "encode_batch_fast")
REPEATS = 3  # warm measurements (raw tokenizer, engine, pack-data's warm runs): the best of this many


# the `pack-data` console script (pyproject's [project.scripts]: pipeline.cli:pack_data), run as
# the installed executable runs it, whether or not that executable is on PATH
PACK_DATA_MAIN = "import sys; sys.argv[0] = 'pack-data'; from pipeline.cli import pack_data; pack_data()"


def pack_data_process(path: Path, out: Path, max_len: int, num_proc: int | None) -> float:
    """Seconds of one whole `pack-data` process, as a user runs it: interpreter start, imports,
    tokenizer load, the job, and the exit."""
    argv = [
        str(path),
        "--tokenizer",
        str(TOKENIZER),
        "--max-len",
        str(max_len),
        "--out",
        str(out),
        "--overwrite",
        "--no-progress",
        *(["--num-proc", str(num_proc)] if num_proc else []),
    ]
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", PACK_DATA_MAIN, *argv], cwd=REPO, check=False, capture_output=True, text=True, env=child_env()
    )
    seconds = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"pack-data process failed:\n{proc.stderr[-3000:]}")
    return seconds


def job_config(args, path: Path, out: Path) -> dict:
    """The PackConfig fields of a benchmark job on `path`: the Llama-2 tokenizer, --max-len and
    --num-proc, output to `out`."""
    return {
        "inputs": [str(path)],
        "tokenizer": str(TOKENIZER),
        "max_len": args.max_len,
        "out": str(out),
        "overwrite": True,
        "num_proc": args.num_proc,
    }


def raw_tokenizer(texts: list[str], tokenizer, apis: tuple[str, ...] = RAW_APIS) -> dict:
    """Tokens/s of the tokenizer's batch APIs (those named in `apis`) on `texts`, best of REPEATS runs each."""
    backend = tokenizer.backend_tokenizer
    calls = {
        "tokenizer(texts)": lambda: tokenizer(texts, add_special_tokens=False)["input_ids"],
        "encode_batch": lambda: [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)],
        "encode_batch_fast": lambda: [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)],
    }
    out = {}
    for name in apis:
        best, ids = best_of(calls[name], REPEATS)
        n = sum(map(len, ids))
        out[name] = {"tokens": n, "seconds": best, "tokens_per_s": n / best}
    return out


def engine_alone(texts: list[str], tokenizer) -> dict:
    """Tokens/s of pack-data's tokenizer engine with none of pack-data's other work: the texts in
    TEXT_BATCH_ROWS pieces, each encoded (ids flattened to int32) by one of default_workers() worker
    processes, driven by as many threads (best of REPEATS; the workers are started beforehand, as
    pack-data starts them during its setup). Not the ceiling of the targets, which is the
    tokenizer's own batch API; shown to tell pack-data's overhead from the engine's gain."""
    from concurrent.futures import ThreadPoolExecutor

    from pipeline.tokenize.encode_pool import default_workers, encode_pool
    from pipeline.tokenize.tokenize_inputs import TEXT_BATCH_ROWS

    pieces = [texts[i : i + TEXT_BATCH_ROWS] for i in range(0, len(texts), TEXT_BATCH_ROWS)]
    n_workers = default_workers()
    pool = encode_pool(n_workers)
    pool.use(tokenizer.backend_tokenizer)
    with ThreadPoolExecutor(n_workers) as threads:
        best, n = best_of(lambda: sum(len(flat) for flat, _ in threads.map(pool.encode, pieces)), REPEATS)
    return {"tokens": n, "seconds": best, "tokens_per_s": n / best, "workers": n_workers}


def bench_text(args, tmp: Path) -> dict:
    from pipeline.tokenize.tokenizer import load_tokenizer

    require(*(path for _, path in DATASETS), TOKENIZER)
    tokenizer = load_tokenizer(str(TOKENIZER))
    # numba compiles pack-data's kernels once per installation into its on-disk cache; a first
    # process would time that (seconds) as well: one small job fills the cache, untimed
    for _, path in DATASETS:
        pack_in_child(**job_config(args, path, tmp / "out-compile"), limit=200)
    result: dict = {"datasets": {}}
    totals = {
        "pack_tokens": 0,
        "pack_s": 0.0,
        "warm_s": 0.0,
        "trl_s": 0.0,
        "sft_s": 0.0,
        "cold_raw_tokens": 0,
        "cold_raw_s": 0.0,
        "cold_trl_s": 0.0,
        "cold_sft_s": 0.0,
        "engine_tokens": 0,
        "engine_s": 0.0,
        "pack_process_s": 0.0,
        "trl_process_s": 0.0,
        "sft_process_s": 0.0,
    }
    raw_best: dict[str, list[float]] = {}
    for name, path in DATASETS:
        texts = rendered_texts(path, tokenizer)
        raw = raw_tokenizer(texts, tokenizer)
        engine = engine_alone(texts, tokenizer)
        config = job_config(args, path, tmp / f"out-{name}")
        stats = pack_in_child(repeat=1 + REPEATS, **config)  # a fresh process's first job, then warm ones
        trl = trl_pipeline(path, tokenizer, tmp, args.max_len, args.num_proc or 1)
        sft = trl_sft_pipeline(path, tokenizer, tmp, args.max_len, args.num_proc or 1)
        cold = {k: baseline_in_child(k, path, tmp, args.max_len) for k in ("raw", "trl", "sft")}
        process_s = pack_data_process(path, tmp / f"out-process-{name}", args.max_len, args.num_proc)
        totals["pack_process_s"] += process_s
        totals["trl_process_s"] += cold["trl"]["process_s"]
        totals["sft_process_s"] += cold["sft"]["process_s"]
        totals["cold_raw_tokens"] += cold["raw"]["tokens"]
        totals["cold_raw_s"] += cold["raw"]["seconds"]
        totals["cold_trl_s"] += cold["trl"]["seconds"]
        totals["cold_sft_s"] += cold["sft"]["seconds"]
        # pack-data's time without interpreter start-up and imports, which are the same for any tool
        pack_s = stats["times"]["total"] - stats["times"].get("setup", 0.0)
        # warm: the best of REPEATS runs after the first, like the raw tokenizer's best of REPEATS
        warm_s = min(w["times"]["total"] - w["times"].get("setup", 0.0) for w in stats["warm_runs"])
        totals["warm_s"] += warm_s
        totals["engine_tokens"] += engine["tokens"]
        totals["engine_s"] += engine["seconds"]
        result["datasets"][name] = {
            "texts": len(texts),
            "raw": raw,
            "engine": engine,
            "pack_data": stats,
            "pack_s_excl_setup": pack_s,
            "pack_process_s": process_s,
            "trl": trl,
            "trl_sft": sft,
            "cold_baselines": cold,
        }
        totals["pack_tokens"] += stats["tokens"]
        totals["pack_s"] += pack_s
        totals["trl_s"] += trl["seconds"]
        totals["sft_s"] += sft["seconds"]
        for api, r in raw.items():
            raw_best.setdefault(api, [0, 0.0])
            raw_best[api][0] += r["tokens"]
            raw_best[api][1] += r["seconds"]
    pack_rate = totals["pack_tokens"] / totals["pack_s"]
    raw_rates = {api: n / s for api, (n, s) in raw_best.items()}
    ceiling_api = max(raw_rates, key=raw_rates.get)
    cold_raw_rate = totals["cold_raw_tokens"] / totals["cold_raw_s"]
    result["summary"] = {
        "pack_tokens_per_s": pack_rate,
        "raw_tokens_per_s": raw_rates,
        "ceiling_api": ceiling_api,
        "pack_vs_ceiling": pack_rate / raw_rates[ceiling_api],
        "warm_pack_tokens_per_s": totals["pack_tokens"] / totals["warm_s"],
        "warm_pack_vs_ceiling": totals["pack_tokens"] / totals["warm_s"] / raw_rates[ceiling_api],
        **speedups("warm_", totals["trl_s"], totals["sft_s"], totals["warm_s"]),
        "engine_tokens_per_s": totals["engine_tokens"] / totals["engine_s"],
        "warm_pack_vs_engine": totals["pack_tokens"] / totals["warm_s"] / (totals["engine_tokens"] / totals["engine_s"]),
        "pack_s": totals["pack_s"],
        "trl_s": totals["trl_s"],
        "trl_sft_s": totals["sft_s"],
        **speedups("", totals["trl_s"], totals["sft_s"], totals["pack_s"]),
        # cold vs cold: every contender in a fresh process, first pass over the texts
        "cold_raw_tokens_per_s": cold_raw_rate,
        "cold_pack_vs_cold_raw": pack_rate / cold_raw_rate,
        "cold_trl_s": totals["cold_trl_s"],
        "cold_trl_sft_s": totals["cold_sft_s"],
        **speedups("cold_", totals["cold_trl_s"], totals["cold_sft_s"], totals["pack_s"]),
        # whole processes as a user runs them: imports, tokenizer load and exit included
        "process_pack_s": totals["pack_process_s"],
        "process_trl_s": totals["trl_process_s"],
        "process_trl_sft_s": totals["sft_process_s"],
        **speedups("process_", totals["trl_process_s"], totals["sft_process_s"], totals["pack_process_s"]),
    }
    return result


def speedups(prefix: str, trl_s: float, sft_s: float, pack_s: float) -> dict[str, float]:
    """`{prefix}speedup_vs_trl` and `{prefix}speedup_vs_trl_sft`: the two TRL pipelines' seconds over pack-data's."""
    return {f"{prefix}speedup_vs_trl": trl_s / pack_s, f"{prefix}speedup_vs_trl_sft": sft_s / pack_s}


def bench_scale(args, tmp: Path) -> dict:
    """The first job on each dataset --copies times over, against the cold raw tokenizer and the
    cold TRL-style batched map pipeline (see the module docstring)."""
    from pipeline.tokenize.tokenizer import load_tokenizer

    require(*(path for _, path in DATASETS), TOKENIZER)
    tokenizer = load_tokenizer(str(TOKENIZER))
    out: dict = {"copies": args.copies, "datasets": {}}
    for name, source in DATASETS:
        path = make_copies(source, args.copies, tmp / f"{name}-x{args.copies}.jsonl")
        pack_in_child(**job_config(args, path, tmp / "out-compile"), limit=200)  # numba's cache, untimed
        config = job_config(args, path, tmp / f"out-{name}")
        stats = pack_in_child(**config)  # a fresh process's first job
        texts = rendered_texts(path, tokenizer)
        raw = raw_tokenizer(texts, tokenizer, apis=("encode_batch_fast",))["encode_batch_fast"]
        cold = {k: baseline_in_child(k, path, tmp, args.max_len) for k in ("raw", "trl")}
        process_s = pack_data_process(path, tmp / f"out-process-{name}", args.max_len, args.num_proc)
        pack_s = stats["times"]["total"] - stats["times"]["setup"]
        out["datasets"][name] = {
            "texts": len(texts),
            "tokens": stats["tokens"],
            "pack_data": stats,
            "pack_s_excl_setup": pack_s,
            "pack_process_s": process_s,
            "raw_warm": raw,
            "cold_baselines": cold,
            "vs_cold_raw": stats["tokens"] / pack_s / (cold["raw"]["tokens"] / cold["raw"]["seconds"]),
            "vs_warm_raw": stats["tokens"] / pack_s / raw["tokens_per_s"],
            "speedup_vs_trl": cold["trl"]["seconds"] / pack_s,
            "process_speedup_vs_trl": cold["trl"]["process_s"] / process_s,
        }
        path.unlink()
    return out


def bench_pretok(args, tmp: Path) -> dict:
    out: dict = {}
    for kind in args.pretok_format.split(","):
        src = tmp / f"pretok.{kind}"
        t = time.perf_counter()
        n = make_pretokenized(src, args.tokens)
        gen_s = time.perf_counter() - t
        stats = pack_in_child(
            inputs=[str(src)],
            tokenizer=str(TOKENIZER if TOKENIZER.exists() else REPO / "data" / "tokenizer"),
            max_len=args.max_len,
            out=str(tmp / "out-pretok"),
            overwrite=True,
            batch_rows=args.pretok_batch_rows,
        )
        pack_s = stats["times"]["total"] - stats["times"].get("setup", 0.0)
        out[kind] = {
            "tokens": n,
            "generate_s": gen_s,
            "input_bytes": src.stat().st_size,
            "pack_data": stats,
            "pack_s_excl_setup": pack_s,
            "tokens_per_s": n / pack_s,
            "tokens_per_s_incl_setup": n / stats["times"]["total"],
        }
        src.unlink()
        shutil.rmtree(tmp / "out-pretok", ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="text,pretok", help="comma list of: text, scale, pretok")
    add_bench_args(parser, max_len=8192)
    parser.add_argument(
        "--num-proc", type=int, default=None, help="pack-data --num-proc (default: its own) and datasets.map num_proc (default: none)"
    )
    parser.add_argument("--copies", type=int, default=20, help="scale: how many copies of each dataset")
    parser.add_argument("--tokens", type=int, default=200_000_000, help="size of the synthetic pre-tokenized set")
    parser.add_argument("--pretok-batch-rows", type=int, default=4096)
    parser.add_argument(
        "--pretok-format",
        default="arrow,parquet",
        help="comma list of file types of the synthetic set: arrow (uncompressed IPC file, "
        "gathered in place), parquet (uncompressed, decoded and spilled)",
    )
    parser.add_argument("--tmp", default=None, help="folder for temporary data (default: system temp)")
    add_bench_args(parser, json=(str, "also write the full results here"))
    args = parser.parse_args()
    if args.json:
        check_output(args.json, "--json")
    tmp = Path(tempfile.mkdtemp(prefix="bench-pack-data-", dir=args.tmp))
    results: dict = {"machine": machine_summary(), "args": vars(args)}
    try:
        parts = args.parts.split(",")
        if "text" in parts:
            results["text"] = bench_text(args, tmp)
            s = results["text"]["summary"]
            print(
                f"[text] pack-data {s['pack_tokens_per_s'] / 1e6:.2f}M tok/s ({s['pack_s']:.2f}s excl. setup); "
                + ", ".join(f"raw {k} {v / 1e6:.2f}M tok/s" for k, v in s["raw_tokens_per_s"].items())
                + f"; pack-data = {s['pack_vs_ceiling']:.0%} of {s['ceiling_api']}"
            )
            print(
                f"[text] TRL-style, batched map {s['trl_s']:.2f}s -> pack-data {s['speedup_vs_trl']:.1f}x faster; "
                f"TRL SFTTrainer-style, per-example map as TRL does {s['trl_sft_s']:.2f}s -> pack-data "
                f"{s['speedup_vs_trl_sft']:.1f}x faster"
            )
            print(
                f"[text] cold vs cold (each contender in a fresh process, first pass over the texts): pack-data "
                f"{s['pack_tokens_per_s'] / 1e6:.2f}M tok/s = {s['cold_pack_vs_cold_raw']:.0%} of a fresh tokenizer's "
                f"first encode_batch_fast ({s['cold_raw_tokens_per_s'] / 1e6:.2f}M tok/s); TRL-style batched map "
                f"{s['cold_trl_s']:.2f}s -> {s['cold_speedup_vs_trl']:.1f}x; TRL SFTTrainer-style "
                f"{s['cold_trl_sft_s']:.2f}s -> {s['cold_speedup_vs_trl_sft']:.1f}x"
            )
            print(
                f"[text] whole process (fresh interpreter to exit: imports, tokenizer load, job; one per dataset): "
                f"pack-data {s['process_pack_s']:.2f}s; TRL-style batched map {s['process_trl_s']:.2f}s -> "
                f"{s['process_speedup_vs_trl']:.1f}x; TRL SFTTrainer-style {s['process_trl_sft_s']:.2f}s -> "
                f"{s['process_speedup_vs_trl_sft']:.1f}x"
            )
            print(
                f"[text] warm (best of {REPEATS} later runs in the same process): pack-data {s['warm_pack_tokens_per_s'] / 1e6:.2f}M tok/s "
                f"= {s['warm_pack_vs_ceiling']:.0%} of {s['ceiling_api']}, {s['warm_speedup_vs_trl']:.1f}x TRL-style "
                f"batched map, {s['warm_speedup_vs_trl_sft']:.1f}x TRL SFTTrainer-style per-example map"
            )
            print(
                f"[text] pack-data's tokenizer engine alone ({results['text']['datasets']['gsm8k']['engine']['workers']} "
                f"worker processes, no reading/rendering/spill/plan/write): {s['engine_tokens_per_s'] / 1e6:.2f}M tok/s; "
                f"warm pack-data = {s['warm_pack_vs_engine']:.0%} of it"
            )
            for name, d in results["text"]["datasets"].items():
                ph = {k: round(v, 2) for k, v in d["pack_data"]["times"].items() if not k.startswith("_")}
                print(
                    f"  {name}: {d['pack_data']['tokens']} tokens, {d['pack_data']['rows']} rows, "
                    f"efficiency {d['pack_data']['efficiency']:.2%}, pack-data phases {ph}; "
                    f"TRL-style, batched map {d['trl']['seconds']:.2f}s "
                    f"{ ({k: round(v, 2) for k, v in d['trl']['phases'].items()}) }; TRL SFTTrainer-style, per-example "
                    f"map {d['trl_sft']['seconds']:.2f}s { ({k: round(v, 2) for k, v in d['trl_sft']['phases'].items()}) }"
                )
        if "scale" in parts:
            results["scale"] = bench_scale(args, tmp)
            for name, d in results["scale"]["datasets"].items():
                cold = d["cold_baselines"]
                ph = {k: round(v, 2) for k, v in d["pack_data"]["times"].items() if not k.startswith("_")}
                print(
                    f"[scale {name} x{args.copies}] {d['texts']} texts, {d['tokens']} tokens, first job: pack-data "
                    f"{d['tokens'] / d['pack_s_excl_setup'] / 1e6:.2f}M tok/s excl. setup = {d['vs_cold_raw']:.0%} of a "
                    f"fresh tokenizer's first encode_batch_fast ({cold['raw']['tokens'] / cold['raw']['seconds'] / 1e6:.2f}M "
                    f"tok/s), {d['vs_warm_raw']:.0%} of its best later one ({d['raw_warm']['tokens_per_s'] / 1e6:.2f}M); "
                    f"TRL-style batched map {cold['trl']['seconds']:.2f}s -> {d['speedup_vs_trl']:.1f}x; whole processes "
                    f"{d['pack_process_s']:.2f}s vs {cold['trl']['process_s']:.2f}s -> {d['process_speedup_vs_trl']:.1f}x; "
                    f"pack-data peak RSS {d['pack_data']['maxrss_self_mb']:.0f} MB (its children: "
                    f"{d['pack_data']['maxrss_children_mb']:.0f} MB), phases {ph}"
                )
        if "pretok" in parts:
            results["pretok"] = bench_pretok(args, tmp)
            for kind, p in results["pretok"].items():
                ph = {k: round(v, 2) for k, v in p["pack_data"]["times"].items() if not k.startswith("_")}
                print(
                    f"[pretok {kind}] {p['tokens']} tokens ({p['input_bytes'] / 1e9:.2f} GB input): "
                    f"{p['tokens_per_s'] / 1e6:.1f}M tok/s excl. setup "
                    f"({p['tokens_per_s_incl_setup'] / 1e6:.1f}M incl.), peak RSS "
                    f"{p['pack_data']['maxrss_self_mb']:.0f} MB (its children: "
                    f"{p['pack_data']['maxrss_children_mb']:.0f} MB); phases {ph}"
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
