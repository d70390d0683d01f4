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
