"""Ground truth: the one check per constraint that the users, the rubric and the evaluation of versions share.

A prompt's ground truth is what can be checked without a judge:

- `instructions`: IFEval instructions, each an official instruction id and its arguments, checked by
  Google's own IFEval checkers (PyPI `if-verifiable`, `if_verifiable.ifeval`), never by a copy of them;
- `answer`: the number an arithmetic question computes to; met when the response's LAST number equals
  it (`checks.final_number`), so "17 + 25 = 42" passes and "42, no wait, 41" does not;
- `checks`: constraints stated in free words ("in at most 40 words", "include the word 'blue'"), which no
  official checker reads; they get this project's own deterministic checks (checks.py).

A response passes a prompt (`GroundTruth.passes`, IFEval's strict prompt-level accuracy) when it meets
every part; an empty response meets nothing. The same function answers the simulated users' thumbs
(serving/users.py), the derived rubric items the judge scores with (derived.py) and the held-out
evaluation of every version (train/policy_eval.py), so the three can never disagree about a constraint.

`derive(question)` reads a prompt's ground truth off its text: the official instruction descriptions
(what `build_description` writes, matched exactly and mapped back to id and arguments), the free
phrasings above, and plain arithmetic ("What is 17 + 25?"), computed without running code. Instructions
whose official checker needs NLTK data downloads (sentence counting, capital word frequency) are not
supported: no registry package ships that data.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import Any

from pydantic import BaseModel, ConfigDict

from dynrubric.rubric.checks import Check, final_number, run_check
from dynrubric.rubric.instructions import Instruction


class GroundTruth(BaseModel):
    """What a prompt asks that can be checked without a judge."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    answer: float | None = None
    instructions: tuple[Instruction, ...] = ()
    checks: tuple[tuple[str, Check], ...] = ()  # (what the prompt asks, in words; its check), free phrasings

    @property
    def empty(self) -> bool:
        return self.answer is None and not self.instructions and not self.checks

    @property
    def kind(self) -> str:
        """`arithmetic` (a computed answer) or `instruction` (instructions only)."""
        return "arithmetic" if self.answer is not None else "instruction"

    def results(self, response: str) -> list[bool]:
        """One verdict per part: the answer first (when there is one), then each instruction."""
        out = [answer_matches(self.answer, response)] if self.answer is not None else []
        return (
            out
            + [i.follows(response) for i in self.instructions]
            + [run_check(c, response) == 1.0 for _, c in self.checks]
        )

    def passes(self, response: str) -> bool:
        """Every part met (IFEval's strict prompt-level accuracy); False for an empty ground truth."""
        results = self.results(response)
        return bool(results) and all(results)


def answer_matches(answer: float, response: str) -> bool:
    """The response's last number equals `answer` (1e-9 relative); an empty response never matches."""
    got = final_number(response) if response.strip() else None
    return got is not None and abs(got - answer) <= 1e-9 * max(1.0, abs(answer))


# ---------------------------------------------------------------- reading ground truth off a prompt
def _words(s: str) -> str:
    """A literal regex for an official sentence, tolerant of how whitespace was re-flowed."""
    return r"\s*".join(re.escape(part) for part in s.split())


_REL = r"(less than|at least)"
_LIST = r"(\[[^\]\n]{1,400}\])"

