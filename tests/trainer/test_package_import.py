"""Importing the trainer prints nothing: the README's Python examples start with
`from trainer import train, TrainConfig`, and transformers imports torchao (when installed) on the
way, whose import logs lines of its own (trainer._quiet_optional_imports)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_importing_train_prints_nothing(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "from trainer import train, TrainConfig; import trainer.run.loop"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    assert (proc.stdout, proc.stderr) == ("", "")
