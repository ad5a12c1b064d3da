"""The round's guard (train/guards.py, train/rounds.py `check_guards`): the dev split's ground truth decides first,
the KL bounds are a trust region that decides only what ground truth cannot tell, and the reported test figures
never change a verdict."""

from __future__ import annotations

from typing import Any

from dynrubric.config import TrainConfig
from dynrubric.train import guards
from dynrubric.train.records import Comparison, Figure, TruthEvidence
from dynrubric.train.rounds import check_guards
from tests.run_records import evaluation, truth

SAFE_KL = 0.45  # the demo profile's trust region (dynrubric/profiles/demo.yaml cites its measurement)


def bounds(**fields: Any) -> dict[str, Any]:
    return {
        "nonfinite_steps": [],
        "kl": 0.1,
        "max_kl": SAFE_KL,
        "kl_to_base": 0.1,
        "max_kl_to_base": SAFE_KL,
        "reward_parent": 0.5,
        "reward_new": 0.5,
        "max_reward_drop": 0.05,
        **fields,
    }


BETTER = {"delta": 0.165, "low": 0.085, "high": 0.245, "prompts": 200}  # issue 38's fresh-clone round 1
WORSE = {"delta": -0.1, "low": -0.16, "high": -0.04, "prompts": 200}
UNSURE = {"delta": 0.03, "low": -0.02, "high": 0.08, "prompts": 200}


def test_better_on_dev_inside_the_safe_kl_is_accepted_and_says_ground_truth_decided() -> None:
    verdict = guards.check(**bounds(kl=0.30141, kl_to_base=0.30141), groundtruth_vs_parent=BETTER)
    assert verdict.accepted, verdict
    assert "dev ground truth decided" in verdict.detail and "+0.165 (95% CI +0.085..+0.245)" in verdict.detail
    assert "0.30141" in verdict.detail
    # the round the old demo bound (0.3) rejected by chance: ground truth is read before the KL
    at_old_bound = guards.check(**bounds(kl=0.30141, max_kl=0.3), groundtruth_vs_parent=BETTER)
    assert at_old_bound.accepted and "beyond the trust region" in at_old_bound.detail


def test_worse_on_dev_is_rejected_whatever_the_kl() -> None:
    for kl in (1e-6, 0.01, 0.3, 5.0):
        verdict = guards.check(**bounds(kl=kl, kl_to_base=kl, max_kl_to_base=10.0), groundtruth_vs_parent=WORSE)
        assert verdict.reason == "heldout_regression", (kl, verdict)
        assert "-0.100 (95% CI -0.160..-0.040)" in verdict.detail and "whatever the KL" in verdict.detail


def test_a_ci_that_ends_at_zero_around_a_loss_is_worse_and_one_around_a_gain_is_not_better() -> None:
    # second_round's `centred` round 2, seed 0: accepted before, though no resample showed it better
    at_zero = {"delta": -0.1, "low": -0.225, "high": 0.0, "prompts": 200}
    verdict = guards.check(**bounds(), groundtruth_vs_parent=at_zero)
    assert verdict.reason == "heldout_regression" and "-0.100 (95% CI -0.225..+0.000)" in verdict.detail
    kind = guards.check(
        **bounds(), groundtruth_vs_parent=UNSURE, groundtruth_by_kind={"arithmetic": {**at_zero, "prompts": 30}}
    )
    assert kind.reason == "kind_regression", kind
    tied = {"delta": 0.0, "low": 0.0, "high": 0.0, "prompts": 200}  # every prompt the same: neither worse nor better
    assert guards.check(**bounds(), groundtruth_vs_parent=tied).accepted
    gain = {"delta": 0.1, "low": 0.0, "high": 0.225, "prompts": 200}  # not shown better: the trust region still decides
    assert guards.check(**bounds(kl=0.6), groundtruth_vs_parent=gain).reason == "kl"