# official descriptions (if_verifiable.ifeval.instructions.*.build_description), with the arguments as groups
_OFFICIAL: list[tuple[str, re.Pattern[str], Callable[[re.Match[str]], dict[str, Any]]]] = [
    (
        "keywords:existence",
        re.compile(_words("Include keywords") + r"\s+" + _LIST + r"\s+" + _words("in the response.")),
        lambda m: {"keywords": _string_list(m[1])},
    ),
    (
        "keywords:forbidden_words",
        re.compile(_words("Do not include keywords") + r"\s+" + _LIST + r"\s+" + _words("in the response.")),
        lambda m: {"forbidden_words": _string_list(m[1])},
    ),
    (
        "keywords:frequency",
        re.compile(
            _words("In your response, the word")
            + r"\s+(\S+)\s+"
            + _words("should appear")
            + r"\s+"
            + _REL
            + r"\s+(\d+)\s+times\."
        ),
        lambda m: {"keyword": m[1], "frequency": int(m[3]), "relation": m[2]},
    ),
    (
        "keywords:letter_frequency",
        re.compile(
            _words("In your response, the letter")
            + r"\s+(\w)\s+"
            + _words("should appear")
            + r"\s+"
            + _REL
            + r"\s+(\d+)\s+times\."
        ),
        lambda m: {"letter": m[1], "let_frequency": int(m[3]), "let_relation": m[2]},
    ),
    (
        "language:response_language",
        re.compile(
            _words("Your ENTIRE response should be in")
            + r"\s+(\w+)\s+"
            + _words("language, no other language is allowed.")
        ),
        lambda m: {"language": _language_code(m[1])},
    ),
    (
        "length_constraints:number_paragraphs",
        re.compile(
            _words("There should be")
            + r"\s+(\d+)\s+"
            + _words("paragraphs. Paragraphs are separated with the markdown divider: ***")
        ),
        lambda m: {"num_paragraphs": int(m[1])},
    ),
    (
        "length_constraints:nth_paragraph_first_word",
        re.compile(
            _words("There should be")
            + r"\s+(\d+)\s+"
            + _words(
                "paragraphs. Paragraphs and only paragraphs are separated with each other by two new lines "
                "as if it was "
                "'\\n\\n' in python. Paragraph"
            )
            + r"\s+(\d+)\s+"
            + _words("must start with word")
            + r"\s+(\S+?)\."
        ),
        lambda m: {"num_paragraphs": int(m[1]), "nth_paragraph": int(m[2]), "first_word": m[3]},
    ),
    (
        "length_constraints:number_words",
        re.compile(_words("Answer with") + r"\s+" + _REL + r"\s+(\d+)\s+words\."),
        lambda m: {"num_words": int(m[2]), "relation": m[1]},
    ),
    (
        "detectable_content:number_placeholders",
        re.compile(
            _words("The response must contain at least")
            + r"\s+(\d+)\s+"
            + _words("placeholders represented by square brackets, such as [address].")
        ),
        lambda m: {"num_placeholders": int(m[1])},
    ),
    (
        "detectable_content:postscript",
        re.compile(
            _words("At the end of your response, please explicitly add a postscript starting with")
            + r"\s+(\S+?)(?=\s|$)"
        ),
        lambda m: {"postscript_marker": m[1]},
    ),
    (
        "detectable_format:number_bullet_lists",
        re.compile(
            _words("Your answer must contain exactly")
            + r"\s+(\d+)\s+"
            + _words("bullet points. Use the markdown bullet points such as: * This is point 1. * This is point 2")
        ),
        lambda m: {"num_bullets": int(m[1])},
    ),
    (
        "detectable_format:constrained_response",
        re.compile(
            _words(
                "Answer with one of the following options: "
                "('My answer is yes.', 'My answer is no.', 'My answer is maybe.')"
            )
        ),
        lambda m: {},
    ),
    (
        "detectable_format:number_highlighted_sections",
        re.compile(
            _words("Highlight at least")
            + r"\s+(\d+)\s+"
            + _words("sections in your answer with markdown, i.e. *highlighted section*.")
        ),
        lambda m: {"num_highlights": int(m[1])},
    ),
    (
        "detectable_format:multiple_sections",
        re.compile(
            _words("Your response must have")
            + r"\s+(\d+)\s+"
            + _words("sections. Mark the beginning of each section with")
            + r"\s+(\w+)\s+X,\s+such\s+as:\s+\2\s+1\s+"
            + _words("[content of section 1]")
            + r"\s+\2\s+2\s+"
            + _words("[content of section 2]")
        ),
        lambda m: {"section_spliter": m[2], "num_sections": int(m[1])},
    ),
    (
        "detectable_format:json_format",
        re.compile(_words("Entire output should be wrapped in JSON format. You can use markdown ticks such as ```.")),
        lambda m: {},
    ),
    (
        "detectable_format:title",
        re.compile(
            _words("Your answer must contain a title, wrapped in double angular brackets, such as <<poem of joy>>.")
        ),
        lambda m: {},
    ),
    (
        "combination:two_responses",
        re.compile(
            _words(
                "Give two different responses. Responses and only responses should be separated by 6 asterisk symbols: "
                "******."
            )
        ),
        lambda m: {},
    ),
    (
        "startend:end_checker",
        re.compile(
            _words("Finish your response with this exact phrase")
            + r"\s+(.{1,200}?)\.\s+"
            + _words("No other words should follow this phrase.")
        ),
        lambda m: {"end_phrase": m[1]},
    ),
    ("startend:quotation", re.compile(_words("Wrap your entire response with double quotation marks.")), lambda m: {}),
    (
        "change_case:english_capital",
        re.compile(_words("Your entire response should be in English, and in all capital letters.")),
        lambda m: {},
    ),
    (
        "change_case:english_lowercase",
        re.compile(
            _words(
                "Your entire response should be in English, and in all lowercase letters. "
                "No capital letters are allowed."
            )
        ),
        lambda m: {},
    ),
    (
        "punctuation:no_comma",
        re.compile(_words("In your entire response, refrain from the use of any commas.")),
        lambda m: {},
    ),
]
_REPEAT = re.compile(
    _words(
        "First repeat the request word for word without change, then give your answer (1. do not say any words or "
        "characters before repeating the request; 2. the request you need to repeat does not include this sentence)"
    )
)

