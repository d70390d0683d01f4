"""Plan which packed row (bin) every example goes to: `assign_bins(lengths, max_len, ...)`.

The planner only sees token counts, never tokens, so it runs over millions of examples in well under
a second. Every hot loop is a numba kernel over numpy arrays:

- `ffd` / `bfd` never sort the examples: lengths are bounded by `max_len`, so a histogram (counting
  sort) gives the decreasing order, and all examples of one length that land in the same bin are
  placed at once (exactly what FFD/BFD would do one by one, since the bin stays the first/best fit
  until it can take no more of that length). FFD finds the leftmost bin with room in a max segment
  tree over bin capacities; BFD keeps one stack of bins per remaining capacity plus a two-level
  bitset to find the smallest capacity that fits. A last linear pass hands each example its bin.
- `shuffle` is first-fit in a seeded random order (same segment tree, one example at a time).
- `sequential` is next-fit in input order; `minibatch` packs consecutive groups of a seeded
  permutation separately (FFD within a group); `pad` is one example per row.

Bins of `ffd`, `bfd`, `shuffle` and `pad` are numbered in a seeded random order, so rows are not
written sorted by length; `sequential` and `minibatch` keep input/group order.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import trailing_zeros

from pipeline.errors import UserError

__all__ = ["STRATEGIES", "PlanError", "assign_bins", "bin_loads", "minibatch_groups"]

STRATEGIES = ("ffd", "bfd", "shuffle", "sequential", "minibatch", "pad")
MAX_LEN_LIMIT = 1 << 24  # bfd keeps O(max_len) per-capacity state; no training row is this long

_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)
_ONE = np.uint64(1)


class PlanError(UserError, ValueError):
    """Bad input to the planner (a `UserError`, and a `ValueError` for plain-library callers)."""


# ----------------------------------------------------------------------------------- validation


@njit(cache=True)
def _scan(lengths, max_len):
    """(index of the first length outside 1..max_len or -1, sum of lengths, largest length)."""
    total = 0
    longest = 0
    for i in range(lengths.size):
        v = np.int64(lengths[i])
        if v < 1 or v > max_len:
            return i, total, longest
        total += v
        longest = max(longest, v)
    return -1, total, longest


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
        raise PlanError(
            f"lengths must be integers (token counts), got dtype {arr.dtype}: "
            "pass e.g. np.asarray(lengths, dtype=np.int64)"
        )
    if arr.dtype not in (np.int32, np.int64):
        bad = np.flatnonzero((arr < 1) | (arr > max_len))
        if bad.size:
            i = int(bad[0])
            raise PlanError(_range_message(i, int(arr[i]), max_len))
        arr = arr.astype(np.int64)
    arr = np.ascontiguousarray(arr)
    bad, total, longest = _scan(arr, max_len)
    if bad >= 0:
        raise PlanError(_range_message(int(bad), int(arr[bad]), max_len))
    return arr, int(total), int(longest)


def _range_message(index: int, value: int, max_len: int) -> str:
    return (
        f"lengths[{index}] = {value} is outside 1..max_len={max_len}: drop empty examples and clip "
        "or split overlong ones before planning"
    )


# ---------------------------------------------------------------------------------- numba kernels


@njit(cache=True)
def _counts(lengths, longest):
    counts = np.zeros(longest + 1, np.int64)
    for i in range(lengths.size):
        counts[lengths[i]] += 1
    return counts


@njit(cache=True)
def _pow2(n):
    p = 1
    while p < n:
        p *= 2
    return p


@njit(cache=True)
def _tree_first_fit(tree, p, length):
    """Leaf node of the leftmost bin whose remaining capacity >= length (root must allow it)."""
    node = 1
    while node < p:
        node <<= 1
        if tree[node] < length:
            node += 1
    return node


@njit(cache=True)
def _tree_set(tree, node, value):
    """Lower a leaf's capacity and refresh the maxima above it (stop once one is unchanged)."""
    tree[node] = value
    node >>= 1
    while node >= 1:
        a = tree[2 * node]
        b = tree[2 * node + 1]
        m = max(a, b)
        if tree[node] == m:
            break
        tree[node] = m
        node >>= 1


@njit(cache=True)
def _grow(a, n):
    b = np.empty(max(2 * a.size, 16), a.dtype)
    b[:n] = a[:n]
    return b


