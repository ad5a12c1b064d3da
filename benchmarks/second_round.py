"""Does a second round add to the first? Issue 38's training settings side by side, on held-out ground truth.

Every arm trains two rounds from base in the loop's own round code, as benchmarks/supervision.py runs its arms: the
same cheap round (`supervision.ROUND`), training prompts, shared vLLM server and base evaluation, and the shipped
reward (`full`). An arm differs from the demo profile in one training setting:

    shipped     the demo profile as it ships
    centred     grpo.advantages centred: a set's advantages are E - mean, not divided by the set's std (Dr GRPO)
    warmup      grpo.warmup_updates 2: a fresh AdamW each round, its learning rate rising over its first 2 updates
    carry       warmup, and grpo.optimizer_across_rounds carry: round 2 goes on with the AdamW state round 1 ended
                with (moments and step counter, so the lineage warms up once)
    kl_parent   grpo.kl_reference parent: round 2's KL penalty holds it to its parent instead of base
    dynamic     dynamic_sampling.oversample 2: a policy step draws up to twice its sets and trains on those that
                spread (DAPO's dynamic sampling)

Round 1 takes the first half of the training prompts and round 2 the second (`train.max_prompts_per_round`), so
round 2 trains on prompts round 1 never saw, as in the loop. Round 2's parent is round 1's candidate when round 1's
guard accepted it, else base; "served" is the last accepted version after the two rounds.

Per arm, pooled over its seeds (per prompt the mean over seeds; a paired bootstrap 95 % CI over the prompts):
- round 2's candidate vs its parent on dev (the split the guard decides on) and on each test figure;
- the served version vs base on the same;
- in how many seeds each round's guard accepted its candidate.
Per seed, round 2 vs its own parent on dev (200 prompts, `DEV_PROMPTS`), and in how many seeds that CI is above 0
(issue 38 asks for 2 of 3).

The last lines, one per arm:

    arm centred: round 2 vs parent dev +0.010 (95% CI -0.040..+0.060); seen ...; unseen ...; ifbench ...; open ...;
    guards accepted r1/r2 3/3 of 3; r2 above its parent on dev (CI above 0) in 1 of 3 seeds

    python benchmarks/second_round.py [--seeds 3] [--seed-start 0] [--arms shipped centred ...] [--out DIR]
                                      [--quick] [--report]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout this file is in, not another install
sys.path.insert(0, str(ROOT / "benchmarks"))  # supervision.py: the runs' machinery, shared

import supervision  # noqa: E402

from dynrubric.config import Settings  # noqa: E402
from dynrubric.config_loader import load_settings, override  # noqa: E402
from dynrubric.jsonl import split_lines  # noqa: E402
from dynrubric.process import stop_signals_interrupt  # noqa: E402
from dynrubric.train.policy_eval import VersionOutcomes, paired_bootstrap  # noqa: E402

#: each arm: one training setting over the demo profile (the reward is the shipped one in every arm)
WARMUP = {"warmup_updates": 2}
ARMS: dict[str, dict[str, Any]] = {
    "shipped": {},
    "centred": {"train": {"grpo": {"advantages": "centred"}}},
    "warmup": {"train": {"grpo": WARMUP}},
    "carry": {"train": {"grpo": WARMUP | {"optimizer_across_rounds": "carry"}}},
    "kl_parent": {"train": {"grpo": {"kl_reference": "parent"}}},
    "dynamic": {"train": {"dynamic_sampling": {"oversample": 2.0}}},
}
ROUNDS = 2
#: dev prompts a version is judged on: the 200 that `up`'s guard and the learning benchmark decide on (supervision.py's
#: round checks 40, where a round-2 gain of a few points can never show a CI above 0)
DEV_PROMPTS = 200
#: dev (the guard's split) first, then the test figures of supervision.py's table
SHOWN = {"dev": "dev"} | supervision.SHOWN


def arm_settings(base: Settings, arm: str, seed: int, run: Path, prompts_file: Path, url: str) -> Settings:
    return supervision.overlay_settings(base, ARMS[arm], seed, run, prompts_file, url)


@dataclass
class RunRecord:
    """One arm x seed: which versions its two rounds made, and what the guard decided."""

    arm: str
    seed: int
    run: str
    seconds: float
    versions: list[str | None]  # each round's candidate (None: the round registered nothing)
    accepted: list[bool]  # each round's guard
    parents: list[str]  # each round's parent
    served: str  # the last accepted version after the rounds (base if none)


def served_after(parents: Sequence[str], versions: Sequence[str | None], accepted: Sequence[bool]) -> str:
    """The version the loop would serve after the rounds: the last candidate its guard accepted, else the last
    round's parent (what it started from, the head until then)."""
    for version, ok in zip(reversed(versions), reversed(accepted), strict=True):
        if ok and version is not None:
            return version
    return parents[0]


