"""The calibration answers' trust rule, side by side: one `eval-judge` run re-weighed under each rule.

`eval_judge.json` keeps every set's rubric and the verifier's raw P(yes) for its candidates and anchors, and
the rule (`rubric.trust_rule`) only decides which items weigh, so weighing the stored verdicts again
(`rubric.evaluator.weigh`) gives exactly what a run under the other rule would score, without a model.
Prints, per rule, the ordered sets' pairwise accuracy (ties 1/2) by kind, the untrusted sets, and the
accuracy as trained (an untrusted set's pairs at 1/2); the last line is the ratio of the two rules'
accuracies (`best` / `every`).

    python benchmarks/trust_rules.py OUT/eval_judge.json   (OUT: `dynrubric eval-judge -o OUT`)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dynrubric.config import RubricConfig  # noqa: E402
from dynrubric.rubric.benchmark import pairwise_accuracy  # noqa: E402
from dynrubric.rubric.calibrate import known_bad_answers  # noqa: E402
from dynrubric.rubric.evaluator import weigh  # noqa: E402
from dynrubric.rubric.items import Rubric  # noqa: E402

RULES: tuple[Literal["every", "best"], ...] = ("every", "best")


def calibration_verdicts(scored_set: dict[str, Any]) -> list[list[float]]:
    """M x A verifier P(yes) of the calibration answers; files written before the rename call them anchors."""
    if "calibration_raw_verdicts" in scored_set:
        return scored_set["calibration_raw_verdicts"]
    return scored_set["anchor_raw_verdicts"]


def accuracies(sets: list[dict[str, Any]], config: RubricConfig) -> dict[str, tuple[float, float, int, int]]:
    """Per kind (and "all"): (pairwise accuracy, as trained, untrusted sets, sets) of the ordered sets."""
    raw_acc: dict[str, list[float]] = defaultdict(list)
    trained: dict[str, list[float]] = defaultdict(list)
    untrusted: dict[str, int] = defaultdict(int)
    for s in sets:
        if s.get("order") is None:  # an equal-quality set: no ranking to check
            continue
        rubric = Rubric.model_validate({"items": s["rubric"]})
        judged = list(s["responses"]) + known_bad_answers(s["prompt"])
        raw = [list(c) + list(a) for c, a in zip(s["raw_verdicts"], calibration_verdicts(s), strict=True)]
        judgement = weigh(rubric, judged, raw, len(s["responses"]), config)
        accuracy = pairwise_accuracy(judgement.scores, s["order"], config.eps)
        for kind in (s["kind"], "all"):
            raw_acc[kind].append(accuracy)
            trained[kind].append(accuracy if judgement.trusted else 0.5)
            untrusted[kind] += not judgement.trusted
    return {
        kind: (sum(v) / len(v), sum(trained[kind]) / len(v), untrusted[kind], len(v)) for kind, v in raw_acc.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("eval_judge_json", type=Path, help="an eval-judge run's eval_judge.json")
    args = ap.parse_args()
    run = json.loads(args.eval_judge_json.read_text())
    by_mode: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in run["sets"]:
        by_mode[s["mode"]].append(s)
    for mode, sets in by_mode.items():
        alls = {}
        for rule in RULES:
            result = accuracies(sets, RubricConfig(trust_rule=rule))
            alls[rule] = result["all"][0]
            for kind, (accuracy, as_trained, untrusted, n) in sorted(result.items()):
                print(
                    f"{mode:11} {rule:5} {kind:11} sets {n:3}  pairwise {accuracy:.3f}  as trained {as_trained:.3f}  "
                    f"untrusted {untrusted}"
                )
        print(f"{mode}: pairwise_accuracy best {alls['best']:.3f}, every {alls['every']:.3f}")
        print(f"ratio: {alls['best'] / alls['every']:.3f}")


if __name__ == "__main__":
    main()
