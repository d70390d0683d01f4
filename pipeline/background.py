"""Work that overlaps a pack-data job, joined later with `result()`.

`Background` runs a function in a daemon thread: for work that mostly waits on I/O or C code that
releases the GIL (hashing the inputs). `Forked` runs it in a forked child process: for work that
would hold this process's GIL for seconds, such as importing transformers and torch to load a
tokenizer, which a thread would take from the job itself.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any


class Background:
    """`fn(*args)` in a daemon thread (a failing job exits without waiting for it); `result()`
    joins and returns its value or raises its exception."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple) -> None:
        try:
            self._value = fn(*args)
        except BaseException as exc:  # noqa: BLE001 (re-raised in the caller's thread by result())
            self._error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


class Forked:
    """`fn(*args)` in a forked daemon process; its value (or exception) must pickle and comes back
    through a pipe. `done()` and `result()` are for one thread only.

    Fork early: before this process starts threads and before heavy imports (a child that exits
    takes nothing with it, and the parent never pays for what the child imports).
    """

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        ctx = mp.get_context("fork")
        self._conn, child_end = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child, args=(child_end, self._conn, fn, args), daemon=True)
        self._proc.start()
        child_end.close()
        self._outcome: tuple[bool, Any] | None = None

    def done(self) -> bool:
        """Whether `result()` would return (or raise) without waiting."""
        return self._outcome is not None or self._conn.poll()

    def cancel(self) -> None:
        """Stop the child: its result is not wanted."""
        self._proc.kill()
        self._proc.join()
        self._conn.close()

    def result(self) -> Any:
        if self._outcome is None:
            try:
                self._outcome = self._conn.recv()
            except EOFError:  # killed (out of memory?) before it could answer
                self._proc.join()
                self._outcome = (False, ChildProcessError(f"it exited with code {self._proc.exitcode}"))
            self._conn.close()
            self._proc.join()
        ok, value = self._outcome
        if not ok:
            raise value
        return value


def _child(conn: Connection, parent_end: Connection, fn: Callable[..., Any], args: tuple) -> None:
    parent_end.close()  # then, if the parent dies, sending the answer fails instead of blocking forever
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it ends us
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # SIGTERM ends us without a word
    try:
        outcome: tuple[bool, Any] = (True, fn(*args))
    except BaseException as exc:  # noqa: BLE001 (re-raised in the parent by result())
        outcome = (False, exc)
    try:
        conn.send(outcome)
    except OSError:  # the parent is gone (killed): nobody to answer
        pass
    except Exception as exc:  # noqa: BLE001 - a value or exception that does not pickle
        with contextlib.suppress(OSError):
            conn.send((False, RuntimeError(f"{type(outcome[1]).__name__}: {outcome[1]} ({exc})")))
    os._exit(0)  # skip the parent's atexit handlers and buffered output copied by the fork
