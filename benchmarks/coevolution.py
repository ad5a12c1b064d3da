"""Does the rubric generator get better as it trains? The judge alone, before and after the loop's generator steps.

DynamicRubric's second claim (issue 36): the evaluator improves as it co-evolves. Here the judge is the judge alone
(no derived ground-truth item, no vote; `JUDGE`), and what it is measured on is what `dynrubric eval-judge` ranks:

    open   the open-prompt judge benchmark (dynrubric/data/judge_open.jsonl, its Arena-Hard sets: a strong model's
           answer beside 3 of base SmolLM2's, test-split questions): per set, the share of (strong, policy) pairs
           the judge orders strong first (a tie within rubric.eps = 1/2)
    real   checker-split sets of SmolLM2's own answers (dynrubric/data/judge_real.jsonl, held-out instruction
           prompts): per set, the share of (pass, fail) pairs ordered the checker's way; the first --real-sets of
           the sets the checker separates

Each is scored with the base generator and with the generator each seed trained, on the same sets; the result per
benchmark is the mean over seeds of (after - before) per set, with a paired bootstrap 95 % CI over the sets.

Training (`train`): one round of --steps generator steps alone (`train.coevolve.k_alt: 0`), in the loop's own round
code (`RoundRunner.generator_step`: the current policy's candidate sets, R rubrics sampled per set, each rewarded by
R_disc (how far its items split the set), R_format and R_anchor (how it orders the ranked anchors of the prompt),
GRPO on the generator). The prompts are TRAIN-split Arena-Hard questions; their anchors (ranking_source `file`) are
the strong model's answer ranked above one base SmolLM2 answer, both cut to the benchmark's 160 tokens: what the
generator learns from on open prompts is which rubrics put a far better answer first, the signal users' thumbs give
in production (`ranking_source: feedback`). The test sets' questions are never trained on (`splits.split_of`).

One vLLM server samples candidates, rubrics and verdicts (policy, generator and the frozen verifier take turns on it,
each reloading its own weights, `engine.shared_servers`, as the rollout judge in `dynrubric up`).

    python benchmarks/coevolution.py [--seeds 3] [--steps 12] [--prompts 64] [--open-sets 48] [--real-sets 24]
                                     [--out DIR] [--quick]

The last lines:

    open: before 0.615, after 0.650, delta +0.035 (95% CI -0.010..+0.080) over 48 sets, 3 seed(s)
    real: ...
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout this file is in, not another install
sys.path.insert(0, str(ROOT / "scripts"))  # the open-prompt benchmark's data readers

from make_open_judge_benchmark import arena_questions, tasks_dir  # noqa: E402

from dynrubric import modelcache  # noqa: E402
from dynrubric.config import Settings  # noqa: E402
from dynrubric.config_loader import load_settings, override  # noqa: E402
from dynrubric.engines import one_shared_server  # noqa: E402
from dynrubric.engines.base import Engine, GenerationRequest, SamplingParams  # noqa: E402
from dynrubric.process import stop_signals_interrupt  # noqa: E402
from dynrubric.rubric.benchmark import read_open_sets, read_real_sets  # noqa: E402
from dynrubric.train.policy_eval import paired_bootstrap  # noqa: E402

if TYPE_CHECKING:
    from dynrubric.rubric.evaluator import ScoredSet

DATA = ROOT / "dynrubric" / "data"
#: the judge alone, as benchmarks/supervision.py's `judge:set+levers` arm: no derived item, no vote; a check decides
#: an item only where its text states it, and the calibration answers overrule an item only when one beats the set's
#: best answer (benchmarks/judge_levers.py: 0.615 on the open sets, the shipped weighing 0.524)
JUDGE: dict[str, Any] = {
    "mode": "set",
    "prompt_constraints": False,
    "consensus": False,
    "stated_checks_only": True,
    "trust_rule": "best",
}
TOKENS = 160  # the open benchmark's answer budget: the anchors and the candidates are cut/decoded to it


# ==================================================================== the data
def training_questions(n: int, seed: int, max_prompt_tokens: int, tokenizer: Any) -> list[dict[str, Any]]:
    """`n` TRAIN-split Arena-Hard questions of at most 1500 characters and `max_prompt_tokens` tokens (as the test
    sets' questions), each with its strong answer; a seeded draw."""
    questions = [
        q
        for q in arena_questions(tasks_dir(), split="train")
        if len(q["prompt"]) <= 1500 and len(tokenizer.encode(q["prompt"])) <= max_prompt_tokens
    ]
    rng = random.Random(seed)
    rng.shuffle(questions)
    return questions[:n]


def write_training_data(
    out: Path, questions: Sequence[dict[str, Any]], engine: Engine, tokenizer: Any, seed: int
) -> tuple[Path, Path]:
    """The round's prompts file and its anchors file (`{prompt, responses: [strong, policy]}`)."""
    from dynrubric.seeds import derive_seed

    def cut(text: str) -> str:
        ids = tokenizer.encode(text, add_special_tokens=False)
        return text if len(ids) <= TOKENS else str(tokenizer.decode(ids[:TOKENS], skip_special_tokens=True))

    requests = [
        GenerationRequest(
            engine.render_chat([{"role": "user", "content": q["prompt"]}]),
            SamplingParams(
                max_tokens=TOKENS, temperature=1.0, n=1, seed=derive_seed(seed, "coevolution-anchor", q["uid"])
            ),
        )
        for q in questions
    ]
    answers = [outs[0].text for outs in engine.generate(requests)]
    prompts, anchors = out / "prompts.jsonl", out / "anchors.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": q["prompt"]}) + "\n" for q in questions))
    anchors.write_text(
        "".join(
            json.dumps({"prompt": q["prompt"], "responses": [cut(q["strong_text"]), a]}) + "\n"
            for q, a in zip(questions, answers, strict=True)
        )
    )
    return prompts, anchors


