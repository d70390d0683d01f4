"""Continuing a run from its checkpoint: which checkpoint (rank 0 checks them and tells the other
ranks), whether this run can continue it exactly, and loading weights, optimizer, scheduler and
RNG states from it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeline.errors import UserError
from trainer.run import checkpoint as ckpt
from trainer.config import RESUME, TrainConfig
from trainer.model.lora import load_adapter_into
from trainer.run.optim import stretch_schedule
from trainer.distributed.parallel import DistInfo, load_optimizer_state
from trainer.run.preflight import refuse_reused_out
from trainer.data.stream import Cursor

# Options that fix the data stream: a resume with other values could not continue exactly.
STREAM_KEYS = ("tokens_per_step", "grad_accum", "seed", "world_size", "context_parallel")
# Options the checkpoint's optimizer and scheduler states carry (its learning rate, schedule shape and
# AdamW settings are restored from them): a resume with other values would silently keep the old ones.
# The schedule's length (--max-steps, --epochs) is this run's (`stretch_schedule`).
OPTIMIZER_KEYS = ("lr", "min_lr_ratio", "warmup", "warmup_ratio", "warmup_rule", "schedule", "optimizer", "weight_decay",
                  "beta1", "beta2", "adam_eps")
# Options that shape a LoRA adapter (its matrices' size and where they sit, its scale alpha / r, the
# base it sits on): a resume with other values would continue another adapter than the one saved.
ADAPTER_KEYS = ("lora_r", "lora_alpha", "lora_target", "qlora")


def checkpoint_to_resume(config: TrainConfig, info: DistInfo) -> Path | None:
    """The checkpoint in `--out` to continue from, or None for a new run (which refuses an `--out`
    that holds checkpoints). Rank 0 verifies the checkpoints (`ckpt.resume_point`) and tells the
    other ranks which one, or why there is none."""
    out = Path(config.out)
    if not config.resume:
        refuse_reused_out(config)
        return None
    found: tuple[Path, list[str]] | str | None = None
    if info.rank == 0:
        try:
            found = (ckpt.resume_point(out, strict=config.resume == "strict") if config.resume in RESUME
                     else (named_checkpoint(out, Path(config.resume)), []))
        except UserError as exc:
            found = str(exc)
    if info.enabled:
        box = [found]
        dist.broadcast_object_list(box, src=0)
        found = box[0]
    if isinstance(found, str):
        raise UserError(found)
    path, notes = found
    for note in notes:
        print(f"pack-train: {note}", file=sys.stderr)
    return path


def named_checkpoint(out: Path, path: Path) -> Path:
    """`--resume PATH`: the checkpoint folder PATH of the run in `out`, if it is intact and the newest
    there (the steps of a newer one would be mixed with this continuation), else UserError."""
    found = ckpt.list_checkpoints(out)
    mine = {p.resolve(): p for p in found}
    if path.resolve() not in mine:
        where = ", ".join(p.name for p in found[-3:]) or "none"
        raise UserError(f"--resume={path}: not a checkpoint of the run in --out {out} (its checkpoints: {where}): "
                        f"give one of {out / ckpt.CHECKPOINTS}/step-..., or the --out of the run it belongs to")
    damage = ckpt.checkpoint_damage(path)
    if damage is not None:
        raise UserError(f"--resume={path}: the checkpoint is damaged ({damage}): give an older one")
    if found[-1].resolve() != path.resolve():
        raise UserError(f"--resume={path}: {found[-1].name} is newer, and its steps would be mixed with this "
                        f"continuation: move the newer checkpoints out of {out / ckpt.CHECKPOINTS} first")
    return path


def check_resumable(path: Path, config: TrainConfig, world: int, fingerprint: dict) -> dict[str, Any]:
    """The checkpoint's state, if this run can continue it exactly (same data stream, same optimizer
    and learning-rate schedule), else UserError."""
    state = ckpt.read_trainer_state(path)
    saved = state.get("config", {})
    for key in STREAM_KEYS:
        now = world if key == "world_size" else getattr(config, key)
        was = saved.get(key, 1 if key == "context_parallel" else None)  # checkpoints from before the option
        if was != now:
            raise UserError(
                f"cannot resume {path}: it was trained with {key}={was} but this run has "
                f"{key}={now}; the data order would differ: use the same value"
            )
    for keys, why in ((OPTIMIZER_KEYS, "its optimizer and schedule states would carry on with"),
                      (ADAPTER_KEYS, "the adapter it saved was trained for")):
        for key in keys:
            if key in saved and saved[key] != getattr(config, key):
                flag = "--" + key.replace("_", "-")
                raise UserError(
                    f"cannot resume {path}: it was trained with {flag} {saved[key]} but this run has {flag} "
                    f"{getattr(config, key)}, and {why} {saved[key]}: resume with {flag} {saved[key]}, or "
                    "start a new run in another --out"
                )
    if state.get("data") != fingerprint:
        raise UserError(
            f"cannot resume {path}: it was trained on other data (shard hashes or row counts differ "
            f"from {config.data})"
        )
    return state


def load_weights_into(model: torch.nn.Module, path: Path) -> None:
    """Load a checkpoint's safetensors into `model` (plain, before wrapping); tied copies may be
    absent from the file."""
    state = ckpt.load_model_weights(path)
    with ckpt.loading(path / "model"):  # e.g. a tensor of another shape
        missing, unexpected = model.load_state_dict(state, strict=False)
    missing = set(missing) - ckpt.tied_parameter_names(model)
    if missing or unexpected:
        raise UserError(
            f"{path}/model does not match the model: missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}: resume with the same --model"
        )


def resume_model(
    path: Path, model: torch.nn.Module, config: TrainConfig, world: int, fingerprint: dict, stop_at: int,
    peft: Any = None,
) -> tuple[int, Cursor, int]:
    """Load the weights of checkpoint `path` into `model` (with LoRA: its adapter into `peft`), once
    `check_resumable` agrees; returns the checkpoint's step, data cursor and tokens seen."""
    state = check_resumable(path, config, world, fingerprint)
    if peft is not None:
        with ckpt.loading(path / "model"):  # e.g. an adapter tensor of another shape
            load_adapter_into(peft, path)
    else:
        load_weights_into(model, path)
    step, cursor, tokens_seen = int(state["step"]), Cursor(**state["cursor"]), int(state.get("tokens_seen", 0))
    if step >= stop_at:
        raise UserError(
            f"{path} is already at step {step} of {stop_at}: nothing to resume; "
            "raise --max-steps (or --stop-at) to train further"
        )
    return step, cursor, tokens_seen


def load_training_state(
    path: Path, *, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR, total_steps: int, rank: int, fsdp: bool,
) -> None:
    """Load the optimizer (of the wrapped `module`), the scheduler and this rank's RNG states from
    checkpoint `path`; the schedule keeps this run's length."""
    for name, restore in (
        ("optimizer.pt", lambda state: load_optimizer_state(module, optimizer, state, fsdp)),
        ("scheduler.pt", scheduler.load_state_dict),
        (f"rng-rank{rank}.pt", ckpt.set_rng_state),
    ):
        with ckpt.loading(path / name):
            restore(ckpt.load_torch(path / name))
    stretch_schedule(optimizer, scheduler, total_steps)
