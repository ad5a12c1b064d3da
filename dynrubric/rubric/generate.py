"""Rubric generation: the generator sees the question and ALL K candidates and writes items that split them.

Ladder per set (every step counted by the caller): set-conditioned tries (1 + `retries`, each with a
new seed) -> prompt-only tries (1 + `prompt_only_retries`) -> the configured generic rubric. With
`mode="prompt_only"` the first rung is skipped (the comparison baseline of the paper). Tries of many sets
run as one batched `generate` call per rung and attempt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from dynrubric.config import RubricConfig
from dynrubric.engines.base import Engine, GenerationRequest, SamplingParams
from dynrubric.rubric.items import Rubric, RubricParseError, parse_rubric, rubric_from_items
from dynrubric.rubric.verify import truncate_tokens

RubricSource = Literal["set", "prompt_only", "generic"]

EXAMPLE_ITEMS = ("The response gives the final answer 42.", "The response contains a calculation error.")
FORMAT = (
    'Answer with JSON only, in this form:\n'
    f'{{"items": [{{"id": "c1", "text": "{EXAMPLE_ITEMS[0]}", "weight": 5, "polarity": 1}},\n'
    f'           {{"id": "c2", "text": "{EXAMPLE_ITEMS[1]}", "weight": 4, "polarity": -1}}]}}\n'
    "Each item is a yes/no check of one property of a response. weight is an integer from 1 (minor) "
    "to 5 (essential); polarity is 1 for a good property and -1 for a flaw. Write 3 to 8 items."
)
SET_INSTRUCTIONS = (
    "You write grading rubrics. Below are a question and several candidate responses to it. Write rubric "
    "items that tell the better candidates from the worse ones: prefer checks that some candidates pass "
    "and others fail, not checks that all of them pass or all fail.\n\n"
)
PROMPT_ONLY_INSTRUCTIONS = (
    "You write grading rubrics. Below is a question. Write rubric items that a good response to it "
    "must meet and flaws it must avoid.\n\n"
)
_EXAMPLE_KEYS = frozenset(" ".join(t.lower().rstrip(".").split()) for t in EXAMPLE_ITEMS)


def _normalised(text: str) -> str:
    return " ".join(text.lower().rstrip(".").split())


# tokens of instructions, format and chat template around the candidates; the rest is for the candidates
_OVERHEAD_TOKENS = 320


@dataclass
class GenerationCounts:
    parse_failures: int = 0
    prompt_only_fallbacks: int = 0
    generic_fallbacks: int = 0
    reasons: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class GeneratedRubric:
    rubric: Rubric
    source: RubricSource
    raw: str  # the generator output the rubric came from (for the generic rubric: the last failed one)


class RubricGenerator:
    def __init__(self, engine: Engine, config: RubricConfig):
        self.engine = engine
        self.config = config
        self.generic = rubric_from_items([(i.text, i.weight, i.polarity) for i in config.generic_rubric])

    def candidate_budget(self, k: int) -> int:
        """Tokens per candidate so that the prompt and the answer fit the generator's context."""
        room = self.config.generator_context_tokens - self.config.generator_max_tokens - _OVERHEAD_TOKENS
        return max(8, min(self.config.response_token_budget, room // max(k, 1)))

    def set_prompt(self, question: str, responses: Sequence[str]) -> str:
        budget = self.candidate_budget(len(responses))
        shown = "\n\n".join(
            f"[Candidate {n}]\n{truncate_tokens(self.engine, r, budget)}" for n, r in enumerate(responses, 1)
        )
        user = f"{SET_INSTRUCTIONS}Question:\n{question}\n\n{shown}\n\n{FORMAT}"
        return self.engine.render_chat([{"role": "user", "content": user}])

    def prompt_only_prompt(self, question: str) -> str:
        user = f"{PROMPT_ONLY_INSTRUCTIONS}Question:\n{question}\n\n{FORMAT}"
        return self.engine.render_chat([{"role": "user", "content": user}])

    def _try(self, prompts: list[str], seeds: list[int]) -> list[tuple[Rubric | None, str, str]]:
        """(rubric or None, raw output, failure reason) per prompt, one batched generate call."""
        requests = [
            GenerationRequest(
                p,
                SamplingParams(
                    max_tokens=self.config.generator_max_tokens,
                    temperature=self.config.generator_temperature,
                    seed=s,
                ),
            )
            for p, s in zip(prompts, seeds, strict=True)
        ]
        out = []
        for completions in self.engine.generate(requests):
            raw = completions[0].text if completions else ""
            try:
                rubric = parse_rubric(raw, self.config.max_items)
            except RubricParseError as e:
                out.append((None, raw, e.reason))
                continue
            # small generators echo the format example; its items judge nothing about this question
            copied = [i.text for i in rubric.items if _normalised(i.text) in _EXAMPLE_KEYS]
            if copied:
                out.append((None, raw, f"copies the format example's item {copied[0]!r}"))
            else:
                out.append((rubric, raw, ""))
        return out

    def generate_many(
        self, questions: Sequence[str], candidate_sets: Sequence[Sequence[str]], seed: int
    ) -> tuple[list[GeneratedRubric], GenerationCounts]:
        """One rubric per set. Attempt `a` samples with seed `seed + a` for every set still without a
        rubric: equal sampling parameters keep the sets of one attempt in one engine batch."""
        counts = GenerationCounts()
        result: list[GeneratedRubric | None] = [None] * len(questions)
        last_raw = [""] * len(questions)
        rungs: list[tuple[RubricSource, int]] = []
        if self.config.mode == "set":
            rungs.append(("set", 1 + self.config.retries))
        rungs.append(("prompt_only", 1 + self.config.prompt_only_retries))
        attempt_no = 0
        for source, attempts in rungs:
            if source == "prompt_only" and self.config.mode == "set":
                counts.prompt_only_fallbacks += sum(r is None for r in result)
            for _ in range(attempts):
                todo = [i for i, r in enumerate(result) if r is None]
                if not todo:
                    break
                prompts = [
                    self.set_prompt(questions[i], candidate_sets[i])
                    if source == "set"
                    else self.prompt_only_prompt(questions[i])
                    for i in todo
                ]
                tried = self._try(prompts, [seed + attempt_no] * len(todo))
                attempt_no += 1
                for i, (rubric, raw, reason) in zip(todo, tried, strict=True):
                    if rubric is None:
                        last_raw[i] = raw
                        counts.parse_failures += 1
                        counts.reasons.append(reason)
                    else:
                        result[i] = GeneratedRubric(rubric, source, raw)
        for i, r in enumerate(result):
            if r is None:
                counts.generic_fallbacks += 1
                result[i] = GeneratedRubric(self.generic, "generic", last_raw[i])
        return [r for r in result if r is not None], counts
