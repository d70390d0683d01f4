"""Work run ahead of the job in other threads, for work that mostly waits on I/O or on C code that
releases the GIL:

- `Background`: one function in a daemon thread beside the job, joined later with `result()`
  (hashing every input byte for the manifest while the job tokenizes);
- `in_order`: a stream of items whose work is started ahead, a bounded number (and weight) at a
  time, and whose results come back in the items' order (Parquet row groups decoded ahead; text
  batches encoded by worker processes).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


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


def in_order(
    items: Iterable[T],
    start: Callable[[T], Future[R]],
    *,
    depth: int,
    weight: Callable[[T], int] = lambda item: 0,
    budget: int = 0,
) -> Iterator[tuple[T, R]]:
    """(item, result of `start(item)`) for every item, in the items' order, with up to `depth`
    items started ahead of the one being waited for, and, when `budget` > 0, their `weight` in
    flight at most `budget` (an item that alone exceeds it waits until nothing else is in flight).

    Example: `in_order(range(5), lambda i: pool.submit(pow, i, 2), depth=2)` yields
    (0, 0), (1, 1), (2, 4), (3, 9), (4, 16), with at most 2 calls submitted and not yet yielded.
    """
    pending: deque[tuple[T, Future[R], int]] = deque()
    in_flight = 0
    source = iter(items)
    upcoming = next(source, _END)
    while upcoming is not _END or pending:
        while upcoming is not _END and len(pending) < depth and (not budget or not pending or in_flight + weight(upcoming) <= budget):
            w = weight(upcoming)
            pending.append((upcoming, start(upcoming), w))
            in_flight += w
            upcoming = next(source, _END)
        item, future, w = pending.popleft()
        result = future.result()
        in_flight -= w
        yield item, result
        del item, future, result  # before more work starts: the consumer may have let go of it


def done(value: R) -> Future[R]:
    """A Future that already holds `value` (for items whose work is done in the calling thread)."""
    future: Future[R] = Future()
    future.set_result(value)
    return future


_END: Any = object()
