"""`--dedup`: drop the examples whose tokens and labels equal an earlier example's, as Axolotl's
`dataset_exact_deduplication` drops rows whose tokenized form repeats (Axolotl 0.19.0's
utils/data/utils.py `_deduplicate_dataset`: a SHA-256 of each tokenized row, the first kept).

Each stored sequence (an example, or a piece of one after `--overlong`) gets a 192-bit fingerprint
from its tokens and labels: its length and three 64-bit sums of (value + shift) x a fixed
pseudo-random odd multiplier per position (the method of `pipeline.shards.example_hash`), computed
with numpy a window of pieces at a time. Different sequences collide with a probability of about
2^-192; the first of equal ones is kept, the others are counted (`Counts.duplicates`).

    >>> kept = drop_duplicates(spill, pieces)     # pieces of the examples seen first
"""

from __future__ import annotations

import numpy as np

from pipeline.plan.rows import Pieces
from pipeline.shards.example_hash import position_multipliers
from pipeline.tokenize.spill import Spill

WINDOW_TOKENS = 1 << 24  # tokens read at a time (about 128 MiB of ids and labels)
_SEEDS = (0xDED0B1, 0xDED0B2, 0xDED0B3)


def fingerprints(spill: Spill, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """(len(starts), 4) uint64: each piece's length and three sums over its ids and labels."""
    n = len(lengths)
    out = np.zeros((n, 4), dtype=np.uint64)
    out[:, 0] = lengths
    mult = position_multipliers(max(int(lengths.max()) if n else 1, 1), _SEEDS)
    ends = np.cumsum(lengths)
    first = 0
    while first < n:  # a window of whole pieces, at least one
        last = max(first + 1, int(np.searchsorted(ends, (ends[first - 1] if first else 0) + WINDOW_TOKENS, "right")))
        lens = lengths[first:last]
        ids, labels = spill.read_pieces(starts[first:last], lens)
        labels = ids if labels is None else labels
        pos = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
        at = np.cumsum(lens) - lens
        with np.errstate(over="ignore"):
            ids64 = ids.astype(np.int64).astype(np.uint64) + np.uint64(1)
            lab64 = labels.astype(np.int64).astype(np.uint64) + np.uint64(101)  # -100 -> 1
            terms = (ids64 * mult[0][pos], lab64 * mult[1][pos], (ids64 ^ (lab64 << np.uint64(32))) * mult[2][pos])
            for k, term in enumerate(terms, start=1):
                out[first:last, k] = np.add.reduceat(term, at) if len(term) else 0
        first = last
    return out


def drop_duplicates(spill: Spill, pieces: Pieces) -> Pieces:
    """`pieces` without the ones whose tokens and labels equal an earlier piece's (input order), the
    dropped counted in `counts.duplicates` and out of `counts.examples_packed`."""
    if len(pieces.lengths) < 2:
        return pieces
    prints = fingerprints(spill, np.asarray(pieces.starts), np.asarray(pieces.lengths, dtype=np.int64))
    _, first = np.unique(prints, axis=0, return_index=True)
    keep = np.zeros(len(prints), dtype=bool)
    keep[first] = True
    counts = pieces.counts
    counts.duplicates = int((~keep).sum())
    counts.examples_packed -= counts.duplicates
    return Pieces(pieces.example_ids[keep], pieces.starts[keep], pieces.lengths[keep], counts)