def test_a_dev_evaluation_of_too_few_prompts_decides_nothing() -> None:
    # the e2e test's 16 dev prompts: one lost, none won, so no resample shows a gain (stop 47's CI failure)
    one_lost = {"delta": -0.0625, "low": -0.1875, "high": 0.0, "prompts": 16}
    verdict = guards.check(**bounds(), groundtruth_vs_parent=one_lost)
    assert verdict.accepted and "over 16 prompts (under 20: not decided on)" in verdict.detail, verdict
    assert "within the trust region" in verdict.detail
    assert guards.check(**bounds(), groundtruth_vs_parent=one_lost, min_decided_prompts=16).reason == (
        "heldout_regression"
    )
    # nor does a gain accept past the trust region
    gained = {"delta": 0.25, "low": 0.0625, "high": 0.4375, "prompts": 16}
    assert guards.check(**bounds(kl=0.6), groundtruth_vs_parent=gained).reason == "kl"


def test_beyond_the_trust_region_without_a_dev_gain_is_rejected_with_the_reason() -> None:
    verdict = guards.check(**bounds(kl=0.6), groundtruth_vs_parent=UNSURE)
    assert verdict.reason == "kl"
    assert "not shown better" in verdict.detail and f"> trust region {SAFE_KL}" in verdict.detail
    drift = guards.check(**bounds(kl_to_base=0.6), groundtruth_vs_parent=UNSURE)
    assert drift.reason == "kl_to_base" and "0.60000" in drift.detail
    inside = guards.check(**bounds(kl=0.2), groundtruth_vs_parent=UNSURE)
    assert inside.accepted and "within the trust region" in inside.detail


def test_the_nonfinite_guard_comes_first() -> None:
    verdict = guards.check(**bounds(nonfinite_steps=[3]), groundtruth_vs_parent=BETTER)
    assert verdict.reason == "nonfinite"
    assert guards.check(**bounds(kl=float("nan")), groundtruth_vs_parent=BETTER).reason == "kl"


def comparison(delta: float, low: float, high: float, prompts: int = 200) -> Comparison:
    return Comparison(version="r1", reference="base", prompts=prompts, delta=delta, low=low, high=high)


def test_the_reported_test_figures_never_change_a_verdict() -> None:
    """For every kind of verdict (better, worse, unsure inside / beyond the trust region, a kind worse), the
    same evidence with the five reported figures far worse, far better or absent gets the same verdict."""
    cases: list[tuple[TruthEvidence, float]] = [
        (truth().model_copy(update={"vs_parent": comparison(**BETTER)}), 0.3),
        (truth().model_copy(update={"vs_parent": comparison(**WORSE)}), 0.001),
        (truth().model_copy(update={"vs_parent": comparison(**UNSURE)}), 0.2),
        (truth().model_copy(update={"vs_parent": comparison(**UNSURE)}), 0.9),
        (
            truth().model_copy(
                update={
                    "vs_parent": comparison(**BETTER),
                    "vs_parent_by_kind": {"arithmetic": comparison(-0.2, -0.33, -0.07, prompts=30)},
                }
            ),
            0.1,
        ),
    ]
    cfg = TrainConfig(max_kl=SAFE_KL, max_kl_to_base=SAFE_KL)
    seen = set()
    for evidence, kl in cases:
        verdicts = []
        for delta in (-0.5, 0.0, 0.5):
            c = comparison(delta, delta - 0.1, delta + 0.1)
            figs = {
                name: Figure(prompts=100, score={"r1": 0.5 + delta, "base": 0.5}, vs_parent=c, vs_base=c)
                for name in ("test_seen", "test_unseen", "ifeval", "ifbench", "open")
            }
            for figures in (figs, {}):
                e = evaluation(groundtruth=evidence.model_copy(update={"figures": figures}), kl_to_parent=kl)
                verdicts.append(check_guards(cfg, e, [], truth_guard=True))
        assert len(set(verdicts)) == 1, verdicts
        seen.add(verdicts[0].reason)
    assert seen == {None, "heldout_regression", "kl", "kind_regression"}
