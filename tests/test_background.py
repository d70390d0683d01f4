"""pipeline.background: work that overlaps a job, in a thread or a forked process."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pipeline.background import Background, Forked
from pipeline.errors import UserError


def _pid_plus(x: int) -> tuple[int, int]:
    return os.getpid(), x + 1


def _fails() -> None:
    raise UserError("tokenizer folder x not found: pass a folder")


def _slow(seconds: float) -> str:
    time.sleep(seconds)
    return "done"


def _dies() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def test_forked_runs_in_another_process_and_returns_its_value() -> None:
    pid, value = Forked(_pid_plus, 41).result()
    assert value == 42 and pid != os.getpid()


def test_forked_reraises_the_child_exception_here() -> None:
    job = Forked(_fails)
    with pytest.raises(UserError, match="tokenizer folder x not found"):
        job.result()
    with pytest.raises(UserError):  # and again: the outcome is kept
        job.result()


def test_forked_done_only_once_the_answer_is_there() -> None:
    job = Forked(_slow, 0.3)
    assert not job.done()
    assert job.result() == "done" and job.done()


def test_forked_child_killed_is_an_error_not_a_hang() -> None:
    with pytest.raises(ChildProcessError, match="exited with code -9"):
        Forked(_dies).result()


def test_background_thread_returns_value_or_raises() -> None:
    assert Background(_pid_plus, 1).result() == (os.getpid(), 2)
    job = Background(_fails)
    with pytest.raises(UserError):
        job.result()
    assert job.done()


ORPHAN = r"""
import os, sys, time
from pipeline.background import Forked
from pipeline.encode_pool import EncodePool

def answer():
    time.sleep(0.5)  # the parent is gone by now
    return "x" * (8 << 20)  # more than a pipe holds: sending it would block while anyone could read

pool = EncodePool(3)
job = Forked(answer)
print(*[p.pid for p in pool._procs], job._proc.pid, flush=True)
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
    """Tokenizer workers and the forked loader hold no end of their parent's pipes: when the parent
    dies (SIGKILL, os._exit), the workers read EOF and the loader's answer fails, so none lingers."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    with open(tmp_path / "pids", "w") as out:  # not a pipe: the children need not close it
        subprocess.run([sys.executable, "-c", ORPHAN], cwd=root, stdout=out, stderr=subprocess.DEVNULL, check=True)
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 4
    deadline = time.monotonic() + 20
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if _alive(p)]
    for p in left:  # never leave them behind, even when the test fails
        os.kill(p, signal.SIGKILL)
    assert left == []
