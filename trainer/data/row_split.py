"""The row split of context parallelism: which tokens of one packed row each of the N ranks of a
context-parallel group holds, and the pieces its attention is cut into; every example stays exact.

A micro-batch is one flat row of T tokens holding several examples (`trainer.data.batch.MicroBatch`).
Under `--context-parallel N` the N ranks of a context-parallel group read the same row and each
keeps a share of its tokens (`shard_microbatch`). Every layer but attention works token by token,
so it runs on the share alone; attention gathers the keys and values of the whole row from the group
and attends this rank's queries to them (`trainer.attention.gathered`, over the group of
`trainer.distributed.context_parallel`), each query to the earlier keys of its own example, as in
the single-process row.

How a row is split (`split_row`): the T tokens are cut into N * c chunks of nearly equal size and
each rank gets c of them, chosen so that the causal work (the keys each query attends: position + 1
within its example) is balanced: taken from the heaviest, each chunk goes to the least-loaded rank
that still has room. One example of T tokens on N = 2 ranks with c = 2: chunks [0, T/4), [T/4,
T/2), [T/2, 3T/4), [3T/4, T) whose work grows 1 : 3 : 5 : 7, so rank 0 gets chunks 0 and 3 (1 + 7)
and rank 1 chunks 1 and 2 (3 + 5). c is 2, 4 or 8: the first that leaves no rank more than
WORK_SLACK (10%) above the mean (or the best of them). Shares differ by at most c tokens.

How a rank attends (`RowShard.pieces`): its tokens, in row order, are cut where an example begins
or a chunk of the split ends, into pieces. A piece holding tokens [a, b) of an example that starts
at s attends the keys [s, b) of the row (with a window w, from max(s, a - w + 1); with chunked
attention, pieces are also cut at the attention chunks and their keys start at their chunk's start).
The keys are picked out of the gathered row and given to the varlen kernel with boundaries of
their own (`varlen_attention(..., cu_seqlens_k=...)`), whose causal mask is aligned to the bottom
right: the piece's queries are the last tokens of its keys.

Everything else is exact as it is: `position_ids` are the row's (RoPE, Llama 4's temperature), the
targets were shifted on the whole row before the split, and the loss is the token mean over the whole
group, since `trainer.run.loop.backward_window` counts loss tokens over every rank. Dynamic NTK RoPE and
longrope need each token's example length, which a share does not show: `RowShard.lengths` has it
(`trainer.attention.positions`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pipeline.contract import IGNORE_INDEX, UserError
from trainer.data.batch import MicroBatch

WORK_SLACK = 1.10  # no rank's causal work more than 10% above the group's mean, where c allows it
CHUNKS_PER_RANK = (2, 4, 8)


def token_positions(seq_lens: np.ndarray) -> np.ndarray:
    """Each token's position within its example: [3, 2] -> [0, 1, 2, 0, 1]."""
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    starts = np.cumsum(seq_lens) - seq_lens
    return np.arange(int(seq_lens.sum()), dtype=np.int64) - np.repeat(starts, seq_lens)


@dataclass(frozen=True)
class RowSplit:
    """Which tokens of a row each rank of the group holds.

    bounds: int64 [n_chunks + 1], chunk k is the row's tokens [bounds[k], bounds[k + 1]);
    chunks: int64 [n_ranks, chunks_per_rank], each rank's chunks in row order;
    work:   int64 [n_ranks], the causal work (keys attended) of each rank's queries.
    """

    bounds: np.ndarray
    chunks: np.ndarray
    work: np.ndarray

    @property
    def imbalance(self) -> float:
        """The busiest rank's work over the mean (1.0: perfectly balanced)."""
        mean = float(self.work.mean())
        return float(self.work.max()) / mean if mean > 0 else 1.0

    def tokens(self, rank: int) -> np.ndarray:
        """The row indices `rank` holds, ascending."""
        return np.concatenate([np.arange(self.bounds[k], self.bounds[k + 1]) for k in self.chunks[rank]])


