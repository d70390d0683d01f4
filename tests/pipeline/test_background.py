"""pipeline.background (work in a thread beside the job; work started ahead, results in order) and the
encode workers, which end with their parent."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.background import Background, done, in_order
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


class _Recorder:
    """Starts work for in_order and records how many items, and how much weight, were in flight."""

    def __init__(self, pool: ThreadPoolExecutor, weights: list[int]) -> None:
        self.pool, self.weights = pool, weights
        self.started: list[int] = []
        self.yielded = 0
        self.most = self.most_weight = 0

    def start(self, i: int):
        self.started.append(i)
        flying = self.started[self.yielded :]
        self.most = max(self.most, len(flying))
        self.most_weight = max(self.most_weight, sum(self.weights[j] for j in flying))
        return done(i * i) if i % 3 == 0 else self.pool.submit(lambda: (time.sleep(0.001 * (i % 2)), i * i)[1])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 10), max_size=30), st.integers(1, 5), st.integers(0, 25))
def test_in_order_yields_every_result_in_order_within_depth_and_budget(weights, depth, budget):
    """Results come back in the items' order; at most `depth` items are in flight, and their weight
    stays within `budget` unless one item alone exceeds it (then it is the only one in flight)."""
    with ThreadPoolExecutor(3) as pool:
        rec = _Recorder(pool, weights)
        out = []
        for item, result in in_order(range(len(weights)), rec.start, depth=depth, weight=weights.__getitem__, budget=budget):
            out.append((item, result))
            rec.yielded += 1
    assert out == [(i, i * i) for i in range(len(weights))]
    assert rec.most <= depth
    if budget:
        assert rec.most_weight <= max(budget, max(weights, default=0))


def test_in_order_raises_the_failing_items_error_at_its_turn():
    def start(i: int):
        if i == 2:
            raise_later = ThreadPoolExecutor(1)
            return raise_later.submit(_fails)
        return done(i)

    got = []
    with pytest.raises(UserError, match="not found"):
        for item, _ in in_order(range(5), start, depth=3):
            got.append(item)
    assert got == [0, 1]


ORPHAN = r"""
import os, sys, time
from pipeline.tokenize.encode_pool import EncodePool

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
    deadline = time.monotonic() + 60  # a grace for a loaded machine
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if _alive(p)]
    for p in left:  # never leave them behind, even when the test fails
        os.kill(p, signal.SIGKILL)
    assert left == []