# ==================================================================== settings, training
def run_settings(
    base: Settings, run: Path, url: str, prompts: Path, anchors: Path, steps: int, seed: int, shape: dict[str, Any]
) -> Settings:
    return override(
        base,
        {
            "paths": {"state_dir": str(run)},
            "rubric": JUDGE,
            "train": {
                "seed": seed,
                "prompt_source": "jsonl",
                "prompts_file": str(prompts),
                "max_new_tokens": TOKENS,
                # a set-conditioned rubric prompt holds K answers of 160 tokens: ~1,200-token samples, whose
                # activations at 4 a micro-batch had this process OOM-killed (8.8 GB) beside another benchmark
                "grpo": {"micro_batch_size": 2},
                "steps_per_round": steps,
                "coevolve": {
                    "k_alt": 0,
                    "k_alt_generator": steps,
                    "ranking_source": "file",
                    "rankings_file": str(anchors),
                    **shape,
                },
            },
            # the verifier on the server too, taking turns with the generator (as the rollout judge in `up`): in this
            # process it read every item of a set ~20x slower (docs/benchmarks.md, seconds per open pair)
            "engine": one_shared_server(url),
        },
    )


def train_generator(settings: Settings) -> tuple[Path, list[dict[str, Any]]]:
    """One round of generator steps alone; (the trained generator's weights dir, each step's record)."""
    from dynrubric.app.train_commands import engine_factory, prompt_source
    from dynrubric.registry import open_registry
    from dynrubric.train.rounds import RoundRunner

    runner = RoundRunner(settings, open_registry(settings), prompt_source(settings), engine_factory(settings))
    try:
        summary = runner.run()
        trained = runner.generator_dir()
    finally:
        runner.close()
    assert trained == runner.run_dir / "generator" / "model", "the round kept no generator"
    return trained, [h.model_dump() for h in summary.steps]


# ==================================================================== the judge, measured
def set_accuracy(passed: Sequence[bool], scores: Sequence[float], eps: float) -> float | None:
    """The share of (passed, not passed) pairs the scores order the passed one first (within eps: 1/2); None when
    the set has no such pair."""
    won = pairs = 0.0
    for a in (i for i, p in enumerate(passed) if p):
        for b in (i for i, p in enumerate(passed) if not p):
            gap = scores[a] - scores[b]
            won += 1.0 if gap >= eps else 0.5 if abs(gap) < eps else 0.0
            pairs += 1
    return won / pairs if pairs else None


