"""Does the closed loop make the served model better, cycle after cycle? Ground truth on held-out prompts.

Runs `dynrubric up` (the demo's embedded parts: Tansu, ingest, a vLLM stable and canary engine, the router,
simulated users, rounds, canary rollouts behind the gate) for `--cycles` cycles (or, without it, as many as fit in
`--minutes`: no cycle starts that the last one's length says would not end in time), leaving the registry under
`DIR/registry/checkpoints/<version>/` (HF model directories). With `--seeds N` it runs N loops one after another,
each in `DIR/seed-S` with `train.seed` S, S counting from `--seed-start` (default 0, so that a later session can run
the seeds an earlier one did not). Per loop it prints the learning curve, one block per cycle, read from the rounds'
own evaluations (the three-way split of issue 35: dev, which the guard decides on, and the test
figures, which nothing decides on): the candidate, its parent and base, the candidate's paired difference from each
with its 95 % CI, what the guard and the rollout decided and which version served after the cycle:

    cycle 2: round 2 r2 (candidate; rollout promoted; serving r2)
      dev            r2 0.412  parent r1 0.388  base 0.250  vs parent +0.025 (95% CI -0.013..+0.063)  vs base ...
      test seen      ...

If `up` fails or is stopped, the curve covers the cycles it finished and the script exits non-zero there. Else it
then evaluates the base and each loop's final served version on the held-out prompts with ground truth
(`dynrubric eval-policy`: greedy, the users' max_tokens, the official IFEval checkers and computed answers; no
judge) and prints

    heldout_pass[base]: X
    heldout_pass[final]: Y
    delta: D (95% CI lo..hi)
    final_version: V

    python benchmarks/learning.py --state-dir DIR [--cycles N | --minutes M] [--seeds S [--seed-start F]]
                                  [--engine-server vllm|transformers] [--config FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout this file is in, not another install

if TYPE_CHECKING:
    from dynrubric.config import Settings


#: `up`'s line for a cycle (dynrubric/app/cli.py `_print_up`)
CYCLE_LINE = re.compile(r"^cycle (\d+): round (\d+) (\S+) (\S+); rollout (.+?); serving (\S+?)(;|$)")


@dataclass
class Cycle:
    cycle: int
    round: int
    version: str
    round_state: str
    decision: str
    serving: str


def cycles_of(output: str) -> list[Cycle]:
    """The cycles `up` printed, in order."""
    out = []
    for line in output.splitlines():
        if m := CYCLE_LINE.match(line.strip()):
            out.append(Cycle(int(m[1]), int(m[2]), m[3], m[4], m[5], m[6]))
    return out


def run_loop(cycles: int | None, minutes: float, extra: list[str], env: dict[str, str]) -> tuple[int, str]:
    """`dynrubric up` for `cycles` cycles (None: as many as fit in `minutes`), its output shown as it comes and
    returned: (exit code, output)."""
    budget = ["--cycles", str(cycles)] if cycles is not None else ["--forever", "--minutes", str(minutes)]
    cmd = [sys.executable, "-m", "dynrubric", "up", *budget, *extra]
    print(f"$ {' '.join(cmd)}  (state dir {env['DYNRUBRIC_PATHS__STATE_DIR']})", flush=True)
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    return proc.wait(), "".join(lines)


def curve(settings: Settings, cycles: Sequence[Cycle]) -> list[str]:
    """Each cycle's candidate, parent and base on dev and on each test figure, from its round's evaluation."""
    from dynrubric.train.policy_eval import FIGURE_TITLES
    from dynrubric.train.records import RoundSummary, read_summary
    from dynrubric.train.rounds import SUMMARY, run_dir_of

    lines = []
    for c in cycles:
        lines.append(
            f"cycle {c.cycle}: round {c.round} {c.version} ({c.round_state}; rollout {c.decision}; serving {c.serving})"
        )
        path = run_dir_of(settings) / "rounds" / f"{c.round:04d}" / SUMMARY
        summary = read_summary(path) if path.is_file() else None
        truth = summary.eval.groundtruth if isinstance(summary, RoundSummary) and summary.eval else None
        if truth is None:
            lines.append("  no ground-truth evaluation (the round registered nothing)")
            continue
        parent, base = truth.vs_parent.reference, truth.vs_base.reference
        rows = [("dev", truth.prompts, truth.pass_rate, truth.vs_parent, truth.vs_base)] + [
            (name, f.prompts, f.score, f.vs_parent, f.vs_base) for name, f in truth.figures.items()
        ]
        for name, prompts, score, vs_parent, vs_base in rows:
            lines.append(
                f"  {FIGURE_TITLES[name]:18} {prompts:>4} prompts  {truth.version} {score[truth.version]:.3f}  "
                f"parent {parent} {score[parent]:.3f}  base {base} {score[base]:.3f}  "
                f"vs parent {vs_parent.delta_ci()}  vs base {vs_base.delta_ci()}"
            )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--state-dir", type=Path, required=True)
    ap.add_argument("--cycles", type=int, default=None, help="cycles per loop (default: as many as fit in --minutes)")
    ap.add_argument("--minutes", type=float, default=45.0, help="time budget of a loop without --cycles")
    ap.add_argument("--seeds", type=int, default=None, help="loops one after another, seeds 0..N-1, each in DIR/seed-S")
    ap.add_argument("--seed-start", type=int, default=0, help="the first seed with --seeds (seed-start .. +N-1)")
    ap.add_argument(
        "--engine-server",
        choices=["vllm", "transformers"],
        default=None,
        help="the serving engines (default: the config's, vLLM)",
    )
    ap.add_argument("--config", type=Path, default=None, help="a config file for `dynrubric -c`")
    args = ap.parse_args()
    if args.cycles is not None and args.cycles < 1:
        raise SystemExit(f"--cycles {args.cycles} runs nothing: pass 1 or more")
    root = args.state_dir.resolve()
    seeds = range(args.seed_start, args.seed_start + (args.seeds or 0))
    runs = [(None, root)] if args.seeds is None else [(s, root / f"seed-{s}") for s in seeds]
    finals = []
    for seed, state in runs:
        finals.append(one_loop(args, seed, state))
    if len(finals) > 1:
        print("per seed, the last served version vs base on the held-out prompts:")
        for seed, line in zip([s for s, _ in runs], finals, strict=True):
            print(f"  seed {seed}: {line}")


def one_loop(args: argparse.Namespace, seed: int | None, state: Path) -> str:
    """One closed loop in `state` (seed: `train.seed`; None: the config's); its curve and final evaluation."""
    state.mkdir(parents=True, exist_ok=True)
    # the registry lives under the state dir by default: DIR/registry/registry.sqlite, DIR/registry/checkpoints/
    env = {**os.environ, "DYNRUBRIC_PATHS__STATE_DIR": str(state)}
    if seed is not None:
        env["DYNRUBRIC_TRAIN__SEED"] = str(seed)
    if args.config is not None:
        env["DYNRUBRIC_CONFIG"] = str(args.config.resolve())
    extra = [] if args.engine_server is None else ["--engine-server", args.engine_server]
    started = time.monotonic()
    rc, output = run_loop(args.cycles, args.minutes, extra, env)
    loop_s = time.monotonic() - started

    from dynrubric.config_loader import load_settings
    from dynrubric.registry import open_registry

    settings = load_settings(args.config, env, profile="demo")  # the profile `up` ran with
    cycles = cycles_of(output)  # a stopped `up` still prints the cycles it finished
    print(f"learning curve{'' if seed is None else f' (seed {seed})'}, each cycle's round on its own evaluation:")
    for line in curve(settings, cycles):
        print(line)
    if rc != 0:
        raise SystemExit(f"dynrubric up failed (exit {rc}) after {len(cycles)} finished cycle(s): the curve above")
    registry = open_registry(settings)
    final = registry.stable()
    versions = ["base"] + ([final.version] if final and final.version != "base" else [])
    subprocess.run([sys.executable, "-m", "dynrubric", "eval-policy", *versions], env=env, cwd=ROOT, check=True)

    from dynrubric.train.policy_eval import compare, decode_params, eval_key, heldout_prompts, outcome_store

    key = eval_key(heldout_prompts(settings), decode_params(settings))
    store = outcome_store(settings)
    base = store.get("base", key)
    last = store.get(versions[-1], key)
    assert base is not None and last is not None, "eval-policy has just stored both"
    e = settings.evaluation
    c = compare(last, base, e.bootstrap_samples, e.confidence)
    print(f"closed loop: {loop_s / 60:.1f} min; held-out prompts: {c.prompts}")
    print(f"heldout_pass[base]: {base.pass_rate():.3f}")
    print(f"heldout_pass[final]: {last.pass_rate():.3f}")
    print(f"delta: {c.delta_ci()}")
    print(f"final_version: {versions[-1]}")
    print(json.dumps({"by_kind": {"base": base.by_kind(), "final": last.by_kind()}}))
    return f"{versions[-1]} {last.pass_rate():.3f} vs base {base.pass_rate():.3f}: {c.delta_ci()}"


if __name__ == "__main__":
    main()
