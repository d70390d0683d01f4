"""Long examples, where attention is a large share of the work: pack-train's attention backends
(`fa4`, `flash_attn`, `torch`, `flex`, `cudnn`) on the same packed rows, same run (issue 20, part 4).

    python scripts/bench/bench_long.py --device cuda --model llama-1b --compile --json bench_long_h100.json
    python scripts/bench/bench_long.py --device cpu --model tiny --examples 40 --min-len 64 --max-example-len 128 \
        --max-len 256 --steps 2 --warmup 1 --backends sdpa     # a CPU smoke run

Data: --examples synthetic pre-tokenized examples with lengths uniform in [--min-len,
--max-example-len] (default 4096-8192 tokens; random ids of the Llama-2 tokenizer in ../shared, else of
data/tokenizer; loss on every token but the first), packed once by `pack-data --strategy ffd --max-len` (default 16384: two to
four examples per row). Each backend then trains the same model from the same seed on the same rows
through `trainer.run.loop.train` (what `pack-train` runs; `scripts.benchlib.train_runs.run_packed_pack_train`: warmup
steps, then the timed ones, read back from metrics.jsonl), --tokens-per-step of whole rows per step
(default: one row). Reported per backend: tokens/s, step time, MFU and TFLOP/s (model FLOPs, causal
attention included: `pipeline.report.flops`), attention's share of the FLOPs, peak memory and the final loss.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `scripts.benchlib`, pipeline, trainer
from scripts.benchlib import (  # noqa: E402
    AUTO_DEVICE,
    LLAMA2,
    REPO,
    add_bench_args,
    check_output,
    device_name,
    machine_summary,
    model_config,
    resolve_device,
    shared_dir,
    write_json,
)
from scripts.benchlib.train_results import H100_BF16_TFLOPS, PathResult, flop_shape  # noqa: E402
from scripts.benchlib.train_runs import PACKED_RUN_DEFAULTS, run_packed_pack_train  # noqa: E402


def make_examples(path: Path, n: int, low: int, high: int, seed: int, vocab: int = 32000) -> np.ndarray:
    """Write n examples of `input_ids` (lengths uniform in [low, high]) as an Arrow IPC file."""
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    lens = rng.integers(low, high + 1, n)
    values = rng.integers(3, vocab, int(lens.sum()), dtype=np.int32)
    offsets = np.concatenate(([0], np.cumsum(lens))).astype(np.int32)
    table = pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))})
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table)
    return lens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_args(p, device=AUTO_DEVICE, model="llama-1b")
    p.add_argument("--backends", default="fa4,flash_attn,torch,flex")
    p.add_argument("--examples", type=int, default=400)
    p.add_argument("--min-len", type=int, default=4096)
    p.add_argument("--max-example-len", type=int, default=8192)
    add_bench_args(p, max_len=(16384, "pack-data --max-len (row length)"))
    p.add_argument("--tokens-per-step", type=int, default=None, help="default: --max-len")
    add_bench_args(p, steps=20, warmup=5)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--compile", action="store_true")
    add_bench_args(p, lora_r=0)
    p.add_argument(
        "--grad-checkpointing",
        nargs="?",
        const=1,
        default=0,
        type=int,
        metavar="N",
        help="recompute every Nth decoder layer (alone: every layer)",
    )
    add_bench_args(p, peak_tflops=H100_BF16_TFLOPS, seed=0, json=None)
    args = p.parse_args()
    if args.json:
        check_output(args.json, "--json")
    device = resolve_device(args.device)
    work = Path(tempfile.mkdtemp(prefix="bench-long-"))
    tokenizer = shared_dir() / LLAMA2  # its vocabulary sizes the model; else the sample tokenizer's
    tokenizer = tokenizer if tokenizer.exists() else REPO / "data" / "tokenizer"
    from pipeline.engines.job import PackConfig, run_pack_data
    from pipeline.tokenize.tokenizer import load_tokenizer

    vocab = len(load_tokenizer(str(tokenizer)))
    lens = make_examples(work / "long.arrow", args.examples, args.min_len, args.max_example_len, args.seed, vocab)
    folder = work / "ffd"
    run_pack_data(
        PackConfig(
            inputs=[str(work / "long.arrow")],
            tokenizer=str(tokenizer),
            max_len=args.max_len,
            out=str(folder),
            strategy="ffd",
            progress=False,
        )
    )
    config = model_config(args.model, vocab)
    train_args = SimpleNamespace(**PACKED_RUN_DEFAULTS)  # bench_train's defaults for what this script does not set
    vars(train_args).update(
        warmup=args.warmup,
        steps=args.steps,
        max_len=args.max_len,
        ffd_tokens=args.tokens_per_step or args.max_len,
        model=args.model,
        dtype=args.dtype,
        compile=args.compile,
        seed=args.seed,
        num_workers=2,
        lora_r=args.lora_r,
        grad_checkpointing=args.grad_checkpointing,
        peak_tflops=args.peak_tflops,
        workdir=work,
    )
    setup = SimpleNamespace(args=train_args, device=device, folders={"ffd": folder}, shape=flop_shape(config))
    print(
        f"# bench_long: {args.examples} examples of {args.min_len}-{args.max_example_len} tokens "
        f"(mean {lens.mean():.0f}), rows of {args.max_len}, model {args.model}, {device_name(device)}"
    )
    results: list[PathResult] = []
    for backend in args.backends.split(","):
        train_args.attn = backend
        try:
            res = run_packed_pack_train("packlm-ffd", setup)
            res.path = backend
        except Exception as exc:  # noqa: BLE001 - one failing backend must not lose the others
            res = PathResult(path=backend, runner="", ok=False, note=f"{type(exc).__name__}: {str(exc)[:160]}")
        results.append(res)
        print(
            f"[{backend}] {res.tokens_per_s:,.0f} tokens/s, {res.step_ms:.0f} ms/step, MFU {res.mfu:.1%} "
            f"({res.tflops:,.1f} TFLOP/s; attention {res.attn_share:.0%} of the FLOPs), "
            f"peak {res.peak_gib} GiB, loss {res.final_loss}, runner {res.runner}"
            + ("" if res.ok and not res.note else f" NOTE {res.note}"),
            flush=True,
        )
    if args.json:
        write_json(
            args.json,
            {
                "config": {k: str(v) for k, v in vars(args).items()},
                "machine": machine_summary(),
                "device_name": device_name(device),
                "torch": torch.__version__,
                "mean_example_tokens": float(lens.mean()),
                "results": [asdict(r) for r in results],
            },
        )


if __name__ == "__main__":
    main()
