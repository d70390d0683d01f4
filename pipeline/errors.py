"""User-facing errors: one line that says what is wrong and how to fix it, never a traceback.

Library code raises `UserError`; every console script wraps its body in `cli_errors()`, which turns
it (and the few OS errors a user can cause, such as a full disk) into a one-line message and a
non-zero exit.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import click


class UserError(Exception):
    """A problem with the user's input or environment, reported as a single line."""


class ShardFormatError(UserError):
    """A packed folder does not follow the shard contract (see `pipeline.shards`)."""


class Terminated(BaseException):
    """SIGTERM arrived (what `timeout`, Slurm and Kubernetes send to stop a job). Raised in the main
    thread by the handler `cli_errors` installs, it unwinds like Ctrl-C: every `finally` runs, so
    temporary folders go and worker processes are told to stop."""


class _Sigterm:
    """What the SIGTERM handler has seen, and whether it may still raise (not while an error is
    being reported: a second exception there would end in a traceback)."""

    arrived = False
    may_raise = True


def _on_sigterm(signum: int, frame: object) -> None:
    _Sigterm.arrived = True
    if _Sigterm.may_raise:
        raise Terminated


@contextmanager
def cli_errors(
    interrupted: str = "nothing was written to the output folder",
    disk_full: str = "free some space or choose another --out; nothing was left behind",
) -> Iterator[None]:
    """Turn expected failures into `click` errors: one line on stderr, exit status 1, or 130 after
    Ctrl-C and 143 after SIGTERM, each with the line `interrupted` (what the command leaves behind).
    A full disk (ENOSPC, EDQUOT) is "disk full while writing FILE: " + `disk_full` (what to do, and
    what the command leaves behind).

    A worker process that SIGTERM stopped as well may make its parent fail first with an error of
    its own; once SIGTERM has arrived, any failure is reported as the termination it is.
    """
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if in_main else None
    _Sigterm.arrived, _Sigterm.may_raise = False, True
    _Exit.status = 1  # until the block ends well or says otherwise
    try:
        yield
        _Exit.status = 0
    except SystemExit as exc:
        _Exit.status = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        raise
    except (KeyboardInterrupt, Terminated, UserError, OSError) as exc:
        _Sigterm.may_raise = False
        if isinstance(exc, KeyboardInterrupt):
            click.echo(f"interrupted: {interrupted}", err=True)
            _Exit.status = 130
            sys.exit(130)
        if isinstance(exc, Terminated) or _Sigterm.arrived:
            click.echo(f"terminated (SIGTERM): {interrupted}", err=True)
            _Exit.status = 143
            sys.exit(143)
        if isinstance(exc, UserError):
            raise click.ClickException(shortened(str(exc))) from None
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise click.ClickException(f"disk full while writing {exc.filename or 'output'}: {disk_full}") from None
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise click.ClickException(f"permission denied: {exc.filename}: choose a folder you can write to") from None
        raise
    except Exception:  # noqa: BLE001 - e.g. Terminated wrapped by C code it was raised in (Ray's wait)
        if not _Sigterm.arrived:
            raise
        _Sigterm.may_raise = False
        click.echo(f"terminated (SIGTERM): {interrupted}", err=True)
        _Exit.status = 143
        sys.exit(143)
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


class _Exit:
    """The exit status `cli_errors` gave the command, and the threads left inside calls that may
    never return (`leave_behind`)."""

    status = 0
    left: list[threading.Thread] = []
    registered = False


def leave_behind(thread: threading.Thread) -> None:
    """Note a daemon thread abandoned inside a client call that does not return (remote storage
    that stopped answering). At exit, while one is still inside, the process ends at once with the
    status `cli_errors` gave it (after flushing stdout and stderr): the client's own finalizers
    (pyarrow's S3 one) would otherwise wait for the call, keeping a finished job alive for minutes."""
    _Exit.left.append(thread)
    if not _Exit.registered:
        _Exit.registered = True
        atexit.register(_exit_now_if_left)  # after pyarrow's finalizers were registered: it runs first


def _exit_now_if_left() -> None:
    if any(t.is_alive() for t in _Exit.left):
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(_Exit.status)


MAX_MESSAGE = 2000  # characters of an error line; a longer one keeps its start and its end (the fix)


def shortened(text: str, limit: int = MAX_MESSAGE) -> str:
    """`text` cut in the middle to at most `limit` characters (a message quoting a huge value)."""
    if len(text) <= limit:
        return text
    tail = limit // 4
    return f"{text[: limit - tail - 5]} ... {text[-tail:]}"


def one_line(msg: object, limit: int = 240) -> str:
    """`msg` (often an exception from a library) as one line of at most `limit` characters."""
    text = " ".join(str(msg).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
