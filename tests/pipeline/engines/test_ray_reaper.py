"""The Ray watchdog's process family: a process whose environment no longer shows the mark (Ray's
agents rename themselves, which can overwrite what /proc shows of their environment) is still
stopped, found through its marked parent while the driver runs and kept by pid and start time."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from pipeline.engines.ray_reaper import RAY_MARK, family, marked, stop

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="the watchdog reads /proc (Linux)")

# a marked parent that starts a child without the mark, prints the child's pid and waits
PARENT = (
    "import os, subprocess, sys, time; "
    f"env = {{k: v for k, v in os.environ.items() if k != {RAY_MARK!r}}}; "
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], env=env); "
    "print(child.pid, flush=True); time.sleep(60)"
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_child_without_the_mark_is_kept_in_the_family_and_stopped() -> None:
    token = uuid.uuid4().hex
    parent = subprocess.Popen([sys.executable, "-c", PARENT], env={**os.environ, RAY_MARK: token}, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        # the mark alone finds the parent only; the family adds its unmarked child
        assert marked(token) == [parent.pid]
        known = family(token, {})
        assert set(known) == {parent.pid, child}
        # the parent dies (as the raylet does first): the child, orphaned and unmarked, stays known
        parent.kill()
        parent.wait()
        assert marked(token) == [] and child in family(token, known)
        # a pid whose start time differs (reused by another process) is not taken for the old one
        assert child not in family(token, {child: known[child] + 1})
        stop(token, known, grace=0.5, settle=2.0)
        deadline = time.monotonic() + 60  # a grace for a loaded machine
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        for pid in (parent.pid, child):
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        parent.wait()
