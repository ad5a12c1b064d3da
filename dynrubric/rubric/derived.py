"""Rubric items that need no language model: from the prompt's own ground truth, and from the set's consensus.

A weak verifier cannot be trusted to notice "at most 40 words" or a wrong sum; a deterministic check
can. These items join the generated items of every rubric.

- `prompt_items(question)`: the prompt's ground truth (groundtruth.py: official IFEval instructions,
  checked by the official checkers; constraints in free words; the value of plain arithmetic), one item
  per part, and a negative item for a response that only repeats the question (the cheapest way to
  "contain the keyword" or "stay under 40 words"), which the score applies as a veto (score.py), and the
  floor item, "the response says something": met by every answer that is not empty, so that an empty
  answer ranks below every attempt whatever else the rubric holds. In a set without an empty answer it
  is the same for every candidate and changes no advantage. The evaluator never lets a calibration
  answer overrule these items, since a calibration answer that meets a prompt's constraint (the echoed
  question contains its keyword) meets it for real; the ground-truth items hold
  `rubric.ground_truth_share` of the score, the floor item weighs with the generated ones.
- `consensus_items(responses)`: for a set whose candidates write final numbers and whose prompt has no
  computed answer, the number a strict plurality of at least two candidates (and at least 40% of those
  giving a number) reaches becomes a `final_number` item: self-consistency voting, the label test-time
  RL uses when no answer is known. It is a vote, not a proof: it weighs less, and it is judged like a
  generated item.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from dynrubric.rubric.checks import Check, final_number
from dynrubric.rubric.groundtruth import GroundTruth, derive
from dynrubric.rubric.items import RubricItem

CONSTRAINT_WEIGHT = 4  # the question states it: close to essential
ANSWER_WEIGHT = 5  # computed from the question: the answer is known
ECHO_WEIGHT = 1  # unused by the score: the echo item is a veto (score.py); the schema wants a weight
FLOOR_WEIGHT = 1  # the least weight: it only tells an empty answer from the rest
CONSENSUS_WEIGHT = 3  # a vote among candidates, not a proof
CONSENSUS_MIN_SHARE = 0.4
INSTRUCTION_TEXT_CHARS = 300


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def truth_items(truth: GroundTruth) -> list[RubricItem]:
    """One checked item per part of a ground truth (ids p1, p2, ...)."""
    found: list[tuple[str, Check, int]] = []
    for instruction in truth.instructions:
        text = f"The response follows this instruction: {instruction.describe()}"[:INSTRUCTION_TEXT_CHARS]
        found.append((text, Check(kind="instruction", value=instruction.key()), CONSTRAINT_WEIGHT))
    for words, check in truth.checks:
        found.append((f"The response {words}.", check, CONSTRAINT_WEIGHT))
    if truth.answer is not None:
        found.append(
            (
                f"The response's final number is {_fmt(truth.answer)}.",
                Check(kind="final_number", value=truth.answer),
                ANSWER_WEIGHT,
            )
        )
    return [
        RubricItem(id=f"p{n + 1}", text=t, weight=w, check=c, origin="ground_truth")
        for n, (t, c, w) in enumerate(found)
    ]


def echo_item(question: str) -> RubricItem:
    return RubricItem(
        id="e1",
        text="The response only repeats the question instead of answering it.",
        weight=ECHO_WEIGHT,
        polarity=-1,
        check=Check(kind="echoes", value=question),
        origin="echo",
    )


def floor_item() -> RubricItem:
    return RubricItem(
        id="f1",
        text="The response says something (it is not empty).",
        weight=FLOOR_WEIGHT,
        check=Check(kind="min_words", value=1),
        origin="floor",
    )


def prompt_items(question: str) -> list[RubricItem]:
    """The checked items of the question's ground truth, then the echo item and the floor item."""
    return [*truth_items(derive(question)), echo_item(question), floor_item()]


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
            id="v1",
            text=f"The response's final number is {_fmt(top)}, the answer most candidates reach.",
            weight=CONSENSUS_WEIGHT,
            check=Check(kind="final_number", value=top),
            origin="consensus",
        )
    ]
