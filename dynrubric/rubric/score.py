"""Aggregation: one score per response from the item verdicts, `E(y|C) = sum w z / sum w`."""

from __future__ import annotations

import math
from collections.abc import Sequence

from dynrubric.rubric.items import Rubric


def aggregate(verdicts: Sequence[Sequence[float]], rubric: Rubric) -> list[float]:
    """K scores in [0, 1] from M x K raw P(yes) verdicts; `z = v` for polarity +1, `1 - v` for -1.

    A verdict that is not a finite number in [0, 1] counts as 0.5 (no information), so a score is
    never NaN whatever the verifier returned.
    """
    if len(verdicts) != len(rubric.items):
        raise ValueError(f"{len(verdicts)} verdict rows for {len(rubric.items)} rubric items")
    if not verdicts:
        return []
    k = len(verdicts[0])
    total_weight = float(sum(rubric.weights))
    scores = []
    for j in range(k):
        acc = 0.0
        for item, row in zip(rubric.items, verdicts, strict=True):
            v = row[j]
            v = min(1.0, max(0.0, v)) if isinstance(v, (int, float)) and math.isfinite(v) else 0.5
            acc += item.weight * (v if item.polarity == 1 else 1.0 - v)
        scores.append(min(1.0, max(0.0, acc / total_weight)))
    return scores
