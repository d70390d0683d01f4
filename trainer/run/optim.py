"""The optimizer (weight decay on matrices only) and its learning-rate schedule: linear warmup, then
cosine, linear or constant.

`adamw` (the default) keeps two fp32 moments per parameter: with fp32 weights and gradients, 16
bytes per parameter. `adafactor` (`torch.optim.Adafactor`) keeps no first moment and, for a matrix,
only a row and a column of second-moment statistics: about 8 bytes per parameter in all (for the
llama-8b preset's 7.2B parameters, 58 GB instead of 116 GB, before activations). Its `lr` caps a
step relative to each weight's RMS; betas are AdamW's alone. `adamw8bit` / `adamw4bit`: torchao's
AdamW with its moments quantized by blocks (2 or 1 byte per parameter for both instead of 8)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.contract import UserError
from trainer.config import TrainConfig, warmup_steps
from trainer.model.precision import MasterAdamW


@dataclass
class Schedule:
    """LR multiplier after `step` completed steps: linear warmup, then cosine/linear/constant decay
    to `min_ratio` at `total` steps. A dataclass, so LambdaLR checkpoints it with the scheduler."""

    kind: str
    warmup: int
    total: int
    min_ratio: float

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        if self.kind == "linear":
            return 1.0 - (1.0 - self.min_ratio) * progress
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def param_groups(params: Iterable[torch.nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only (not on norms, biases); frozen parameters left out."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(
    params: Iterable[torch.nn.Parameter],
    config: TrainConfig,
    device: torch.device,
    total_steps: int,
    master_weights: bool = False,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """`config.optimizer` over `params` (AdamW fused on CUDA) and a LambdaLR that follows `Schedule`.
    `master_weights` (--dtype bf16-weights on one process): `MasterAdamW`, which turns `params` into
    bf16 and keeps their fp32 masters."""
    groups = param_groups(params, config.weight_decay)
    if master_weights:
        optimizer: torch.optim.Optimizer = MasterAdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.adam_eps)
    elif config.optimizer == "adafactor":
        optimizer = torch.optim.Adafactor(groups, lr=config.lr, foreach=True)
    elif config.optimizer in LOW_BIT:
        optimizer = low_bit_adamw(config.optimizer, groups, config)
    else:
        optimizer = torch.optim.AdamW(
            groups,
            lr=config.lr,
            betas=(config.beta1, config.beta2),
            eps=config.adam_eps,
            # fused: one pass over each tensor, on the GPU or, under --offload-states, in CPU memory
            **({"fused": True} if device.type == "cuda" else {"foreach": True}),
        )
    schedule = Schedule(config.schedule, warmup_steps(config, total_steps), total_steps, config.min_lr_ratio)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


LOW_BIT = {"adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit"}


def low_bit_adamw(name: str, groups: list[dict[str, Any]], config: TrainConfig) -> torch.optim.Optimizer:
    """torchao's block-quantized AdamW (`AdamW8bit`, `AdamW4bit`): the moments in 8 or 4 bits, one
    scale per block of 256 values, the update computed in fp32."""
    try:
        from torchao import optim as low_bit
    except ImportError:
        raise UserError(f"--optimizer {name} needs torchao (pip install torchao): or use --optimizer adamw") from None
    return getattr(low_bit, LOW_BIT[name])(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.adam_eps)


def stretch_schedule(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, total_steps: int) -> None:
    """After a scheduler was loaded from a checkpoint: keep this run's length (`--max-steps` may have
    grown) and set the learning rate of the next step from it."""
    schedule = scheduler.lr_lambdas[0]
    schedule.total = total_steps
    for group, base in zip(optimizer.param_groups, scheduler.base_lrs):
        lr = float(base) * schedule(scheduler.last_epoch)
        if isinstance(group["lr"], torch.Tensor):  # torchao's low-bit AdamW keeps its rate as a tensor
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
