"""The numba kernels of the bin packer (`pipeline.plan.binpack.assign_bins` checks the input, picks
the kernels of a strategy and numbers the bins); each is a loop over numpy arrays:

- `ffd_runs` / `bfd_runs` never sort the examples: lengths are bounded by `max_len`, so a histogram
  (`count_lengths`, a counting sort) gives the decreasing order, and all examples of one length that
  land in the same bin are placed at once (exactly what FFD/BFD would do one by one, since the bin
  stays the first/best fit until it can take no more of that length). FFD finds the leftmost bin
  with room in a max segment tree over bin capacities; BFD keeps one stack of bins per remaining
  capacity plus a two-level bitset to find the smallest capacity that fits. A last linear pass
  (`assign_from_runs`) hands each example its bin.
- `first_fit_order` is first-fit in a given order (same segment tree, one example at a time);
  `next_fit` is next-fit in input order; `minibatch_bins` packs consecutive groups of a permutation
  separately (FFD within a group).
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import trailing_zeros

_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)
_ONE = np.uint64(1)


@njit(cache=True)
def scan_lengths(lengths, max_len):
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


@njit(cache=True)
def count_lengths(lengths, longest):
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
def ffd_runs(counts, max_len, bin_cap):
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
def bfd_runs(counts, max_len, bin_cap):
    """BFD by length classes; same output layout as `ffd_runs`.

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
def assign_from_runs(lengths, lo, run_bin, run_cnt, out):
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
def first_fit_order(lengths, order, max_len, bin_cap, out):
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
def relabel(out, perm):
    for i in range(out.size):
        out[i] = perm[out[i]]


@njit(cache=True)
def next_fit(lengths, max_len, out):
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
def minibatch_bins(lengths, perm, max_len, group_size, out):
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
