"""Writing the planned rows as shards: gather each shard's pieces from the spill, write it, and
check the file as it is on disk, overlapped with gathering the next one.

Per shard, the pieces are read from the spill (`Spill.read_pieces`, straight into flat input_ids /
labels arrays), a numba kernel builds position_ids and sets the first label of every piece to
-100, and `rows_table` wraps the arrays without copying. `write_shard` runs in a writer thread
while the next shard is gathered; as soon as a shard file is written, a hasher thread computes its
sha256 and a checker thread re-opens it memory-mapped and runs `summarize_shard` on it (every
per-row and per-token check), so what is checked is what is on disk. A bad shard, or a token id
beyond the tokenizer's vocabulary, stops the job.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numba
import numpy as np

from pipeline.errors import UserError
from pipeline.plan.rows import RowPlan
from pipeline.progress import bar
from pipeline.shards import (
    ShardInfo,
    ShardSummary,
    file_sha256,
    first_beyond_vocab,
    rows_table,
    shard_name,
    summarize_shard,
    write_shard,
)
from pipeline.tokenize.spill import Spill

HASH_THREADS = max(1, min(4, (os.cpu_count() or 1) - 1))  # shards hashed at once (hashlib frees the GIL)


@numba.njit(cache=True, nogil=True)
def _finish(ids, labels, lengths, out_pos, check_ids):  # pragma: no cover - numba
    """position_ids, first label of each piece -100, loss count; with check_ids, the index of the
    first negative id (else -1)."""
    k = 0
    loss = 0
    bad = -1
    for p in range(lengths.shape[0]):
        n = lengths[p]
        labels[k] = -100
        for t in range(n):
            out_pos[k + t] = t
            if labels[k + t] != -100:
                loss += 1
            if check_ids and bad < 0 and ids[k + t] < 0:
                bad = k + t
        k += n
    return loss, bad


def gather_rows(
    spill: Spill,
    starts: np.ndarray,
    lengths: np.ndarray,
    example_ids: np.ndarray | None = None,
    buffers: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Read pieces (in row order) from the spill into flat ids, labels, position_ids; count loss tokens.

    The first label of every piece is set to -100 (a split example's later chunks included). When
    the spill reads the input in place (direct mode: its ids were never looked at), a negative id
    is a UserError naming its example's file and row (`example_ids` of the pieces).
    `buffers`: optional (ids, labels, position_ids) int32 arrays, large enough, reused across shards;
    the results are then views of them.
    """
    ids, labels = spill.read_pieces(starts, lengths, None if buffers is None else buffers[:2])
    n = len(ids)
    if labels is None:
        labels = ids.copy() if buffers is None else buffers[1][:n]
        if buffers is not None:
            np.copyto(labels, ids)
    pos = np.empty(n, np.int32) if buffers is None else buffers[2][:n]
    lens = np.ascontiguousarray(lengths, dtype=np.int64)
    loss, bad = _finish(ids, labels, lens, pos, spill.direct)
    if bad >= 0:
        piece = int(np.searchsorted(np.cumsum(lens), bad, side="right"))
        where = spill.where(int(example_ids[piece])) if example_ids is not None and spill.where else "the input"
        raise UserError(f"{where}: input_ids contains a negative id: fix the data")
    return ids, labels, pos, int(loss)


def shard_table(
    spill: Spill, rows: RowPlan, max_len: int, buffers: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
) -> tuple[Any, int, int]:
    """One shard, the rows of `rows` (`RowPlan.rows`): (Arrow table, tokens, loss tokens), gathered
    from the spill (`gather_rows`; `buffers` as there)."""
    ids, labels, pos, loss = gather_rows(spill, rows.starts, rows.lengths, rows.example_ids, buffers)
    row_off = np.concatenate(([0], np.cumsum(rows.lengths)))[rows.row_pieces]
    if int(np.diff(row_off).max()) > max_len:
        raise RuntimeError("planner produced a row longer than max_len")  # a bug, not user input
    table = rows_table(ids, labels, pos, row_off, rows.lengths, rows.example_ids, rows.row_pieces)
    return table, int(row_off[-1]), loss


