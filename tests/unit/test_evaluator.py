"""The evaluator on the tiny model with the in-process TransformersEngine: prompt layout, one batched
verifier call per set, P(yes) from summed Yes/No variants, the fallback ladder and its counters."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from dynrubric.config import RubricConfig
from dynrubric.engines.base import Completion, Engine, GenerationRequest
from dynrubric.engines.hf import TransformersEngine
from dynrubric.rubric.checks import run_check
from dynrubric.rubric.evaluator import Evaluator, EvaluatorMetrics
from dynrubric.rubric.items import Rubric, RubricItem
from dynrubric.rubric.verify import CRITERION_MARK, AnswerTokens, Verifier

QUESTION = "What is 7 * 6?"
RESPONSES = ["It is 42.", "The answer is 4.", "42", "Seven times six equals forty two, so 42."]
RUBRIC = Rubric(
    items=[
        RubricItem(id="a", text="States the answer 42", weight=3, polarity=1),
        RubricItem(id="b", text="Contains a wrong number", weight=2, polarity=-1),
        RubricItem(id="c", text="Is one short sentence", weight=1, polarity=1),
    ]
)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> TransformersEngine:
    with TransformersEngine(tiny_model_dir) as e:
        yield e


class Spy(Engine):
    """Delegates to a real engine and records the calls (how many batched calls, which seeds).
    `script` replaces generate's text (a scripted rubric generator: the tiny random model never
    writes valid JSON), and `no_logprobs` returns no candidate logprobs, the fault of an engine that
    only reports its top-k (cannot be produced on demand with the real engine)."""

    def __init__(self, inner: Engine, script: list[str] | None = None, no_logprobs: bool = False):
        self.inner, self.script, self.no_logprobs = inner, script, no_logprobs
        self.policy_version = inner.policy_version
        self.score_calls: list[int] = []
        self.generate_requests: list[GenerationRequest] = []

    @property
    def tokenizer(self):
        return self.inner.tokenizer

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Completion]]:
        self.generate_requests.extend(requests)
        if self.script is None:
            return self.inner.generate(requests)
        return [[Completion(self.script.pop(0) if self.script else "", (), "stop")] for _ in requests]

    def score_next_token(self, prompts, candidates):
        self.score_calls.append(len(prompts))
        if self.no_logprobs:
            return [{} for _ in prompts]
        return self.inner.score_next_token(prompts, candidates)

    def load_weights(self, path, version):
        raise NotImplementedError


def test_answer_tokens_are_single_distinct_tokens(engine):
    answers = AnswerTokens.of(engine)
    ids = [engine.tokenizer.encode(s, add_special_tokens=False) for s in answers.all]
    assert all(len(i) == 1 for i in ids) and len({i[0] for i in ids}) == len(ids)
    assert answers.yes and answers.no


def test_verifier_prompts_share_the_response_prefix_and_go_out_in_one_call(engine):
    spy = Spy(engine)
    verifier = Verifier(spy)
    prompts = verifier.prompts(QUESTION, RESPONSES, RUBRIC)
    m = len(RUBRIC.items)
    assert len(prompts) == m * len(RESPONSES)
    for k, response in enumerate(RESPONSES):
        block = prompts[k * m : (k + 1) * m]
        prefixes = {p[: p.index(CRITERION_MARK)] for p in block}
        assert len(prefixes) == 1 and response in prefixes.pop()  # the shared prefix holds the response
        assert [p.split(CRITERION_MARK)[1].split("\n")[0] for p in block] == [i.text for i in RUBRIC.items]
    verdicts, hard = verifier.verify(QUESTION, RESPONSES, RUBRIC)
    assert spy.score_calls == [m * len(RESPONSES)] and hard == 0
    assert len(verdicts) == m and all(len(row) == len(RESPONSES) for row in verdicts)


def test_verdict_is_summed_yes_mass_over_yes_plus_no_mass(engine, tiny_model_dir):
    """Recompute v for one pair straight from the model's logits."""
    from transformers import AutoModelForCausalLM

    verifier = Verifier(engine)
    verdicts, _ = verifier.verify(QUESTION, RESPONSES[:1], RUBRIC)
    prompt = verifier.prompts(QUESTION, RESPONSES[:1], RUBRIC)[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = engine.tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        probs = model(ids).logits[0, -1].float().softmax(-1)
    tok = engine.tokenizer
    p_yes = sum(probs[tok.encode(s, add_special_tokens=False)[0]].item() for s in verifier.answers.yes)
    p_no = sum(probs[tok.encode(s, add_special_tokens=False)[0]].item() for s in verifier.answers.no)
    assert verdicts[0][0] == pytest.approx(p_yes / (p_yes + p_no), abs=1e-4)


def _metric(registry: CollectorRegistry, name: str, labels: dict[str, str] | None = None) -> float:
    value = registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


def test_invalid_generator_output_walks_the_whole_ladder_and_counts_it(engine):
    registry = CollectorRegistry()
    cfg = RubricConfig(retries=1, prompt_only_retries=1, generator_max_tokens=24, constrained=False)
    spy = Spy(engine)  # unconstrained, the tiny random model writes noise: every try fails to parse
    ev = Evaluator(spy, engine, cfg, EvaluatorMetrics(registry))
    [scored] = ev.score_sets([QUESTION], [RESPONSES])
    assert scored.rubric_source == "generic"
    # the generic rubric, joined by the item the question itself implies (7 * 6 = 42, checked)
    assert [i.text for i in scored.rubric.items if i.check is None] == [g.text for g in cfg.generic_rubric]
    assert scored.rubric.items[0].check is not None and scored.rubric.items[0].check.value == 42
    assert len(spy.generate_requests) == 4  # 2 set-conditioned + 2 prompt-only tries
    seeds = [r.params.seed for r in spy.generate_requests]
    assert len(set(seeds)) == 4  # every retry has its own seed
    assert RESPONSES[1] in spy.generate_requests[0].prompt  # set-conditioned tries show the candidates
    assert "[Candidate" not in spy.generate_requests[2].prompt  # prompt-only tries do not
    assert _metric(registry, "dynrubric_rubric_parse_failures_total") == 4
    assert _metric(registry, "dynrubric_rubric_fallbacks_total", {"kind": "prompt_only"}) == 1
    assert _metric(registry, "dynrubric_rubric_fallbacks_total", {"kind": "generic"}) == 1
    assert _metric(registry, "dynrubric_rubric_sets_total") == 1
    assert _metric(registry, "dynrubric_rubric_mean_gap_count") == 1
    assert all(0.0 <= s <= 1.0 and not math.isnan(s) for s in scored.scores)


def test_set_conditioned_prompt_shows_every_candidate_within_budget_and_retry_succeeds(engine):
    good = json.dumps(
        {
            "items": [
                {"id": "ans", "text": "States the answer 42", "weight": 4, "polarity": 1},
                {"id": "wrong", "text": "Gives a wrong number", "weight": 3, "polarity": -1},
            ]
        }
    )
    long_response = "forty two " * 400
    spy = Spy(engine, script=["I am not sure.", "Here: " + good])
    cfg = RubricConfig(response_token_budget=32, retries=1)  # the retry is what this test exercises
    ev = Evaluator(spy, engine, cfg)
    [scored] = ev.score_sets([QUESTION], [RESPONSES + [long_response]])
    # the generated items, after the checked item the question implies, the echo item and the floor item
    assert scored.rubric_source == "set" and [i.id for i in scored.rubric.items] == ["p1", "e1", "f1", "ans", "wrong"]
    assert ev.counts.parse_failures == 1 and ev.counts.generic_fallbacks == 0
    prompt = spy.generate_requests[0].prompt
    for n, r in enumerate(RESPONSES, 1):
        assert f"[Candidate {n}]\n{r}" in prompt
    assert "[Candidate 5]" in prompt and long_response not in prompt
    overhead = len(engine.tokenizer.encode(ev.rubric_generator.set_prompt(QUESTION, [""] * 5)))
    assert len(engine.tokenizer.encode(prompt)) <= overhead + 5 * (32 + 8)  # 32 tokens a candidate, an ellipsis
    assert spy.generate_requests[0].params.seed != spy.generate_requests[1].params.seed
    assert scored.generator_raw.startswith("Here:")
    assert scored.gaps.item_split and len(scored.verdicts) == 5 and len(scored.scores) == 5


def test_prompt_only_mode_never_shows_candidates(engine):
    good = json.dumps([{"text": "Says 42", "weight": 2}, {"text": "Is rude", "weight": 1, "polarity": -1}])
    spy = Spy(engine, script=[good])
    ev = Evaluator(spy, engine, RubricConfig(mode="prompt_only"))
    rubric, source, raw = ev.generate_rubric(QUESTION, RESPONSES, seed=7)
    assert source == "prompt_only" and raw == good
    assert [i.text for i in rubric.items] == [
        "The response's final number is 42.",
        "The response only repeats the question instead of answering it.",
        "The response says something (it is not empty).",
        "Says 42",
        "Is rude",
    ]
    prompt = spy.generate_requests[0].prompt
    assert QUESTION in prompt and "[Candidate" not in prompt and RESPONSES[1] not in prompt


def test_checks_mode_scores_with_the_prompts_own_ground_truth_alone(engine):
    """The ground-truth arm: no generator call, no verifier call; a prompt without a checkable constraint or answer
    gives an untrusted set (no signal), whatever its answers."""
    spy, verifier = Spy(engine), Spy(engine)
    ev = Evaluator(spy, verifier, RubricConfig(mode="checks"))
    [arith, open_prompt] = ev.score_sets([QUESTION, "Tell me about rivers."], [RESPONSES, ["Rivers flow.", ""]])
    assert spy.generate_requests == [] and verifier.score_calls == []
    assert arith.rubric_source == "checks" and arith.trusted
    assert {i.origin for i in arith.rubric.items} == {"ground_truth", "echo", "floor"}
    # "The answer is 4." misses the computed answer 42; the three others state it
    assert arith.scores[1] < min(arith.scores[0], arith.scores[2], arith.scores[3])
    assert not open_prompt.trusted and {i.origin for i in open_prompt.rubric.items} == {"echo", "floor"}


def test_checks_mode_needs_the_prompts_constraints():
    with pytest.raises(ValueError, match="prompt_constraints"):
        RubricConfig(mode="checks", prompt_constraints=False)


def test_hard_verdicts_when_logprobs_are_missing_are_counted(engine):
    registry = CollectorRegistry()
    spy = Spy(engine, no_logprobs=True)
    cfg = RubricConfig(retries=0, prompt_only_retries=0, generator_max_tokens=16, constrained=False)
    ev = Evaluator(engine, spy, cfg, EvaluatorMetrics(registry))
    [scored] = ev.score_sets([QUESTION], [RESPONSES[:2]])
    asked = sum(i.check is None for i in scored.rubric.items)  # checked items never reach the verifier
    judged = 2 + 3  # the two candidates and the three calibration answers
    assert scored.hard_verdict_fallbacks == asked * judged
    assert all(v in (0.0, 0.5, 1.0) for row in scored.raw_verdicts for v in row)
    assert _metric(registry, "dynrubric_rubric_fallbacks_total", {"kind": "hard_verdict"}) == asked * judged


def test_apply_rubric_matches_score_sets_for_the_same_rubric(engine):
    ev = Evaluator(engine, engine, RubricConfig(retries=0, prompt_only_retries=0, generator_max_tokens=16))
    [scored] = ev.score_sets([QUESTION], [RESPONSES])
    again = ev.apply_rubric(QUESTION, scored.rubric, RESPONSES)
    assert again == pytest.approx(scored.scores, abs=1e-5)
    assert ev.apply_rubric(QUESTION, scored.rubric, []) == []


def test_the_generator_prompt_carries_no_literal_example_to_copy(engine):
    spy = Spy(engine, script=[json.dumps([{"text": "Says 42", "weight": 2}, {"text": "Is rude", "weight": 1}])])
    ev = Evaluator(spy, engine, RubricConfig())
    ev.score_sets([QUESTION], [RESPONSES])
    prompt = spy.generate_requests[0].prompt
    assert "{" not in prompt.replace(QUESTION, "")  # the format is described in words, never shown as JSON
    assert spy.generate_requests[0].params.json_schema is not None  # decoding is constrained instead


class YesToAll(Spy):
    """A verifier that says Yes to everything (scripted: cannot be produced on demand)."""

    def score_next_token(self, prompts, candidates):
        return [{c: (0.0 if c.strip().lower() == "yes" else -9.0) for c in candidates} for _ in prompts]


def test_calibration_answers_debias_verdicts_and_overrule_the_generated_items_they_outrank(engine):
    """A Yes-to-everything verifier is de-biased to zero by the calibration answers; a generated check the echoed
    question meets while a real candidate misses it is overruled (weight 0), and a set left with nothing else to
    rank by is untrusted."""
    rubric = Rubric(
        items=[
            RubricItem(id="a", text="Is helpful", weight=2),
            RubricItem(id="b", text="Uses no commas", weight=1, check={"kind": "no_commas"}),
        ]
    )
    ev = Evaluator(engine, YesToAll(engine), RubricConfig(trust_rule="every"))
    judged = ev.judge(QUESTION, rubric, ["It is 42.", "Well, 42."])
    assert judged.raw_verdicts[0][:2] == pytest.approx([1.0, 1.0], abs=1e-3)
    assert judged.verdicts[0] == [0.0, 0.0]  # no better than the known-bad answers: no credit
    assert judged.verdicts[1] == [1.0, 0.0]
    assert judged.overruled == [False, True]  # the echo (no comma) beats "Well, 42." on b: b is noise here
    assert judged.scores == [0.0, 0.0] and judged.trusted  # item a still weighs (it ranks nobody: a tie)
    best_rule = Evaluator(engine, YesToAll(engine), RubricConfig(trust_rule="best"))
    kept = best_rule.judge(QUESTION, rubric, ["It is 42.", "Well, 42."])
    assert kept.overruled == [False, False] and kept.scores == pytest.approx([1 / 3, 0.0])  # the best answer wins
    only_b = Rubric(items=[rubric.items[1]])
    assert not ev.judge(QUESTION, only_b, ["It is 42.", "Well, 42."]).trusted  # nothing left to rank by


def test_the_echoed_question_never_overrules_the_prompts_own_constraint(engine):
    """Issue 24, point 1: "Include the word X": the echoed question contains X, yet candidates without X still
    rank below candidates with X and the set trains (non-zero advantages). Before, the echo's lead on the
    derived item made the whole set untrusted (zero advantage)."""
    from dynrubric.rubric.derived import FLOOR_WEIGHT
    from dynrubric.train.grpo import group_advantages

    question = "Describe the sea. Include the word 'blue'."
    cfg = RubricConfig()
    ev = Evaluator(engine, YesToAll(engine), cfg)
    generated = Rubric(items=[RubricItem(id="g1", text="The response describes the sea", weight=3)])
    rubric = ev.rubric_generator.with_derived(generated, question, [])
    assert [i.origin for i in rubric.items] == ["ground_truth", "echo", "floor", "generator"]
    responses = [
        "The sea is blue and wide.",
        "The sea is wide and deep.",
        "Waves roll in, blue and grey.",
        "It is big.",
    ]
    judged = ev.judge(question, rubric, responses)
    assert judged.trusted and not any(judged.overruled)
    with_x = [s for r, s in zip(responses, judged.scores, strict=True) if "blue" in r]
    without_x = [s for r, s in zip(responses, judged.scores, strict=True) if "blue" not in r]
    assert min(with_x) > max(without_x)
    assert run_check(rubric.items[0].check, question) == 1.0  # the echoed question does meet the constraint ...
    advantages = group_advantages(judged.scores, 1e-6, cfg.eps)  # ... and the set still trains
    assert advantages is not None and all(
        a > 0 if "blue" in r else a < 0 for r, a in zip(responses, advantages, strict=True)
    )
    # a candidate that echoes the question "contains the keyword" and still scores nothing (the echo veto);
    # the real answer: the constraint's share, and the floor item's part of the rest (g1 is de-biased to 0)
    share = cfg.ground_truth_share
    floor = (1 - share) * FLOOR_WEIGHT / (3 + FLOOR_WEIGHT)
    assert ev.judge(question, rubric, [question, responses[0]]).scores == pytest.approx([0.0, share + floor])


def test_the_floor_item_ranks_an_empty_answer_below_every_attempt_under_the_default_rule(engine):
    """The ordered benchmark's sets hold an empty and an off-topic answer beside the real attempts. An item
    that any text meets is met by the off-topic answer better than by the empty candidate, so `every` (the
    default) overrules it, and the wrong, off-topic and empty answers tied at 0 (arithmetic ranks 3-6 tied in
    22 of 22 sets). The derived floor item ("says something") is a check no calibration answer overrules: the empty
    answer ranks last, and a set without one is unchanged by it."""
    from dynrubric.rubric.derived import floor_item

    generated = [
        RubricItem(
            id="a", text="The response's final number is 42", weight=3, check={"kind": "final_number", "value": 42}
        ),
        RubricItem(
            id="b", text="The response has at least one word", weight=1, check={"kind": "min_words", "value": 1}
        ),
        RubricItem(id="c", text="The response gives a number", weight=1, check={"kind": "contains", "value": "4"}),
    ]
    responses = ["6 x 7 = 42. It is 42.", "6 x 7 = 43. It is 43.", "Tomatoes like the sun.", ""]
    ev = Evaluator(engine, engine, RubricConfig())
    judged = ev.judge(QUESTION, Rubric(items=[*generated, floor_item()]), responses)
    assert (
        judged.overruled == [False, True, False, False] and judged.trusted
    )  # b: a known-bad answer beats the empty one
    s = judged.scores
    assert s[0] > s[1] > s[2] > s[3] == 0.0, s
    without = ev.judge(QUESTION, Rubric(items=generated), responses).scores
    assert without[2] == without[3] == 0.0  # no floor: the off-topic and the empty answer tie
    # no empty candidate: the floor item is met by all and changes no ranking and no advantage's sign
    kept = ev.judge(QUESTION, Rubric(items=[*generated, floor_item()]), responses[:3]).scores
    alone = ev.judge(QUESTION, Rubric(items=generated), responses[:3]).scores
    assert sorted(range(3), key=kept.__getitem__) == sorted(range(3), key=alone.__getitem__)


def test_stored_verdicts_weighed_again_give_the_judges_scores(engine):
    """benchmarks/trust_rules.py re-weighs an eval-judge run's stored raw verdicts under each rule: `weigh` over
    a judgement's raw P(yes) must give exactly the judgement, and another rule what a judge with it gives."""
    from dynrubric.rubric.calibrate import known_bad_answers
    from dynrubric.rubric.evaluator import weigh

    rubric = Rubric(
        items=[
            RubricItem(id="a", text="Is helpful", weight=2),
            RubricItem(id="b", text="Uses no commas", weight=1, check={"kind": "no_commas"}),
        ]
    )
    responses = ["It is 42.", "Well, 42.", ""]
    for rule in ("every", "best"):
        cfg = RubricConfig(trust_rule=rule)
        judged = Evaluator(engine, engine, cfg).judge(QUESTION, rubric, responses)
        raw = [c + a for c, a in zip(judged.raw_verdicts, judged.calibration_raw_verdicts, strict=True)]
        again = weigh(rubric, responses + known_bad_answers(QUESTION), raw, len(responses), cfg)
        assert again == dataclasses.replace(judged, hard_verdict_fallbacks=0)


def test_pooled_runs_weigh_the_items_of_every_rubric_sample_as_one_rubric(engine):
    """benchmarks/judge_levers.py given runs at several rubric.seeds weighs each set with all their generated items:
    the same as judging the set under one rubric holding them all, whatever the count (past MAX_ITEMS)."""
    import sys

    from dynrubric.rubric.items import MAX_ITEMS

    benchmarks = str(Path(__file__).resolve().parents[2] / "benchmarks")
    sys.path.insert(0, benchmarks)
    try:
        import judge_levers
    finally:
        sys.path.remove(benchmarks)

    responses = ["It is 42.", "Well, 42.", "no"]
    samples = [
        [RubricItem(id=f"i{r}{m}", text=f"Criterion {r} {m}", weight=1 + m, origin="generator") for m in range(5)]
        for r in range(3)
    ]
    # no calibration answers: the tiny random verifier's items would all be overruled, every score 0
    cfg = RubricConfig(calibration_answers=False)
    ev = Evaluator(engine, engine, cfg)
    runs = []
    for items in samples:
        judged = ev.judge(QUESTION, Rubric(items=items), responses)
        runs.append(
            [
                {
                    "prompt": QUESTION,
                    "responses": responses,
                    "passed": [True, False, False],
                    "rubric": [i.model_dump() for i in items],
                    "raw_verdicts": judged.raw_verdicts,
                    "calibration_raw_verdicts": judged.calibration_raw_verdicts,
                }
            ]
        )
    [pooled] = judge_levers.pooled(runs)
    assert len(pooled["rubric"]) == 15 > MAX_ITEMS
    scores, _ = judge_levers.weigh_set(pooled, (lambda r: r, cfg))
    every = [i for items in samples for i in items]
    whole = Rubric.model_construct(items=every)
    assert scores == pytest.approx(ev.judge(QUESTION, whole, responses).scores)
    assert min(scores) > 0
    assert scores != pytest.approx(judge_levers.weigh_set(runs[0][0], (lambda r: r, cfg))[0])
    for lever in judge_levers.LEVERS.values():  # each reshapes a pooled rubric too
        judge_levers.weigh_set(pooled, lever)


def test_an_empty_response_earns_no_checked_item_of_either_polarity(engine):
    """A flaw check ("does not contain X" is good, so "contains X" at polarity -1) that no real answer
    avoids must not lift the empty answer above them: on the judge benchmark it put the empty response
    on top of 3 of 66 ordered sets."""
    rubric = Rubric(
        items=[
            RubricItem(
                id="a", text="The response's final number is 42", weight=3, check={"kind": "final_number", "value": 42}
            ),
            RubricItem(
                id="b",
                text="The response has at least one word",
                weight=3,
                polarity=-1,
                check={"kind": "min_words", "value": 0},
            ),
        ]
    )
    judged = Evaluator(engine, engine, RubricConfig()).judge(QUESTION, rubric, ["It is 42.", "It is 41.", ""])
    assert judged.scores == pytest.approx([0.5, 0.0, 0.0])
    assert judged.verdicts[1] == [1.0, 1.0, 1.0]  # the flaw is "present" in the empty answer too


def test_a_rounds_local_judges_report_each_set_as_it_is_judged(engine):
    """A step's judging takes minutes on a CPU: progress comes after each set's verdicts, not once at the end."""
    from dynrubric.config import Settings
    from dynrubric.train.executor import LocalJudges, ScoreChunk

    spy = Spy(engine)
    settings = Settings.model_validate({"rubric": {"retries": 0, "prompt_only_retries": 0, "generator_max_tokens": 16}})
    judges = LocalJudges(settings, engine, spy)
    verifier_calls_at_progress: list[int] = []
    chunks = [
        ScoreChunk([QUESTION, QUESTION], [RESPONSES, RESPONSES[:2]], seed=1),
        ScoreChunk([QUESTION], [RESPONSES], seed=2),
    ]
    results = judges.score(chunks, lambda n: verifier_calls_at_progress.extend([len(spy.score_calls)] * n))
    assert [len(r.sets) for r in results] == [2, 1]
    # one batched verifier call per set, and each set reported right after its own call
    assert verifier_calls_at_progress == [1, 2, 3] and len(spy.score_calls) == 3
