"""Worker processes that encode texts into token ids, each with its own interpreter and GIL.

Why processes: the tokenizer's Rust encoder runs without the GIL, but turning its result into
Python ids (`Encoding.ids`, about 37 ns a token) and flattening them (about 17 ns) need the GIL. On
16 cores, 16 threads of one process spent most of their time waiting for it (BENCHMARKS.md); in
separate processes that work runs in parallel, and only int32 buffers come back.

A worker holds only the tokenizer's Rust backend (sent once as its JSON, or inherited at the fork
when the job knows it already), so it never imports transformers or torch. Workers are forked before
the parent imports those (`run_pack_data` starts them first), which keeps the fork cheap, and the
pool is kept for later jobs in the same process.
Each worker serves one request at a time; `encode` checks a free worker out, so any number of
threads may call it.
"""

from __future__ import annotations

import atexit
import hashlib
import multiprocessing as mp
import os
import queue
import re
import signal
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from pipeline.errors import UserError

MAX_DEFAULT_WORKERS = 16  # measured up to 16 cores (BENCHMARKS.md); each worker holds a tokenizer copy


def default_workers() -> int:
    """The CPUs this process may use (its affinity mask, else the machine's count), at most
    MAX_DEFAULT_WORKERS."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_DEFAULT_WORKERS))


Cuts = tuple[np.ndarray, np.ndarray]  # (cuts per text, their char positions): see encode_segments


def flat_ids(encodings: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Encodings -> flat int32 ids and int64 lengths (one per encoding)."""
    ids = [e.ids for e in encodings]
    lens = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(chain.from_iterable(ids), dtype=np.int32, count=int(lens.sum()))
    return flat, lens


def encode_segments(backend: Any, texts: list[str], cuts: Cuts | None = None,
                    sizes: TokenSizes | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Encode each text whole with a `tokenizers.Tokenizer` (no special tokens) -> flat int32 ids
    and the int64 token count of each of its segments.

    `cuts` = (counts, positions): text i is cut at counts[i] ascending char positions (taken in
    order from `positions`) into counts[i] + 1 segments; None: one segment per text. Whole texts,
    because the ids must be the tokenizer's ids of the text a model will see: segments encoded
    alone differ at every cut for SentencePiece-style tokenizers (each starts with "▁"), and
    wherever a merge or a pre-tokenizer word crosses the cut. A segment starts at the first token
    that ends after its cut, so a token that straddles a cut belongs to the later segment (a
    response's first token carries loss, as in TRL's prompt/completion split).

    Where the tokens end: from the ids alone with `sizes` (`token_sizes` of this backend), for each
    text whose token sizes add up to its length; else from the tokenizer's offsets (`encode_batch`,
    which costs 17-36% more than `encode_batch_fast`).
    """
    if cuts is None or len(cuts[1]) == 0:
        return flat_ids(backend.encode_batch_fast(texts, add_special_tokens=False))
    counts, positions = np.asarray(cuts[0], np.int64), np.asarray(cuts[1], np.int64)
    if sizes is None:
        return _split_by_offsets(backend.encode_batch(texts, add_special_tokens=False), texts, counts, positions)
    flat, lens = flat_ids(backend.encode_batch_fast(texts, add_special_tokens=False))
    seg_lens, ok = _split_by_sizes(sizes, flat, lens, texts, counts, positions)
    if not ok.all():  # the sizes do not add up for these texts: their offsets tell
        bad = np.flatnonzero(~ok).tolist()
        redo = [texts[i] for i in bad]
        cut0 = np.cumsum(counts) - counts  # each text's first cut in `positions`
        seg0 = cut0 + np.arange(len(texts))  # and its first segment in `seg_lens`
        _, fixed = _split_by_offsets(backend.encode_batch(redo, add_special_tokens=False), redo, counts[bad],
                                     np.concatenate([positions[cut0[i] : cut0[i] + counts[i]] for i in bad]))
        seg_lens[np.concatenate([np.arange(seg0[i], seg0[i] + counts[i] + 1) for i in bad])] = fixed
    return flat, seg_lens


def _split_by_offsets(encodings: list[Any], texts: list[str], counts: np.ndarray,
                      positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat ids and segment token counts of `encodings` (made with offsets), cut where `positions` say."""
    flat, lens = flat_ids(encodings)
    seg_lens = np.empty(len(texts) + len(positions), dtype=np.int64)
    k = j = 0
    for text, encoding, n, count in zip(texts, encodings, lens.tolist(), counts.tolist()):
        prev = 0
        for char in positions[j : j + count].tolist():
            token = _first_token_from(encoding, char, len(text), n)
            seg_lens[k] = max(token - prev, 0)
            prev = max(token, prev)
            k += 1
        seg_lens[k] = n - prev
        k += 1
        j += count
    return flat, seg_lens


