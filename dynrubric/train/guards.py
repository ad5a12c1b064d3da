"""Guards: reasons to reject a round's checkpoint (the parent stays the policy to build on).

- `nonfinite`: a step's loss or gradient norm was NaN/inf (that step applied no update, but the
  round is suspect);
- `kl`: the per-token KL(new || parent) on held-out samples exceeds `train.max_kl`;
- `kl_to_base`: the per-token KL(new || base), base = the root of the lineage, exceeds
  `train.max_kl_to_base`: the drift the rounds add up to is bounded, not only each round's step;
- `reward_drop`: the held-out reward of the new policy is more than `train.max_reward_drop` below
  the parent's, both judged in one candidate set per prompt (parent and new samples together, one
  rubric), so the comparison is paired rather than across differently-conditioned rubrics. The judge
  is the frozen verifier with the PREVIOUS rubric generator (the parent's weights in single-model
  mode), on held-out prompts no round trained on, so the candidate never grades itself;
- `heldout_regression`: on the held-out prompts with ground truth (official checkers, computed answers;
  no judge), the candidate's pass rate is significantly below its parent's: the whole paired-bootstrap
  CI of the difference lies below 0 (`evaluation.guard`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GuardVerdict:
    reason: str | None  # None: accepted; else "nonfinite" | "kl" | "kl_to_base" | "reward_drop" | "heldout_regression"
    detail: str

    @property
    def accepted(self) -> bool:
        return self.reason is None


def check(
    *,
    nonfinite_steps: list[int],
    kl: float,
    max_kl: float,
    kl_to_base: float,
    max_kl_to_base: float,
    reward_parent: float,
    reward_new: float,
    max_reward_drop: float,
    groundtruth_vs_parent: dict[str, float] | None = None,
) -> GuardVerdict:
    if nonfinite_steps:
        return GuardVerdict("nonfinite", f"non-finite loss or gradient at step(s) {nonfinite_steps}")
    if not math.isfinite(kl) or kl > max_kl:
        return GuardVerdict("kl", f"KL to parent {kl:.5f} per token > bound {max_kl}")
    if not math.isfinite(kl_to_base) or kl_to_base > max_kl_to_base:
        return GuardVerdict("kl_to_base", f"KL to the base {kl_to_base:.5f} per token > bound {max_kl_to_base}")
    drop = reward_parent - reward_new
    if not math.isfinite(drop) or drop > max_reward_drop:
        return GuardVerdict(
            "reward_drop",
            f"held-out reward fell {drop:.4f} ({reward_parent:.4f} -> {reward_new:.4f}) > bound {max_reward_drop}",
        )
    truth = ""
    if groundtruth_vs_parent is not None:
        d, lo, hi = groundtruth_vs_parent["delta"], groundtruth_vs_parent["low"], groundtruth_vs_parent["high"]
        if hi < 0:
            return GuardVerdict(
                "heldout_regression",
                f"held-out ground-truth pass rate fell {d:+.3f} vs the parent "
                f"(95% CI {lo:+.3f}..{hi:+.3f}, all below 0)",
            )
        truth = f"; ground truth {d:+.3f} (CI {lo:+.3f}..{hi:+.3f})"
    return GuardVerdict(
        None,
        f"KL {kl:.5f} <= {max_kl}; KL to base {kl_to_base:.5f} <= {max_kl_to_base}; "
        f"reward {reward_parent:.4f} -> {reward_new:.4f}{truth}",
    )
