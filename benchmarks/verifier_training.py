"""Does training the verifier on ranked answers make the judge alone rank? Before and after, the same rubrics.

Issue 36: the judge alone ranks open answers about as well as its verifier reads them (0.653 on the open sets; a
generator taught experts' items did not move it, docs/benchmarks.md). Here the verifier is trained
(dynrubric/train/verifier_training.py) on the signal the generator learns from in R_anchor: a ranked pair of
answers. The training sets are TRAIN-split prompts, never the test sets' questions (`splits.split_of`):

    arena    --train-open Arena-Hard questions: o3-mini's answer (the preferred one) beside 3 of base SmolLM2's
    health   --train-health single-turn HealthBench prompts: the physicians' ideal completion beside 3 of SmolLM2's

every answer cut or decoded to the open benchmark's 160 tokens. The base generator writes each set's rubric, as the
judge alone would (`coevolution.JUDGE`); each item the verifier reads, on the preferred answer and on one other,
makes a pair (one item drawn per other answer), and the verifier learns to order the pair by the item's polarity.

Then the judge alone ranks the same benchmark sets with the base verifier and with each seed's trained one, the
generator's rubrics the same for both (written once, then read by either verifier: `Evaluator.judge`):

    open     the open judge benchmark's 48 Arena-Hard sets (test-split questions)
    health   its 16 HealthBench sets (test-split questions)
    real     checker-split sets of SmolLM2's own answers to held-out instruction prompts (judge_real.jsonl): a
             domain the training never saw, where a verifier that learned only "the strong model's style" would not
             help, and one that learned to say no more readily could hurt

Per set, the share of (strong or passing, other) pairs ordered right (a tie within rubric.eps = 1/2); the delta is
the mean over seeds of (after - before) per set, with a paired bootstrap 95 % CI over the sets (`coevolution.line`).
A seed draws its own pairs and their order. One vLLM server decodes the answers and serves generator and verifier
in turns; the training runs in this process.

    python benchmarks/verifier_training.py [--seeds 1] [--seed-start 0] [--train-open 64] [--train-health 32]
                                           [--epochs 2] [--lr 5e-5] [--out DIR] [--quick]
                                           [--strong gemini --trained DIR] [--validate 0.2 --check-every 10]

`--validate SHARE` holds out that share of the training prompts (a seeded draw per seed) as validation pairs and
keeps the weights of the lowest validation loss, checked every `--check-every` updates (early stopping,
`train_verifier`); the last weights are judged too, side by side, into results-last.json (the same "before").

`--strong gemini` puts Gemini-2.0-flash's answer in each open set in place of o3-mini's (the sets `open-gemini`):
the verifier was trained to prefer o3-mini's answers, so a gain that holds there is not o3-mini's manner alone.
`--trained DIR` judges with the verifiers an earlier run trained (DIR/s<seed>/verifier) instead of training.

The last lines:

    open: before 0.653, after 0.700, delta +0.047 (95% CI -0.010..+0.100) over 48 sets, 1 seed(s)
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout this file is in, not another install
sys.path.insert(0, str(ROOT / "benchmarks"))  # coevolution.py, generator_warmstart.py: the judge, its sets, answers

import coevolution  # noqa: E402
from generator_warmstart import benchmark_sets, judge_settings, policy_answers  # noqa: E402

from dynrubric import modelcache  # noqa: E402
from dynrubric.config import Settings  # noqa: E402
from dynrubric.config_loader import load_settings  # noqa: E402
from dynrubric.process import stop_signals_interrupt  # noqa: E402
from dynrubric.rubric.items import Rubric  # noqa: E402
from dynrubric.train.generator_warmstart import ExpertPrompt, expert_prompts  # noqa: E402
from dynrubric.train.verifier_training import (  # noqa: E402
    VerdictPair,
    VerifierCheck,
    VerifierStep,
    items_read,
    train_verifier,
    verdict_pairs,
)

Sets = dict[str, list[tuple[str, list[str], list[bool]]]]
OTHERS = 3  # base SmolLM2's answers beside the preferred one, as in the benchmark's sets


def cut(tokenizer: Any, text: str) -> str:
    """`text` cut to the open benchmark's answer budget in `tokenizer`'s tokens."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return (
        text
        if len(ids) <= coevolution.TOKENS
        else str(tokenizer.decode(ids[: coevolution.TOKENS], skip_special_tokens=True))
    )


