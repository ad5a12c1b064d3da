"""Checkable items, items derived from the prompt and the set, calibration answers, and the judge
benchmark's metrics and command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynrubric.jsonl import split_lines
from dynrubric.rubric.benchmark import (
    JudgeSet,
    RealSet,
    all_tied,
    empty_on_top,
    kendall_tau,
    pairwise_accuracy,
    read_judge_sets,
    read_real_sets,
    summarise_mode,
    summarise_real,
)
from dynrubric.rubric.calibrate import calibrate_row, calibration_outranks
from dynrubric.rubric.checks import Check, CheckError, echoes, parse_check, run_check
from dynrubric.rubric.derived import consensus_items, prompt_items
from dynrubric.rubric.items import parse_rubric

REPO = Path(__file__).resolve().parents[2]
BENCHMARK = REPO / "dynrubric" / "data" / "judge_benchmark.jsonl"


def tiny_judge_env(model_dir: Path) -> dict[str, str]:
    """The console script's environment: the tiny model as rubric writer and verifier, one short rubric try."""
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "COLUMNS": "200",
        "DYNRUBRIC_MODELS__GENERATOR": str(model_dir),
        "DYNRUBRIC_MODELS__VERIFIER": str(model_dir),
        "DYNRUBRIC_RUBRIC__GENERATOR_MAX_TOKENS": "48",
        "DYNRUBRIC_RUBRIC__RETRIES": "0",
        "DYNRUBRIC_RUBRIC__PROMPT_ONLY_RETRIES": "0",
    }


@pytest.mark.parametrize(
    ("check", "response", "met"),
    [
        ({"kind": "contains", "value": "Paris"}, "The capital is paris.", 1.0),
        ({"kind": "contains", "value": "Paris"}, "The capital is Lyon.", 0.0),
        ({"kind": "not_contains", "value": "very"}, "A fine day.", 1.0),
        ({"kind": "not_contains", "value": "very"}, "A very fine day.", 0.0),
        ({"kind": "regex", "value": r"^\d+$"}, "42", 1.0),
        ({"kind": "max_words", "value": 3}, "one two three", 1.0),
        ({"kind": "max_words", "value": 3}, "one two three four", 0.0),
        ({"kind": "min_words", "value": "4"}, "one two three four", 1.0),
        ({"kind": "starts_with", "value": "Dear"}, "dear reader, hello", 1.0),
        ({"kind": "ends_with", "value": "peace"}, "We wish you peace.", 1.0),
        ({"kind": "ends_with", "value": "peace"}, "Peace to you.", 0.0),
        ({"kind": "bullet_count", "value": 2}, "Intro\n- a\n* b\nend", 1.0),
        ({"kind": "bullet_count", "value": 2}, "- a\n- b\n1. c", 0.0),
        ({"kind": "final_number", "value": 1000}, "5 x 200 = 1,000", 1.0),
        ({"kind": "final_number", "value": 42}, "42 is not it, 24 is", 0.0),
        ({"kind": "no_commas", "value": None}, "no commas here", 1.0),
        ({"kind": "lowercase"}, "Not lower", 0.0),
        # an empty answer meets no check, not even the ones it passes on a technicality
        ({"kind": "max_words", "value": 50}, "  ", 0.0),
        ({"kind": "no_commas"}, "", 0.0),
    ],
)
def test_check_vocabulary(check, response, met):
    assert run_check(parse_check(check), response) == met


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ({"kind": "run_python", "value": "import os"}, "unknown check kind"),
        ({"kind": "contains"}, "non-empty text"),
        ({"kind": "max_words", "value": 2.5}, "whole number"),
        ({"kind": "final_number", "value": "NaN"}, "finite"),
        ({"kind": "regex", "value": "(unclosed"}, "does not compile"),
        ("contains 42", "must be an object"),
    ],
)
def test_malformed_checks_are_refused_with_a_reason(raw, reason):
    with pytest.raises(CheckError, match=reason):
        parse_check(raw)


def test_a_catastrophic_regex_is_cut_off_not_hung():
    check = Check(kind="regex", value=r"(a+)+$")
    assert run_check(check, "a" * 40 + "b") == 0.0  # backtracking would take hours; the timeout ends it


