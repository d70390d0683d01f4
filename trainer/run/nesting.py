"""A run folder and the folders a run reads must not overlap where one run could replace or
remove what another needs (checked before torch is imported, beside `preflight.refuse_foreign_out`,
which refuses an `--out` inside the --model, --data, --eval-data or --tokenizer folder):

- `--out` inside another run folder: that run's `--keep-last` removes checkpoint folders, a
  `--merge-lora` replaces `merged/`, a new config.json replaces the old; and a run folder that holds
  a folder it did not write is not recognised as a run folder any more. Refused.
- `--model`, `--data`, `--eval-data` or `--tokenizer` inside what this run writes into its `--out`
  (`checkpoints/`, `merged/`, `tensorboard/`, ...): replaced or removed while the run reads it.
  Refused. Elsewhere in the run folder (`RUN/packed`, a folder the run never writes) is fine: the
  run writes only the entries named in `RUN_ENTRIES`, so nothing there is replaced or removed.
  `--resume RUN/checkpoints/step-N` is how a run continues from one of its checkpoints: not refused.
"""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.contract import RUN_CONFIG, RUN_ENTRIES, UserError
from trainer.config import TrainConfig
from trainer.run.preflight import is_run_folder, list_checkpoints


def _real(path: str) -> Path:
    return Path(os.path.realpath(os.path.expanduser(path)))


def _outer_run(out: Path) -> Path | None:
    """The nearest folder above `out` that is a run folder of pack-train's (one with its config.json
    or its checkpoints), or None."""
    for folder in out.parents:
        if ((folder / RUN_CONFIG).is_file() or list_checkpoints(folder)) and is_run_folder(folder):
            return folder
    return None


def refuse_nested_run(config: TrainConfig) -> None:
    """UserError (one line) for an `--out` inside another run folder, or a folder the run reads that
    lies in what the run writes into `--out` (see the module's docstring)."""
    out = _real(str(config.out))
    outer = _outer_run(out)
    if outer is not None:
        raise UserError(
            f"--out {config.out} is inside the run folder {outer}: a run there replaces and removes "
            "what it wrote (checkpoints/, merged/, config.json); choose an --out outside every run folder"
        )
    for option, value in (
        ("--model", config.model),
        ("--data", config.data),
        ("--eval-data", config.eval_data),
        ("--tokenizer", config.tokenizer),
    ):
        if not value or not os.path.exists(os.path.expanduser(str(value))):
            continue
        real = _real(str(value))
        hit = next((name for name in RUN_ENTRIES if real.is_relative_to(out / name)), None)
        if hit is not None:
            raise UserError(
                f"{option} {value} is inside {config.out}/{hit}, which this run writes (and "
                f"replaces or removes); copy it out of the run folder, or choose another --out"
            )