# free phrasings of common constraints ("in at most 40 words", "include the word 'blue'"): no official
# description to match, so they are read into this project's own checks (checks.py), the same for every reader
_WORD_NUMBERS = {
    "one": 1,
    "two": 2,
    "three": 3,
    "four": 4,
    "five": 5,
    "six": 6,
    "seven": 7,
    "eight": 8,
    "nine": 9,
    "ten": 10,
    "eleven": 11,
    "twelve": 12,
    "fifteen": 15,
    "twenty": 20,
    "thirty": 30,
    "forty": 40,
    "fifty": 50,
    "hundred": 100,
}
_N = r"(\d+|" + "|".join(_WORD_NUMBERS) + r")"
_QUOTED = r"[\"'\u201c\u2018]([^\"'\u201d\u2019]{1,60})[\"'\u201d\u2019]"
_PHRASE = rf"(?:{_QUOTED}|(\w[\w-]*))"
_I = re.I
_MAX_WORDS = re.compile(
    rf"\b(?:at most|no more than|not more than|maximum of|up to|fewer than|less than|under|within)\s+{_N}\s+words", _I
)
_MIN_WORDS = re.compile(
    rf"\b(?:at least|no fewer than|no less than|minimum of|(?<!no )(?<!not )more than)\s+{_N}\s+words", _I
)
_BULLETS = re.compile(rf"\b(?:exactly\s+)?{_N}\s+(?:bullet points|bullets|bulleted items|bullet-point items)", _I)
_INCLUDE = re.compile(
    rf"\b(?:include|includes|including|use|mention|contain|contains)\s+the\s+(?:word|phrase|keyword|term)\s+{_PHRASE}",
    _I,
)
_EXCLUDE = re.compile(
    rf"\b(?:do not|don't|never|without|avoid)\s+(?:use|using|include|including|mention|mentioning|say|saying)?\s*"
    rf"(?:the\s+)?(?:word|phrase|keyword|term)\s+{_PHRASE}",
    _I,
)
_START = re.compile(
    rf"\b(?:start|begin)\s+(?:your\s+(?:response|answer|reply)\s+)?with\s+(?:the\s+(?:word|phrase)\s+)?{_PHRASE}", _I
)
_END = re.compile(
    rf"\b(?:end|finish)\s+(?:your\s+(?:response|answer|reply)\s+)?with\s+(?:the\s+(?:word|phrase)\s+)?{_PHRASE}", _I
)
_NEGATED_BEFORE = re.compile(r"\b(?:not|n't|never|avoid|without)\s*$", _I)
_NO_COMMAS = re.compile(r"\b(?:no|without|do not use|don't use|avoid|never use)\s+(?:any\s+)?commas\b", _I)
_LOWERCASE = re.compile(r"\b(?:all\s+)?(?:in\s+)?lower[- ]?case(?:\s+letters)?\b|\bno capital letters\b", _I)
_ONE_WORD = re.compile(r"\b(?:in|with|using)\s+(?:exactly\s+)?(?:one|a single)\s+word\b", _I)
_ARITHMETIC = re.compile(r"\bwhat is\s+([\d\s.+\-*/x\u00d7\u00f7()]+?)\s*[?=]", _I)
_OPS: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def _number(token: str) -> int:
    return int(token) if token.isdigit() else _WORD_NUMBERS[token.lower()]


