"""Aggregation: one score per response from the item verdicts, `E(y|C) = veto(y) * sum w' z / sum w'`.

The weights `w'` are the items' own weights `w`, rebalanced by `item_weights` so that an item a calibration answer
overruled counts for nothing and the prompt's ground truth counts for a fixed share:

    w'_m = 0                              m overruled (a calibration answer beat a real candidate on it)
    w'_m = s * w_m / sum_{G} w            m in G, the ground-truth items (the prompt's own constraints,
                                          checked: derived.py), s = rubric.ground_truth_share
    w'_m = (1 - s) * w_m / sum_{J} w      m in J, every other item that stands (generated, consensus, the
                                          floor item "says something", derived.py)

When G or J is empty the other keeps its plain weights (`w' = w`): a prompt without ground truth is
scored as `sum w z / sum w`, the DynamicRubric score. With both present, a response that meets the
prompt's constraints outranks one that misses them unless the rest of the rubric disagrees by more than
`s / (1 - s)` times as much: what the prompt asks for explicitly is not outvoted by what a generated
rubric guesses it wants.

The echo item ("only repeats the question", derived.py) is a veto, not a weight: `veto(y) = 1 - v_echo(y)`,
so a response that merely repeats the question scores 0 however many of the question's keywords and
limits that copy meets. As a weighted item it could only lower an echo's share of J, and an echo that
meets a keyword constraint would still outrank a real answer that misses it: the cheapest reward hack.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dynrubric.rubric.items import Rubric


def item_weights(rubric: Rubric, overruled: Sequence[bool], ground_truth_share: float) -> list[float]:
    """The weights `w'` the score uses (module docstring); 0 for the echo veto and for overruled items."""
    truth = [i.origin == "ground_truth" and not o for i, o in zip(rubric.items, overruled, strict=True)]
    rest = [i.origin not in ("ground_truth", "echo") and not o for i, o in zip(rubric.items, overruled, strict=True)]
    w_truth = sum(i.weight for i, t in zip(rubric.items, truth, strict=True) if t)
    w_rest = sum(i.weight for i, r in zip(rubric.items, rest, strict=True) if r)
    if not w_truth or not w_rest:
        return [float(i.weight) if t or r else 0.0 for i, t, r in zip(rubric.items, truth, rest, strict=True)]
    s = ground_truth_share
    return [
        s * i.weight / w_truth if t else (1.0 - s) * i.weight / w_rest if r else 0.0
        for i, t, r in zip(rubric.items, truth, rest, strict=True)
    ]


def aggregate(
    verdicts: Sequence[Sequence[float]], rubric: Rubric, weights: Sequence[float] | None = None
) -> list[float]:
    """K scores in [0, 1] from M x K raw P(yes) verdicts; `z = v` for polarity +1, `1 - v` for -1, weighted by
    `weights` (default: the items' own weights), times the echo veto (module docstring).

    A verdict that is not a finite number in [0, 1] counts as 0.5 (no information), so a score is
    never NaN whatever the verifier returned; with no weight left every score is 0.
    """
    if len(verdicts) != len(rubric.items):
        raise ValueError(f"{len(verdicts)} verdict rows for {len(rubric.items)} rubric items")
    if not verdicts:
        return []
    weights = [
        0.0 if i.origin == "echo" else float(w)
        for i, w in zip(rubric.items, rubric.weights if weights is None else weights, strict=True)
    ]
    k = len(verdicts[0])
    total_weight = sum(weights)
    scores = []
    for j in range(k):
        acc, veto = 0.0, 1.0
        for item, w, row in zip(rubric.items, weights, verdicts, strict=True):
            v = row[j]
            v = min(1.0, max(0.0, v)) if isinstance(v, (int, float)) and math.isfinite(v) else 0.5
            z = v if item.polarity == 1 else 1.0 - v
            if item.origin == "echo":
                veto *= z
            else:
                acc += w * z
        scores.append(min(1.0, max(0.0, veto * acc / total_weight)) if total_weight > 0 else 0.0)
    return scores