def training_prompts(base: Settings, arena: int, health: int, tokenizer: Any) -> list[ExpertPrompt]:
    """TRAIN-split prompts with a preferred answer (cut to the benchmark's tokens): Arena-Hard's strong answer, then
    HealthBench's ideal completion."""

    questions = coevolution.training_questions(arena, 0, base.train.max_prompt_tokens, tokenizer)
    out = [
        ExpertPrompt(q["uid"], "arena-hard", q["prompt"], (cut(tokenizer, q["strong_text"]),), ()) for q in questions
    ]
    healthy = [
        p for p in expert_prompts(coevolution.DATA / "prompts.jsonl") if p.source == "healthbench" and p.references
    ]
    return out + [
        ExpertPrompt(p.id, p.source, p.question, (cut(tokenizer, p.references[0]),), ()) for p in healthy[:health]
    ]


def with_gemini(
    open_sets: list[tuple[str, list[str], list[bool]]], tokenizer: Any
) -> list[tuple[str, list[str], list[bool]]]:
    """The open sets with Gemini-2.0-flash's answer to each question (cut to the benchmark's tokens) in place of
    o3-mini's, the model whose answers the verifier was trained to prefer: what it learned is either what makes an
    answer better or o3-mini's manner. A question Gemini has no answer to is left out."""
    from make_open_judge_benchmark import ARENA, _jsonl, tasks_dir

    root = tasks_dir() / ARENA
    answers = {}
    for obj in _jsonl(root / "model_answer" / "gemini-2.0-flash-001.jsonl"):
        content = obj["messages"][-1]["content"]
        answers[obj["uid"]] = content.get("answer", "") if isinstance(content, dict) else str(content)
    by_prompt = {q["prompt"]: answers.get(q["uid"], "") for q in _jsonl(root / "question.jsonl")}
    out = []
    for prompt, responses, passed in open_sets:
        other = by_prompt.get(prompt, "")
        if other.strip():
            shown = cut(tokenizer, other)
            out.append((prompt, [shown if p else r for r, p in zip(responses, passed, strict=True)], passed))
    return out


def training_rubrics(
    settings: Settings, base_dir: Path, sets: Sequence[tuple[str, list[str]]], cache: Path
) -> list[Rubric]:
    """The base generator's rubric per training set (kept in `cache`: every seed trains on the same rubrics)."""
    if cache.is_file():
        return [Rubric.model_validate(r) for r in json.loads(cache.read_text())]
    from dynrubric.app.train_commands import engine_factory
    from dynrubric.rubric.generate import RubricGenerator

    generator = engine_factory(settings)("generator", base_dir)
    try:
        generated, _ = RubricGenerator(generator, settings.rubric).generate_many(
            [s[0] for s in sets], [s[1] for s in sets], settings.rubric.seed
        )
    finally:
        generator.close()
    rubrics = [g.rubric for g in generated]
    cache.write_text(json.dumps([r.model_dump() for r in rubrics]))
    return rubrics


def rejudged(
    settings: Settings, verifier_dir: Path, sets: Sets, rubrics: dict[str, list[Rubric]]
) -> dict[str, list[float]]:
    """Each benchmark set's accuracy under its stored rubric, the verifier at `verifier_dir` answering."""
    from dynrubric.app.train_commands import engine_factory
    from dynrubric.rubric.evaluator import Evaluator

    make = engine_factory(settings)
    base_dir = modelcache.resolve(settings.paths.resolved_home(), settings.models.generator)
    generator, verifier = make("generator", base_dir), make("verifier", verifier_dir)
    try:
        evaluator = Evaluator(generator, verifier, settings.rubric)
        return {
            name: coevolution.accuracies(
                s,
                [
                    evaluator.judge(p, r, responses).scores
                    for (p, responses, _), r in zip(s, rubrics[name], strict=True)
                ],
                settings.rubric.eps,
            )
            for name, s in sets.items()
        }
    finally:
        generator.close()
        verifier.close()


