"""Plan which packed row (bin) every example goes to: `assign_bins(lengths, max_len, ...)`.

The planner only sees token counts, never tokens, so it runs over millions of examples in well under
a second; every hot loop is a numba kernel over numpy arrays (`pipeline.plan.binpack_kernels`).

- `ffd` / `bfd`: first-fit / best-fit decreasing, placing all examples of one length at once.
- `shuffle` is first-fit in a seeded random order.
- `sequential` is next-fit in input order; `minibatch` packs consecutive groups of a seeded
  permutation separately (FFD within a group); `pad` is one example per row.

Bins of `ffd`, `bfd`, `shuffle` and `pad` are numbered in a seeded random order, so rows are not
written sorted by length; `sequential` and `minibatch` keep input/group order.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.errors import UserError
from pipeline.plan.binpack_kernels import (
    assign_from_runs,
    bfd_runs,
    count_lengths,
    ffd_runs,
    first_fit_order,
    minibatch_bins,
    next_fit,
    relabel,
    scan_lengths,
)

__all__ = ["STRATEGIES", "PlanError", "assign_bins", "bin_loads", "minibatch_groups"]

STRATEGIES = ("ffd", "bfd", "shuffle", "sequential", "minibatch", "pad")
MAX_LEN_LIMIT = 1 << 24  # bfd keeps O(max_len) per-capacity state; no training row is this long


class PlanError(UserError, ValueError):
    """Bad input to the planner (a `UserError`, and a `ValueError` for plain-library callers)."""


# ----------------------------------------------------------------------------------- validation


def _as_int(value: object, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise PlanError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _check_lengths(lengths: object, max_len: int) -> tuple[np.ndarray, int, int]:
    """Validated lengths as int32/int64 array, their sum and the longest one."""
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise PlanError(f"lengths must be a 1-D array of token counts, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64), 0, 0
    if arr.dtype.kind not in "iu":
        raise PlanError(f"lengths must be integers (token counts), got dtype {arr.dtype}: pass e.g. np.asarray(lengths, dtype=np.int64)")
    if arr.dtype not in (np.int32, np.int64):
        bad = np.flatnonzero((arr < 1) | (arr > max_len))
        if bad.size:
            i = int(bad[0])
            raise PlanError(_range_message(i, int(arr[i]), max_len))
        arr = arr.astype(np.int64)
    arr = np.ascontiguousarray(arr)
    bad, total, longest = scan_lengths(arr, max_len)
    if bad >= 0:
        raise PlanError(_range_message(int(bad), int(arr[bad]), max_len))
    return arr, int(total), int(longest)


def _range_message(index: int, value: int, max_len: int) -> str:
    return (
        f"lengths[{index}] = {value} is outside 1..max_len={max_len}: drop empty examples and clip or split overlong ones before planning"
    )


# ---------------------------------------------------------------------------------- public API


def assign_bins(
    lengths: np.ndarray,
    max_len: int,
    strategy: str = "ffd",
    seed: int = 0,
    group_size: int = 32,
) -> np.ndarray:
    """Bin (packed row) index of every example; bins are dense 0..n_bins-1 in write order.

    `lengths`: 1-D integer token counts, each in 1..max_len (already clipped by the overlong
    policy). `strategy`: one of `STRATEGIES` (see the module docstring). `seed` fixes every random
    choice (bin numbering, shuffle order, minibatch groups); `group_size` is the examples per group
    of `minibatch`. No bin holds more than `max_len` tokens. Raises `PlanError` (a `ValueError`) on
    bad input, naming the offending value.
    """
    max_len = _as_int(max_len, "max_len")
    if max_len < 1 or max_len > MAX_LEN_LIMIT:
        raise PlanError(f"max_len must be in 1..{MAX_LEN_LIMIT}, got {max_len}")
    if strategy not in STRATEGIES:
        raise PlanError(f"unknown packing strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    seed = _as_int(seed, "seed")
    if seed < 0:
        raise PlanError(f"seed must be a non-negative integer, got {seed}")
    group_size = _as_int(group_size, "group_size")
    if group_size < 1:
        raise PlanError(f"group_size must be >= 1, got {group_size}")
    arr, total, longest = _check_lengths(lengths, max_len)
    n = arr.size
    if n == 0:
        return np.empty(0, np.int64)

    rng = np.random.default_rng(seed)
    out = np.empty(n, np.int64)
    # first-fit/best-fit/next-fit leave at most one bin at most half full, so this bounds n_bins
    bin_cap = min(n, 2 * (-(-total // max_len)) + 1)
    if strategy in ("ffd", "bfd"):
        counts = count_lengths(arr, longest)
        runs = ffd_runs if strategy == "ffd" else bfd_runs
        lo, run_bin, run_cnt, n_runs, n_bins = runs(counts, max_len, bin_cap)
        perm = rng.permutation(n_bins)
        assign_from_runs(arr, lo, perm[run_bin[:n_runs]], run_cnt, out)
    elif strategy == "shuffle":
        order = rng.permutation(n)
        n_bins = first_fit_order(arr, order, max_len, bin_cap, out)
        del order
        relabel(out, rng.permutation(n_bins))
    elif strategy == "sequential":
        next_fit(arr, max_len, out)
    elif strategy == "minibatch":
        minibatch_bins(arr, rng.permutation(n), max_len, group_size, out)
    else:  # pad
        out = rng.permutation(n).astype(np.int64, copy=False)
    return out


# The numba kernels each strategy calls itself (kernels they call are compiled into them).
_STRATEGY_KERNELS = {
    "ffd": (scan_lengths, count_lengths, ffd_runs, assign_from_runs),
    "bfd": (scan_lengths, count_lengths, bfd_runs, assign_from_runs),
    "shuffle": (scan_lengths, first_fit_order, relabel),
    "sequential": (scan_lengths, next_fit),
    "minibatch": (scan_lengths, minibatch_bins),
    "pad": (scan_lengths,),
}


def uncompiled(strategies: tuple[str, ...] | list[str]) -> list[str]:
    """Those of `strategies` whose numba kernels are neither compiled in this process nor in numba's
    on-disk cache (for this source): their first plan compiles them, seconds each (tens on a busy
    machine), which a command should announce rather than sit silent through."""

    def ready(kernel: Any) -> bool:
        if kernel.signatures:
            return True
        try:  # numba's cache index, empty when missing or stale
            return bool(kernel._cache._cache_file._load_index())
        except Exception:  # noqa: BLE001 - another numba version's internals: say it may compile
            return False

    return [s for s in strategies if not all(ready(k) for k in _STRATEGY_KERNELS.get(s, ()))]


def minibatch_groups(n: int, seed: int = 0, group_size: int = 32) -> np.ndarray:
    """Group (optimizer step) of each of `n` examples under `assign_bins(..., "minibatch", seed)`.

    Bins of group g are contiguous and come before those of group g+1, so a trainer can take exactly
    one group per step.
    """
    n = _as_int(n, "n")
    group_size = _as_int(group_size, "group_size")
    if n < 0 or group_size < 1:
        raise PlanError(f"need n >= 0 and group_size >= 1, got n={n}, group_size={group_size}")
    groups = np.empty(n, np.int64)
    groups[np.random.default_rng(seed).permutation(n)] = np.arange(n, dtype=np.int64) // group_size
    return groups


def bin_loads(bins: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Tokens per bin (int64, one entry per bin id 0..max(bins))."""
    bins = np.asarray(bins, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if bins.shape != lengths.shape:
        raise PlanError(f"bins and lengths differ in shape: {bins.shape} vs {lengths.shape}")
    if bins.size == 0:
        return np.zeros(0, np.int64)
    if bins.min() < 0:
        raise PlanError(f"bin ids must be >= 0, got {int(bins.min())}")
    return np.rint(np.bincount(bins, weights=lengths)).astype(np.int64)
