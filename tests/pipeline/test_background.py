"""pipeline.background (work in a thread beside the job) and the encode workers, which end with their parent."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pipeline.background import Background
from pipeline.errors import UserError


def _pid_plus(x: int) -> tuple[int, int]:
    return os.getpid(), x + 1


def _fails() -> None:
    raise UserError("tokenizer folder x not found: pass a folder")


def test_background_thread_returns_value_or_raises() -> None:
    assert Background(_pid_plus, 1).result() == (os.getpid(), 2)
    job = Background(_fails)
    with pytest.raises(UserError):
        job.result()


ORPHAN = r"""
import os, sys, time
from pipeline.encode_pool import EncodePool

pool = EncodePool(3)
print(*[p.pid for p in pool._procs], flush=True)
os._exit(0)  # as a SIGKILL would: no atexit handler closes the pool
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_children_end_when_the_parent_dies_without_a_word(tmp_path):
    """Tokenizer workers hold no end of their parent's pipes: when the parent dies (SIGKILL,
    os._exit), the workers read EOF, so none lingers."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    with open(tmp_path / "pids", "w") as out:  # not a pipe: the children need not close it
        subprocess.run([sys.executable, "-c", ORPHAN], cwd=root, stdout=out, stderr=subprocess.DEVNULL, check=True)
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 3
    deadline = time.monotonic() + 20
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if _alive(p)]
    for p in left:  # never leave them behind, even when the test fails
        os.kill(p, signal.SIGKILL)
    assert left == []
