"""The judged online check end to end: a damaged canary is failed on its judged win rate.

Real, all of it: the router (shadowing every answered request to the other arm, after the user's
answer), two transformers engine servers (stable on SmolLM2-135M, canary on a copy whose matrices
drown in noise), the broker, `OnlineMetrics` pairing the served and shadow responses, `PairJudge`,
and the judge itself: `Evaluator.score_sets` on SmolLM2-135M with the calibration answers and the
items the evaluator derives from the question (rubric/derived.py: "What is 7 + 5?" gives a
final-number item worth 5, decided by a deterministic check), then the controller and the gate.

What this judge can and cannot do, measured: on its own, SmolLM2-135M prefers the damaged model's
word salad to its own answers (generic rubric, six prompts, 6 of 6 pairs in either order); the
derived answer item is what lets it judge, so the users ask the two questions whose answer the
evaluator derives and SmolLM2 gets right at temperature 0 ("7 + 5 = 12.", "... is 4."), and the
judge prefers stable on every pair. The rubric is a generic one (`mode: generic`, two of the default
items): SmolLM2's set-conditioned rubric did not parse within 128 tokens (the ladder fell back to the
generic rubric anyway) at ~30 s a set on a loaded 2-core machine, against ~5 s a set without it. How
well a judge judges open questions is the evaluator's business (benchmarks/judge.py).
"""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from dynrubric.config import GateConfig, RolloutConfig, RubricConfig
from dynrubric.engines.hf import TransformersEngine
from dynrubric.rubric.derived import prompt_items
from dynrubric.rubric.evaluator import Evaluator
from serving.judged import PairJudge
from serving.users import SimulatedUsers
from tests.serving_harness import damage, drive, signal_prompts, start_stack, stop_stack

# feedback is noise (thumbs at random, no regenerates) and the margins cannot be shown, so the primary
# check stays inconclusive and no guardrail has the data to decide: only the judged check can end the step
GATE = GateConfig(
    min_users_per_arm=3,
    min_requests_per_arm=5,
    min_rated_per_arm=5,
    positive_rate_margin=0.01,
    regenerate_rate_margin=0.01,
    mixture_tau=0.3,
    error_rate_margin=0.2,
    latency_p95_margin=3.0,
    judge_alpha=0.05,
    judge_tau=0.25,
)
ANSWERED = ("add-7-5", "add-2-2")  # SmolLM2-135M answers them right at temperature 0


@pytest.mark.slow
def test_damaged_canary_is_failed_by_the_judged_check(kafka_broker, smollm_dir, tmp_path):
    stack = start_stack(tmp_path, kafka_broker, smollm_dir, "transformers", shadow_rate=1.0)
    try:
        stack.registry.register(damage(smollm_dir, tmp_path / "damaged"), "v0", 1, {}, version="v-bad")
        metrics = CollectorRegistry()
        prompts = [p for p in signal_prompts() if p.id in ANSWERED]
        assert all(
            any(i.check and i.check.kind == "final_number" for i in prompt_items(p.messages[-1].content))
            for p in prompts
        )  # the evaluator derives each one's answer
        with TransformersEngine(smollm_dir) as judge_engine:
            # the default anchors and derived items; of the generic rubric, the two items a word salad fails most
            # plainly (each verifier item costs 5 forward passes a pair: 2 answers and 3 anchors)
            rubric = RubricConfig(
                mode="generic",
                generic_rubric=[
                    item
                    for item in RubricConfig().generic_rubric
                    if item.text.startswith(("The response directly", "The response contains"))
                ],
            )
            assert len(rubric.generic_rubric) == 2
            judge = PairJudge(Evaluator(judge_engine, judge_engine, rubric), eps=rubric.eps)
            controller = stack.controller(
                RolloutConfig(steps=[0.5], poll_interval_s=0.5, max_step_s=600, judge=True, judge_pairs_per_poll=8),
                GATE,
                judge=judge,
                metrics=metrics,
            )
            rollout = controller.start("v-bad")
            users = SimulatedUsers(
                stack.router_url,
                prompts,
                n_users=16,
                noise=0.5,
                rated_share=1.0,
                regenerate_p=0.0,
                max_tokens=16,
                seed=7,
            )
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
