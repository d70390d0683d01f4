"""Before the first step on a GPU: does the run's largest micro-batch fit in memory? Measured, not
guessed: steps of the run's own model, wrapper and options on synthetic rows, extrapolated.

With a varlen attention kernel (flash_attn, fa4: no T x T matrix) each phase of a step holds memory
on a line in the micro-batch's tokens T: weights, gradients and fixed buffers (a loss chunk's
logits, an MLP tile) in its intercept, the activations in its slope. The step's peak is the largest
of those lines: a convex function of T, which the loss chunk's constant logits rule at short rows
and the layers' activations at long ones. So `check_fits` runs two forward + backward passes of P
and 2P tokens per rank, P an eighth of the largest micro-batch's share (and at least past the
logits the loss keeps whole and two --tile-mlp tiles), and extends the line through their peaks to
the largest micro-batch, adding the optimizer states the first step will allocate. Extending a
chord of a convex function gives at most what the function reaches: the need it reads is a lower
bound, so a refused row never fits, and the longest length it names is an upper bound. A largest
micro-batch of at most 2P tokens is measured as it is.

Worked example (round numbers): an 8B LoRA step peaks at 30 GiB with P = 32,768 tokens and 40 GiB
with 65,536: 0.31 MiB a token. A 262,144-token row then needs at least 40 + 10 x 6 = 100 GiB; an 80
GB H100 offers about 74 (95% of 77.9): the run stops in one line naming that row and at most about
65,536 + 34 / 10 x 32,768 = 176,000 tokens as the longest row that could fit.

Under --context-parallel N each rank holds 1/N of a row, so the line is per rank and the row's
length N times its share. With --offload-activations the tensors saved for the backward wait in
pinned host memory: the bytes the probes move there (`HostOffload.moved`, counted as they are
copied: each is a layer's input or another tensor of a size fixed per token) lie on a line in T too,
and a row whose count exceeds the host memory a rank has is refused like one the GPU cannot hold.
Under --offload-states the optimizer states and gradients still to come in host memory are added to
that count, and taken out of the GPU's.
The count is what the row needs at the least: torch's pinned allocator rounds each block up to a
power of two, so the host may hold up to twice that. The offload's backward copies the next layer's
input back ahead of need (`HostOffload.prefetch`); the probes measure what that holds
(`HostOffload.ahead`, a line too), and a row that fits only without it trains without it. The
probes leave no trace in the run: gradients are zeroed and the random number generators restored,
so the steps that follow are those of a run without the check.

The weights count as they sit on the GPU, measured with the rest: a --qlora base at about half a
byte a weight, an --int8-base one at 1 byte a weight plus a float32 scale per row, each with the one
layer's weight a matmul dequantizes at a time.

The first step allocates the optimizer's states after its backward, so its peak can be below the
need read here, which is that of every later step (whose backward runs beside those states).
"""

from __future__ import annotations

import functools
import math
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from pipeline.contract import UserError
from trainer.data.batch import MicroBatch, collate_flat
from trainer.data.row_split import shard_microbatch
from trainer.data.stream import Largest
from trainer.model.long_rows import PINNED, HostOffload
from trainer.model.loss import KEEP_LOGITS_UP_TO
from trainer.run.state import Run

Step = Callable[[MicroBatch], None]
Measure = Callable[[Step, MicroBatch, torch.device], tuple[int, int, int]]

MARGIN = 0.95  # the share of a GPU's memory a step may plan to use: the rest is slack
# for the allocator's fragmentation and what other libraries take later
ROUND = 1024  # the longest length that fits is named rounded down to this (when at least this)


@dataclass(frozen=True)
class Need:
    """Memory a micro-batch of `tokens` needs on each GPU (and in host memory with offloading), from
    the measured line `intercept + per_token x tokens` (bytes, tokens per rank)."""

    gpu: int
    host: int
    gpu_line: tuple[float, float]  # (intercept, per token) on the GPU
    host_line: tuple[float, float]
    probes: tuple[int, ...]  # the measured tokens per rank
    ahead: int = 0  # of `gpu`: what the offload's copies back hold ahead of the backward (HostOffload.ahead)
    ahead_line: tuple[float, float] = (0.0, 0.0)

    def without_prefetch(self) -> Need:
        """The need with the offload's read-ahead off (`HostOffload.prefetch = False`): its bytes,
        measured at the probes, taken from the GPU's. At any moment the run without it holds what
        the run with it holds less the tensors copied back early, so this is a lower bound too."""
        line = (self.gpu_line[0] - self.ahead_line[0], max(0.0, self.gpu_line[1] - self.ahead_line[1]))
        return replace(self, gpu=self.gpu - self.ahead, gpu_line=line, ahead=0, ahead_line=(0.0, 0.0))


