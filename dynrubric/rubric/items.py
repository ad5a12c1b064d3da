"""Rubric items: the strict schema, and a parser tolerant of what a small generator actually writes.

`parse_rubric(raw)` returns a valid `Rubric` or raises `RubricParseError` with the reason; it never
raises anything else. What it tolerates, in order:

1. JSON anywhere in the text: inside ```code fences```, or the first balanced `{...}`/`[...]` that
   decodes, with reasoning before and after it;
2. repairs of near-JSON: trailing commas, single quotes, Python literals (`True`, `None`), smart quotes;
3. an object `{"items": [...]}` (also `rubric`/`criteria`), or a bare list of items;
4. per item: `text` (also `criterion`/`description`/`item`), `weight` as int, float or string,
   `polarity` as `1`/`-1`/`"+1"`/`"positive"`/`"negative"` (missing = +1), `id` (missing = generated),
   and an optional deterministic `check` (checks.py); a malformed check is dropped with its reason and
   the item stays, judged by the verifier.

Weight rule: a numeric weight is rounded to the nearest integer and clamped into 1..5 (a generator that
writes 10 means "very important", not "invalid"); a weight that is not a finite number drops the item.
Items whose text is empty are dropped. Duplicates and near-duplicates merge into the first one, keeping
the larger weight. Two texts are near-duplicates when, with negation words set aside, their word sets
overlap >= 0.8 (Jaccard) AND they name the same numbers ("is 42" and "is 24" are different items). The
negation decides the meaning: an item's effective polarity is its polarity, flipped once if its text is
negated ("is not X" with +1 means what "is X" with -1 means). Same effective polarity -> merge; opposite
-> the second contradicts the first and is dropped. Items with different checks are never merged. More than `max_items`
keeps the heaviest ones (stable); fewer than 2 valid items is an error.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dynrubric.rubric.checks import Check, CheckError, parse_check

MAX_ITEMS = 12
# A generator that writes one item four times has written one item: its copies merge and the rubric
# stands (the derived items join it). The schema still asks for 2..4 (generate.GENERATED_ITEMS).
MIN_ITEMS = 1
MAX_TEXT_CHARS = 500


class RubricParseError(ValueError):
    """The generator's output holds no valid rubric; `reason` says what was wrong."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(reason)


# the derived items that rank no real answers against each other: the echo veto (no real answer trips it) and
# the floor item (every real answer meets it); trust and the gap statistics leave them out (derived.py)
NON_RANKING_ORIGINS = ("echo", "floor")


