"""Worker processes that encode texts into token ids, each with its own interpreter and GIL.

Why processes: the tokenizer's Rust encoder runs without the GIL, but turning its result into
Python ids (`Encoding.ids`) and flattening them need the GIL, so threads of one process wait for
each other; in separate processes that work runs in parallel, and only int32 buffers come back.

A worker holds only the tokenizer's Rust backend (sent once as its JSON), so it never imports
transformers or torch. The pool is kept for later jobs in the same process.
Each worker serves one request at a time; `encode` checks a free worker out, so any number of
threads may call it.
"""

from __future__ import annotations

import atexit
import hashlib
import multiprocessing as mp
import os
import queue
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from pipeline.errors import UserError
from pipeline.tokenize.segments import Cuts, encode_segments, token_sizes

MAX_DEFAULT_WORKERS = 16  # each worker holds a tokenizer copy


def usable_cpus() -> int:
    """The CPUs this process may use: its affinity mask (a container's or taskset's share), else
    the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_workers() -> int:
    """The CPUs this process may use, at most MAX_DEFAULT_WORKERS."""
    return min(usable_cpus(), MAX_DEFAULT_WORKERS)


def capped_workers(requested: int, command: str) -> int:
    """`requested` worker processes, or the CPUs this process may use where that is fewer, said in
    one line on stderr: more tokenizer processes than CPUs only wait on each other (64 on 2 cores
    ran 2.9x slower than 2), each holding a tokenizer copy. Example: 64 on 2 CPUs ->
    "pack-data: --num-proc 64 capped at 2, the CPUs this process may use" and 2."""
    cpus = usable_cpus()
    if requested <= cpus:
        return requested
    print(f"{command}: --num-proc {requested} capped at {cpus}, the CPUs this process may use", file=sys.stderr)
    return cpus


def _serve(conn: Connection, initial: str | None, inherited: list[Connection]) -> None:  # pragma: no cover - runs in the worker processes
    """A worker's loop: ("tokenizer", json) loads a backend; ("encode", texts, counts, positions)
    answers `encode_segments` (cuts as int64 bytes, or None); None ends.
    An `initial` backend JSON is loaded first, as if it had come as the first message. `inherited`:
    the parent's ends of the pool's pipes, which a forked worker holds too and closes, so that it
    reads EOF (and ends) when the parent dies, even by SIGKILL. A reply the dead parent cannot take
    ends the worker quietly."""
    for other in inherited:
        other.close()
    for sig in (signal.SIGINT, signal.SIGTERM):  # the parent handles both and closes the pipes
        signal.signal(sig, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the pool is the parallelism
    from tokenizers import Tokenizer

    backend = sizes = None
    first = None if initial is None else ("tokenizer", initial)
    while True:
        try:
            msg, first = (conn.recv(), None) if first is None else (first, None)
        except (EOFError, OSError):  # the parent is gone
            return
        if msg is None:
            return
        try:
            if msg[0] == "tokenizer":
                backend = Tokenizer.from_str(msg[1])
                sizes = token_sizes(backend)
                reply: tuple = ("ok",)
            else:
                _, texts, counts, positions = msg
                cuts = None if counts is None else (np.frombuffer(counts, np.int64), np.frombuffer(positions, np.int64))
                flat, lens = encode_segments(backend, texts, cuts, sizes)
                reply = ("ok", lens.tobytes(), flat.tobytes())
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
            reply = ("error", f"{type(exc).__name__}: {exc}")
        try:
            conn.send(reply)
        except OSError:  # the parent is gone
            return


@contextmanager
def _worker_alive() -> Iterator[None]:
    """A pipe that broke because its worker died becomes one clear UserError."""
    try:
        yield
    except (EOFError, OSError):
        raise UserError("a tokenizer worker process exited unexpectedly (out of memory?): rerun with a smaller --num-proc") from None


def _send(conn: Connection, msg: Any) -> None:
    with _worker_alive():
        conn.send(msg)


def _recv(conn: Connection) -> tuple:
    """A worker's reply; its reported failure is raised here."""
    with _worker_alive():
        answer = conn.recv()
    if answer[0] == "error":
        raise RuntimeError(f"tokenizer worker failed: {answer[1]}")
    return answer


