"""The shipped prompt file (dynrubric/data/prompts.jsonl, written by us) and its checkable signals.

One JSON object per line:
    {"id": "arith-01", "kind": "arithmetic", "messages": [...chat...], "answer": "42"}
    {"id": "constraint-05", "kind": "constraint", "messages": [...], "constraint": {"type": "include_word", "word": "blue"}}
    {"id": "open-01", "kind": "open", "messages": [...]}
Constraint types: one_word | include_word {word} | max_words {n} | lowercase | starts_with {prefix}.
`check(item, response)` says whether a response meets the checkable signal (None for open questions):
simulated users turn it into feedback, tests into an oracle.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dynrubric.errors import DynrubricError
from streaming.events import ChatMessage


class Constraint(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["one_word", "include_word", "max_words", "lowercase", "starts_with"]
    word: str | None = None
    n: int | None = Field(default=None, ge=1)
    prefix: str | None = None

    @model_validator(mode="after")
    def _has_parameter(self) -> Constraint:
        needed = {"include_word": "word", "max_words": "n", "starts_with": "prefix"}.get(self.type)
        if needed and getattr(self, needed) is None:
            raise ValueError(f"constraint {self.type} needs `{needed}`")
        return self


class PromptItem(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1)
    kind: Literal["arithmetic", "constraint", "open"]
    messages: list[ChatMessage] = Field(min_length=1)
    answer: str | None = None
    constraint: Constraint | None = None

    @model_validator(mode="after")
    def _checkable_field(self) -> PromptItem:
        if self.kind == "arithmetic" and self.answer is None:
            raise ValueError("an arithmetic prompt needs `answer`")
        if self.kind == "constraint" and self.constraint is None:
            raise ValueError("a constraint prompt needs `constraint`")
        return self


def default_path() -> Path:
    return Path(str(resources.files("dynrubric").joinpath("data", "prompts.jsonl")))


def load_prompts(path: Path | None = None) -> list[PromptItem]:
    path = Path(path) if path else default_path()
    items = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                items.append(PromptItem.model_validate_json(line))
            except ValueError as e:
                raise DynrubricError(f"{path}:{n} is not a valid prompt line: {e}", "see streaming/prompts.py") from None
    return items


_WORD = re.compile(r"[A-Za-z0-9']+")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def check(item: PromptItem, response: str) -> bool | None:
    """True/False when the response meets/misses the item's checkable signal; None for open questions."""
    text = response.strip()
    if item.kind == "arithmetic":
        numbers = _NUMBER.findall(text.replace(",", ""))
        return bool(numbers) and float(numbers[0]) == float(item.answer)
    if item.kind == "open":
        return None
    c = item.constraint
    words = _WORD.findall(text)
    if c.type == "one_word":
        return len(words) == 1
    if c.type == "include_word":
        return c.word.lower() in (w.lower() for w in words)
    if c.type == "max_words":
        return 0 < len(words) <= c.n
    if c.type == "lowercase":
        return bool(text) and text == text.lower()
    return text.startswith(c.prefix)
