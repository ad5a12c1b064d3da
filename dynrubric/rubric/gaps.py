"""Score-gap diagnostics of one candidate set, and the rolling detector of rubric collapse.

A rubric that cannot tell the candidates apart gives GRPO no signal. Per set we measure the score gaps
(mean |S_i - S_j| over pairs, max-min spread, std, share of tied pairs) and, per item, how much it splits
the set: `v_bar (1 - v_bar)` (for 0/1 verdicts, the variance the generator's R_disc rewards) and whether it
splits any pair at all. An item splits a pair when its verdicts fall on opposite sides of 0.5 and differ by at least
`eps`, i.e. a judge forced to answer Yes/No would answer differently for the two responses.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Any

from dynrubric.rubric.items import NON_RANKING_ORIGINS, Rubric


@dataclass(frozen=True)
class GapStats:
    mean_abs_gap: float  # mean |S_i - S_j| over all pairs i < j
    spread: float  # max S - min S
    std: float  # population std of S
    tie_rate: float  # share of pairs with |S_i - S_j| < eps
    item_split: list[float]  # per item v_bar (1 - v_bar), in 0..0.25
    nonsplit_share: float  # share of items that split no pair
    candidates: int = 0  # K, the set's size (a set of one has no gap to measure)

    def as_dict(self) -> dict[str, object]:
        return {
            "mean_abs_gap": self.mean_abs_gap,
            "spread": self.spread,
            "std": self.std,
            "tie_rate": self.tie_rate,
            "item_split": list(self.item_split),
            "nonsplit_share": self.nonsplit_share,
        }


def _splits_a_pair(verdicts: Sequence[float], eps: float) -> bool:
    yes = [v for v in verdicts if v >= 0.5]
    no = [v for v in verdicts if v < 0.5]
    return bool(yes) and bool(no) and max(yes) - min(no) >= eps


def gap_stats(verdicts: Sequence[Sequence[float]], rubric: Rubric, scores: Sequence[float], eps: float) -> GapStats:
    """Diagnostics of one set. `verdicts` is M x K raw P(yes) (polarity not applied; splits do not
    depend on it), `scores` the K aggregated scores. The echo item is a veto that no real answer is meant to
    trip (score.py) and the floor item one that every real answer meets (derived.py), not criteria that should
    split the set: they are left out of the item statistics."""
    if len(verdicts) != len(rubric.items):
        raise ValueError(f"{len(verdicts)} verdict rows for {len(rubric.items)} rubric items")
    verdicts = [row for row, item in zip(verdicts, rubric.items, strict=True) if item.origin not in NON_RANKING_ORIGINS]
    k = len(scores)
    pairs = list(combinations(range(k), 2))
    gaps = [abs(scores[i] - scores[j]) for i, j in pairs]
    mean = sum(scores) / k if k else 0.0
    std = (sum((s - mean) ** 2 for s in scores) / k) ** 0.5 if k else 0.0
    item_split = []
    nonsplit = 0
    for row in verdicts:
        v_bar = sum(row) / len(row) if row else 0.0
        item_split.append(v_bar * (1.0 - v_bar))
        nonsplit += 0 if _splits_a_pair(row, eps) else 1
    return GapStats(
        mean_abs_gap=sum(gaps) / len(gaps) if gaps else 0.0,
        spread=(max(scores) - min(scores)) if k else 0.0,
        std=std,
        tie_rate=sum(g < eps for g in gaps) / len(gaps) if gaps else 1.0,
        item_split=item_split,
        nonsplit_share=nonsplit / len(verdicts) if verdicts else 1.0,
        candidates=k,
    )


class CollapseDetector:
    """Fires while the last `window` sets' mean gap is under `min_mean_gap`, or their mean share of
    non-splitting items is over `max_nonsplit_share`. Needs a full window before it can fire.

    The window counts sets, not calls or rounds: `state()` / `restore()` carry it across training
    rounds (the trainer keeps it in its run dir). A set of fewer than two candidates (a reward-server
    group closed by its timeout with one sample, a retry) has no gap to measure: it is counted in
    `singletons` and leaves the window as it was, instead of reading as a collapsed set."""

    def __init__(self, window: int, min_mean_gap: float, max_nonsplit_share: float):
        if window < 1:
            raise ValueError("collapse window must be at least 1 set")
        self.window = window
        self.min_mean_gap = min_mean_gap
        self.max_nonsplit_share = max_nonsplit_share
        self._recent: deque[tuple[float, float]] = deque(maxlen=window)  # (mean_abs_gap, nonsplit_share)
        self.collapsed = False
        self.singletons = 0

    def update(self, stats: GapStats) -> bool:
        if stats.candidates < 2:
            self.singletons += 1
            return self.collapsed
        self._recent.append((stats.mean_abs_gap, stats.nonsplit_share))
        self._evaluate()
        return self.collapsed

    def _evaluate(self) -> None:
        if len(self._recent) < self.window:
            self.collapsed = False
            return
        n = len(self._recent)
        mean_gap = sum(g for g, _ in self._recent) / n
        nonsplit = sum(s for _, s in self._recent) / n
        self.collapsed = mean_gap < self.min_mean_gap or nonsplit > self.max_nonsplit_share

    def state(self) -> dict[str, object]:
        return {"recent": [list(r) for r in self._recent], "singletons": self.singletons}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from `state()` (a window saved with another size keeps its newest sets)."""
        self._recent.clear()
        self._recent.extend((float(g), float(s)) for g, s in state.get("recent", []))
        self.singletons = int(state.get("singletons", 0))
        self._evaluate()
