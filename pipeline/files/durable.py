"""Durable, atomic writes: what a rename commits is on disk before the rename makes it visible.

A rename shows a finished file or folder at once, but after a power loss the file system may show
the new name over data that never reached the disk. Every writer of output that a rename commits
(pack-data's folder, its manifest, pack-report's files, pack-train's checkpoints) therefore follows
one order: write -> fsync the files -> fsync their folder -> rename -> fsync the folder renamed into.

Example: `write_text_atomic(Path("run/latest"), "step-00000040\\n")` leaves either the old
`run/latest` or the new one, complete, whatever happens to the process or the machine.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flush one file's (or one folder's entries') data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike[str]) -> None:
    """fsync every file under `root`, then every folder, deepest first, `root` last."""
    folders = []
    for folder, _, files in os.walk(root):
        folders.append(folder)
        for name in files:
            fsync_path(os.path.join(folder, name))
    for folder in reversed(folders):
        fsync_path(folder)


def write_atomic(path: str | os.PathLike[str], write: Callable[[Path], None]) -> None:
    """Create or replace `path` whole: `write(tmp)` fills a temporary file beside it, which is
    fsynced and renamed over `path`. The file gets the permissions of a plainly created one."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        fsync_path(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_path(path.parent)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """`write_atomic` of a UTF-8 text."""
    write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
