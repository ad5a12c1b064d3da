"""The judged online check's judge: each shadow pair is decided by ground truth where it has one, else by the rubric
evaluator.

A pair is the served response and the shadow response from the other arm to the same prompt. Where the prompt
states a ground truth (dynrubric/rubric/groundtruth.py: official IFEval instructions, a computed answer), the
pair is decided by it, exactly as users' feedback and the evaluation of versions check it: 1 when only the
canary passes, 0 when only stable does, 1/2 when both or neither do; no model runs. The other pairs go to
`Evaluator.score_sets` as one set each, so the rubric is conditioned on the two answers it must separate:
1 when the canary's response scores higher by more than the rubric's tie threshold (`rubric.eps`), 0 when
lower, 1/2 for a tie. The gate's sequential test runs on the mean (`serving.gate.JudgeStats`). The two
responses are shown to the judge in a random order per pair, so a judge with a position bias adds noise,
not bias.

The evaluator's engines may run on a server that another process also reloads (in `up`, the rounds' own vLLM
server, which the trainer reloads with the policy's and the generator's weights while a round runs and leaves
idle while a rollout runs): such servers are `shared_servers`, forgotten before every batch the model judges,
so the judge's engines reload their own weights first (engines/http.py: SharedServer).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dynrubric.rubric.groundtruth import derive
from serving.online import ShadowPair

if TYPE_CHECKING:
    from dynrubric.engines.http import SharedServer


class PairJudge:
    def __init__(
        self,
        evaluator: Any,
        eps: float,
        seed: int = 0,
        ground_truth: bool = True,
        shared_servers: Sequence[SharedServer] = (),
    ):
        self.evaluator = evaluator
        self.eps = eps
        self.ground_truth = ground_truth
        self.shared_servers = list(shared_servers)
        self._rng = random.Random(seed)

    def score(self, pairs: list[ShadowPair]) -> list[float]:
        """The canary's score (1, 1/2 or 0) for each pair."""
        out: list[float | None] = [self._by_ground_truth(p) if self.ground_truth else None for p in pairs]
        rest = [i for i, verdict in enumerate(out) if verdict is None]
        if rest:
            for server in self.shared_servers:  # another process may have reloaded it since the last batch
                server.forget()
            canary_first = [self._rng.random() < 0.5 for _ in rest]
            sets = [
                [pairs[i].canary, pairs[i].stable] if first else [pairs[i].stable, pairs[i].canary]
                for i, first in zip(rest, canary_first, strict=True)
            ]
            scored = self.evaluator.score_sets([pairs[i].prompt for i in rest], sets)
            for i, s, first in zip(rest, scored, canary_first, strict=True):
                canary, stable = (s.scores[0], s.scores[1]) if first else (s.scores[1], s.scores[0])
                out[i] = 1.0 if canary > stable + self.eps else 0.0 if canary < stable - self.eps else 0.5
        return [float(v) for v in out if v is not None]

    @staticmethod
    def _by_ground_truth(pair: ShadowPair) -> float | None:
        """The pair's verdict by the prompt's ground truth, or None when the prompt states none."""
        truth = derive(pair.prompt)
        if truth.empty:
            return None
        canary, stable = truth.passes(pair.canary), truth.passes(pair.stable)
        return 0.5 if canary == stable else 1.0 if canary else 0.0
