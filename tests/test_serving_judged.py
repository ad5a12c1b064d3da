"""The judged online check end to end: a damaged canary is failed on its judged win rate.

Real: the router (shadowing every answered request to the other arm, after the user's answer),
two transformers engine servers (stable on SmolLM2-135M, canary on a copy whose matrices drown in
noise), the broker, `OnlineMetrics` pairing the served and shadow responses, `PairJudge` and
`Evaluator.score_sets` (rubric ladder, verifier prompts, aggregation), the controller and the gate.

Stand-in: the judge's engine. The only judge available offline, SmolLM2-135M, prefers the damaged
model's word salad to SmolLM2's own answers (measured on the six prompts below with the generic
rubric: 0.35-0.44 against 0.30-0.36, 6 of 6 pairs, in either order) and takes ~45 s a set on a
loaded 2-core CI machine. So the judge's engine here writes no rubric (the evaluator falls back to
the generic one) and answers each verifier prompt from the prompt's checkable answer, the knowledge
a capable judge has. What this test shows is the path from live traffic to a rollback; how well a
real judge judges is the evaluator's business (benchmarks/judge.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from dynrubric.config import GateConfig, RolloutConfig, RubricConfig
from dynrubric.engines.base import Completion, Engine, GenerationRequest
from dynrubric.engines.hf import TransformersEngine
from dynrubric.rubric.evaluator import Evaluator
from dynrubric.rubric.verify import CRITERION_MARK
from serving.judged import PairJudge
from serving.users import SimulatedUsers
from tests.serving_harness import SIGNAL_PROMPTS, damage, drive, signal_prompts, start_stack, stop_stack

ANSWER_OF = {text: word for _, text, word in SIGNAL_PROMPTS}
# feedback is noise (thumbs at random, no regenerates) and the margins cannot be shown, so the primary
# check stays inconclusive and no guardrail has the data to decide: only the judged check can end the step
GATE = GateConfig(min_users_per_arm=3, min_requests_per_arm=5, min_rated_per_arm=5, positive_rate_margin=0.01,
                  regenerate_rate_margin=0.01, mixture_tau=0.3, error_rate_margin=0.2, latency_p95_margin=3.0,
                  judge_alpha=0.05, judge_tau=0.25)


class AnswerKeyJudge(Engine):
    """The judge's engine stand-in (see the module docstring): a real tokenizer, verdicts from the answer key."""

    def __init__(self, inner: Engine):
        self.inner = inner
        self.policy_version = inner.policy_version

    @property
    def tokenizer(self):
        return self.inner.tokenizer

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Completion]]:
        return [[Completion("", (), "stop")] for _ in requests]  # no rubric: the evaluator's generic one

    def score_next_token(self, prompts, candidates):
        out = []
        for p in prompts:
            question = p.split("Question:\n", 1)[1].split("\n\nResponse:\n", 1)[0]
            response, criterion = p.split("\n\nResponse:\n", 1)[1].split(CRITERION_MARK, 1)
            right = ANSWER_OF[question] in response.lower()
            yes = right != ("irrelevant" in criterion)  # the generic rubric's one negative item
            out.append({c: math.log(0.9 if (c.strip().lower() == "yes") == yes else 0.1) for c in candidates})
        return out

    def load_weights(self, path, version):
        raise NotImplementedError


@pytest.mark.slow
def test_damaged_canary_is_failed_by_the_judged_check(kafka_broker, smollm_dir, tiny_model_dir, tmp_path):
    stack = start_stack(tmp_path, kafka_broker, smollm_dir, "transformers", shadow_rate=1.0)
    try:
        stack.registry.register(damage(smollm_dir, tmp_path / "damaged"), "v0", 1, {}, version="v-bad")
        metrics = CollectorRegistry()
        with TransformersEngine(tiny_model_dir) as tokenizer_engine:
            judge_engine = AnswerKeyJudge(tokenizer_engine)
            judge = PairJudge(Evaluator(judge_engine, judge_engine, RubricConfig(retries=0, prompt_only_retries=0)),
                              eps=0.02)
            controller = stack.controller(RolloutConfig(steps=[0.5], poll_interval_s=0.5, max_step_s=600, judge=True,
                                                        judge_pairs_per_poll=8), GATE, judge=judge, metrics=metrics)
            rollout = controller.start("v-bad")
            users = SimulatedUsers(stack.router_url, signal_prompts(), n_users=16, noise=0.5, rated_share=1.0,
                                   regenerate_p=0.0, max_tokens=16, seed=7)
            done = drive(stack, controller, rollout.id, users, batch=4, timeout_s=600)
        final = done["rollout"]
        print(f"\n{final.id}: {final.status}: {final.reason}")
        assert final.status == "rolled_back"
        assert final.reason.startswith("gate failed at step 0: judged_win_rate: the rubric judge prefers stable")
        judged = next(c for c in final.last_gate["checks"] if c["name"] == "judged_win_rate")["numbers"]
        assert f"canary win rate {judged['win_rate']:.2f} over {judged['pairs']} pairs" in final.reason
        assert judged["upper"] < judged["bar"] and final.last_gate["experiment_id"] == rollout.id
        exported = generate_latest(metrics).decode()
        assert f'dynrubric_rollout_judge_win_rate{{bound="upper"}} {judged["upper"]}' in exported
        router_metrics = httpx.get(f"{stack.router_url}/metrics").text
        assert 'dynrubric_router_shadow_requests_total{outcome="sent"}' in router_metrics
    finally:
        stop_stack(stack)