class RubricItem(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(min_length=1, max_length=64)
    text: str = Field(min_length=1, max_length=MAX_TEXT_CHARS)
    weight: int = Field(ge=1, le=5)
    polarity: Literal[1, -1] = 1
    check: Check | None = None  # answered by running the check instead of (or blended with) the verifier
    # who wrote the item: the generator; derived.py from the prompt's ground truth, the echo item or the floor
    # item; or the candidates' consensus. Items derived without a model are never overruled by a calibration answer
    origin: Literal["generator", "ground_truth", "echo", "floor", "consensus"] = "generator"

    @field_validator("text")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("item text is blank")
        return v


class Rubric(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    items: list[RubricItem] = Field(min_length=MIN_ITEMS, max_length=MAX_ITEMS)

    @model_validator(mode="after")
    def _unique_ids(self) -> Rubric:
        ids = [i.id for i in self.items]
        if len(set(ids)) != len(ids):
            raise ValueError(f"item ids are not unique: {ids}")
        return self

    @property
    def weights(self) -> list[int]:
        return [i.weight for i in self.items]

    def to_json(self) -> str:
        return json.dumps({"items": [i.model_dump(exclude_none=True) for i in self.items]}, ensure_ascii=False)


# ---------------------------------------------------------------- finding JSON in free text
_FENCE = re.compile(r"```(?:json|JSON|python)?\s*\n?(.*?)```", re.S)
_TRAILING_COMMA = re.compile(r",\s*([}\]])")
_SMART = str.maketrans({"\u201c": '"', "\u201d": '"', "\u2018": "'", "\u2019": "'"})


def _balanced_spans(text: str, limit: int = 64) -> list[str]:
    """Substrings from each `{`/`[` to its matching closer (quote-aware), outermost first."""
    spans: list[str] = []
    pairs = {"{": "}", "[": "]"}
    starts = [i for i, c in enumerate(text) if c in pairs][:limit]
    for start in starts:
        stack: list[str] = []
        quote: str | None = None
        escaped = False
        for j in range(start, len(text)):
            c = text[j]
            if quote:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == quote:
                    quote = None
                continue
            if c in "\"'":
                quote = c
            elif c in pairs:
                stack.append(pairs[c])
            elif c in "}]":
                if not stack or c != stack[-1]:
                    break
                stack.pop()
                if not stack:
                    spans.append(text[start : j + 1])
                    break
    return spans


def _decode(candidate: str) -> Any:
    """json, then repaired json, then a Python literal; None when nothing decodes."""
    text = candidate.strip().translate(_SMART)
    attempts = [text, _TRAILING_COMMA.sub(r"\1", text)]
    for attempt in attempts:
        try:
            return json.loads(attempt)
        except (ValueError, RecursionError):
            pass
    pythonish = re.sub(r"\btrue\b", "True", attempts[1])
    pythonish = re.sub(r"\bfalse\b", "False", pythonish)
    pythonish = re.sub(r"\bnull\b", "None", pythonish)
    try:
        return ast.literal_eval(pythonish)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None


def _item_list(value: Any) -> list[Any] | None:
    if isinstance(value, list):
        return value
    if isinstance(value, dict):
        for key in ("items", "rubric", "criteria", "rubric_items"):
            inner = value.get(key)
            if isinstance(inner, list):
                return inner
            if isinstance(inner, dict):
                found = _item_list(inner)
                if found is not None:
                    return found
    return None


def _find_items(raw: str) -> list[Any]:
    candidates = [m.group(1) for m in _FENCE.finditer(raw)] + _balanced_spans(raw)
    for candidate in candidates:
        items = _item_list(_decode(candidate))
        if items:
            return items
    if not candidates:
        raise RubricParseError("no JSON object or list found in the generator output")
    raise RubricParseError("found JSON-like text but no list of rubric items in it")


# ---------------------------------------------------------------- one item
def _weight(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            return None
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return min(5, max(1, int(round(value))))


def _polarity(value: Any) -> Literal[1, -1] | None:
    if value is None:
        return 1
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)) and math.isfinite(value) and value != 0:
        return 1 if value > 0 else -1
    if isinstance(value, str):
        v = value.strip().lower()
        if v in {"1", "+1", "+", "positive", "pos", "reward", "good"}:
            return 1
        if v in {"-1", "-", "negative", "neg", "penalty", "penalize", "penalise", "bad"}:
            return -1
    return None


def _clean(text: str, limit: int) -> str:
    """Whitespace collapsed, surrogate pairs joined and lone surrogates replaced (Python-literal
    decoding keeps `\\ud800` escapes as lone surrogates, which are not valid text)."""
    text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return " ".join(text.split())[:limit]


def _text(entry: dict[Any, Any]) -> str:
    for key in ("text", "criterion", "description", "item", "question", "check"):
        value = entry.get(key)
        if isinstance(value, str) and value.strip():
            return _clean(value, MAX_TEXT_CHARS)
    return ""


RawItem = tuple[str, str, int, Literal[1, -1], Check | None]  # id, text, weight, polarity, check

# what an item's text must say for a check of each kind to be the check of that text (besides the check's value)
_STATED_WORDS: dict[str, tuple[str, ...]] = {
    "max_words": ("word",),
    "min_words": ("word",),
    "bullet_count": ("bullet", "point", "list", "item"),
    "no_commas": ("comma",),
    "lowercase": ("lowercase", "lower case", "lower-case", "capital", "uppercase", "upper case"),
    "starts_with": ("start", "begin", "open", "first"),
    "ends_with": ("end", "finish", "close", "last", "conclude"),
}


def check_is_stated(text: str, check: Check) -> bool:
    """Does an item's text state what its check verifies? A phrase check (contains, not_contains, starts_with,
    ends_with) needs its phrase in the text; a count (max_words, min_words, bullet_count) and final_number need the
    number; every kind but the phrase containment ones needs a word that names what is counted or where (words,
    bullets, commas, lower case, start, end); a regex is never stated in words. Otherwise the check judges something
    the item does not say: "The response is a garden." checked as `max_words 1` (issue 36), which every answer meets
    or misses alike; the item is then the verifier's to answer."""
    said = " ".join(text.lower().split())
    kind, value = check.kind, check.value
    if kind == "regex":
        return False
    phrase = " ".join(str(value).lower().split())
    if kind in ("contains", "not_contains", "starts_with", "ends_with") and phrase not in said:
        return False
    if kind in ("max_words", "min_words", "bullet_count", "final_number"):
        numbers = {float(n.replace(",", "")) for n in re.findall(r"\d[\d,]*(?:\.\d+)?", said)}
        if float(value) not in numbers:  # type: ignore[arg-type]
            return False
    words = _STATED_WORDS.get(kind)
    return words is None or any(w in said for w in words)


def _raw_item(entry: Any, index: int, notes: list[str], stated_checks_only: bool = False) -> RawItem | None:
    """(id, text, weight, polarity, check) or None when the entry is not a usable item. A malformed
    check is dropped (its reason appended to `notes`) and the item kept without it; with `stated_checks_only`, so is a
    check its text does not state (`check_is_stated`)."""
    if isinstance(entry, str):
        text = _clean(entry, MAX_TEXT_CHARS)
        return (f"i{index + 1}", text, 1, 1, None) if text else None
    if not isinstance(entry, dict):
        return None
    text = _text(entry)
    weight = _weight(entry.get("weight", 1))
    polarity = _polarity(entry.get("polarity"))
    if not text or weight is None or polarity is None:
        return None
    raw_id = entry.get("id")
    item_id = _clean(str(raw_id), 64) if isinstance(raw_id, (str, int)) and not isinstance(raw_id, bool) else ""
    check = None
    if entry.get("check") is not None:
        try:
            check = parse_check(entry["check"])
        except CheckError as e:
            notes.append(f"check dropped: {e.reason}")
    if check is not None and stated_checks_only and not check_is_stated(text, check):
        notes.append(f"check dropped: the item's text does not state {check.describe()}")
        check = None
    return (item_id or f"i{index + 1}", text, weight, polarity, check)


# ---------------------------------------------------------------- dedupe / merge
_WORD = re.compile(r"[a-z0-9]+(?:[.,][0-9]+)*")
_NUMBER_WORD = re.compile(r"[0-9]")
NEGATIONS = frozenset({"not", "no", "never", "without", "none", "nor", "cannot", "neither", "nothing"})


def _tokens(text: str) -> list[str]:
    # "isn't" / "doesn't": the contraction is a negation word of its own
    return _WORD.findall(re.sub(r"n['\u2019]t\b", " not", text.lower()))


def _negated(text: str) -> bool:
    """True when the text negates its claim (an odd number of negation words)."""
    return sum(t in NEGATIONS for t in _tokens(text)) % 2 == 1


def _content(text: str) -> tuple[frozenset[str], frozenset[str]]:
    """(words without negations, numbers) of a text."""
    tokens = [t for t in _tokens(text) if t not in NEGATIONS]
    numbers = frozenset(t.replace(",", "") for t in tokens if _NUMBER_WORD.search(t))
    return frozenset(tokens), numbers


def near_duplicate(a: str, b: str, threshold: float = 0.8) -> bool:
    """Same claim up to wording and negation: >= `threshold` word overlap and the same numbers."""
    (wa, na), (wb, nb) = _content(a), _content(b)
    if not wa or not wb:
        return a.strip().lower() == b.strip().lower()
    return na == nb and len(wa & wb) / len(wa | wb) >= threshold


def merge_items(raw: list[RawItem], max_items: int = MAX_ITEMS) -> list[RubricItem]:
    kept: list[list[Any]] = []  # [id, text, weight, polarity, check]
    for item_id, text, weight, polarity, check in raw:
        twin = next((k for k in kept if k[4] == check and near_duplicate(k[1], text)), None)
        if twin is None:
            kept.append([item_id, text, weight, polarity, check])
            continue
        effective = polarity * (-1 if _negated(text) else 1)
        if twin[3] * (-1 if _negated(twin[1]) else 1) == effective:
            twin[2] = max(twin[2], weight)
        # an opposite effective polarity contradicts the first item: the first one stands
    if len(kept) > max_items:
        order = sorted(range(len(kept)), key=lambda i: -kept[i][2])[:max_items]
        kept = [kept[i] for i in sorted(order)]
    seen: set[str] = set()
    items = []
    for n, (item_id, text, weight, polarity, check) in enumerate(kept):
        if item_id in seen:
            item_id = f"i{n + 1}"
            while item_id in seen:
                item_id += "_"
        seen.add(item_id)
        items.append(RubricItem(id=item_id, text=text, weight=weight, polarity=polarity, check=check))
    return items


def parse_rubric(
    raw_text: str, max_items: int = MAX_ITEMS, notes: list[str] | None = None, stated_checks_only: bool = False
) -> Rubric:
    """The rubric in a generator's raw output, or RubricParseError saying why there is none.
    Reasons for dropped checks are appended to `notes` when given; `stated_checks_only` drops every check its item's
    text does not state (`check_is_stated`)."""
    if not isinstance(raw_text, str):
        raise RubricParseError(f"generator output is {type(raw_text).__name__}, not text")
    if not raw_text.strip():
        raise RubricParseError("generator output is empty")
    entries = _find_items(raw_text)
    dropped: list[str] = []
    raw = [r for n, e in enumerate(entries) if (r := _raw_item(e, n, dropped, stated_checks_only)) is not None]
    if not raw:
        raise RubricParseError(f"none of the {len(entries)} entries is a valid item (text, weight 1..5, polarity)")
    try:
        items = merge_items(raw, max_items=max(MIN_ITEMS, min(max_items, MAX_ITEMS)))
        if len(items) < MIN_ITEMS:
            raise RubricParseError(
                f"only {len(items)} distinct valid item(s) after validation and merging; need at least {MIN_ITEMS}"
            )
        rubric = Rubric(items=items)
    except ValidationError as e:  # a repair above missed a case: still the typed error, never a crash
        raise RubricParseError(f"rubric failed validation: {e.errors()[0]['msg']}") from None
    if notes is not None:
        notes.extend(dropped)
    return rubric


def rubric_from_items(items: list[tuple[str, int, Literal[1, -1]]]) -> Rubric:
    """A rubric from (text, weight, polarity) triples (the configured generic rubric)."""
    return Rubric(items=merge_items([(f"g{n + 1}", t, w, p, None) for n, (t, w, p) in enumerate(items)]))
