"""Rubric items that need no language model: from the prompt's own constraints, and from the set's consensus.

A weak verifier cannot be trusted to notice "at most 40 words" or a wrong sum; a regular expression can.
These items carry a deterministic check (checks.py) and join the generated items of every rubric.

- `prompt_items(question)`: constraints the question states in IFEval style (word limits, required or
  forbidden words, start/end words, bullet counts, no commas, lower case), as Tulu 3's RLVR verifies
  them, and the value of plain arithmetic the question asks for ("What is 17 + 25?").
- `consensus_items(responses)`: for a set whose candidates write final numbers, the number a strict
  plurality of at least two candidates (and at least 40% of those giving a number) reaches becomes a
  `final_number` item: self-consistency voting, the label test-time RL uses when no answer is known.
  It is a vote, not a proof, so it weighs less than an answer computed from the prompt.
"""

from __future__ import annotations

import ast
import operator
import re
from collections import Counter
from collections.abc import Sequence

from dynrubric.rubric.checks import Check, final_number
from dynrubric.rubric.items import RubricItem

CONSTRAINT_WEIGHT = 4  # the question states it: close to essential
ANSWER_WEIGHT = 5  # computed from the question: the answer is known
CONSENSUS_WEIGHT = 3  # a vote among candidates, not a proof
CONSENSUS_MIN_SHARE = 0.4

_WORD_NUMBERS = {
    "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9,
    "ten": 10, "eleven": 11, "twelve": 12, "fifteen": 15, "twenty": 20, "thirty": 30, "forty": 40,
    "fifty": 50, "hundred": 100,
}
_N = r"(\d+|" + "|".join(_WORD_NUMBERS) + r")"
_QUOTED = r"[\"'\u201c\u2018]([^\"'\u201d\u2019]{1,60})[\"'\u201d\u2019]"
_PHRASE = rf"(?:{_QUOTED}|(\w[\w-]*))"
_FLAGS = re.I


def _number(token: str) -> int:
    return int(token) if token.isdigit() else _WORD_NUMBERS[token.lower()]


def _phrase(match: re.Match[str], first_group: int) -> str:
    return (match.group(first_group) or match.group(first_group + 1)).strip()


