"""The three-way split of the prompt bank: train, dev, test, by base question, with held-out instruction types.

Every prompt of the bank belongs to a *base question*: the instruction prompts' question before their
instructions ("Describe a sunset over the sea."), an arithmetic prompt's expression, an open prompt's
source id. A base question's split is a function of its text alone:

    h(base)   = first 8 hex digits of sha256(base) / 16**8          (uniform in [0, 1))
    split     = test if h < TEST_SHARE, dev if h < TEST_SHARE + DEV_SHARE, else train

so no base question is ever in two splits, whatever instructions are appended to it. Five of the bank's
instruction types (`HELDOUT_TYPES`) never appear in a training prompt: the bank writes them only onto dev
and test base questions, and `trainable` refuses any prompt whose ground truth names one, so a prompt of
live traffic that asks for one (a user's own phrasing, say) is not trained on either. Test reports seen and
unseen types apart (Tulu 3's IFEval-OOD). Dev decides everything that is tuned or guarded (round guards,
settings); test is only reported.

The bank (dynrubric/data/prompts.jsonl) stores each prompt's `base` and `split`; `BankSplit` reads them back
and `tests/unit/test_splits.py` holds the bank to the rules above.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

from dynrubric.errors import DynrubricError
from dynrubric.jsonl import split_lines
from dynrubric.prompt_key import prompt_key

Split = Literal["train", "dev", "test"]
SPLITS: tuple[Split, ...] = ("train", "dev", "test")
TEST_SHARE = 0.2
DEV_SHARE = 0.2

#: official IFEval instruction types that no training prompt carries (unseen types on dev and test)
HELDOUT_TYPES: frozenset[str] = frozenset(
    {
        "punctuation:no_comma",
        "detectable_format:title",
        "startend:end_checker",
        "detectable_content:postscript",
        "keywords:letter_frequency",
    }
)


def base_bucket(base: str) -> float:
    """Where a base question falls in [0, 1): the first 8 hex digits of its sha256."""
    return int(hashlib.sha256(base.encode()).hexdigest()[:8], 16) / 16**8


def split_of(base: str) -> Split:
    """The split of a base question (module docstring)."""
    h = base_bucket(base)
    return "test" if h < TEST_SHARE else "dev" if h < TEST_SHARE + DEV_SHARE else "train"


def has_heldout_type(instruction_ids: Iterable[str]) -> bool:
    return any(i in HELDOUT_TYPES for i in instruction_ids)


@dataclass(frozen=True)
class BankEntry:
    """One prompt of the bank, as the split sees it."""

    key: str
    id: str
    kind: str  # instruction | arithmetic | open
    base: str
    split: Split
    instruction_ids: tuple[str, ...]
    source: str | None = None  # open prompts: arena-hard | writingbench | healthbench

    @property
    def unseen(self) -> bool:
        """Carries an instruction type that no training prompt has."""
        return has_heldout_type(self.instruction_ids)


class BankSplit:
    """The bank's prompts by key, with their split; what the trainer and the evaluation ask of the split."""

    def __init__(self, entries: Iterable[BankEntry]):
        self.by_key = {e.key: e for e in entries}

    @classmethod
    def read(cls, path: Path) -> BankSplit:
        entries = []
        for n, line in enumerate(split_lines(Path(path).read_text()), 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            where = f"{path}:{n}"
            for field in ("id", "kind", "base", "split", "messages"):
                if field not in obj:
                    raise DynrubricError(
                        f"{where}: the prompt bank's line has no {field!r}",
                        "regenerate the bank with scripts/make_prompt_bank.py",
                    )
            if obj["split"] not in SPLITS:
                raise DynrubricError(f"{where}: split {obj['split']!r} is not one of {', '.join(SPLITS)}")
            msgs = [(m.get("role", "user"), m["content"]) for m in obj["messages"]]
            entries.append(
                BankEntry(
                    key=prompt_key(msgs),
                    id=obj["id"],
                    kind=obj["kind"],
                    base=obj["base"],
                    split=obj["split"],
                    instruction_ids=tuple(i["id"] for i in obj.get("instructions", ())),
                    source=obj.get("source"),
                )
            )
        return cls(entries)

    def split(self, key: str) -> Split | None:
        """The split of a bank prompt; None for a prompt that is not in the bank (live traffic of its own)."""
        e = self.by_key.get(key)
        return e.split if e is not None else None

    def entries(self, split: Split) -> list[BankEntry]:
        return [e for e in self.by_key.values() if e.split == split]


@cache
def shipped_split() -> BankSplit:
    """The split of the shipped prompt bank (read once per process)."""
    from importlib import resources

    return BankSplit.read(Path(str(resources.files("dynrubric").joinpath("data", "prompts.jsonl"))))


def trainable(key: str, instruction_ids: Iterable[str], bank: BankSplit | None = None) -> bool:
    """May a prompt be trained on: not a dev or test prompt of the bank, and no held-out instruction type
    (read off its text by the caller, `groundtruth.derive`)."""
    bank = shipped_split() if bank is None else bank
    return bank.split(key) in (None, "train") and not has_heldout_type(instruction_ids)


def _last_user_message(messages: object) -> str:
    users = (
        [m.get("content") for m in messages if m.get("role", "user") == "user"] if isinstance(messages, list) else []
    )
    return str(users[-1]) if users else ""


def violations(lines: Iterable[dict[str, object]]) -> list[str]:
    """What breaks the split in a bank's lines (empty: it holds), read off each prompt's own text:

    - a line whose `split` is not `split_of(base)`, or whose text does not start from its `base`
      (instruction prompts start with it; arithmetic prompts state it; open prompts are named by it);
    - a base question in two splits;
    - a training prompt whose text asks for a held-out instruction type (`groundtruth.derive`);
    - a held-out type that no test prompt carries (test could not report unseen types)."""
    from dynrubric.rubric.groundtruth import derive

    problems: list[str] = []
    split_of_base: dict[str, str] = {}
    unseen_in_test: set[str] = set()
    for line in lines:
        where, base, split = line.get("id"), str(line.get("base")), line.get("split")
        question = _last_user_message(line.get("messages"))
        if split != split_of(base):
            problems.append(f"{where}: split {split!r} but its base {base!r} belongs to {split_of(base)!r}")
        kind = line.get("kind")
        if (kind == "instruction" and not question.startswith(base)) or (kind == "arithmetic" and base not in question):
            problems.append(f"{where}: its text does not state its base {base!r}")
        if kind == "open" and base != f"{line.get('source')}:{str(where).split('-', 1)[-1]}":
            problems.append(f"{where}: an open prompt's base is its source and id, not {base!r}")
        if split_of_base.setdefault(base, str(split)) != split:
            problems.append(f"{where}: base {base!r} is in {split_of_base[base]!r} and {split!r}")
        ids = {i.id for i in derive(question).instructions}
        if split == "train" and ids & HELDOUT_TYPES:
            problems.append(f"{where}: a training prompt asks for held-out type(s) {sorted(ids & HELDOUT_TYPES)}")
        if split == "test":
            unseen_in_test |= ids & HELDOUT_TYPES
    problems += [f"held-out type {t} has no test prompt" for t in sorted(HELDOUT_TYPES - unseen_in_test)]
    return problems