def test_a_malformed_check_drops_the_check_not_the_item_and_is_reported():
    notes: list[str] = []
    rubric = parse_rubric(
        json.dumps(
            {
                "items": [
                    {"text": "Gives the answer 42", "weight": 5, "check": {"kind": "final_number", "value": 42}},
                    {"text": "Explains the method", "weight": 2, "check": {"kind": "exec", "value": "x"}},
                ]
            }
        ),
        notes=notes,
    )
    assert rubric.items[0].check == Check(kind="final_number", value=42.0)
    assert rubric.items[1].check is None and rubric.items[1].text == "Explains the method"
    assert notes == ["check dropped: unknown check kind 'exec'"]


def test_near_duplicate_merging_respects_numbers_and_negation():
    def texts(items):
        return [(i.text, i.weight, i.polarity) for i in parse_rubric(json.dumps({"items": items})).items]

    # different numbers are different claims
    assert (
        len(texts([{"text": "The final answer is 42", "weight": 3}, {"text": "The final answer is 24", "weight": 3}]))
        == 2
    )
    # "is not X" rewarded contradicts "is X" rewarded: the first stands
    assert texts(
        [
            {"text": "The response is polite", "weight": 3},
            {"text": "The response is not polite", "weight": 2},
            {"text": "Mentions the cost", "weight": 1},
        ]
    ) == [("The response is polite", 3, 1), ("Mentions the cost", 1, 1)]
    # "is not X" penalised means "is X" rewarded: the same item, merged with the larger weight
    assert texts(
        [
            {"text": "The response isn't polite", "weight": 4, "polarity": -1},
            {"text": "The response is polite", "weight": 2},
            {"text": "Mentions the cost", "weight": 1},
        ]
    ) == [("The response isn't polite", 4, -1), ("Mentions the cost", 1, 1)]
    # same words, same numbers, same meaning: merged
    assert texts(
        [
            {"text": "States that 7 * 6 is 42", "weight": 2},
            {"text": "states that 7*6 is 42.", "weight": 5},
            {"text": "Is short", "weight": 1},
        ]
    )[0] == ("States that 7 * 6 is 42", 5, 1)


def _truth_checks(question: str) -> list[Check]:
    return [i.check for i in prompt_items(question) if i.origin == "ground_truth"]


def test_prompt_constraints_become_checked_items():
    q = (
        "Describe the sea in no more than 30 words. Include the word \"tide\". Do not use the word 'blue'. "
        "Start your response with the word 'Waves' and end your answer with the word calm. Use no commas."
    )
    checks = {c.kind: c.value for c in _truth_checks(q)}
    assert checks == {
        "max_words": 30.0,
        "contains": "tide",
        "not_contains": "blue",
        "starts_with": "Waves",
        "ends_with": "calm",
        "no_commas": None,
    }
    assert {c.kind for c in _truth_checks("Answer in at least five words, all in lowercase letters.")} == {
        "min_words",
        "lowercase",
    }
    assert [c.value for c in _truth_checks("Give exactly 3 bullet points about tea.")] == [3.0]
    [item] = [
        i for i in prompt_items("What is (12 + 3) * 4? Answer with the number only.") if i.origin == "ground_truth"
    ]
    assert item.check == Check(kind="final_number", value=60.0) and item.weight == 5
    assert _truth_checks("What is the capital of France?") == []
    assert _truth_checks("What is __import__('os').system('true')?") == []  # nothing but arithmetic is evaluated
    # every prompt gets the echo item: repeating the question is penalised in its own right
    [echo] = [i for i in prompt_items("What is the capital of France?") if i.origin == "echo"]
    assert echo.polarity == -1 and echo.check == Check(kind="echoes", value="What is the capital of France?")


def test_official_instructions_become_items_checked_by_the_official_checker():
    q = (
        "Describe a cat. Your entire response should be in English, and in all lowercase letters. No capital "
        "letters are allowed. Include keywords ['milk', 'window'] in the response."
    )
    [lower, keywords] = _truth_checks(q)
    assert lower.kind == keywords.kind == "instruction"
    assert json.loads(str(keywords.value)) == {"id": "keywords:existence", "kwargs": {"keywords": ["milk", "window"]}}
    assert run_check(lower, "a cat drinks milk by the window.") == 1.0
    assert run_check(lower, "A cat drinks milk by the window.") == 0.0
    assert run_check(keywords, "A cat drinks milk by the window.") == 1.0
    assert run_check(keywords, "A cat drinks milk.") == 0.0


