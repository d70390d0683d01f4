"""A real full disk for tests: `small_disk(folder, size)` mounts a tmpfs of `size` (e.g. "512k") on
`folder` for the block and unmounts it after; mounting needs root, so elsewhere the test is skipped.

    with small_disk(tmp_path / "small", "2m") as small:
        ...  # writes past 2 MiB fail with ENOSPC
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_disk(folder: Path, size: str) -> Iterator[Path]:
    folder.mkdir()
    mounted = (
        os.geteuid() == 0
        and subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True).returncode == 0
    )
    if not mounted:
        pytest.skip("mounting a small file system needs root")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)  # lazy: a failed write may hold a file open
