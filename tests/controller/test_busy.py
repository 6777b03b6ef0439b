"""The busy / idle arithmetic of `miles_like.run.busy` against brute-force references: unions of
intervals measured on an integer grid, the tail read off sorted completion times by counting,
occupancy in closed form."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from miles_like.run.busy import (
    Span,
    occupancy,
    rollout_metrics,
    step_metrics,
    tail_seconds,
    union_seconds,
)
from rollout.activity import ForwardPass

GRID = 60
spans = st.lists(
    st.tuples(st.integers(0, GRID), st.integers(0, GRID)).map(lambda t: Span(min(t), max(t))),
    max_size=12,
)


def covered_cells(intervals, lo: int, hi: int) -> int:
    """Unit cells [c, c + 1) inside [lo, hi) that some interval covers (integer endpoints)."""
    return sum(any(s <= c and c + 1 <= e for s, e in intervals) for c in range(lo, hi))


@given(spans, st.integers(0, GRID), st.integers(0, GRID))
def test_union_equals_the_covered_grid(intervals, a, b):
    lo, hi = min(a, b), max(a, b)
    assert union_seconds(intervals, Span(lo, hi)) == covered_cells(intervals, lo, hi)


@given(st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=120))
def test_tail_starts_when_ninety_percent_are_done(times):
    # brute force: the first completion time at which at least 90% of the samples are done
    start = min(x for x in times if 10 * sum(t <= x for t in times) >= 9 * len(times))
    assert tail_seconds(times) == max(times) - start


def test_tail_of_ten_samples_is_the_last_gap():
    assert tail_seconds([float(t) for t in range(10)]) == 1.0  # 9 of 10 done at t=8
    assert tail_seconds([0.0] * 9 + [5.0]) == 5.0
    assert tail_seconds([]) == 0.0


def test_occupancy_is_time_weighted_over_the_peak():
    # 3 s at 8 sequences, 1 s at 2: (24 + 2) / 4 / 8
    fs = [ForwardPass(0, 3, 8, 0), ForwardPass(3, 4, 2, 0)]
    assert occupancy(fs) == 26 / 4 / 8
    assert occupancy([]) == 0.0


def test_rollout_and_step_fractions():
    # engine 0 busy [0, 4) of the window [0, 10), engine 1 busy [2, 3); 10 samples, the last
    # finishing at 8 while 9 were done by 3
    e0 = [ForwardPass(0, 2, 4, 5), ForwardPass(2, 3, 4, 4), ForwardPass(3, 4, 1, 0)]
    e1 = [ForwardPass(2, 3, 2, 0), ForwardPass(7, 8, 1, 1)]
    m = rollout_metrics([e0, e1], Span(0, 10))
    assert m["engine_busy_frac"] == (0.4 + 0.2) / 2 and m["engine_busy_frac_min"] == 0.2
    assert m["rollout_tail_s"] == 5.0 and m["rollout_tail_frac"] == 5.0 / 8.0
    assert m["engine_occupancy"] == ((2 * 4 + 4 + 1) / 4 / 4 + (2 + 1) / 2 / 2) / 2
    # trainer ranks busy [5, 7) and [5, 6): the devices are idle in [4, 5) and [8, 10)
    s = step_metrics([e0, e1], [[Span(5, 7)], [Span(5, 6)]], Span(0, 10))
    assert s["trainer_busy_frac"] == (0.2 + 0.1) / 2
    assert s["device_idle_frac"] == pytest.approx(0.3, abs=1e-12)
