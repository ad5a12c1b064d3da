"""Aggregation with polarity, per-set gap diagnostics and the rolling collapse detector."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynrubric.rubric.gaps import CollapseDetector, gap_stats
from dynrubric.rubric.items import Rubric, RubricItem
from dynrubric.rubric.score import aggregate


def rubric(*spec: tuple[int, int]) -> Rubric:
    return Rubric(
        items=[RubricItem(id=f"i{n}", text=f"item {n}", weight=w, polarity=p) for n, (w, p) in enumerate(spec)]
    )


def test_weighted_mean_with_negative_polarity():
    r = rubric((3, 1), (1, -1))
    verdicts = [[1.0, 0.0, 0.5], [1.0, 0.0, 0.5]]  # item x response, raw P(yes)
    assert aggregate(verdicts, r) == pytest.approx([(3 * 1 + 1 * 0) / 4, (0 + 1) / 4, (1.5 + 0.5) / 4])


def test_non_finite_verdicts_count_as_uninformative_never_nan():
    r = rubric((1, 1), (1, 1))
    scores = aggregate([[math.nan, 1.0], [math.inf, -3.0]], r)
    assert scores == pytest.approx([0.5, 0.5])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 5), st.sampled_from([1, -1])), min_size=2, max_size=12),
    st.integers(1, 8),
    st.data(),
)
def test_scores_always_in_unit_interval(spec, k, data):
    r = rubric(*spec)
    v = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 1))
    verdicts = [data.draw(st.lists(v, min_size=k, max_size=k)) for _ in spec]
    scores = aggregate(verdicts, r)
    assert len(scores) == k and all(0.0 <= s <= 1.0 for s in scores)
    stats = gap_stats([[x if math.isfinite(x) else 0.5 for x in row] for row in verdicts], r, scores, 0.02)
    assert all(
        math.isfinite(x) for x in (stats.mean_abs_gap, stats.spread, stats.std, stats.tie_rate, stats.nonsplit_share)
    )


def test_gap_stats_by_hand():
    r = rubric((1, 1), (1, 1), (1, -1))
    verdicts = [
        [0.9, 0.1, 0.9, 0.1],  # splits
        [0.6, 0.6, 0.6, 0.6],  # all Yes: splits nobody
        [0.51, 0.49, 0.5, 0.5],  # opposite sides of 0.5 but closer than eps: splits nobody
    ]
    scores = [0.4, 0.2, 0.4, 0.1]
    s = gap_stats(verdicts, r, scores, eps=0.05)
    gaps = [0.2, 0.0, 0.3, 0.2, 0.1, 0.3]
    assert s.mean_abs_gap == pytest.approx(sum(gaps) / 6)
    assert s.spread == pytest.approx(0.3)
    assert s.std == pytest.approx(math.sqrt(sum((x - 0.275) ** 2 for x in scores) / 4))
    assert s.tie_rate == pytest.approx(1 / 6)
    assert s.item_split == pytest.approx([0.25, 0.24, 0.25])
    assert s.nonsplit_share == pytest.approx(2 / 3)


def test_collapse_needs_a_full_window_and_recovers():
    r = rubric((1, 1), (1, 1))
    flat = gap_stats([[0.7, 0.7], [0.2, 0.2]], r, [0.45, 0.45], eps=0.02)
    lively = gap_stats([[0.9, 0.1], [0.1, 0.9]], r, [0.9, 0.1], eps=0.02)
    d = CollapseDetector(window=3, min_mean_gap=0.05, max_nonsplit_share=0.8)
    assert [d.update(flat), d.update(flat)] == [False, False]  # window not full yet
    assert d.update(flat) and d.collapsed
    assert d.update(lively) is False  # window mean gap 0.27, non-split share 0.67: recovered
    assert not d.collapsed
    d2 = CollapseDetector(window=2, min_mean_gap=0.0, max_nonsplit_share=0.5)
    d2.update(flat)
    assert d2.update(flat)  # fires on the non-split share alone


def test_collapse_detector_rejects_empty_window():
    with pytest.raises(ValueError):
        CollapseDetector(window=0, min_mean_gap=0.1, max_nonsplit_share=0.5)
