"""Evaluation and guards of a round: the candidate judged against its parent, the verdict, its metrics.

`evaluate_round` gathers the guards' evidence once (train/heldout.py) and keeps it in the round's
`eval.json`, so a round resumed after evaluation does not evaluate again. `round_verdict` applies the
guards (train/guards.py) to that evidence and the steps' history and returns the metrics the registry
records with the checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dynrubric.config import TrainConfig
from dynrubric.train import guards
from dynrubric.train.heldout import evaluate_candidate
from dynrubric.train.plan import GUARDED, read_json, write_json


def round_verdict(
    cfg: TrainConfig, history: Sequence[dict[str, Any]], evaluation: dict[str, Any], truth_guard: bool = True
) -> tuple[guards.GuardVerdict, dict[str, Any]]:
    """(the guards' verdict, the checkpoint's metrics) of a round with step records `history`. `truth_guard`:
    whether the ground-truth comparison with the parent can reject (`evaluation.guard`)."""
    policy_steps = [h for h in history if h["phase"] == "policy"]
    truth = evaluation.get("groundtruth")
    verdict = guards.check(
        nonfinite_steps=[h["step"] for h in history if h["nonfinite"]],
        kl=evaluation["kl_to_parent"],
        max_kl=cfg.max_kl,
        kl_to_base=evaluation["kl_to_base"],
        max_kl_to_base=cfg.max_kl_to_base,
        reward_parent=evaluation["reward_parent"],
        reward_new=evaluation["reward_new"],
        max_reward_drop=cfg.max_reward_drop,
        groundtruth_vs_parent=truth["vs_parent"] if truth and truth_guard else None,
    )

    def mean(key: str) -> float | None:
        return (sum(h[key] for h in policy_steps) / len(policy_steps)) if policy_steps else None

    metrics = {
        "reward_mean": mean("reward_mean"),
        "heldout_reward": evaluation["reward_new"],
        "heldout_reward_parent": evaluation["reward_parent"],
        "kl": evaluation["kl_to_parent"],
        "kl_to_base": evaluation["kl_to_base"],
        GUARDED: "accepted" if verdict.accepted else verdict.reason,
        "mean_gap": mean("mean_gap"),
        "tie_rate": mean("tie_rate"),
        "no_gradient_sets": sum(h["no_gradient_sets"] for h in history),
        "updates": sum(1 for h in history if h["updated"]),
    }
    if truth:  # the ground truth of the held-out prompts: what the run page's learning curve plots
        version = truth["version"]
        metrics |= {
            "heldout_pass": truth["pass"][version],
            "heldout_pass_by_kind": truth["pass_by_kind"][version],
            "heldout_vs_parent": truth["vs_parent"],
            "heldout_vs_base": truth["vs_base"],
            "heldout_truth_prompts": truth["prompts"],
        }
    return verdict, metrics


def evaluate_round(path: Path, **candidate: Any) -> dict[str, Any]:
    """The guards' evidence for the round, from `path` (eval.json) when it was gathered before, else
    `train.heldout.evaluate_candidate(**candidate)`, saved there."""
    if path.is_file():
        saved: dict[str, Any] = read_json(path)
        return saved
    result = evaluate_candidate(**candidate)
    write_json(path, result)
    return result