@dataclass
class Written:
    """The shards `write_shards` wrote: manifest entries, totals, and per file its size and its
    `summarize_shard` (for `verify_folder(..., checked=...)`)."""

    shards: list[ShardInfo] = field(default_factory=list)
    total_tokens: int = 0
    loss_tokens: int = 0
    sizes: dict[str, int] = field(default_factory=dict)
    checked: dict[str, ShardSummary] = field(default_factory=dict)


def write_shards(
    folder: Path, spill: Spill, plan: RowPlan, *, max_len: int, rows_per_shard: int, vocab: int | None, progress: bool
) -> Written:
    """Write `plan`'s rows into `folder` as shards of `rows_per_shard` rows; see the module doc."""
    rps = rows_per_shard
    n_rows = plan.n_rows
    row_pieces = plan.row_pieces
    out = Written()
    written: list[Future] = []
    checks: list[tuple[str, Future]] = []

    def write_one(path: Path, table: Any) -> tuple[int, Future, Future]:
        write_shard(path, table)  # looked up at call time (tests replace it)
        # hashlib and the numba checks release the GIL: hash this shard and check the file as it is
        # on disk (re-opened memory-mapped) while the next ones are gathered and written
        check = checker.submit(summarize_shard, path, max_len)
        checks.append((path.name, check))
        return os.path.getsize(path), hasher.submit(file_sha256, path), check

    # two sets of token buffers, reused: one shard is gathered into one set while the previous one,
    # whose table views the other set, is written (fresh arrays per shard would cost page faults)
    bounds = row_pieces[np.append(np.arange(0, n_rows, rps), n_rows)]
    cap = int(np.diff(np.concatenate(([0], np.cumsum(plan.lengths)))[bounds]).max())
    sets = [tuple(np.empty(cap, np.int32) for _ in range(3)) for _ in range(min(2, -(-n_rows // rps)))]
    with (
        bar(progress, desc="write", total=n_rows, unit="row") as rows_bar,
        ThreadPoolExecutor(HASH_THREADS) as hasher,
        ThreadPoolExecutor(1) as checker,
        ThreadPoolExecutor(1) as writer,
    ):
        for s, r0 in enumerate(range(0, n_rows, rps)):
            r1 = min(n_rows, r0 + rps)
            table, tokens, loss = shard_table(spill, plan.rows(r0, r1), max_len, sets[s % 2])
            name = shard_name(s)
            if written:  # the previous shard is written (in a thread) while this one was gathered;
                written[-1].result()  # at most one shard waits in RAM
            while checks and checks[0][1].done():  # a shard that failed its check stops the job now
                done_name, check = checks.pop(0)
                check_vocab(folder, [(done_name, check.result())], vocab, spill)
            written.append(writer.submit(write_one, folder / name, table))
            del table
            out.shards.append(ShardInfo(file=name, rows=r1 - r0, tokens=tokens, sha256=""))
            out.total_tokens += tokens
            out.loss_tokens += loss
            rows_bar.update(r1 - r0)
        for info, done in zip(out.shards, written):
            size, digest, check = done.result()
            out.sizes[info.file] = size
            out.checked[info.file] = check.result()
            info.sha256 = digest.result()
    check_vocab(folder, out.checked.items(), vocab, spill)
    return out


def check_vocab(folder: Path, summaries: Iterable[tuple[str, ShardSummary]], vocab: int | None, spill: Spill) -> None:
    """Every token id below the tokenizer's vocabulary size, else a UserError naming the input
    example of the first one beyond it."""
    for name, summary in summaries:
        if vocab is not None and summary.max_id >= vocab:
            example, value = first_beyond_vocab(folder / name, vocab)
            where = spill.where(example) if spill.where else f"example {example} of the input"
            raise UserError(
                f"{where}: token id {value} is outside the tokenizer's vocabulary ({vocab} ids): "
                "was this data tokenized with another tokenizer?"
            )


def check_sizes(folder: Path, sizes: dict[str, int]) -> None:
    """Cheap integrity check before the rename: each shard file still has the size it was written with."""
    for name, size in sizes.items():
        now = os.path.getsize(folder / name)
        if now != size:
            raise UserError(
                f"{folder / name}: shard is {now} bytes but {size} were written (changed on disk while packing?): re-run pack-data"
            )