@njit(cache=True)
def _ffd_runs(counts, max_len, bin_cap):
    """FFD by length classes. Returns (lo, run_bin, run_cnt, n_runs, n_bins).

    Runs come out for decreasing lengths; those of length L start at lo[L] and together hold
    counts[L] slots: run r puts run_cnt[r] examples of that length into bin run_bin[r].
    """
    p = _pow2(bin_cap)
    tree = np.full(2 * p, max_len, np.int32)  # unopened bins are full-capacity leaves
    est = bin_cap + counts.size + 16
    run_bin = np.empty(est, np.int64)
    run_cnt = np.empty(est, np.int64)
    lo = np.zeros(counts.size, np.int64)
    n_runs = 0
    n_bins = 0
    for length in range(counts.size - 1, 0, -1):
        lo[length] = n_runs
        rem = counts[length]
        while rem > 0:
            node = _tree_first_fit(tree, p, length)
            cap = np.int64(tree[node])
            k = cap // length
            k = min(k, rem)
            rem -= k
            if n_runs == run_bin.size:
                run_bin = _grow(run_bin, n_runs)
                run_cnt = _grow(run_cnt, n_runs)
            b = node - p
            run_bin[n_runs] = b
            run_cnt[n_runs] = k
            n_runs += 1
            if b >= n_bins:
                n_bins = b + 1
            _tree_set(tree, node, np.int32(cap - k * length))
    return lo, run_bin, run_cnt, n_runs, n_bins


@njit(cache=True)
def _bits_set(l0, l1, c):
    w = c >> 6
    if l0[w] == 0:
        l1[w >> 6] |= _ONE << np.uint64(w & 63)
    l0[w] |= _ONE << np.uint64(c & 63)


@njit(cache=True)
def _bits_clear(l0, l1, c):
    w = c >> 6
    l0[w] &= ~(_ONE << np.uint64(c & 63))
    if l0[w] == 0:
        l1[w >> 6] &= ~(_ONE << np.uint64(w & 63))


@njit(cache=True)
def _bits_next(l0, l1, c):
    """Smallest set position >= c, or -1."""
    w = c >> 6
    bits = l0[w] & (_ALL << np.uint64(c & 63))
    if bits != 0:
        return (w << 6) + np.int64(trailing_zeros(bits))
    w += 1
    w1 = w >> 6
    if w1 >= l1.size:
        return -1
    bits = l1[w1] & (_ALL << np.uint64(w & 63))
    while bits == 0:
        w1 += 1
        if w1 >= l1.size:
            return -1
        bits = l1[w1]
    ww = (w1 << 6) + np.int64(trailing_zeros(bits))
    return (ww << 6) + np.int64(trailing_zeros(l0[ww]))


@njit(cache=True)
def _bfd_runs(counts, max_len, bin_cap):
    """BFD by length classes; same output layout as `_ffd_runs`.

    head[c] is a stack (linked through nxt) of open bins with exactly c tokens of room; the bitset
    marks non-empty stacks for 0 < c < max_len. A bin never sits in two stacks.
    """
    head = np.full(max_len + 1, -1, np.int64)
    nxt = np.empty(bin_cap, np.int64)
    n0 = (max_len >> 6) + 1
    l0 = np.zeros(n0, np.uint64)
    l1 = np.zeros((n0 >> 6) + 1, np.uint64)
    est = bin_cap + counts.size + 16
    run_bin = np.empty(est, np.int64)
    run_cnt = np.empty(est, np.int64)
    lo = np.zeros(counts.size, np.int64)
    n_runs = 0
    n_bins = 0
    for length in range(counts.size - 1, 0, -1):
        rem = counts[length]
        lo[length] = n_runs
        while rem > 0:
            c = _bits_next(l0, l1, length)
            if c < 0 or c >= max_len:
                b = n_bins
                n_bins += 1
                c = max_len
            else:
                b = head[c]
                head[c] = nxt[b]
                if head[c] < 0:
                    _bits_clear(l0, l1, c)
            k = c // length
            k = min(k, rem)
            rem -= k
            if n_runs == run_bin.size:
                run_bin = _grow(run_bin, n_runs)
                run_cnt = _grow(run_cnt, n_runs)
            run_bin[n_runs] = b
            run_cnt[n_runs] = k
            n_runs += 1
            c -= k * length
            if c > 0:
                nxt[b] = head[c]
                if head[c] < 0:
                    _bits_set(l0, l1, c)
                head[c] = b
    return lo, run_bin, run_cnt, n_runs, n_bins


