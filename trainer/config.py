"""`TrainConfig`: every option of a training run; `validate` refuses a value outside its choices
(click's choices do the same for `pack-train`; this covers `train()` called from Python)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeline.errors import UserError

SCHEDULES = ("cosine", "linear", "constant")
RESUME = ("newest", "strict")
PARALLEL = ("ddp", "fsdp")
REPORT_TO = ("none", "tensorboard", "wandb")
GRAD_REDUCE = ("fp32", "bf16")
DTYPES = ("auto", "bf16", "bf16-weights", "fp32")
OPTIMIZERS = ("adamw", "adafactor")
# Micro-batch token budget when none is given: a GPU step's worth on CUDA; on the CPU one row of the
# README's 8192-token packing, so that a step of the tiny model takes a second rather than several.
TOKENS_PER_STEP = {"cuda": 16384, "cpu": 8192}


@dataclass
class TrainConfig:
    """Every option of `pack-train` (see trainer/cli.py for the user-facing help)."""

    data: str
    model: str
    out: str
    tokenizer: str | None = None
    tokens_per_step: int | None = None  # None: TOKENS_PER_STEP of the device (resolved by `resolved`)
    grad_accum: int = 1
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup: int = 0
    schedule: str = "cosine"
    epochs: int | None = None
    max_steps: int | None = None
    stop_at: int | None = None
    attn: str = "auto"
    dtype: str = "auto"
    compile: bool | None = None  # None: compile on CUDA, not on CPU
    grad_checkpointing: int = 0  # 0: off; N: every Nth decoder layer recomputes its activations (1: all)
    seed: int = 0
    save_every: int = 0
    keep_last: int | None = None
    resume: str | None = None  # "newest" (intact checkpoint) or "strict" (the latest, or refuse)
    log_every: int = 10
    report_to: str = "none"  # also log the metrics to "tensorboard" or "wandb"
    eval_data: str | None = None  # held-out packed folder; None: DATA/eval when pack-data wrote one; "none": off
    eval_every: int = 0  # evaluate every N steps (0: only after the last step)
    lora_r: int = 0  # LoRA rank (0: full fine-tune), trainer.lora
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_target: str = "all"  # "all" linear layers of the decoder, or module names: q_proj,v_proj
    merge_lora: bool = False  # write RUN/merged, the base model with the adapters merged in
    save_best: bool = False  # checkpoint each step whose eval loss is the lowest so far; RUN/best.json names it
    parallel: str = "ddp"
    grad_reduce: str = "fp32"
    reshard_after_forward: bool = True
    optimizer: str = "adamw"  # or "adafactor": factored second moments, no first moment (trainer.optim)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    num_workers: int = 2
    prefetch: int = 4
    peak_flops: float = 989e12
    device: str = "auto"
    verify_hashes: bool = True
    progress: bool = True


def resolved(config: TrainConfig, device_type: str) -> TrainConfig:
    """`config` with the defaults that depend on the device filled in (tokens_per_step)."""
    if config.tokens_per_step is not None:
        return config
    return replace(config, tokens_per_step=TOKENS_PER_STEP.get(device_type, TOKENS_PER_STEP["cpu"]))


def validate(config: TrainConfig) -> None:
    """Raise UserError (one line) for an option outside its choices."""
    if config.report_to not in REPORT_TO:
        raise UserError(f"unknown --report-to {config.report_to!r}: choose {', '.join(REPORT_TO)}")
    if config.grad_checkpointing < 0:
        raise UserError(f"--grad-checkpointing must be 0 (off) or N >= 1 (every Nth layer), "
                        f"got {config.grad_checkpointing}")
    if config.lora_r < 0:
        raise UserError(f"--lora-r must be >= 0 (0: no LoRA), got {config.lora_r}")
    if config.merge_lora and not config.lora_r:
        raise UserError("--merge-lora needs --lora-r (there is no adapter to merge)")
    if config.lora_r and config.parallel == "fsdp":
        raise UserError("--lora-r is not supported with --parallel fsdp yet: use --parallel ddp (the base "
                        "weights are frozen, so DDP holds no optimizer state for them)")
    if config.schedule not in SCHEDULES:
        raise UserError(f"unknown --schedule {config.schedule!r}: choose {', '.join(SCHEDULES)}")
    if config.parallel not in PARALLEL:
        raise UserError(f"unknown --parallel {config.parallel!r}: choose {', '.join(PARALLEL)}")
    if config.grad_reduce not in GRAD_REDUCE:
        raise UserError(f"unknown --grad-reduce {config.grad_reduce!r}: choose {', '.join(GRAD_REDUCE)}")
    if config.dtype not in DTYPES:
        raise UserError(f"unknown --dtype {config.dtype!r}: choose {', '.join(DTYPES)}")
    if config.optimizer not in OPTIMIZERS:
        raise UserError(f"unknown --optimizer {config.optimizer!r}: choose {', '.join(OPTIMIZERS)}")
    if config.dtype == "bf16-weights" and config.optimizer != "adamw":
        raise UserError(f"--dtype bf16-weights needs --optimizer adamw (its fp32 masters are updated by a "
                        f"fused AdamW step); with --optimizer {config.optimizer} use --dtype bf16")
    if config.tokens_per_step is not None and config.tokens_per_step < 1:
        raise UserError(f"--tokens-per-step must be >= 1, got {config.tokens_per_step}")
    if config.resume and config.resume not in RESUME:
        raise UserError(f"unknown --resume={config.resume}: choose {' or '.join(RESUME)}")
