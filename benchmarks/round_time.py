"""How long one round of `dynrubric up` takes, before and after the speed settings, side by side (issue 38).

One round of the demo profile from base (its ten policy steps of 8 sets x 4 candidates, one generator step, the
held-out evaluation with the dev split and the five reported figures), run twice in this one process on the same
training prompts and seed, as `up` runs its rounds: the loop's own round code (`RoundRunner`) on one vLLM server
that the policy and the rubric generator take turns on, with the verifier in process (`engine.one_shared_server`,
the server started as `up` starts it). Each arm starts from a fresh state directory, so each decodes base on the
dev split and the figures inside its round, as `up`'s first round does.

    before   the demo's settings at commit 01cc34f (`BEFORE`): the trainer under bfloat16 autocast whatever the CPU,
             micro-batches of 4, 16 requests in flight per engine, the evaluation's prompts sent 32 at a time
    after    the demo profile as shipped: `grpo.compute_dtype: auto` (float32 on a CPU without native bfloat16),
             micro-batches of 2, 64 requests in flight (`engine.concurrency`), 256 prompts at a time
             (`evaluation.decode_batch`)

On a CPU that multiplies bfloat16 natively (AMX, AVX512-BF16) `auto` is bfloat16 too, and the arms differ only in the
micro-batch, the requests in flight and the evaluation's batch (docs/benchmarks.md: 0.52 on an AVX2-only CPU, 0.80
on one with AVX512-BF16).

The arms run in the order given (`--arms`; the default runs `after` first, so that the trainer's peak memory printed
after it is its own).

It prints each stage's seconds (the round's `stage_seconds`, as `dynrubric report` shows them) for both arms, their
totals and `ratio: X` (after / before): the same steps, prompts and seeds on each side.

    python benchmarks/round_time.py [--out DIR] [--arms after before] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout this file is in, not another install
sys.path.insert(0, str(ROOT / "benchmarks"))  # supervision.py's training prompts and round runner

from supervision import deep_merge, train_run, training_prompts  # noqa: E402

from dynrubric import modelcache  # noqa: E402
from dynrubric.config import Settings  # noqa: E402
from dynrubric.config_loader import load_settings, override  # noqa: E402
from dynrubric.engines import one_shared_server  # noqa: E402
from dynrubric.process import stop_signals_interrupt  # noqa: E402

#: the settings each arm puts over the demo profile
BEFORE: dict[str, Any] = {
    "train": {"grpo": {"compute_dtype": "bfloat16", "micro_batch_size": 4}},
    "engine": {"concurrency": 16},
    "evaluation": {"decode_batch": 32},
}
AFTER: dict[str, Any] = {}
ARMS: dict[str, dict[str, Any]] = {"after": AFTER, "before": BEFORE}
QUICK: dict[str, Any] = {
    "train": {"steps_per_round": 3, "coevolve": {"k_alt": 2, "k_alt_generator": 1}},
    "evaluation": {"max_prompts": 10, "report_prompts": 12},
}


def arm_settings(base: Settings, arm: str, run: Path, prompts_file: Path, url: str) -> Settings:
    # as `up`'s rounds: the policy and the generator on the one server, the verifier in process (loop.py)
    engine = one_shared_server(url, in_process=["verifier"]) | ARMS[arm].get("engine", {})
    return override(
        base,
        deep_merge(
            ARMS[arm],
            {
                "paths": {"state_dir": str(run)},
                "train": {"prompt_source": "jsonl", "prompts_file": str(prompts_file)},
                "engine": engine,
            },
        ),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/dynrubric-round-time"))
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--quick", action="store_true", help="a tiny round: does it run end to end")
    args = ap.parse_args()
    stop_signals_interrupt()  # a SIGTERM unwinds the `with`s: the vLLM server it started stops too
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYNRUBRIC_")}
    base = load_settings(None, env, profile="demo")
    if args.quick:
        base = override(base, QUICK)
    per_round = base.train.prompts_per_step * base.train.coevolve.k_alt
    prompts_file = out / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps(p) + "\n" for p in training_prompts(per_round)))
    print(
        f"one round of {base.train.coevolve.k_alt} policy steps x {base.train.prompts_per_step} sets x "
        f"{base.train.candidates} candidates and {base.train.coevolve.k_alt_generator} generator step(s), "
        f"{per_round} training prompts; figures {', '.join(base.evaluation.figures)}",
        flush=True,
    )

    from dynrubric.app.loop import TRAINER_KV_CACHE_GIB
    from dynrubric.engines.vllm_server import VllmServer, every_core
    from dynrubric.train.records import RoundSummary, read_summary
    from dynrubric.train.rounds import SUMMARY, run_dir_of

    model = modelcache.resolve(base.paths.resolved_home(), base.models.verifier)
    cfg = base.vllm.model_copy(update={"kv_cache_space_gib": TRAINER_KV_CACHE_GIB})
    stages: dict[str, dict[str, float]] = {}
    totals: dict[str, float] = {}
    with VllmServer(model, cfg, env={"VLLM_CPU_OMP_THREADS_BIND": every_core()}) as server:  # as `up` starts it
        for arm in args.arms:
            run = out / arm
            shutil.rmtree(run, ignore_errors=True)
            settings = arm_settings(base, arm, run, prompts_file, server.base_url)
            print(f"{arm}: training one round in {run}", flush=True)
            t0 = time.monotonic()
            train_run(settings, 1)
            wall = time.monotonic() - t0
            summary = read_summary(sorted((run_dir_of(settings) / "rounds").iterdir())[-1] / SUMMARY)
            assert isinstance(summary, RoundSummary)  # the embedded trainer's round, not OpenRLHF's
            stages[arm] = dict(summary.stage_seconds)
            totals[arm] = float(summary.seconds)
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            print(f"{arm}: round {summary.seconds:.0f}s (wall {wall:.0f}s); trainer peak RSS so far {peak:.1f} GiB")

    names = list(dict.fromkeys(k for arm in stages for k in stages[arm]))
    print(f"\n{'stage':20} " + " ".join(f"{a:>9}" for a in stages))
    for name in names:
        print(f"{name:20} " + " ".join(f"{stages[a].get(name, 0.0):>9.1f}" for a in stages))
    print(f"{'round':20} " + " ".join(f"{totals[a]:>9.1f}" for a in stages))
    (out / "results.json").write_text(json.dumps({"stages": stages, "totals": totals}, indent=1))
    if "before" in totals and "after" in totals:
        print(f"ratio: {totals['after'] / totals['before']:.2f}")


if __name__ == "__main__":
    main()
