"""`TrainConfig`: every option of a training run; `validate` refuses a value of the wrong type, out of
range or outside its choices (`TRAIN_CHECKS`, the same bounds as pack-train's click options), and
options that contradict each other, in one line each. `train()` and `pack-train` both go through
it; `pack-train --config FILE` checks each value of the file with `TRAIN_CHECKS` too."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

from pipeline.errors import UserError
from pipeline.option_checks import MAX_PROCS, PATH, Check, check_options

SCHEDULES = ("cosine", "linear", "constant")
RESUME = ("newest", "strict")
PARALLEL = ("ddp", "fsdp")
REPORT_TO = ("none", "tensorboard", "wandb")
GRAD_REDUCE = ("fp32", "bf16")
DTYPES = ("auto", "bf16", "bf16-weights", "fp8", "fp32")
FP8_RECIPES = ("rowwise_with_gw_hp", "rowwise", "tensorwise")  # trainer.model.fp8.RECIPES
OPTIMIZERS = ("adamw", "adamw8bit", "adamw4bit", "adafactor")
WARMUP_RULES = ("hf", "axolotl")
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
    # one optimizer step per group of a --strategy minibatch folder (trainer.data.plan.group_plan);
    # None: on exactly when the folder has groups (resolved by trainer.run.start)
    step_by_group: bool | None = None
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup: int = 0
    warmup_ratio: float = 0.0  # warmup as a share of the run's optimizer steps (rounded up), instead of --warmup
    warmup_rule: str = "hf"  # "axolotl": its ratio rounded down, 3% of the steps (at most 100) when none given
    schedule: str = "cosine"
    epochs: int | None = None
    max_steps: int | None = None
    stop_at: int | None = None
    attn: str = "auto"
    dtype: str = "auto"
    fp8_recipe: str = "rowwise_with_gw_hp"  # with dtype "fp8": torchao's float8 scaling (trainer.model.fp8)
    compile: bool | None = None  # None: compile on CUDA, not on CPU
    grad_checkpointing: int = 0  # 0: off; N: every Nth decoder layer recomputes its activations (1: all)
    # compiled layers: the share of their activations the backward keeps (torch's activation_memory_budget);
    # below 1 the compiled backward recomputes the cheapest ones (norms, SwiGLU's product) instead
    activation_memory_budget: float = 1.0
    seed: int = 0
    save_every: int = 0
    keep_last: int | None = None
    resume: str | None = None  # "newest" (intact checkpoint), "strict" (the latest, or refuse), or a checkpoint folder
    log_every: int = 10
    report_to: str = "none"  # also log the metrics to "tensorboard" or "wandb"
    eval_data: str | None = None  # held-out packed folder; None: DATA/eval when pack-data wrote one; "none": off
    eval_every: int = 0  # evaluate every N steps (0: only after the last step)
    evals_per_epoch: int = 0  # instead of eval_every: this many evaluations an epoch (`per_epoch`)
    saves_per_epoch: int = 0  # instead of save_every: this many checkpoints an epoch (`per_epoch`)
    wandb_project: str | None = None  # with report_to "wandb": its project (None: pack-train)
    wandb_entity: str | None = None
    run_name: str | None = None  # the W&B run's name
    lora_r: int = 0  # LoRA rank (0: full fine-tune), trainer.model.lora
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_target: str = "all"  # "all" linear layers of the decoder, or module names: q_proj,v_proj
    merge_lora: bool = False  # write RUN/merged, the base model with the adapters merged in
    qlora: bool = False  # the frozen base's decoder linear layers in 4-bit NF4 (trainer.model.lora)
    save_best: bool = False  # checkpoint each step whose eval loss is the lowest so far; RUN/best.json names it
    parallel: str = "ddp"
    context_parallel: int = 1  # ranks that share each micro-batch (trainer.distributed.context_parallel)
    tile_mlp: int = 0  # run each layer's MLP over the sequence this many tokens at a time (trainer.model.long_rows)
    offload_activations: bool = False  # what the forward saves for the backward in CPU memory
    offload_states: bool = False  # FSDP2: shards, gradients and optimizer states in CPU memory
    grad_reduce: str = "fp32"
    reshard_after_forward: bool = True
    ddp_bucket_mb: int = 250  # DDP's gradient all-reduce bucket size (MiB), trainer.distributed.parallel
    optimizer: str = "adamw"  # or "adafactor": factored second moments, no first moment (trainer.run.optim)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8  # AdamW's epsilon (torch's default)
    grad_clip: float = 1.0
    num_workers: int = 2
    prefetch: int = 4
    peak_flops: float | None = None  # None: the device's known peak (trainer.run.metrics.known_peak_flops), if any
    device: str = "auto"
    verify_hashes: bool = True
    progress: bool = True
    profile_steps: str | None = None  # "FIRST-LAST" optimizer steps to profile (trainer.run.profiling)


_AT_LEAST_0, _AT_LEAST_1 = Check(int, low=0), Check(int, low=1)
_OPTIONAL_1 = Check(int, low=1, none=True)
_FRACTION = Check(float, low=0, high=1, high_open=True)
# the type and range of every TrainConfig field: `validate`, and the values of `pack-train --config FILE`
TRAIN_CHECKS: dict[str, Check] = {
    "data": Check(PATH), "model": Check(PATH), "out": Check(PATH), "tokenizer": Check(PATH, none=True),
    "tokens_per_step": _OPTIONAL_1, "grad_accum": _AT_LEAST_1, "step_by_group": Check(bool, none=True), "lr": Check(float, low=0, low_open=True),
    "min_lr_ratio": Check(float, low=0, high=1), "warmup": _AT_LEAST_0,
    "warmup_ratio": Check(float, low=0, high=1, high_open=True), "schedule": Check(str, choices=SCHEDULES),
    "warmup_rule": Check(str, choices=WARMUP_RULES), "evals_per_epoch": _AT_LEAST_0, "saves_per_epoch": _AT_LEAST_0,
    "wandb_project": Check(str, none=True), "wandb_entity": Check(str, none=True), "run_name": Check(str, none=True),
    "adam_eps": Check(float, low=0, low_open=True),
    "epochs": _OPTIONAL_1, "max_steps": _OPTIONAL_1, "stop_at": _OPTIONAL_1, "attn": Check(str),
    "dtype": Check(str, choices=DTYPES), "fp8_recipe": Check(str, choices=FP8_RECIPES), "compile": Check(bool, none=True), "grad_checkpointing": _AT_LEAST_0,
    "activation_memory_budget": Check(float, low=0, low_open=True, high=1),
    "seed": _AT_LEAST_0, "save_every": _AT_LEAST_0, "keep_last": _OPTIONAL_1,
    "resume": Check(str, none=True), "log_every": _AT_LEAST_1,
    "report_to": Check(str, choices=REPORT_TO), "eval_data": Check(PATH, none=True), "eval_every": _AT_LEAST_0,
    "lora_r": _AT_LEAST_0, "lora_alpha": Check(float, low=0, low_open=True), "lora_dropout": _FRACTION, "lora_target": Check(str),
    "merge_lora": Check(bool), "qlora": Check(bool), "save_best": Check(bool), "parallel": Check(str, choices=PARALLEL),
    "context_parallel": _AT_LEAST_1, "tile_mlp": _AT_LEAST_0, "offload_activations": Check(bool), "offload_states": Check(bool),
    "grad_reduce": Check(str, choices=GRAD_REDUCE), "reshard_after_forward": Check(bool),
    "ddp_bucket_mb": _AT_LEAST_1,
    "optimizer": Check(str, choices=OPTIMIZERS), "weight_decay": Check(float, low=0), "beta1": _FRACTION,
    "beta2": _FRACTION, "grad_clip": Check(float, low=0), "num_workers": Check(int, low=0, high=MAX_PROCS), "prefetch": _AT_LEAST_1,
    "peak_flops": Check(float, low=0, low_open=True, none=True), "device": Check(str), "verify_hashes": Check(bool),
    "progress": Check(bool), "profile_steps": Check(str, none=True),
}


def resolved(config: TrainConfig, device_type: str) -> TrainConfig:
    """`config` with the defaults that depend on the device filled in (tokens_per_step)."""
    if config.tokens_per_step is not None:
        return config
    return replace(config, tokens_per_step=TOKENS_PER_STEP.get(device_type, TOKENS_PER_STEP["cpu"]))


def validate(config: TrainConfig) -> None:
    """Raise UserError (one line) for an option of the wrong type, out of range or outside its
    choices, or options that contradict each other."""
    check_options(config, TRAIN_CHECKS)
    for name in ("data", "eval_data", "out"):
        refuse_uri(f"--{name.replace('_', '-')}", getattr(config, name))
    if config.resume is not None and config.resume not in RESUME and not Path(config.resume).is_dir():
        raise UserError(f"--resume={config.resume}: expected newest, strict, or a checkpoint folder "
                        "(RUN/checkpoints/step-...), and there is no such folder")
    if config.warmup and config.warmup_ratio:
        raise UserError(f"--warmup {config.warmup} and --warmup-ratio {config.warmup_ratio} both set the warmup: "
                        "give one")
    if config.evals_per_epoch and config.eval_every or config.saves_per_epoch and config.save_every:
        raise UserError("--evals-per-epoch / --saves-per-epoch and --eval-every / --save-every both say when: give one")
    if config.stop_at is not None and config.max_steps is not None and config.stop_at > config.max_steps:
        raise UserError(f"--stop-at {config.stop_at} is past --max-steps {config.max_steps}")
    if config.qlora and not config.lora_r:
        raise UserError("--qlora needs --lora-r (it stores the frozen base of a LoRA run in 4 bits)")
    if config.qlora and config.dtype == "fp8":
        raise UserError("--qlora and --dtype fp8 both choose how the frozen base computes: use one of them")
    if config.merge_lora and not config.lora_r:
        raise UserError("--merge-lora needs --lora-r (there is no adapter to merge)")
    if config.lora_r and config.parallel == "fsdp":
        raise UserError("--lora-r is not supported with --parallel fsdp yet: use --parallel ddp (the base "
                        "weights are frozen, so DDP holds no optimizer state for them)")
    if config.offload_states and config.parallel != "fsdp":
        raise UserError("--offload-states needs --parallel fsdp (FSDP2 keeps each rank's shards, their gradients "
                        "and the optimizer's states in CPU memory)")
    if config.offload_states and config.dtype == "fp8":
        raise UserError("--offload-states does not combine with --dtype fp8 (its float8 all-gathers run on the "
                        "GPU's copies of the weights): use --dtype bf16")
    if config.profile_steps is not None:
        parse_step_range(config.profile_steps)
    if config.context_parallel > 1 and config.attn not in ("auto", "flash_attn", "sdpa"):
        raise UserError(f"--context-parallel needs --attn flash_attn (GPU) or sdpa: {config.attn} cannot attend a "
                        "share of an example to the keys of the whole row")
    if config.optimizer in ("adamw8bit", "adamw4bit") and config.parallel == "fsdp":
        raise UserError(f"--optimizer {config.optimizer} (torchao's low-bit AdamW) is not run with --parallel fsdp "
                        "here: use --parallel ddp, or --optimizer adamw")
    if config.dtype in ("bf16-weights", "fp8") and config.optimizer != "adamw":
        raise UserError(f"--dtype {config.dtype} needs --optimizer adamw (its fp32 masters are updated by a "
                        f"fused AdamW step); with --optimizer {config.optimizer} use --dtype bf16")


def warmup_steps(config: TrainConfig, total_steps: int) -> int:
    """The warmup's optimizer steps: --warmup, or --warmup-ratio of `total_steps` rounded up (as the
    Hugging Face Trainer rounds it): a ratio of 0.1 over 25 steps warms up for 3.

    >>> warmup_steps(TrainConfig(data="d", model="m", out="o", warmup_ratio=0.1), 25)
    3
    """
    if config.warmup_rule == "axolotl":  # axolotl 0.19.0, core/builders/base.py
        steps = (config.warmup if config.warmup else int(config.warmup_ratio * total_steps) if config.warmup_ratio
                 else min(int(0.03 * total_steps), 100))
        return 2 if steps == 1 else steps
    return math.ceil(config.warmup_ratio * total_steps) if config.warmup_ratio else config.warmup


def per_epoch(config: TrainConfig, total_steps: int) -> TrainConfig:
    """--evals-per-epoch / --saves-per-epoch as --eval-every / --save-every, as Axolotl computes them:
    every ceil(total_steps / (n * epochs)) steps (transformers' fractional eval_steps/save_steps of
    1 / (n * epochs)); a fraction of 1 or more evaluates (saves) at the end only.

    >>> per_epoch(TrainConfig(data="d", model="m", out="o", epochs=2, evals_per_epoch=4), 40).eval_every
    5
    """
    changes = {}
    for n, field in ((config.evals_per_epoch, "eval_every"), (config.saves_per_epoch, "save_every")):
        if n and n * (config.epochs or 1) > 1:
            changes[field] = math.ceil(total_steps / (n * (config.epochs or 1)))
    return replace(config, **changes) if changes else config


def parse_step_range(text: str) -> tuple[int, int]:
    """`--profile-steps` as (first, last) optimizer steps, both counted from 1 and included:
    "6-8" -> (6, 8), "7" -> (7, 7); anything else is a UserError saying what is expected.

    >>> parse_step_range("6-8"), parse_step_range("7")
    ((6, 8), (7, 7))
    """
    parts = str(text).split("-")
    if len(parts) in (1, 2) and all(p.strip().isdigit() for p in parts):
        first, last = int(parts[0]), int(parts[-1])
        if 1 <= first <= last:
            return first, last
    raise UserError(f"--profile-steps {text}: expected FIRST-LAST optimizer steps counted from 1, "
                    "e.g. 6-8 (or one step, e.g. 7)")


def refuse_uri(option: str, value: str | None) -> None:
    """pack-train reads and writes local folders (or mounted file systems): a URI such as
    s3://bucket/packed is refused in one line rather than taken as a local path."""
    problem = uri_problem(option, value)
    if problem:
        raise UserError(f"{option} {value}: {problem}")


def uri_problem(option: str, value: str | None) -> str | None:
    """Why `value` cannot be given to `option` (it is a URI), or None."""
    if value is None or not re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", str(value)):
        return None
    fix = ("give a local (or mounted) folder and copy the run folder afterwards" if option == "--out" else
           "copy the packed folder to a local (or mounted) path first and give that path")
    return f"pack-train reads and writes local folders only, not URIs: {fix}"
