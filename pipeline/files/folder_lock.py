"""One run per output folder at a time: an advisory lock (`fcntl.flock`) on a lock file, held for
the run's life.

The kernel drops the lock when the process that holds it ends, however it ends (kill -9 and power
loss included), so a crashed run never leaves a folder locked: the next run finds the stale file
unlocked and takes it over. The file records the holder's pid and host, which a second run names in
its one-line error. pack-data locks `.OUT.lock` beside its --out (the output folder itself appears
only when complete); pack-train locks `RUN/.pack-train.lock` inside its run folder.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from pipeline.errors import UserError


@contextmanager
def folder_lock(lock_path: str | os.PathLike[str], folder: str | os.PathLike[str], command: str) -> Iterator[None]:
    """Hold an exclusive lock on `lock_path` for the block, or raise a one-line UserError naming
    `folder` and the other run's pid when another `command` run holds it.

    Folders created here to hold the lock file are removed again afterwards when they are empty (a
    run that fails before writing anything leaves nothing), and so is the lock file.
    """
    check_no_file_in_the_way(Path(folder))
    lock_path = Path(lock_path)
    created = _make_parents(lock_path.parent)
    try:
        fd = _acquire(lock_path, folder, command)
    except BaseException:
        _remove_empty(created)
        raise
    try:
        yield
    finally:
        if fd is not None:
            with suppress(OSError):
                os.unlink(lock_path)  # still held: a run that opened this file retries on the new one
            os.close(fd)
        _remove_empty(created)


def check_no_file_in_the_way(out: Path, option: str = "--out") -> None:
    """A UserError when a regular file stands where a folder on the way to `out` has to be
    (`--out notes.txt/run` with notes.txt a file): the folder could not be made."""
    for folder in Path(out).absolute().parents:
        if folder.exists() or folder.is_symlink():
            if not folder.is_dir():
                raise UserError(
                    f"{option} {out}: {folder} is a file, not a folder, so nothing can be written below it: choose another {option}"
                )
            return


def _acquire(lock_path: Path, folder: str | os.PathLike[str], command: str) -> int | None:
    """The open, locked lock file (its content our pid and host); None where the file system has no
    locks (said on stderr)."""
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _holder(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise UserError(
                    f"{folder} is in use by another {command} run{holder}: wait for it to end, or choose another --out"
                ) from None
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                print(
                    f"{command}: warning: the file system of {folder} has no file locks, so nothing stops a second run on the same --out",
                    file=sys.stderr,
                )
                return None
            raise
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(lock_path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the run before us removed (and released) this file: lock the one there now
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
    except OSError as exc:  # a full disk: the lock file goes, so no folder made for it stays behind
        os.unlink(lock_path)
        os.close(fd)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise UserError(
                f"disk full: {command} could not write its lock {lock_path} into {folder}, so nothing "
                "was written: free some space, or choose another --out"
            ) from None
        raise
    return fd


def _holder(fd: int) -> str:
    """' (pid N on HOST)' from a lock file's content, '' when it holds none."""
    try:
        pid, host = os.pread(fd, 256, 0).decode().split()[:2]
    except (OSError, UnicodeDecodeError, ValueError):
        return ""
    return f" (pid {pid} on {host})" if pid.isdigit() else ""


def _make_parents(folder: Path) -> list[Path]:
    """Create `folder` and its missing parents; the ones created, deepest first."""
    missing = []
    path = folder.absolute()
    while not path.exists():
        missing.append(path)
        path = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise UserError(f"cannot make the folder {folder}: a file is in the way; choose another --out") from None
    return missing


def _remove_empty(folders: list[Path]) -> None:
    for path in folders:
        try:
            path.rmdir()
        except OSError:  # not empty (the run wrote into it), or gone
            return
