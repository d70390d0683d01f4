"""The GPU correctness checks (tests/gpu/check_gpu_*.py) under pytest: each runs as its own process
(a fresh CUDA context) on a machine with a CUDA device and must exit 0 (every backend within its
tolerance); without one they are skipped. Each check also runs by hand, as its docstring says:
`python3 tests/gpu/check_gpu_attention.py`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
CHECKS = sorted(p.name for p in HERE.glob("check_gpu_*.py"))


def test_every_check_is_collected():
    """What the parametrized test runs is every check in this folder (a renamed or new check is
    run, never silently left out)."""
    assert CHECKS == ["check_gpu_attention.py", "check_gpu_families.py", "check_gpu_hf.py"]


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the GPU checks need one")
@pytest.mark.parametrize("check", CHECKS)
def test_gpu_check_passes(check: str, tmp_path: Path):
    proc = subprocess.run([sys.executable, str(HERE / check)], cwd=tmp_path, capture_output=True, text=True, timeout=540, check=False)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
