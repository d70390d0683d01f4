"""Held-out evaluation examples (`pack-data --eval-fraction F` or `--eval-examples N`).

A seeded choice of whole examples, by example id, among those that are packed (not dropped): the
same ids for any `--num-proc`, since ids are input-order indices. They are packed into `OUT/eval/`
(a packed folder of its own) and never into the training folder; a split example's pieces all go
to the same side.

    >>> pieces = Pieces(np.array([0, 1, 1, 2, 3]), np.arange(5) * 8, np.array([5, 8, 2, 4, 6]),
    ...                 Counts(examples_read=4, examples_packed=4, split=1))
    >>> train, held = split_off_eval(pieces, fraction=0.5, examples=None, seed=0)
    >>> train.example_ids.tolist(), held.example_ids.tolist(), held.counts.examples_packed
    ([0, 2], [1, 1, 3], 2)
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pipeline.errors import UserError
from pipeline.plan.rows import Pieces
from pipeline.shards import Counts

EVAL_FOLDER = "eval"


def split_off_eval(
    pieces: Pieces, *, fraction: float | None, examples: int | None, seed: int, truncated_ids: np.ndarray | None = None
) -> tuple[Pieces, Pieces]:
    """(training pieces, held-out pieces) with `fraction` of the packed examples (rounded) or
    `examples` of them held out; the counts of each side are its own (examples read is the input's
    on both; `truncated_ids`: the examples `--overlong truncate` cut). Leaving either side empty is
    a UserError."""
    ids = pieces.example_ids
    first = pieces.first_pieces()
    present = ids[first]
    n = len(present)
    m = int(round(fraction * n)) if fraction is not None else int(examples or 0)
    if not 0 < m < n:
        asked = f"--eval-fraction {fraction:g}" if fraction is not None else f"--eval-examples {examples}"
        raise UserError(
            f"{asked} holds out {m} of the {n} packed examples: both the training and the eval "
            "folder need at least one; choose a value that leaves some on each side"
        )
    chosen = np.sort(np.random.default_rng([seed, 1]).choice(present, size=m, replace=False))
    held = np.isin(ids, chosen)
    split_ids = np.unique(ids[~first])  # a piece after an example's first: the example was split
    c = pieces.counts
    held_split = int(np.isin(split_ids, chosen).sum())
    held_truncated = int(np.isin(truncated_ids, chosen).sum()) if truncated_ids is not None else 0
    eval_counts = Counts(examples_read=c.examples_read, examples_packed=m, split=held_split, truncated=held_truncated)
    train_counts = replace(c, examples_packed=c.examples_packed - m, split=c.split - held_split, truncated=c.truncated - held_truncated)
    train = Pieces(ids[~held], pieces.starts[~held], pieces.lengths[~held], train_counts)
    evals = Pieces(ids[held], pieces.starts[held], pieces.lengths[held], eval_counts)
    return train, evals