def split_row(seq_lens: np.ndarray, n_ranks: int) -> RowSplit:
    """Split a row of examples of `seq_lens` tokens over `n_ranks` ranks (see the module).

    >>> split_row(np.array([8]), 2).chunks.tolist()   # one example: the zigzag
    [[0, 3], [1, 2]]
    """
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    total = int(seq_lens.sum())
    if total < n_ranks:
        raise UserError(
            f"a micro-batch of {total} tokens cannot be split over {n_ranks} context-parallel "
            "ranks: raise --tokens-per-step or lower --context-parallel"
        )
    work_before = np.zeros(total + 1, dtype=np.int64)
    np.cumsum(token_positions(seq_lens) + 1, out=work_before[1:])
    best: RowSplit | None = None
    for per_rank in [c for c in CHUNKS_PER_RANK if total >= n_ranks * c] or [1]:
        n_chunks = n_ranks * per_rank
        bounds = np.arange(n_chunks + 1, dtype=np.int64) * total // n_chunks
        chunk_work = work_before[bounds[1:]] - work_before[bounds[:-1]]
        load = np.zeros(n_ranks, dtype=np.int64)
        taken: list[list[int]] = [[] for _ in range(n_ranks)]
        for k in np.argsort(-chunk_work, kind="stable"):  # a loop over chunks (at most 8 N), not tokens
            open_ranks = [r for r in range(n_ranks) if len(taken[r]) < per_rank]
            r = min(open_ranks, key=lambda i: (load[i], i))
            taken[r].append(int(k))
            load[r] += chunk_work[k]
        split = RowSplit(bounds, np.sort(np.array(taken, dtype=np.int64), axis=1), load)
        if best is None or split.imbalance < best.imbalance:
            best = split
        if split.imbalance <= WORK_SLACK:
            break
    assert best is not None
    return best


@dataclass(frozen=True)
class Pieces:
    """A rank's queries cut into pieces, and the keys of each (numpy; see `RowShard.pieces`)."""

    cu_q: np.ndarray  # int32 [n_pieces + 1]: piece j is this rank's tokens [cu_q[j], cu_q[j + 1])
    cu_k: np.ndarray  # int32 [n_pieces + 1]: its keys are key_slots[cu_k[j]:cu_k[j + 1]]
    key_slots: np.ndarray  # int64: where each key sits in the gathered row (`ContextGroups.gather_tokens`)
    max_q: int
    max_k: int