def log(s: VerifierStep | VerifierCheck) -> None:
    if isinstance(s, VerifierCheck):
        print(f"    validation after {s.update} updates: loss {s.loss:.3f}, ordered {s.ordered:.2f}", flush=True)
    else:
        print(f"    update {s.update} (epoch {s.epoch}): loss {s.loss:.3f}, ordered {s.ordered:.2f}", flush=True)


def split_pairs(
    render: Any, training_sets: Sequence[tuple[str, list[str]]], read: Sequence[Sequence[Any]], seed: int, share: float
) -> tuple[list[VerdictPair], list[VerdictPair]]:
    """(training, validation) pairs: `share` of the prompts with items, a seeded draw, give the validation pairs, so
    that no validation pair shares a prompt with a training pair."""
    rng = random.Random(seed)
    with_items = [i for i, items in enumerate(read) if items]
    held = set(rng.sample(with_items, round(share * len(with_items))))
    train: list[VerdictPair] = []
    validation: list[VerdictPair] = []
    for i in with_items:
        question, responses = training_sets[i]
        (validation if i in held else train).extend(verdict_pairs(render, question, responses, 0, read[i], rng))
    return train, validation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--seed-start", type=int, default=0)
    ap.add_argument("--train-open", type=int, default=64, help="train-split Arena-Hard questions")
    ap.add_argument("--train-health", type=int, default=32, help="train-split HealthBench prompts")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--batch", type=int, default=8, help="pairs per update")
    ap.add_argument("--open-sets", type=int, default=48)
    ap.add_argument("--health-sets", type=int, default=16)
    ap.add_argument("--real-sets", type=int, default=24)
    ap.add_argument("--out", type=Path, default=Path("/tmp/dynrubric-verifier-training"))
    ap.add_argument("--quick", action="store_true", help="4 + 2 training prompts, 4 + 2 + 4 sets judged: does it run")
    ap.add_argument(
        "--strong",
        choices=["o3-mini", "gemini"],
        default="o3-mini",
        help="the open sets' strong answer: the benchmark's (o3-mini's, as in training) or Gemini-2.0-flash's",
    )
    ap.add_argument(
        "--trained", type=Path, help="judge with the verifiers another run trained (DIR/s<seed>/verifier): no training"
    )
    ap.add_argument("--validate", type=float, default=0.0, help="share of training prompts held out: early stopping")
    ap.add_argument("--check-every", type=int, default=10, help="updates between validation checks")
    args = ap.parse_args()
    stop_signals_interrupt()  # a SIGTERM unwinds the `with`s: the vLLM server it started stops too
    if args.quick:
        args.train_open, args.train_health, args.open_sets, args.health_sets, args.real_sets = 4, 2, 4, 2, 4
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYNRUBRIC_")}
    base = load_settings(None, env, profile="demo")
    base_dir = modelcache.resolve(base.paths.resolved_home(), base.models.generator)
    sets = benchmark_sets(args.open_sets, args.health_sets, args.real_sets)
    judged = coevolution.JudgedRuns(out / "results.json")
    judged_last = coevolution.JudgedRuns(out / "results-last.json")  # with --validate: the last weights

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    if args.strong == "gemini":
        sets = {
            "open-gemini" if n == "open" else n: with_gemini(s, tokenizer) if n == "open" else s
            for n, s in sets.items()
        }

    from dynrubric.app.train_commands import engine_factory
    from dynrubric.engines.vllm_server import VllmServer
    from dynrubric.rubric.verify import AnswerTokens, Verifier

    started = time.monotonic()
    with VllmServer(base_dir, base.vllm) as server:
        print(f"vLLM server at {server.base_url} ({time.monotonic() - started:.0f}s)", flush=True)
        settings = judge_settings(base, out / "base", server.base_url)
        policy = engine_factory(settings)("policy", base_dir)  # decodes the answers; renders the verifier's prompts
        if args.trained is None:
            t0 = time.monotonic()
            prompts = training_prompts(base, args.train_open, args.train_health, tokenizer)
            answers = policy_answers(policy, prompts, coevolution.TOKENS, out / f"answers-{len(prompts)}.json")
            training_sets = [(p.question, [p.references[0], *answers[p.id][:OTHERS]]) for p in prompts]
            rubrics = training_rubrics(settings, base_dir, training_sets, out / f"rubrics-{len(prompts)}.json")
            read = [items_read(r, settings.rubric.check_weight) for r in rubrics]
            # the verifier's prompts rendered, and its Yes/No read, as its engine does (same tokenizer and template)
            render, answers_read = Verifier(policy).prompts, AnswerTokens.of(policy)
            print(
                f"{len(prompts)} train-split prompts, {OTHERS} answers each and a rubric; {sum(map(len, read))} items "
                f"the verifier reads in {sum(1 for r in read if r)} sets ({time.monotonic() - t0:.0f}s)",
                flush=True,
            )

        if "before" not in judged.results:
            t0 = time.monotonic()
            kept = {name: coevolution.scored_sets(settings, base_dir, s) for name, s in sets.items()}
            (out / "rubrics-benchmark.json").write_text(
                json.dumps({name: [x.rubric.model_dump() for x in k] for name, k in kept.items()})
            )
            judged.record(
                "before",
                {
                    name: coevolution.accuracies(sets[name], [x.scores for x in k], settings.rubric.eps)
                    for name, k in kept.items()
                },
            )
            print(f"base verifier judged ({time.monotonic() - t0:.0f}s)", flush=True)
        stored = json.loads((out / "rubrics-benchmark.json").read_text())
        benchmark_rubrics = {name: [Rubric.model_validate(r) for r in stored[name]] for name in sets}

        for seed in judged.pending(range(args.seed_start, args.seed_start + args.seeds)):
            key = f"seed {seed}"
            run = out / f"s{seed}"
            measures: dict[str, list[float]] = {}
            t0 = time.monotonic()
            if args.trained is not None:
                verifier = args.trained.resolve() / f"s{seed}" / "verifier"
                trained = f"{verifier}"
            else:
                shutil.rmtree(run, ignore_errors=True)
                verifier = run / "verifier"
                pairs, validation = split_pairs(render, training_sets, read, seed, args.validate)
                trained_run = train_verifier(
                    base_dir,
                    pairs,
                    answers_read.yes,
                    answers_read.no,
                    verifier,
                    lr=args.lr,
                    epochs=args.epochs,
                    batch=args.batch,
                    micro_batch=2,
                    seed=seed,
                    validation=validation,
                    check_every=args.check_every,
                    last_dir=run / "verifier-last" if validation else None,
                    log=log,
                )
                steps = trained_run.steps
                measures["loss"] = [steps[0].loss, steps[-1].loss]
                trained = f"{len(pairs)} pairs, {len(steps)} updates, loss {steps[0].loss:.3f} -> {steps[-1].loss:.3f}"
                if validation:
                    measures["validation loss"] = [c.loss for c in trained_run.checks]
                    measures["kept"] = [float(trained_run.kept)]
                    trained += (
                        f"; {len(validation)} validation pairs, kept the weights after {trained_run.kept} updates"
                    )
            train_s = time.monotonic() - t0
            t0 = time.monotonic()
            after = rejudged(judge_settings(base, run, server.base_url), verifier, sets, benchmark_rubrics)
            seconds = {"train": train_s, "judge": time.monotonic() - t0}
            means = judged.record_seed(key, after, seconds, **measures)
            print(f"  {key}: {trained} ({train_s:.0f}s); {means}", flush=True)
            if (run / "verifier-last").is_dir():
                judged_last.results.setdefault("before", judged.results["before"])
                last = rejudged(
                    judge_settings(base, run, server.base_url), run / "verifier-last", sets, benchmark_rubrics
                )
                print(f"  {key}, the last weights: {judged_last.record_seed(key, last, seconds)}", flush=True)
        policy.close()
    print(f"total {(time.monotonic() - started) / 60:.1f} min")
    print("\n".join(judged.lines(list(sets))))
    if judged_last.results:
        print("the last weights, not the validation's:")
        print("\n".join(judged_last.lines(list(sets))))


if __name__ == "__main__":
    main()