def scored_sets(
    settings: Settings,
    generator_dir: Path,
    sets: Sequence[tuple[str, list[str], list[bool]]],
) -> list[ScoredSet]:
    """Each set scored by the judge alone: the rubrics of the generator at `generator_dir`, the frozen verifier
    (`models.verifier`) answering."""
    from dynrubric.app.train_commands import engine_factory
    from dynrubric.rubric.evaluator import Evaluator

    make = engine_factory(settings)
    verifier_dir = modelcache.resolve(settings.paths.resolved_home(), settings.models.verifier)
    generator, verifier = make("generator", generator_dir), make("verifier", verifier_dir)
    try:
        evaluator = Evaluator(generator, verifier, settings.rubric)
        scored = []
        for i in range(0, len(sets), 8):
            chunk = sets[i : i + 8]
            scored += evaluator.score_sets([s[0] for s in chunk], [s[1] for s in chunk])
    finally:
        generator.close()
        verifier.close()
    return scored


def accuracies(
    sets: Sequence[tuple[str, list[str], list[bool]]], scores: Sequence[Sequence[float]], eps: float
) -> list[float]:
    """Each set's `set_accuracy` under `scores`."""
    out = [set_accuracy(s[2], x, eps) for s, x in zip(sets, scores, strict=True)]
    assert all(a is not None for a in out), "every set has a (passed, failed) pair"
    return [float(a) for a in out if a is not None]


def judge_sets(
    settings: Settings, generator_dir: Path, sets: Sequence[tuple[str, list[str], list[bool]]]
) -> list[float]:
    """Each set's accuracy with the rubrics of the generator at `generator_dir`, the frozen verifier answering."""
    scored = scored_sets(settings, generator_dir, sets)
    return accuracies(sets, [x.scores for x in scored], settings.rubric.eps)


def benchmark_sets(open_sets: int, real_sets: int) -> dict[str, list[tuple[str, list[str], list[bool]]]]:
    """The judge benchmarks' sets: (prompt, responses, passed)."""
    opened = [s for s in read_open_sets(DATA / "judge_open.jsonl") if s.source == "arena-hard"][:open_sets]
    real = [s for s in read_real_sets(DATA / "judge_real.jsonl") if s.separated][:real_sets]
    return {
        "open": [(s.prompt, s.responses, s.passed) for s in opened],
        "real": [(s.prompt, s.responses, s.passed) for s in real],
    }


def line(name: str, before: Sequence[float], afters: Sequence[Sequence[float]]) -> str:
    mean_after = [sum(a[i] for a in afters) / len(afters) for i in range(len(before))]
    delta, low, high = paired_bootstrap(mean_after, before, 2000, 0.95)
    return (
        f"{name}: before {sum(before) / len(before):.3f}, after {sum(mean_after) / len(mean_after):.3f}, delta "
        f"{delta:+.3f} (95% CI {low:+.3f}..{high:+.3f}) over {len(before)} sets, {len(afters)} seed(s)"
    )


class JudgedRuns:
    """What a before/after judge benchmark has judged, kept in `results.json` under its --out so that a later call
    adds seeds: the base generator's accuracies per set ("before") and each seed's ("seed S"), with what else the seed
    recorded ("seed S seconds", ...)."""

    def __init__(self, path: Path):
        self.path = path
        self.results: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}

    def judge_before(
        self, settings: Settings, base_dir: Path, sets: dict[str, list[tuple[str, list[str], list[bool]]]]
    ) -> None:
        if "before" not in self.results:
            t0 = time.monotonic()
            self.record("before", {name: judge_sets(settings, base_dir, s) for name, s in sets.items()})
            print(f"base generator judged ({time.monotonic() - t0:.0f}s)", flush=True)

    def pending(self, seeds: range) -> list[int]:
        done = [seed for seed in seeds if f"seed {seed}" in self.results]
        for seed in done:
            print(f"  seed {seed}: done before ({self.path})", flush=True)
        return [seed for seed in seeds if seed not in done]

    def record(self, key: str, value: Any) -> None:
        self.results[key] = value
        self.path.write_text(json.dumps(self.results))

    def record_seed(
        self, key: str, after: dict[str, list[float]], seconds: dict[str, float], **measures: list[float]
    ) -> str:
        """One seed's accuracies per benchmark (`key`), its seconds ("`key` seconds") and each training measure's
        values ("`key` `name`"); the seed's mean accuracies, for its printed line."""
        self.record(key + " seconds", seconds)
        for name, values in measures.items():
            self.record(f"{key} {name}", values)
        self.record(key, after)
        return ", ".join(f"{n} {sum(v) / len(v):.3f}" for n, v in after.items() if v)

    def lines(self, names: Sequence[str]) -> list[str]:
        """Per benchmark, the base generator against every seed judged so far (`line`)."""
        seeds = [k for k in self.results if k.startswith("seed ") and k[len("seed ") :].isdigit()]
        return [
            line(name, self.results["before"][name], [self.results[k][name] for k in seeds])
            for name in names
            if seeds and self.results["before"].get(name)
        ]


