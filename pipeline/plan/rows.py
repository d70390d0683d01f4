"""From tokenized examples to the row plan: the overlong policy turns examples into pieces of at
most max_len tokens, and the bin packer (`pipeline.plan.binpack.assign_bins`) gives each piece its row.

Example: lengths [5, 3, 9] with max_len 8 and `--overlong split` give pieces of lengths
[5, 3, 8, 1] (example ids [0, 1, 2, 2]); `ffd` packs them into rows [[5, 3], [8], [1]] - pieces stay
in input order inside a row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pipeline.errors import UserError
from pipeline.plan.binpack import assign_bins, minibatch_groups
from pipeline.shards import Counts
from pipeline.tokenize.spill import Spill

OVERLONG = ("truncate", "split", "drop", "error")


@dataclass
class Pieces:
    """What gets packed: one entry per (piece of an) example, in input order."""

    example_ids: np.ndarray  # int64
    starts: np.ndarray  # int64 offset into the spill
    lengths: np.ndarray  # int64
    counts: Counts = field(default_factory=Counts)

    def first_pieces(self) -> np.ndarray:
        """True at the first piece of each example (an example's pieces are side by side)."""
        first = np.ones(len(self.example_ids), dtype=bool)
        first[1:] = self.example_ids[1:] != self.example_ids[:-1]
        return first


def apply_overlong(spill: Spill, max_len: int, policy: str, min_len: int = 1) -> Pieces:
    """Turn spilled examples into pieces of at most `max_len` tokens according to `policy`, after
    dropping (and counting as `too_short`) the examples of fewer than `min_len` tokens (`--min-len`):
    an example's whole tokenized length decides, before any cut, as Axolotl's min_sample_len does."""
    lengths, starts, ids = spill.lengths, spill.offsets, spill.example_ids
    short = lengths < min_len
    counts = Counts(examples_read=spill.examples_read, empty_skipped=spill.empty_skipped, too_short=int(short.sum()))
    if counts.too_short:
        lengths, starts, ids = lengths[~short], starts[~short], ids[~short]
    over = lengths > max_len
    if policy == "truncate":
        counts.truncated = int(over.sum())
        pieces = Pieces(ids, starts, np.minimum(lengths, max_len), counts)
    elif policy == "drop":
        counts.dropped = int(over.sum())
        keep = ~over
        pieces = Pieces(ids[keep], starts[keep], lengths[keep], counts)
    elif policy == "split":
        counts.split = int(over.sum())
        n_chunks = (lengths + max_len - 1) // max_len
        rep = np.repeat(np.arange(len(lengths)), n_chunks)
        first_chunk = np.cumsum(n_chunks) - n_chunks
        k = np.arange(len(rep), dtype=np.int64) - np.repeat(first_chunk, n_chunks)
        chunk_start = k * max_len
        pieces = Pieces(ids[rep], starts[rep] + chunk_start, np.minimum(lengths[rep] - chunk_start, max_len), counts)
    else:  # "error": tokenize_to_spill already raised on the first overlong example
        if over.any():
            raise UserError(
                f"example {int(ids[over][0])} ({int(lengths[over][0])} tokens) is longer than --max-len "
                f"{max_len}: raise --max-len, or pass --overlong truncate or split"
            )
        pieces = Pieces(ids, starts, lengths, counts)
    counts.examples_packed = len(np.unique(pieces.example_ids)) if policy == "split" else len(pieces.example_ids)
    return pieces


@dataclass
class RowPlan:
    """The pieces in row order: row r holds pieces `row_pieces[r]:row_pieces[r + 1]` of the arrays."""

    example_ids: np.ndarray  # int64 per piece
    starts: np.ndarray  # int64 offset into the spill
    lengths: np.ndarray  # int64
    row_pieces: np.ndarray  # int64, n_rows + 1
    # --strategy minibatch: the rows of each group of examples, in order (rows are written group
    # after group; a group is one optimizer step of pack-train); empty for other strategies
    group_rows: list[int] = field(default_factory=list)

    @property
    def n_rows(self) -> int:
        return len(self.row_pieces) - 1

    def rows(self, r0: int, r1: int) -> RowPlan:
        """The plan of rows [r0, r1) alone (what one shard holds)."""
        a, b = int(self.row_pieces[r0]), int(self.row_pieces[r1])
        return RowPlan(self.example_ids[a:b], self.starts[a:b], self.lengths[a:b], self.row_pieces[r0 : r1 + 1] - a)


def plan_rows(pieces: Pieces, max_len: int, strategy: str, seed: int, group_size: int) -> RowPlan:
    """Give every piece its row (`assign_bins`); a stable sort by row keeps pieces in input order
    inside a row."""
    bins = assign_bins(pieces.lengths, max_len, strategy, seed, group_size)
    order = np.argsort(bins, kind="stable")
    n_rows = int(bins.max()) + 1
    per_row = np.bincount(bins, minlength=n_rows).astype(np.int64)
    group_rows: list[int] = []
    if strategy == "minibatch":  # rows are numbered group after group: count each group's rows
        row_group = np.empty(n_rows, np.int64)
        row_group[bins] = minibatch_groups(len(bins), seed, group_size)
        group_rows = np.bincount(row_group).astype(np.int64).tolist()
    return RowPlan(
        example_ids=pieces.example_ids[order],
        starts=pieces.starts[order],
        lengths=pieces.lengths[order],
        row_pieces=np.concatenate(([0], np.cumsum(per_row))),
        group_rows=group_rows,
    )
