"""Where training prompts come from: the `PromptSource` protocol, and its JSONL implementation.

The streaming tier implements `PromptSource` over its Parquet replay store (new prompts since a
watermark; every logged response of a prompt grouped by policy_version); the core ships a JSONL
prompt file reader so that training runs without Kafka. The CLI (the composition root) picks one.

A watermark is an opaque string owned by the source: the trainer stores the one returned with a batch
and hands it back next round, and never interprets it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from dynrubric.errors import DynrubricError
from dynrubric.jsonl import split_lines
from dynrubric.prompt_key import prompt_key


@dataclass(frozen=True)
class TrainPrompt:
    key: str  # stable id of the conversation (the same prompt logged twice has the same key)
    messages: tuple[tuple[str, str], ...]  # (role, content) pairs, the last one from the user

    @property
    def question(self) -> str:
        """The last user message: what the rubric generator and the verifier see."""
        return next(c for r, c in reversed(self.messages) if r == "user")

    def chat(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages]


def make_prompt(messages: Sequence[tuple[str, str]] | str) -> TrainPrompt:
    if isinstance(messages, str):
        messages = [("user", messages)]
    msgs = tuple((str(r), str(c)) for r, c in messages)
    if not msgs or not any(r == "user" for r, _ in msgs):
        raise ValueError("a prompt needs at least one user message")
    return TrainPrompt(key=prompt_key(msgs), messages=msgs)


def heldout_bucket(key: str) -> float:
    """Where a prompt key falls in [0, 1): prompts below `train.heldout_share` are held out, never trained."""
    return int(key[:8], 16) / 16**8


@runtime_checkable
class PromptSource(Protocol):
    def new_prompts(self, since_watermark: str | None, limit: int) -> tuple[list[TrainPrompt], str | None]:
        """Up to `limit` prompts logged after `since_watermark` (None: from the beginning), oldest first,
        and the watermark to pass next time (unchanged when there is nothing new)."""
        ...

    def responses_by_version(self, prompt_key: str) -> dict[str, list[str]]:
        """Every logged response to the prompt, grouped by the policy_version that wrote it."""
        ...

    def feedback_by_response(self, prompt_key: str) -> list[tuple[str, list[str]]]:
        """Every logged response to the prompt with the kinds of user feedback it got (thumbs_up, regenerate,
        ...); empty where there is no serving log."""
        ...


def parse_prompt_line(obj: object, where: str) -> TrainPrompt:
    if not isinstance(obj, dict):
        raise DynrubricError(
            f"{where}: expected a JSON object, got {type(obj).__name__}",
            'write {"prompt": "..."} or {"messages": [{"role": "user", "content": "..."}]}',
        )
    if isinstance(obj.get("prompt"), str) and obj["prompt"].strip():
        return make_prompt(obj["prompt"])
    msgs = obj.get("messages")
    if isinstance(msgs, list) and msgs and all(isinstance(m, dict) and "content" in m for m in msgs):
        try:
            return make_prompt([(m.get("role", "user"), m["content"]) for m in msgs])
        except ValueError as e:
            raise DynrubricError(f"{where}: {e}", "add a message with role 'user'") from None
    raise DynrubricError(
        f"{where}: no non-empty 'prompt' string or 'messages' list",
        'write {"prompt": "..."} or {"messages": [{"role": "user", "content": "..."}]}',
    )


def read_prompt_file(path: Path) -> list[TrainPrompt]:
    """Every prompt of a JSONL file; a bad line is an error naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise DynrubricError(f"prompt file {path} does not exist", "set train.prompts_file to a JSONL file")
    out = []
    for n, line in enumerate(split_lines(path.read_text()), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DynrubricError(f"{path}:{n} is not valid JSON ({e.msg})", "fix or remove that line") from None
        out.append(parse_prompt_line(obj, f"{path}:{n}"))
    return out


class ResponseHistory:
    """Responses the trainer itself sampled, by prompt and policy version (JSONL, append-only).

    With the JSONL prompt source there is no serving log, so temporal contrast reads the trainer's own
    earlier samples from here."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def append(self, records: Sequence[tuple[str, str, list[str]]], origin: str | None = None) -> None:
        """(prompt_key, policy_version, responses) records, flushed and fsynced together. `origin` names
        the step that sampled them: a step re-run after a crash appends them again, and reads count them once."""
        import os

        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            for key, version, responses in records:
                f.write(json.dumps({"key": key, "version": version, "responses": responses, "origin": origin}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def by_version(self, key: str) -> dict[str, list[str]]:
        out: dict[str, list[str]] = defaultdict(list)
        if not self.path.exists():
            return {}
        seen: set[str] = set()
        for line in split_lines(self.path.read_text()):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a torn last line after a crash
                continue
            if rec.get("key") != key or rec.get("origin") in seen:
                continue
            if rec.get("origin") is not None:
                seen.add(rec["origin"])
            out[rec["version"]].extend(rec["responses"])
        return dict(out)


class JsonlPromptSource:
    """Prompts from a JSONL file, in file order; the watermark is the number of prompts consumed."""

    def __init__(self, path: Path, history: ResponseHistory):
        self.path = Path(path)
        self.history = history

    def new_prompts(self, since_watermark: str | None, limit: int) -> tuple[list[TrainPrompt], str | None]:
        prompts = read_prompt_file(self.path)
        start = int(since_watermark or 0)
        taken = prompts[start : start + limit]
        return taken, str(start + len(taken))

    def responses_by_version(self, prompt_key: str) -> dict[str, list[str]]:
        return self.history.by_version(prompt_key)

    def feedback_by_response(self, prompt_key: str) -> list[tuple[str, list[str]]]:
        return []  # a prompt file has no users
