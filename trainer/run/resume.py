"""Continuing a run from its checkpoint: which checkpoint (rank 0 checks them and tells the other
ranks), whether this run can continue it exactly, and loading weights, optimizer, scheduler and
RNG states from it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeline.contract import UserError
from trainer.config import RESUME, TrainConfig
from trainer.data.stream import Cursor, Planner, step_cursor
from trainer.distributed.parallel import DistInfo, load_optimizer_state
from trainer.model.lora import load_adapter_into
from trainer.run import checkpoint as ckpt
from trainer.run.optim import stretch_schedule
from trainer.run.preflight import refuse_reused_out

# Options that fix the data stream: a resume with other values could not continue exactly.
STREAM_KEYS = ("tokens_per_step", "grad_accum", "seed", "world_size", "context_parallel", "step_by_group")
# Options the checkpoint's optimizer and scheduler states carry (its learning rate, schedule shape and
# AdamW settings are restored from them; they hold states for the parameters that train, which
# --unfrozen-parameters chooses): a resume with other values would silently keep the old ones.
# The schedule's length (--max-steps, --epochs) is this run's (`stretch_schedule`).
OPTIMIZER_KEYS = (
    "lr",
    "min_lr_ratio",
    "warmup",
    "warmup_ratio",
    "warmup_rule",
    "schedule",
    "optimizer",
    "weight_decay",
    "beta1",
    "beta2",
    "adam_eps",
    "unfrozen_parameters",
)
# Options that shape a LoRA adapter (its matrices' size and where they sit, its scale alpha / r, the
# base it sits on): a resume with other values would continue another adapter than the one saved.
ADAPTER_KEYS = ("lora_r", "lora_alpha", "lora_target", "qlora", "int8_base")


def checkpoint_to_resume(config: TrainConfig, info: DistInfo) -> Path | None:
    """The checkpoint to continue from, or None for a new run (which refuses an `--out` that holds
    checkpoints). Rank 0 verifies the checkpoints (`ckpt.resume_point`, `named_checkpoint`) and
    tells the other ranks which one, or why there is none."""
    out = Path(config.out)
    if not config.resume:
        refuse_reused_out(config)
        return None
    found: tuple[Path, list[str]] | str | None = None
    if info.rank == 0:
        try:
            found = (
                ckpt.resume_point(out, strict=config.resume == "strict")
                if config.resume in RESUME
                else named_checkpoint(out, Path(config.resume))
            )
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


def named_checkpoint(out: Path, path: Path) -> tuple[Path, list[str]]:
    """`--resume PATH` (Hugging Face's resume_from_checkpoint): any intact checkpoint. One of the run
    in `out`, older ones included (a roll-back: `continue_history` sets the newer ones aside), or one
    of another run folder, whose history a new `out` (one without checkpoints of its own) starts
    from there; else UserError. Returns PATH and the notes to print (none)."""
    damage = ckpt.checkpoint_damage(path)
    if damage is not None:
        raise UserError(f"--resume={path}: the checkpoint is damaged ({damage}): give another one")
    found = ckpt.list_checkpoints(out)
    if found and path.resolve() not in {p.resolve() for p in found}:
        raise UserError(
            f"--resume={path}: a checkpoint of another run folder, but --out {out} holds checkpoints of "
            f"its own run (newest {found[-1].name}): to start a new run from {path}, give a new --out; "
            f"to continue {out}, give one of its own checkpoints"
        )
    return path, []


def continue_history(out: Path, path: Path | None, step: int) -> int | None:
    """Rank 0, once every check has passed, before the run folder is written: the step up to which
    the run keeps the metrics lines of `out`, or None when its history starts anew (a new run, or
    one started from the checkpoint of another run folder). Resuming a checkpoint of `out` that
    is not its newest rolls back to it: the newer ones are set aside (`ckpt.set_aside_newer`)."""
    if path is None:
        return None
    own = {p.resolve(): p for p in ckpt.list_checkpoints(out)}.get(path.resolve())
    if own is None:
        print(
            f"pack-train: --resume={path}: the run in {out} starts its own history from this checkpoint of another run folder",
            file=sys.stderr,
        )
        return None
    moved = ckpt.set_aside_newer(out, own)  # `own`: PATH may be a link to it, named otherwise
    if moved:
        print(
            f"pack-train: --resume={path}: rolled back; the newer checkpoints of this run ("
            f"{', '.join(p.name for p in moved)}) are kept, unchanged, in {moved[0].parent} (with the metrics "
            "they logged), where this run's saves, --keep-last and --resume never mix with them",
            file=sys.stderr,
        )
    return step


def check_resumable(path: Path, config: TrainConfig, world: int, fingerprint: dict, planner: Planner, stop_at: int) -> dict[str, Any]:
    """The checkpoint's state, if this run can continue it exactly (same data stream, same optimizer
    and learning-rate schedule, a step and data cursor that agree with its name and the data, a
    step before `stop_at`), else UserError."""
    state = ckpt.read_trainer_state(path)
    saved = state.get("config", {})
    for key in STREAM_KEYS:
        now = world if key == "world_size" else getattr(config, key)
        was = saved.get(key, {"context_parallel": 1, "step_by_group": False}.get(key))  # checkpoints from before the option
        if was != now:
            raise UserError(
                f"cannot resume {path}: it was trained with {key}={was} but this run has "
                f"{key}={now}; the data order would differ: use the same value"
            )
    for keys, why in (
        (OPTIMIZER_KEYS, "its optimizer and schedule states would carry on with"),
        (ADAPTER_KEYS, "the adapter it saved was trained for"),
    ):
        for key in keys:
            now = getattr(config, key)
            now = list(now) if isinstance(now, tuple) else now  # as config.json holds it
            if key in saved and saved[key] != now:
                flag = "--" + key.replace("_", "-")
                if isinstance(saved[key], bool):  # an on/off flag: --qlora, --int8-base
                    was, now = ("with", "without") if saved[key] else ("without", "with")
                    raise UserError(
                        f"cannot resume {path}: it was trained {was} {flag}, this run {now} it, and {why} "
                        f"that: resume {was} {flag}, or start a new run in another --out"
                    )
                raise UserError(
                    f"cannot resume {path}: it was trained with {flag} {saved[key]} but this run has {flag} "
                    f"{now}, and {why} {saved[key]}: resume with {flag} {saved[key]}, or "
                    "start a new run in another --out"
                )
    if state.get("data") != fingerprint:
        raise UserError(f"cannot resume {path}: it was trained on other data (shard hashes or row counts differ from {config.data})")
    step = int(state["step"])
    named = ckpt.checkpoint_step(path.resolve())  # the folder's own name (PATH may be a link to it)
    if named is not None and named != step:
        raise UserError(
            f"cannot resume {path}: its name says step {named} but it holds the state of step "
            f"{step} (a renamed folder?): rename it back to {ckpt.checkpoint_name(step)}, or give "
            "another checkpoint"
        )
    if step >= stop_at:
        raise UserError(
            f"{path} is already at step {step} of {stop_at}: nothing to resume; raise --max-steps (or --stop-at) to train further"
        )
    cursor, expected = Cursor(**state["cursor"]), step_cursor(planner, Cursor(), step)
    if cursor != expected:
        raise UserError(
            f"cannot resume {path}: its data cursor (epoch {cursor.epoch}, step {cursor.step_in_epoch} "
            f"of that epoch) is not where step {step} stands in {config.data} (epoch {expected.epoch}, "
            f"step {expected.step_in_epoch}): its {ckpt.STATE_FILE} was altered; give another checkpoint"
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


def resume_model(path: Path, model: torch.nn.Module, state: dict[str, Any], peft: Any = None) -> tuple[int, Cursor, int]:
    """Load the weights of checkpoint `path` (whose state `check_resumable` accepted) into `model`
    (with LoRA: its adapter into `peft`); returns the checkpoint's step, data cursor and tokens seen."""
    refuse_other_model(path, model, state)
    if peft is not None:
        with ckpt.loading(path / "model"):  # e.g. an adapter tensor of another shape
            load_adapter_into(peft, path)
    else:
        load_weights_into(model, path)
    return int(state["step"]), Cursor(**state["cursor"]), int(state.get("tokens_seen", 0))


# what makes a model another one, in its config.json: the kind and every shape of its weights
MODEL_SHAPE_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
)


def refuse_other_model(path: Path, model: torch.nn.Module, state: dict[str, Any]) -> None:
    """One line when the full model checkpoint `path` holds (its model/config.json) is of another kind
    or shape than `model`, the --model of this run (a LoRA checkpoint holds only the adapter, whose
    shapes `load_adapter_into` checks)."""
    try:
        saved = json.loads((path / "model" / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # no model config (a LoRA adapter): the weights' shapes decide
    now = model.config.to_dict()
    differ = [k for k in MODEL_SHAPE_KEYS if isinstance(saved, dict) and k in saved and k in now and saved[k] != now[k]]
    if differ:
        key = differ[0]
        was = state.get("config", {}).get("model", "?")
        raise UserError(
            f"cannot resume {path}: it holds another model than --model (its {key} is {saved[key]}, "
            f"this model's {now[key]}): resume with the --model it was trained with ({was})"
        )


def load_training_state(
    path: Path,
    *,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    total_steps: int,
    rank: int,
    fsdp: bool,
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