class EncodePool:
    """`n` worker processes encoding texts with one tokenizer backend (`use`); see the module doc.

    `backend`, a backend's JSON known before the fork, is inherited by the workers, which build it at
    once: no pipe carries it, and they build it while the job's setup goes on.
    """

    def __init__(self, n: int, backend: str | None = None) -> None:
        import tokenizers  # noqa: F401 - imported once here, inherited by forked workers

        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        self.n = n
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._free: queue.SimpleQueue[Connection] = queue.SimpleQueue()
        self._tokenizer: str | None = None  # sha256 of the backend JSON the workers hold
        self._backend: Any = None  # the backend (or JSON) object last handed over
        self._unacked: set[Connection] = set()  # workers whose tokenizer acknowledgement is unread
        for _ in range(n):
            parent, child = ctx.Pipe()
            inherited = [parent, *self._conns] if ctx.get_start_method() == "fork" else []
            proc = ctx.Process(target=_serve, args=(child, backend, inherited), daemon=True, name="packlm-encode")
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
            self._free.put(parent)
        if backend is not None:  # each worker acknowledges it as if `use` had sent it
            self._tokenizer = _digest(backend)
            self._backend = backend
            self._unacked = set(self._conns)

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def use(self, backend: Any) -> None:
        """Hand every worker `backend` (a `tokenizers.Tokenizer`, or its JSON; a no-op when they hold
        it already).

        Returns at once: the workers load it while this process goes on (pack-data calls this in its
        setup), and each one's acknowledgement is read before its first `encode`. A tokenizer changed
        in place after being handed over is not sent again.
        """
        if backend is self._backend:
            return
        text = backend if isinstance(backend, str) else backend.to_str()
        digest = _digest(text)
        if digest != self._tokenizer:
            self._drain()
            for conn in self._conns:
                _send(conn, ("tokenizer", text))
            self._unacked = set(self._conns)
            self._tokenizer = digest
        self._backend = backend

    def encode(self, texts: list[str], cuts: Cuts | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Texts -> flat int32 ids and int64 segment lengths, as `encode_segments` with the backend."""
        conn = self._free.get()
        try:
            if conn in self._unacked:
                _recv(conn)
                self._unacked.discard(conn)
            counts, positions = (None, None) if cuts is None else (cuts[0].astype(np.int64).tobytes(), cuts[1].astype(np.int64).tobytes())
            _send(conn, ("encode", texts, counts, positions))
            reply = _recv(conn)
        finally:
            self._free.put(conn)
        return np.frombuffer(reply[2], dtype=np.int32), np.frombuffer(reply[1], dtype=np.int64)

    def _drain(self) -> None:
        """Read the acknowledgements still pending (before the workers are sent anything else)."""
        for conn in list(self._unacked):
            _recv(conn)
        self._unacked = set()

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
                conn.close()
            except OSError:
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
        self._procs.clear()
        self._conns.clear()


def _digest(backend_json: str) -> str:
    return hashlib.sha256(backend_json.encode()).hexdigest()


_POOL: EncodePool | None = None


def encode_pool(n: int, backend: str | None = None) -> EncodePool:
    """The process-wide pool of `n` workers: reused while its workers live, else forked anew (with
    `backend`, when known, for the workers to inherit; a reused pool gets it through `use`)."""
    global _POOL
    if _POOL is not None and (_POOL.n != n or not _POOL.alive):
        _POOL.close()
        _POOL = None
    if _POOL is None:
        _POOL = EncodePool(n, backend)
    return _POOL


@atexit.register
def close_pool() -> None:
    """Stop the process-wide pool's workers (also run at exit)."""
    global _POOL
    if _POOL is not None:
        _POOL.close()
        _POOL = None
