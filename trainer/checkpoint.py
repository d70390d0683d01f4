"""Atomic training checkpoints: everything needed to continue a run exactly where it stopped.

Layout of `RUN_DIR/checkpoints/step-00000040/`:

- `model/`              `save_pretrained` output (config + safetensors), loadable by transformers
- `optimizer.pt`        optimizer state (full, unsharded)
- `scheduler.pt`        LR scheduler state
- `rng-rank{r}.pt`      python / numpy / torch (/ cuda) RNG states of every rank
- `trainer_state.json`  step, data cursor, tokens seen, the run configuration and data fingerprint

A checkpoint is written into `checkpoints/.tmp-step-...` and renamed into place only when complete;
`checkpoints/latest` (a one-line text file, replaced atomically) names the newest complete one. A
crash while saving therefore never leaves a checkpoint that looks complete but is not.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.errors import UserError

CHECKPOINTS = "checkpoints"
LATEST = "latest"
STATE_FILE = "trainer_state.json"


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def rng_state() -> dict[str, Any]:
    """RNG states of this process (python, numpy, torch CPU and, if present, CUDA)."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` captured."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def save_checkpoint(
    run_dir: str | os.PathLike[str],
    step: int,
    *,
    model: Any,
    model_state: dict[str, torch.Tensor] | None,
    optimizer_state: dict[str, Any] | None,
    scheduler_state: dict[str, Any] | None,
    trainer_state: dict[str, Any],
    tokenizer: Any = None,
    rank: int = 0,
    barrier: Callable[[], None] = lambda: None,
    keep_last: int | None = None,
) -> Path:
    """Write a complete checkpoint for `step` atomically; every rank calls this (collectively).

    `model` is the plain Hugging Face model (for `save_pretrained`); `model_state` its full state dict
    (needed when the parameters are sharded; None uses the model's own). Only rank 0 writes model,
    optimizer and scheduler; every rank writes its RNG state.
    """
    root = Path(run_dir) / CHECKPOINTS
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{checkpoint_name(step)}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    barrier()
    torch.save(rng_state(), tmp / f"rng-rank{rank}.pt")
    if rank == 0:
        model.save_pretrained(tmp / "model", state_dict=model_state, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "model")
        torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save(scheduler_state, tmp / "scheduler.pt")
        (tmp / STATE_FILE).write_text(json.dumps(trainer_state, indent=2) + "\n", encoding="utf-8")
    barrier()
    if rank == 0:
        if final.exists():  # re-saving a step (e.g. after resuming from it): replace it whole
            old = root / f".old-{checkpoint_name(step)}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        _write_text_atomic(root / LATEST, final.name + "\n")
        if keep_last:
            for stale in list_checkpoints(run_dir)[:-keep_last]:
                shutil.rmtree(stale, ignore_errors=True)
    barrier()
    return final


def list_checkpoints(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    done = [p for p in root.glob("step-*") if (p / STATE_FILE).is_file()]
    return sorted(done, key=lambda p: p.name)


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint of a run (per `latest`, else the highest step), or None."""
    root = Path(run_dir) / CHECKPOINTS
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text(encoding="utf-8").strip()
        if (named / STATE_FILE).is_file():
            return named
    done = list_checkpoints(run_dir)
    return done[-1] if done else None


def read_trainer_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON state of checkpoint folder `path`."""
    try:
        return json.loads((Path(path) / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: unreadable checkpoint state ({exc}): pick another checkpoint") from None


def load_torch(path: str | os.PathLike[str]) -> Any:
    """torch.load of a file this module wrote (our own files: full unpickling is allowed)."""
    return torch.load(path, map_location="cpu", weights_only=False)


def load_model_weights(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """All tensors of the safetensors files in a checkpoint's `model/` folder (sharded or not)."""
    from safetensors.torch import load_file

    files = sorted((Path(path) / "model").glob("*.safetensors"))
    if not files:
        raise UserError(f"{path}/model: no safetensors weights: the checkpoint is incomplete")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def tied_parameter_names(model: torch.nn.Module) -> set[str]:
    """Names of parameters that share storage with another one (e.g. tied embeddings/lm_head)."""
    seen: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        seen.setdefault(id(param), []).append(name)
    return {n for names in seen.values() if len(names) > 1 for n in names}
