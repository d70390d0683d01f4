"""The suite always ends: a rank that hangs is killed and reported (tests/gloo_ranks.py), and a test
that runs past its wall-clock limit fails, or, stuck where no signal reaches it, stops the run with
every thread's stack (tests/wallclock.py). What ended each case is read from its report (which limit
was met), not from the seconds it took, which a loaded machine stretches."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gloo_ranks import fork_ranks, run_killable

HERE = Path(__file__).resolve().parent


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split(")")[-1].split()[0] == "Z")  # a zombie is gone


def _gone(pids: list[int], within_s: float = 60.0) -> bool:  # a grace for a loaded machine
    end = time.monotonic() + within_s
    while any(_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.05)
    return not any(_alive(p) for p in pids)


def _sleeper(rank: int, record: str, hang: int) -> None:
    """Rank `hang` starts a child of its own and sleeps forever; the other returns at once."""
    if rank == hang:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])
        Path(record, f"rank{rank}.pids").write_text(f"{os.getpid()} {child.pid}")
        time.sleep(1000)


def test_a_hanging_rank_is_killed_with_what_it_started_and_reported(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match=r"^rank\(s\) \[1\] of 2 still running after 2 s: killed"):
        fork_ranks(_sleeper, (str(tmp_path), 1), deadline_s=2)
    pids = [int(p) for p in (tmp_path / "rank1.pids").read_text().split()]
    assert _gone(pids), pids


def _failing(rank: int, record: str) -> None:
    if rank == 0:
        raise ValueError("rank zero gave up")
    Path(record, "rank1.pid").write_text(str(os.getpid()))
    time.sleep(1000)  # as a rank waiting in a collective on the failed one


def test_a_failing_rank_is_reported_with_its_traceback_and_the_others_are_killed(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="rank 0 of 2 failed") as failed:  # (not the 120 s deadline's line)
        fork_ranks(_failing, (str(tmp_path),), deadline_s=120)
    assert "ValueError: rank zero gave up" in str(failed.value)
    if (tmp_path / "rank1.pid").exists():
        assert _gone([int((tmp_path / "rank1.pid").read_text())])


def test_ranks_that_return_pass() -> None:
    fork_ranks(lambda rank: None, deadline_s=60)


def test_a_command_past_its_timeout_is_killed_with_its_children(tmp_path: Path) -> None:
    """torchrun's shape: a launcher whose children hold its output pipes."""
    record = tmp_path / "pids"
    script = f"sleep 1000 & echo $$ $! > {record}; wait"
    with pytest.raises(AssertionError, match="still running after 2 s: killed with its process group"):
        run_killable(["sh", "-c", script], 2)
    assert _gone([int(p) for p in record.read_text().split()])
    done = run_killable(["sh", "-c", "echo out; echo err >&2; exit 3"], 30)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")


INNER_CONFTEST = """
import wallclock
from wallclock import (pytest_addoption, pytest_configure, pytest_runtest_call, pytest_runtest_setup,
                       pytest_runtest_teardown)
wallclock.HARD_STOP_GRACE_S = 2
"""

INNER_TESTS = """
import signal, time
import pytest

@pytest.mark.wallclock(1)
def test_sleeps():
    try:
        time.sleep(1000)
    except Exception:  # the limit is no Exception: code under test cannot swallow it
        pass

def test_quick():
    pass

@pytest.mark.wallclock(1)
def test_stuck_where_no_signal_reaches():
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])  # as a C call that never returns
    time.sleep(1000)
"""


def _inner_run(tmp_path: Path, *select: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(INNER_CONFTEST)
    (tmp_path / "test_inner.py").write_text(INNER_TESTS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    return run_killable(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_inner.py"),
            *select,
        ],
        120,
        cwd=tmp_path,
        env=env,
    )


def test_a_test_past_its_wall_clock_limit_fails_and_the_next_one_runs(tmp_path: Path) -> None:
    proc = _inner_run(tmp_path, "-k", "sleeps or quick")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 failed, 1 passed" in proc.stdout, proc.stdout
    assert "test_inner.py::test_sleeps (call) ran past its wall-clock limit of 1 s" in proc.stdout, proc.stdout


def test_a_test_stuck_where_no_signal_reaches_stops_the_run_with_every_stack(tmp_path: Path) -> None:
    proc = _inner_run(tmp_path, "-k", "stuck")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Timeout" in proc.stderr and "test_stuck_where_no_signal_reaches" in proc.stderr, proc.stderr