@dataclass
class RowShard:
    """One rank's share of a row: which tokens, where every token of the row sits once gathered,
    and the pieces its attention is cut into (cached per window / chunk / device)."""

    rank: int
    n_ranks: int
    cu_seqlens: np.ndarray  # int64 [n_examples + 1], the whole row's
    tokens: np.ndarray  # int64 [L]: the row indices this rank holds, ascending
    width: int  # the largest share in the group: each rank sends this many rows when gathering
    slots: np.ndarray  # int64 [T]: where token t of the row sits in the gathered tensor
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, split: RowSplit, cu_seqlens: np.ndarray, rank: int) -> RowShard:
        shares = [split.tokens(r) for r in range(len(split.chunks))]
        width = max(len(s) for s in shares)
        slots = np.empty(int(split.bounds[-1]), dtype=np.int64)
        for r, share in enumerate(shares):  # a loop over ranks
            slots[share] = r * width + np.arange(len(share))
        return cls(rank, len(shares), np.asarray(cu_seqlens, dtype=np.int64), shares[rank], width, slots)

    def _examples(self) -> tuple[np.ndarray, np.ndarray]:
        """Each local token's example index and position within it."""
        example = np.searchsorted(self.cu_seqlens, self.tokens, side="right") - 1
        return example, self.tokens - self.cu_seqlens[example]

    def lengths(self) -> np.ndarray:
        """int64 [L]: the length of each local token's example (what dynamic RoPE needs)."""
        example, _ = self._examples()
        return np.diff(self.cu_seqlens)[example]

    def pieces(self, window: int | None = None, chunk: int | None = None) -> Pieces:
        """This rank's queries in pieces, each with its keys (see the module). Worked example: the
        row holds one example of 8 tokens and this rank tokens 2, 3, 6, 7 (chunks 1 and 3 of 4):
        pieces [2, 4) and [6, 8), keys [0, 4) and [0, 8): cu_q [0, 2, 4], cu_k [0, 4, 12]."""
        key = ("pieces", window, chunk)
        if key not in self._cache:
            self._cache[key] = self._pieces(window, chunk)
        return self._cache[key]

    def _pieces(self, window: int | None, chunk: int | None) -> Pieces:
        tokens, n = self.tokens, len(self.tokens)
        example, position = self._examples()
        begins = np.ones(n, dtype=bool)
        begins[1:] = (tokens[1:] != tokens[:-1] + 1) | (position[1:] == 0)
        if chunk is not None:
            begins |= position % chunk == 0
        first = np.flatnonzero(begins)
        last = np.append(first[1:], n) - 1
        q_len = last - first + 1
        ends = tokens[last] + 1  # row index past each piece's last query
        key_start = self.cu_seqlens[example[first]]
        if chunk is not None:
            key_start = key_start + position[first] // chunk * chunk
        if window is not None:
            key_start = np.maximum(key_start, tokens[first] - window + 1)
        k_len = ends - key_start
        keys = np.arange(int(k_len.sum()), dtype=np.int64) - np.repeat(np.cumsum(k_len) - k_len - key_start, k_len)
        cu_q = np.zeros(len(first) + 1, dtype=np.int32)
        cu_k = np.zeros(len(first) + 1, dtype=np.int32)
        np.cumsum(q_len, out=cu_q[1:])
        np.cumsum(k_len, out=cu_k[1:])
        return Pieces(cu_q, cu_k, self.slots[keys], int(q_len.max(initial=0)), int(k_len.max(initial=0)))

    def on(self, device: torch.device, window: int | None, chunk: int | None) -> tuple[torch.Tensor, ...]:
        """(cu_q, cu_k, key_slots) of `pieces(window, chunk)` on `device`, copied once per row."""
        key = ("tensors", window, chunk, str(device))
        if key not in self._cache:
            p = self.pieces(window, chunk)
            self._cache[key] = tuple(torch.from_numpy(a).to(device, non_blocking=True) for a in (p.cu_q, p.cu_k, p.key_slots))
        return self._cache[key]

    def lengths_on(self, device: torch.device) -> torch.Tensor:
        key = ("lengths", str(device))
        if key not in self._cache:
            self._cache[key] = torch.from_numpy(self.lengths()).to(device)
        return self._cache[key]


def shard_microbatch(batch: MicroBatch, rank: int, n_ranks: int) -> MicroBatch:
    """`rank`'s share of a whole-row micro-batch (host tensors): its tokens, targets and positions,
    its pieces as `cu_seqlens`, and the RowShard that attention and positions read (`context`).
    With one rank (no context parallelism) the batch itself."""
    if n_ranks == 1:
        return batch
    cu = batch.cu_seqlens.numpy().astype(np.int64)
    split = split_row(np.diff(cu), n_ranks)
    shard = RowShard.of(split, cu, rank)
    index = torch.from_numpy(shard.tokens)
    pieces = shard.pieces()
    targets = batch.targets[:, index]
    return MicroBatch(
        input_ids=batch.input_ids[:, index],
        targets=targets,
        position_ids=batch.position_ids[:, index],
        cu_seqlens=torch.from_numpy(pieces.cu_q),
        max_seqlen=pieces.max_q,
        n_tokens=len(shard.tokens),
        n_loss_tokens=int((targets != IGNORE_INDEX).sum()),
        n_examples=len(pieces.cu_q) - 1,
        context=shard,
    )
