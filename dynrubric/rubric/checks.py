"""Checkable rubric items: a small declarative vocabulary of deterministic checks, no code execution.

An item may carry a `Check`; the evaluator then answers the item by running the check on the response
(1.0 = meets it, 0.0 = does not) instead of, or blended with, the verifier's P(yes). The vocabulary:

| kind          | value            | meets when                                                        |
|---------------|------------------|-------------------------------------------------------------------|
| contains      | phrase           | the phrase occurs (case-insensitive, whitespace-normalised)       |
| not_contains  | phrase           | the phrase does not occur                                         |
| regex         | pattern          | the pattern matches somewhere (`regex` module, time-limited)      |
| max_words     | N                | at most N words                                                   |
| min_words     | N                | at least N words                                                  |
| starts_with   | phrase           | the response's first words are the phrase (case-insensitive)      |
| ends_with     | phrase           | the response's last words are the phrase (trailing punctuation ok)|
| bullet_count  | N                | exactly N lines start with a bullet (-, *, +, or "1." style)      |
| final_number  | X                | the last number in the response equals X (1e-9 relative)          |
| no_commas     | (none)           | the response has no comma                                         |
| lowercase     | (none)           | the response has no upper-case letter                             |
| instruction   | {id, kwargs}     | the official IFEval checker of that instruction passes (instructions.py) |
| echoes        | the question     | the response only repeats the question (`echoes` below)           |

`instruction` and `echoes` are written by derived.py from the prompt itself; a generator cannot write
them (`parse_check` refuses them), so no generated item can claim the authority of the prompt's own
ground truth.

An empty (whitespace-only) response meets no check: "at most 50 words" or "no commas" say nothing
about an answer that was never given, and an empty answer must never win on technicalities.
"""

from __future__ import annotations

import difflib
import math
import re
from typing import Any, Literal

import regex
from pydantic import BaseModel, ConfigDict, Field

from dynrubric.rubric.instructions import parse_instruction

CheckKind = Literal[
    "contains",
    "not_contains",
    "regex",
    "max_words",
    "min_words",
    "starts_with",
    "ends_with",
    "bullet_count",
    "final_number",
    "no_commas",
    "lowercase",
    "instruction",
    "echoes",
]
PHRASE_KINDS = frozenset({"contains", "not_contains", "starts_with", "ends_with"})
COUNT_KINDS = frozenset({"max_words", "min_words", "bullet_count"})
NO_VALUE_KINDS = frozenset({"no_commas", "lowercase"})
DERIVED_ONLY_KINDS = frozenset({"instruction", "echoes"})  # written from the prompt, never by a generator
ECHO_MIN_COVER = 0.8  # share of the question's words (in order) an echo repeats ...
ECHO_MAX_NEW_WORDS = 3  # ... adding at most this many words of its own
MAX_PHRASE_CHARS = 200
MAX_COUNT = 100_000
REGEX_TIMEOUT_S = 0.05  # a pathological pattern is cut off, and the check counts as not met

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_BULLET = re.compile(r"^\s*(?:[-*+\u2022]|\d{1,3}[.)])\s+\S")
_EDGE_PUNCT = ".,;:!?\"'()[]{}*_`"


class CheckError(ValueError):
    """A check that cannot be run as written; `reason` says what is wrong with it."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(reason)


class Check(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: CheckKind
    value: str | float | None = Field(default=None)

    def describe(self) -> str:
        return self.kind if self.value is None else f"{self.kind} {self.value!r}"


def _words(text: str) -> list[str]:
    return text.split()


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def _strip_edges(text: str) -> str:
    return _norm(text).strip(_EDGE_PUNCT + " ")


def final_number(text: str) -> float | None:
    """The last number written in `text` (thousands separators allowed), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def echoes(question: str, response: str) -> bool:
    """The response only repeats the question: it holds at least `ECHO_MIN_COVER` of the question's words in
    order, and at most `ECHO_MAX_NEW_WORDS` words besides (case and punctuation aside). A short answer that
    shares a few words with the question is not an echo, nor is a response that repeats the request and
    then answers it (an instruction some prompts give)."""
    asked = _alnum_words(question)
    said = _alnum_words(response)
    if not said or not asked:
        return False
    matcher = difflib.SequenceMatcher(None, asked, said, autojunk=False)
    kept = sum(block.size for block in matcher.get_matching_blocks())
    return kept >= ECHO_MIN_COVER * len(asked) and len(said) - kept <= ECHO_MAX_NEW_WORDS