def _first_token_from(encoding: Any, char: int, n_chars: int, n_tokens: int) -> int:
    """The index of the token holding char `char` of the text, or of the first char after it that
    a token holds (normalizers may drop chars); `n_tokens` when none does."""
    while char < n_chars:
        token = encoding.char_to_token(char)
        if token is not None:
            return token
        char += 1
    return n_tokens


@dataclass(frozen=True)
class TokenSizes:
    """How many bytes of the original text each token id stands for (`token_sizes`)."""

    bytes: np.ndarray  # int64 per id; an unknown token gets an impossible size
    added: np.ndarray  # bool per id: an added (special) token, matched in the raw text
    strips: np.ndarray  # bool per id: an added token that takes the spaces beside it (lstrip/rstrip)
    prepends: bool  # the pre-tokenizer puts a "▁" before the text unless it starts with a space
    nfc: bool  # the normalizer is NFC: only texts it leaves as they are can be measured


def cached_token_sizes(backend: Any) -> TokenSizes | None:
    """`token_sizes(backend)`, worked out once per backend object in this process."""
    entry = _SIZES.get(id(backend))
    if entry is None or entry[0] is not backend:
        entry = _SIZES[id(backend)] = (backend, token_sizes(backend))  # (the backend kept: its id stays its own)
    return entry[1]


_SIZES: dict[int, tuple[Any, TokenSizes | None]] = {}
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_IMPOSSIBLE = 1 << 40


def token_sizes(backend: Any) -> TokenSizes | None:
    """The byte size of every token of `backend`, where its string alone says it: BPE (no dropout,
    no subword affixes) with a byte-level pre-tokenizer (each char of a token is one byte; no prefix
    space; no normalizer but NFC, for texts already in NFC) or a SentencePiece-style Metaspace one
    ("▁" is one space, `<0xNN>` one byte; no normalizer). None for other tokenizers, whose texts
    need offsets.

    A text whose token sizes add up to its UTF-8 length (`encode_segments` checks every one) is
    measured right: here the tokens can only understate a text (a literal "▁"), but
    for an unknown token (given an impossible size) and the Metaspace "▁" put before a text (which is
    counted), so they add up to its length only when they state it exactly. Texts with an added
    token that strips the spaces beside it are not measured this way at all.
    """
    model, pre, norm = backend.model, backend.pre_tokenizer, backend.normalizer
    if type(model).__name__ != "BPE" or model.dropout or model.continuing_subword_prefix or model.end_of_word_suffix:
        return None
    kind = type(pre).__name__
    if kind == "ByteLevel" and not pre.add_prefix_space and type(norm).__name__ in ("NoneType", "NFC"):
        size, prepends = len, False
    elif kind == "Metaspace" and pre.replacement == "▁" and norm is None and pre.prepend_scheme in ("first", "never"):
        size, prepends = _metaspace_size, pre.prepend_scheme == "first"
    else:
        return None
    vocab = backend.get_vocab(with_added_tokens=False)
    sizes = np.full(backend.get_vocab_size(with_added_tokens=True), _IMPOSSIBLE, dtype=np.int64)
    sizes[np.fromiter(vocab.values(), dtype=np.int64, count=len(vocab))] = np.fromiter(
        map(size, vocab), dtype=np.int64, count=len(vocab))
    added = np.zeros(len(sizes), dtype=bool)
    strips = np.zeros(len(sizes), dtype=bool)
    for i, token in backend.get_added_tokens_decoder().items():
        sizes[i] = len(token.content.encode())
        added[i] = True
        strips[i] = token.lstrip or token.rstrip
    if model.unk_token is not None and backend.token_to_id(model.unk_token) is not None:
        sizes[backend.token_to_id(model.unk_token)] = _IMPOSSIBLE  # it stands for any char
    return TokenSizes(sizes, added, strips, prepends, norm is not None)


