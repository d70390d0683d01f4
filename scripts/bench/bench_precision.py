#!/usr/bin/env python
"""Precision against precision on the same rows: speed and held-out loss of pack-train's own loop.

Packs GSM8K + CodeAlpaca (Llama-2 tokenizer, from `../shared`) once with `pack-data --strategy ffd
--eval-fraction F`, then runs `trainer.train` (what `pack-train` runs) once per `--dtypes` entry from
the same seed on the same rows for `--steps` optimizer steps, with a held-out evaluation at the end.
An entry is a pack-train `--dtype`, with an fp8 recipe after a colon (`fp8:tensorwise`; plain `fp8`
is pack-train's default recipe) and another model seed after an at sign (`bf16-weights@1`: the noise
control, the same precision from another random initialisation over the same rows). Reports tokens/s over the steps after `--warmup` (from
metrics.jsonl), the held-out loss and each entry's ratios against the first entry: the speed-up
and the held-out loss's relative difference (issue 38: fp8 within 1% of bf16).

An entry `hf/bf16` or `hf/fp8[:RECIPE]` is the Hugging Face peer on the same rows and GPUs
(`run_hf_entry`): every rank trains a plain `LlamaForCausalLM` on the rows pack-train's rank takes
at each step, wrapped as pack-train wraps its model (FSDP2 or DDP). Put it first, and every
pack-train entry's ratio is against it. It has no held-out evaluation.

One process, or every rank of a torchrun launch (FSDP2 with `--parallel fsdp`): rank 0 packs while
the others wait for its marker file; only rank 0 writes the report.

    python scripts/bench/bench_precision.py --model llama-1b --dtypes bf16-weights,fp8,fp8:tensorwise \\
        --steps 200 --json bench_precision.json
    torchrun --nproc-per-node 4 scripts/bench/bench_precision.py --model llama-8b --parallel fsdp \\
        --tokens-per-step 8192 --dtypes hf/bf16,bf16,fp8:tensorwise --steps 40 --json fp8_8b.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `scripts.benchlib`, pipeline, trainer
from scripts.benchlib import (  # noqa: E402
    LLAMA2,
    add_bench_args,
    check_output,
    free_memory,
    jsonable,
    load_source_examples,
    machine_summary,
    pack_data_args,
    reset_cuda_peak,
    seeded_order,
    shared_dir,
    write_json,
    write_jsonl,
    write_text_output,
)
from scripts.benchlib.metrics_rates import parse_steps, timed_rate, window_rates  # noqa: E402
from scripts.benchlib.train_runs import no_checkpoint_writes  # noqa: E402
from trainer.config import GRAD_REDUCE  # noqa: E402


def parse_entry(entry: str, seed: int = 0) -> tuple[str, str | None, int]:
    """ "fp8:tensorwise" -> ("fp8", "tensorwise", seed); "bf16-weights@1" -> ("bf16-weights", None, 1)."""
    entry, _, entry_seed = entry.partition("@")
    dtype, _, recipe = entry.partition(":")
    return dtype, (recipe or None), (int(entry_seed) if entry_seed else seed)


HF = "hf/"  # the prefix of the Hugging Face peer's entries


def prepare(args: argparse.Namespace, rank: int) -> Path:
    """The packed folder (with its eval split), written by rank 0 once; other ranks wait for it."""
    folder = args.workdir / "ffd-eval"
    ready = args.workdir / "ffd-eval.ready.json"
    stamp = {
        "limit": args.limit,
        "seed": args.seed,
        "max_len": args.max_len,
        "eval_fraction": args.eval_fraction,
        "shared": str(args.shared.resolve()),
    }
    if rank != 0:
        deadline = time.time() + 1800
        while not (ready.is_file() and json.loads(ready.read_text()) == stamp):
            if time.time() > deadline:
                raise SystemExit(f"rank {rank}: rank 0 did not finish packing {folder} in 30 min")
            time.sleep(2)
        return folder
    if ready.is_file() and json.loads(ready.read_text()) == stamp:
        return folder
    import click

    from pipeline.cli import pack_data

    args.workdir.mkdir(parents=True, exist_ok=True)
    inputs = args.workdir / "examples.jsonl"
    write_jsonl(inputs, seeded_order(load_source_examples(args.shared, args.limit), args.seed))
    argv = pack_data_args(
        [inputs], folder, tokenizer=args.shared / LLAMA2, max_len=args.max_len, strategy="ffd", seed=args.seed, num_proc=args.pack_procs
    )
    argv += ["--eval-fraction", str(args.eval_fraction)]
    try:
        pack_data.main(args=argv, standalone_mode=False)
    except click.ClickException as exc:
        raise SystemExit(f"pack-data failed: {exc.format_message()}") from None
    write_text_output(ready, json.dumps(stamp), "--workdir")
    return folder


def run_entry(entry: str, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """pack-train's loop for one precision; its summary and the timed steps' rate."""
    from trainer import TrainConfig, train
    from trainer.distributed.parallel import pick_device

    dtype, recipe, seed = parse_entry(entry, args.seed)
    out = args.workdir / f"run-{entry.replace(':', '-').replace('@', '-seed')}"
    config = TrainConfig(
        data=str(folder),
        model=args.model,
        out=str(out),
        tokens_per_step=args.tokens_per_step,
        lr=args.lr,
        warmup=args.lr_warmup,
        schedule="cosine",
        max_steps=args.steps,
        attn=args.attn,
        dtype=dtype,
        fp8_recipe=recipe or "rowwise_with_gw_hp",
        seed=seed,
        log_every=args.log_every,
        parallel=args.parallel,
        grad_checkpointing=args.grad_checkpointing,
        progress=False,
        num_workers=2,
        save_every=0,
        verify_hashes=False,
        peak_flops=args.peak_tflops * 1e12,
        profile_steps=args.profile_steps,
        reshard_after_forward=args.reshard_after_forward,
        grad_reduce=args.grad_reduce,
    )
    if out.exists() and int(os.environ.get("RANK", "0")) == 0:
        import shutil

        shutil.rmtree(out)
    # each entry's peak is its own, not the highest of the entries before it in this process
    device = pick_device("auto")  # the device pack-train's --device auto trains on
    reset_cuda_peak(device)
    try:
        with no_checkpoint_writes():  # no checkpoint of 1-8B parameters on disk
            summary = train(config)
    finally:
        free_memory(device)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train_rows = [r for r in records if "loss" in r and "step_time_s" in r]
    timed = [r for r in train_rows if r["step"] > args.warmup]
    tokens_per_s = timed_rate(train_rows, args.warmup)
    windows = window_rates(train_rows, args.warmup, profiled=parse_steps(args.profile_steps))
    return {
        "entry": entry,
        "dtype": dtype,
        "recipe": recipe,
        "seed": seed,
        "tokens_per_s": tokens_per_s,
        "window_tokens_per_s": windows,
        "median_window_tokens_per_s": statistics.median(windows) if windows else None,
        "mfu_last": timed[-1].get("mfu") if timed else None,
        "eval_loss": summary.get("eval_loss"),
        "final_loss": summary.get("final_loss"),
        "peak_mem_gib": train_rows[-1].get("peak_mem_gib") if train_rows else None,
        "world_size": summary.get("world_size"),
        "attention": summary.get("attention"),
        "loss_curve": [(r["step"], r["loss"]) for r in train_rows],
        # --profile-steps: rank 0's summary (every rank's, and the traces, stay in RUN/profile/)
        "profile": (
            json.loads((out / "profile" / "rank0.json").read_text())
            if args.profile_steps and (out / "profile" / "rank0.json").is_file()
            else None
        ),
    }


def run_hf_entry(entry: str, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The Hugging Face peer of pack-train's run: what a skilled user runs with HF on these GPUs.

    Each rank builds the same randomly initialised `LlamaForCausalLM` (`flash_attention_2` where
    flash-attn imports on CUDA, else `sdpa`), takes at each step exactly the rows pack-train's rank
    takes (`plan_step_rows`), flattened by HF's own collator with restarting `position_ids` and,
    for FA2, the boundaries (`scripts.benchlib.train_steps.hf_row_batches`: TRL's `padding_free` rows), and runs HF's
    forward with `labels=` (HF's loss, a mean over its own rank's tokens). It gets pack-train's
    setup around the model: `--grad-checkpointing`'s layers recomputed, each decoder layer
    compiled with pack-train's settings, then FSDP2 (bf16 parameters over fp32 shards,
    `--grad-reduce`, `--no-reshard-after-forward`) or DDP; bf16 autocast, fused AdamW, clip 1.0
    at a constant `--lr`. `hf/fp8` converts each decoder linear layer to torchao's float8 training
    first (`scripts.benchlib.train_steps.hf_fp8`, the recipe after the colon, pack-train's default without one).

    Its result has pack-train's entries' keys, from metrics lines of its own: every `--log-every`
    steps the ranks' token counts are summed and the window timed, with one wait for the GPU, as
    pack-train's log lines do. No held-out evaluation (`eval_loss` None).
    """
    import torch

    from pipeline.report.flops import step_flops
    from pipeline.shards import manifest_vocab, read_manifest
    from scripts.benchlib import build_hf_model, cuda_peak_gib, make_optimizer, sync
    from scripts.benchlib.train_results import flop_shape
    from scripts.benchlib.train_runs import plan_step_rows
    from scripts.benchlib.train_steps import flash_attn_available, hf_fp8, hf_row_batches, hf_step_fn
    from trainer.distributed.parallel import close_distributed, pick_device, setup_distributed, wrap_parallel
    from trainer.model.load import compile_decoder_layers, decoder_layers, enable_grad_checkpointing

    dtype, recipe, seed = parse_entry(entry.removeprefix(HF), args.seed)
    if dtype not in ("bf16", "fp8"):
        raise SystemExit(f"{entry}: the Hugging Face peer runs hf/bf16 or hf/fp8[:RECIPE]")
    device = pick_device("auto")
    info = setup_distributed(device)  # main's group under torchrun, so closing it below leaves it open
    attn = "flash_attention_2" if device.type == "cuda" and flash_attn_available() else "sdpa"
    reset_cuda_peak(device)
    model = build_hf_model(args.model, attn, device, manifest_vocab(read_manifest(folder).tokenizer), seed)
    shape = flop_shape(model.config, 0, args.grad_checkpointing)  # the FLOP count's view (pipeline.report.flops)
    layers = decoder_layers(model)
    if args.grad_checkpointing:
        enable_grad_checkpointing(model, every=args.grad_checkpointing)
    if dtype == "fp8":
        hf_fp8(layers, recipe or "rowwise_with_gw_hp")
    if device.type == "cuda":  # as pack-train's --compile defaults
        compile_decoder_layers(model)
    module = wrap_parallel(
        model,
        layers,
        info,
        fsdp=args.parallel == "fsdp",
        bf16=True,
        reduce_bf16=args.grad_reduce == "bf16",
        bucket_mb=250,
        reshard_after_forward=args.reshard_after_forward,
    )
    opt = make_optimizer(module, args.lr, device)
    step = hf_step_fn(module, opt, device, "bf16")
    steps = plan_step_rows(folder, args.tokens_per_step, args.seed, args.steps, world_size=info.world_size, rank=info.rank)
    rows: list[dict[str, Any]] = []
    tokens, flops, since, last = 0, 0.0, 0, time.perf_counter()
    try:
        for k, thunk in enumerate(hf_row_batches(steps, device, flash_kwargs=attn == "flash_attention_2"), 1):
            batch = thunk()
            loss = step(batch.payload)
            tokens, since = tokens + batch.tokens, since + 1
            flops += step_flops(shape, batch.seq_lens, tokens=batch.tokens, loss_tokens=batch.loss_tokens).model
            if k % args.log_every and k < args.steps:
                continue
            total = torch.tensor([tokens, flops], dtype=torch.float64, device=device)  # flops: this window's
            if info.enabled:
                torch.distributed.all_reduce(total)
            value = float(loss.detach())
            sync(device)
            now = time.perf_counter()
            peak = args.peak_tflops * 1e12 * info.world_size
            rows.append(
                {
                    "step": k,
                    "loss": value,
                    "tokens": int(total[0]),
                    "step_time_s": (now - last) / since,
                    "mfu": float(total[1]) / (now - last) / peak,
                }
            )
            last, since, flops = now, 0, 0.0
        peak = cuda_peak_gib(device)
    finally:
        del module, model, opt, step
        free_memory(device)
        close_distributed(info)
    tokens_per_s = timed_rate(rows, args.warmup)
    windows = window_rates(rows, args.warmup)
    return {
        "entry": entry,
        "dtype": dtype,
        "recipe": recipe,
        "seed": seed,
        "tokens_per_s": tokens_per_s,
        "window_tokens_per_s": windows,
        "median_window_tokens_per_s": statistics.median(windows) if windows else None,
        "mfu_last": rows[-1]["mfu"] if windows else None,
        "eval_loss": None,
        "final_loss": rows[-1]["loss"] if rows else None,
        "peak_mem_gib": peak,
        "tokens_seen": rows[-1]["tokens"] if rows else 0,
        "world_size": info.world_size,
        "attention": attn,
        "loss_curve": [(r["step"], r["loss"]) for r in rows],
        "profile": None,
    }


