"""The output folder of pack-data: checked before the job, written as a hidden temporary sibling,
and made visible by one atomic rename only when it is complete.

A folder named like the output therefore only ever appears complete: any failure (including ^C and
SIGTERM) removes the temporary folder, and one left by a run killed outright (SIGKILL, power loss)
is removed by the next run on the same host. `--overwrite` replaces only an empty folder or one
that holds nothing but what pack-data wrote into it: nothing of the user's is ever deleted.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipeline.errors import UserError
from pipeline.files.durable import fsync_path
from pipeline.files.folder_lock import check_no_file_in_the_way
from pipeline.shards import MANIFEST_NAME, pack_data_files


def check_out(out: Path, overwrite: bool) -> None:
    """--out may be new, or, with --overwrite, an empty folder or one that holds only what
    pack-data wrote into it."""
    check_no_file_in_the_way(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise UserError(f"--out {out} exists and is not a folder: choose another --out")
    if not overwrite:
        raise UserError(f"output folder {out} already exists: pass --overwrite to replace it, or choose another --out")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    ours = pack_data_files(out)
    if ours is None:
        raise UserError(
            f"--out {out} is a non-empty folder that pack-data did not write (no pack-data {MANIFEST_NAME}); "
            "refusing to replace it even with --overwrite: choose another --out"
        )
    foreign = [name for name in entries if name not in ours]
    if foreign:
        raise UserError(
            f"--out {out} holds {foreign[0]!r}, which pack-data did not write; refusing to replace the "
            "folder even with --overwrite: move it out of the folder, or choose another --out"
        )


@contextmanager
def output_folder(out: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a fresh temporary folder beside `out`; when the block succeeds, rename it to `out`
    (`commit`). However the block ends, the temporary folder is gone afterwards. An `out` that is a
    symbolic link stands for the folder it names: that folder is written (its temporary folder
    beside it, on its disk), and the link stays as it was."""
    if out.is_symlink():
        out = Path(os.path.realpath(out))
    parent = out.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(parent, out.name)
    tmp = parent / f"{tmp_prefix(out.name)}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        commit(tmp, out, overwrite)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def tmp_prefix(name: str) -> str:
    """Temporary folders of output `name` are `.NAME.tmp-HOST-PID-RANDOM`, beside it."""
    return f".{name}.tmp-{socket.gethostname()}-"


def local_inputs_folder(out: Path) -> Path:
    """Where remote inputs are downloaded: a hidden sibling of the local output folder, named like
    its temporary folders (so a run killed outright has it removed by the next one)."""
    return out.absolute().parent / f"{tmp_prefix(out.name)}{os.getpid()}-inputs-{uuid.uuid4().hex[:8]}"


def remove_stale_tmp(parent: Path, name: str) -> None:
    """Remove the temporary folders of output `name` in `parent` that runs on this host left when
    they were killed outright (SIGKILL, power loss): those whose process no longer exists. A folder
    of another host, or of a process that still exists, is left alone."""
    prefix = tmp_prefix(name)
    for path in parent.iterdir():
        pid = path.name[len(prefix) :].split("-", 1)[0] if path.name.startswith(prefix) else ""
        if pid.isdigit() and not _process_exists(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def commit(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished temporary folder to `out` (replacing an old output when allowed).
    Its files were fsynced as they were written; its entries are fsynced here, before the rename,
    and the parent's after it (`pipeline.files.durable`)."""
    fsync_path(tmp)
    if out.exists():
        check_out(out, overwrite)  # it may have appeared while we worked
        old = out.absolute().parent / f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        try:
            os.rename(tmp, out)
        except OSError as exc:  # --out appeared (non-empty) after the check at the start
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            raise UserError(
                f"output folder {out} appeared while packing: pass --overwrite to replace it, or choose another --out"
            ) from None
    fsync_path(out.absolute().parent)
