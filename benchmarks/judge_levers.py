"""The judge's levers, side by side: one `eval-judge --open` (or `--real`) run weighed again under each.

Run `eval-judge --open` (open prompts: a strong model's answer beside the policy's) or `eval-judge --real` (the
policy's answers graded by the official checkers) once with `rubric.check_weight 0`, so that the verifier answers
every item, checked or not, and `eval_judge_open.json` (`eval_judge_real.json`) keeps each set's rubric (with the
checks the generator wrote) and the verifier's raw P(yes) for its candidates and calibration answers. Each lever
below only changes how those verdicts are weighed (`rubric.evaluator.weigh`), so weighing them again gives what a
run under the lever scores, the rubrics and P(yes) being the same (the generator does not read the weighing rules):

    shipped          every check decides its item (check_weight 1), calibration de-bias, trust rule `every`
    stated checks    a check decides its item only where the item's text states it (`rubric.stated_checks_only`);
                     the verifier's P(yes) answers the rest
    + no de-bias     stated checks, the verifier's P(yes) as it is (no calibration answers' floor subtracted)
    + trust best     stated checks, de-bias, an item overruled only when a calibration answer beats the set's best
    + never overrule stated checks, de-bias, no item overruled
    trust best only  every check decides its item (as shipped), trust rule `best`
    raw P(yes)       no check at all: sum w z / sum w of the verifier's oriented P(yes), no de-bias, no overrule

Per lever: the pairwise accuracy of the strong (passing) answer over the policy's (failing) one (ties within
`rubric.eps` = 1/2) with a bootstrap 95 % CI over sets, the sets it ties, the untrusted sets; beside it the
length-only judge on the same pairs. A --real run counts the sets the checker separates.
The last line: `best lever: NAME accuracy X (length Y)`.

Given several runs of the same sets under different `rubric.seed`s, each set is weighed with the generated items of
all of them pooled (the verifier's P(yes) on an item does not depend on the other items): what sampling that many
rubrics per set and merging their items would score.

    python benchmarks/judge_levers.py OUT/eval_judge_open.json [OUT2/eval_judge_open.json ...]

    (OUT: `DYNRUBRIC_RUBRIC__CHECK_WEIGHT=0 [DYNRUBRIC_RUBRIC__SEED=N] dynrubric eval-judge --open --modes set -o OUT`)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dynrubric.config import RubricConfig  # noqa: E402
from dynrubric.rubric.benchmark import (  # noqa: E402
    all_tied,
    bootstrap_ci,
    length_pair_outcomes,
    strong_pair_outcomes,
)
from dynrubric.rubric.calibrate import known_bad_answers  # noqa: E402
from dynrubric.rubric.checks import Check  # noqa: E402
from dynrubric.rubric.evaluator import weigh  # noqa: E402
from dynrubric.rubric.items import Rubric, RubricItem, check_is_stated  # noqa: E402


def stated_only(rubric: Rubric) -> Rubric:
    """The rubric as `rubric.stated_checks_only` parses it: a generated item keeps its check only where stated."""
    return Rubric.model_construct(  # a pooled rubric may hold more than MAX_ITEMS items
        items=[
            i.model_copy(update={"check": None})
            if i.origin == "generator" and i.check is not None and not check_is_stated(i.text, i.check)
            else i
            for i in rubric.items
        ]
    )


def no_checks(rubric: Rubric) -> Rubric:
    return Rubric.model_construct(
        items=[i.model_copy(update={"check": None}) if i.origin == "generator" else i for i in rubric.items]
    )


Lever = tuple[Callable[[Rubric], Rubric], RubricConfig]
LEVERS: dict[str, Lever] = {
    "shipped": (lambda r: r, RubricConfig()),
    "stated checks": (stated_only, RubricConfig()),
    "+ no de-bias": (stated_only, RubricConfig(calibration_answers=False)),
    "+ trust best": (stated_only, RubricConfig(trust_rule="best")),
    # eps is the overrule margin inside `weigh` only (the pairs below take the default): no item is ever overruled
    "+ never overrule": (stated_only, RubricConfig(eps=0.99)),
    "trust best only": (lambda r: r, RubricConfig(trust_rule="best")),
    "raw P(yes)": (no_checks, RubricConfig(calibration_answers=False)),
}


def weigh_set(s: dict[str, Any], lever: Lever) -> tuple[list[float], bool]:
    reshape, config = lever
    # not validated as a whole: pooled rubrics hold more than MAX_ITEMS items, and their ids may repeat
    rubric = reshape(Rubric.model_construct(items=[RubricItem.model_validate(i) for i in s["rubric"]]))
    k = len(s["responses"])
    if config.calibration_answers:
        judged = list(s["responses"]) + known_bad_answers(s["prompt"])
        raw = [list(c) + list(a) for c, a in zip(s["raw_verdicts"], s["calibration_raw_verdicts"], strict=True)]
    else:
        judged, raw = list(s["responses"]), [list(c) for c in s["raw_verdicts"]]
    j = weigh(rubric, judged, raw, k, config)
    return j.scores, j.trusted


def pooled(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The first run's sets, each with the generated items (and their verdict rows) of the other runs' same set."""
    others = [{(s["prompt"], tuple(s["responses"])): s for s in run} for run in runs[1:]]
    out = []
    for s in runs[0]:
        rubric, raw, calibration = list(s["rubric"]), list(s["raw_verdicts"]), list(s["calibration_raw_verdicts"])
        for run in others:
            o = run[(s["prompt"], tuple(s["responses"]))]
            for item, r, c in zip(o["rubric"], o["raw_verdicts"], o["calibration_raw_verdicts"], strict=True):
                if item["origin"] == "generator":
                    rubric.append(item)
                    raw.append(r)
                    calibration.append(c)
        out.append(s | {"rubric": rubric, "raw_verdicts": raw, "calibration_raw_verdicts": calibration})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("eval_judge_open_json", type=Path, nargs="+", help="several: the same sets, rubric.seed apart")
    ap.add_argument("--mode", default="set")
    args = ap.parse_args()
    # an open run's sets have a source; a --real run's are one source, its checker-graded sets: those it separates
    runs = [
        [
            s | {"source": s.get("source", "real")}
            for s in json.loads(path.read_text())["sets"]
            if s["mode"] == args.mode and any(s["passed"]) and not all(s["passed"])
        ]
        for path in args.eval_judge_open_json
    ]
    sets = pooled(runs)
    if len(runs) > 1:
        print(f"the generated items of {len(runs)} runs pooled per set")
    unread = sum(
        i["origin"] == "generator" and all(v == 0.5 for v in row)
        for s in sets
        for i, row in zip(s["rubric"], s["raw_verdicts"], strict=True)
    )
    if unread:
        print(f"note: {unread} generated items were not read by the verifier (0.5): run with rubric.check_weight 0")
    eps = RubricConfig().eps
    generated = [i for s in sets for i in s["rubric"] if i["origin"] == "generator"]
    checked = [i for i in generated if i.get("check")]
    stated = [i for i in checked if check_is_stated(i["text"], Check.model_validate(i["check"]))]
    print(
        f"{len(sets)} sets ({args.mode}); generated items {len(generated)}, with a check {len(checked)}, "
        f"whose text states it {len(stated)}"
    )
    for source in sorted({s["source"] for s in sets}) + ["all"]:
        chosen = [s for s in sets if source == "all" or s["source"] == source]
        if not chosen:
            continue
        length = [length_pair_outcomes(s["responses"], s["passed"]) for s in chosen]
        length_acc = sum(x for a in length for x in a) / sum(len(a) for a in length)
        best = ("", 0.0)
        for name, lever in LEVERS.items():
            outcomes, tied, untrusted = [], 0, 0
            for s in chosen:
                scores, trusted = weigh_set(s, lever)
                outcomes.append(strong_pair_outcomes(scores, s["passed"], eps))
                tied += all_tied(scores, eps)
                untrusted += not trusted
            acc = sum(x for a in outcomes for x in a) / sum(len(a) for a in outcomes)
            lo, hi = bootstrap_ci([sum(a) / len(a) for a in outcomes])
            print(
                f"{source:11} {name:15} pairwise {acc:.3f} (95% CI {lo:.3f}-{hi:.3f})  tied {tied:2}/{len(chosen)}  "
                f"untrusted {untrusted:2}  length {length_acc:.3f}"
            )
            if source == "all" and acc > best[1]:
                best = (name, acc)
    print(f"best lever: {best[0]} accuracy {best[1]:.3f} (length {length_acc:.3f})")


if __name__ == "__main__":
    main()