def table(results: Sequence[dict[str, Any]]) -> str:
    """One line per entry, ratios against the first."""
    base = results[0]
    lines = [
        "| precision | tokens/s (all ranks) | x first | median window tokens/s | x first | MFU (last window) "
        "| held-out loss | vs first | final train loss | peak GiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        speed = r["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else float("nan")
        if r["eval_loss"] is not None and base["eval_loss"]:
            rel = f"{100 * (r['eval_loss'] - base['eval_loss']) / base['eval_loss']:+.2f}%"
            ev = f"{r['eval_loss']:.4f}"
        else:
            rel = ev = "n/a"
        med, base_med = r.get("median_window_tokens_per_s"), base.get("median_window_tokens_per_s")
        steady = f"{med:,.0f} | {med / base_med:.2f}" if med and base_med else "n/a | n/a"
        mfu = f"{100 * r['mfu_last']:.1f}%" if r["mfu_last"] else "n/a"
        peak = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] else "n/a"
        lines.append(
            f"| {r['entry']} | {r['tokens_per_s']:,.0f} | {speed:.2f} | {steady} | {mfu} | {ev} | {rel} | {r['final_loss']:.4f} | {peak} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_args(p, model="llama-1b")
    p.add_argument(
        "--dtypes",
        default="bf16-weights,fp8",
        help="comma separated pack-train --dtype values, fp8 with :RECIPE, a model seed with @N; "
        "hf/bf16 and hf/fp8[:RECIPE] are the Hugging Face peer on the same rows; ratios against the first",
    )
    add_bench_args(
        p, steps=200, warmup=(10, "steps left out of tokens/s (compile); whole --log-every windows from the first that starts after them")
    )
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--tokens-per-step", type=int, default=16384)
    add_bench_args(p, max_len=8192)
    p.add_argument("--eval-fraction", type=float, default=0.02)
    add_bench_args(p, lr=1e-4)
    p.add_argument("--lr-warmup", type=int, default=10)
    p.add_argument("--attn", default="auto")
    p.add_argument("--parallel", default="ddp", choices=("ddp", "fsdp"))
    p.add_argument("--grad-checkpointing", type=int, default=0)
    p.add_argument(
        "--no-reshard-after-forward",
        dest="reshard_after_forward",
        action="store_false",
        help="FSDP2 keeps each layer's gathered weights from its forward to its backward (pack-train --no-reshard-after-forward)",
    )
    p.add_argument("--grad-reduce", default="fp32", choices=GRAD_REDUCE, help="dtype of the gradient reduction (pack-train --grad-reduce)")
    p.add_argument(
        "--profile-steps",
        default=None,
        metavar="FIRST-LAST",
        help="pack-train --profile-steps for every entry (e.g. 21-23, past --warmup): where those "
        "steps' GPU time went, in the JSON (rank 0) and in each run's profile/ folder. The "
        "profiler slows those steps: they count in tokens/s, not in the median window",
    )
    add_bench_args(
        p,
        limit=(None, "first N examples of each dataset"),
        seed=0,
        pack_procs=4,
        peak_tflops=(989.0, "dense bf16 peak for MFU (H100 SXM: 989)"),
        shared=None,
        workdir=Path("/tmp/packlm-bench-precision"),
        json=None,
    )
    args = p.parse_args(argv)
    if args.json:
        check_output(args.json, "--json")
    args.shared = args.shared or shared_dir()
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    return args


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    t0 = time.perf_counter()
    folder = prepare(args, rank)
    if rank == 0:
        print(f"[{time.perf_counter() - t0:.0f} s] packed rows ready in {folder}", flush=True)
    with process_group():
        return run_entries(args, folder, rank, t0)


@contextmanager
def process_group() -> Iterator[None]:
    """Under torchrun, one process group for every entry (pack-train's and the peer's runs find it
    and leave it open), destroyed at the end. A group of each entry's own, made after the one
    before it was destroyed, can take that one's stale NCCL address from torchrun's store: the
    second entry's first collective then fails with "Connection refused"."""
    import torch

    from trainer.distributed.parallel import close_distributed, pick_device, setup_distributed

    device = pick_device("auto")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    info = setup_distributed(device)
    try:
        yield
    finally:
        close_distributed(info)


def run_entries(args: argparse.Namespace, folder: Path, rank: int, t0: float) -> list[dict[str, Any]]:
    """Each --dtypes entry in turn; rank 0 prints and saves the table after every one."""
    results = []
    for entry in args.dtypes:
        res = (run_hf_entry if entry.startswith(HF) else run_entry)(entry, folder, args)
        results.append(res)
        if rank != 0:
            continue
        print(
            f"[{time.perf_counter() - t0:.0f} s] {entry}: {res['tokens_per_s']:,.0f} tokens/s, "
            f"held-out {res['eval_loss']}, final train {res['final_loss']}",
            flush=True,
        )
        text = table(results)
        if args.json:  # after every entry, so a run cut short keeps what it measured
            import torch

            write_json(
                args.json,
                {
                    "config": jsonable(args),
                    "machine": machine_summary(),
                    "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                    "torch": torch.__version__,
                    "results": results,
                    "table": text,
                    "wall_s": time.perf_counter() - t0,
                    "complete": len(results) == len(args.dtypes),
                },
            )
    if rank == 0:
        print(table(results))
    return results


if __name__ == "__main__":
    main()
