"""Guards: whether a round's checkpoint is accepted (else the parent stays the policy to build on), and why.

Ground truth decides first; the proxies (KL, the judge's reward) decide only where ground truth cannot tell. In
this order, the first rule that applies decides:

1. `nonfinite`: a step's loss or gradient norm was NaN/inf (that step applied no update, but the round is
   suspect); and a KL that is not finite (a broken measurement) rejects as `kl` / `kl_to_base`.
2. `heldout_regression`: on the dev split's prompts with ground truth (official checkers, computed answers; no
   judge), the candidate's pass rate is significantly below its parent's (`worse`): an exact one-sided sign test
   on the prompts where the two differ rejects "no worse" at level (1 - `evaluation.confidence`) / 2. Rejected
   whatever the KL (`evaluation.guard`). Over fewer than `evaluation.min_decided_prompts` dev prompts the
   comparison is shown and decides nothing (rules 2-4): a bootstrap CI of a handful of paired 0/1 outcomes is too
   narrow to accept on.
3. `kind_regression`: the same on one kind of dev prompt (arithmetic, instruction, ...) with at least
   `evaluation.min_decided_prompts` prompts: a slice that collapsed is not hidden by a total that rose. A kind
   with fewer prompts is shown, never decides.
4. accepted: the candidate is significantly better than its parent on dev (the whole CI above 0). The proxies
   below are shown in the detail and do not reject it (a KL beyond the trust region is named there).
5. `kl`: the per-token KL(new || parent) on held-out samples exceeds `train.max_kl`, a trust region sized from
   measured harm (the KL at which ground truth fell in the learning benchmark's runs, docs/benchmarks.md; the
   demo profile cites its number). It decides only when dev ground truth does not show the candidate better.
6. `kl_to_base`: the per-token KL(new || base), base = the root of the lineage, exceeds
   `train.max_kl_to_base`: the drift the rounds add up to, bounded the same way.
7. `reward_drop`: the held-out reward of the new policy is more than `train.max_reward_drop` below the
   parent's, both judged in one candidate set per prompt (parent and new samples together, one rubric), so the
   comparison is paired rather than across differently-conditioned rubrics. The judge is the frozen verifier
   with the PREVIOUS rubric generator (the parent's weights in single-model mode), on held-out prompts no round
   trained on, so the candidate never grades itself.

Without ground truth (`evaluation.guard` off, or a trainer that does not evaluate it) rules 2-4 are skipped.
The reported test figures (`TruthEvidence.figures`) are never an input here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dynrubric.train.records import delta_ci

DEFAULT_MIN_DECIDED_PROMPTS = 20  # mirrors evaluation.min_decided_prompts' default (config.py says why)
DEFAULT_CONFIDENCE = 0.95  # mirrors evaluation.confidence's default


@dataclass(frozen=True)
class GuardVerdict:
    # None: accepted; else "nonfinite" | "heldout_regression" | "kind_regression" | "kl" | "kl_to_base" | "reward_drop"
    reason: str | None
    detail: str

    @property
    def accepted(self) -> bool:
        return self.reason is None


def _ci(c: Mapping[str, Any], confidence: float) -> str:
    """A comparison as records.delta_ci writes it, at its record's `confidence`, else the guard's."""
    return delta_ci(c["delta"], c["low"], c["high"], c.get("confidence", confidence))


def sign_test_p(losses: int, wins: int) -> float:
    """The exact one-sided sign test's p-value for "the candidate is no worse", from the n = losses + wins prompts
    on which it and its reference differ (ties carry no sign):

        p = sum_{k = losses}^{n} C(n, k) / 2^n

    the chance of at least `losses` losses among n fair coin flips."""
    n = losses + wins
    return sum(math.comb(n, k) for k in range(losses, n + 1)) / 2.0**n


def worse(c: Mapping[str, Any], confidence: float = DEFAULT_CONFIDENCE) -> bool:
    """Is the candidate significantly worse than its reference on this comparison? With the counts of prompts it
    lost and won (`losses`, `wins`): a mean below 0 and `sign_test_p` at most (1 - confidence) / 2, the one-sided
    tail of the two-sided CI. The percentile bootstrap CI is not used for this: over the few prompts on which two
    versions differ its upper end is 0 whenever none was won, so 2 lost and 0 won of a kind's 30 prompts read as
    -0.067 (95% CI -0.167..+0.000), and the rule that read such a CI as worse rejected a round that dev called
    better in total (+0.065, CI +0.005..+0.125) and the test split too (unseen types +0.137, CI +0.021..+0.242;
    docs/benchmarks.md, four cycles, seed 1). The sign test gives that 0.25. Without the counts (a record written
    before they were kept) the CI decides: wholly below 0, or ending at 0 around a mean below 0."""
    delta, high, wins, losses = c["delta"], c["high"], c.get("wins"), c.get("losses")
    if wins is None or losses is None:
        return bool(high < 0 or (high <= 0 and delta < 0))
    return delta < 0 and sign_test_p(int(losses), int(wins)) <= (1.0 - confidence) / 2.0


def _counts(c: Mapping[str, Any]) -> str:
    """What a verdict adds after a comparison: ' (L lost, W won; sign test p X)', or '' without the counts."""
    wins, losses = c.get("wins"), c.get("losses")
    if wins is None or losses is None:
        return ""
    return f" ({int(losses)} lost, {int(wins)} won; sign test p {sign_test_p(int(losses), int(wins)):.3f})"


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
    groundtruth_vs_parent: Mapping[str, Any] | None = None,
    groundtruth_by_kind: Mapping[str, Mapping[str, Any]] | None = None,
    min_decided_prompts: int = DEFAULT_MIN_DECIDED_PROMPTS,
    confidence: float = DEFAULT_CONFIDENCE,
) -> GuardVerdict:
    """The verdict on a candidate (module docstring: the rules, in order). `groundtruth_vs_parent`: the dev
    split's paired comparison with the parent (`delta`, `low`, `high`, `prompts`, and `wins` and `losses` where
    counted); `groundtruth_by_kind`: the same per kind of dev prompt. A comparison decides only over at least
    `min_decided_prompts` prompts; `confidence`: the two-sided level of its CI (`worse` tests at its one-sided tail)."""
    if nonfinite_steps:
        return GuardVerdict("nonfinite", f"non-finite loss or gradient at step(s) {nonfinite_steps}")
    if not math.isfinite(kl):
        return GuardVerdict("kl", f"KL to parent is {kl} (not a measurement)")
    if not math.isfinite(kl_to_base):
        return GuardVerdict("kl_to_base", f"KL to the base is {kl_to_base} (not a measurement)")
    proxies = (
        f"KL to parent {kl:.5f} (trust region {max_kl}); KL to base {kl_to_base:.5f} (trust region "
        f"{max_kl_to_base}); judge's reward {reward_parent:.4f} -> {reward_new:.4f}"
    )
    truth = ""
    if groundtruth_vs_parent is not None and groundtruth_vs_parent["prompts"] < min_decided_prompts:
        truth = (
            f"dev ground truth {_ci(groundtruth_vs_parent, confidence)} over "
            f"{int(groundtruth_vs_parent['prompts'])} prompts (under {min_decided_prompts}: not decided on); "
        )
    elif groundtruth_vs_parent is not None:
        total = _ci(groundtruth_vs_parent, confidence)
        if worse(groundtruth_vs_parent, confidence):
            return GuardVerdict(
                "heldout_regression",
                f"dev ground truth decided: pass rate {total} vs the parent{_counts(groundtruth_vs_parent)}, worse; "
                f"rejected whatever the KL ({proxies})",
            )
        kinds = groundtruth_by_kind or {}
        for kind in sorted(kinds):
            c = kinds[kind]
            if c["prompts"] >= min_decided_prompts and worse(c, confidence):
                return GuardVerdict(
                    "kind_regression",
                    f"dev ground truth decided: {kind} prompts {_ci(c, confidence)} vs the parent over "
                    f"{int(c['prompts'])} prompts{_counts(c)}, worse, whatever the total ({total}); "
                    f"rejected ({proxies})",
                )
        shown = [
            f"{kind} {_ci(c, confidence)} over {int(c['prompts'])}{_counts(c)}"
            + ("" if c["prompts"] >= min_decided_prompts else f" (under {min_decided_prompts} prompts: not decided on)")
            for kind, c in sorted(kinds.items())
        ]
        by_kind = f"; by kind: {', '.join(shown)}" if shown else ""
        if groundtruth_vs_parent["low"] > 0:
            beyond = (
                "; beyond the trust region, accepted on ground truth"
                if kl > max_kl or kl_to_base > max_kl_to_base
                else ""
            )
            return GuardVerdict(
                None,
                f"dev ground truth decided: better than the parent, {total}, all above 0{by_kind}; {proxies}{beyond}",
            )
        truth = f"dev ground truth {total}: not shown better{by_kind}; "
    if kl > max_kl:
        return GuardVerdict("kl", f"{truth}KL to parent {kl:.5f} per token > trust region {max_kl}")
    if kl_to_base > max_kl_to_base:
        return GuardVerdict(
            "kl_to_base", f"{truth}KL to the base {kl_to_base:.5f} per token > trust region {max_kl_to_base}"
        )
    drop = reward_parent - reward_new
    if not math.isfinite(drop) or drop > max_reward_drop:
        return GuardVerdict(
            "reward_drop",
            f"{truth}held-out reward fell {drop:.4f} ({reward_parent:.4f} -> {reward_new:.4f}) "
            f"> bound {max_reward_drop}",
        )
    return GuardVerdict(
        None,
        f"{truth}within the trust region: KL {kl:.5f} <= {max_kl}; KL to base {kl_to_base:.5f} <= {max_kl_to_base}; "
        f"reward {reward_parent:.4f} -> {reward_new:.4f}",
    )