_MAX_WORDS = re.compile(
    rf"\b(?:at most|no more than|not more than|maximum of|up to|fewer than|less than|under|within)\s+{_N}\s+words", _FLAGS
)
_MIN_WORDS = re.compile(
    rf"\b(?:at least|no fewer than|no less than|minimum of|(?<!no )(?<!not )more than)\s+{_N}\s+words", _FLAGS
)
_BULLETS = re.compile(rf"\b(?:exactly\s+)?{_N}\s+(?:bullet points|bullets|bulleted items|bullet-point items)", _FLAGS)
_INCLUDE = re.compile(
    rf"\b(?:include|includes|including|use|mention|contain|contains)\s+the\s+(?:word|phrase|keyword|term)\s+{_PHRASE}", _FLAGS
)
_EXCLUDE = re.compile(
    rf"\b(?:do not|don't|never|without|avoid)\s+(?:use|using|include|including|mention|mentioning|say|saying)?\s*"
    rf"(?:the\s+)?(?:word|phrase|keyword|term)\s+{_PHRASE}", _FLAGS
)
_START = re.compile(
    rf"\b(?:start|begin)\s+(?:your\s+(?:response|answer|reply)\s+)?with\s+(?:the\s+(?:word|phrase)\s+)?{_PHRASE}", _FLAGS
)
_END = re.compile(
    rf"\b(?:end|finish)\s+(?:your\s+(?:response|answer|reply)\s+)?with\s+(?:the\s+(?:word|phrase)\s+)?{_PHRASE}", _FLAGS
)
_NEGATED_BEFORE = re.compile(r"\b(?:not|n't|never|avoid|without)\s*$", _FLAGS)
_NO_COMMAS = re.compile(r"\b(?:no|without|do not use|don't use|avoid|never use)\s+(?:any\s+)?commas\b", _FLAGS)
_LOWERCASE = re.compile(r"\b(?:all\s+)?(?:in\s+)?lower[- ]?case(?:\s+letters)?\b|\bno capital letters\b", _FLAGS)
_ARITHMETIC = re.compile(r"\bwhat is\s+([\d\s.+\-*/x\u00d7\u00f7()]+?)\s*[?=]", _FLAGS)

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _evaluate(expression: str) -> float | None:
    """The value of + - * / arithmetic on numbers, or None (anything else is refused, nothing runs)."""
    text = expression.replace("\u00d7", "*").replace("\u00f7", "/")
    text = re.sub(r"(?<=\d)\s*x\s*(?=\d)", "*", text)
    if not re.search(r"\d\s*[-+*/]\s*[\d(]", text) or len(text) > 80:
        return None
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        return None

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("not plain arithmetic")

    try:
        return value(tree.body)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def prompt_items(question: str) -> list[RubricItem]:
    """Checkable items for the constraints `question` states (ids p1, p2, ...)."""
    found: list[tuple[str, Check, int]] = []
    if m := _MAX_WORDS.search(question):
        n = _number(m.group(1)) - (1 if m.group(0).lower().startswith(("fewer", "less", "under")) else 0)
        found.append((f"The response has at most {n} words.", Check(kind="max_words", value=float(n)), CONSTRAINT_WEIGHT))
    if m := _MIN_WORDS.search(question):
        n = _number(m.group(1)) + (1 if m.group(0).lower().startswith("more") else 0)
        found.append((f"The response has at least {n} words.", Check(kind="min_words", value=float(n)), CONSTRAINT_WEIGHT))
    if m := _BULLETS.search(question):
        n = _number(m.group(1))
        found.append((f"The response has exactly {n} bullet points.", Check(kind="bullet_count", value=float(n)), CONSTRAINT_WEIGHT))
    for m in _INCLUDE.finditer(question):
        if _NEGATED_BEFORE.search(question[max(0, m.start() - 12) : m.start()]):
            continue  # "do not use the word X" is the forbidden-word constraint below
        w = _phrase(m, 1)
        found.append((f"The response includes the word '{w}'.", Check(kind="contains", value=w), CONSTRAINT_WEIGHT))
    for m in _EXCLUDE.finditer(question):
        w = _phrase(m, 1)
        found.append((f"The response avoids the word '{w}'.", Check(kind="not_contains", value=w), CONSTRAINT_WEIGHT))
    if m := _START.search(question):
        w = _phrase(m, 1)
        found.append((f"The response starts with '{w}'.", Check(kind="starts_with", value=w), CONSTRAINT_WEIGHT))
    if m := _END.search(question):
        w = _phrase(m, 1)
        found.append((f"The response ends with '{w}'.", Check(kind="ends_with", value=w), CONSTRAINT_WEIGHT))
    if _NO_COMMAS.search(question):
        found.append(("The response uses no commas.", Check(kind="no_commas"), CONSTRAINT_WEIGHT))
    if _LOWERCASE.search(question):
        found.append(("The response is written in lower case only.", Check(kind="lowercase"), CONSTRAINT_WEIGHT))
    if (m := _ARITHMETIC.search(question)) and (answer := _evaluate(m.group(1))) is not None:
        found.append((f"The response's final number is {_fmt(answer)}.", Check(kind="final_number", value=answer), ANSWER_WEIGHT))
    return [RubricItem(id=f"p{n + 1}", text=t, weight=w, check=c) for n, (t, c, w) in enumerate(found)]


def consensus_items(responses: Sequence[str]) -> list[RubricItem]:
    """A `final_number` item for the number a clear plurality of the candidates reaches, if any."""
    numbers = [x for r in responses if (x := final_number(r)) is not None]
    if len(numbers) < 2:
        return []
    ranked = Counter(numbers).most_common(2)
    top, count = ranked[0]
    runner_up = ranked[1][1] if len(ranked) > 1 else 0
    if count < 2 or count <= runner_up or count < CONSENSUS_MIN_SHARE * len(numbers):
        return []
    return [
        RubricItem(
            id="v1", text=f"The response's final number is {_fmt(top)}, the answer most candidates reach.",
            weight=CONSENSUS_WEIGHT, check=Check(kind="final_number", value=top),
        )
    ]
