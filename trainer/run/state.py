"""`Run`: one training run as `trainer.run.start` builds it before the first step, and as the loop
(`trainer.run.loop`) and the memory check (`trainer.run.fit_check`) read it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from pipeline.contract import ModelShape
from trainer.config import TrainConfig
from trainer.data.evaluate import Evaluator
from trainer.data.integrity import ShardHashCheck
from trainer.data.stream import Cursor, Largest, Planner
from trainer.distributed.context_parallel import Layout
from trainer.distributed.parallel import DistInfo
from trainer.model.keep_attention import KeptAttention
from trainer.model.loss import LossModule
from trainer.model.precision import MasterAdamW
from trainer.run.profiling import StepProfiler


@dataclass
class Run:
    """What `trainer.run.start.start` builds, and checks, before the first step."""

    config: TrainConfig
    info: DistInfo
    fsdp: bool  # --parallel fsdp under torchrun
    device: torch.device
    autocast: Any  # bf16 autocast, or a null context for fp32
    masters: MasterAdamW | None  # --dtype bf16-weights (not under FSDP): the optimizer, with fp32 masters
    out: Path
    planner: Planner
    total_steps: int  # the schedule's length
    stop_at: int  # the last step of this run (--stop-at)
    start_step: int
    cursor: Cursor  # the data cursor after start_step
    tokens_seen: int
    fingerprint: dict  # of the data, recorded in checkpoints
    hashes: ShardHashCheck | None
    tokenizer: Any
    model: transformers.PreTrainedModel  # plain, as save_pretrained writes it
    peft: Any  # with --lora-r: the PeftModel around `model` (checkpoints hold its adapter), else None
    wrapper: LossModule  # the model with the loss as its forward (what the optimizer updates)
    module: torch.nn.Module  # the wrapper as the step calls it: itself, or DDP around it
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    loader: torch.utils.data.DataLoader
    evaluator: Evaluator | None  # the held-out folder's loss (--eval-data)
    backend: str
    compiled: bool
    n_params: int
    flop_shape: ModelShape  # what the metrics count FLOPs of (trainer.run.metrics.model_shape)
    fp8_all_gather: bool = False  # FSDP2 all-gathers float8 weights: their scales refresh after each step
    profiler: StepProfiler | None = None  # --profile-steps
    layout: Layout = field(default_factory=Layout)  # data x context parallel
    largest: Largest = Largest(0)  # the largest micro-batch (trainer.run.fit_check measures what it needs)
    resumed_from: Path | None = None  # the checkpoint this run continues (--resume), if any
    kept_attention: KeptAttention | None = None  # --keep-attention: the recompute policy, counting what it kept
