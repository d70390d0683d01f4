"""The training benchmarks' step loop: batches prepared as thunks (HF padding or flattening, the
same rows as pack-train, packlm's own collation), the HF and packlm step functions, and the timed
loop that counts real tokens, data wait and (optionally) a profile of extra steps."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.run.profiling import finish_profile, new_profiler

from .train_results import PathResult, loss_tokens_of
from .training import autocast_ctx, optimizer_step, pad_collate, sync, to_device


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
    *,
    warmup: int,
    steps: int,
    device: torch.device,
    profile_steps: int = 0,
    trace: Path | None = None,
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
            raise SystemExit(f"ran out of data after {i} steps: lower --steps/--warmup or raise --limit") from None
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


def flatten_collate(examples: Sequence[dict[str, np.ndarray]], *, flash_kwargs: bool = False) -> dict[str, Any]:
    """The same examples through HF's own `DataCollatorWithFlattening` (input_ids, labels,
    position_ids as a [1, T] batch), exactly as the packing paper ships it. With `flash_kwargs`
    (the flash_attention_2 paths) it also returns the boundaries, `cu_seq_lens_q/k` and
    `max_length_q/k` (Python ints), as a skilled user asks it to (`return_flash_attn_kwargs=True`):
    without them transformers derives them from `position_ids` in every layer, with a host sync
    (`max_length.item()`) and a graph break there."""
    from transformers import DataCollatorWithFlattening

    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    return collator([{"input_ids": e["input_ids"], "labels": e["labels"]} for e in examples], return_tensors="pt")


def real_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Non-padding tokens of an HF batch."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return int(batch["input_ids"].numel())


def hf_step_fn(model, opt, device: torch.device, dtype: str) -> Callable[[Any], torch.Tensor]:
    """Standard HF training step: forward with labels= (HF's loss), backward, AdamW."""

    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with autocast_ctx(device, dtype):
            loss = model(**batch).loss
        optimizer_step(model, opt, loss)
        return loss

    return step


def hf_batches(
    groups: Sequence[Sequence[int]],
    examples: dict[int, dict[str, np.ndarray]],
    *,
    flatten: bool,
    pad_id: int,
    device: torch.device,
    flash_kwargs: bool = False,
) -> Iterator[Callable[[], Batch]]:
    """One thunk per group: collate (padding or HF flattening, `flatten_collate`) and copy to the
    device."""
    for ids in groups:

        def thunk(ids: Sequence[int] = ids) -> Batch:
            exs = [examples[i] for i in ids]
            host = flatten_collate(exs, flash_kwargs=flash_kwargs) if flatten else pad_collate(exs, pad_id)
            lens = np.array([len(e["input_ids"]) for e in exs], dtype=np.int64)
            return Batch(to_device(host, device), real_tokens(host), lens, len(exs), loss_tokens_of([e["labels"] for e in exs]))

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
        out.extend({"input_ids": row["input_ids"][a:b], "labels": row["labels"][a:b]} for a, b in zip(edges[:-1], edges[1:]))
    return out


def hf_row_batches(
    steps: Sequence[Sequence[dict[str, np.ndarray]]], device: torch.device, *, flash_kwargs: bool = False
) -> Iterator[Callable[[], Batch]]:
    """One thunk per step of packed rows: their examples through HF's flattening collator (one
    [1, T] row, restarting position_ids, -100 at each example's first label) and to the device.
    Every step is collated before the first one runs (pinned on CUDA), as a DataLoader's workers
    would have it ready, so the peer's time holds no host collation."""
    ready = []
    for rows in steps:
        host = flatten_collate(row_examples(rows), flash_kwargs=flash_kwargs)
        if device.type == "cuda":
            host = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in host.items()}
        ready.append((host, np.concatenate([r["seq_lens"] for r in rows]).astype(np.int64), loss_tokens_of([r["labels"] for r in rows])))
    for host, lens, loss in ready:

        def thunk(host: dict[str, torch.Tensor] = host, lens: np.ndarray = lens, loss: int = loss) -> Batch:
            return Batch(to_device(host, device), real_tokens(host), lens, len(lens), loss)

        yield thunk


def packed_batches(steps: Sequence[Sequence[dict[str, np.ndarray]]], device: torch.device) -> Iterator[Callable[[], Batch]]:
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


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


def hf_fp8(layers: Sequence[torch.nn.Module], recipe: str) -> None:
    """torchao's float8 training on every linear layer of these decoder layers whose dimensions
    are multiples of 16 (LoRA adapters left alone), as a Hugging Face user applies it; the inner
    dimension padded to 16 (a flattened step's token count is any number)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), pad_inner_dim=True)

    def take(module: torch.nn.Module, fqn: str) -> bool:
        return isinstance(module, torch.nn.Linear) and "lora_" not in fqn and module.in_features % 16 == 0 and module.out_features % 16 == 0

    for layer in layers:
        convert_to_float8_training(layer, module_filter_fn=take, config=config)


def hf_lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """`model` with peft LoRA adapters (rank, alpha 16, every linear layer of the decoder) as a
    Hugging Face user adds them, the frozen base weights stored in bf16 (the adapters stay fp32)."""
    from peft import LoraConfig, get_peft_model

    from trainer.model.lora import freeze_in_bf16

    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"))
    freeze_in_bf16(model)
    return model
