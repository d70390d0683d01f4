"""Checks of one shard file against the shard contract: every per-row and per-token rule.

Per-row and per-example checks are vectorised numpy over a shard's offsets; the per-token checks
(ids in range, position_ids, labels, loss-token count) are one branch-free numba pass over the flat
token columns (`_token_checks`; only a shard with a defect gets a second pass that finds which and
where), so checking costs about one read of the tokens. The first defect found raises
`ShardFormatError` with one line naming the file, row and example index within the row.

`summarize_shard(path, max_len, vocab_size)` checks one shard file and keeps what the folder-level
checks (`pipeline.shards.verify`) need: rows, tokens, loss tokens, example ids, the largest id, and
the file's size / mtime / inode.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np

from pipeline.errors import ShardFormatError
from pipeline.shards.format import IGNORE_INDEX, ShardColumns, load_shard

# Defects the token pass finds, in the order they are reported when a shard has several kinds.
_OK, _NEGATIVE_ID, _BEYOND_VOCAB, _POSITION, _LABEL_AT_START, _LABEL_SHIFTED = range(6)


@numba.njit(cache=True, nogil=True)
def _token_checks(input_ids, labels, position_ids, seq_lens, vocab):  # pragma: no cover - numba
    """One pass over a shard's flat tokens; `seq_lens` must tile them (checked before).

    Returns (code, index, loss tokens, largest id, examples without a loss token): the first defect
    kind found, in the `_NEGATIVE_ID` .. `_LABEL_SHIFTED` order (`_OK` if none), the flat token
    index of its first occurrence (the flat example index for `_LABEL_AT_START`), the number of
    labels != -100, the largest input id (-1 for no tokens) and the number of examples all of whose
    labels are -100. `vocab` <= 0: unknown.
    The pass itself is branch-free (it vectorises); only a shard with a defect gets a second,
    slower pass (`_token_defects`) that finds which and where.
    """
    limit = np.int64(vocab) if vocab > 0 else np.int64(1) << 32
    loss = 0
    top = np.int64(-1)
    bad = False
    no_loss = 0
    t = 0
    for k in range(seq_lens.shape[0]):
        n = seq_lens[k]
        acc = labels[t] != -100
        example_loss = 0
        for i in range(n):
            x = np.int64(input_ids[t + i])
            y = labels[t + i]
            m = y != -100
            example_loss += m
            top = max(top, x)
            acc |= (x < 0) | (x >= limit) | (position_ids[t + i] != i) | (m & (y != x))
        loss += example_loss
        no_loss += example_loss == 0
        bad |= acc
        t += n
    if not bad:
        return _OK, -1, loss, top, no_loss
    code, at, loss = _token_defects(input_ids, labels, position_ids, seq_lens, vocab)
    return code, at, loss, top, no_loss


@numba.njit(cache=True, nogil=True)
def _token_defects(input_ids, labels, position_ids, seq_lens, vocab):  # pragma: no cover - numba
    """`_token_checks`'s result for a shard known to have a defect: the first of each kind."""
    first = np.full(6, -1, np.int64)
    loss = 0
    t = 0
    for k in range(seq_lens.shape[0]):
        n = seq_lens[k]
        if labels[t] != -100 and first[_LABEL_AT_START] < 0:
            first[_LABEL_AT_START] = k
        for i in range(n):
            x = input_ids[t]
            y = labels[t]
            if x < 0 and first[_NEGATIVE_ID] < 0:
                first[_NEGATIVE_ID] = t
            if vocab > 0 and x >= vocab and first[_BEYOND_VOCAB] < 0:
                first[_BEYOND_VOCAB] = t
            if position_ids[t] != i and first[_POSITION] < 0:
                first[_POSITION] = t
            if y != -100:
                loss += 1
                if y != x and first[_LABEL_SHIFTED] < 0:
                    first[_LABEL_SHIFTED] = t
            t += 1
    for code in range(1, 6):
        if first[code] >= 0:
            return code, first[code], loss
    return _OK, -1, loss


def _first(mask: np.ndarray) -> int:
    """Index of the first True in `mask` (caller knows there is one)."""
    return int(np.argmax(mask))


class _Locator:
    """Turns flat indices into 'file row R example E (id X)' text."""

    def __init__(self, name: str, flat: ShardColumns) -> None:
        self.name, self.flat = name, flat

    def row(self, r: int) -> str:
        return f"{self.name} row {r}"

    def example(self, k: int) -> str:
        """Location of flat example index k."""
        r = int(np.searchsorted(self.flat.ex_off, k, side="right") - 1)
        e = k - int(self.flat.ex_off[r])
        return f"{self.name} row {r} example {e} (id {int(self.flat.example_ids[k])})"

    def token(self, t: int, example_starts: np.ndarray) -> str:
        """Location of flat token index t, given the flat token start of every example."""
        k = int(np.searchsorted(example_starts, t, side="right") - 1)
        pos = t - int(example_starts[k])
        return f"{self.example(k)} token {pos}"


