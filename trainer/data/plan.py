"""The cuts of one epoch: a permutation of the rows cut greedily into micro-batches of at most a token
budget (`greedy_cuts`), and, for a folder of groups (`--strategy minibatch`), one optimizer step per
group (`group_plan`). `trainer.data.stream.Planner` builds an epoch's plan from these."""

from __future__ import annotations

from dataclasses import dataclass

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
    # stepping by group: step s takes micro-batches step_starts[s]:step_starts[s + 1]; None: grad_accum each
    step_starts: np.ndarray | None = None

    @property
    def n_microbatches(self) -> int:
        return len(self.cuts) - 1

    def rows(self, index: int) -> np.ndarray:
        """Global row indices of global micro-batch `index`."""
        return self.order[self.cuts[index] : self.cuts[index + 1]]


def group_plan(lengths: np.ndarray, groups: np.ndarray, budget: int, *, seed: int, epoch: int,
               shuffle: bool = True) -> EpochPlan:
    """The plan of `epoch` for rows in groups (`groups[g]` rows each, group after group): the groups
    in a seeded order (`shuffle`), each group's rows cut on their own into micro-batches of at most
    `budget` tokens (a longer row alone), one optimizer step per group. The groups themselves are
    pack-data's: every epoch takes the same groups, in another order."""
    first = np.concatenate(([0], np.cumsum(groups)))
    ranked = np.random.default_rng([seed, epoch]).permutation(len(groups)) if shuffle else np.arange(len(groups))
    order, cuts, step_starts = [], [np.zeros(1, np.int64)], [0]
    placed = 0
    for g in ranked:
        rows = np.arange(first[g], first[g + 1], dtype=np.int64)
        inner = greedy_cuts(lengths[rows], budget)
        order.append(rows)
        cuts.append(inner[1:] + placed)
        placed += len(rows)
        step_starts.append(step_starts[-1] + len(inner) - 1)
    return EpochPlan(epoch=epoch, order=np.concatenate(order) if order else np.zeros(0, np.int64),
                     cuts=np.concatenate(cuts), n_dropped_microbatches=0,
                     n_long_rows=int((lengths > budget).sum()), step_starts=np.asarray(step_starts, dtype=np.int64))