@njit(cache=True)
def _assign_from_runs(lengths, lo, run_bin, run_cnt, out):
    """Hand examples of each length, in input order, the slots of that length's runs."""
    cur = lo.copy()
    used = np.zeros(lo.size, np.int64)
    for i in range(lengths.size):
        length = lengths[i]
        r = cur[length]
        out[i] = run_bin[r]
        u = used[length] + 1
        if u == run_cnt[r]:
            cur[length] = r + 1
            used[length] = 0
        else:
            used[length] = u


@njit(cache=True)
def _first_fit_order(lengths, order, max_len, bin_cap, out):
    """First-fit in the given order (one example at a time); returns the number of bins.

    Works in blocks: gathering a block's lengths and scattering its bins as separate loops lets the
    CPU overlap the random memory accesses, instead of stalling on each one inside the tree walk.
    """
    p = _pow2(bin_cap)
    tree = np.full(2 * p, max_len, np.int32)
    block = 4096
    buf = np.empty(block, np.int64)
    n_bins = 0
    for start in range(0, order.size, block):
        m = min(block, order.size - start)
        for j in range(m):
            buf[j] = lengths[order[start + j]]
        for j in range(m):
            length = buf[j]
            node = _tree_first_fit(tree, p, length)
            b = node - p
            buf[j] = b
            if b >= n_bins:
                n_bins = b + 1
            _tree_set(tree, node, np.int32(tree[node] - length))
        for j in range(m):
            out[order[start + j]] = buf[j]
    return n_bins


@njit(cache=True)
def _relabel(out, perm):
    for i in range(out.size):
        out[i] = perm[out[i]]


@njit(cache=True)
def _next_fit(lengths, max_len, out):
    b = 0
    load = 0
    for i in range(lengths.size):
        length = lengths[i]
        if load + length > max_len:
            b += 1
            load = 0
        out[i] = b
        load += length


@njit(cache=True)
def _minibatch(lengths, perm, max_len, group_size, out):
    """FFD inside each consecutive group of `perm`; bins numbered group after group."""
    n = perm.size
    g = min(group_size, n)
    glen = np.empty(g, np.int64)
    gidx = np.empty(g, np.int64)
    p = _pow2(g)
    tree = np.empty(2 * p, np.int32)
    next_bin = 0
    for start in range(0, n, group_size):
        m = min(group_size, n - start)
        for k in range(m):
            glen[k] = lengths[perm[start + k]]
            gidx[k] = perm[start + k]
        if m <= 64:  # stable insertion sort by decreasing length
            for k in range(1, m):
                vl = glen[k]
                vi = gidx[k]
                j = k - 1
                while j >= 0 and glen[j] < vl:
                    glen[j + 1] = glen[j]
                    gidx[j + 1] = gidx[j]
                    j -= 1
                glen[j + 1] = vl
                gidx[j + 1] = vi
        else:
            o = np.argsort(-glen[:m], kind="mergesort")
            glen[:m] = glen[:m][o]
            gidx[:m] = gidx[:m][o]
        q = _pow2(m)
        tree[: 2 * q] = max_len
        nb = 0
        for k in range(m):
            node = _tree_first_fit(tree, q, glen[k])
            b = node - q
            out[gidx[k]] = next_bin + b
            if b >= nb:
                nb = b + 1
            _tree_set(tree, node, np.int32(tree[node] - glen[k]))
        next_bin += nb


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
        raise PlanError(
            f"unknown packing strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}"
        )
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
        counts = _counts(arr, longest)
        runs = _ffd_runs if strategy == "ffd" else _bfd_runs
        lo, run_bin, run_cnt, n_runs, n_bins = runs(counts, max_len, bin_cap)
        perm = rng.permutation(n_bins)
        _assign_from_runs(arr, lo, perm[run_bin[:n_runs]], run_cnt, out)
    elif strategy == "shuffle":
        order = rng.permutation(n)
        n_bins = _first_fit_order(arr, order, max_len, bin_cap, out)
        del order
        _relabel(out, rng.permutation(n_bins))
    elif strategy == "sequential":
        _next_fit(arr, max_len, out)
    elif strategy == "minibatch":
        _minibatch(arr, rng.permutation(n), max_len, group_size, out)
    else:  # pad
        out = rng.permutation(n).astype(np.int64, copy=False)
    return out


# The numba kernels each strategy calls itself (kernels they call are compiled into them).
_STRATEGY_KERNELS = {
    "ffd": (_scan, _counts, _ffd_runs, _assign_from_runs),
    "bfd": (_scan, _counts, _bfd_runs, _assign_from_runs),
    "shuffle": (_scan, _first_fit_order, _relabel),
    "sequential": (_scan, _next_fit),
    "minibatch": (_scan, _minibatch),
    "pad": (_scan,),
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
