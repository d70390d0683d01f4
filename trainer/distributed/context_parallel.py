"""Context parallelism's process groups: N neighbouring ranks share each packed row, and attention
gathers the keys and values of the whole row from them.

`setup` forms the groups and returns this rank's `Layout` on the data-parallel x context-parallel
grid; the groups it holds (`ContextGroups`) are handed down explicitly, by the run that owns them,
to what uses them: the attention that gathers keys and values (`trainer.attention.gathered`,
installed with them by `trainer.model.load.prepare`) and the start-up check of a share
(`trainer.model.check.check_context_parallel`). Which tokens each rank holds is the data's
(`trainer.data.row_split`). `torch.distributed.destroy_process_group` ends the groups with the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeline.contract import UserError


@dataclass(frozen=True)
class ContextGroups:
    """This rank's context-parallel process groups: the run's (NCCL on GPUs) and one for CPU tensors
    (gloo; the same group on the CPU), for the start-up probe of a model still there."""

    run: Any
    cpu: Any

    def on(self, device: torch.device) -> Any:
        """The group for tensors on `device`."""
        return self.cpu if device.type == "cpu" else self.run

    def gather_tokens(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """This rank's rows [L, ...] and the group's, as [n * width, ...] (differentiable)."""
        return _GatherTokens.apply(x, width, self.on(x.device))

    def reduce_max(self, value: torch.Tensor) -> None:
        """Replace `value` (on every rank of the group) by its largest value in the group."""
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.on(value.device))


@dataclass(frozen=True)
class Layout:
    """This rank's place on the data-parallel x context-parallel grid: ranks dp * cp_size ..
    dp * cp_size + cp_size - 1 (neighbours, so one host's GPUs) share each row, through `groups`
    (None without context parallelism)."""

    dp_rank: int = 0
    dp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    groups: ContextGroups | None = None


def setup(rank: int, world_size: int, distributed: bool, n: int) -> Layout:
    """Form the context-parallel groups of `n` neighbouring ranks (every rank calls this) and
    return this rank's Layout; n == 1 leaves every rank its own rows."""
    if n == 1:
        return Layout(dp_rank=rank, dp_size=world_size)
    if not distributed:
        raise UserError(
            f"--context-parallel {n} splits each row over {n} ranks: start pack-train with "
            f"torchrun --nproc-per-node {n} (or a multiple of {n})"
        )
    if world_size % n:
        raise UserError(
            f"--context-parallel {n} does not divide the {world_size} ranks of this run: use a "
            f"divisor of {world_size}, or a number of ranks that {n} divides"
        )
    on_cpu = dist.get_backend() == "gloo"
    mine = None
    for first in range(0, world_size, n):  # every rank creates every group, in the same order
        ranks = list(range(first, first + n))
        group = dist.new_group(ranks)
        cpu_group = group if on_cpu else dist.new_group(ranks, backend="gloo")
        if first <= rank < first + n:
            mine = ContextGroups(group, cpu_group)
    return Layout(dp_rank=rank // n, dp_size=world_size // n, cp_rank=rank % n, cp_size=n, groups=mine)


class _GatherTokens(torch.autograd.Function):
    """All-gather rows [L, ...] of every rank of `group` into [n * width, ...] (each rank's rows
    padded to `width`); the backward sums the gradients of every rank and returns each its own."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, width: int, group: Any) -> torch.Tensor:
        ctx.group, ctx.length, ctx.width = group, x.shape[0], width
        n = dist.get_world_size(group)
        if x.shape[0] < width:
            x = torch.cat([x, x.new_zeros((width - x.shape[0], *x.shape[1:]))])
        x = x.contiguous()
        out = x.new_empty((n * width, *x.shape[1:]))
        if dist.get_backend(group) == "nccl":
            dist.all_gather_into_tensor(out, x, group=group)
        else:
            dist.all_gather(list(out.chunk(n)), x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        group, width = ctx.group, ctx.width
        rank = dist.get_rank(group)
        if dist.get_backend(group) == "nccl":
            part = grad.new_empty((width, *grad.shape[1:]))
            dist.reduce_scatter_tensor(part, grad.contiguous(), group=group)
        else:  # gloo has no reduce-scatter
            total = grad.contiguous().clone()
            dist.all_reduce(total, group=group)
            part = total[rank * width : (rank + 1) * width]
        return part[: ctx.length], None, None
