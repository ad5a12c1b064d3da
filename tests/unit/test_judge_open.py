"""The open-prompt judge benchmark (`dynrubric eval-judge --open`): its metrics on hand-made scores, the shipped
sets (test split, one strong answer each), and the command end to end on a subset with the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dynrubric.config import RubricConfig
from dynrubric.engines.hf import TransformersEngine
from dynrubric.errors import DynrubricError
from dynrubric.rubric.benchmark import (
    OpenSet,
    all_tied,
    bootstrap_ci,
    combine_scores,
    length_pair_outcomes,
    physician_rubrics,
    read_open_sets,
    strictly_first,
    strong_pair_outcomes,
    summarise_open,
    summarise_physician,
    words,
)
from dynrubric.rubric.checks import Check
from dynrubric.rubric.evaluator import Evaluator, generated_items_read
from dynrubric.rubric.items import Rubric, RubricItem
from dynrubric.rubric.score import aggregate
from dynrubric.train.splits import split_of

from .test_rubric_checks import tiny_judge_env

REPO = Path(__file__).resolve().parents[2]
OPEN = REPO / "dynrubric" / "data" / "judge_open.jsonl"


def _set(responses: list[str], strong: int, rubric: list[tuple[str, float]] | None = None) -> OpenSet:
    return OpenSet("q", responses, [j == strong for j in range(len(responses))], "arena-hard", "x", rubric or [])


def test_pairs_are_strong_against_each_policy_answer_ties_within_eps_half():
    # strong answer at index 2; the policy answers' order among themselves never counts
    assert strong_pair_outcomes([0.5, 0.9, 0.6, 0.59], [False, False, True, False], eps=0.02) == [1.0, 0.0, 0.5]
    assert strong_pair_outcomes([0.1, 0.9, 0.3, 0.2], [False, False, True, False], eps=0.02) == [1.0, 0.0, 1.0]


def test_the_length_baseline_gives_the_pair_to_the_answer_with_more_words():
    responses = ["one two three", "one two three four five", "one two three", "a b c d e f g"]
    # strong = index 1 (5 words) vs 3 (win), 3 (win), 7 (loss); equal word counts tie
    assert length_pair_outcomes(responses, [False, True, False, False]) == [1.0, 1.0, 0.0]
    assert length_pair_outcomes(responses, [True, False, False, False]) == [0.0, 0.5, 0.0]
    assert words(" a\nb  c ") == 3


def test_strictly_first_needs_a_lead_of_eps_over_every_other_answer():
    passed = [True, False, False, False]
    assert strictly_first([0.9, 0.5, 0.6, 0.7], passed, eps=0.02)
    assert not strictly_first([0.9, 0.5, 0.89, 0.7], passed, eps=0.02)  # a tie with one policy answer
    assert not strictly_first([0.5, 0.5, 0.5, 0.5], passed, eps=0.02)
    assert not strictly_first([0.5, 0.9, 0.1, 0.1], passed, eps=0.02)


def test_bootstrap_interval_holds_the_mean_and_narrows_to_a_point_without_variance():
    low, high = bootstrap_ci([0.0, 1.0] * 20)
    assert low < 0.5 < high and 0.3 < low and high < 0.7
    assert bootstrap_ci([0.75] * 10) == (0.75, 0.75)


def test_summarise_open_counts_accuracy_length_ties_and_items_read():
    sets = [
        _set(["long answer with many words here", "short", "short too", "x"], 0),  # judge right, length right
        _set(["a", "b c d e f", "g h", "i j k"], 0),  # judge tied everything, length wrong on all 3
        _set(["p q", "r s", "t u v w", "x y"], 2),  # judge wrong on one pair
    ]
    scores = [[0.9, 0.1, 0.2, 0.3], [0.5, 0.5, 0.5, 0.5], [0.6, 0.1, 0.5, 0.2]]
    r = summarise_open(sets, scores, [True, True, False], [(1, 4), (0, 3), (2, 2)], ["set", "set", "generic"], 0.02)
    assert (r.sets, r.pairs) == (3, 9)
    assert r.pairwise_accuracy == pytest.approx((3 + 1.5 + 2) / 9)
    assert r.accuracy_ci[0] <= r.pairwise_accuracy <= r.accuracy_ci[1]
    assert r.length_baseline == pytest.approx((3 + 0 + 3) / 9)
    assert (r.strong_first, r.tied_sets, r.tied_share, r.untrusted_sets) == (1, 1, pytest.approx(1 / 3), 1)
    assert (r.items_read, r.generated_items, r.items_read_share) == (3, 9, pytest.approx(3 / 9))
    assert r.rubric_sources == {"generic": 1, "set": 2}


def test_summarise_physician_rates_the_ideal_completion_first_only_when_strictly_above_all():
    sets = [_set(["a", "b", "c", "d"], 0, [("x", 5)]), _set(["a", "b", "c", "d"], 3, [("x", 5), ("y", -2)])]
    scores = [[0.8, 0.2, 0.79, 0.1], [0.1, 0.2, 0.3, 0.9]]
    p = summarise_physician(sets, scores, eps=0.02)
    assert (p.sets, p.items, p.ideal_first, p.ideal_first_rate) == (2, 3, 1, 0.5)
    assert p.pairwise_accuracy == pytest.approx((2.5 + 3) / 6) and p.tied_sets == 0


def test_generated_items_read_counts_the_generator_items_without_a_check():
    at_most_10 = Check(kind="max_words", value=10)
    rubric = Rubric(
        items=[
            RubricItem(id="a", text="Explains why", weight=2),
            RubricItem(id="b", text="Mentions Paris", weight=2, check=Check(kind="contains", value="Paris")),
            RubricItem(id="c", text="Is short", weight=1, check=Check(kind="max_words", value=50)),
            RubricItem(id="d", text="At most 10 words", weight=3, origin="ground_truth", check=at_most_10),
            RubricItem(id="e", text="Is polite", weight=1, origin="consensus"),
        ]
    )  # fmt: skip
    assert generated_items_read(rubric, check_weight=1.0) == (1, 3)  # b and c decided by their checks
    assert generated_items_read(rubric, check_weight=0.5) == (3, 3)  # blended: the verifier is read on all


def test_the_items_counted_as_read_are_the_ones_the_evaluator_asks_the_verifier(tiny_model_dir, monkeypatch):
    """The count is the evaluator's own decision, not a copy of it: judge() asks the verifier for exactly the items
    `verifier_reads` names, and the scores do not depend on the count."""
    rubric = Rubric(
        items=[
            RubricItem(id="a", text="Explains why", weight=2),
            RubricItem(id="b", text="Mentions Paris", weight=2, check=Check(kind="contains", value="Paris")),
        ]
    )
    with TransformersEngine(tiny_model_dir) as engine:
        for cw, read in ((1.0, ["a"]), (0.5, ["a", "b"])):
            evaluator = Evaluator(engine, engine, RubricConfig(check_weight=cw))
            asked: list[str] = []
            inner = evaluator.verifier.verify_items

            def spy(prompt, responses, items, inner=inner, asked=asked):
                asked.extend(i.id for i in items)
                return inner(prompt, responses, items)

            monkeypatch.setattr(evaluator.verifier, "verify_items", spy)
            evaluator.judge("Capital of France?", rubric, ["Paris.", "Lyon."])
            assert asked == read and generated_items_read(rubric, cw)[0] == len(read)


def test_physician_criteria_become_rubrics_of_weight_and_polarity_in_chunks():
    criteria = [(f"criterion {n}", float(p)) for n, p in enumerate([10, -8, 3, 0, -1, 2, 5, 7, -3, 1, 4, 6, 2, -9])]
    parts = physician_rubrics(criteria)
    items = [i for r, _ in parts for i in r.items]
    assert [len(r.items) for r, _ in parts] == [12, 1]  # the 0-point criterion is left out; 13 items
    assert [i.weight for i in items[:3]] == [5, 5, 3] and [i.polarity for i in items[:3]] == [1, -1, 1]
    assert all(i.origin == "ground_truth" for i in items)
    assert [w for _, w in parts] == [sum(i.weight for i in parts[0][0].items), 5.0]
    # combining chunk scores by their weights is the score of one rubric of all the items
    small = physician_rubrics([("a", 5), ("b", -2), ("c", 1), ("d", 3)])
    one = Rubric(items=[i for r, _ in small for i in r.items])
    verdicts = [[0.9, 0.1], [0.2, 0.7], [0.5, 0.5], [1.0, 0.0]]
    halves = [(Rubric(items=one.items[:2]), verdicts[:2]), (Rubric(items=one.items[2:]), verdicts[2:])]
    combined = combine_scores([(aggregate(v, r), float(sum(r.weights))) for r, v in halves])
    assert combined == pytest.approx(aggregate(verdicts, one))


def test_open_sets_need_exactly_one_strong_answer(tmp_path):
    path = tmp_path / "open.jsonl"
    line = {"prompt": "q", "responses": ["a", "b"], "passed": [True, True], "source": "arena-hard"}
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(DynrubricError, match="exactly one"):
        read_open_sets(path)


def test_the_shipped_open_sets_are_test_split_with_one_strong_answer_and_the_policy_budget(smollm_dir):
    from transformers import AutoTokenizer

    lines = [json.loads(line) for line in OPEN.read_text().split("\n") if line.strip()]
    sets = read_open_sets(OPEN)
    arena = [s for s in sets if s.source == "arena-hard"]
    health = [s for s in sets if s.source == "healthbench"]
    assert len(arena) >= 40 and len(health) >= 10 and len(arena) + len(health) == len(sets)
    assert all(not s.rubric for s in arena) and all(s.rubric for s in health)
    assert len({(s.source, s.id) for s in sets}) == len(sets)
    for s in sets:
        assert split_of(f"{s.source}:{s.id}") == "test", s.id
        assert len(s.responses) == 4 and sum(s.passed) == 1
    tok = AutoTokenizer.from_pretrained(smollm_dir)
    for line in lines:  # decoded text re-encodes to about as many tokens (not always exactly: a few more)
        assert all(len(tok.encode(r, add_special_tokens=False)) <= line["max_tokens"] + 8 for r in line["responses"])
    assert {s.strong for s in sets} == {0, 1, 2, 3}  # the strong answer's slot is shuffled


def test_eval_judge_open_end_to_end_on_a_subset(tiny_model_dir, tmp_path):
    """The real command on 3 Arena-Hard and 2 HealthBench sets (the shortest prompts: the tiny model's byte-level
    tokenizer makes the others long): the printed figures are there and agree with the JSON and the sets."""
    sets = read_open_sets(OPEN)
    lines = [line for line in OPEN.read_text().split("\n") if line.strip()]
    by_source = {
        src: sorted((i for i, s in enumerate(sets) if s.source == src), key=lambda i: len(sets[i].prompt))
        for src in ("arena-hard", "healthbench")
    }
    chosen = by_source["arena-hard"][:3] + by_source["healthbench"][:2]
    subset = tmp_path / "open.jsonl"
    subset.write_text("".join(lines[i] + "\n" for i in chosen))
    r = subprocess.run(
        [str(Path(sys.executable).parent / "dynrubric"), "eval-judge", str(subset), "--open", "--modes", "set",
         "--out", str(tmp_path / "out")],
        cwd=tmp_path, env=tiny_judge_env(tiny_model_dir), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    tail = dict(line.split(": ", 1) for line in r.stdout.strip().splitlines()[-5:])
    assert list(tail) == [
        "pairwise_accuracy_open[set]",
        "length_baseline_open[set]",
        "tied_share_open[set]",
        "items_read_share_open[set]",
        "ideal_first_rate_physician",
    ]
    assert all(0.0 <= float(v.split()[0]) <= 1.0 for v in tail.values())
    assert (
        "3 sets, 9 pairs" in tail["pairwise_accuracy_open[set]"] and "of 2 sets" in tail["ideal_first_rate_physician"]
    )
    report = json.loads((tmp_path / "out" / "eval_judge_open.json").read_text())
    result, physician = report["results"]["set"], report["physician"]
    assert (result["sets"], result["pairs"], physician["sets"]) == (3, 9, 2)
    arena = [sets[i] for i in chosen[:3]]
    # the length baseline from the known word counts of the subset
    expected = [x for s in arena for x in length_pair_outcomes(s.responses, s.passed)]
    assert result["length_baseline"] == pytest.approx(sum(expected) / 9)
    assert f"{result['length_baseline']:.3f}" == tail["length_baseline_open[set]"].split()[0]
    judged = [s for s in report["sets"] if s["mode"] == "set"]
    assert [s["id"] for s in judged] == [s.id for s in arena]
    eps = RubricConfig().eps
    accuracy = [x for s in judged for x in strong_pair_outcomes(s["scores"], s["passed"], eps)]
    assert result["pairwise_accuracy"] == pytest.approx(sum(accuracy) / 9)
    assert result["tied_sets"] == sum(all_tied(s["scores"], eps) for s in judged)
    generated = [i for s in judged for i in s["rubric"] if i["origin"] == "generator"]
    assert result["generated_items"] == len(generated)
    assert result["items_read"] == sum(i["check"] is None for i in generated)  # check_weight 1: checks decide
    scored = [s for s in report["sets"] if s["mode"] == "physician"]
    assert physician["ideal_first"] == sum(strictly_first(s["scores"], s["passed"], eps) for s in scored)
    assert physician["items"] == sum(len(sets[i].rubric) for i in chosen[3:])
