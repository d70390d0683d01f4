"""Shared test setup. Tests live beside the package they test (tests/pipeline, whose folders mirror
pipeline/'s steps, and tests/trainer) or run whole commands (tests/e2e); this folder is on sys.path
(pytest puts a rootdir conftest's folder there), so they share the helpers `families` (model
families), `gloo_ranks` (training on two CPU ranks) and `packed_factory` (packed folders built in a
few lines)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def repo_root() -> Path:
    """The repository's root folder (data/, pipeline/, trainer/ ...)."""
    return ROOT
