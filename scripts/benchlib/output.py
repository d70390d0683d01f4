"""Result files and one-line refusals: `check_output` before the work, `write_output` whole or not
at all (one line on a refused target or a full disk), argparse whose errors are one line."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn


class OneLineParser(argparse.ArgumentParser):
    """argparse whose refusals are one line (`PROG: error: ...`, exit 2), without the usage block."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def jsonable(args: argparse.Namespace) -> dict[str, Any]:
    """Command-line arguments as JSON values (paths as strings)."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def check_output(path: str | os.PathLike[str], option: str = "--out") -> Path:
    """`path` as a Path, if a script may write a file there; else exit with one line naming it.
    Refused: an existing folder, anything that is not a regular file (a device such as /dev/null,
    a FIFO, a socket) and a path below a regular file. Scripts call it on their output options
    before any work, and `write_output` again before it writes."""
    import stat

    from pipeline.errors import UserError
    from pipeline.files.folder_lock import check_no_file_in_the_way

    path = Path(path)
    if str(path) in ("", "."):
        raise SystemExit(f"error: {option} {str(path)!r}: name a file to write")
    try:
        check_no_file_in_the_way(path, option)
        mode = path.stat().st_mode
    except UserError as exc:
        raise SystemExit(f"error: {exc}") from None
    except FileNotFoundError:
        return path
    except OSError as exc:
        raise SystemExit(f"error: {option} {path}: {exc.strerror}: choose another {option}") from None
    if stat.S_ISDIR(mode):
        raise SystemExit(f"error: {option} {path} is a folder: name a file to write (one inside it, or another path)")
    if not stat.S_ISREG(mode):
        raise SystemExit(f"error: {option} {path} is not a regular file (a device, FIFO or socket): name a regular file to write")
    return path


def check_output_folder(path: str | os.PathLike[str], option: str = "--out") -> Path:
    """`path` as a Path, if a script may write its files into that folder (one that exists, or
    that can be made); else exit with one line naming it."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise SystemExit(f"error: {option} {path} is not a folder: name a folder to write into")
    check_output(path / "file", option)  # no regular file on the way
    return path


def write_output(path: str | os.PathLike[str], write: Callable[[Path], None], option: str = "--out") -> None:
    """Create or replace the file `path` whole (`pipeline.files.durable.write_atomic`: `write(tmp)` fills a
    temporary file beside it, renamed over `path`; a link keeps pointing at the new file); its
    folder is made if missing. A target `check_output` refuses, a full disk or another write error
    exits with one line, leaving nothing behind."""
    import errno

    from pipeline.files.durable import write_atomic

    target = Path(os.path.realpath(check_output(path, option)))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, write)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise SystemExit(
                f"error: disk full while writing {path}: free some space or choose another {option}; nothing was written"
            ) from None
        raise SystemExit(f"error: cannot write {path}: {exc.strerror}: choose another {option}") from None


def write_text_output(path: str | os.PathLike[str], text: str, option: str = "--json") -> None:
    """`write_output` of a UTF-8 text."""
    write_output(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), option)


def write_json(path: str | os.PathLike[str], payload: Any, option: str = "--json") -> None:
    """Write a result file whole (`write_output`; its folder created if needed)."""
    write_text_output(path, json.dumps(payload, indent=2) + "\n", option)


def write_jsonl(path: Path, records: Sequence[dict[str, str]], option: str = "--out") -> None:
    """One JSON object per line, written whole or not at all (`write_output`)."""

    def write(tmp: Path) -> None:
        with tmp.open("w", encoding="utf-8") as handle:
            for rec in records:
                handle.write(json.dumps(rec, ensure_ascii=False) + "\n")

    write_output(path, write, option)
