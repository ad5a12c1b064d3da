"""Rubric generation: the generator sees the question and ALL K candidates and writes items that split them.

Ladder per set (every step counted by the caller): set-conditioned tries (1 + `retries`, each with a
new seed) -> prompt-only tries (1 + `prompt_only_retries`) -> the configured generic rubric. With
`mode="prompt_only"` the first rung is skipped (the comparison baseline of the paper); `mode="generic"`
uses the generic rubric alone (the floor every generated rubric must beat); `mode="checks"` writes no rubric at all:
the items derived from the prompt's own ground truth are the whole rubric (no judge; a prompt without a checkable
constraint or answer gets only the echo veto and the floor item, which rank nothing: its set is untrusted, no
signal). Tries of many sets run as one
batched `generate` call per rung and attempt, decoded under the rubric's JSON Schema (`rubric_schema`).
Every rubric, whatever its rung, is then joined by the items derived without a model (derived.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

from dynrubric.config import RubricConfig
from dynrubric.engines.base import Engine, GenerationRequest, SamplingParams
from dynrubric.engines.grammar import json_text
from dynrubric.rubric.derived import consensus_items, prompt_items
from dynrubric.rubric.items import (
    MAX_ITEMS,
    Rubric,
    RubricItem,
    RubricParseError,
    merge_items,
    parse_rubric,
    rubric_from_items,
)
from dynrubric.rubric.verify import truncate_tokens

RubricSource = Literal["set", "prompt_only", "generic", "checks"]
RUBRIC_SOURCES: tuple[RubricSource, ...] = get_args(RubricSource)

GENERATED_ITEMS = (2, 4)  # items the generator writes; derived items (derived.py) join them
ITEM_TEXT_CHARS = (8, 80)
_PHRASE_KINDS = ["contains", "not_contains", "starts_with", "ends_with"]
_COUNT_KINDS = ["max_words", "min_words", "bullet_count"]


def rubric_schema() -> dict[str, object]:
    """The JSON Schema generation is decoded under: bounded so that a rubric always finishes inside
    `generator_max_tokens` (4 items of at most ~55 tokens: 256 is enough), with the check vocabulary of checks.py."""
    phrase = json_text(1, 40)
    check = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"kind": {"enum": _PHRASE_KINDS}, "value": phrase},
                "required": ["kind", "value"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {
                    "kind": {"enum": _COUNT_KINDS},
                    "value": {"type": "integer", "minimum": 0, "maximum": 1000},
                },
                "required": ["kind", "value"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {"kind": {"enum": ["final_number"]}, "value": {"type": "number"}},
                "required": ["kind", "value"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {"kind": {"enum": ["no_commas", "lowercase"]}},
                "required": ["kind"],
                "additionalProperties": False,
            },
        ]
    }
    item = {
        "type": "object",
        "properties": {
            # every item starts "The response ": a small model then writes a claim about a response,
            # not numbering or an echo of the question
            "text": {
                "type": "string",
                "pattern": f"^The response [a-z][ !#-\\[\\]-~]{{{ITEM_TEXT_CHARS[0]},{ITEM_TEXT_CHARS[1]}}}$",
            },
            "weight": {"type": "integer", "minimum": 1, "maximum": 5},
            "polarity": {"enum": [1, -1]},
            "check": check,
        },
        "required": ["text", "weight", "polarity"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": item, "minItems": GENERATED_ITEMS[0], "maxItems": GENERATED_ITEMS[1]}
        },
        "required": ["items"],
        "additionalProperties": False,
    }


# key order matters: the grammar writes properties in schema order, so "text" comes first
RUBRIC_SCHEMA_JSON = json.dumps(rubric_schema(), separators=(",", ":"))

# The format is described in words: small models copy a literal example back instead of writing items.
FORMAT = (
    'Answer with a JSON object whose key "items" holds a list of 2 to 4 rubric items. Each item has '
    '"text" (one short yes/no check of a response, specific to this question, starting "The response"), "weight" '
    '(an integer: 5 essential, 1 minor) and "polarity" (1 when meeting it is good, -1 when it is a '
    'flaw). When the property is mechanical, add "check" with "kind" one of contains, '
    'not_contains, starts_with, ends_with (with a short "value" phrase), max_words, min_words, '
    'bullet_count (with a whole-number "value"), final_number (with the number as "value"), '
    "no_commas or lowercase."
)
SET_INSTRUCTIONS = (
    "You write grading rubrics. Below are a question and several candidate responses to it. Write rubric "
    "items that tell the better candidates from the worse ones: prefer checks that some candidates pass "
    "and others fail, not checks that all of them pass or all fail. Name the exact answer, word or "
    "number a correct response must give where you can.\n\n"
)
PROMPT_ONLY_INSTRUCTIONS = (
    "You write grading rubrics. Below is a question. Write rubric items that a good response to it "
    "must meet and flaws it must avoid.\n\n"
)


# tokens of instructions, format and chat template around the candidates; the rest is for the candidates
_OVERHEAD_TOKENS = 320


@dataclass
class GenerationCounts:
    parse_failures: int = 0
    prompt_only_fallbacks: int = 0
    generic_fallbacks: int = 0
    dropped_checks: int = 0
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

    def _try(self, prompts: list[str], seeds: list[int]) -> list[tuple[Rubric | None, str, str, list[str]]]:
        """(rubric or None, raw output, failure reason, dropped-check reasons) per prompt, in one
        batched generate call, decoded under the rubric schema unless `constrained` is off."""
        schema = RUBRIC_SCHEMA_JSON if self.config.constrained else None
        requests = [
            GenerationRequest(
                p,
                SamplingParams(
                    max_tokens=self.config.generator_max_tokens,
                    temperature=self.config.generator_temperature,
                    seed=s,
                    json_schema=schema,
                    frequency_penalty=self.config.generator_frequency_penalty,
                ),
            )
            for p, s in zip(prompts, seeds, strict=True)
        ]
        out: list[tuple[Rubric | None, str, str, list[str]]] = []
        for completions in self.engine.generate(requests):
            raw = completions[0].text if completions else ""
            notes: list[str] = []
            try:
                rubric = parse_rubric(raw, self.config.max_items, notes, self.config.stated_checks_only)
            except RubricParseError as e:
                out.append((None, raw, e.reason, notes))
                continue
            out.append((rubric, raw, "", notes))
        return out

    def with_derived(self, rubric: Rubric, question: str, responses: Sequence[str]) -> Rubric:
        """`rubric` joined by the items derived without a model: the question's stated constraints,
        and (set mode) the candidates' consensus answer when no answer follows from the question.
        Derived items come first, so a generated near-duplicate merges into them."""
        derived: list[RubricItem] = prompt_items(question) if self.config.prompt_constraints else []
        if (
            self.config.mode == "set"
            and self.config.consensus
            and not any(i.check is not None and i.check.kind == "final_number" for i in derived)
        ):
            derived += consensus_items(responses)
        if not derived:
            return rubric
        raw = [(i.id, i.text, i.weight, i.polarity, i.check) for i in [*derived, *rubric.items]]
        # derived items come first, so merging keeps their ids (a generated item's clashing id is renamed)
        origin = {i.id: i.origin for i in derived}
        return Rubric(
            items=[
                i.model_copy(update={"origin": origin.get(i.id, "generator")})
                for i in merge_items(raw, max_items=MAX_ITEMS)
            ]
        )

    def generate_many(
        self, questions: Sequence[str], candidate_sets: Sequence[Sequence[str]], seed: int
    ) -> tuple[list[GeneratedRubric], GenerationCounts]:
        """One rubric per set. Attempt `a` samples with seed `seed + a` for every set still without a
        rubric: equal sampling parameters keep the sets of one attempt in one engine batch."""
        counts = GenerationCounts()
        if self.config.mode == "checks":  # no model: the prompt's checked ground truth, echo veto and floor item
            return [GeneratedRubric(Rubric(items=prompt_items(q)), "checks", "") for q in questions], counts
        result: list[GeneratedRubric | None] = [None] * len(questions)
        last_raw = [""] * len(questions)
        rungs: list[tuple[RubricSource, int]] = []
        if self.config.mode == "set":
            rungs.append(("set", 1 + self.config.retries))
        if self.config.mode != "generic":
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
                for i, (rubric, raw, reason, dropped) in zip(todo, tried, strict=True):
                    counts.dropped_checks += len(dropped)
                    counts.reasons.extend(dropped)
                    if rubric is None:
                        last_raw[i] = raw
                        counts.parse_failures += 1
                        counts.reasons.append(reason)
                    else:
                        result[i] = GeneratedRubric(rubric, source, raw)
        for i, r in enumerate(result):
            if r is None:
                counts.generic_fallbacks += self.config.mode != "generic"  # generic mode is no fallback
                r = GeneratedRubric(self.generic, "generic", last_raw[i])
            result[i] = GeneratedRubric(self.with_derived(r.rubric, questions[i], candidate_sets[i]), r.source, r.raw)
        return [r for r in result if r is not None], counts
