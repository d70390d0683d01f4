#!/usr/bin/env python
"""Unsloth's LoRA on the rows pack-train trains on (issue 38, part 3): the peer `bench_train.py`
cannot host.

Unsloth patches transformers, peft and TRL when it is imported, before they are, so it runs in a
process of its own: this script imports it first and `bench_train`'s helpers after it. Everything
else is `bench_train`'s same-row peer (`hf-ffd-*`):

- the rows: pack-train's own seeded plan of the `ffd` shards that `bench_train.py` prepared in the
  same `--workdir` (`plan_step_rows`), each step's examples flattened into one [1, T] row with
  restarting `position_ids` (`hf_row_batches`, collated and pinned before timing), plus
  `packed_seq_lengths`, the per-example lengths Unsloth's padding-free collator adds (its
  varlen attention reads them; without them it derives them from `position_ids`);
- the model: Unsloth's `FastLanguageModel.from_pretrained` needs a checkpoint folder, so the
  `--model` preset is written once into `WORKDIR/unsloth-<model>` (random init drawn on the GPU in
  bf16 from `--seed`; the speed does not depend on the values) with the Llama-2 tokenizer beside it;
- LoRA: `FastLanguageModel.get_peft_model` with rank `--lora-r`, alpha 16, no dropout, every linear
  layer of the decoder, and Unsloth's gradient checkpointing (`--gc unsloth`, its default: every
  layer, the saved inputs offloaded to the host; `true`: every layer, kept on the GPU; `false`);
- the step: bf16 autocast, the model's own loss (`labels=`), fused AdamW on the adapters, gradient
  norm clipped at 1 (`hf_step_fn`).

MFU counts the model FLOPs of the rows (`pipeline.report.flops`), as `bench_train.py --lora-r` does.

    python scripts/bench/bench_train.py --device cuda --compile --workdir /tmp/pb --model llama-8b --lora-r 16 \\
        --grad-checkpointing 2 --paths packlm-ffd --json packlm.json
    python scripts/bench/bench_unsloth.py --workdir /tmp/pb --model llama-8b --lora-r 16 --gc unsloth --json unsloth.json
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `scripts.benchlib`, pipeline, trainer
from scripts.benchlib import add_bench_args  # noqa: E402 - the standard library only: unsloth is imported first in main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, required=True, help="bench_train.py's --workdir (its packed rows)")
    add_bench_args(p, shared=None, model=("llama-8b", "packlm preset"), lora_r=16)
    p.add_argument("--gc", choices=("unsloth", "true", "false"), default="unsloth", help="Unsloth's use_gradient_checkpointing")
    add_bench_args(p, steps=9, warmup=3)
    p.add_argument("--ffd-tokens", type=int, default=16384, help="tokens per step (bench_train.py --ffd-tokens)")
    add_bench_args(
        p,
        seed=0,
        lr=1e-4,
        max_len=(8192, "pack-data --max-len of the prepared rows"),
        peak_tflops=989.0,
        device=("cuda", "cuda (tests: cpu, with a stand-in for unsloth)"),
        json=None,
    )
    args = p.parse_args(argv)
    if args.json:
        from scripts.benchlib import check_output

        check_output(args.json, "--json")
    return args


def write_checkpoint(folder: Path, preset: str, vocab_size: int, seed: int, tokenizer: Path, device: str) -> None:
    """The preset as a bf16 safetensors checkpoint with its tokenizer, once per folder."""
    import torch
    from transformers import AutoModelForCausalLM

    from scripts.benchlib import free_memory, model_config

    if (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file():
        return
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(model_config(preset, vocab_size), dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    del model
    free_memory(torch.device(device))


def with_lengths(batches: Iterator[Callable[[], Any]]) -> Iterator[Callable[[], Any]]:
    """Each step's batch plus `packed_seq_lengths` (int32, on the host, as Unsloth's collator gives it)."""
    import torch

    for thunk in batches:

        def add(thunk: Callable[[], Any] = thunk) -> Any:
            batch = thunk()
            batch.payload["packed_seq_lengths"] = torch.tensor(batch.seq_lens, dtype=torch.int32)
            return batch

        yield add


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t0 = time.perf_counter()
    import torch
    import unsloth  # noqa: F401 - first, so that it patches transformers before anything imports it
    from unsloth import FastLanguageModel

    from scripts.benchlib import (
        LLAMA2,
        device_name,
        free_memory,
        machine_summary,
        make_optimizer,
        prepare_data,
        reset_cuda_peak,
        shared_dir,
        tokenizer_ids,
        write_json,
    )
    from scripts.benchlib.train_results import flop_shape, n_params_of
    from scripts.benchlib.train_runs import Setup, finish_path, plan_step_rows
    from scripts.benchlib.train_steps import hf_row_batches, hf_step_fn, timed_loop

    device = torch.device(args.device)
    shared = args.shared or shared_dir()
    folders = prepare_data(args.workdir, shared, limit=None, seed=args.seed, max_len=args.max_len)
    vocab_size, _ = tokenizer_ids(folders["ffd"])
    checkpoint = args.workdir / f"unsloth-{args.model}"
    write_checkpoint(checkpoint, args.model, vocab_size, args.seed, shared / LLAMA2, args.device)
    print(f"checkpoint ready in {time.perf_counter() - t0:.1f} s: {checkpoint}", flush=True)

    reset_cuda_peak(device)
    # max_seq_length is the longest example (the preset's 8192 positions, no RoPE scaling); a flattened
    # step is longer, which Unsloth accepts where packed_seq_lengths marks the examples
    gc = {"unsloth": "unsloth", "true": True, "false": False}[args.gc]
    model, _ = FastLanguageModel.from_pretrained(
        model_name=str(checkpoint),
        max_seq_length=args.max_len,
        dtype=torch.bfloat16,
        load_in_4bit=False,
        load_in_16bit=True,
        use_gradient_checkpointing=gc,
        local_files_only=True,
    )
    n_params = n_params_of(model)
    config = model.config
    model = FastLanguageModel.get_peft_model(
        model,
        r=args.lora_r,
        lora_alpha=16,
        lora_dropout=0.0,
        bias="none",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        use_gradient_checkpointing=gc,
        random_state=args.seed,
    )
    model.train()
    opt = make_optimizer(model, args.lr, device)
    steps = plan_step_rows(folders["ffd"], args.ffd_tokens, args.seed, args.warmup + args.steps)
    batches = with_lengths(hf_row_batches(steps, device))
    print(f"model ready in {time.perf_counter() - t0:.1f} s: {n_params / 1e6:.1f}M params, gradient checkpointing {gc!r}", flush=True)
    res, lens = timed_loop(batches, hf_step_fn(model, opt, device, "bf16"), warmup=args.warmup, steps=args.steps, device=device)
    s = Setup(
        argparse.Namespace(peak_tflops=args.peak_tflops, lora_r=args.lora_r),
        device,
        folders,
        [],
        [],
        {},
        0,
        vocab_size,
        shape=flop_shape(config, args.lora_r, 1 if gc else 0),
    )
    path = f"unsloth-ffd+gc-{args.gc}"
    res = finish_path(res, lens, s, path=path, runner=f"unsloth {unsloth.__version__}", n_params=n_params)
    del model, opt
    free_memory(device)
    print(
        f"  {path}: {res.tokens_per_s:,.0f} tokens/s, {res.step_ms:.0f} ms/step, peak {res.peak_gib} GiB, "
        f"MFU {100 * res.mfu:.1f}%, loss {res.final_loss:.4f}"
    )
    report = {
        "config": {k: str(v) for k, v in vars(args).items()},
        "machine": machine_summary(),
        "device_name": device_name(device),
        "torch": torch.__version__,
        "results": [asdict(res)],
        "wall_s": time.perf_counter() - t0,
    }
    if args.json:
        write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
