"""The shipped prompt bank (dynrubric/data/prompts.jsonl, written by scripts/make_prompt_bank.py) and its checks.

One JSON object per line:
    {"id": "arith-0001", "kind": "arithmetic", "messages": [...chat...], "answer": 42.0}
    {"id": "instr-0001", "kind": "instruction", "messages": [...],
     "instructions": [{"id": "change_case:english_lowercase", "kwargs": {}}]}
    {"id": "open-01", "kind": "open", "messages": [...]}
A line's ground truth is what its last user message states (`dynrubric.rubric.groundtruth.derive`: the
official IFEval instruction descriptions, free phrasings such as "include the word 'blue'", computed
arithmetic); `answer` and `instructions`, when written, must be exactly what the text states, so the
file cannot claim a ground truth the judge would not read off the same prompt. `check(item, response)`
is that ground truth's verdict (None for open questions): simulated users turn it into feedback, and
the judge's derived items and the evaluation of versions use the same function.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dynrubric.errors import DynrubricError
from dynrubric.rubric.groundtruth import GroundTruth, derive
from dynrubric.rubric.instructions import Instruction
from streaming.events import ChatMessage


class PromptItem(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1)
    kind: Literal["arithmetic", "instruction", "open"]
    messages: list[ChatMessage] = Field(min_length=1)
    answer: float | None = None
    instructions: list[Instruction] | None = None
    base: str | None = None  # the base question (dynrubric/train/splits.py)
    split: Literal["train", "dev", "test"] | None = None  # splits.split_of(base); None: not in a split

    @property
    def question(self) -> str:
        return next(m.content for m in reversed(self.messages) if m.role == "user")

    def ground_truth(self) -> GroundTruth:
        return derive(self.question)

    @model_validator(mode="after")
    def _states_its_ground_truth(self) -> PromptItem:
        truth = self.ground_truth()
        if self.answer is not None and truth.answer != self.answer:
            raise ValueError(f"`answer` {self.answer} is not what the question computes to ({truth.answer})")
        if self.instructions is not None and tuple(self.instructions) != truth.instructions:
            raise ValueError(f"`instructions` are not the ones the question states: {list(truth.instructions)}")
        if self.kind == "arithmetic" and truth.answer is None:
            raise ValueError("an arithmetic prompt needs a question whose value can be computed (What is 17 + 25?)")
        if self.kind == "instruction" and not (truth.instructions or truth.checks):
            raise ValueError("an instruction prompt needs a question that states a checkable instruction")
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
                raise DynrubricError(
                    f"{path}:{n} is not a valid prompt line: {e}", "see streaming/prompt_bank.py"
                ) from None
    return items


def check(item: PromptItem, response: str) -> bool | None:
    """True/False when the response meets/misses the item's ground truth; None for open questions."""
    if item.kind == "open":
        return None
    return item.ground_truth().passes(response)
