"""The round's guard (train/guards.py, train/rounds.py `check_guards`): the dev split's ground truth decides first,
the KL bounds are a trust region that decides only what ground truth cannot tell, and the reported test figures
never change a verdict."""

from __future__ import annotations

from typing import Any

from dynrubric.config import TrainConfig
from dynrubric.train import guards
from dynrubric.train.policy_eval import VersionOutcomes, compare
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


def test_without_counts_a_ci_that_ends_at_zero_around_a_loss_is_worse_and_one_around_a_gain_is_not_better() -> None:
    # a record written before wins and losses were counted: the CI decides. second_round's `centred` round 2, seed 0
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


# learning.py --cycles 4, seed 1, round 3 against r1 (docs/benchmarks.md): better in total on dev and on the test
# split's unseen types, rejected by the CI rule over 2 arithmetic prompts lost and none won
SEED1_R3_TOTAL = {"delta": 0.065, "low": 0.005, "high": 0.125, "prompts": 200, "wins": 25, "losses": 12}
SEED1_R3_ARITHMETIC = {"delta": -0.067, "low": -0.167, "high": 0.0, "prompts": 30, "wins": 0, "losses": 2}
SEED1_R3_INSTRUCTION = {"delta": 0.088, "low": 0.035, "high": 0.141, "prompts": 170, "wins": 25, "losses": 10}


def test_a_kind_lost_on_two_prompts_and_won_on_none_does_not_reject_a_round_dev_calls_better() -> None:
    kinds = {"arithmetic": SEED1_R3_ARITHMETIC, "instruction": SEED1_R3_INSTRUCTION}
    verdict = guards.check(**bounds(), groundtruth_vs_parent=SEED1_R3_TOTAL, groundtruth_by_kind=kinds)
    assert verdict.accepted, verdict
    assert "better than the parent, +0.065 (95% CI +0.005..+0.125)" in verdict.detail
    # shown with its counts, not decided on
    assert "arithmetic -0.067 (95% CI -0.167..+0.000) over 30 (2 lost, 0 won; sign test p 0.250)" in verdict.detail
    # the same CIs without the counts: the CI rule, which rejected it
    no_counts = {k: {f: v for f, v in c.items() if f not in ("wins", "losses")} for k, c in kinds.items()}
    assert guards.check(**bounds(), groundtruth_vs_parent=SEED1_R3_TOTAL, groundtruth_by_kind=no_counts).reason == (
        "kind_regression"
    )


def test_a_kind_lost_significantly_by_the_sign_test_rejects_whatever_the_total() -> None:
    six_lost = {"delta": -0.2, "low": -0.333, "high": -0.067, "prompts": 30, "wins": 0, "losses": 6}
    verdict = guards.check(
        **bounds(), groundtruth_vs_parent=SEED1_R3_TOTAL, groundtruth_by_kind={"arithmetic": six_lost}
    )
    assert verdict.reason == "kind_regression", verdict
    assert "6 lost, 0 won; sign test p 0.016" in verdict.detail and "whatever the total (+0.065" in verdict.detail
    # 6 lost and 1 won: p 0.0625 > 0.025, not shown worse at 95%; at 80% (one-sided 0.1) it is
    one_won = {**six_lost, "delta": -0.167, "wins": 1}
    assert guards.check(**bounds(), groundtruth_vs_parent=UNSURE, groundtruth_by_kind={"arithmetic": one_won}).accepted
    assert (
        guards.check(
            **bounds(), groundtruth_vs_parent=UNSURE, groundtruth_by_kind={"arithmetic": one_won}, confidence=0.8
        ).reason
        == "kind_regression"
    )
    # in total too
    total = {"delta": -0.1, "low": -0.16, "high": -0.04, "prompts": 200, "wins": 10, "losses": 30}
    verdict = guards.check(**bounds(), groundtruth_vs_parent=total)
    assert verdict.reason == "heldout_regression" and "30 lost, 10 won; sign test p 0.001" in verdict.detail


def test_sign_test_p_is_the_binomial_tail() -> None:
    assert guards.sign_test_p(2, 0) == 0.25
    assert guards.sign_test_p(6, 0) == 1 / 64
    assert guards.sign_test_p(6, 1) == 8 / 128
    assert guards.sign_test_p(0, 5) == 1.0 and guards.sign_test_p(0, 0) == 1.0


def test_compare_counts_the_prompts_won_and_lost_and_the_round_verdict_reads_them() -> None:
    keys = [f"p{i}" for i in range(30)]
    parent = VersionOutcomes(
        version="r1",
        eval_key="k",
        scores=dict.fromkeys(keys, 1.0),
        kinds=dict.fromkeys(keys, "arithmetic"),
        responses={},
    )
    lost_two = {**parent.scores, "p0": 0.0, "p1": 0.0}
    candidate = parent.model_copy(update={"version": "r3", "scores": lost_two})
    c = compare(candidate, parent, samples=2000, confidence=0.95, kind="arithmetic")
    assert (c.wins, c.losses, c.prompts) == (0, 2, 30) and c.high == 0.0
    total = Comparison.model_validate({**SEED1_R3_TOTAL, "version": "r3", "reference": "r1"})
    evidence = truth("r3").model_copy(update={"vs_parent": total, "vs_parent_by_kind": {"arithmetic": c}})
    verdict = check_guards(TrainConfig(), evaluation(groundtruth=evidence), [], truth_guard=True)
    assert verdict.accepted, verdict
    rejected = check_guards(TrainConfig(), evaluation(groundtruth=evidence), [], True, confidence=0.5)  # p 0.25
    assert rejected.reason == "kind_regression" and "2 lost, 0 won; sign test p 0.250" in rejected.detail


def test_a_comparison_and_the_verdict_print_the_level_its_ci_was_computed_at() -> None:
    keys = [f"p{i}" for i in range(30)]
    parent = VersionOutcomes(
        version="r1", eval_key="k", scores=dict.fromkeys(keys, 0.0), kinds=dict.fromkeys(keys, "x"), responses={}
    )
    candidate = parent.model_copy(update={"version": "r2", "scores": {**parent.scores, "p0": 1.0}})
    at_80 = compare(candidate, parent, samples=500, confidence=0.8)
    assert at_80.confidence == 0.8 and "(80% CI " in at_80.line()
    verdict = guards.check(**bounds(), groundtruth_vs_parent=at_80.model_dump(), confidence=0.8)
    assert "(80% CI " in verdict.detail and "95%" not in verdict.detail, verdict.detail
    older = {k: v for k, v in at_80.model_dump().items() if k != "confidence"}  # a record written before the level
    assert Comparison.model_validate(older).confidence == 0.95
