"""Atomic, verified training checkpoints: everything needed to continue a run exactly.

Layout of `RUN_DIR/checkpoints/step-00000040/`:

- `model/`              `save_pretrained` output (config + safetensors), loadable by transformers
- `optimizer.pt`        optimizer state (full, unsharded)
- `scheduler.pt`        LR scheduler state
- `rng-rank{r}.pt`      python / numpy / torch (/ cuda) RNG states of every rank
  (the `.pt` files hold tensors and plain values only: `load_torch` reads them with
  `torch.load(weights_only=True)`, so a planted pickle cannot run code; a file that needs more is
  refused in one line)
- `trainer_state.json`  step, data cursor, tokens seen, the run configuration and data fingerprint
- `checkpoint.json`     written last: size and sha256 of every other file

A checkpoint is written into `checkpoints/.tmp-step-...`, fsynced, and renamed into place only when
complete (`pipeline.files.durable`); `checkpoints/latest` (a one-line text file, replaced atomically)
names the newest. A checkpoint is intact when every file that `checkpoint.json` lists is there with
its size and sha256: a crash, a full disk or a flipped byte after saving shows up as a damaged
checkpoint, which `resume_point` reports and steps over (or refuses, when strict). Resuming an older
checkpoint rolls back to it: the newer ones move, unchanged, to `RUN/superseded/N/` (`set_aside_newer`).
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import random
import re
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from pipeline.contract import (
    BEST,
    CHECKPOINTS,
    LATEST,
    METRICS,
    SUPERSEDED,
    UserError,
    file_sha256,
    fsync_path,
    fsync_tree,
    leaves,
    one_line,
    write_atomic,
    write_text_atomic,
)
from trainer.run.preflight import list_checkpoints  # torch-free: pack-train's early checks use it too

STATE_FILE = "trainer_state.json"
FILE_LIST = "checkpoint.json"


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def rng_state() -> dict[str, Any]:
    """RNG states of this process (python, numpy, torch CPU and, if present, CUDA), as tensors and
    plain values that `torch.load(weights_only=True)` reads back: numpy's key array becomes a tensor."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` captured."""
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


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
    writing = tmp / f"rng-rank{rank}.pt"
    try:
        torch.save(rng_state(), writing)
        if rank == 0:
            writing = tmp / "model"
            model.save_pretrained(writing, state_dict=model_state, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(writing)
            for name, obj in (("optimizer.pt", optimizer_state), ("scheduler.pt", scheduler_state)):
                writing = tmp / name
                torch.save(obj, writing)
            writing = tmp / STATE_FILE
            writing.write_text(json.dumps(trainer_state, indent=2) + "\n", encoding="utf-8")
        barrier()
        if rank == 0:
            writing = tmp / FILE_LIST
            write_file_list(tmp)
            writing = tmp
            fsync_tree(tmp)
    except BaseException as exc:  # a full disk, Ctrl-C: the unfinished folder goes
        full = isinstance(exc, Exception) and _disk_full(exc, tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if full or _write_failed(exc):
            raise UserError(_save_failed(final, writing.relative_to(tmp.parent), exc, full)) from None
        raise
    if rank == 0:
        if final.exists():  # re-saving a step (e.g. after resuming from it): replace it whole
            old = root / f".old-{checkpoint_name(step)}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        fsync_path(root)
        write_text_atomic(root / LATEST, final.name + "\n")
        if keep_last:
            best = best_checkpoint(run_dir)
            for stale in list_checkpoints(run_dir)[:-keep_last]:
                if best is None or stale.name != best["checkpoint"]:  # --save-best's survives --keep-last
                    shutil.rmtree(stale, ignore_errors=True)
    barrier()
    return final


def _disk_full(exc: Exception, folder: Path) -> bool:
    """Whether a failed write into `folder` ran out of space. torch.save reports it as a
    RuntimeError that names no errno ("unexpected pos ..."), safetensors as a SafetensorError
    ("... No space left on device (os error 28)"), so the file system's free space decides too."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    if "No space left on device" in text or "os error 28" in text or "Disk quota exceeded" in text:
        return True
    if not isinstance(exc, (OSError, RuntimeError)) and type(exc).__name__ != "SafetensorError":
        return False
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < (1 << 20)


def _write_failed(exc: BaseException) -> bool:
    """Whether `exc` is a failed write (not a bug): an OSError, safetensors' I/O error, or torch's
    stream writer failing ("PytorchStreamWriter failed writing file", "unexpected pos")."""
    text = str(exc)
    return (
        isinstance(exc, OSError)
        or (type(exc).__name__ == "SafetensorError" and "I/O error" in text)
        or (isinstance(exc, RuntimeError) and ("PytorchStreamWriter" in text or "unexpected pos" in text))
    )


def _save_failed(final: Path, writing: Path, exc: Exception, full: bool) -> str:
    """The one line of a checkpoint that could not be written (its unfinished folder is gone)."""
    where = f"saving checkpoint {final} failed while writing {writing}"
    after = "the unfinished checkpoint was removed; the checkpoints saved before are intact (continue with --resume)"
    if full:
        return f"disk full: {where}: free some space (or choose another --out); {after}"
    return f"{where} ({type(exc).__name__}: {one_line(exc, 160)}): check the disk (space, quota, errors); {after}"


def write_folder_atomic(final: Path, write: Callable[[Path], None], fix: str) -> None:
    """Create or replace the folder `final` whole: `write(tmp)` fills `.tmp-NAME` beside it, which is
    fsynced and renamed into place, so a kill -9 or a full disk never leaves a half-written `final`
    (what a killed writer left beside it is removed first). A full disk or a write error is one line
    ending with `fix`, the unfinished folder removed."""
    final = Path(final)
    tmp, old = final.parent / f".tmp-{final.name}", final.parent / f".old-{final.name}"
    for stale in (tmp, old):
        _remove(stale)
    try:
        write(tmp)
        fsync_tree(tmp)
    except BaseException as exc:  # a full disk, Ctrl-C: the unfinished folder goes
        full = isinstance(exc, Exception) and _disk_full(exc, final.parent)
        shutil.rmtree(tmp, ignore_errors=True)
        if full or _write_failed(exc):
            why = "disk full" if full else f"{type(exc).__name__}: {one_line(exc, 160)}"
            raise UserError(f"writing {final} failed ({why}); nothing of it was left: {fix}") from None
        raise
    if final.exists() or final.is_symlink():
        os.replace(final, old)
        os.replace(tmp, final)
        _remove(old)
    else:
        os.replace(tmp, final)
    fsync_path(final.parent)


def _remove(path: Path) -> None:
    """Remove a folder tree, a file or a link (never what a link points to), if there."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def best_checkpoint(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """RUN/best.json ({"step", "eval_loss", "checkpoint": its folder name under checkpoints/}) as
    `--save-best` writes it, or None."""
    try:
        return json.loads((Path(run_dir) / BEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def mark_best(run_dir: str | os.PathLike[str], step: int, eval_loss: float, checkpoint: Path) -> None:
    """Record `checkpoint` as the one with the lowest eval loss so far (atomically; rank 0 only)."""
    record = {"step": step, "eval_loss": eval_loss, "checkpoint": Path(checkpoint).name}
    write_text_atomic(Path(run_dir) / BEST, json.dumps(record) + "\n")


def checkpoint_step(path: Path) -> int | None:
    """The step a checkpoint folder's name says (step-00000040 -> 40), or None for another name."""
    found = re.fullmatch(r"step-(\d+)", Path(path).name)
    return int(found[1]) if found else None


def set_aside_newer(run_dir: str | os.PathLike[str], path: Path) -> list[Path]:
    """A roll-back to checkpoint `path` of the run in `run_dir` (rank 0, before the run writes):
    move every newer checkpoint, unchanged, to RUN/superseded/N/checkpoints/ (N: the first number
    free), with a copy of metrics.jsonl, and best.json when it names one of them, so that the
    continued run's saves (which reach the same step names), --keep-last and --resume never take
    them for its own; they stay loadable (--resume PATH with a new --out). checkpoints/latest names
    `path` again. Newest first, so an interrupted move leaves an unbroken history. Returns where
    they went."""
    root = Path(run_dir)
    step = checkpoint_step(path)
    newer = [p for p in list_checkpoints(root) if (checkpoint_step(p) or 0) > (step or 0) and p.name != path.name]
    if step is None or not newer:
        return []
    number = 1
    while (root / SUPERSEDED / str(number)).exists():
        number += 1
    kept = root / SUPERSEDED / str(number)
    (kept / CHECKPOINTS).mkdir(parents=True)
    metrics = root / METRICS
    if metrics.is_file():
        write_atomic(kept / metrics.name, lambda tmp: shutil.copyfile(metrics, tmp))
    best = best_checkpoint(root)
    if isinstance(best, dict) and best.get("checkpoint") in {p.name for p in newer}:
        os.replace(root / BEST, kept / BEST)
    moved = []
    for old in reversed(newer):
        os.replace(old, kept / CHECKPOINTS / old.name)
        moved.append(kept / CHECKPOINTS / old.name)
    fsync_path(kept / CHECKPOINTS)
    fsync_path(root / CHECKPOINTS)
    write_text_atomic(root / CHECKPOINTS / LATEST, path.name + "\n")
    return moved[::-1]


def write_file_list(folder: Path) -> None:
    """Write `folder/checkpoint.json`: the size and sha256 of every other file under `folder`."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != FILE_LIST)
    listing = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": d} for p, d in zip(files, _sha256s(files))}
    (folder / FILE_LIST).write_text(json.dumps({"files": listing}, indent=1) + "\n", encoding="utf-8")


def checkpoint_damage(path: Path) -> str | None:
    """What is wrong with checkpoint folder `path` (a phrase), or None when it is intact: every
    file `checkpoint.json` lists is there, with its size and sha256."""
    try:
        listing = json.loads((path / FILE_LIST).read_text(encoding="utf-8"))["files"]
        expected = {name: (int(f["bytes"]), str(f["sha256"])) for name, f in listing.items()}
    except FileNotFoundError:
        return f"it has no {FILE_LIST} (its save never finished)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"its {FILE_LIST} is unreadable ({type(exc).__name__})"
    for name in expected:  # a listed name that climbs out of the folder is never opened
        if (problem := leaves(path, name)) is not None:
            return f"its {FILE_LIST} lists {name!r}, which leaves the checkpoint folder ({problem})"
    for name, (size, _) in expected.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, not {size}"
    names = list(expected)
    for name, digest in zip(names, _sha256s([path / n for n in names])):
        if digest != expected[name][1]:
            return f"{name} does not match its sha256"
    return None


def _sha256s(files: list[Path]) -> list[str]:
    """The hex sha256 of each file, four files at a time (hashlib releases the GIL)."""
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(file_sha256, files))


def resume_point(run_dir: str | os.PathLike[str], *, strict: bool) -> tuple[Path, list[str]]:
    """The newest intact checkpoint of a run, and one line for each newer one that is damaged.

    With `strict`, a damaged newest checkpoint is a UserError instead. Example: with step-20 intact
    and step-30 missing `optimizer.pt`, the answer is (step-20, ["checkpoint .../step-00000030 is
    damaged (optimizer.pt is missing): resuming from step-00000020, the newest intact one"]).
    """
    found = list_checkpoints(run_dir)
    if not found:
        raise UserError(
            f"--resume: {run_dir} holds no checkpoint to resume from: leave out --resume to start "
            "the run, or give --out the run folder whose checkpoints/ it should continue"
        )
    damaged: list[tuple[Path, str]] = []
    for path in reversed(found):
        damage = checkpoint_damage(path)
        if damage is None:
            break
        damaged.append((path, damage))
    else:
        path, damage = damaged[0]
        raise UserError(
            f"--resume: no intact checkpoint in {Path(run_dir) / CHECKPOINTS}: the newest, {path.name}, "
            f"is damaged ({damage}): start a new run with another --out"
        )
    if damaged and strict:
        bad, damage = damaged[0]
        raise UserError(
            f"--resume=strict: checkpoint {bad} is damaged ({damage}): use --resume to continue from {path.name}, the newest intact one"
        )
    notes = [f"checkpoint {bad} is damaged ({damage}): resuming from {path.name}, the newest intact one" for bad, damage in damaged]
    return path, notes


def read_trainer_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON state of checkpoint folder `path`: an object whose `step` and `tokens_seen` are
    non-negative integers, `cursor` {"epoch", "step_in_epoch"} too and `config` an object; else
    UserError, one line."""
    file = Path(path) / STATE_FILE
    try:
        state = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: unreadable checkpoint state ({one_line(exc, 160)}): pick another checkpoint") from None

    def count(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    cursor = state.get("cursor") if isinstance(state, dict) else None
    if not (
        isinstance(state, dict)
        and count(state.get("step"))
        and count(state.get("tokens_seen", 0))
        and isinstance(state.get("config", {}), dict)
        and isinstance(cursor, dict)
        and set(cursor) == {"epoch", "step_in_epoch"}
        and all(map(count, cursor.values()))
    ):
        raise UserError(
            f"{file}: not a checkpoint state pack-train writes (an object with integer step, "
            "tokens_seen and cursor {epoch, step_in_epoch}): pick another checkpoint"
        )
    return state


@contextmanager
def loading(path: str | os.PathLike[str]) -> Iterator[None]:
    """Any failure inside (a UserError aside) becomes one line that names `path` as damaged."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the loader raises, the file is unusable
        first = (str(exc).strip().splitlines() or [""])[0][:160]
        raise UserError(
            f"{path}: cannot be loaded ({type(exc).__name__}{': ' + first if first else ''}): the "
            "checkpoint is damaged or from another model; move it aside to resume from an older one"
        ) from None


def load_torch(path: str | os.PathLike[str]) -> Any:
    """A checkpoint's `.pt` file, read with `torch.load(weights_only=True)`: tensors and plain values
    only, so a file planted in a checkpoint cannot run code while it loads. A file that holds
    anything else (a pickled object) is refused in one line."""
    with loading(path):
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
            if found is None:  # not a pickle at all: `loading` says the file is damaged
                raise
            raise UserError(
                f"{path}: refused: it holds Python objects besides tensors and plain values ({found[1]}), "
                "and loading them could run code from the file; pack-train never writes such a file, so "
                "the checkpoint was written by something else or altered: move it aside (or resume from "
                "another checkpoint of a run you trust)"
            ) from None


def load_model_weights(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """All tensors of the safetensors files in a checkpoint's `model/` folder (sharded or not)."""
    files = sorted((Path(path) / "model").glob("*.safetensors"))
    if not files:
        raise UserError(
            f"{path}/model: no safetensors weights: the checkpoint is incomplete; resume from "
            "another one (--resume alone takes the newest intact checkpoint)"
        )
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with loading(file):
            state.update(load_file(str(file)))
    return state


def tied_parameter_names(model: torch.nn.Module) -> set[str]:
    """Names of parameters that share storage with another one (e.g. tied embeddings/lm_head)."""
    seen: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        seen.setdefault(id(param), []).append(name)
    return {n for names in seen.values() if len(names) > 1 for n in names}
