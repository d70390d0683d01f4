"""`Background`: a function run in a daemon thread beside the job, joined later with `result()`.
For work that mostly waits on I/O or on C code that releases the GIL, such as hashing every input
byte for the manifest while the job tokenizes."""

from __future__ import annotations

import threading
from collections.abc import Callable
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

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value
