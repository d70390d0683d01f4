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

    python scripts/bench_train.py --device cuda --model llama-1b --steps 30 --warmup 5 \
        --json bench_train.json
    python scripts/bench_train.py --device cpu --model tiny --limit 200 --steps 2 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch._functorch.config
from benchlib import (
    autocast_ctx,
    build_hf_model,
    check_output,
    cuda_peak_gib,
    device_name,
    examples_by_id,
    ffd_steps,
    free_memory,
    group_example_ids,
    jsonable,
    machine_summary,
    make_optimizer,
    minibatch_groups,
    model_config,
    optimizer_step,
    pad_collate,
    prepare_data,
    reset_cuda_peak,
    resolve_device,
    shared_dir,
    sync,
    to_device,
    tokenizer_ids,
    write_json,
)

from pipeline.report.flops import ModelShape, attention_share, step_flops
from pipeline.shards import IGNORE_INDEX, iter_rows, read_manifest
from trainer.run.profiling import finish_profile, new_profiler

H100_BF16_TFLOPS = 989.0
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
DEFAULT_PATHS = ("hf-ffd-fa2+model", "hf-ffd-flex+model", "hf-ffd-fa2+model+bf16", "packlm-ffd",
                 "packlm-ffd+bf16-weights", "hf-pad+layers", "packlm-minibatch")


def split_path(path: str) -> tuple[str, list[str]]:
    """"hf-flat-fa2+layers+liger" -> ("hf-flat-fa2", ["layers", "liger"])."""
    base, *tunings = path.split("+")
    return base, tunings
HF_ATTN = {
    "hf-pad": "sdpa",
    "hf-flat-sdpa": "sdpa",
    "hf-flat-flex": "flex_attention",
    "hf-flat-fa2": "flash_attention_2",
    "hf-ffd-sdpa": "sdpa",
    "hf-ffd-flex": "flex_attention",
    "hf-ffd-fa2": "flash_attention_2",
}


def precision_class(path: str) -> str:
    """"fp8", "bf16 weights" or "autocast" (bf16 autocast over fp32 weights, or fp32 with --dtype
    fp32): the precision a path computes at, for same-precision ratios. pack-train's bf16-weights
    (fp32 masters) and HF's +bf16 (no masters) share a class: HF gets the faster, less precise one."""
    tunings = split_path(path)[1]
    if "fp8" in tunings:
        return "fp8"
    return "bf16 weights" if {"bf16", "bf16-weights"} & set(tunings) else "autocast"



# ------------------------------------------------------------------------------------- batching


def flatten_collate(examples: Sequence[dict[str, np.ndarray]], *, flash_kwargs: bool = False) -> dict[str, Any]:
    """The same examples through HF's own `DataCollatorWithFlattening` (input_ids, labels,
    position_ids as a [1, T] batch), exactly as the packing paper ships it. With `flash_kwargs`
    (the flash_attention_2 paths) it also returns the boundaries, `cu_seq_lens_q/k` and
    `max_length_q/k` (Python ints), as a skilled user asks it to (`return_flash_attn_kwargs=True`):
    without them transformers derives them from `position_ids` in every layer, with a host sync
    (`max_length.item()`) and a graph break there."""
    from transformers import DataCollatorWithFlattening

    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    return collator([{"input_ids": e["input_ids"], "labels": e["labels"]} for e in examples],
                    return_tensors="pt")


def real_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Non-padding tokens of an HF batch."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return int(batch["input_ids"].numel())


# ------------------------------------------------------------------------------------ accounting


def flop_shape(config: Any, lora_r: int = 0, grad_checkpointing: int = 0) -> ModelShape:
    """The model of `config` as the one FLOP count sees it (`trainer.run.metrics.model_shape`), with
    LoRA adapters of rank `lora_r` on every linear layer of the decoder and every
    `grad_checkpointing`-th layer recomputed, as the paths train it; built on the meta device."""
    from transformers import AutoModelForCausalLM

    from trainer import TrainConfig
    from trainer.model.lora import add_lora
    from trainer.run.metrics import model_shape

    options = TrainConfig(data="-", model="-", out="-", lora_r=lora_r, grad_checkpointing=grad_checkpointing)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        if lora_r:
            add_lora(model, options)
    return model_shape(model, options)


def loss_tokens_of(labels: Sequence[np.ndarray]) -> int:
    """The loss tokens of examples or rows by their (unshifted) labels: those not -100 (an example's
    first label is -100, so it is the count of shifted targets)."""
    return int(sum(int((np.asarray(x) != IGNORE_INDEX).sum()) for x in labels))


def n_params_of(model: torch.nn.Module) -> int:
    """All parameters (embeddings and LM head included)."""
    return sum(p.numel() for p in model.parameters())


