"""The official IFEval instructions: an instruction's id and arguments, its description and its checker.

Google's own checkers (PyPI `if-verifiable`, `if_verifiable.ifeval`) answer whether a response follows
an instruction, never a copy of them. `Instruction.describe()` is the official `build_description`
text, which is what a prompt says to ask for the instruction (groundtruth.py reads it back).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

#: official IFEval instruction ids whose checker runs here (no NLTK data download), with the arguments
#: `build_description` takes; the checker is `if_verifiable.ifeval.instructions_registry.INSTRUCTION_DICT[id]`
SUPPORTED: dict[str, tuple[str, ...]] = {
    "keywords:existence": ("keywords",),
    "keywords:frequency": ("keyword", "frequency", "relation"),
    "keywords:forbidden_words": ("forbidden_words",),
    "keywords:letter_frequency": ("letter", "let_frequency", "let_relation"),
    "language:response_language": ("language",),
    "length_constraints:number_paragraphs": ("num_paragraphs",),
    "length_constraints:number_words": ("num_words", "relation"),
    "length_constraints:nth_paragraph_first_word": ("num_paragraphs", "nth_paragraph", "first_word"),
    "detectable_content:number_placeholders": ("num_placeholders",),
    "detectable_content:postscript": ("postscript_marker",),
    "detectable_format:number_bullet_lists": ("num_bullets",),
    "detectable_format:constrained_response": (),
    "detectable_format:number_highlighted_sections": ("num_highlights",),
    "detectable_format:multiple_sections": ("section_spliter", "num_sections"),
    "detectable_format:json_format": (),
    "detectable_format:title": (),
    "combination:two_responses": (),
    "combination:repeat_prompt": ("prompt_to_repeat",),
    "startend:end_checker": ("end_phrase",),
    "startend:quotation": (),
    "change_case:english_capital": (),
    "change_case:english_lowercase": (),
    "punctuation:no_comma": (),
}
RELATIONS = ("less than", "at least")  # the official checkers' comparison relations


class Instruction(BaseModel):
    """One official IFEval instruction: its id and the arguments its description was built with."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @field_validator("id")
    @classmethod
    def _supported(cls, v: str) -> str:
        if v not in SUPPORTED:
            raise ValueError(f"instruction {v!r} is not supported (supported: {', '.join(SUPPORTED)})")
        return v

    def key(self) -> str:
        """A canonical JSON text of the instruction (a check's value, a cache key)."""
        return json.dumps({"id": self.id, "kwargs": self.kwargs}, sort_keys=True, ensure_ascii=False)

    def describe(self) -> str:
        """The official description of the instruction (what a prompt says to ask for it)."""
        return _checker(self.key()).description

    def follows(self, response: str) -> bool:
        """The official checker's verdict; an empty response follows no instruction."""
        return bool(response.strip()) and _checker(self.key()).check(response)


def parse_instruction(obj: Any) -> Instruction:
    """An `Instruction` from `{"id": ..., "kwargs": {...}}` (a check's value, a prompt file's field)."""
    if isinstance(obj, str):
        obj = json.loads(obj)
    return Instruction.model_validate(obj)


# ---------------------------------------------------------------- the official checkers
class _Official:
    """One built official checker: its description and its verdict function."""

    def __init__(self, description: str, check: Callable[[str], bool]):
        self.description = description
        self.check = check


@cache
def _checker(key: str) -> _Official:
    """The official checker of an instruction, built once per (id, kwargs)."""
    import langdetect

    # the English-only case checkers call langdetect, which samples: seed it so a verdict is a function of
    # the text (the official evaluation leaves it unseeded)
    langdetect.DetectorFactory.seed = 0
    from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT

    spec = json.loads(key)
    checker = INSTRUCTION_DICT[spec["id"]](spec["id"])
    description = checker.build_description(**spec["kwargs"])

    def check(response: str) -> bool:
        try:
            return bool(checker.check_following(response))
        except Exception:  # noqa: BLE001 - an official checker that cannot read a response: not followed
            return False

    return _Official(description, check)
