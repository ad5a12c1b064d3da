"""The shipped prompt bank (dynrubric/data/prompts.jsonl, written by scripts/make_prompt_bank.py) and its checks.

One JSON object per line:
    {"id": "arith-0001", "kind": "arithmetic", "messages": [...chat...], "answer": 42.0}
    {"id": "instr-0001", "kind": "instruction", "messages": [...],
     "instructions": [{"id": "change_case:english_lowercase", "kwargs": {}}]}
    {"id": "arena-<uid>", "kind": "open", "source": "arena-hard", "messages": [...],
     "base": "arena-hard:<uid>", "split": "train", "references": ["..."], "criteria": [{"text": "...", "points": 5}]}
Every line may carry its `base` question and `split` (dynrubric/train/splits.py; `split` must be
`split_of(base)`). An open line (scripts/open_prompts.py) carries its `source`, what strong models or experts
answered (`references`) and graded criteria (`criteria`, negative points = bad): what the simulated users'
preference on it is measured against (`dynrubric.rubric.open_quality`); no reward reads them.
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
from dynrubric.rubric.open_quality import open_quality
from dynrubric.train.splits import Split, split_of
from streaming.events import ChatMessage


class Criterion(BaseModel):
    """A graded criterion of an open prompt (HealthBench's physicians', WritingBench's checklist)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str = Field(min_length=1)
    points: int


class PromptItem(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1)
    kind: Literal["arithmetic", "instruction", "open"]
    messages: list[ChatMessage] = Field(min_length=1)
    answer: float | None = None
    instructions: list[Instruction] | None = None
    base: str | None = None
    split: Split | None = None  # None: a line that predates the split (served, as all lines were)
    source: str | None = None  # open lines: arena-hard | writingbench | healthbench
    references: list[str] = []  # open lines: strong models' or experts' answers
    criteria: list[Criterion] = []  # open lines

    @property
    def prompt_text(self) -> str:
        """Every message's text: what an answer that only echoes the conversation would repeat."""
        return "\n".join(m.content for m in self.messages)

    def open_quality(self, response: str) -> float:
        """`dynrubric.rubric.open_quality` of a response against this line's references and criteria."""
        return open_quality(self.prompt_text, response, self.references, [(c.text, c.points) for c in self.criteria])

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
        if self.kind != "open" and (self.references or self.criteria):
            raise ValueError("only an open prompt carries references or criteria")
        if self.split is not None and (self.base is None or split_of(self.base) != self.split):
            raise ValueError(f"`split` {self.split!r} is not split_of(base) for base {self.base!r}")
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