def test_echo_check_spots_a_repeated_question_not_a_repeated_request_then_answer():
    q = "Describe a cat. Include the word 'blue'."
    assert echoes(q, q) and echoes(q, "describe a cat, include the word blue!") and echoes(q, f"Sure. {q}")
    assert not echoes(q, "A cat is a small furry animal with blue eyes.")
    assert not echoes(q, f"{q} A cat is a small furry animal with blue eyes.")  # repeats, then answers
    assert not echoes(q, "")
    with pytest.raises(CheckError, match="derived from the prompt"):
        parse_check({"kind": "instruction", "value": "{}"})  # a generator cannot claim the prompt's authority


def test_consensus_needs_a_clear_plurality():
    [item] = consensus_items(["= 42", "It is 42.", "41", "I think 40", ""])
    assert item.check == Check(kind="final_number", value=42.0)
    assert consensus_items(["42", "41", "40"]) == []  # no number reached twice
    assert consensus_items(["42", "42", "41", "41"]) == []  # a tie is no plurality
    assert consensus_items(["no numbers", "at all"]) == []


def test_calibration_against_the_calibration_answers_mean_and_the_trust_rule():
    # 3 real candidates, then 2 calibration answers with mean 0.4
    assert calibrate_row([0.7, 0.4, 0.1, 0.3, 0.5], 3) == pytest.approx([0.5, 0.0, 0.0, 0.0, 1 / 6])
    assert calibrate_row([0.9, 1.0, 1.0], 1) == [0.0, 0.0, 0.0]  # calibration answers at 1: the item says nothing
    assert calibration_outranks([0.5, 0.3], [0.31], eps=0.02) is False  # within the tie threshold
    assert calibration_outranks([0.5, 0.3], [0.45], eps=0.02) is True  # above a weak candidate: untrusted by default
    assert calibration_outranks([0.5, 0.3], [0.45], eps=0.02, rule="best") is False  # the best answer still wins
    assert calibration_outranks([0.5, 0.3], [0.51], eps=0.02, rule="best") is False  # within the tie threshold
    assert calibration_outranks([0.5, 0.3], [0.55], eps=0.02, rule="best") is True  # garbage above every real answer


def test_empty_on_top_needs_a_ranking():
    responses = ["", "It is 42.", "42"]
    assert empty_on_top([0.5, 0.5, 0.1], responses, eps=0.02)  # tied with the best: a positive advantage
    assert empty_on_top([0.6, 0.5, 0.1], responses, eps=0.02)
    assert not empty_on_top([0.1, 0.5, 0.4], responses, eps=0.02)
    # a rubric that splits nobody ranks nothing: every advantage is zero, the empty answer gains nothing
    assert all_tied([0.0, 0.0, 0.01], eps=0.02) and not empty_on_top([0.0, 0.0, 0.01], responses, eps=0.02)
    assert not empty_on_top([0.9, 0.5], ["It is 42.", "42"], eps=0.02)  # no empty response


def test_pairwise_accuracy_and_kendall_tau():
    order = [2, 0, 1]  # response 2 best, then 0, then 1
    assert pairwise_accuracy([0.5, 0.1, 0.9], order, eps=0.02) == 1.0
    assert pairwise_accuracy([0.5, 0.9, 0.1], order, eps=0.02) == 0.0
    assert pairwise_accuracy([0.5, 0.5, 0.5], order, eps=0.02) == 0.5  # ties count half
    assert kendall_tau([0.5, 0.1, 0.9], order, eps=0.02) == pytest.approx(1.0)
    assert kendall_tau([0.5, 0.9, 0.1], order, eps=0.02) == pytest.approx(-1.0)


