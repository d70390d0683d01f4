"""A console command run for a test whose subject is what the command decides and writes, with the
answer's fields the tests read from a finished subprocess (`returncode`, `stdout_text`,
`stderr_text`), so `error_line` and the like read both.

It runs as its own process, as a user runs it. Run inside the pytest worker instead (click's
CliRunner), the commands' signal handlers and pack-train's data-loader processes stayed in the worker
after the command, and a full run of the suite lost a worker and hung (the cause was not pinned down
further; a process per command rules it out).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Finished:
    returncode: int
    stdout_text: str
    stderr_text: str


def run_here(name: str, *args: object, cwd: Path) -> Finished:
    """Run console command `name` (`pack-data`, `pack-train`, ...; with `--no-progress` for the two
    that take it) in the folder `cwd`, as `cli(name, *args, cwd=cwd)` does."""
    argv = [str(Path(sys.executable).parent / name), *map(str, args)]
    if name in ("pack-data", "pack-train"):
        argv.append("--no-progress")
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600)
    return Finished(done.returncode, done.stdout, done.stderr)
