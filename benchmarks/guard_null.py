"""How often does the round's guard reject a candidate that is as good as its parent? (issue 38: guards that agree
with ground truth.)

For each round of a run (`train.run_dir` with `rounds/*/summary.json` and the dev outcomes under `groundtruth/dev/`),
it keeps which dev prompts the candidate and its parent scored differently, and draws the null many times: each
such prompt is won by either version with probability 1/2 (the two are equally good; the prompts both pass or both
fail stay as they are). Each draw is compared as the round compares (`policy_eval.compare`, the evaluation's
bootstrap) and judged by the guard's ground-truth rules (`guards.check`, inside the trust region, the reward
unchanged) twice: with the sign test (the counts of won and lost prompts) and with the CI alone (the rule before
it: wholly below 0, or ending at 0 around a loss). A rejection of a null draw is a false rejection; at 95 % the sign
test allows at most 2.5 % per comparison (total, and each kind of at least `evaluation.min_decided_prompts`).

It prints, per round: the prompts won and lost against the parent, the kinds' discordant counts, and the share of
null draws each rule rejects (in total or by any kind). The last line pools the rounds.

    python benchmarks/guard_null.py RUN_DIR [--draws N] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout this file is in, not another install

from dynrubric.config import EvaluationConfig  # noqa: E402
from dynrubric.train import guards  # noqa: E402
from dynrubric.train.policy_eval import OutcomeStore, VersionOutcomes, compare  # noqa: E402
from dynrubric.train.records import Comparison  # noqa: E402

#: the guard's proxies held where they decide nothing: inside the trust region, the judged reward unchanged
NEUTRAL: dict[str, Any] = {
    "nonfinite_steps": [],
    "kl": 0.0,
    "max_kl": 1.0,
    "kl_to_base": 0.0,
    "max_kl_to_base": 1.0,
    "reward_parent": 0.5,
    "reward_new": 0.5,
    "max_reward_drop": 1.0,
}


def null_draw(
    candidate: VersionOutcomes, parent: VersionOutcomes, rng: random.Random
) -> tuple[VersionOutcomes, VersionOutcomes]:
    """The pair with the two versions' scores swapped, with probability 1/2, on each prompt they score differently:
    either is as likely to win it (the prompts they score alike stay as they are)."""
    ours, theirs = dict(candidate.scores), dict(parent.scores)
    for key in ours:
        if ours[key] != theirs[key] and rng.random() < 0.5:
            ours[key], theirs[key] = theirs[key], ours[key]
    return candidate.model_copy(update={"scores": ours}), parent.model_copy(update={"scores": theirs})


def verdicts(candidate: VersionOutcomes, parent: VersionOutcomes, e: EvaluationConfig) -> tuple[str | None, str | None]:
    """(with the sign test, with the CI alone): the guard's reason, None when it accepts or leaves it to the
    proxies."""
    total = compare(candidate, parent, e.bootstrap_samples, e.confidence)
    kinds = {k: compare(candidate, parent, e.bootstrap_samples, e.confidence, k) for k in set(candidate.kinds.values())}

    def reason(counted: bool) -> str | None:
        def dump(c: Comparison) -> dict[str, Any]:
            return c.model_dump() if counted else c.model_dump(exclude={"wins", "losses"})

        v = guards.check(
            **NEUTRAL,
            groundtruth_vs_parent=dump(total),
            groundtruth_by_kind={k: dump(c) for k, c in kinds.items()},
            min_decided_prompts=e.min_decided_prompts,
            confidence=e.confidence,
        )
        return v.reason

    return reason(True), reason(False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path, help="a run's train.run_dir (rounds/ and groundtruth/ under it)")
    ap.add_argument("--draws", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    e = EvaluationConfig()
    store = OutcomeStore(args.run_dir / "groundtruth")
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    pooled = {"sign test": 0, "CI alone": 0, "draws": 0}
    for summary_path in sorted((args.run_dir / "rounds").glob("*/summary.json")):
        summary = json.loads(summary_path.read_text())
        version, parent_version = summary["version"], summary["parent"]
        paths = (store.path(version), store.path(parent_version))
        if not all(p.is_file() for p in paths):
            print(f"round {summary['round']}: no dev outcomes for {version} and {parent_version}; skipped")
            continue
        candidate, parent = (VersionOutcomes.model_validate_json(p.read_text()) for p in paths)
        observed = compare(candidate, parent, e.bootstrap_samples, e.confidence)
        by_kind = []
        for kind in sorted(set(candidate.kinds.values())):
            c = compare(candidate, parent, e.bootstrap_samples, e.confidence, kind)
            by_kind.append(f"{kind} {c.losses} lost, {c.wins} won of {c.prompts}")
        rejected = {"sign test": 0, "CI alone": 0}
        for _ in range(args.draws):
            signed, ci_alone = verdicts(*null_draw(candidate, parent, rng), e)
            rejected["sign test"] += signed is not None
            rejected["CI alone"] += ci_alone is not None
        for rule, n in rejected.items():
            pooled[rule] += n
        pooled["draws"] += args.draws
        print(
            f"round {summary['round']} {version} vs {parent_version}: {observed.losses} lost, {observed.wins} won of "
            f"{observed.prompts} ({'; '.join(by_kind)}); null draws rejected: sign test "
            f"{rejected['sign test'] / args.draws:.3f}, CI alone {rejected['CI alone'] / args.draws:.3f} "
            f"of {args.draws}",
            flush=True,
        )
    n = max(1, pooled["draws"])
    print(f"total {time.monotonic() - t0:.0f}s")
    print(
        f"false rejections of an equal candidate: sign test {pooled['sign test'] / n:.3f}, "
        f"CI alone {pooled['CI alone'] / n:.3f} over {pooled['draws']} null draws"
    )


if __name__ == "__main__":
    main()