def _alnum_words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def parse_check(raw: Any) -> Check:
    """A validated Check from what a generator wrote, or CheckError saying what is wrong."""
    if not isinstance(raw, dict):
        raise CheckError(f"a check must be an object with kind and value, got {type(raw).__name__}")
    kind = raw.get("kind", raw.get("type"))
    if not isinstance(kind, str):
        raise CheckError("a check needs a kind")
    kind = kind.strip().lower().replace("-", "_").replace(" ", "_")
    if kind in DERIVED_ONLY_KINDS:
        raise CheckError(f"check kind {kind!r} is derived from the prompt itself, not written by a generator")
    value = raw.get("value", raw.get("arg"))
    if kind in NO_VALUE_KINDS:
        return Check(kind=kind)  # type: ignore[arg-type]
    if kind in PHRASE_KINDS or kind == "regex":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str) or not value.strip():
            raise CheckError(f"check {kind} needs a non-empty text value")
        if len(value) > MAX_PHRASE_CHARS:
            raise CheckError(f"check {kind} value is longer than {MAX_PHRASE_CHARS} characters")
        if kind == "regex":
            try:
                regex.compile(value)
            except regex.error as e:
                raise CheckError(f"check regex does not compile: {e}") from None
        return Check(kind=kind, value=value.strip() if kind != "regex" else value)  # type: ignore[arg-type]
    if kind in COUNT_KINDS or kind == "final_number":
        if isinstance(value, str):
            try:
                value = float(value.strip().replace(",", ""))
            except ValueError:
                raise CheckError(f"check {kind} needs a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise CheckError(f"check {kind} needs a finite number")
        if kind in COUNT_KINDS:
            if value != int(value) or not 0 <= value <= MAX_COUNT:
                raise CheckError(f"check {kind} needs a whole number from 0 to {MAX_COUNT}")
            value = int(value)
        return Check(kind=kind, value=float(value))  # type: ignore[arg-type]
    raise CheckError(f"unknown check kind {kind!r}")


def run_check(check: Check, response: str) -> float:
    """1.0 when `response` meets the check, else 0.0. Never raises."""
    if not response.strip():
        return 0.0
    kind, value = check.kind, check.value
    if kind == "contains":
        return float(_norm(str(value)) in _norm(response))
    if kind == "not_contains":
        return float(_norm(str(value)) not in _norm(response))
    if kind == "starts_with":
        return float(_strip_edges(response).startswith(_strip_edges(str(value))))
    if kind == "ends_with":
        return float(_strip_edges(response).endswith(_strip_edges(str(value))))
    if kind == "max_words":
        return float(len(_words(response)) <= float(value))  # type: ignore[arg-type]
    if kind == "min_words":
        return float(len(_words(response)) >= float(value))  # type: ignore[arg-type]
    if kind == "bullet_count":
        bullets = sum(bool(_BULLET.match(line)) for line in response.splitlines())
        return float(bullets == int(value))  # type: ignore[arg-type]
    if kind == "final_number":
        got = final_number(response)
        want = float(value)  # type: ignore[arg-type]
        return float(got is not None and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9))
    if kind == "no_commas":
        return float("," not in response)
    if kind == "lowercase":
        return float(response == response.lower())
    if kind == "instruction":
        return float(parse_instruction(str(value)).follows(response))
    if kind == "echoes":
        return float(echoes(str(value), response))
    try:  # regex
        return float(regex.search(str(value), response, timeout=REGEX_TIMEOUT_S) is not None)
    except TimeoutError:
        return 0.0
