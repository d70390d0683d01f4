"""A wall-clock limit on every test, so that `python -m pytest` always ends (hooks loaded by
tests/conftest.py; no plugin to install).

Each phase of a test (setup, call, teardown) gets `wallclock_limit_s` seconds (pyproject's
[tool.pytest.ini_options]; `@pytest.mark.wallclock(seconds)` for one test; 0 turns it off). At the
limit, SIGALRM fails the test with one line naming the limit; Python code waiting anywhere
(a child process, a socket, a sleep) gets it. Code stuck inside a C call never returns to the
interpreter to see it, so a hard stop follows `HARD_STOP_GRACE_S` later: faulthandler prints
every thread's stack and ends the test process (exit status 1); forked ranks die with it
(tests/gloo_ranks.py)."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from collections.abc import Generator

import pytest

HARD_STOP_GRACE_S = 60


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("wallclock_limit_s", "seconds each phase of a test may run (0: no limit)", default="600")


_stderr = sys.__stderr__  # the terminal's stderr, not pytest's capture of it (see pytest_configure)


def pytest_configure(config: pytest.Config) -> None:
    global _stderr
    config.addinivalue_line("markers", "wallclock(seconds): this test's own wall-clock limit")
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None and capture.is_globally_capturing():  # fd 2 is pytest's file: take the real one
        capture.suspend_global_capture()
        try:
            _stderr = os.fdopen(os.dup(2), "w")
        finally:
            capture.resume_global_capture()


class WallClockExceeded(pytest.fail.Exception):
    """The test ran past its limit (a BaseException: `except Exception` in the code under test
    cannot swallow it)."""


def _limit(item: pytest.Item) -> float:
    marker = item.get_closest_marker("wallclock")
    return float(marker.args[0]) if marker else float(item.config.getini("wallclock_limit_s"))


def _limited(item: pytest.Item, phase: str) -> Generator[None, None, None]:
    seconds = _limit(item)
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expired(signum, frame) -> None:
        raise WallClockExceeded(
            f"{item.nodeid} ({phase}) ran past its wall-clock limit of {seconds:g} s "
            f"(wallclock_limit_s in pyproject.toml, or @pytest.mark.wallclock)",
            pytrace=False,
        )

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    faulthandler.dump_traceback_later(seconds + HARD_STOP_GRACE_S, exit=True, file=_stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    yield from _limited(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    yield from _limited(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    yield from _limited(item, "teardown")
