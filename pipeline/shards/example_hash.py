"""A hash of every example a packed folder holds, from its shards alone: what tells whether an eval
folder holds examples of a training folder, example by example, whatever files they came from.

Each stored sequence (an example, or a piece of a split one) is hashed by its tokens: its length
and two 64-bit sums of (token + 1) x a fixed pseudo-random multiplier per position, computed with
numpy over the memory-mapped shards (one pass over the tokens, no Python loop per example). Two
sequences with the same tokens get the same hash in any folder; different ones collide with a
probability of about 2^-128.

    >>> hashes = example_hashes(folder, read_manifest(folder))   # (n_sequences, 3) uint64
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from pipeline.shards.format import load_shard, shard_paths
from pipeline.shards.manifest import Manifest

_SEEDS = (0x5EED0FE8A1, 0x5EED0FE8A2)


def position_multipliers(n: int, seeds: tuple[int, ...] = _SEEDS) -> np.ndarray:
    """(len(seeds), n) odd uint64 multipliers for positions 0..n-1, the same in every process and
    folder (each row a stream of its own seed, so the first n do not depend on n)."""
    rows = [np.random.Generator(np.random.PCG64(seed)).integers(0, 2**63, size=n, dtype=np.uint64) for seed in seeds]
    return np.stack(rows) * np.uint64(2) + np.uint64(1)


def example_hashes(folder: str | os.PathLike[str], manifest: Manifest) -> np.ndarray:
    """(length, hash a, hash b) of every stored sequence of the folder's shards, as uint64 rows."""
    mult = position_multipliers(max(manifest.max_len, 1))
    out = []
    for path in shard_paths(Path(folder), manifest):
        cols = load_shard(path)
        lens = np.asarray(cols.seq_lens, dtype=np.int64)
        if not len(lens):
            continue
        if int(lens.max()) > mult.shape[1]:  # a folder not yet verified: longer than its max_len
            mult = position_multipliers(int(lens.max()))
        starts = np.cumsum(lens) - lens
        pos = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(starts, lens)
        tokens = np.asarray(cols.input_ids[: int(lens.sum())], dtype=np.uint64) + np.uint64(1)
        with np.errstate(over="ignore"):
            a = np.add.reduceat(tokens * mult[0][pos], starts)
            b = np.add.reduceat(tokens * mult[1][pos], starts)
        out.append(np.stack([lens.astype(np.uint64), a, b], axis=1))
    return np.concatenate(out) if out else np.zeros((0, 3), np.uint64)


def shared_examples(a: np.ndarray, b: np.ndarray) -> int:
    """How many distinct sequences (rows of `example_hashes`) of `b` are also in `a`."""
    view = lambda h: np.ascontiguousarray(h).view([("", np.uint64)] * 3).ravel()  # noqa: E731
    return int(len(np.intersect1d(view(a), view(b))))
