"""Where a training step's time goes: torch.profiler over chosen steps, summarised per step.

`pack-train --profile-steps 6-8` profiles steps 6 to 8 on every rank (`StepProfiler`, driven by
`trainer.run.loop` after each optimizer step) and writes, per rank, `RUN/profile/rank{r}.json` (the
summary: GPU milliseconds per step by kernel kind, the top kernels, the GPU's idle share and the
gaps between kernels, the host's top operators and the calls that wait for the GPU) and
`RUN/profile/rank{r}.trace.json.gz` (the Chrome trace, for chrome://tracing or Perfetto).
`scripts/bench/bench_train.py` profiles its Hugging Face paths with the same functions.

Example of a summary's heart, from an H100 (8B LoRA step, every second layer checkpointed)::

    "ms_per_step_by_kind": {"matmul": 897.4, "other": 124.9, "attention": 63.2, "copy/cast": 52.5, ...}
    "gpu_idle_share": 0.017
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


class StepProfiler:
    """torch.profiler over optimizer steps `first`..`last` of this rank: `after_step(step)` after
    each step's optimizer update starts it once step `first - 1` is done and stops it after step
    `last`, then writes `out/rank{rank}.json` (`profile_summary`) and the gzipped Chrome trace."""

    def __init__(self, steps: tuple[int, int], device: torch.device, out: Path, rank: int) -> None:
        self.first, self.last = steps
        self.device, self.out, self.rank = device, Path(out), rank
        self.prof = new_profiler(device, trace=None)
        self.running = False

    def after_step(self, step: int) -> None:
        if step == self.first - 1 and not self.running:
            self._sync()
            self.prof.start()
            self.running = True
        elif step == self.last and self.running:
            self._sync()
            self.prof.stop()
            self.running = False
            self._write()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        trace = self.out / f"rank{self.rank}.trace.json.gz"  # torch gzips a path ending in .gz
        summary = {
            "steps": [self.first, self.last],
            "rank": self.rank,
            **finish_profile(self.prof, self.last - self.first + 1, self.device, trace),
        }
        (self.out / f"rank{self.rank}.json").write_text(json.dumps(summary, indent=1) + "\n")


def new_profiler(device: torch.device, trace: Path | None) -> Any:
    """A torch.profiler of the host and, on CUDA, the GPU; with Python stacks only when a `trace`
    is asked for (stacks slow the host down)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return profile(activities=activities, with_stack=trace is not None)


def finish_profile(prof: Any, steps: int, device: torch.device, trace: Path | None) -> dict[str, Any]:
    """`profile_summary` of a stopped profiler's `steps` steps; its Chrome trace to `trace` if given."""
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    return profile_summary(prof, steps, device)


# GPU kernels by kind, matched in order on the lower-cased kernel name. NCCL's kernels (all-reduce,
# all-gather, reduce-scatter) run on their own stream beside the compute. Inductor names a kernel after
# its operations: the compiled AdamW update of --dtype bf16-weights (trainer.model.precision) holds "lerp"
# (AdamW's first moment; nothing else in these models lerps), and "_to_copy" too.
KERNEL_KINDS = (
    ("communication", ("nccl",)),
    ("attention", ("flash", "fmha", "flex", "attention")),
    ("optimizer", ("adam", "foreach", "multi_tensor", "lerp")),
    ("matmul", ("gemm", "cutlass", "sm90_xmma", "nvjet", "matmul", "wgmma")),
    ("cross-entropy", ("cross_entropy", "log_softmax", "nll_loss")),
    ("copy/cast", ("copy", "cast", "to_copy")),
)


def kernel_kind(name: str) -> str:
    """The KERNEL_KINDS kind of a GPU kernel's name, else "other" (fused elementwise work, norms)."""
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(key in low for key in keys)), "other")