def outcomes(settings: Settings, version: str) -> dict[str, VersionOutcomes]:
    """`version`'s stored outcomes on dev and the figures (supervision.final_outcomes reads the figures alone)."""
    from dynrubric.train.policy_eval import outcome_store

    out = dict(supervision.final_outcomes(settings, version))
    path = outcome_store(settings).path(version, "dev")
    if path.is_file():
        out["dev"] = VersionOutcomes.model_validate_json(path.read_text())
    return out


def pooled_delta(
    new: Sequence[VersionOutcomes], reference: Sequence[VersionOutcomes], samples: int = 2000
) -> tuple[float, float, float]:
    """(delta, low, high): per prompt the mean over seeds of `new`'s grade, paired with the mean over the same
    seeds of `reference`'s (each seed's own reference: round 2's parent differs by seed), on the prompts all of
    them answered; a paired bootstrap 95 % CI over the prompts."""
    if not new or len(new) != len(reference):
        raise ValueError("one reference per run")
    keys = sorted(set.intersection(*(set(o.scores) for o in [*new, *reference])))
    if not keys:
        raise ValueError("no prompt that every run answered")
    a = [sum(o.scores[k] for o in new) / len(new) for k in keys]
    b = [sum(o.scores[k] for o in reference) / len(reference) for k in keys]
    return paired_bootstrap(a, b, samples, 0.95)


def seeds_gaining_on_dev(
    new: Sequence[dict[str, VersionOutcomes]], parents: Sequence[dict[str, VersionOutcomes]]
) -> list[tuple[float, float, float] | None]:
    """Per seed, round 2's candidate vs its own parent on dev (issue 38: "round 2 gains on its parent, with the CI's
    lower bound above 0, in at least 2 of the 3 seeds"); None where either has no dev outcomes."""
    return [
        pooled_delta([n["dev"]], [p["dev"]]) if "dev" in n and "dev" in p else None
        for n, p in zip(new, parents, strict=True)
    ]