# ==================================================================== main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--seed-start", type=int, default=0)
    ap.add_argument("--steps", type=int, default=12, help="generator steps a seed trains")
    ap.add_argument("--sets-per-step", type=int, default=4)
    ap.add_argument("--rubric-samples", type=int, default=4, help="rubrics sampled per set (the GRPO group)")
    ap.add_argument("--prompts", type=int, default=64, help="train-split Arena-Hard questions to train on")
    ap.add_argument("--open-sets", type=int, default=48)
    ap.add_argument("--real-sets", type=int, default=24)
    ap.add_argument("--out", type=Path, default=Path("/tmp/dynrubric-coevolution"))
    ap.add_argument("--quick", action="store_true", help="2 steps of 2 sets, 4 + 4 sets judged: does it run")
    args = ap.parse_args()
    stop_signals_interrupt()  # a SIGTERM unwinds the `with`s: the vLLM server it started stops too
    if args.quick:
        args.steps, args.sets_per_step, args.prompts, args.open_sets, args.real_sets = 2, 2, 8, 4, 4
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYNRUBRIC_")}
    base = load_settings(None, env, profile="demo")
    shape = {"sets_per_step": args.sets_per_step, "rubric_samples": args.rubric_samples}
    base_dir = modelcache.resolve(base.paths.resolved_home(), base.models.generator)
    sets = benchmark_sets(args.open_sets, args.real_sets)
    judged = JudgedRuns(out / "results.json")

    from transformers import AutoTokenizer

    from dynrubric.app.train_commands import engine_factory
    from dynrubric.engines.vllm_server import VllmServer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    started = time.monotonic()
    with VllmServer(base_dir, base.vllm) as server:
        print(f"vLLM server at {server.base_url} ({time.monotonic() - started:.0f}s)", flush=True)
        data = out / "data"
        data.mkdir(exist_ok=True)
        questions = training_questions(args.prompts, 0, base.train.max_prompt_tokens, tokenizer)
        probe = run_settings(base, out / "base", server.base_url, data / "p", data / "a", 1, 0, shape)
        policy = engine_factory(probe)("policy", base_dir)
        prompts, anchors = write_training_data(data, questions, policy, tokenizer, 0)
        policy.close()
        print(f"{len(questions)} train-split Arena-Hard questions with their anchors ({anchors})", flush=True)

        judged.judge_before(probe, base_dir, sets)
        for seed in judged.pending(range(args.seed_start, args.seed_start + args.seeds)):
            key = f"seed {seed}"
            run = out / f"s{seed}"
            shutil.rmtree(run, ignore_errors=True)
            settings = run_settings(base, run, server.base_url, prompts, anchors, args.steps, seed, shape)
            t0 = time.monotonic()
            trained, steps = train_generator(settings)
            train_s = time.monotonic() - t0
            for s in steps:
                print(
                    f"    step {s['step']}: updated {s.get('updated')}, "
                    + ", ".join(f"{k} {v:.3f}" for k, v in s.items() if k.startswith("gen_") and isinstance(v, float)),
                    flush=True,
                )
            t0 = time.monotonic()
            after = {name: judge_sets(settings, trained, s) for name, s in sets.items()}
            means = judged.record_seed(key, after, {"train": train_s, "judge": time.monotonic() - t0})
            print(f"  {key}: {args.steps} generator steps in {train_s:.0f}s; {means}", flush=True)
    print(f"total {(time.monotonic() - started) / 60:.1f} min")
    print("\n".join(judged.lines(list(sets))))


if __name__ == "__main__":
    main()