def profile_summary(prof: Any, steps: int, device: torch.device, top: int = 12) -> dict[str, Any]:
    """Per step: GPU ms by kernel kind (KERNEL_KINDS, else "other": fused elementwise and norms),
    the top kernels, and the GPU's idle share of the wall time (gaps between kernels). The busy
    time, the idle share and the gaps count compute kernels only: communication kernels overlap
    them on their own stream, and their time is the "communication" kind."""
    # kernels only: a user annotation's GPU range ("Optimizer.step#AdamW.step") spans kernels
    # counted on their own
    events = [
        e
        for e in prof.events()
        if e.device_type.name == ("CUDA" if device.type == "cuda" else "CPU")
        and (device.type != "cuda" or e.device_time > 0)
        and not getattr(e, "is_user_annotation", False)
        and "#" not in e.name
    ]
    if device.type != "cuda":
        return {"note": "kernel times are measured on CUDA only", **host_summary(prof, steps)}
    kinds: dict[str, float] = {}
    names: dict[str, float] = {}
    compute = []
    for e in events:
        kind = kernel_kind(e.name)
        kinds[kind] = kinds.get(kind, 0.0) + e.device_time / 1000.0
        names[e.name[:80]] = names.get(e.name[:80], 0.0) + e.device_time / 1000.0
        if kind != "communication":
            compute.append(e)
    busy = sum(e.device_time for e in compute) / 1000.0
    spans = [(e.time_range.start, e.time_range.end) for e in compute]
    wall = (max(b for _, b in spans) - min(a for a, _ in spans)) / 1000.0 if spans else 0.0
    return {
        "busy_ms_per_step": busy / steps,
        "wall_ms_per_step": wall / steps,
        "gpu_idle_share": 1 - busy / wall if wall else None,
        "kernels_per_step": len(events) / steps,
        "ms_per_step_by_kind": {k: v / steps for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms_per_step": {k: v / steps for k, v in sorted(names.items(), key=lambda kv: -kv[1])[:top]},
        **gap_summary([(e.time_range.start, e.time_range.end, e.name) for e in compute], steps),
        **host_summary(prof, steps),
    }


# host calls that may wait for the GPU (the two aten ones only when their tensor is on it): where a
# step waits, the GPU's queue runs dry behind the host
HOST_WAITS = (
    "aten::_local_scalar_dense",
    "aten::is_nonzero",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
)


def host_summary(prof: Any, steps: int, top: int = 15) -> dict[str, Any]:
    """The host side of the profiled steps: the operators with the most self CPU time per step, and
    every call that waits for the GPU (HOST_WAITS) with the innermost Python frames outside torch
    that made it (found only where the profiler ran with_stack, as bench_train's HF and inline paths
    do with --profile-trace: frames are then parents of the operator events; else "?", as under
    pack-train's --profile-steps, which records no stacks)."""
    averages = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)
    waits: dict[str, float] = {}
    for e in prof.events():
        if e.device_type.name == "CPU" and e.name in HOST_WAITS:
            frames, parent = [], e.cpu_parent
            while parent is not None and len(frames) < 3:  # with_stack: Python frames are parents
                if ".py(" in parent.name and "torch/" not in parent.name:
                    frames.append(parent.name)
                parent = parent.cpu_parent
            key = f"{e.name} <- {' <- '.join(frames) or '?'}"
            waits[key] = waits.get(key, 0.0) + 1 / steps
    return {
        "top_host_ops_self_ms_per_step": {a.key[:80]: a.self_cpu_time_total / 1000.0 / steps for a in averages[:top]},
        "host_waits_per_step": dict(sorted(waits.items(), key=lambda kv: -kv[1])),
    }


# (name, upper edge in us) of each bucket of gap lengths
GAP_BUCKETS = (("<5us", 5.0), ("5-20us", 20.0), ("20-100us", 100.0), ("100-1000us", 1000.0), (">=1000us", float("inf")))


def gap_summary(kernels: Sequence[tuple[float, float, str]], steps: int, top: int = 8) -> dict[str, Any]:
    """Where the GPU sat idle: the gaps between kernels (start, end in us, name), per step by
    length bucket, and the longest gaps with the kernels on either side.

    >>> g = gap_summary([(0, 10, "a"), (12, 20, "b"), (520, 530, "c")], steps=1, top=1)
    >>> g["idle_ms_per_step_by_gap"], g["gaps_per_step"]["<5us"], g["longest_gaps"][0]["after"]
    ({'<5us': 0.002, '5-20us': 0.0, '20-100us': 0.0, '100-1000us': 0.5, '>=1000us': 0.0}, 1.0, 'b')
    """
    labels = [name for name, _ in GAP_BUCKETS]
    idle, count = dict.fromkeys(labels, 0.0), dict.fromkeys(labels, 0.0)
    gaps: list[tuple[float, str, str]] = []
    ordered = sorted(kernels)
    reach = ordered[0][1] if ordered else 0.0  # the latest end so far (kernels may overlap)
    for (_, _, before), (start, end, after) in zip(ordered, ordered[1:]):
        if start > reach:
            gap = start - reach
            label = next(name for name, edge in GAP_BUCKETS if gap < edge)
            idle[label] += gap / 1000.0 / steps
            count[label] += 1 / steps
            gaps.append((gap, before[:80], after[:80]))
        reach = max(reach, end)
    gaps.sort(reverse=True)
    return {
        "idle_ms_per_step_by_gap": {k: round(v, 4) for k, v in idle.items()},
        "gaps_per_step": count,
        "longest_gaps": [{"us": round(g, 1), "after": b, "before": a} for g, b, a in gaps[:top]],
    }
