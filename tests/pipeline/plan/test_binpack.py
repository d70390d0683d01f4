"""Bin-packing planner: validity, determinism, agreement with slow reference packers, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.errors import UserError
from pipeline.plan.binpack import (
    STRATEGIES,
    PlanError,
    assign_bins,
    bin_loads,
    minibatch_groups,
)

FAST = settings(max_examples=60, deadline=None)


@st.composite
def problems(draw, max_size=120):
    """(lengths, max_len): lengths in 1..max_len, sometimes many equal values."""
    max_len = draw(st.integers(1, 64))
    hi = draw(st.integers(1, max_len))
    lengths = draw(st.lists(st.integers(1, hi), min_size=0, max_size=max_size))
    return np.asarray(lengths, dtype=np.int64), max_len


# ------------------------------------------------------------------------- slow reference packers


def ref_ffd(lengths, max_len):
    """First-fit decreasing, ties in input order, linear scan over bins."""
    caps, out = [], [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, c in enumerate(caps):
            if c >= lengths[i]:
                break
        else:
            caps.append(max_len)
            b = len(caps) - 1
        caps[b] -= lengths[i]
        out[i] = b
    return out


def ref_bfd(lengths, max_len):
    """Best-fit decreasing: the open bin with the least room that still fits."""
    caps, out = [], [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fits = [b for b, c in enumerate(caps) if c >= lengths[i]]
        if fits:
            b = min(fits, key=lambda b: caps[b])
        else:
            caps.append(max_len)
            b = len(caps) - 1
        caps[b] -= lengths[i]
        out[i] = b
    return out


def ref_next_fit(lengths, max_len):
    out, b, load = [], 0, 0
    for x in lengths:
        if load + x > max_len:
            b, load = b + 1, 0
        out.append(b)
        load += x
    return out


def partition(bins):
    """The bins as a set of frozensets of example indices (independent of bin numbering)."""
    groups: dict[int, set[int]] = {}
    for i, b in enumerate(np.asarray(bins).tolist()):
        groups.setdefault(b, set()).add(i)
    return {frozenset(g) for g in groups.values()}


def check_valid(bins, lengths, max_len):
    assert isinstance(bins, np.ndarray) and bins.dtype == np.int64
    assert bins.shape == lengths.shape
    if lengths.size == 0:
        return
    # dense ids 0..n_bins-1, every example in exactly one bin, no bin over max_len
    assert np.array_equal(np.unique(bins), np.arange(bins.max() + 1))
    loads = bin_loads(bins, lengths)
    assert loads.sum() == lengths.sum()
    assert loads.max() <= max_len


# ------------------------------------------------------------------------------- property tests


@FAST
@given(problems(), st.sampled_from(STRATEGIES), st.integers(0, 2**32), st.integers(1, 40))
def test_every_strategy_valid_and_deterministic(problem, strategy, seed, group_size):
    lengths, max_len = problem
    bins = assign_bins(lengths, max_len, strategy, seed=seed, group_size=group_size)
    check_valid(bins, lengths, max_len)
    again = assign_bins(lengths.copy(), max_len, strategy, seed=seed, group_size=group_size)
    assert np.array_equal(bins, again)


@FAST
@given(problems(), st.integers(0, 1000))
def test_ffd_matches_reference_exactly(problem, seed):
    lengths, max_len = problem
    bins = assign_bins(lengths, max_len, "ffd", seed=seed)
    ref = ref_ffd(lengths.tolist(), max_len)
    # same examples together (ties broken in input order), only the numbering differs
    assert partition(bins) == partition(ref)
    assert (bins.max() + 1 if bins.size else 0) == len(set(ref))


@FAST
@given(problems(), st.integers(0, 1000))
def test_bfd_matches_reference(problem, seed):
    lengths, max_len = problem
    bins = assign_bins(lengths, max_len, "bfd", seed=seed)
    ref = np.asarray(ref_bfd(lengths.tolist(), max_len), dtype=np.int64)
    check_valid(bins, lengths, max_len)
    if lengths.size:
        assert bins.max() == ref.max()
        # bins with equal room are interchangeable, so the multiset of loads is tie-independent
        assert sorted(bin_loads(bins, lengths)) == sorted(bin_loads(ref, lengths))


@FAST
@given(problems(), st.sampled_from(["ffd", "bfd", "shuffle"]), st.integers(0, 1000))
def test_any_fit_never_leaves_two_bins_that_would_merge(problem, strategy, seed):
    # first-fit / best-fit only open a bin when nothing fits, so no two bins fit in one row
    lengths, max_len = problem
    loads = np.sort(bin_loads(assign_bins(lengths, max_len, strategy, seed=seed), lengths))
    if loads.size >= 2:
        assert loads[0] + loads[1] > max_len


@FAST
@given(problems())
def test_sequential_is_next_fit_in_input_order(problem):
    lengths, max_len = problem
    bins = assign_bins(lengths, max_len, "sequential", seed=123)
    assert bins.tolist() == ref_next_fit(lengths.tolist(), max_len)
    assert np.all(np.diff(bins) >= 0)  # input order preserved


@FAST
@given(problems(), st.integers(0, 1000), st.integers(1, 70))
def test_minibatch_never_mixes_groups(problem, seed, group_size):
    lengths, max_len = problem
    bins = assign_bins(lengths, max_len, "minibatch", seed=seed, group_size=group_size)
    groups = minibatch_groups(lengths.size, seed=seed, group_size=group_size)
    sizes = np.bincount(groups, minlength=1)
    assert np.all(sizes[:-1] == group_size) and 0 <= sizes[-1] <= group_size
    n_bins = bins.max() + 1 if bins.size else 0
    bin_group = np.full(n_bins, -1)
    for b, g in zip(bins.tolist(), groups.tolist(), strict=True):
        assert bin_group[b] in (-1, g), "a bin holds examples of two groups"
        bin_group[b] = g
    assert np.all(np.diff(bin_group) >= 0)  # bins of a group are contiguous, groups in order
    for g in np.unique(groups):
        members = np.flatnonzero(groups == g)
        assert members.size <= group_size
        # each group packed as tightly as FFD packs it alone
        want = len(set(ref_ffd(lengths[members].tolist(), max_len)))
        assert np.unique(bins[members]).size == want


@FAST
@given(problems(), st.integers(0, 1000))
def test_pad_is_one_example_per_row(problem, seed):
    lengths, max_len = problem
    bins = assign_bins(lengths, max_len, "pad", seed=seed)
    assert np.array_equal(np.sort(bins), np.arange(lengths.size))


def test_bins_are_not_written_sorted_by_length():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 2048, 5000)
    for strategy in ("ffd", "bfd", "shuffle"):
        bins = assign_bins(lengths, 2048, strategy, seed=1)
        longest = np.zeros(bins.max() + 1, np.int64)
        np.maximum.at(longest, bins, lengths)
        steps = np.diff(longest)
        assert (steps > 0).any() and (steps < 0).any(), strategy
        # a different seed renumbers the same bins
        other = assign_bins(lengths, 2048, strategy, seed=2)
        if strategy != "shuffle":
            assert partition(other) == partition(bins)
        assert not np.array_equal(other, bins)


def test_ffd_is_near_the_lower_bound_on_realistic_lengths():
    rng = np.random.default_rng(3)
    lengths = np.clip(rng.lognormal(4.8, 0.7, 50_000).astype(np.int64), 1, 2048)
    lower = -(-int(lengths.sum()) // 2048)
    for strategy in ("ffd", "bfd"):
        n_bins = assign_bins(lengths, 2048, strategy).max() + 1
        assert lower <= n_bins <= lower * 1.001 + 1, strategy


# ---------------------------------------------------------------------------------- hand cases


def test_hand_case_ffd_and_bfd_differ():
    lengths = np.array([4, 5, 1, 8, 10])
    # FFD: 10 | 8 1 | 5 4  (the 1 goes to the leftmost bin with room)
    assert partition(assign_bins(lengths, 10, "ffd")) == {
        frozenset({4}),
        frozenset({3, 2}),
        frozenset({1, 0}),
    }
    # BFD: 10 | 8 | 5 4 1  (the 1 goes to the bin with the least room)
    assert partition(assign_bins(lengths, 10, "bfd")) == {
        frozenset({4}),
        frozenset({3}),
        frozenset({1, 0, 2}),
    }


def test_hand_case_ffd_fills_leftmost():
    bins = assign_bins([5, 4, 3, 2, 1], 6, "ffd", seed=7)
    assert partition(bins) == {frozenset({0, 4}), frozenset({1, 3}), frozenset({2})}


def test_hand_case_sequential():
    assert assign_bins([5, 2, 4, 1], 6, "sequential").tolist() == [0, 1, 1, 2]
    assert assign_bins([3, 3, 3, 3], 6, "sequential").tolist() == [0, 0, 1, 1]
    assert assign_bins([1, 1, 1], 1, "sequential").tolist() == [0, 1, 2]


def test_hand_case_minibatch_and_pad():
    lengths = np.array([4, 4, 4, 4])
    bins = assign_bins(lengths, 8, "minibatch", seed=5, group_size=2)
    groups = minibatch_groups(4, seed=5, group_size=2)
    assert np.array_equal(bins, groups)  # each group of two fits in one row
    assert assign_bins(lengths, 8, "minibatch", group_size=1).max() == 3
    assert assign_bins(lengths, 8, "ffd").max() == 1
    assert sorted(assign_bins(lengths, 8, "pad").tolist()) == [0, 1, 2, 3]


def test_one_example_fills_a_row():
    for strategy in STRATEGIES:
        assert assign_bins([7], 7, strategy).tolist() == [0]


def test_other_integer_dtypes_and_lists_give_the_same_plan():
    base = np.array([3, 9, 2, 7, 7, 1, 5], dtype=np.int64)
    want = assign_bins(base, 10, "ffd", seed=4)
    for arr in (base.astype(np.int32), base.astype(np.uint16), base.tolist()):
        assert np.array_equal(assign_bins(arr, 10, "ffd", seed=4), want)


# ---------------------------------------------------------------------------------- bad input


def test_empty_input_returns_empty_int64():
    for empty in (np.array([], dtype=np.int64), [], np.array([], dtype=np.float64)):
        out = assign_bins(empty, 16)
        assert out.dtype == np.int64 and out.shape == (0,)


@pytest.mark.parametrize(
    ("lengths", "max_len", "needle"),
    [
        (np.array([1.0, 2.0]), 8, "float64"),
        (np.array([True, False]), 8, "bool"),
        (np.array([3, 0, 2]), 8, "lengths[1] = 0"),
        (np.array([3, 2, -4]), 8, "lengths[2] = -4"),
        (np.array([3, 9]), 8, "lengths[1] = 9"),
        (np.array([3, 300], dtype=np.uint16), 8, "lengths[1] = 300"),
        (np.array([[1, 2]]), 8, "1-D"),
        (np.array([1, 2]), 0, "max_len"),
        (np.array([1, 2]), -5, "-5"),
        (np.array([1, 2]), 2.5, "2.5"),
        (np.array([1, 2]), 1 << 30, "max_len"),
    ],
)
def test_bad_input_is_a_clear_error(lengths, max_len, needle):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        assign_bins(lengths, max_len)


def test_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match="'nope'"):
        assign_bins([1, 2], 8, strategy="nope")
    with pytest.raises(ValueError, match="group_size"):
        assign_bins([1, 2], 8, strategy="minibatch", group_size=0)
    with pytest.raises(ValueError, match="seed"):
        assign_bins([1, 2], 8, seed=-1)
    with pytest.raises(ValueError, match="max_len"):
        assign_bins([], 0)


def test_plan_errors_are_user_errors():
    # CLIs turn UserError into one line without a traceback
    with pytest.raises(UserError):
        assign_bins([0], 8)
    assert issubclass(PlanError, ValueError)


def test_bin_loads():
    assert bin_loads(np.array([1, 0, 1]), np.array([2, 3, 4])).tolist() == [3, 6]
    assert bin_loads(np.array([], np.int64), np.array([], np.int64)).tolist() == []
    with pytest.raises(ValueError, match="shape"):
        bin_loads(np.array([0, 1]), np.array([1]))
