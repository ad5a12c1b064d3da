"""What running a round on Ray costs: the same round in-process and on a local Ray, then judging alone
on two judge actors vs one.

1. rounds:  two training rounds (the shipped prompts, SmolLM2-135M as policy, rubric writer and
            verifier, in-process transformers engines) with `train.executor: inprocess`, then the same
            two rounds in a fresh state dir with `train.executor: ray` on a local Ray started beforehand
            (joining a running cluster is what a deployment does; starting it is not the round's cost).
            Ray's first round starts the actors (a process each, importing torch); later rounds reuse
            them, as a long-running trainer does. Prints every time, the first round's ratio, and
            `ratio: X` = Ray / in-process for round 2 (target <= 1.15).
2. judging: the same candidate sets, split into two chunks, judged by a pool of one judge actor, then
            of two (each holding its own rubric writer and verifier), after one warm-up call each.
            The judges share the machine's cores (`ray.actor_cpus` = cores / judges, each actor's torch
            threads = its cores). Prints both times and `judging ratio: X` (two judges / one). On a
            2-core machine expect little gain: one judge already runs on both cores.

    python benchmarks/ray_overhead.py            # SmolLM2-135M from the model cache
    python benchmarks/ray_overhead.py --quick    # the tiny random test model (seconds; overhead-dominated)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dynrubric.train.records import RoundSummary

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout this file is in, not another install


def settings_for(state: Path, model: str, executor: str, judges: int, quick: bool, actor_cpus: float = 0.0):
    from dynrubric.config import Settings

    small = {
        "candidates": 4,
        "prompts_per_step": 4,
        "steps_per_round": 2,
        "max_prompts_per_round": 12,
        "heldout_prompts": 2,
        "max_new_tokens": 16 if quick else 48,
        "judge_chunks": 2,
        "coevolve": {"k_alt": 1, "rubric_samples": 2, "sets_per_step": 2, "generator_max_tokens": 64},
    }
    return Settings.model_validate(
        {
            "paths": {"state_dir": str(state)},
            "models": {"policy": model, "generator": model, "verifier": model},
            "rubric": {"generator_max_tokens": 64 if quick else 160},
            "train": {
                **small,
                "prompts_file": str(ROOT / "dynrubric" / "data" / "prompts.jsonl"),
                "executor": executor,
            },
            "ray": {"judges": judges, "actor_cpus": actor_cpus},
        }
    )


def time_rounds(state: Path, model: str, executor: str, quick: bool) -> tuple[list[float], RoundSummary]:
    """Seconds of two rounds one after another (the first starts the workers), and the last summary."""
    from dynrubric.app.train_commands import engine_factory, prompt_source
    from dynrubric.registry import open_registry
    from dynrubric.train.rounds import RoundRunner

    s = settings_for(state, model, executor, 1, quick)
    runner = RoundRunner(s, open_registry(s), prompt_source(s), engine_factory(s))
    runner.ensure_base()  # registering the base model is not the round's work
    times = []
    try:
        for _ in range(2):
            start = time.perf_counter()
            summary = runner.run()
            times.append(time.perf_counter() - start)
    finally:
        runner.close()
    return times, summary


def time_judging(state: Path, model: str, judges: int, quick: bool, cpus: int) -> float:
    from dynrubric import modelcache
    from dynrubric.app.train_commands import engine_factory
    from dynrubric.train.executor import ScoreChunk
    from dynrubric.train.ray_executor import RayExecutor

    s = settings_for(state, model, "ray", judges, quick, actor_cpus=max(1, cpus // judges))  # they share the cores
    model_dir = modelcache.resolve(s.paths.resolved_home(), model)
    questions = [
        "Name three colours.",
        "What is 12 times 3?",
        "Say hello politely.",
        "Describe the sea.",
        "Give one word for happy.",
        "List two fruits.",
        "What is the capital of France?",
        "Count to five.",
    ]
    answers = [
        "Red, green and blue.",
        "36",
        "Hello there!",
        "It is large and blue.",
        "Glad",
        "Apple, pear",
        "Paris",
        "1 2 3 4 5",
    ]
    sets = [[a, a.upper(), f"I think: {a}", "I do not know."] for a in answers]
    chunks = [ScoreChunk(questions[:4], sets[:4], 1), ScoreChunk(questions[4:], sets[4:], 2)]
    executor = RayExecutor(s, engine_factory(s))
    try:
        pool = executor.judges(None, None, "policy", model_dir, model_dir)  # type: ignore[arg-type]
        pool.score(chunks, lambda n: None)  # warm-up: every actor has loaded its engines
        start = time.perf_counter()
        pool.score(chunks, lambda n: None)
        return time.perf_counter() - start
    finally:
        executor.close()


def stages(summary: RoundSummary) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in summary.stage_seconds.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the tiny random test model instead of SmolLM2-135M")
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    args = parser.parse_args()

    import ray

    with tempfile.TemporaryDirectory() as tmp:
        model = "smollm2-135m"
        if args.quick:
            from tests.tinymodel import build_tiny_model

            model = str(build_tiny_model(Path(tmp) / "tiny"))
        local, summary = time_rounds(Path(tmp) / "inprocess", model, "inprocess", args.quick)
        print(f"in-process: round 1 {local[0]:.1f} s, round 2 {local[1]:.1f} s ({summary.phases})", flush=True)
        print(f"  round 2 stages: {stages(summary)}", flush=True)
        ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
        try:
            remote, ray_summary = time_rounds(Path(tmp) / "ray", model, "ray", args.quick)
            print(
                f"on Ray:     round 1 {remote[0]:.1f} s (starts the actors), round 2 {remote[1]:.1f} s "
                f"({ray_summary.phases})"
            )
            print(f"  round 2 stages: {stages(ray_summary)}")
            print(f"first-round ratio (actor start included): {remote[0] / local[0]:.2f}")
            print(f"ratio: {remote[1] / local[1]:.2f}", flush=True)
            cpus = int(ray.cluster_resources()["CPU"])
            one = time_judging(Path(tmp) / "j1", model, 1, args.quick, cpus)
            two = time_judging(Path(tmp) / "j2", model, 2, args.quick, cpus)
            print(
                f"judging 8 sets in 2 chunks on {cpus} CPUs: one judge actor {one:.1f} s (all {cpus} cores), "
                f"two judge actors {two:.1f} s ({max(1, cpus // 2)} each)"
            )
            print(f"judging ratio: {two / one:.2f}")
        finally:
            ray.shutdown()


if __name__ == "__main__":
    main()
