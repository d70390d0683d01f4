"""`--out` and the inputs must not overlap: an `--out` inside an input folder (or one a glob walks
into) is read back as input by the next run, and an input inside `--out` (or an input file's own
folder as `--out`) is deleted when `--overwrite` replaces the folder. Both are refused in one line before anything is read or written.

Paths are compared with every symbolic link resolved, so a link to the same folder counts as the
folder. Remote inputs and a remote `--out` (URIs), and Hub ids, never share a local folder.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Sequence
from pathlib import Path

from pipeline.errors import UserError

_GLOB_CHARS = re.compile(r"[*?\[]")


def _real(path: str) -> Path:
    return Path(os.path.realpath(os.path.expanduser(path)))


def _glob_reaches(pattern: str, out: Path) -> bool:
    """Whether the glob `pattern` can match `out`, a folder above it, or anything inside it: its
    parts match out's parts one by one as far as both go (`**` matches anything below)."""
    parts = Path(os.path.abspath(os.path.expanduser(pattern))).parts
    fixed = next(i for i, part in enumerate(parts) if _GLOB_CHARS.search(part))
    head = _real(os.path.join(*parts[:fixed])).parts
    for mine, theirs in zip(out.parts, (*head, *parts[fixed:])):
        if theirs == "**":
            return True
        if not fnmatch.fnmatchcase(mine, theirs):
            return False
    return True


def check_out_nesting(out: str, inputs: Sequence[str], is_uri: bool) -> None:
    """UserError (one line) when the local `out` lies inside an input folder, can be matched by an
    input glob, or holds an input (an input file's own folder as `--out` included). A new folder
    beside an input file (`data/train.jsonl`, `--out data/packed`) is fine: only that file is read."""
    if is_uri:
        return
    real_out = _real(out)
    for given in inputs:
        spec = os.path.expanduser(str(given))
        if os.path.exists(spec):
            real = _real(spec)
            if real.is_relative_to(real_out):
                packed = " (it is packed output of pack-data)" if (real_out / "manifest.json").is_file() else ""
                raise UserError(
                    f"input {given} is inside --out {out}{packed}: writing the output replaces that "
                    "folder (with --overwrite, deleting the input): choose an --out outside the inputs"
                )
            if real.is_dir() and real_out.is_relative_to(real):
                raise UserError(
                    f"--out {out} is inside the input folder {given}: the next run would read the "
                    "packed output back as input: choose an --out outside the input folders"
                )
        elif _GLOB_CHARS.search(spec) and "://" not in spec and _glob_reaches(spec, real_out):
            raise UserError(
                f"--out {out} is a folder the input glob {given!r} reaches: the next run would read "
                "the packed output back as input: choose an --out the glob does not match"
            )
