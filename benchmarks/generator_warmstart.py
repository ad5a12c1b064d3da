"""Does teaching the rubric generator what experts write make the judge alone rank? Before and after a warm start.

Issue 36's lever "teach the generator what a rubric item is": the generator fine-tuned, supervised, on experts'
rubric items for TRAIN-split open prompts (dynrubric/train/generator_warmstart.py: HealthBench's physicians'
criteria and WritingBench's checklists, written in the generator's item schema, each the answer to the generator's
own set-conditioned prompt over the reference answer and base SmolLM2's). Then the judge alone
(`coevolution.JUDGE`: no derived ground-truth item, no vote, stated checks only, trust `best`) ranks the same sets
with the base generator and with each seed's warm-started one:

    open     the open judge benchmark's 48 Arena-Hard sets (test-split questions; no Arena-Hard prompt has criteria,
             so this is a domain the warm start never saw): the strong model's answer beside 3 of base SmolLM2's
    health   its 16 HealthBench sets (test-split questions; the physicians' ideal completion beside 3 of SmolLM2's),
             judged here by generated rubrics, not by the physicians' criteria
    real     checker-split sets of SmolLM2's own answers to held-out instruction prompts (judge_real.jsonl)

Per set, the share of (strong or passing, other) pairs ordered right (a tie within rubric.eps = 1/2); the delta
is the mean over seeds of (after - before) per set, with a paired bootstrap 95 % CI over the sets
(`coevolution.line`). A seed draws its own items, set orders and example order. One vLLM server decodes the
policy's answers for the training sets (160 tokens, temperature 1, seeded) and serves generator and verifier in
turns, as in coevolution.py; the warm start itself runs in this process.

    python benchmarks/generator_warmstart.py [--seeds 3] [--seed-start 0] [--epochs 2] [--lr 5e-5] [--variants 1]
                                             [--out DIR] [--quick]

The last lines:

    open: before 0.653, after 0.700, delta +0.047 (95% CI -0.010..+0.100) over 48 sets, 3 seed(s)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout this file is in, not another install
sys.path.insert(0, str(ROOT / "benchmarks"))  # coevolution.py: the judge alone, its sets and its report line

import coevolution  # noqa: E402

from dynrubric import modelcache  # noqa: E402
from dynrubric.config import Settings  # noqa: E402
from dynrubric.config_loader import load_settings, override  # noqa: E402
from dynrubric.engines import one_shared_server  # noqa: E402
from dynrubric.engines.base import Engine, GenerationRequest, SamplingParams  # noqa: E402
from dynrubric.process import stop_signals_interrupt  # noqa: E402
from dynrubric.rubric.benchmark import read_open_sets  # noqa: E402
from dynrubric.train.generator_warmstart import (  # noqa: E402
    ExpertPrompt,
    WarmStartStep,
    expert_prompts,
    warm_start,
    warmstart_examples,
)

K = 4  # the set's size, as the judge benchmarks' sets


def judge_settings(base: Settings, run: Path, url: str) -> Settings:
    return override(
        base, {"paths": {"state_dir": str(run)}, "rubric": coevolution.JUDGE, "engine": one_shared_server(url)}
    )


def policy_answers(
    engine: Engine, prompts: Sequence[ExpertPrompt], tokens: int, cache: Path, seed: int = 0
) -> dict[str, list[str]]:
    """K answers of the base policy per prompt (kept in `cache`: every seed trains on the same answers)."""
    if cache.is_file():
        return dict(json.loads(cache.read_text()))
    from dynrubric.seeds import derive_seed

    requests = [
        GenerationRequest(
            engine.render_chat([{"role": "user", "content": p.question}]),
            SamplingParams(max_tokens=tokens, temperature=1.0, n=K, seed=derive_seed(seed, "warmstart-answers", p.id)),
        )
        for p in prompts
    ]
    answers = {p.id: [c.text for c in outs] for p, outs in zip(prompts, engine.generate(requests), strict=True)}
    cache.write_text(json.dumps(answers))
    return answers


Sets = dict[str, list[tuple[str, list[str], list[bool]]]]


def benchmark_sets(open_sets: int, health_sets: int, real_sets: int) -> Sets:
    sets = coevolution.benchmark_sets(open_sets, real_sets)
    health = [s for s in read_open_sets(coevolution.DATA / "judge_open.jsonl") if s.source == "healthbench"]
    return {"open": sets["open"], "health": [(s.prompt, s.responses, s.passed) for s in health][:health_sets]} | {
        "real": sets["real"]
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--seed-start", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--batch", type=int, default=8, help="examples per update")
    ap.add_argument("--variants", type=int, default=1, help="examples per prompt (another draw of its items)")
    ap.add_argument("--prompts", type=int, default=0, help="train on the first N expert prompts (0: all)")
    ap.add_argument("--open-sets", type=int, default=48)
    ap.add_argument("--health-sets", type=int, default=16)
    ap.add_argument("--real-sets", type=int, default=24)
    ap.add_argument("--out", type=Path, default=Path("/tmp/dynrubric-generator-warmstart"))
    ap.add_argument("--quick", action="store_true", help="8 prompts, 1 epoch, 4 + 2 + 4 sets judged: does it run")
    args = ap.parse_args()
    stop_signals_interrupt()  # a SIGTERM unwinds the `with`s: the vLLM server it started stops too
    if args.quick:
        args.prompts, args.epochs, args.variants, args.open_sets, args.health_sets, args.real_sets = 8, 1, 1, 4, 2, 4
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYNRUBRIC_")}
    base = load_settings(None, env, profile="demo")
    base_dir = modelcache.resolve(base.paths.resolved_home(), base.models.generator)
    sets = benchmark_sets(args.open_sets, args.health_sets, args.real_sets)
    prompts = expert_prompts(coevolution.DATA / "prompts.jsonl")
    prompts = prompts[: args.prompts] if args.prompts else prompts
    judged = coevolution.JudgedRuns(out / "results.json")

    from dynrubric.app.train_commands import engine_factory
    from dynrubric.engines.vllm_server import VllmServer
    from dynrubric.rubric.generate import RubricGenerator

    started = time.monotonic()
    with VllmServer(base_dir, base.vllm) as server:
        print(f"vLLM server at {server.base_url} ({time.monotonic() - started:.0f}s)", flush=True)
        probe = judge_settings(base, out / "base", server.base_url)
        policy = engine_factory(probe)("policy", base_dir)
        t0 = time.monotonic()
        answers = policy_answers(policy, prompts, coevolution.TOKENS, out / f"answers-{len(prompts)}.json")
        set_prompt = RubricGenerator(policy, probe.rubric).set_prompt
        print(f"{len(prompts)} train-split expert prompts, {K} answers each ({time.monotonic() - t0:.0f}s)", flush=True)

        judged.judge_before(probe, base_dir, sets)
        for seed in judged.pending(range(args.seed_start, args.seed_start + args.seeds)):
            key = f"seed {seed}"
            run = out / f"s{seed}"
            shutil.rmtree(run, ignore_errors=True)
            examples = warmstart_examples(prompts, answers, set_prompt, K, args.variants, seed)

            def log(s: WarmStartStep) -> None:
                print(f"    update {s.update} (epoch {s.epoch}): nll {s.nll:.3f} over {s.tokens} tokens", flush=True)

            t0 = time.monotonic()
            steps = warm_start(
                base_dir,
                examples,
                run / "generator",
                lr=args.lr,
                epochs=args.epochs,
                batch=args.batch,
                micro_batch=2,
                seed=seed,
                log=log,
            )
            train_s = time.monotonic() - t0
            t0 = time.monotonic()
            settings = judge_settings(base, run, server.base_url)
            after = {name: coevolution.judge_sets(settings, run / "generator", s) for name, s in sets.items()}
            seconds = {"train": train_s, "judge": time.monotonic() - t0}
            means = judged.record_seed(key, after, seconds, nll=[steps[0].nll, steps[-1].nll])
            print(
                f"  {key}: {len(examples)} examples, {len(steps)} updates in {train_s:.0f}s, "
                f"nll {steps[0].nll:.3f} -> {steps[-1].nll:.3f}; {means}",
                flush=True,
            )
        policy.close()
    print(f"total {(time.monotonic() - started) / 60:.1f} min")
    print("\n".join(judged.lines(list(sets))))


if __name__ == "__main__":
    main()
