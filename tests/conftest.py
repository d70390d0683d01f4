"""Shared test setup. Tests live beside the package they test (tests/pipeline, whose folders mirror
pipeline/'s steps, and tests/trainer) or run whole commands (tests/e2e); this folder is on sys.path
(pytest puts a rootdir conftest's folder there), so they share the helpers `families` (model
families), `gloo_ranks` (training on two CPU ranks) and `packed_factory` (packed folders built in a
few lines). Every test runs under a wall-clock limit (tests/wallclock.py), so the suite always ends."""

from __future__ import annotations

from pathlib import Path

import pytest

from wallclock import (pytest_addoption, pytest_configure, pytest_runtest_call,  # noqa: F401  (hooks)
                       pytest_runtest_setup, pytest_runtest_teardown)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def repo_root() -> Path:
    """The repository's root folder (data/, pipeline/, trainer/ ...)."""
    return ROOT
