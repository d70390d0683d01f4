"""A console command run inside the test's own process (click's CliRunner), for the tests whose
subject is what the command decides and writes, not its process: no interpreter start-up, no second
import of torch and transformers. The answer has the fields the tests read from a finished
subprocess (`returncode`, `stdout_text`, `stderr_text`), so `error_line` and the like read both.

An exception the command let escape (a traceback, for a user) is put into `stderr_text` as one: the
checks for "no traceback" see it as they would in a real process.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from pathlib import Path

import click
from click.testing import CliRunner


@dataclass
class Finished:
    returncode: int
    stdout_text: str
    stderr_text: str


def commands() -> dict[str, click.Command]:
    from pipeline.cli import pack_data, pack_report, pack_verify
    from trainer.cli import pack_train

    return {"pack-data": pack_data, "pack-verify": pack_verify, "pack-report": pack_report, "pack-train": pack_train}


def run_here(name: str, *args: object, cwd: Path) -> Finished:
    """Run console command `name` (`pack-data`, `pack-train`, ...; with `--no-progress` for the two
    that take it) in this process, in the folder `cwd`, as `cli(name, *args, cwd=cwd)` would."""
    argv = [str(a) for a in args] + (["--no-progress"] if name in ("pack-data", "pack-train") else [])
    before = os.getcwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(commands()[name], argv)
    finally:
        os.chdir(before)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "Traceback (most recent call last):\n" + "".join(traceback.format_exception(result.exception))
    return Finished(result.exit_code, result.stdout, stderr)
