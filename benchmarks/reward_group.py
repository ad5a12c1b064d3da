"""What one OpenRLHF batch costs the reward server: 4 prompts x 4 samples scored as the barrier does
(one `Evaluator.score_sets` call over the 4 closed groups), with SmolLM2-135M in-process.

OpenRLHF 0.11.2 gives each reward request 180 s (aiohttp total timeout), and a sample's request waits
for its group's barrier AND the scoring of that group, so `group_timeout_s` plus this number must fit.
Prints, per rubric configuration: seconds for the batch, seconds per group, and the generation ladder's
counts (parse failures and fallbacks make a batch slower: every retry is another generator pass).

    python benchmarks/reward_group.py                      # the default rubric settings
    python benchmarks/reward_group.py --set retries=0 ...  # RubricConfig overrides
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dynrubric.config_loader import load_settings  # noqa: E402

QUESTIONS = [
    "What is 17 + 25? Explain briefly.",
    "Why do leaves change colour in autumn?",
    "How do I reverse a list in Python?",
    "Give two tips for sleeping better.",
]
RESPONSES = [
    ["42.", "17 + 25 = 42, since 17 + 20 = 37 and 37 + 5 = 42.", "It is 32.", "The sum is forty-two."],
    [
        "Chlorophyll breaks down, so yellow and red pigments show.",
        "Because it gets cold.",
        "Leaves are green.",
        "Shorter days stop chlorophyll production; carotenoids and anthocyanins remain visible.",
    ],
    ["Use reversed(lst) or lst[::-1].", "lst.reverse() reverses in place.", "You cannot.", "Sort it descending."],
    [
        "Keep a regular schedule and avoid screens before bed.",
        "Drink coffee at night.",
        "Sleep more.",
        "Exercise during the day and keep your bedroom dark and cool.",
    ],
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", action="append", default=[], help="rubric.KEY=VALUE (repeatable)")
    args = parser.parse_args()
    for item in args.set:
        key, value = item.split("=", 1)
        os.environ[f"DYNRUBRIC_RUBRIC__{key.upper()}"] = value
    from prometheus_client import CollectorRegistry

    from dynrubric.engines import build_engine
    from dynrubric.rubric.evaluator import Evaluator, EvaluatorMetrics

    settings = load_settings()
    engine = build_engine(settings, "generator")
    evaluator = Evaluator(engine, engine, settings.rubric, EvaluatorMetrics(CollectorRegistry()))
    from dynrubric.engines.base import GenerationRequest, SamplingParams

    engine.generate([GenerationRequest("Say hi.", SamplingParams(max_tokens=4))])  # warm-up: weights paged in
    start, cpu = time.perf_counter(), time.process_time()
    scored = evaluator.score_sets(QUESTIONS, RESPONSES)
    batch_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    r = settings.rubric
    print(
        f"rubric: generator_max_tokens={r.generator_max_tokens} retries={r.retries} "
        f"prompt_only_retries={r.prompt_only_retries} max_items={r.max_items}"
    )
    print(
        f"sources: {[s.rubric_source for s in scored]}; parse failures {evaluator.counts.parse_failures}, "
        f"prompt-only fallbacks {evaluator.counts.prompt_only_fallbacks}, generic {evaluator.counts.generic_fallbacks}"
    )
    verify_s = sum(s.verify_seconds for s in scored)
    print(
        f"rubric generation {batch_s - verify_s:.1f} s, verification {verify_s:.1f} s "
        f"({[round(s.verify_seconds, 1) for s in scored]} per group)"
    )
    print(
        f"batch of {len(QUESTIONS)} groups x {len(RESPONSES[0])}: {batch_s:.1f} s wall "
        f"({batch_s / len(QUESTIONS):.1f} s per group), {cpu_s:.1f} CPU-s on {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
