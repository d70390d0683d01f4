"""Shared test setup. Tests live beside the package they test (tests/pipeline, whose folders mirror
pipeline/'s steps, and tests/trainer) or run whole commands (tests/e2e); this folder is on sys.path
(pytest puts a rootdir conftest's folder there), so they share the helpers `families` (model
families), `gloo_ranks` (training on two CPU ranks) and `packed_factory` (packed folders built in a
few lines). Every test runs under a wall-clock limit (tests/wallclock.py), so the suite always ends.
The README runs them on two pytest-xdist workers (`-n 2 --dist loadgroup`); the tests that start Ray
share one worker, one after another (two local Rays at once would hold twice the memory). A test
that looks at processes looks only at its own (tests/own_processes.py), never at the machine's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from wallclock import pytest_addoption, pytest_configure, pytest_runtest_call, pytest_runtest_setup, pytest_runtest_teardown  # noqa: F401  (hooks)

ROOT = Path(__file__).resolve().parents[1]
RAY_TESTS = re.compile(r"test_ray_|\[ray\]|bench_ray")  # tests that start a Ray cluster


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under `--dist loadgroup`, every test that starts Ray runs on the same worker."""
    for item in items:
        if RAY_TESTS.search(item.nodeid):
            item.add_marker(pytest.mark.xdist_group("ray"))


@pytest.fixture
def repo_root() -> Path:
    """The repository's root folder (data/, pipeline/, trainer/ ...)."""
    return ROOT
