"""The evaluator on the tiny model with the in-process TransformersEngine: prompt layout, one batched
verifier call per set, P(yes) from summed Yes/No variants, the fallback ladder and its counters."""

from __future__ import annotations

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
from dynrubric.rubric.evaluator import Evaluator, EvaluatorMetrics
from dynrubric.rubric.items import Rubric, RubricItem
from dynrubric.rubric.verify import CRITERION_MARK, AnswerTokens, Verifier

QUESTION = "What is 7 * 6?"
RESPONSES = ["It is 42.", "The answer is 4.", "42", "Seven times six equals forty two, so 42."]
RUBRIC = Rubric(items=[
    RubricItem(id="a", text="States the answer 42", weight=3, polarity=1),
    RubricItem(id="b", text="Contains a wrong number", weight=2, polarity=-1),
    RubricItem(id="c", text="Is one short sentence", weight=1, polarity=1),
])


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
    cfg = RubricConfig(retries=1, prompt_only_retries=1, generator_max_tokens=24)
    spy = Spy(engine)  # the tiny random model writes noise: every try fails to parse
    ev = Evaluator(spy, engine, cfg, EvaluatorMetrics(registry))
    [scored] = ev.score_sets([QUESTION], [RESPONSES])
    assert scored.rubric_source == "generic"
    assert [i.text for i in scored.rubric.items] == [g.text for g in cfg.generic_rubric]
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
    good = json.dumps({"items": [
        {"id": "ans", "text": "States the answer 42", "weight": 4, "polarity": 1},
        {"id": "wrong", "text": "Gives a wrong number", "weight": 3, "polarity": -1},
    ]})
    long_response = "forty two " * 400
    spy = Spy(engine, script=["I am not sure.", "Here: " + good])
    cfg = RubricConfig(response_token_budget=32, retries=1)  # the retry is what this test exercises
    ev = Evaluator(spy, engine, cfg)
    [scored] = ev.score_sets([QUESTION], [RESPONSES + [long_response]])
    assert scored.rubric_source == "set" and [i.id for i in scored.rubric.items] == ["ans", "wrong"]
    assert ev.counts.parse_failures == 1 and ev.counts.generic_fallbacks == 0
    prompt = spy.generate_requests[0].prompt
    for n, r in enumerate(RESPONSES, 1):
        assert f"[Candidate {n}]\n{r}" in prompt
    assert "[Candidate 5]" in prompt and long_response not in prompt
    assert len(engine.tokenizer.encode(prompt)) < 32 * 5 + 600
    assert spy.generate_requests[0].params.seed != spy.generate_requests[1].params.seed
    assert scored.generator_raw.startswith("Here:")
    assert scored.gaps.item_split and len(scored.verdicts) == 2 and len(scored.scores) == 5


def test_prompt_only_mode_never_shows_candidates(engine):
    good = json.dumps([{"text": "Says 42", "weight": 2}, {"text": "Is rude", "weight": 1, "polarity": -1}])
    spy = Spy(engine, script=[good])
    ev = Evaluator(spy, engine, RubricConfig(mode="prompt_only"))
    rubric, source, raw = ev.generate_rubric(QUESTION, RESPONSES, seed=7)
    assert source == "prompt_only" and raw == good and len(rubric.items) == 2
    prompt = spy.generate_requests[0].prompt
    assert QUESTION in prompt and "[Candidate" not in prompt and RESPONSES[1] not in prompt


def test_hard_verdicts_when_logprobs_are_missing_are_counted(engine):
    registry = CollectorRegistry()
    spy = Spy(engine, no_logprobs=True)
    ev = Evaluator(engine, spy, RubricConfig(retries=0, prompt_only_retries=0, generator_max_tokens=16), EvaluatorMetrics(registry))
    [scored] = ev.score_sets([QUESTION], [RESPONSES[:2]])
    m = len(scored.rubric.items)
    assert scored.hard_verdict_fallbacks == m * 2
    assert all(v in (0.0, 0.5, 1.0) for row in scored.verdicts for v in row)
    assert _metric(registry, "dynrubric_rubric_fallbacks_total", {"kind": "hard_verdict"}) == m * 2


def test_apply_rubric_matches_score_sets_for_the_same_rubric(engine):
    ev = Evaluator(engine, engine, RubricConfig(retries=0, prompt_only_retries=0, generator_max_tokens=16))
    [scored] = ev.score_sets([QUESTION], [RESPONSES])
    again = ev.apply_rubric(QUESTION, scored.rubric, RESPONSES)
    assert again == pytest.approx(scored.scores, abs=1e-5)
    assert ev.apply_rubric(QUESTION, scored.rubric, []) == []


def test_a_rubric_that_copies_the_format_example_is_a_counted_failure(engine):
    from dynrubric.rubric.generate import EXAMPLE_ITEMS

    copied = json.dumps({"items": [{"text": EXAMPLE_ITEMS[0], "weight": 5}, {"text": "Is concise", "weight": 1}]})
    good = json.dumps([{"text": "Says 42", "weight": 2}, {"text": "Is rude", "weight": 1, "polarity": -1}])
    spy = Spy(engine, script=[copied, good])
    ev = Evaluator(spy, engine, RubricConfig())
    [scored] = ev.score_sets([QUESTION], [RESPONSES])
    assert [i.text for i in scored.rubric.items] == ["Says 42", "Is rude"]
    assert ev.counts.parse_failures == 1
    assert "format example" in ev.counts.reasons[0]
