"""Fixtures shared by the trainer tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """Two OpenMP threads on a shared 2-core machine are 30x slower than one for the tiny models
    these tests train (use with `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