@dataclass
class PathResult:
    """What one path measured (JSON-serialisable)."""

    path: str
    runner: str
    ok: bool = True
    note: str = ""
    steps: int = 0
    tokens: int = 0  # real tokens in the timed steps
    loss_tokens: int = 0  # of which carry a loss
    examples: int = 0
    seconds: float = 0.0
    data_wait_s: float = 0.0
    peak_gib: float | None = None
    tokens_per_s: float = 0.0
    step_ms: float = 0.0
    tflops: float = 0.0  # model TFLOP/s (pipeline.report.flops: dense and causal attention)
    mfu: float = 0.0  # model FLOPs/s / peak
    hfu: float = 0.0  # as mfu, with the recompute (--grad-checkpointing)
    attn_tflops_per_s: float = 0.0
    attn_share: float = 0.0  # attention's share of the model FLOPs
    data_wait_pct: float = 0.0
    final_loss: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def finish_result(res: PathResult, *, shape: ModelShape, lens: np.ndarray, peak_tflops: float) -> None:
    """Fill the derived rates of `res` from its raw counts: the FLOPs of the timed steps' examples
    (`lens`, `res.tokens`, `res.loss_tokens`) for `shape`, by the one count."""
    if res.seconds <= 0 or res.steps <= 0:
        return
    res.tokens_per_s = res.tokens / res.seconds
    res.step_ms = 1000.0 * res.seconds / res.steps
    flops = step_flops(shape, lens, tokens=res.tokens, loss_tokens=res.loss_tokens)
    res.tflops = flops.model / res.seconds / 1e12
    res.mfu = flops.model / res.seconds / (peak_tflops * 1e12)
    res.hfu = flops.hardware / res.seconds / (peak_tflops * 1e12)
    res.attn_tflops_per_s = flops.attention / res.seconds / 1e12
    res.attn_share = attention_share(flops)
    res.data_wait_pct = 100.0 * res.data_wait_s / res.seconds


# ------------------------------------------------------------------------------------ step loop


@dataclass
class Batch:
    """A prepared step: model inputs on the device plus what the accounting needs."""

    payload: Any
    tokens: int
    seq_lens: np.ndarray
    examples: int
    loss_tokens: int = 0


def timed_loop(
    batches: Iterator[Callable[[], Batch]],
    step: Callable[[Any], torch.Tensor],
    *, warmup: int, steps: int, device: torch.device, profile_steps: int = 0, trace: Path | None = None,
) -> tuple[PathResult, np.ndarray]:
    """Run `warmup` untimed then `steps` timed steps; returns raw counts and all timed seq_lens.
    With `profile_steps`, that many more steps run under torch.profiler afterwards (not timed) and
    `res.extra["profile"]` gets where their GPU time went (`profile_summary`); with `trace`, their
    Chrome trace is written there too.

    Each item of `batches` is a thunk doing the host preparation + H2D copy of one step; the time spent
    in it is the data wait. CUDA is synchronised only at the edges of the timed region, so the host
    can run ahead of the GPU as in a real loop. `res.extra["host_ms_per_step"]`: the host's time in
    each timed step (data included), which shows a stall (a compile, a wait) in one of them.
    """
    res = PathResult(path="", runner="")
    lens: list[np.ndarray] = []
    losses: list[torch.Tensor] = []
    host_ms: list[float] = []
    t_start = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            sync(device)
            t_start = time.perf_counter()
        t0 = time.perf_counter()
        try:
            thunk = next(batches)
        except StopIteration:
            raise SystemExit(f"ran out of data after {i} steps: lower --steps/--warmup or "
                             "raise --limit") from None
        batch = thunk()
        t1 = time.perf_counter()
        loss = step(batch.payload)
        if i >= warmup:
            host_ms.append(round((time.perf_counter() - t0) * 1000, 1))
            res.data_wait_s += t1 - t0
            res.tokens += batch.tokens
            res.loss_tokens += batch.loss_tokens
            res.examples += batch.examples
            lens.append(batch.seq_lens)
            losses.append(loss.detach())
        elif i == 0:
            float(loss.detach())  # surface errors of the first step early
    sync(device)
    res.seconds = time.perf_counter() - t_start
    res.steps = steps
    res.final_loss = float(losses[-1]) if losses else None
    res.extra["host_ms_per_step"] = host_ms
    if profile_steps:
        with new_profiler(device, trace) as prof:
            for _ in range(profile_steps):
                step(next(batches)().payload)
            sync(device)
        res.extra["profile"] = finish_profile(prof, profile_steps, device, trace)
    return res, (np.concatenate(lens) if lens else np.zeros(0, np.int64))


def hf_step_fn(model, opt, device: torch.device, dtype: str) -> Callable[[Any], torch.Tensor]:
    """Standard HF training step: forward with labels= (HF's loss), backward, AdamW."""

    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with autocast_ctx(device, dtype):
            loss = model(**batch).loss
        optimizer_step(model, opt, loss)
        return loss

    return step


