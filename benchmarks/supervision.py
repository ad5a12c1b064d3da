"""Which reward teaches? The same rounds under five reward arms, judged on test ground truth the reward never sees.

DynamicRubric's supervision claim (issue 36): a set-conditioned rubric judge teaches a policy better than a
prompt-only rubric, a fixed generic rubric or no judge. Every arm is a configuration of the one judge
(`rubric.*`), nothing else differs:

    ground_truth       rubric.mode checks: the prompt's own checked constraints and computed answers only; an open
                       prompt (no checker) gives an untrusted set, no gradient
    judge:set          rubric.mode set, no derived items (prompt_constraints, consensus off): the generator reads
                       the prompt and the whole candidate set; the verifier answers its items
    judge:prompt_only  the same judge, the generator reads the prompt alone
    judge:generic      the same verifier on the configured generic rubric (no generator)
    full               the shipped default: derived ground-truth items (75 % of a checkable prompt's score) + the
                       set-conditioned judge + the consensus item

and, named with --arms, `judge:set+levers`: judge:set with the levers benchmarks/judge_levers.py measured on open
prompts (a check only where its item's text states it; trust rule `best`); `judge:set+verifier`: judge:set+levers
with a trained verifier (`models.verifier` = --verifier DIR, a model dir benchmarks/verifier_training.py writes).

Each arm and seed trains from the base model on the same training prompts (the bank's train split, half checkable
and half open, as the demo's users send them), with the same round shape and seeds (`train.seed` = the seed), in
the loop's own round code (`RoundRunner`: candidates, rubrics, verdicts, GRPO, the generator's co-evolution steps,
the ground-truth evaluation). One vLLM server samples candidates and rubrics for every run (the policy and the
generator take turns on it, `engine.shared_servers`, as in `dynrubric up`); the verifier runs in this process.

A round here is cheap (`ROUND`): fewer policy steps than the demo's ten, shorter figures. Base is evaluated once
and its outcomes are copied into every run (greedy decoding: the same answers).

Per arm, pooled over its seeds: each test figure's delta vs base, `mean_s(cand_s(p)) - base(p)` per prompt p, with
a paired bootstrap 95 % CI over the prompts (test seen types, test unseen types, IFBench, open quality); the arm's
reward agreement with the checker on its own training sets (pairs of candidates the checker separates: share the
reward orders the same way, a tie counting 1/2); the seconds per run. The last lines, one per arm:

    arm judge:set: seen +0.050 (95% CI +0.010..+0.090); unseen ...; ifbench ...; open ...

    python benchmarks/supervision.py [--seeds 3] [--seed-start 0] [--rounds 1] [--arms full judge:set ...] [--out DIR]
                                     [--quick] [--report]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout this file is in, not another install

from dynrubric import modelcache  # noqa: E402
from dynrubric.config import Settings  # noqa: E402
from dynrubric.config_loader import load_settings, override  # noqa: E402
from dynrubric.engines import one_shared_server  # noqa: E402
from dynrubric.jsonl import split_lines  # noqa: E402
from dynrubric.process import stop_signals_interrupt  # noqa: E402
from dynrubric.rubric.groundtruth import derive  # noqa: E402
from dynrubric.train.policy_eval import (  # noqa: E402
    FIGURES,
    Suite,
    VersionOutcomes,
    default_prompts_file,
    paired_bootstrap,
)
from dynrubric.train.prompts import make_prompt  # noqa: E402
from dynrubric.train.records import RoundSummary  # noqa: E402
from dynrubric.train.splits import trainable  # noqa: E402

#: each arm: the judge's configuration (rubric.*) over the demo profile; where the judge has no generator (checks,
#: the generic rubric) the round has no generator step either (`train.coevolve.enabled` off), the same policy steps
NO_GENERATOR = {"coevolve": {"enabled": False}}
JUDGE_ALONE = {"prompt_constraints": False, "consensus": False}  # no derived ground-truth item, no vote
#: judge:set with the levers of benchmarks/judge_levers.py: checks only where the item's text states them, the
#: verifier answers the rest, and an item overruled only when a calibration answer beats the set's best answer
LEVERS = {"rubric": {"mode": "set", **JUDGE_ALONE, "stated_checks_only": True, "trust_rule": "best"}}
ARMS: dict[str, dict[str, Any]] = {
    "ground_truth": {"rubric": {"mode": "checks", "consensus": False}, "train": NO_GENERATOR},
    "judge:set": {"rubric": {"mode": "set", **JUDGE_ALONE}},
    "judge:prompt_only": {"rubric": {"mode": "prompt_only", **JUDGE_ALONE}},
    "judge:generic": {"rubric": {"mode": "generic", **JUDGE_ALONE}, "train": NO_GENERATOR},
    "full": {},
    "judge:set+levers": LEVERS,
    # the same with a trained verifier: its model dir (--verifier) is the run's `models.verifier` (`run_settings`)
    "judge:set+verifier": LEVERS,
}
#: the arm whose verifier is the model dir given as --verifier
TRAINED_VERIFIER = "judge:set+verifier"
#: the arms run when none is named: the five of the issue
DEFAULT_ARMS = ["ground_truth", "judge:set", "judge:prompt_only", "judge:generic", "full"]

#: the benchmark's round over the demo profile: 5 policy steps of 8 sets x 4 candidates and 1 generator step (the
#: demo: 10 + 1); figures of 80 prompts; the dev check (the guard's) on 40
ROUND: dict[str, Any] = {
    "train": {"steps_per_round": 6, "coevolve": {"k_alt": 5, "k_alt_generator": 1}},
    "evaluation": {"max_prompts": 40, "report_prompts": 80, "figures": ["test_seen", "test_unseen", "ifbench", "open"]},
}
QUICK: dict[str, Any] = {
    "train": {"steps_per_round": 3, "prompts_per_step": 4, "coevolve": {"k_alt": 2, "k_alt_generator": 1}},
    "evaluation": {"max_prompts": 10, "report_prompts": 12},
}
#: the figures of the table, as the last lines name them
SHOWN = {"test_seen": "seen", "test_unseen": "unseen", "ifbench": "ifbench", "open": "open"}


def deep_merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# ==================================================================== the training prompts
def training_prompts(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` prompts of the bank's train split that a round may train on, half open and half checkable (the demo
    users' OPEN_SHARE), the checkable ones instruction and arithmetic in the bank's proportion; a fixed draw."""
    lines = [json.loads(x) for x in split_lines(default_prompts_file().read_text()) if x.strip()]
    train = [x for x in lines if x["split"] == "train"]
    rng = random.Random(seed)
    rng.shuffle(train)
    open_ = [x for x in train if x["kind"] == "open"]
    checkable = []
    for x in train:
        if x["kind"] == "open":
            continue
        question = x["messages"][-1]["content"]
        key = make_prompt([(m["role"], m["content"]) for m in x["messages"]]).key
        if trainable(key, [i.id for i in derive(question).instructions]):
            checkable.append(x)
    chosen = [p for pair in zip(open_[: n - n // 2], checkable[: n // 2], strict=False) for p in pair]
    return [{"messages": x["messages"]} for x in chosen[:n]]


# ==================================================================== one arm x seed
def run_settings(
    base: Settings, arm: str, seed: int, run: Path, prompts_file: Path, url: str, verifier: Path | None = None
) -> Settings:
    """The arm's settings: its judge (`TRAINED_VERIFIER`'s with `verifier` as its model), and without a generator a
    round of the same policy steps alone."""
    overlay = ARMS[arm]
    if arm == TRAINED_VERIFIER:
        if verifier is None or not (verifier / "config.json").is_file():
            raise SystemExit(
                f"error: the arm {arm} needs --verifier DIR, a model dir with config.json (got {verifier})"
            )
        overlay = deep_merge(overlay, {"models": {"verifier": str(verifier.resolve())}})
    return overlay_settings(base, overlay, seed, run, prompts_file, url)


def overlay_settings(
    base: Settings, overlay: dict[str, Any], seed: int, run: Path, prompts_file: Path, url: str
) -> Settings:
    """One run's settings: `overlay` (config sections as nested dicts) over `base`, with the run's own state dir,
    seed and training prompts, on the shared server (the verifier in this process). An overlay that turns the
    generator off gets a round of the same policy steps alone."""
    if not overlay.get("train", {}).get("coevolve", {}).get("enabled", True):
        base = override(base, {"train": {"steps_per_round": base.train.coevolve.k_alt}})
    return override(
        base,
        overlay
        | {
            "paths": {"state_dir": str(run)},
            "train": overlay.get("train", {})
            | {"seed": seed, "prompt_source": "jsonl", "prompts_file": str(prompts_file)},
            "engine": one_shared_server(url, in_process=["verifier"]),
        },
    )


@dataclass
class RunResult:
    arm: str
    seed: int
    seconds: float
    outcomes: dict[str, VersionOutcomes]  # suite -> the final version's test outcomes
    agreement: tuple[float, int]  # (share of checker-split pairs the reward orders alike, pairs)
    final: str
    guard: str


def train_rounds(settings: Settings, rounds: int) -> list[RoundSummary]:
    """Train `rounds` rounds from base with the loop's round code (each from the last accepted version, as the loop
    does); their summaries, in order."""
    from dynrubric.app.train_commands import engine_factory, prompt_source
    from dynrubric.registry import open_registry
    from dynrubric.train.rounds import RoundRunner

    runner = RoundRunner(settings, open_registry(settings), prompt_source(settings), engine_factory(settings))
    try:
        summaries = []
        for _ in range(rounds):
            summary = runner.run()
            summaries.append(summary)
            print(
                f"    round {summary.round}: {summary.version} ({summary.state}; guard: {summary.guard.detail})",
                flush=True,
            )
        return summaries
    finally:
        runner.close()


def train_run(settings: Settings, rounds: int) -> str:
    """Train `rounds` rounds from base; the last round's candidate (its version; base if no round registered one)."""
    version = "base"
    for summary in train_rounds(settings, rounds):
        version = summary.version or version
    return version


def reward_agreement(settings: Settings) -> tuple[float, int]:
    """The reward's agreement with the checker on the run's own policy sets: over the candidate pairs of checkable
    prompts that the checker separates (one passes, one fails), the share the reward orders the same way (a tie
    1/2). Sets from the run log's `set_scores`, their responses from the rollouts log (same order)."""
    from dynrubric.train.records import PolicyStep, read_summary
    from dynrubric.train.rounds import PLAN, SUMMARY, read_json, run_dir_of

    run_dir = run_dir_of(settings)
    rollouts = [json.loads(x) for x in split_lines((run_dir / "rollouts.jsonl").read_text()) if x.strip()]
    by_origin: dict[str, list[dict[str, Any]]] = {}
    for r in rollouts:
        by_origin.setdefault(r["origin"], []).append(r)
    agree = pairs = 0.0
    for round_dir in sorted((run_dir / "rounds").iterdir()):
        plan = read_json(round_dir / PLAN)
        questions = {p["key"]: p["messages"][-1][1] for p in plan["prompts"]}
        summary = read_summary(round_dir / SUMMARY)
        for step in summary.steps if isinstance(summary, RoundSummary) else []:
            if not isinstance(step, PolicyStep):
                continue
            sets = by_origin.get(f"round/{int(round_dir.name)}/step/{step.step}", [])
            for rec, scored in zip(sets, step.set_scores, strict=True):
                truth = derive(questions[rec["key"]])
                if truth.empty:
                    continue
                passed = [truth.passes(r) for r in rec["responses"]]
                for i in range(len(passed)):
                    for j in range(i + 1, len(passed)):
                        if passed[i] == passed[j]:
                            continue
                        hi, lo = (i, j) if passed[i] else (j, i)
                        diff = scored.scores[hi] - scored.scores[lo]
                        pairs += 1
                        agree += 1.0 if diff > settings.rubric.eps else 0.5 if abs(diff) <= settings.rubric.eps else 0.0
    return (agree / pairs if pairs else float("nan"), int(pairs))


def final_outcomes(settings: Settings, version: str) -> dict[str, VersionOutcomes]:
    """The test figures' outcomes of `version`, as the round's evaluation stored them."""
    from dynrubric.train.policy_eval import outcome_store

    store = outcome_store(settings)
    out: dict[str, VersionOutcomes] = {}
    for suite in settings.evaluation.figures:
        path = store.path(version, suite)
        if path.is_file():
            out[suite] = VersionOutcomes.model_validate_json(path.read_text())
    return out


def pending_runs(record: Path, seeds: range, arms: Sequence[str]) -> list[tuple[int, str]]:
    """The (seed, arm) runs to train, in order: those `record` (results.jsonl) does not hold yet. A run that an
    earlier invocation finished keeps its record, so a later session can add seeds."""
    recorded = split_lines(record.read_text()) if record.is_file() else []
    done = {(r["arm"], r["seed"]) for r in map(json.loads, recorded)}
    todo = []
    for seed in seeds:
        for arm in arms:
            if (arm, seed) in done:
                print(f"  {arm} seed {seed}: done before ({record})", flush=True)
            else:
                todo.append((seed, arm))
    return todo


# ==================================================================== base, once
def evaluate_base(settings: Settings) -> None:
    """Base's answers to the dev split and the figures, stored under this settings' run dir (copied into each run)."""
    from dynrubric.engines import build_engine
    from dynrubric.train.policy_eval import evaluate_suites, heldout_prompts, report_suites

    engine = build_engine(settings, "policy")
    try:
        base_dir = modelcache.resolve(settings.paths.resolved_home(), settings.models.policy)
        suites = {"dev": heldout_prompts(settings), **report_suites(settings)}
        evaluate_suites(settings, engine, [("base", base_dir)], suites)
    finally:
        engine.close()


@contextmanager
def server_with_base(base_settings: Settings, out: Path, prompts_file: Path) -> Iterator[tuple[str, Settings]]:
    """One vLLM server for every run, with base's answers evaluated once on it under `out/base` (base is the same
    model, decoded greedily, whatever an arm changes); yields (the server's URL, that base run's settings)."""
    from dynrubric.engines.vllm_server import VllmServer

    model = modelcache.resolve(base_settings.paths.resolved_home(), base_settings.models.verifier)
    started = time.monotonic()
    with VllmServer(model, base_settings.vllm) as server:
        print(f"vLLM server at {server.base_url} ({time.monotonic() - started:.0f}s)", flush=True)
        base_run = overlay_settings(base_settings, {}, 0, out / "base", prompts_file, server.base_url)
        t0 = time.monotonic()
        evaluate_base(base_run)
        print(f"base evaluated ({time.monotonic() - t0:.0f}s)", flush=True)
        yield server.base_url, base_run


def copy_base(src: Settings, dst: Settings) -> None:
    from dynrubric.train.policy_eval import outcome_store

    a, b = outcome_store(src), outcome_store(dst)
    suites: list[Suite] = ["dev", *src.evaluation.figures]
    for suite in suites:
        if a.path("base", suite).is_file():
            b.path("base", suite).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(a.path("base", suite), b.path("base", suite))


# ==================================================================== the table
def pooled(base: VersionOutcomes, runs: Sequence[VersionOutcomes], samples: int) -> tuple[float, float, float]:
    """(delta, low, high): per prompt the mean over seeds of the final version's grade, paired with base's."""
    keys = sorted(base.scores)
    mean = [sum(r.scores[k] for r in runs) / len(runs) for k in keys]
    return paired_bootstrap(mean, [base.scores[k] for k in keys], samples, 0.95)


def fmt(d: tuple[float, float, float]) -> str:
    return f"{d[0]:+.3f} (95% CI {d[1]:+.3f}..{d[2]:+.3f})"


def table(results: Sequence[RunResult], base: dict[str, VersionOutcomes], arms: Sequence[str]) -> list[str]:
    lines = []
    head = f"{'arm':18} {'seeds':>5} " + " ".join(f"{SHOWN[s]:>30}" for s in SHOWN) + f" {'agreement':>16} {'s/run':>6}"
    lines.append(head)
    last = []
    for arm in arms:
        mine = [r for r in results if r.arm == arm]
        if not mine:
            continue
        cells, parts = [], []
        for suite, name in SHOWN.items():
            runs = [r.outcomes[suite] for r in mine if suite in r.outcomes]
            if suite not in base or len(runs) != len(mine):
                cells.append(f"{'-':>30}")
                continue
            d = pooled(base[suite], runs, 2000)
            cells.append(f"{fmt(d):>30}")
            parts.append(f"{name} {fmt(d)}")
        pairs = sum(r.agreement[1] for r in mine)
        share = sum(r.agreement[0] * r.agreement[1] for r in mine if r.agreement[1]) / pairs if pairs else float("nan")
        seconds = sum(r.seconds for r in mine) / len(mine)
        lines.append(f"{arm:18} {len(mine):>5} " + " ".join(cells) + f" {share:>7.3f} of {pairs:>5} {seconds:>6.0f}")
        last.append(f"arm {arm}: " + "; ".join(parts))
    return lines + last


# ==================================================================== main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, choices=list(ARMS))
    ap.add_argument("--seed-start", type=int, default=0, help="the first seed (seeds seed-start .. seed-start+seeds-1)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/dynrubric-supervision"))
    ap.add_argument("--quick", action="store_true", help="a tiny round and figures: does it run end to end")
    ap.add_argument("--report", action="store_true", help="train nothing: the table of the runs under --out so far")
    ap.add_argument("--verifier", type=Path, help=f"the trained verifier's model dir, for the arm {TRAINED_VERIFIER}")
    args = ap.parse_args()
    stop_signals_interrupt()  # a SIGTERM unwinds the `with`s: the vLLM server it started stops too
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYNRUBRIC_")}
    shape = deep_merge(ROUND, QUICK) if args.quick else ROUND
    base_settings = override(load_settings(None, env, profile="demo"), shape)
    per_round = base_settings.train.prompts_per_step * base_settings.train.coevolve.k_alt
    prompts_file = out / "prompts.jsonl"
    prompts = training_prompts(per_round * args.rounds)
    prompts_file.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    print(
        f"{len(prompts)} training prompts ({prompts_file}); per run {args.rounds} round(s) of "
        f"{base_settings.train.coevolve.k_alt} policy steps x {base_settings.train.prompts_per_step} sets x "
        f"{base_settings.train.candidates} candidates and {base_settings.train.coevolve.k_alt_generator} generator "
        f"step(s); figures of {base_settings.evaluation.report_prompts} prompts",
        flush=True,
    )

    if args.report:
        report(out, base_settings, prompts_file, args.arms)
        return
    started = time.monotonic()
    with server_with_base(base_settings, out, prompts_file) as (url, base_run):
        record = out / "results.jsonl"
        for seed, arm in pending_runs(record, range(args.seed_start, args.seed_start + args.seeds), args.arms):
            run = out / f"{arm.replace(':', '-')}-s{seed}"
            shutil.rmtree(run, ignore_errors=True)
            settings = run_settings(base_settings, arm, seed, run, prompts_file, url, args.verifier)
            copy_base(base_run, settings)
            print(f"  {arm} seed {seed}: training in {run}", flush=True)
            t0 = time.monotonic()
            final = train_run(settings, args.rounds)
            seconds = time.monotonic() - t0
            from dynrubric.registry import open_registry

            state = open_registry(settings).get(final).state.value
            result = RunResult(
                arm, seed, seconds, final_outcomes(settings, final), reward_agreement(settings), final, state
            )
            print(
                f"  {arm} seed {seed}: {final} ({state}) in {seconds:.0f}s; reward agreement with the checker "
                f"{result.agreement[0]:.3f} on {result.agreement[1]} pairs; "
                + ", ".join(f"{SHOWN[s]} {o.pass_rate():.3f}" for s, o in result.outcomes.items()),
                flush=True,
            )
            record.open("a").write(
                json.dumps(
                    {
                        "arm": arm,
                        "seed": seed,
                        "run": run.name,
                        "seconds": seconds,
                        "final": final,
                        "state": state,
                        "agreement": result.agreement,
                        "verifier": settings.models.verifier,
                        "scores": {s: o.pass_rate() for s, o in result.outcomes.items()},
                    }
                )
                + "\n"
            )
    print(f"total {(time.monotonic() - started) / 60:.1f} min")
    report(out, base_settings, prompts_file, args.arms)


def report(out: Path, base_settings: Settings, prompts_file: Path, arms: Sequence[str]) -> None:
    """The table of every run recorded in `out/results.jsonl` (the runs' outcomes read from their directories)."""
    results = []
    for line in split_lines((out / "results.jsonl").read_text()):
        r = json.loads(line)
        settings = overlay_settings(base_settings, {}, r["seed"], out / r["run"], prompts_file, "http://unused")
        outcomes = final_outcomes(settings, r["final"])
        agreement = (float(r["agreement"][0]), int(r["agreement"][1]))
        results.append(RunResult(r["arm"], r["seed"], r["seconds"], outcomes, agreement, r["final"], r["state"]))
    base = final_outcomes(run_settings(base_settings, "full", 0, out / "base", prompts_file, "http://unused"), "base")
    print("\nbase: " + ", ".join(f"{SHOWN[s]} {o.pass_rate():.3f} on {len(o.scores)}" for s, o in base.items()))
    for line in table(results, base, arms):
        print(line)


if __name__ == "__main__":
    assert set(SHOWN) <= set(FIGURES)
    main()
