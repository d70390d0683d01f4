"""The cuts of one epoch: a permutation of the rows cut greedily into micro-batches of at most a token
budget (`greedy_cuts`), and, for a folder of groups (`--strategy minibatch`), the groups in a seeded
order, each cut on its own (`group_plan`). `trainer.data.stream.Planner` builds an epoch's plan from
these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from numba import njit


@njit(cache=True)
def greedy_cuts(lengths: np.ndarray, budget: int) -> np.ndarray:  # pragma: no cover - numba
    """Boundaries of consecutive groups whose token sum stays <= budget (a lone long row allowed)."""
    n = lengths.shape[0]
    cuts = np.empty(n + 1, dtype=np.int64)
    cuts[0] = 0
    k = 0
    acc = 0
    for i in range(n):
        length = lengths[i]
        if acc > 0 and acc + length > budget:
            k += 1
            cuts[k] = i
            acc = 0
        acc += length
    if n > 0:
        k += 1
        cuts[k] = n
    return cuts[: k + 1]


@dataclass
class EpochPlan:
    """The micro-batches of one epoch: micro-batch i holds rows `order[cuts[i]:cuts[i+1]]`."""

    epoch: int
    order: np.ndarray  # permuted global row indices
    cuts: np.ndarray  # n_microbatches + 1 boundaries into `order` (after truncation)
    n_dropped_microbatches: int  # cut off so every rank gets the same number of steps
    n_long_rows: int  # rows longer than the token budget (each its own micro-batch)
    # stepping by group: group k of the epoch is micro-batches group_starts[k]:group_starts[k + 1]; None: no groups
    group_starts: np.ndarray | None = None

    @property
    def n_microbatches(self) -> int:
        return len(self.cuts) - 1

    def rows(self, index: int) -> np.ndarray:
        """Global row indices of global micro-batch `index`."""
        return self.order[self.cuts[index] : self.cuts[index + 1]]


def group_plan(lengths: np.ndarray, groups: np.ndarray, budget: int, *, seed: int, epoch: int, shuffle: bool = True) -> EpochPlan:
    """The plan of `epoch` for rows in groups (`groups[g]` rows each, group after group): the groups
    in a seeded order (`shuffle`), each group's rows cut on their own into micro-batches of at most
    `budget` tokens (a longer row alone). The groups themselves are pack-data's: every epoch takes
    the same groups, in another order (`Planner.step_share` deals them to the ranks)."""
    first = np.concatenate(([0], np.cumsum(groups)))
    ranked = np.random.default_rng([seed, epoch]).permutation(len(groups)) if shuffle else np.arange(len(groups))
    order, cuts, group_starts = [], [np.zeros(1, np.int64)], [0]
    placed = 0
    for g in ranked:
        rows = np.arange(first[g], first[g + 1], dtype=np.int64)
        inner = greedy_cuts(lengths[rows], budget)
        order.append(rows)
        cuts.append(inner[1:] + placed)
        placed += len(rows)
        group_starts.append(group_starts[-1] + len(inner) - 1)
    return EpochPlan(
        epoch=epoch,
        order=np.concatenate(order) if order else np.zeros(0, np.int64),
        cuts=np.concatenate(cuts),
        n_dropped_microbatches=0,
        n_long_rows=int((lengths > budget).sum()),
        group_starts=np.asarray(group_starts, dtype=np.int64),
    )


class StepShare(NamedTuple):
    """One rank's part of an optimizer step: the micro-batches to read (keys of the epoch, in order),
    of which the first `real` are its own; the others are fillers, read and backpropagated with
    weight 0 so that every rank takes part in the step's collectives."""

    indices: list[int]
    real: int


def group_share(group_starts: np.ndarray, step: int, world: int, rank: int, *, even: bool = False) -> StepShare:
    """`rank`'s part of step `step` when a step takes the next `world` groups of the epoch, one a rank
    (`group_starts`: an `EpochPlan`'s): its group's micro-batches, then fillers (the first micro-batch
    of the step's first group) where it has no group (the epoch's last step may hold fewer groups
    than ranks) or, `even`, fewer micro-batches than the step's fullest group.

    >>> starts = np.array([0, 2, 3, 6, 7, 9])  # five groups of 2, 1, 3, 1 and 2 micro-batches
    >>> group_share(starts, 0, 2, 1), group_share(starts, 0, 2, 1, even=True), group_share(starts, 2, 2, 1)
    (StepShare(indices=[2], real=1), StepShare(indices=[2, 0], real=1), StepShare(indices=[7], real=0))
    """
    first = step * world
    mine, end = first + rank, min(first + world, len(group_starts) - 1)
    own = list(range(int(group_starts[mine]), int(group_starts[mine + 1]))) if mine < end else []
    want = int(np.diff(group_starts[first : end + 1]).max()) if even else max(len(own), 1)
    return StepShare(own + [int(group_starts[first])] * (want - len(own)), len(own))