def test_the_shipped_benchmark_is_what_its_script_generates():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from make_judge_benchmark import build
    finally:
        sys.path.pop(0)
    shipped = [json.loads(line) for line in split_lines(BENCHMARK.read_text())]
    assert shipped == build(0)
    sets = read_judge_sets(BENCHMARK)
    assert sum(not s.collapsed for s in sets) >= 60 and sum(s.collapsed for s in sets) >= 20
    assert {s.kind for s in sets} == {"arithmetic", "instruction", "factual"}


def test_instruction_sets_rank_by_the_constraints_they_meet():
    """The benchmark's ground truth for instructions is the number of constraints met; the checks the
    prompt implies must count exactly that (a broken generator would show here first)."""
    for s in read_judge_sets(BENCHMARK):
        if s.kind != "instruction" or s.collapsed:
            continue
        checks = [i.check for i in prompt_items(s.prompt) if i.origin != "floor"]  # the floor: all but empty
        met = [sum(run_check(c, r) for c in checks) for r in s.responses]
        assert [met[i] for i in s.order] == [5, 4, 3, 2, 1, 0], s.prompt


def test_eval_judge_through_the_console_script(tiny_model_dir, tmp_path):
    # short sets: the tiny model's byte-level tokenizer makes the benchmark's sets thousands of tokens
    sets = tmp_path / "sets.jsonl"
    sets.write_text(
        "".join(
            json.dumps(s) + "\n"
            for s in [
                {
                    "prompt": "What is 2 + 3?",
                    "responses": ["5", "It is 6.", ""],
                    "order": [0, 1, 2],
                    "kind": "arithmetic",
                },
                {
                    "prompt": "Say hi in at most 2 words.",
                    "responses": ["hello there friend", "hi"],
                    "order": [1, 0],
                    "kind": "instruction",
                },
                {"prompt": "What is 2 + 2?", "responses": ["4", "4."], "collapsed": True, "kind": "arithmetic"},
                {"prompt": "Say hi.", "responses": ["hi", "hi!"], "collapsed": True, "kind": "instruction"},
            ]
        )
    )
    env = tiny_judge_env(tiny_model_dir)
    script = Path(sys.executable).parent / "dynrubric"
    r = subprocess.run(
        [str(script), "eval-judge", str(sets), "--modes", "set,generic", "--out", str(tmp_path / "out")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    tail = r.stdout.strip().splitlines()[-4:]
    assert [line.split(":")[0] for line in tail] == [
        "pairwise_accuracy[set]",
        "trained_pairwise_accuracy[set]",
        "pairwise_accuracy[generic]",
        "trained_pairwise_accuracy[generic]",
    ]
    assert all(0.0 <= float(line.split(":")[1]) <= 1.0 for line in tail)
    report = json.loads((tmp_path / "out" / "eval_judge.json").read_text())
    assert [r["mode"] for r in report["results"]] == ["set", "generic"]
    assert len(report["sets"]) == 2 * 4 and (tmp_path / "out" / "eval_judge.png").read_bytes()[:4] == b"\x89PNG"
    bad = subprocess.run(
        [str(script), "eval-judge", str(sets), "--modes", "best"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "unknown mode" in bad.stderr and "Traceback" not in bad.stderr


def test_the_ordered_benchmark_counts_what_the_trainer_receives():
    """`trained_pairwise_accuracy`: an untrusted set gives every answer the same advantage, so its pairs count
    1/2 whatever its raw scores rank; a trusted set's pairs count as ranked."""
    from dynrubric.rubric.gaps import GapStats

    sets = [
        JudgeSet("q1", ["a", "b", "c"], "arithmetic", [0, 1, 2]),  # ranked right: raw 1
        JudgeSet("q2", ["a", "b", "c"], "arithmetic", [0, 1, 2]),  # ranked right but untrusted: trained 1/2
        JudgeSet("q3", ["a", "b"], "factual", [1, 0]),  # ranked wrong: 0 either way
    ]
    scores = [[0.9, 0.5, 0.1], [0.9, 0.5, 0.1], [0.8, 0.2]]
    gaps = [GapStats(0.0, 0.0, 0.0, 0.0, [], 0.0)] * 3
    r = summarise_mode(
        "set", sets, scores, gaps, [True, False, True], eps=0.02, window=1, min_mean_gap=0.1, max_nonsplit=0.5,
        rubric_sources={}, parse_failures=0, generation_tries=0, prompt_only_fallbacks=0, generic_fallbacks=0,
        dropped_checks=0, hard_verdicts=0, seconds=0.0,
    )  # fmt: skip
    assert r.by_kind["all"].pairwise_accuracy == pytest.approx((1 + 1 + 0) / 3)
    assert r.by_kind["all"].trained_pairwise_accuracy == pytest.approx((1 + 0.5 + 0) / 3)
    assert r.by_kind["arithmetic"].trained_pairwise_accuracy == pytest.approx(0.75)
    assert r.by_kind["factual"].trained_pairwise_accuracy == 0.0


def test_the_judge_on_real_output_counts_pairs_ties_and_the_advantage_sign():
    """Pairs are (pass, fail) within separated sets, ties within eps count 1/2; a set trains right when its
    passing answers get the larger mean advantage, no advantage when untrusted or tied."""
    sets = [
        RealSet("q1", ["a", "b", "c"], [True, False, False]),  # separated: 2 pairs
        RealSet("q2", ["a", "b"], [False, True]),  # separated: 1 pair
        RealSet("q3", ["a", "b"], [True, True]),  # not separated: ignored
        RealSet("q4", ["a", "b"], [True, False]),
    ]  # separated, untrusted
    scores = [[0.9, 0.5, 0.9], [0.8, 0.2], [0.1, 0.9], [0.9, 0.1]]

    def advantages(s):
        mean = sum(s) / len(s)
        return None if max(s) - min(s) < 0.02 else [x - mean for x in s]

    r = summarise_real(sets, scores, [True, True, True, False], advantages, eps=0.02)
    assert (r.sets, r.separated_sets, r.separated_pairs) == (4, 3, 4)
    # q1: 0.9 vs 0.5 won, 0.9 vs 0.9 tie (1/2); q2: 0.2 vs 0.8 lost; q4: won
    assert r.pairwise_accuracy == pytest.approx((1 + 0.5 + 0 + 1) / 4)
    # q1: passing answer's advantage 0.9 - 0.767 > 0 (right); q2: 0.2 - 0.5 < 0 (wrong); q4 untrusted
    assert (r.trains_right, r.trains_wrong, r.no_advantage) == (1, 1, 1)


def test_eval_judge_real_judges_only_the_sets_the_checker_separates(tiny_model_dir, tmp_path):
    sets = tmp_path / "real.jsonl"
    sets.write_text(
        "".join(
            json.dumps(s) + "\n"
            for s in [
                {
                    "prompt": "Say hi. Your answer must be in all lowercase letters.",
                    "responses": ["hi", "Hi"],
                    "passed": [True, False],
                },
                {"prompt": "Say hi without commas.", "responses": ["hi", "hi, you"], "passed": [True, False]},
                {"prompt": "Say hi.", "responses": ["hi", "hello"], "passed": [True, True]},
            ]
        )
    )
    env = tiny_judge_env(tiny_model_dir)
    script = Path(sys.executable).parent / "dynrubric"
    r = subprocess.run(
        [str(script), "eval-judge", str(sets), "--real", "--modes", "set", "--out", str(tmp_path / "out")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-2].startswith("pairwise_accuracy_real[set]: ")
    report = json.loads((tmp_path / "out" / "eval_judge_real.json").read_text())
    result = report["results"]["set"]
    assert (result["sets"], result["separated_sets"], result["separated_pairs"]) == (3, 2, 2)
    assert [s["passed"] for s in report["sets"]] == [[True, False], [True, False]]  # the tied set was not judged
    # lowercase and no-commas are read off the prompts: the checked items order both sets right
    assert result["pairwise_accuracy"] == 1.0, report


def test_the_shipped_real_output_sets_are_graded_by_their_prompts_ground_truth():
    from dynrubric.rubric.groundtruth import derive

    sets = read_real_sets(REPO / "dynrubric" / "data" / "judge_real.jsonl")
    assert len(sets) >= 60 and sum(s.separated for s in sets) >= 20
    for s in sets:
        truth = derive(s.prompt)
        assert truth.instructions and s.passed == [truth.passes(r) for r in s.responses], s.prompt
