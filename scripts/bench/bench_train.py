#!/usr/bin/env python
"""Training throughput: Hugging Face padding / flattening baselines against packlm (issue 6).

Every path trains the same randomly initialised model (`--model`, default the `llama-1b` preset) on the
same examples (GSM8K + CodeAlpaca from `../shared`, Llama-2 tokenizer, one seeded order) with fused
AdamW (or, with `--optimizer adafactor`, torch's Adafactor, for a full fine-tune of a large model)
and the same learning rate, and reports real (non-padding) tokens/s, step time, peak memory,
MFU (model FLOPs, causal attention included, over `--peak-tflops`: `pipeline.report.flops`, the count
pack-train's metrics use), HFU (with the recompute of --grad-checkpointing), attention's share of the
FLOPs and the share of step time the loop spent waiting for its next batch (host preparation + host-to-device copy).

Paths (`--paths`, comma separated):

- `hf-pad`          HF model, `sdpa`, 32 examples right-padded to the longest + attention mask.
- `hf-flat-sdpa`    the same 32 examples through `transformers.DataCollatorWithFlattening`, `sdpa`.
- `hf-flat-flex`    ... with `flex_attention`.
- `hf-flat-fa2`     ... with `flash_attention_2` (skipped with a note when flash-attn is missing).
- `hf-ffd-sdpa`, `hf-ffd-flex`, `hf-ffd-fa2`: the same-row peer. HF fed exactly the rows
                    `packlm-ffd` trains on (pack-train's own seeded plan of the `ffd` shards, step by
                    step), each step's examples flattened into one [1, T] row with restarting
                    `position_ids` (what TRL's `packing_strategy="bfd"` + `padding_free=True` hands
                    the model), HF's own loss.
- `packlm-minibatch` packlm on `pack-data --strategy minibatch` shards (groups of 32 examples).
- `packlm-ffd`      packlm on `pack-data --strategy ffd --max-len 8192` shards, `--ffd-tokens` per step
                    (default 16384, pack-train's default --tokens-per-step: two full rows).

An HF path may add what a skilled user would: `+layers` (each decoder layer `torch.compile`d with
dynamic shapes, as pack-train does), `+model` (the whole model compiled), `+bf16` (the weights
themselves in bf16 and AdamW on them, no fp32 masters: less precise than any pack-train precision,
and faster), `+fp8` (torchao's float8 training on every linear layer of the decoder, `--fp8-recipe`,
as accelerate's torchao float8 recipe does it), `+liger` (Liger's Llama kernels; last in the list, as
it patches transformers for the rest of the run). A packlm path may add `+bf16-weights` (`pack-train
--dtype bf16-weights`: bf16 weights for compute, fp32 master weights in the optimizer, in place of
autocast over fp32 weights), `+fp8` (`pack-train --dtype fp8 --fp8-recipe R`) or, with `--lora-r`,
`+qlora` (`pack-train --qlora`: the frozen base in 4-bit NF4). A tuning that fails
is reported as a skipped path. "Best HF packed" is the fastest `hf-flat*` or `hf-ffd*` path of the
run, "best padding" the fastest `hf-pad*` one; "x HF same rows" divides a path by the fastest
`hf-ffd*` path of the run (the peer fed the same rows), "x HF same rows, same precision" by the
fastest one of its precision class (PRECISION_CLASS). The default paths: see DEFAULT_PATHS.

The data are prepared once (`--workdir`, reused when the parameters match): the two datasets become
one instruction/input/output JSONL in a seeded order, then `pack-data` writes `pad`, `minibatch` and
`ffd` shards. HF paths read the `pad` shards (one example per row) and group the examples exactly as
the `minibatch` shards do, so every HF step sees one `minibatch` group of 32 examples. HF paths run
the standard HF forward with `labels=` (HF's own loss), as users do.

packlm paths run the product's own loop, `trainer.run.loop.train` (what `pack-train` runs), in this
process, and read its metrics.jsonl back (`--packed-runner pack-train`, the default when
`trainer.run.loop` imports; only its final checkpoint write is patched out). On `minibatch` shards a step
holds at most `--max-len` tokens, which is one whole 32-example group in almost every step (groups
are drawn in pack-train's own seeded row order, not the HF order). `--packed-runner inline` runs an
equivalent loop here instead (`build_model` + `collate_rows` + `packed_loss`, exactly the HF groups).

Precision: `--dtype bf16` means bf16 *autocast* with fp32 weights and fp32 AdamW state for every path
(the HF Trainer's `bf16=True`) except packlm paths with `+bf16-weights`; `--dtype fp32` disables
autocast (CPU tests).

`--lora-r R` trains LoRA adapters (rank R, alpha 16, every linear layer of the decoder) on every path:
HF paths through `peft.get_peft_model`, packlm paths through `pack-train --lora-r`; both keep the
frozen base weights in bf16. MFU then counts 4 x the frozen weights a token (forward, and the backward
through the activations; they get no weight gradients) and 6 x the adapters'. Every path's MFU counts
the same model FLOPs for the same rows: the output head over the loss tokens only, as pack-train
computes it (HF's loss computes every token's logits: extra work no MFU counts).
`--grad-checkpointing [N]` recomputes the activations of every decoder layer (or of every Nth one) in the backward on every path (HF's
gradient_checkpointing_enable with the same per-layer choice, pack-train --grad-checkpointing [N]).
`--activation-memory-budget F` sets torch.compile's activation memory budget for every compiled path
(pack-train --activation-memory-budget; HF paths run their compiled steps under the same setting).

    python scripts/bench/bench_train.py --device cuda --model llama-1b --steps 30 --warmup 5 \
        --json bench_train.json
    python scripts/bench/bench_train.py --device cpu --model tiny --limit 200 --steps 2 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch._functorch.config

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: `scripts.benchlib`, pipeline, trainer
from scripts.benchlib import (  # noqa: E402
    AUTO_DEVICE,
    add_bench_args,
    build_hf_model,
    check_output,
    device_name,
    examples_by_id,
    free_memory,
    group_example_ids,
    jsonable,
    machine_summary,
    make_optimizer,
    minibatch_groups,
    model_config,
    prepare_data,
    reset_cuda_peak,
    resolve_device,
    shared_dir,
    tokenizer_ids,
    write_json,
)
from scripts.benchlib.args import default_pack_procs, default_workdir  # noqa: E402
from scripts.benchlib.train_results import (  # noqa: E402
    H100_BF16_TFLOPS,
    PathResult,
    flop_shape,
    markdown_table,
    n_params_of,
    packed_dtype,  # noqa: F401 - this benchmark's names, as its tests call them
    precision_class,  # noqa: F401
    split_path,
    target_lines,
)
from scripts.benchlib.train_runs import Setup, finish_path, plan_step_rows, run_packed_path, trace_path  # noqa: E402
from scripts.benchlib.train_steps import (  # noqa: E402
    flash_attn_available,
    hf_batches,
    hf_fp8,
    hf_lora,
    hf_row_batches,
    hf_step_fn,
    timed_loop,
)

HF_PATHS = ("hf-pad", "hf-flat-sdpa", "hf-flat-flex", "hf-flat-fa2", "hf-ffd-sdpa", "hf-ffd-flex", "hf-ffd-fa2")
PACKED_PATHS = ("packlm-minibatch", "packlm-ffd")
ALL_PATHS = HF_PATHS + PACKED_PATHS
# what a skilled user adds to a Hugging Face path: "+layers" compiles each decoder layer (dynamic
# shapes, as pack-train does), "+model" the whole model; "+liger" applies Liger's Llama kernels
# (fused linear cross-entropy, RMSNorm, SwiGLU, RoPE) and must come last: it patches transformers'
# Llama classes for the rest of the process
HF_TUNINGS = ("layers", "model", "bf16", "fp8", "liger")
# what a packlm path may add: "+bf16-weights" runs pack-train --dtype bf16-weights, "+fp8" --dtype fp8,
# "+qlora" --qlora (with --lora-r)
PACKED_TUNINGS = ("bf16-weights", "fp8", "qlora")
# the same-row peer at each precision (its best attention and whole-model compile) beside pack-train's
# paths on those rows, then padding and the minibatch rows
DEFAULT_PATHS = (
    "hf-ffd-fa2+model",
    "hf-ffd-flex+model",
    "hf-ffd-fa2+model+bf16",
    "packlm-ffd",
    "packlm-ffd+bf16-weights",
    "hf-pad+layers",
    "packlm-minibatch",
)


HF_ATTN = {
    "hf-pad": "sdpa",
    "hf-flat-sdpa": "sdpa",
    "hf-flat-flex": "flex_attention",
    "hf-flat-fa2": "flash_attention_2",
    "hf-ffd-sdpa": "sdpa",
    "hf-ffd-flex": "flex_attention",
    "hf-ffd-fa2": "flash_attention_2",
}


# ------------------------------------------------------------------------------------ the paths


def run_hf_path(path: str, s: Setup) -> PathResult:
    """One Hugging Face baseline (padding or flattening, stock attention), with the tunings its
    name asks for (HF_TUNINGS)."""
    a = s.args
    base, tunings = split_path(path)
    attn = HF_ATTN[base]
    if attn == "flash_attention_2" and not flash_attn_available():
        return PathResult(path=path, runner="hf", ok=False, note="flash-attn is not importable here")
    if attn == "flash_attention_2" and s.device.type != "cuda":
        return PathResult(path=path, runner="hf", ok=False, note="flash_attention_2 needs CUDA")
    if "liger" in tunings:
        try:
            from liger_kernel.transformers import apply_liger_kernel_to_llama
        except ImportError as exc:
            return PathResult(path=path, runner="hf", ok=False, note=f"Liger kernels not importable: {exc}")
        apply_liger_kernel_to_llama()
    reset_cuda_peak(s.device)
    model = build_hf_model(a.model, attn, s.device, s.vocab_size, a.seed)
    model.train()
    n_params = n_params_of(model)
    layers = list(model.model.layers)
    if "bf16" in tunings:
        model.to(torch.bfloat16)
    if a.grad_checkpointing:
        from trainer.model.load import enable_grad_checkpointing

        enable_grad_checkpointing(model, every=a.grad_checkpointing)
    if a.lora_r:
        model = hf_lora(model, a.lora_r)
    if "fp8" in tunings:
        hf_fp8(layers, a.fp8_recipe)
    if "layers" in tunings:
        # transformers' attention functions read each layer's `layer_idx`, which dynamo guards on:
        # one compile per layer, and past dynamo's recompile limit the remaining layers' attention runs
        # uncompiled; a skilled user raises the limit to cover every layer
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(layers))
        for layer in layers:
            layer.compile(dynamic=True)
    if "model" in tunings:
        model.compile(dynamic=True)
    opt = make_optimizer(model, a.lr, s.device, a.optimizer)
    if base.startswith("hf-ffd"):
        batches = hf_row_batches(
            plan_step_rows(s.folders["ffd"], a.ffd_tokens, a.seed, a.warmup + a.steps + a.profile_steps),
            s.device,
            flash_kwargs=attn == "flash_attention_2",
        )
    else:
        batches = hf_batches(
            s.group_ids, s.examples, flatten=(base != "hf-pad"), pad_id=s.pad_id, device=s.device, flash_kwargs=attn == "flash_attention_2"
        )
    try:  # the compiled layers partition at their first step: under the budget (no effect uncompiled)
        with torch._functorch.config.patch(activation_memory_budget=a.activation_memory_budget):
            res, lens = timed_loop(
                batches,
                hf_step_fn(model, opt, s.device, a.dtype),
                warmup=a.warmup,
                steps=a.steps,
                device=s.device,
                profile_steps=a.profile_steps,
                trace=trace_path(a, path),
            )
    finally:
        del model, opt
        free_memory(s.device)
    return finish_path(res, lens, s, path=path, runner=f"hf/{attn}" + "".join(f"+{t}" for t in tunings), n_params=n_params)


# ------------------------------------------------------------------------------------- reporting


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_args(
        p,
        device=AUTO_DEVICE,
        model="llama-1b",
        steps=(30, "timed optimizer steps per path"),
        warmup=(5, "untimed steps per path before timing"),
    )
    p.add_argument(
        "--paths",
        default=",".join(DEFAULT_PATHS),
        help=f"comma separated, of {','.join(ALL_PATHS)}; an HF path may add +TUNING "
        f"({', '.join(HF_TUNINGS)}; +liger last), a packlm path +{'/+'.join(PACKED_TUNINGS)}",
    )
    add_bench_args(
        p, json=(None, "write all results here"), workdir=default_workdir("packlm-bench"), shared=None, tokenizer=None, limit=None, seed=0
    )
    p.add_argument("--group", type=int, default=32, help="examples per step (padding/minibatch)")
    add_bench_args(p, max_len=8192)
    p.add_argument(
        "--ffd-tokens",
        type=int,
        default=16384,
        help="tokens per optimizer step on the ffd path (whole rows; 16384, pack-train's "
        "default --tokens-per-step, is two full 8192-token rows)",
    )
    add_bench_args(p, lr=1e-4)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="bf16 = autocast over fp32 weights for every path")
    p.add_argument("--attn", default="auto", help="packlm attention backend (build_model attn=)")
    p.add_argument(
        "--fp8-recipe",
        default="rowwise_with_gw_hp",
        choices=("rowwise_with_gw_hp", "rowwise", "tensorwise"),
        help="torchao float8 recipe of +fp8 paths, HF and packlm alike (pack-train --fp8-recipe)",
    )
    p.add_argument("--packed-runner", choices=("auto", "pack-train", "inline"), default="auto")
    p.add_argument("--compile", action="store_true", help="pack-train --compile (per-layer)")
    add_bench_args(p, lora_r=(0, "LoRA rank on every path (0: full fine-tune)"))
    p.add_argument(
        "--optimizer",
        choices=("adamw", "adafactor"),
        default="adamw",
        help="every path's optimizer (pack-train --optimizer; torch.optim.Adafactor on HF paths)",
    )
    p.add_argument(
        "--grad-checkpointing",
        nargs="?",
        const=1,
        default=0,
        type=int,
        metavar="N",
        help="activation checkpointing of every decoder layer on every path, or with N of every Nth one (layers 0, N, 2N, ...)",
    )
    p.add_argument(
        "--activation-memory-budget",
        type=float,
        default=1.0,
        metavar="F",
        help="torch.compile's activation memory budget on every compiled path (pack-train "
        "--activation-memory-budget; HF paths compile under the same setting)",
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="profile this many more steps of each path after its timed ones (torch.profiler) "
        "and report GPU time by kernel kind, top kernels, GPU idle time by gap length "
        "with the longest gaps, and the host's busiest operators and waits for the GPU",
    )
    p.add_argument(
        "--profile-trace",
        default=None,
        metavar="DIR",
        help="with --profile-steps: write each path's Chrome trace of those steps into DIR as "
        "PATH.json.gz, '+' written '_' (for chrome://tracing or Perfetto); the HF and inline "
        "paths also record Python stacks (which slows the host down), pack-train's do not",
    )
    add_bench_args(p, pack_procs=default_pack_procs(4))
    p.add_argument("--num-workers", type=int, default=2, help="pack-train DataLoader workers")
    add_bench_args(p, peak_tflops=H100_BF16_TFLOPS)
    args = p.parse_args(argv)
    if args.json:
        check_output(args.json, "--json")
    args.paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    known = [(HF_PATHS, HF_TUNINGS), (PACKED_PATHS, PACKED_TUNINGS)]
    unknown = [
        x for x in args.paths if not any(split_path(x)[0] in bases and set(split_path(x)[1]) <= set(tunings) for bases, tunings in known)
    ]
    if unknown:
        p.error(
            f"unknown path(s) {unknown}: choose from {','.join(ALL_PATHS)} (HF ones with "
            f"+{'/+'.join(HF_TUNINGS)}, packlm ones with +{'/+'.join(PACKED_TUNINGS)})"
        )
    liger = [k for k, x in enumerate(args.paths) if "liger" in split_path(x)[1]]
    if liger and liger[0] != len(args.paths) - len(liger):
        p.error("+liger paths must come last: Liger patches transformers' Llama classes for the rest of the run")
    return args


def main(argv: Sequence[str] | None = None) -> list[PathResult]:
    args = parse_args(argv)
    device = resolve_device(args.device)
    shared = args.shared or shared_dir()
    t0 = time.perf_counter()
    print(
        f"# bench_train: model={args.model} device={device} steps={args.steps} "
        f"warmup={args.warmup} dtype={args.dtype} (bf16 = autocast, fp32 weights)"
    )
    print(f"preparing data in {args.workdir} (shared={shared}, limit={args.limit})")
    folders = prepare_data(
        args.workdir, shared, limit=args.limit, seed=args.seed, max_len=args.max_len, tokenizer=args.tokenizer, num_proc=args.pack_procs
    )
    vocab_size, pad_id = tokenizer_ids(folders["pad"])
    groups = minibatch_groups(folders["minibatch"], args.group)
    group_ids = [group_example_ids(g) for g in groups]
    examples = examples_by_id(folders["pad"])
    config = model_config(args.model, vocab_size)
    setup = Setup(
        args,
        device,
        folders,
        groups,
        group_ids,
        examples,
        pad_id,
        vocab_size,
        shape=flop_shape(config, args.lora_r, args.grad_checkpointing),
    )
    if args.packed_runner == "auto":
        try:
            from trainer import TrainConfig, train  # noqa: F401

            args.packed_runner = "pack-train"
        except ImportError as exc:
            print(
                f"NOTE: trainer.run.loop is not importable ({exc}); packlm paths run the equivalent "
                "inline loop (build_model + collate_rows + packed_loss)"
            )
            args.packed_runner = "inline"
    mean_tokens = np.mean([sum(len(r["input_ids"]) for r in g) for g in groups])
    print(
        f"data ready in {time.perf_counter() - t0:.1f} s: {len(examples)} examples, "
        f"{len(groups)} groups of {args.group} (mean {mean_tokens:.0f} tokens/group), "
        f"vocab {vocab_size}, packed runner {args.packed_runner}"
    )
    results: list[PathResult] = []

    def save(table: str, targets: list[str]) -> None:
        """The JSON report so far: written after every path, so a run cut short keeps its results."""
        if args.json:
            write_json(
                args.json,
                {
                    "config": jsonable(args),
                    "machine": machine_summary(),
                    "device_name": device_name(device),
                    "torch": torch.__version__,
                    "mean_tokens_per_group": float(mean_tokens),
                    "results": [asdict(r) for r in results],
                    "table": table,
                    "targets": targets,
                    "wall_s": time.perf_counter() - t0,
                },
            )

    for path in args.paths:
        t_path = time.perf_counter()
        # each path compiles from scratch: compiled code of earlier paths (the same Llama classes)
        # must not use up dynamo's recompile limits of a later one, which then runs uncompiled
        torch._dynamo.reset()
        try:
            packed = split_path(path)[0] in PACKED_PATHS
            res = run_packed_path(path, setup) if packed else run_hf_path(path, setup)
        except torch.cuda.OutOfMemoryError as exc:
            res = PathResult(path=path, runner="", ok=False, note=f"OOM: {str(exc)[:80]}")
        except Exception as exc:  # noqa: BLE001 - one failing path must not lose the others
            traceback.print_exc()
            first = (str(exc).strip().splitlines() or [""])[0][:120]
            res = PathResult(
                path=path, runner=HF_ATTN.get(split_path(path)[0], args.packed_runner), ok=False, note=f"{type(exc).__name__}: {first}"
            )
        free_memory(device)  # here, once the traceback (and the model it holds) is gone
        print(
            f"  {path}: {res.tokens_per_s:,.0f} tokens/s, {res.step_ms:.0f} ms/step "
            f"({time.perf_counter() - t_path:.1f} s){'' if res.ok else ' SKIPPED ' + res.note}"
        )
        if "profile" in res.extra:
            print(f"  {path} profile: {json.dumps(res.extra['profile'])}")
        results.append(res)
        save(markdown_table(results), [])
    table = markdown_table(results)
    print()
    print(table)
    print()
    targets = target_lines(results)
    for line in targets:
        print(line)
    save(table, targets)
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")
    return results


if __name__ == "__main__":
    main()