def table(records: Sequence[RunRecord], settings_of: Any, base: dict[str, VersionOutcomes]) -> list[str]:
    """Per arm: round 2 vs its parent, the served version vs base, and the guards' counts; then the last lines."""
    lines = [f"{'arm':10} {'seeds':>5} {'accepted r1/r2':>14} {'':15}" + " ".join(f"{n:>30}" for n in SHOWN.values())]
    last = []
    for arm in ARMS:
        mine = [r for r in records if r.arm == arm]
        if not mine:
            continue
        runs = [(r, outcomes(settings_of(r), r.versions[-1] or r.parents[-1])) for r in mine]
        parents = [outcomes(settings_of(r), r.parents[-1]) for r in mine]
        served = [outcomes(settings_of(r), r.served) for r in mine]
        accepted = "/".join(str(sum(r.accepted[i] for r in mine)) for i in range(ROUNDS))
        vs_parent, vs_base, parts = [], [], []
        for suite, name in SHOWN.items():
            if suite not in base or any(suite not in o for (_, o) in runs) or any(suite not in o for o in parents):
                vs_parent.append(f"{'-':>30}")
                vs_base.append(f"{'-':>30}")
                continue
            d = pooled_delta([o[suite] for _, o in runs], [o[suite] for o in parents])
            vs_parent.append(f"{supervision.fmt(d):>30}")
            parts.append(f"{name} {supervision.fmt(d)}")
            if all(suite in o for o in served):
                vs_base.append(
                    f"{supervision.fmt(pooled_delta([o[suite] for o in served], [base[suite]] * len(mine))):>30}"
                )
            else:
                vs_base.append(f"{'-':>30}")
        lines.append(f"{arm:10} {len(mine):>5} {accepted:>14} {'r2 vs parent':15}" + " ".join(vs_parent))
        lines.append(f"{'':10} {'':>5} {'':>14} {'served vs base':15}" + " ".join(vs_base))
        gains = seeds_gaining_on_dev([o for _, o in runs], parents)
        for (r, _), gain in zip(runs, gains, strict=True):
            shown = supervision.fmt(gain) if gain is not None else "-"
            lines.append(f"{'':10} seed {r.seed}: r2 vs its parent {r.parents[-1]} on dev {shown}")
        gained = sum(gain is not None and gain[1] > 0 for gain in gains)
        last.append(
            f"arm {arm}: round 2 vs parent "
            + "; ".join(parts)
            + f"; guards accepted r1/r2 {accepted} of {len(mine)}; r2 above its parent on dev (CI above 0) in "
            f"{gained} of {len(mine)} seeds"
        )
    return lines + last


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--seed-start", type=int, default=0, help="the first seed (seeds seed-start .. seed-start+seeds-1)")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--out", type=Path, default=Path("/tmp/dynrubric-second-round"))
    ap.add_argument("--quick", action="store_true", help="a tiny round and figures: does it run end to end")
    ap.add_argument("--report", action="store_true", help="train nothing: the table of the runs under --out so far")
    args = ap.parse_args()
    stop_signals_interrupt()  # a SIGTERM unwinds the `with`s: the vLLM server it started stops too
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYNRUBRIC_")}
    shape = supervision.deep_merge(supervision.ROUND, supervision.QUICK) if args.quick else supervision.ROUND
    base_settings = override(load_settings(None, env, profile="demo"), shape)
    if not args.quick:
        base_settings = override(base_settings, {"evaluation": {"max_prompts": DEV_PROMPTS}})
    per_round = base_settings.train.prompts_per_step * base_settings.train.coevolve.k_alt
    # each round takes its own prompts: round 1 the file's first per_round lines, round 2 the next
    base_settings = override(base_settings, {"train": {"max_prompts_per_round": per_round}})
    prompts_file = out / "prompts.jsonl"
    prompts = supervision.training_prompts(per_round * ROUNDS)
    prompts_file.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    print(
        f"{len(prompts)} training prompts ({prompts_file}), {per_round} a round; per run {ROUNDS} rounds of "
        f"{base_settings.train.coevolve.k_alt} policy steps x {base_settings.train.prompts_per_step} sets x "
        f"{base_settings.train.candidates} candidates and {base_settings.train.coevolve.k_alt_generator} generator "
        f"step(s); dev {base_settings.evaluation.max_prompts} prompts, figures of "
        f"{base_settings.evaluation.report_prompts}",
        flush=True,
    )
    record = out / "results.jsonl"

    def settings_of(r: RunRecord) -> Settings:
        return arm_settings(base_settings, r.arm, r.seed, out / r.run, prompts_file, "http://unused")

    def report() -> None:
        records = [RunRecord(**json.loads(x)) for x in split_lines(record.read_text())] if record.is_file() else []
        base_run = arm_settings(base_settings, "shipped", 0, out / "base", prompts_file, "http://unused")
        base = outcomes(base_run, "base")
        print("\nbase: " + ", ".join(f"{SHOWN[s]} {o.pass_rate():.3f} on {len(o.scores)}" for s, o in base.items()))
        for line in table([r for r in records if r.arm in args.arms], settings_of, base):
            print(line)

    if args.report:
        report()
        return
    started = time.monotonic()
    with supervision.server_with_base(base_settings, out, prompts_file) as (url, base_run):
        for seed, arm in supervision.pending_runs(
            record, range(args.seed_start, args.seed_start + args.seeds), args.arms
        ):
            run = out / f"{arm}-s{seed}"
            shutil.rmtree(run, ignore_errors=True)
            settings = arm_settings(base_settings, arm, seed, run, prompts_file, url)
            supervision.copy_base(base_run, settings)
            print(f"  {arm} seed {seed}: training in {run}", flush=True)
            t0 = time.monotonic()
            summaries = supervision.train_rounds(settings, ROUNDS)
            versions = [s.version for s in summaries]
            accepted = [s.guard.accepted and s.version is not None for s in summaries]
            parents = [s.parent for s in summaries]
            r = RunRecord(
                arm,
                seed,
                run.name,
                time.monotonic() - t0,
                versions,
                accepted,
                parents,
                served_after(parents, versions, accepted),
            )
            print(f"  {arm} seed {seed}: {r.versions} accepted {r.accepted}, served {r.served} in {r.seconds:.0f}s")
            with record.open("a") as f:
                f.write(json.dumps(r.__dict__) + "\n")
    print(f"total {(time.monotonic() - started) / 60:.1f} min")
    report()


if __name__ == "__main__":
    main()