def check_shard(flat: ShardColumns, name: str, max_len: int, vocab_size: int | None = None) -> tuple[int, int, int]:
    """Every per-row and per-token rule on one shard's columns (`name` for messages); returns its
    (loss tokens, largest input id, examples with no loss token)."""
    loc = _Locator(name, flat)
    row_len = np.diff(flat.row_off)
    n_ex = np.diff(flat.ex_off)
    if len(row_len) and (bad := (row_len < 1) | (n_ex < 1)).any():
        r = _first(bad)
        raise ShardFormatError(f"{loc.row(r)}: empty row ({int(row_len[r])} tokens, {int(n_ex[r])} examples)")
    if (bad := row_len > max_len).any():
        r = _first(bad)
        raise ShardFormatError(f"{loc.row(r)}: row too long: {int(row_len[r])} tokens > max_len {max_len}")
    seq = flat.seq_lens
    if (bad := seq < 1).any():
        k = _first(bad)
        raise ShardFormatError(f"{loc.example(k)}: seq_lens entry is {int(seq[k])}, must be >= 1")
    # Sum of seq_lens per row, vectorised through a cumulative sum over the flat example lengths.
    cum = np.concatenate(([0], np.cumsum(seq)))
    row_sums = cum[flat.ex_off[1:]] - cum[flat.ex_off[:-1]]
    if (bad := row_sums != row_len).any():
        r = _first(bad)
        raise ShardFormatError(f"{loc.row(r)}: seq_lens sum to {int(row_sums[r])} but the row has {int(row_len[r])} tokens")
    # From here the example boundaries tile the flat token arrays exactly: one numba pass over the
    # tokens finds the first defect of each kind (reported in the order below) and counts loss tokens.
    starts = cum[:-1]
    code, at, loss_tokens, max_id, no_loss = _token_checks(flat.input_ids, flat.labels, flat.position_ids, seq, int(vocab_size or 0))
    if code == _NEGATIVE_ID:
        raise ShardFormatError(f"{loc.token(at, starts)}: negative token id {int(flat.input_ids[at])}")
    if code == _BEYOND_VOCAB:
        raise ShardFormatError(
            f"{loc.token(at, starts)}: token id {int(flat.input_ids[at])} >= the tokenizer's "
            f"vocab_size {vocab_size} (manifest): packed with another tokenizer?"
        )
    if code == _POSITION:
        expected = at - int(starts[np.searchsorted(starts, at, side="right") - 1])
        raise ShardFormatError(
            f"{loc.token(at, starts)}: position_ids do not restart/count up per example "
            f"(got {int(flat.position_ids[at])}, expected {expected})"
        )
    labels = flat.labels
    if code == _LABEL_AT_START:  # `at` is the flat example index here
        raise ShardFormatError(
            f"{loc.example(at)} token 0: label at an example start is {int(labels[starts[at]])}, "
            f"must be {IGNORE_INDEX} (no prediction across example boundaries)"
        )
    if code == _LABEL_SHIFTED:
        raise ShardFormatError(
            f"{loc.token(at, starts)}: label {int(labels[at])} is neither {IGNORE_INDEX} nor the "
            f"input id {int(flat.input_ids[at])} (labels must be unshifted copies of input_ids)"
        )
    return int(loss_tokens), int(max_id), int(no_loss)


@dataclass
class ShardSummary:
    """One shard file as `check_shard` found it: what `verify_folder`'s folder-level checks need.

    `size`, `mtime_ns` and `inode` are the file's, taken before it was opened: a summary stands for
    the file only while all three are unchanged (and it was checked against the same max_len; the
    vocabulary check is `max_id` < vocab_size, so a summary made before the vocabulary was known
    still serves). A same-size rewrite in place within one file-system timestamp tick would go
    unnoticed; `pack-verify` (sha256) catches that too.
    """

    rows: int
    tokens: int
    loss_tokens: int
    no_loss: int  # examples with no token that carries a loss
    example_ids: np.ndarray  # int64, a copy (a view would keep the memory-mapped shard resident)
    max_len: int
    max_id: int  # the largest input id (-1 for an empty shard)
    size: int
    mtime_ns: int
    inode: int

    def holds_for(self, path: Path, max_len: int, vocab_size: int | None) -> bool:
        """True when this summary still describes `path` checked with these limits."""
        try:
            st = os.stat(path)
        except OSError:
            return False
        return (st.st_size, st.st_mtime_ns, st.st_ino, max_len) == (self.size, self.mtime_ns, self.inode, self.max_len) and (
            vocab_size is None or self.max_id < vocab_size
        )


def summarize_shard(path: str | os.PathLike[str], max_len: int, vocab_size: int | None = None) -> ShardSummary:
    """`check_shard` on the file as it is on disk (memory-mapped); its totals and example ids.

    pack-data calls this on each shard as soon as it is written and hands the results to
    `verify_folder(..., checked=...)`, which then need not read the tokens again.
    """
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ShardFormatError(f"{path}: cannot read the shard ({exc.strerror})") from None
    flat = load_shard(path)
    loss_tokens, max_id, no_loss = check_shard(flat, str(path), max_len, vocab_size)  # the folder too: DATA or DATA/eval
    return ShardSummary(
        rows=len(flat.row_off) - 1,
        tokens=len(flat.input_ids),
        loss_tokens=loss_tokens,
        no_loss=no_loss,
        example_ids=np.array(flat.example_ids, dtype=np.int64, copy=True),
        max_len=max_len,
        max_id=max_id,
        size=st.st_size,
        mtime_ns=st.st_mtime_ns,
        inode=st.st_ino,
    )


def first_beyond_vocab(path: str | os.PathLike[str], vocab_size: int) -> tuple[int, int]:
    """(example id, token id) of the first token id >= vocab_size in a shard that has one (for the
    error message: which input example holds it)."""
    flat = load_shard(Path(path))
    t = _first(flat.input_ids >= vocab_size)
    k = int(np.searchsorted(np.cumsum(flat.seq_lens), t, side="right"))
    return int(flat.example_ids[k]), int(flat.input_ids[t])