def _phrase(m: re.Match[str]) -> str:
    return (m[1] or m[2]).strip()


def free_checks(question: str) -> list[tuple[str, Check]]:
    """The checks of the free phrasings `question` holds, each with the words it is asked in."""
    found: list[tuple[str, Check]] = []
    if m := _MAX_WORDS.search(question):
        n = _number(m[1]) - (1 if m[0].lower().startswith(("fewer", "less", "under")) else 0)
        found.append((f"at most {n} words", Check(kind="max_words", value=float(n))))
    elif _ONE_WORD.search(question):
        found.append(("one word", Check(kind="max_words", value=1.0)))
    if m := _MIN_WORDS.search(question):
        n = _number(m[1]) + (1 if m[0].lower().startswith("more") else 0)
        found.append((f"at least {n} words", Check(kind="min_words", value=float(n))))
    if m := _BULLETS.search(question):
        n = _number(m[1])
        found.append((f"exactly {n} bullet points", Check(kind="bullet_count", value=float(n))))
    for m in _INCLUDE.finditer(question):
        if _NEGATED_BEFORE.search(question[max(0, m.start() - 12) : m.start()]):
            continue  # "do not use the word X" is the forbidden word below
        found.append((f"includes the word '{_phrase(m)}'", Check(kind="contains", value=_phrase(m))))
    for m in _EXCLUDE.finditer(question):
        found.append((f"avoids the word '{_phrase(m)}'", Check(kind="not_contains", value=_phrase(m))))
    if m := _START.search(question):
        found.append((f"starts with '{_phrase(m)}'", Check(kind="starts_with", value=_phrase(m))))
    if m := _END.search(question):
        found.append((f"ends with '{_phrase(m)}'", Check(kind="ends_with", value=_phrase(m))))
    if _NO_COMMAS.search(question):
        found.append(("uses no commas", Check(kind="no_commas")))
    if _LOWERCASE.search(question):
        found.append(("is written in lower case only", Check(kind="lowercase")))
    return found


def _string_list(text: str) -> list[str]:
    value = ast.literal_eval(text)  # a Python list literal of strings, as the official description writes it
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError("not a list of strings")
    return value


@cache
def _language_names() -> Mapping[str, str]:
    from if_verifiable.ifeval.instructions import _LANGUAGES

    return {name.lower(): code for code, name in _LANGUAGES.items()}


def _language_code(name: str) -> str:
    return _language_names()[name.lower()]


def evaluate_arithmetic(expression: str) -> float | None:
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


def derive(question: str) -> GroundTruth:
    """The ground truth a question states (module docstring); empty when it states none. Instructions come
    in the order the question states them; free phrasings are read only outside the official sentences
    (whose words they would otherwise read again)."""
    found: list[tuple[tuple[int, int], Instruction]] = []  # in the order the question states them
    for iid, pattern, args in _OFFICIAL:
        if m := pattern.search(question):
            try:
                found.append((m.span(), Instruction(id=iid, kwargs=args(m))))
            except (ValueError, KeyError, SyntaxError):
                continue
    if m := _REPEAT.search(question):
        request = (question[: m.start()] + question[m.end() :]).strip()
        if request:
            found.append((m.span(), Instruction(id="combination:repeat_prompt", kwargs={"prompt_to_repeat": request})))
    rest = question
    for (start, end), _ in sorted(found, key=lambda f: f[0], reverse=True):
        rest = rest[:start] + " " + rest[end:]
    answer = None
    if (m := _ARITHMETIC.search(question)) is not None:
        answer = evaluate_arithmetic(m[1])
    return GroundTruth(
        answer=answer,
        instructions=tuple(i for _, i in sorted(found, key=lambda f: f[0])),
        checks=tuple(free_checks(rest)),
    )


def describe_all(instructions: Sequence[Instruction]) -> str:
    """The official descriptions of `instructions`, joined as a prompt writes them."""
    return " ".join(i.describe() for i in instructions)