def _metaspace_size(token: str) -> int:
    return 1 if len(token) == 6 and _BYTE_TOKEN.fullmatch(token) else len(token.replace("▁", " ").encode())


def _split_by_sizes(sizes: TokenSizes, flat: np.ndarray, lens: np.ndarray, texts: list[str], counts: np.ndarray,
                    positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Segment token counts from the ids' byte sizes (vectorised over the batch), and per text
    whether its sizes add up (False: its counts are to be taken from offsets)."""
    n = len(texts)
    ends = np.concatenate(([0], np.cumsum(sizes.bytes[flat])))  # ends[t + 1]: where token t ends
    first_tok = np.cumsum(lens) - lens
    base = ends[first_tok]
    text_bytes = np.fromiter((len(t.encode()) for t in texts), dtype=np.int64, count=n)
    prepended = np.zeros(n, dtype=np.int64)
    if sizes.prepends:  # "▁" put before the text: unless it starts with a space or an added token
        spaced = np.fromiter((t[:1] in (" ", "▁") for t in texts), dtype=bool, count=n)
        first_added = sizes.added[flat[np.minimum(first_tok, len(flat) - 1)]] if len(flat) else np.ones(n, bool)
        prepended = ((lens > 0) & ~spaced & ~first_added).astype(np.int64)
    ok = ends[first_tok + lens] - base - prepended == text_bytes
    if sizes.nfc:
        ok &= np.fromiter((unicodedata.is_normalized("NFC", t) for t in texts), dtype=bool, count=n)
    if sizes.strips.any():
        stripping = np.concatenate(([0], np.cumsum(sizes.strips[flat])))
        ok &= stripping[first_tok + lens] == stripping[first_tok]
    owner = np.repeat(np.arange(n), counts)
    cut_bytes = np.fromiter((len(texts[i][:c].encode()) for i, c in zip(owner.tolist(), positions.tolist())),
                            dtype=np.int64, count=len(positions))
    # the first token ending after the cut: ends[t + 1] > target
    target = base[owner] + prepended[owner] + cut_bytes
    bound = np.clip(np.searchsorted(ends, target, side="right") - 1 - first_tok[owner], 0, lens[owner])
    bound[cut_bytes == 0] = 0  # a cut before the text's first char: a "▁" put before it goes along
    first_seg = np.cumsum(counts + 1) - (counts + 1)
    starts = np.zeros(n + len(positions), dtype=np.int64)
    later = np.ones(len(starts), dtype=bool)
    later[first_seg] = False
    starts[later] = bound
    stops = np.empty_like(starts)
    stops[:-1] = starts[1:]
    stops[first_seg + counts] = lens
    return stops - starts, ok


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
                sizes = token_sizes(backend)  # (20 ms for Llama-2's, while the job sets up)
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
        raise UserError(
            "a tokenizer worker process exited unexpectedly (out of memory?): rerun with a smaller "
            "--num-proc"
        ) from None


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
            counts, positions = (None, None) if cuts is None else (cuts[0].astype(np.int64).tobytes(),
                                                                   cuts[1].astype(np.int64).tobytes())
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