def hf_batches(
    groups: Sequence[Sequence[int]], examples: dict[int, dict[str, np.ndarray]], *, flatten: bool,
    pad_id: int, device: torch.device, flash_kwargs: bool = False,
) -> Iterator[Callable[[], Batch]]:
    """One thunk per group: collate (padding or HF flattening, `flatten_collate`) and copy to the
    device."""
    for ids in groups:
        def thunk(ids: Sequence[int] = ids) -> Batch:
            exs = [examples[i] for i in ids]
            host = flatten_collate(exs, flash_kwargs=flash_kwargs) if flatten else pad_collate(exs, pad_id)
            lens = np.array([len(e["input_ids"]) for e in exs], dtype=np.int64)
            return Batch(to_device(host, device), real_tokens(host), lens, len(exs),
                         loss_tokens_of([e["labels"] for e in exs]))

        yield thunk


def row_examples(rows: Sequence[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """The examples of packed rows, in order: each row cut at its `seq_lens`.

    >>> row = {"input_ids": np.arange(5), "labels": np.arange(5), "seq_lens": np.array([2, 3])}
    >>> [e["input_ids"].tolist() for e in row_examples([row])]
    [[0, 1], [2, 3, 4]]
    """
    out = []
    for row in rows:
        edges = np.concatenate([[0], np.cumsum(row["seq_lens"])]).tolist()
        out.extend({"input_ids": row["input_ids"][a:b], "labels": row["labels"][a:b]}
                   for a, b in zip(edges[:-1], edges[1:]))
    return out


def hf_row_batches(steps: Sequence[Sequence[dict[str, np.ndarray]]], device: torch.device, *,
                   flash_kwargs: bool = False) -> Iterator[Callable[[], Batch]]:
    """One thunk per step of packed rows: their examples through HF's flattening collator (one
    [1, T] row, restarting position_ids, -100 at each example's first label) and to the device.
    Every step is collated before the first one runs (pinned on CUDA), as a DataLoader's workers
    would have it ready, so the peer's time holds no host collation."""
    ready = []
    for rows in steps:
        host = flatten_collate(row_examples(rows), flash_kwargs=flash_kwargs)
        if device.type == "cuda":
            host = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in host.items()}
        ready.append((host, np.concatenate([r["seq_lens"] for r in rows]).astype(np.int64),
                      loss_tokens_of([r["labels"] for r in rows])))
    for host, lens, loss in ready:
        def thunk(host: dict[str, torch.Tensor] = host, lens: np.ndarray = lens, loss: int = loss) -> Batch:
            return Batch(to_device(host, device), real_tokens(host), lens, len(lens), loss)

        yield thunk


def packed_batches(
    steps: Sequence[Sequence[dict[str, np.ndarray]]], device: torch.device
) -> Iterator[Callable[[], Batch]]:
    """One thunk per step: packlm's `collate_rows` + pinned non-blocking copy (`MicroBatch.to`)."""
    from trainer.data.batch import collate_rows

    for rows in steps:
        def thunk(rows: Sequence[dict[str, np.ndarray]] = rows) -> Batch:
            mb = collate_rows(rows)
            lens = np.concatenate([r["seq_lens"] for r in rows]).astype(np.int64)
            return Batch(mb.to(device), mb.n_tokens, lens, mb.n_examples, loss_tokens_of([r["labels"] for r in rows]))

        yield thunk


def packed_step_fn(model, opt, device: torch.device, dtype: str, compiled: bool) -> Callable[[Any], torch.Tensor]:
    """packlm's step: chunked loss over the flat varlen batch (each chunk compiled where the layers
    are, as pack-train does), mean over loss tokens, AdamW."""
    from trainer.model.loss import LossModule

    loss_module = LossModule(model, compiled=compiled)

    def step(mb) -> torch.Tensor:
        with autocast_ctx(device, dtype):
            loss_sum = loss_module(mb)
            n = mb.n_loss_tokens
        loss = loss_sum / max(int(n), 1)
        optimizer_step(model, opt, loss)
        return loss

    return step


# ------------------------------------------------------------------------------------ the paths


@dataclass
class Setup:
    """Everything the paths share."""

    args: argparse.Namespace
    device: torch.device
    folders: dict[str, Path]
    groups: list[list[dict[str, np.ndarray]]]  # minibatch rows per group
    group_ids: list[list[int]]
    examples: dict[int, dict[str, np.ndarray]]
    pad_id: int
    vocab_size: int
    shape: ModelShape | None = None  # the model as the FLOP count sees it (`flop_shape`)


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


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
        batches = hf_row_batches(plan_step_rows(s.folders["ffd"], a.ffd_tokens, a.seed,
                                                a.warmup + a.steps + a.profile_steps), s.device,
                                 flash_kwargs=attn == "flash_attention_2")
    else:
        batches = hf_batches(s.group_ids, s.examples, flatten=(base != "hf-pad"), pad_id=s.pad_id,
                             device=s.device, flash_kwargs=attn == "flash_attention_2")
    try:  # the compiled layers partition at their first step: under the budget (no effect uncompiled)
        with torch._functorch.config.patch(activation_memory_budget=a.activation_memory_budget):
            res, lens = timed_loop(batches, hf_step_fn(model, opt, s.device, a.dtype),
                                   warmup=a.warmup, steps=a.steps, device=s.device, profile_steps=a.profile_steps,
                                   trace=trace_path(a, path))
    finally:
        del model, opt
        free_memory(s.device)
    return _finish_path(res, lens, s, path=path, runner=f"hf/{attn}" + "".join(f"+{t}" for t in tunings),
                        n_params=n_params)


def hf_fp8(layers: Sequence[torch.nn.Module], recipe: str) -> None:
    """torchao's float8 training on every linear layer of these decoder layers whose dimensions
    are multiples of 16 (LoRA adapters left alone), as a Hugging Face user applies it; the inner
    dimension padded to 16 (a flattened step's token count is any number)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), pad_inner_dim=True)

    def take(module: torch.nn.Module, fqn: str) -> bool:
        return (isinstance(module, torch.nn.Linear) and "lora_" not in fqn
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)

    for layer in layers:
        convert_to_float8_training(layer, module_filter_fn=take, config=config)


def hf_lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """`model` with peft LoRA adapters (rank, alpha 16, every linear layer of the decoder) as a
    Hugging Face user adds them, the frozen base weights stored in bf16 (the adapters stay fp32)."""
    from peft import LoraConfig, get_peft_model

    from trainer.model.lora import freeze_in_bf16

    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=16, lora_dropout=0.0,
                                             target_modules="all-linear", task_type="CAUSAL_LM"))
    freeze_in_bf16(model)
    return model


def packed_step_rows(path: str, s: Setup) -> list[list[dict[str, np.ndarray]]]:
    """The micro-batches of a packlm path: minibatch groups, or ffd rows cut by --ffd-tokens."""
    if split_path(path)[0] == "packlm-minibatch":
        return s.groups
    return ffd_steps(s.folders["ffd"], s.args.ffd_tokens)


def run_packed_inline(path: str, s: Setup) -> PathResult:
    """A packlm path in this process: build_model + collate_rows + packed_loss, fused AdamW."""
    from trainer.model.load import build_model, compile_decoder_layers

    a = s.args
    if a.lora_r or a.grad_checkpointing or split_path(path)[1]:
        raise ValueError("the inline runner has no --lora-r / --grad-checkpointing / +bf16-weights: use "
                         "--packed-runner pack-train")
    reset_cuda_peak(s.device)
    model, backend = build_model(a.model, attn=a.attn, device=s.device, dtype=torch.float32,
                                 vocab_size=s.vocab_size, seed=a.seed)
    model.train()
    if a.compile:  # as pack-train --compile does
        compile_decoder_layers(model)
    opt = make_optimizer(model, a.lr, s.device, a.optimizer)
    n_params = n_params_of(model)
    try:
        res, lens = timed_loop(packed_batches(packed_step_rows(path, s), s.device),
                               packed_step_fn(model, opt, s.device, a.dtype, a.compile),
                               warmup=a.warmup, steps=a.steps, device=s.device, profile_steps=a.profile_steps,
                               trace=trace_path(a, path))
    finally:
        del model, opt
        free_memory(s.device)
    return _finish_path(res, lens, s, path=path, runner=f"inline/{backend}", n_params=n_params)


def _finish_path(res: PathResult, lens: Any, s: Setup, *, path: str, runner: str,
                 n_params: int) -> PathResult:
    """Label a timed path and fill in peak memory, MFU and attention FLOPs."""
    res.path, res.runner = path, runner
    res.peak_gib = cuda_peak_gib(s.device)
    finish_result(res, shape=s.shape, lens=lens, peak_tflops=s.args.peak_tflops)
    res.extra["n_params"] = n_params
    return res


def plan_step_rows(folder: Path, tokens_per_step: int, seed: int, count: int, first: int = 0, *,
                   world_size: int = 1, rank: int = 0) -> list[list[dict[str, np.ndarray]]]:
    """The rows of optimizer steps first..first+count-1 that rank `rank` of pack-train's
    `world_size` data-parallel ranks takes from `folder` (grad_accum 1), in its order: the same
    deterministic `trainer.data.stream.Planner` plan."""
    from trainer.data.stream import Cursor, Planner, row_lengths, step_cursor

    manifest = read_manifest(folder)
    planner = Planner(row_lengths(folder, manifest), tokens_per_step, seed=seed, world_size=world_size)
    rows = list(iter_rows(folder))
    steps = []
    for k in range(first, first + count):
        cur = step_cursor(planner, Cursor(), k)
        steps.append([rows[int(i)] for i in planner.local_rows(cur.epoch, cur.step_in_epoch, rank)])
    return steps


def step_seq_lens_of_plan(folder: Path, tokens_per_step: int, seed: int, first: int,
                          count: int) -> tuple[np.ndarray, int]:
    """Example lengths and real tokens of optimizer steps first..first+count-1 that pack-train takes
    (`plan_step_rows`)."""
    lens = [r["seq_lens"] for rows in plan_step_rows(folder, tokens_per_step, seed, count, first) for r in rows]
    out = np.concatenate(lens).astype(np.int64) if lens else np.zeros(0, np.int64)
    return out, int(out.sum())


@contextmanager
def no_checkpoint_writes() -> Iterator[None]:
    """pack-train always saves a checkpoint at its last step; a benchmark does not need the ~12 GB
    (1B params + AdamW state) on disk, so the harness replaces `trainer.run.loop.save` with a no-op
    (an AttributeError here if that function is renamed, never a silent save). The timed steps are
    untouched."""
    from unittest import mock

    from trainer.run import loop

    with mock.patch.object(loop, "save", lambda *args, **kwargs: None):
        yield


def trace_path(a: argparse.Namespace, path: str) -> Path | None:
    """Where --profile-trace puts the Chrome trace of `path`'s profiled steps (gzipped), if asked."""
    if not (a.profile_trace and a.profile_steps):
        return None
    Path(a.profile_trace).mkdir(parents=True, exist_ok=True)
    return Path(a.profile_trace) / f"{path.replace('+', '_')}.json.gz"


def run_packed_pack_train(path: str, s: Setup) -> PathResult:
    """A packlm path through the product's own loop (`trainer.run.loop.train`, what `pack-train` runs),
    read back from its metrics.jsonl. Steps 1..W are warmup; the timed region is W+1..W+S."""
    from trainer import TrainConfig, train

    a = s.args
    base, tunings = split_path(path)
    folder = s.folders["minibatch" if base == "packlm-minibatch" else "ffd"]
    # minibatch: a 32-example group fills about one max_len row, and a step of <= max_len tokens
    # then takes one whole group; ffd: --ffd-tokens of whole rows per step.
    tokens_per_step = a.max_len if base == "packlm-minibatch" else a.ffd_tokens
    run_dir = Path(tempfile.mkdtemp(prefix=f"{path}-", dir=a.workdir))
    log_every = a.warmup if a.warmup > 0 else a.steps
    if a.profile_steps and (a.warmup + a.steps) % log_every:
        raise ValueError("--profile-steps with pack-train paths: --steps must be a multiple of "
                         "--warmup (the timed region then ends on a metrics line)")
    config = TrainConfig(
        data=str(folder), model=a.model, out=str(run_dir), tokens_per_step=tokens_per_step,
        grad_accum=1, lr=a.lr, warmup=0, schedule="constant", max_steps=a.warmup + a.steps + a.profile_steps,
        attn=a.attn, dtype=packed_dtype(tunings, a.dtype), fp8_recipe=a.fp8_recipe, compile=a.compile,
        qlora="qlora" in tunings,
        seed=a.seed, log_every=log_every,
        profile_steps=f"{a.warmup + a.steps + 1}-{a.warmup + a.steps + a.profile_steps}" if a.profile_steps else None,
        lora_r=a.lora_r, grad_checkpointing=a.grad_checkpointing, optimizer=a.optimizer,
        activation_memory_budget=a.activation_memory_budget,
        device=str(s.device), progress=False, num_workers=a.num_workers,
        peak_flops=a.peak_tflops * 1e12,
    )
    reset_cuda_peak(s.device)
    try:
        with no_checkpoint_writes():
            summary = train(config)
    finally:
        free_memory(s.device)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    records = [rec for rec in records if rec["step"] <= a.warmup + a.steps]  # not the profiled ones
    res, window_ms = timed_result(path, f"pack-train/{summary.get('attention')}", records, a.warmup, a.steps,
                                  stopped_by_sigterm=bool(summary.get("stopped_by_sigterm")))
    if a.profile_steps:  # pack-train --profile-steps wrote them (trainer.run.profiling)
        res.extra["profile"] = json.loads((run_dir / "profile" / "rank0.json").read_text())
        trace = trace_path(a, path)
        if trace is not None:
            shutil.copyfile(run_dir / "profile" / "rank0.trace.json.gz", trace)
    res.peak_gib = records[-1]["peak_mem_gib"] if s.device.type == "cuda" else None
    lens, planned_tokens = step_seq_lens_of_plan(folder, tokens_per_step, a.seed, a.warmup,
                                                 res.steps)
    if planned_tokens != res.tokens:
        res.note = "; ".join(filter(None, [
            res.note, f"planned {planned_tokens} tokens but pack-train counted {res.tokens}"]))
    res.examples = len(lens)
    res.loss_tokens = loss_tokens_of([r["labels"] for rows in plan_step_rows(folder, tokens_per_step, a.seed,
                                                                              res.steps, a.warmup) for r in rows])
    n_params = int(summary["params"])
    finish_result(res, shape=s.shape, lens=lens, peak_tflops=a.peak_tflops)
    res.extra.update(n_params=n_params, tokens_per_step=tokens_per_step,
                     pack_train_mfu_last=records[-1].get("mfu"), step_ms_per_metrics_window=window_ms)
    shutil.rmtree(run_dir, ignore_errors=True)
    return res


def timed_result(path: str, runner: str, records: Sequence[dict], warmup: int, steps: int, *,
                 stopped_by_sigterm: bool = False) -> tuple[PathResult, list[float]]:
    """The timed steps (warmup+1..warmup+steps) of pack-train's metrics lines, and the mean step of
    each timed line's window in ms. A run that logged fewer timed steps is not a result: SIGTERM
    (a `timeout` around the benchmark) makes pack-train finish its step, save and end, and one
    step's rate would otherwise stand in for the benchmark's.

    >>> recs = [{"step": 3, "tokens": 30, "step_time_s": 2.0, "data_wait_s": 0.0, "loss": 9.0},
    ...         {"step": 4, "tokens": 40, "step_time_s": 0.5, "data_wait_s": 0.0, "loss": 8.0}]
    >>> res, ms = timed_result("packlm-ffd", "pack-train", recs, warmup=3, steps=6)
    >>> res.ok, res.steps, res.tokens, ms, res.note
    (False, 1, 10, [500.0], 'pack-train stopped after 1 of 6 timed steps')
    """
    res = PathResult(path=path, runner=runner)
    prev_step, prev_tokens = 0, 0
    window_ms = []  # the mean step of each timed metrics window (a stall shows in one of them)
    for rec in records:
        n = rec["step"] - prev_step
        if rec["step"] > warmup:
            window_ms.append(round(rec["step_time_s"] * 1000, 1))
            res.steps += n
            res.seconds += rec["step_time_s"] * n
            res.data_wait_s += rec["data_wait_s"] * n
            res.tokens += rec["tokens"] - prev_tokens
            res.final_loss = rec["loss"]
        prev_step, prev_tokens = rec["step"], rec["tokens"]
    if res.steps < steps:
        res.ok = False
        res.note = (f"pack-train stopped after {res.steps} of {steps} timed steps"
                    + (" (SIGTERM)" if stopped_by_sigterm else ""))
    return res, window_ms


def packed_dtype(tunings: Sequence[str], dtype: str) -> str:
    """pack-train's --dtype for a packlm path's tunings (else the run's --dtype)."""
    return next((t for t in ("fp8", "bf16-weights") if t in tunings), dtype)


def run_packed_path(path: str, s: Setup) -> PathResult:
    """A packlm path through `pack-train`'s loop, or the equivalent inline loop."""
    if s.args.packed_runner == "pack-train":
        return run_packed_pack_train(path, s)
    return run_packed_inline(path, s)


# ------------------------------------------------------------------------------------- reporting


def best_hf_same_rows(results: Sequence[PathResult], precision: str | None = None) -> PathResult | None:
    """The fastest `hf-ffd*` path (the peer fed the same rows), of one precision class if given."""
    peers = [r for r in results if r.ok and r.tokens_per_s > 0 and r.path.startswith("hf-ffd")
             and (precision is None or precision_class(r.path) == precision)]
    return max(peers, key=lambda r: r.tokens_per_s, default=None)


def markdown_table(results: Sequence[PathResult]) -> str:
    """Path, precision, tokens/s, step ms, peak GiB, MFU, attention share, data-wait %, ratios: against
    the HF peer fed the same rows (fastest of all, and of the path's precision), the best HF packed
    path and the best padding one."""
    ok = [r for r in results if r.ok and r.tokens_per_s > 0]
    best_hf = max((r.tokens_per_s for r in ok if r.path.startswith(("hf-flat", "hf-ffd"))), default=0.0)
    pad = max((r.tokens_per_s for r in ok if r.path.startswith("hf-pad")), default=0.0)
    same = best_hf_same_rows(results)

    def ratio(r: PathResult, base: float) -> str:
        return f"{r.tokens_per_s / base:.2f}" if base else "n/a"

    head = ("| path | precision | runner | tokens/step | tokens/s | step ms | peak GiB | MFU | HFU "
            "| attn FLOP share | data-wait % | x HF same rows | x HF same rows, same precision "
            "| x best HF packed | x best padding |\n"
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in results:
        if not r.ok:
            lines.append(f"| {r.path} | {precision_class(r.path)} | {r.runner} | skipped: {r.note} "
                         "| | | | | | | | | | | |")
            continue
        peak = f"{r.peak_gib:.1f}" if r.peak_gib is not None else "n/a"
        same_precision = best_hf_same_rows(results, precision_class(r.path))
        lines.append(
            f"| {r.path} | {precision_class(r.path)} | {r.runner} | {r.tokens / max(r.steps, 1):,.0f} | "
            f"{r.tokens_per_s:,.0f} | {r.step_ms:.0f} | {peak} | {100 * r.mfu:.1f}% | "
            f"{100 * r.hfu:.1f}% | {100 * r.attn_share:.1f}% | {r.data_wait_pct:.2f} | "
            f"{ratio(r, same.tokens_per_s if same else 0)} | "
            f"{ratio(r, same_precision.tokens_per_s if same_precision else 0)} | "
            f"{ratio(r, best_hf)} | {ratio(r, pad)} |"
        )
    return "\n".join(lines)


def target_lines(results: Sequence[PathResult]) -> list[str]:
    """Issue 38's targets, checked against this run's numbers: every packlm-ffd path against the HF
    peer fed the same rows (all precisions, and its own); fp8 against bf16-weights of the same run;
    the bf16 ffd MFU; the packlm paths' data wait."""
    ok = [r for r in results if r.ok and r.tokens_per_s > 0]
    by_path = {r.path: r for r in ok}
    lines = []
    same = best_hf_same_rows(results)
    for r in ok:
        if split_path(r.path)[0] != "packlm-ffd" or same is None:
            continue
        own = best_hf_same_rows(results, precision_class(r.path))
        lines.append(f"{r.path} vs best HF same rows ({same.path}): {r.tokens_per_s / same.tokens_per_s:.2f}x"
                     + (f"; vs same precision ({own.path}): {r.tokens_per_s / own.tokens_per_s:.2f}x" if own else ""))
    fp8, bf16 = by_path.get("packlm-ffd+fp8"), by_path.get("packlm-ffd+bf16-weights")
    if fp8 and bf16:
        x = fp8.tokens_per_s / bf16.tokens_per_s
        lines.append(f"packlm-ffd+fp8 vs packlm-ffd+bf16-weights: {x:.2f}x (target >= 1.25x on the 8B shape): "
                     f"{'MET' if x >= 1.25 else 'NOT MET'}")
    if fp8 and same:
        x = fp8.tokens_per_s / same.tokens_per_s
        lines.append(f"packlm-ffd+fp8 vs best HF same rows: {x:.2f}x (target >= 1.3x): "
                     f"{'MET' if x >= 1.3 else 'NOT MET'}")
    bf16_ffd = [r for r in ok if split_path(r.path)[0] == "packlm-ffd" and precision_class(r.path) != "fp8"]
    if bf16_ffd:
        best = max(bf16_ffd, key=lambda r: r.mfu)
        mfu = 100 * best.mfu
        lines.append(f"{best.path} MFU {mfu:.1f}% (target >= 60% in bf16): {'MET' if mfu >= 60 else 'NOT MET'}")
    waits = [r for r in ok if r.path.startswith("packlm")]
    if waits:
        worst = max(waits, key=lambda r: r.data_wait_pct)
        lines.append(f"data-wait of packlm paths <= {worst.data_wait_pct:.2f}% of step time "
                     f"(target < 1%): {'MET' if worst.data_wait_pct < 1 else 'NOT MET'}")
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="llama-1b", help="packlm preset (tests: tiny)")
    p.add_argument("--steps", type=int, default=30, help="timed optimizer steps per path")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per path before timing")
    p.add_argument("--paths", default=",".join(DEFAULT_PATHS),
                   help=f"comma separated, of {','.join(ALL_PATHS)}; an HF path may add +TUNING "
                        f"({', '.join(HF_TUNINGS)}; +liger last), a packlm path +{'/+'.join(PACKED_TUNINGS)}")
    p.add_argument("--json", type=Path, default=None, help="write all results here")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "packlm-bench")
    p.add_argument("--shared", type=Path, default=None,
                   help="shared data folder (default $SHARED, .devcarry/shared or ../shared)")
    p.add_argument("--tokenizer", type=Path, default=None, help="default SHARED/tokenizers/llama2")
    p.add_argument("--limit", type=int, default=None, help="first N examples of each dataset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--group", type=int, default=32, help="examples per step (padding/minibatch)")
    p.add_argument("--max-len", type=int, default=8192, help="pack-data --max-len")
    p.add_argument("--ffd-tokens", type=int, default=16384,
                   help="tokens per optimizer step on the ffd path (whole rows; 16384, pack-train's "
                        "default --tokens-per-step, is two full 8192-token rows)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="bf16 = autocast over fp32 weights for every path")
    p.add_argument("--attn", default="auto", help="packlm attention backend (build_model attn=)")
    p.add_argument("--fp8-recipe", default="rowwise_with_gw_hp",
                   choices=("rowwise_with_gw_hp", "rowwise", "tensorwise"),
                   help="torchao float8 recipe of +fp8 paths, HF and packlm alike (pack-train --fp8-recipe)")
    p.add_argument("--packed-runner", choices=("auto", "pack-train", "inline"), default="auto")
    p.add_argument("--compile", action="store_true", help="pack-train --compile (per-layer)")
    p.add_argument("--lora-r", type=int, default=0, help="LoRA rank on every path (0: full fine-tune)")
    p.add_argument("--optimizer", choices=("adamw", "adafactor"), default="adamw",
                   help="every path's optimizer (pack-train --optimizer; torch.optim.Adafactor on HF paths)")
    p.add_argument("--grad-checkpointing", nargs="?", const=1, default=0, type=int, metavar="N",
                   help="activation checkpointing of every decoder layer on every path, or with N of "
                        "every Nth one (layers 0, N, 2N, ...)")
    p.add_argument("--activation-memory-budget", type=float, default=1.0, metavar="F",
                   help="torch.compile's activation memory budget on every compiled path (pack-train "
                        "--activation-memory-budget; HF paths compile under the same setting)")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="profile this many more steps of each path after its timed ones (torch.profiler) "
                        "and report GPU time by kernel kind, top kernels, GPU idle time by gap length "
                        "with the longest gaps, and the host's busiest operators and waits for the GPU")
    p.add_argument("--profile-trace", default=None, metavar="DIR",
                   help="with --profile-steps: write each path's Chrome trace of those steps into DIR as "
                        "PATH.json.gz, '+' written '_' (for chrome://tracing or Perfetto); the HF and inline "
                        "paths also record Python stacks (which slows the host down), pack-train's do not")
    p.add_argument("--pack-procs", type=int, default=max(1, min(8, (os.cpu_count() or 1) // 4)),
                   help="pack-data --num-proc")
    p.add_argument("--num-workers", type=int, default=2, help="pack-train DataLoader workers")
    p.add_argument("--peak-tflops", type=float, default=H100_BF16_TFLOPS,
                   help="dense bf16 peak for MFU (H100 SXM: 989)")
    args = p.parse_args(argv)
    if args.json:
        check_output(args.json, "--json")
    args.paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    known = [(HF_PATHS, HF_TUNINGS), (PACKED_PATHS, PACKED_TUNINGS)]
    unknown = [x for x in args.paths if not any(
        split_path(x)[0] in bases and set(split_path(x)[1]) <= set(tunings) for bases, tunings in known)]
    if unknown:
        p.error(f"unknown path(s) {unknown}: choose from {','.join(ALL_PATHS)} (HF ones with "
                f"+{'/+'.join(HF_TUNINGS)}, packlm ones with +{'/+'.join(PACKED_TUNINGS)})")
    liger = [k for k, x in enumerate(args.paths) if "liger" in split_path(x)[1]]
    if liger and liger[0] != len(args.paths) - len(liger):
        p.error("+liger paths must come last: Liger patches transformers' Llama classes for the rest of the run")
    return args


def main(argv: Sequence[str] | None = None) -> list[PathResult]:
    args = parse_args(argv)
    device = resolve_device(args.device)
    shared = args.shared or shared_dir()
    t0 = time.perf_counter()
    print(f"# bench_train: model={args.model} device={device} steps={args.steps} "
          f"warmup={args.warmup} dtype={args.dtype} (bf16 = autocast, fp32 weights)")
    print(f"preparing data in {args.workdir} (shared={shared}, limit={args.limit})")
    folders = prepare_data(args.workdir, shared, limit=args.limit, seed=args.seed,
                           max_len=args.max_len, tokenizer=args.tokenizer,
                           num_proc=args.pack_procs)
    vocab_size, pad_id = tokenizer_ids(folders["pad"])
    groups = minibatch_groups(folders["minibatch"], args.group)
    group_ids = [group_example_ids(g) for g in groups]
    examples = examples_by_id(folders["pad"])
    config = model_config(args.model, vocab_size)
    setup = Setup(args, device, folders, groups, group_ids, examples, pad_id, vocab_size,
                  shape=flop_shape(config, args.lora_r, args.grad_checkpointing))
    if args.packed_runner == "auto":
        try:
            from trainer import TrainConfig, train  # noqa: F401

            args.packed_runner = "pack-train"
        except ImportError as exc:
            print(f"NOTE: trainer.run.loop is not importable ({exc}); packlm paths run the equivalent "
                  "inline loop (build_model + collate_rows + packed_loss)")
            args.packed_runner = "inline"
    mean_tokens = np.mean([sum(len(r["input_ids"]) for r in g) for g in groups])
    print(f"data ready in {time.perf_counter() - t0:.1f} s: {len(examples)} examples, "
          f"{len(groups)} groups of {args.group} (mean {mean_tokens:.0f} tokens/group), "
          f"vocab {vocab_size}, packed runner {args.packed_runner}")
    results: list[PathResult] = []

    def save(table: str, targets: list[str]) -> None:
        """The JSON report so far: written after every path, so a run cut short keeps its results."""
        if args.json:
            write_json(args.json, {
                "config": jsonable(args),
                "machine": machine_summary(),
                "device_name": device_name(device),
                "torch": torch.__version__,
                "mean_tokens_per_group": float(mean_tokens),
                "results": [asdict(r) for r in results],
                "table": table,
                "targets": targets,
                "wall_s": time.perf_counter() - t0,
            })

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
            res = PathResult(path=path, runner=HF_ATTN.get(split_path(path)[0], args.packed_runner), ok=False,
                             note=f"{type(exc).__name__}: {first}")
        free_memory(device)  # here, once the traceback (and the model it holds) is gone
        print(f"  {path}: {res.tokens_per_s:,.0f} tokens/s, {res.step_ms:.0f} ms/step "
              f"({time.perf_counter() - t_path:.1f} s){'' if res.ok else ' SKIPPED ' + res.note}")
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
