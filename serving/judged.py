"""The judged online check's judge: the rubric evaluator scores each shadow pair as one candidate set.

A pair is the served response and the shadow response from the other arm to the same prompt. Both
go to `Evaluator.score_sets` as one set, so the rubric is conditioned on the two answers it must
separate. The canary's score for the pair is 1 when its response scores higher by more than the
rubric's tie threshold (`rubric.eps`), 0 when lower, 1/2 for a tie; the gate's sequential test
runs on the mean (`serving.gate.JudgeStats`). The two responses are shown in a random order per
pair, so a judge with a position bias adds noise, not bias.
"""

from __future__ import annotations

import random
from typing import Any

from serving.online import ShadowPair


class PairJudge:
    def __init__(self, evaluator: Any, eps: float, seed: int = 0):
        self.evaluator = evaluator
        self.eps = eps
        self._rng = random.Random(seed)

    def score(self, pairs: list[ShadowPair]) -> list[float]:
        """The canary's score (1, 1/2 or 0) for each pair."""
        if not pairs:
            return []
        canary_first = [self._rng.random() < 0.5 for _ in pairs]
        sets = [[p.canary, p.stable] if first else [p.stable, p.canary] for p, first in zip(pairs, canary_first)]
        scored = self.evaluator.score_sets([p.prompt for p in pairs], sets)
        out = []
        for s, first in zip(scored, canary_first):
            canary, stable = (s.scores[0], s.scores[1]) if first else (s.scores[1], s.scores[0])
            out.append(1.0 if canary > stable + self.eps else 0.0 if canary < stable - self.eps else 0.5)
        return out