def probe_tokens(vocab: int, tile_mlp: int, largest_local: int = 0) -> int:
    """P: per rank, the shorter of the two measured steps (see the module): an eighth of the
    largest micro-batch's share, past the logits the loss keeps whole, two --tile-mlp tiles at
    least, 8,192 at least, a multiple of 4,096."""
    low = max(8192, KEEP_LOGITS_UP_TO // max(vocab, 1) + 1, 2 * tile_mlp, -(-largest_local // 8))
    return -(-low // 4096) * 4096


def synthetic_row(tokens: int, vocab: int) -> MicroBatch:
    """One example of `tokens` tokens (ids spread over the vocabulary, every token a loss token but
    the first), drawn from no random generator."""
    ids = (np.arange(tokens, dtype=np.int64) * 7919 + 1) % vocab
    labels = ids.copy()
    labels[0] = -100
    return collate_flat(ids, labels, np.arange(tokens, dtype=np.int64), np.array([tokens]))


def fit_line(points: list[tuple[int, int]]) -> tuple[float, float]:
    """(intercept, slope) of the line through one or two (tokens, bytes) points; one point is a
    line of slope 0 (it was measured at the micro-batch itself)."""
    if len(points) == 1:
        return float(points[0][1]), 0.0
    (t1, b1), (t2, b2) = points
    slope = max(0.0, (b2 - b1) / (t2 - t1))
    return b2 - slope * t2, slope


def longest_fitting(line: tuple[float, float], capacity: float) -> int | None:
    """Tokens per rank the line allows within `capacity` bytes, or None where each token adds none."""
    intercept, slope = line
    if slope <= 0:
        return None
    return max(0, math.floor((capacity - intercept) / slope))


def _local_params(optimizer: torch.optim.Optimizer) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each parameter the optimizer steps, with the tensor this rank holds of it (its shard, under FSDP2)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            yield p, (p.to_local() if hasattr(p, "to_local") else p)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, where: str = "cuda") -> int:
    """The bytes of the states the optimizer's first step will allocate on the `where` device type
    (0 where it has them, as after a resume): AdamW's two moments per parameter, in its dtype (a
    sharded parameter: its shard); Adafactor's row and column statistics of a matrix, a vector's
    second moment (fp32). States go where their parameter lives: CPU memory under --offload-states."""
    total = 0
    adafactor = isinstance(optimizer, torch.optim.Adafactor)
    for p, local in _local_params(optimizer):
        if optimizer.state.get(p) or local.device.type != where:
            continue
        if adafactor:
            total += 4 * (local.shape[-2] + local.shape[-1] if local.dim() >= 2 else local.numel())
        else:
            total += 2 * local.numel() * local.element_size()
    return total


def host_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Under --offload-states, what the first step will still allocate in host memory for the
    parameters kept there: their optimizer states and the gradients they do not hold yet."""
    grads = sum(
        local.numel() * local.element_size() for p, local in _local_params(optimizer) if local.device.type == "cpu" and p.grad is None
    )
    return optimizer_state_bytes(optimizer, "cpu") + grads


def gpu_capacity(device: torch.device) -> int:
    """Bytes this process may hold on `device`: what is free plus what its allocator holds already,
    and no more than `torch.cuda.set_per_process_memory_fraction` lets the allocator reserve (a GPU
    shared with other work, or a benchmark standing in for a smaller card)."""
    free, total = torch.cuda.mem_get_info(device)
    capacity = int(free + torch.cuda.memory_reserved(device))
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # older torch: no getter
    if fraction is None:
        return capacity
    index = torch.cuda.current_device() if device.index is None else device.index  # as the setter, it wants one
    return min(capacity, int(fraction(index) * total))


def host_capacity() -> int | None:
    """Bytes of host memory available to each rank on this host (MemAvailable over the local ranks,
    plus the pinned memory torch holds already), or None where /proc/meminfo does not say."""
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
            held = int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
            return (available + held) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return None


def empty_caches() -> None:
    """Hand the blocks torch's GPU and pinned-host allocators keep cached back, and those the
    offload's pool keeps (`PINNED`), so that a probe's peak counts its own blocks only, the host
    memory read after it is free again, and the training after the probes starts without theirs (a
    cached pinned block serves only requests of its own power-of-two size)."""
    PINNED.clear()
    torch.cuda.empty_cache()
    empty_host = getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if empty_host is not None:
        empty_host()


def measure_peaks(step: Step, batch: MicroBatch, device: torch.device) -> tuple[int, int, int]:
    """(GPU bytes at the peak of `step(batch)`, allocated, not cached; bytes its forward moved to
    host memory with --offload-activations, 0 without; the most bytes its backward copied back from
    there ahead of need, `HostOffload.ahead`)."""
    torch.cuda.synchronize(device)
    empty_caches()
    torch.cuda.reset_peak_memory_stats(device)
    HostOffload.moved = HostOffload.ahead = 0
    step(batch)
    torch.cuda.synchronize(device)
    moved, ahead = HostOffload.moved, HostOffload.ahead
    empty_caches()
    return int(torch.cuda.max_memory_allocated(device)), int(moved), int(ahead)


def measure_need(
    step: Step,
    clear: Callable[[], None],
    largest_local: int,
    *,
    vocab: int,
    tile_mlp: int,
    cp_rank: int,
    cp_size: int,
    device: torch.device,
    measure: Measure = measure_peaks,
) -> Need:
    """Run the probes (`step` on synthetic rows of this rank's share, then `clear`), fit the lines
    and evaluate them at `largest_local` tokens per rank."""
    p = probe_tokens(vocab, tile_mlp, largest_local)
    probes = (largest_local,) if largest_local <= 2 * p else (p, 2 * p)
    gpu_points, host_points, ahead_points = [], [], []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for tokens in probes:
            row = synthetic_row(tokens * cp_size, vocab)
            gpu, host, ahead = measure(step, shard_microbatch(row, cp_rank, cp_size), device)
            clear()
            gpu_points.append((tokens, gpu))
            host_points.append((tokens, host))
            ahead_points.append((tokens, ahead))
    gpu_line, host_line, ahead_line = fit_line(gpu_points), fit_line(host_points), fit_line(ahead_points)
    at = float(largest_local)
    return Need(
        gpu=int(gpu_line[0] + gpu_line[1] * at),
        host=int(host_line[0] + host_line[1] * at),
        gpu_line=gpu_line,
        host_line=host_line,
        probes=probes,
        ahead=int(ahead_line[0] + ahead_line[1] * at),
        ahead_line=ahead_line,
    )


def size(n: float) -> str:
    """Bytes as people read them: '61.2 GiB', '3.0 MiB'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= 0.1 * scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} bytes"


def _levers(tile_mlp: int, offload: bool, checkpointing: int, offload_states: bool | None = None) -> str:
    """The options that make a long row fit, less those already in use (`offload_states` None: that
    one does not apply, as for LoRA, whose optimizer states are small)."""
    levers = ["--context-parallel N (over N GPUs)"]
    if not checkpointing:
        levers.append("--grad-checkpointing")
    if not tile_mlp:
        levers.append("--tile-mlp 8192")
    if not offload:
        levers.append("--offload-activations")
    if offload_states is False:
        levers.append("--parallel fsdp --offload-states")
    return ", ".join(levers)


def verdict(
    largest: Largest,
    need: Need,
    optimizer_bytes: int,
    gpu_cap: int,
    host_cap: int | None,
    *,
    cp_size: int,
    tokens_per_step: int,
    data: str,
    tile_mlp: int,
    offload: bool,
    checkpointing: int,
    host_fixed: int = 0,
    offload_states: bool | None = None,
    keep_attention: bool = False,
) -> tuple[str | None, str]:
    """(the one-line refusal or None, the start-up line saying what the largest micro-batch needs).
    Bytes per rank. The GPU's need (with the optimizer states it will hold) is held against
    `gpu_cap`; the bytes moved to host memory (--offload-activations), plus `host_fixed` (what
    --offload-states will still allocate there), against `host_cap` (None: not checked, where
    nothing is offloaded or the host does not say what it has). Each against MARGIN of what there is."""
    gpu_need = need.gpu + optimizer_bytes
    host_need = need.host + host_fixed
    host = host_cap is not None and host_need > 0
    gpu_short = gpu_need > MARGIN * gpu_cap
    host_short = host and host_need > MARGIN * host_cap
    allowed = [longest_fitting((need.gpu_line[0] + optimizer_bytes, need.gpu_line[1]), MARGIN * gpu_cap)]
    if host:
        allowed.append(longest_fitting((need.host_line[0] + host_fixed, need.host_line[1]), MARGIN * host_cap))
    bounds = [a for a in allowed if a is not None]
    longest = min(bounds) * cp_size if bounds else None
    if longest is not None and longest >= ROUND:
        longest = longest // ROUND * ROUND
    if len(need.probes) == 1:
        measured, rate = f"a step of {need.probes[0] * cp_size:,} tokens", ""
    else:
        measured = f"steps of {' and '.join(f'{t * cp_size:,}' for t in need.probes)} tokens"
        rate = f" ({size(need.gpu_line[1])} a token)"
    host_said = (
        (
            f"; what it offloads needs at least {size(host_need)} more of the {size(host_cap)} of host "
            f"memory each rank has (blocks under 1 GiB take up to twice their size in torch's pinned "
            f"allocator)"
        )
        if host
        else ""
    )
    info = (
        f"the largest micro-batch ({largest.tokens:,} tokens) needs at least {size(gpu_need)} of the "
        f"{size(gpu_cap)} a GPU holds"
        + (f" (the longest that could fit: at most about {longest:,} tokens)" if longest is not None else "")
        + f", measured from {measured}{rate}"
        + host_said
    )
    if not (gpu_short or host_short):
        return None, info
    shortfalls = []
    if gpu_short:
        shortfalls.append(f"{size(gpu_need)} on each GPU, which holds {size(gpu_cap)}")
    if host_short:
        shortfalls.append(f"{size(host_need)} of host memory for what each rank offloads, which has {size(host_cap)}")
    where = " and ".join(shortfalls)
    rest = need.gpu_line[0] + optimizer_bytes if gpu_short else need.host_line[0] + host_fixed
    fit = f"at most about {longest:,} tokens" if longest else f"none (the rest of the step alone needs about {size(rest)})"
    remedies = []
    if gpu_short:
        if keep_attention:  # its kept attention outputs are the first memory to give back
            remedies.append("drop --keep-attention")
        remedies.append(f"use {_levers(tile_mlp, offload, checkpointing, offload_states)}")
    if host_short:
        remedies.append("give each rank more host memory (fewer ranks a machine, or --context-parallel over several machines)")
    remedy = " and ".join(remedies)
    if largest.row is not None:
        return (
            f"{data}: {largest.row} holds {largest.tokens:,} tokens, which need at least {where} (measured from "
            f"{measured}); the longest row that could fit is {fit}: to train it, {remedy}; "
            f"or pack with a lower --max-len"
        ), info
    return (
        f"--tokens-per-step {tokens_per_step}: a micro-batch of {largest.tokens:,} tokens needs at least {where} "
        f"(measured from {measured}); the most that could fit is {fit}: lower --tokens-per-step, "
        f"or {remedy}"
    ), info


def agree(line: str | None, info_enabled: bool, device: torch.device) -> bool:
    """True when this rank or any other found a micro-batch too large (one all-reduce), so every
    rank stops together."""
    flag = torch.tensor([0 if line is None else 1], device=device)
    if info_enabled:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def applies(run: Run) -> bool:
    """The check runs where memory is the GPU's (on the CPU a row's step uses the host's, unmeasured)."""
    return run.device.type == "cuda"


def check_fits(run: Run, step: Step, clear: Callable[[], None]) -> None:
    """The check (see the module) for a `trainer.run.state.Run`: returns, having printed on rank 0 what
    the largest micro-batch needs, or raises the one-line UserError on every rank. `step(batch)` is
    the loop's forward + backward of one micro-batch; `clear()` zeroes the gradients."""
    config, layout = run.config, run.layout
    HostOffload.prefetch = True  # measured with the read-ahead; turned off below where only that fits
    vocab = int(run.model.get_input_embeddings().num_embeddings)
    largest_local = -(-run.largest.tokens // layout.cp_size)
    need = measure_need(
        step,
        clear,
        largest_local,
        vocab=vocab,
        tile_mlp=config.tile_mlp,
        cp_rank=layout.cp_rank,
        cp_size=layout.cp_size,
        device=run.device,
        measure=measure_peaks,
    )
    gpu_cap, host_cap = gpu_capacity(run.device), host_capacity()
    offloads = config.offload_activations or config.offload_states
    judge = functools.partial(
        verdict,
        largest=run.largest,
        optimizer_bytes=optimizer_state_bytes(run.optimizer, run.device.type),
        gpu_cap=gpu_cap,
        host_cap=host_cap if offloads else None,
        cp_size=layout.cp_size,
        tokens_per_step=config.tokens_per_step,
        data=str(config.data),
        tile_mlp=config.tile_mlp,
        offload=config.offload_activations,
        checkpointing=int(config.grad_checkpointing),
        host_fixed=host_state_bytes(run.optimizer) if config.offload_states else 0,
        offload_states=None if config.lora_r else config.offload_states,
        keep_attention=config.keep_attention,
    )
    line, info = judge(need=need)
    if line is not None and need.ahead > 0:  # without the offload's read-ahead, if that fits
        lean_line, lean_info = judge(need=need.without_prefetch())
        if lean_line is None:
            HostOffload.prefetch = False
            lean_info += (
                f"; no room to copy {size(need.ahead)} of saved tensors back ahead of the backward: each comes back as it is needed"
            )
        line, info = lean_line, lean_info
    if agree(line, run.info.enabled, run.device):
        raise UserError(line or "another rank's largest micro-batch does not fit its GPU (its line says why)")
    if run.info.rank == 0:
        print(f"pack-train: memory: {info}", file=sys.stderr)
