"""Paths that come from data stay inside the folder they belong to.

A manifest names its shards and its eval folder, a checkpoint's `checkpoint.json` names its files, a
Hub dataset's card and configs name data folders and files: each of these is read from a file that
someone else may have written (a shared packed folder, a downloaded checkpoint, a Hub repo). Every
such name goes through `contained` before anything is opened: it must be a relative path with no
`..` part, and, resolved (symbolic links followed), it must stay under the folder's root. Otherwise
the command stops in one line naming the field, the value and the folder.

    >>> contained("/data/packed", "shard-00000.arrow", "manifest.json shards[0].file")
    PosixPath('/data/packed/shard-00000.arrow')
    >>> contained("/data/packed", "../other/shard.arrow", "manifest.json shards[0].file")
    Traceback (most recent call last):
    pipeline.errors.UserError: manifest.json shards[0].file is '../other/shard.arrow', which leaves /data/packed ...
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath, PureWindowsPath

from pipeline.errors import UserError


def escape(name: str) -> str | None:
    """Why `name`, a path read from data, could leave the folder it is joined to (a phrase), or None
    when it is a plain relative path: not empty, not absolute, no drive, no `..` part, no NUL."""
    if not isinstance(name, str) or not name.strip():
        return "it is not a non-empty path"
    if "\0" in name:
        return "it holds a NUL character"
    if PurePosixPath(name).is_absolute() or PureWindowsPath(name).anchor:
        return "it is an absolute path"
    if ".." in PurePosixPath(name.replace("\\", "/")).parts:
        return "it climbs out with '..'"
    return None


def leaves(folder: str | os.PathLike[str], name: str, *, root: str | os.PathLike[str] | None = None) -> str | None:
    """Why `folder / name` (`name` read from data) is not inside the folder (a phrase), or None: `name`
    must be a plain relative path (`escape`) that, resolved, stays under `root` (default `folder`; a
    Hub snapshot passes its repo's cache folder, whose blobs its files link to)."""
    problem = escape(name)
    if problem is None:
        top = Path(root if root is not None else folder).resolve()
        target = (Path(folder) / name).resolve()
        if target != top and top not in target.parents:
            problem = f"it resolves (through a symbolic link) to {target}"
    return problem


def contained(folder: str | os.PathLike[str], name: str, what: str, *, root: str | os.PathLike[str] | None = None) -> Path:
    """`folder / name`, once `leaves` finds nothing wrong with `name` (`what` says where it was read,
    e.g. "manifest.json shards[3].file"); otherwise UserError, one line."""
    problem = leaves(folder, name, root=root)
    if problem is not None:
        raise UserError(
            f"{what} is {name!r}, which leaves {folder}: {problem}; a path read from the folder's files must "
            "name something inside it: the file was altered or written by something else; restore or "
            "re-create it"
        )
    return Path(folder) / name
