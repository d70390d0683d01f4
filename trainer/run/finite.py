"""A run whose loss or weights stop being finite stops in one line, before it saves them.

`--lr 1e308` (or any divergence) turns the loss into NaN or inf; training on would only spend time
and write checkpoints of NaN weights over the good ones. `FiniteWatch` notes on the device, with no
host sync per step, the first step whose loss was not finite; the loop asks it at every logged step
and before every checkpoint (`check`), which then also looks at the weights (an update can make them
inf while the loss it came from was finite). The run stops with one line naming the step and the
last checkpoint that was saved before it, which `--resume` continues from.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.contract import UserError


class FiniteWatch:
    """The first step (1-based) whose loss was not finite, kept on `device` (0: none yet)."""

    def __init__(self, device: torch.device) -> None:
        self.first_bad = torch.zeros((), dtype=torch.int64, device=device)

    def after_step(self, step: int, loss_sum: torch.Tensor) -> None:
        """Note `step` if this rank's loss sum of it is NaN or inf (device ops only)."""
        bad = (self.first_bad == 0) & ~torch.isfinite(loss_sum.detach()).all()
        self.first_bad = torch.where(bad, torch.full_like(self.first_bad, step), self.first_bad)

    def check(self, step: int, distributed: bool, last_saved: Path | None, module: torch.nn.Module | None = None) -> None:
        """Raise UserError if any rank saw a non-finite loss, or (with `module`, before a checkpoint)
        holds a weight that is not finite. Collective under torch.distributed."""
        first = self.first_bad.clone()
        weights_bad = torch.zeros((), dtype=torch.int64, device=first.device)
        if module is not None:
            # the trained ones: frozen weights (a LoRA base, NF4 among them) do not change
            local = [p.to_local() if hasattr(p, "to_local") else p for p in module.parameters() if p.requires_grad]
            finite = torch.stack([torch.isfinite(t.detach()).all() for t in local if t.numel()]).all()
            weights_bad = (~finite).to(torch.int64).to(first.device)
        if distributed:
            # the earliest step any rank saw: 0 (none) must not win the MIN
            first = torch.where(first == 0, torch.full_like(first, 2**62), first)
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
            first = torch.where(first == 2**62, torch.zeros_like(first), first)
            dist.all_reduce(weights_bad, op=dist.ReduceOp.MAX)
        bad_step, bad_weights = int(first.item()), bool(weights_bad.item())
        if not bad_step and not bad_weights:
            return
        what = (
            f"the loss of step {bad_step} is not finite (NaN or inf)"
            if bad_step
            else f"after step {step} a weight is not finite (NaN or inf)"
        )
        kept = (
            f"the last checkpoint saved before it, {last_saved}, is intact (continue from it with --resume and a lower --lr)"
            if last_saved is not None
            else "no checkpoint was saved"
        )
        raise UserError(
            f"{what}: training stopped at step {step} without saving; {kept}; lower --lr "
            "(or raise --warmup, keep --grad-clip on) to train stably"
        )
