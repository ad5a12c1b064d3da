"""Training rounds end to end on the tiny model: learning over 3 rounds, lineage, kill -9 and resume, guards.

The task (tests/train_harness.py): responses containing the letter 'u' are rubric-preferred; the
verifier is a rule behind the Engine interface, the policy and the rubric generator are the real tiny
model through the real TransformersEngine.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from itertools import pairwise
from pathlib import Path

import pytest
import yaml

from dynrubric.jsonl import split_lines
from dynrubric.train.records import read_summary
from tests.train_harness import KeywordVerifier, keyword_rate, runner, write_prompts

ROOT = Path(__file__).parents[2]
MARGIN = 0.125
SAMPLES = 64 * 16  # responses sampled from each model to measure the keyword rate


@pytest.mark.slow
def test_three_rounds_move_the_policy_toward_the_rubric_preferred_behaviour(tmp_path: Path, tiny_model_dir: Path):
    """With the guards at their defaults: each round builds on the last accepted version, and that
    version ends up preferring the keyword.

    False-pass probability: if training did not change the policy, the base and the head rates are
    means of 1024 independent Bernoulli draws each with the same expectation, and by Hoeffding
    P(rate_head - rate_base >= 0.125) <= exp(-1024 * 0.125^2) = exp(-16) < 1.2e-7."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", 48)
    r = runner(tmp_path / "state", tiny_model_dir, prompts)
    summaries = [r.run() for _ in range(3)]

    versions = {c.version: c for c in r.registry.list()}
    assert list(versions) == ["base", "r1", "r2", "r3"]
    assert [versions[v].round for v in ("r1", "r2", "r3")] == [1, 2, 3]
    accepted = "base"
    for s in summaries:  # a rejected round is never built on
        assert s.parent == accepted, (s.round, s.parent, accepted)
        assert s.state == ("candidate" if s.guard.accepted else "rejected")
        accepted = s.version if s.guard.accepted else accepted
        assert (r.round_dir(s.round) / "summary.json").is_file()
        assert set(versions[s.version].metrics) >= {
            "reward_mean",
            "kl",
            "kl_to_base",
            "mean_gap",
            "tie_rate",
            "heldout_reward",
            "guard",
        }
    assert r.head().version == accepted != "base"
    # each round took its own prompts: the watermark moved 16 prompts per round
    assert [s.watermark_after for s in summaries] == ["16", "32", "48"]
    # a collapse in round N makes round N+1 start with a generator phase, and the summary says so
    for before, after in pairwise(summaries):
        assert bool(after.refresh) == before.collapse.fired
        if before.collapse.fired:
            assert after.steps[0].phase == "generator" and "collapse" in after.refresh
    # the run log holds every step and round exactly once
    keys = [rec.key for rec in r.runlog.records()]
    assert len(keys) == len(set(keys)) == 3 * r.cfg.steps_per_round + 3
    # the guard ran at its defaults, judged by the frozen rule verifier and the PARENT's rubric writer,
    # on held-out prompts no round trained on; the drift from the base is tracked
    assert (r.cfg.max_kl, r.cfg.max_reward_drop) == (0.05, 0.05)
    for s in summaries:
        assert s.eval.judge == {"generator": s.parent, "verifier": "keyword-rule"}
        assert not set(s.eval.heldout_keys) & {
            p["key"] for p in json.loads((r.round_dir(s.round) / "plan.json").read_text())["prompts"]
        }
        assert s.eval.base == "base" and s.eval.kl_to_base > 0

    questions = [f"Tell me something about thing number {i}." for i in range(64)]
    base_rate = keyword_rate(versions["base"].path, questions, 16, seed=123)
    final_rate = keyword_rate(versions[accepted].path, questions, 16, seed=123)
    assert final_rate - base_rate >= MARGIN, (base_rate, final_rate, [(s.guard, s.eval) for s in summaries])


def _wait_for_steps(runlog: Path, n: int, proc: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if runlog.exists() and _steps_logged(runlog) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited early (rc {proc.returncode})")
        time.sleep(0.2)
    raise AssertionError(f"no {n} steps within {timeout} s")


def _wait_for_line(lines: queue.Queue, text: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    """Until the trainer prints `text` on a line of its own (tests.train_harness.PrintedPhases)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if lines.get(timeout=1.0).strip() == text:
                return
        except queue.Empty:
            if proc.poll() is not None:
                raise AssertionError(f"trainer exited (rc {proc.returncode}) before {text!r}") from None
    raise AssertionError(f"no {text!r} within {timeout} s")


def _steps_logged(runlog: Path) -> int:
    return sum('"kind": "step"' in x for x in split_lines(runlog.read_text()))


@pytest.mark.slow
def test_kill_9_during_a_round_then_resume_applies_exactly_one_update_per_step(tmp_path: Path, tiny_model_dir: Path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 32)
    state = tmp_path / "state"
    runlog = state / "train" / "runlog.jsonl"
    cmd = [sys.executable, "-m", "tests.train_harness", str(state), str(tiny_model_dir), str(prompts), "1"]

    stderr = (tmp_path / "trainer.err").open("wb")  # a file: an unread pipe could fill up and stall the trainer

    def start() -> tuple[subprocess.Popen, queue.Queue]:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x.decode()) for x in proc.stdout], daemon=True).start()
        return proc, lines

    def kill(proc: subprocess.Popen, where: str) -> None:
        assert proc.poll() is None, f"the trainer finished before the kill {where}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    planned = runner(state, tiny_model_dir, prompts)
    n_steps, eval_file = planned.cfg.steps_per_round, planned.round_dir(1) / "eval.json"
    # kill inside step 2 (right after step 1 was published): step 2 never published
    proc, _ = start()
    _wait_for_steps(runlog, 1, proc)
    kill(proc, "inside step 2")
    assert _steps_logged(runlog) == 1
    # kill inside evaluation: every step published, the evaluation begun and its result not written
    proc, lines = start()
    _wait_for_line(lines, "start evaluate", proc)
    kill(proc, "inside evaluation")
    assert _steps_logged(runlog) == n_steps and not eval_file.exists()
    proc, _ = start()
    proc.wait(timeout=900)
    stderr.close()
    assert proc.returncode == 0, (tmp_path / "trainer.err").read_text()[-3000:]
    assert eval_file.is_file()

    r = runner(state, tiny_model_dir, prompts)
    summary = read_summary(r.round_dir(1) / "summary.json")
    steps = summary.steps
    assert [h.step for h in steps] == list(range(n_steps))
    # the evaluation restarted after the kill judged the trained weights (the ones registered), not the parent's
    assert summary.eval.kl_to_parent > 0
    # AdamW's own step counter after each policy step: exactly one more update per updating step
    policy = [h for h in steps if h.phase == "policy"]
    expected, count = [], 0
    for h in policy:
        count += 1 if h.updated else 0
        expected.append(count)
    assert [h.updates for h in policy] == expected and count >= 1
    keys = [rec.key for rec in r.runlog.records()]
    assert sorted(keys) == sorted({*keys}) and len([k for k in keys if "/step/" in k]) == n_steps
    assert [c.version for c in r.registry.list()] == ["base", "r1"]
    assert not (r.round_dir(1) / "steps").exists()  # step state is removed once the checkpoint is registered

    # a finished round is never run again
    assert r.run(1).version == "r1" and len(r.registry.list()) == 2

    # guard: a KL bound no update can meet rejects round 2, records why, and keeps r1 as the head
    strict = runner(state, tiny_model_dir, prompts, max_kl=1e-12, steps_per_round=1)
    s2 = strict.run()
    assert s2.state == "rejected" and s2.guard.reason == "kl"
    rejected = strict.registry.get("r2")
    assert rejected.state.value == "rejected" and rejected.reason.startswith("kl: ")
    assert strict.head().version == "r1"


class UndecidedVerifier(KeywordVerifier):
    """Answers P(yes) = 1/2 for every criterion: every set is collapsed (no item splits it)."""

    @staticmethod
    def judge(prompt: str) -> float | None:
        return None


@pytest.mark.slow
def test_collapse_window_spans_rounds_so_small_rounds_fire_it(tmp_path: Path, tiny_model_dir: Path):
    """Rounds of 4 sets and a window of 8: neither round fills the window alone. Carried across rounds
    (the run dir keeps it), the window is full in round 2, which fires, and round 3 starts with a
    generator phase (the evaluator refresh)."""
    from tests.train_harness import engines as harness_engines

    def engines(role: str, model_dir: Path):
        return UndecidedVerifier(model_dir) if role == "verifier" else harness_engines(role, model_dir)

    prompts = write_prompts(tmp_path / "prompts.jsonl", 24)
    r = runner(
        tmp_path / "state",
        tiny_model_dir,
        prompts,
        steps_per_round=1,
        prompts_per_step=4,
        candidates=4,
        max_prompts_per_round=8,
        heldout_prompts=1,
    )
    r.engines = engines
    assert r.settings.rubric.collapse_window == 8
    first, second = r.run(), r.run()
    assert [first.collapse.fired, second.collapse.fired] == [False, True]
    assert second.steps[0].nonsplit_share == 1.0
    third = r.run()  # the evaluator refresh: a generator phase first
    assert third.refresh and third.steps[0].phase == "generator" and third.phases["generator"] == 1


def test_a_generator_step_never_changes_the_served_policy(tmp_path: Path, tiny_model_dir: Path):
    """Issue 24, point 3: by default the rubric generator is its own model with its own optimiser, so a generator
    GRPO step leaves the policy (what users are served) exactly as it was. With one shared model
    (`train.coevolve.single_model: true`, the old default) the same step changes the served weights."""
    import torch

    from dynrubric.config_loader import override
    from dynrubric.train.executor import Trainers, TrainerSpec
    from dynrubric.train.grpo import CandidateSet, SampledResponse
    from tests.train_harness import settings as harness_settings

    prompts = write_prompts(tmp_path / "prompts.jsonl", 4)
    base = harness_settings(tmp_path / "state", tiny_model_dir, prompts)
    prompt = (1, 5, 9, 13)
    groups = [
        CandidateSet(
            (SampledResponse(prompt, (20, 21, 22)), SampledResponse(prompt, (30, 31)), SampledResponse(prompt, (40,))),
            (1.0, 0.5, 0.0),
        )
    ]
    changed = {}
    for single in (None, True):  # None: the default
        settings = base if single is None else override(base, {"train": {"coevolve": {"single_model": single}}})
        trainers = Trainers(TrainerSpec(settings, tiny_model_dir, tiny_model_dir, tiny_model_dir, None))
        before = {k: v.clone() for k, v in trainers.policy.model.state_dict().items()}
        stats = trainers.step("generator", groups)
        assert stats["updated"] and stats["updates"] == 1
        changed[single] = any(not torch.equal(before[k], v) for k, v in trainers.policy.model.state_dict().items())
        assert trainers.policy.updates == (1 if single else 0)  # the policy's own AdamW state is untouched
    assert changed == {None: False, True: True}


def test_a_step_links_the_trainer_it_did_not_update_and_resumes_from_the_links(tmp_path: Path, tiny_model_dir: Path):
    """Publishing a step writes only the trainer the step updated (issue 38, a round's checkpoints): the other's
    weights and AdamW state are hard links to the last published step's files, and a round resumed from the linked
    step has both trainers exactly as they were."""
    import torch

    from dynrubric.train.executor import Trainers, TrainerSpec
    from dynrubric.train.grpo import CandidateSet, SampledResponse
    from tests.train_harness import settings as harness_settings

    settings = harness_settings(tmp_path / "state", tiny_model_dir, write_prompts(tmp_path / "prompts.jsonl", 4))
    prompt = (1, 5, 9, 13)
    groups = [
        CandidateSet(
            (SampledResponse(prompt, (20, 21, 22)), SampledResponse(prompt, (30, 31)), SampledResponse(prompt, (40,))),
            (1.0, 0.5, 0.0),
        )
    ]
    trainers = Trainers(TrainerSpec(settings, tiny_model_dir, tiny_model_dir, tiny_model_dir, None))
    steps = tmp_path / "steps"
    trainers.step("generator", groups)
    trainers.save(steps / "0000")  # nothing published before: both written
    trainers.step("policy", groups)
    trainers.save(steps / "0001", steps / "0000")

    def inodes(step: str, part: str) -> dict[str, int]:
        root = steps / step / part
        return {str(f.relative_to(root)): f.stat().st_ino for f in sorted(root.rglob("*")) if f.is_file()}

    assert inodes("0001", "generator") == inodes("0000", "generator")  # linked: the policy step left it
    policy_before, policy_after = inodes("0000", "policy"), inodes("0001", "policy")
    assert policy_after.keys() == policy_before.keys()
    assert not set(policy_after.values()) & set(policy_before.values())  # written: the step updated it
    trainers.step("generator", groups)
    trainers.save(steps / "0002", steps / "0001")
    assert inodes("0002", "policy") == inodes("0001", "policy")
    assert not set(inodes("0002", "generator").values()) & set(inodes("0001", "generator").values())

    resumed = Trainers(TrainerSpec(settings, tiny_model_dir, tiny_model_dir, tiny_model_dir, steps / "0002"))
    for mine, theirs in ((trainers.policy, resumed.policy), (trainers.generator, resumed.generator)):
        assert theirs.updates == mine.updates
        expected = mine.model.state_dict()
        assert all(torch.equal(expected[k], v) for k, v in theirs.model.state_dict().items())
    assert (resumed.policy.updates, resumed.generator.updates) == (1, 2)


@pytest.mark.slow
def test_the_demo_profile_moves_the_policy_within_one_round(tmp_path: Path, tiny_model_dir: Path):
    """Issue 24, point 2: `dynrubric up`'s training settings (the demo profile) make several updates per round with one
    AdamW state across the round's steps and move the policy: KL(candidate || parent) on held-out samples well above
    zero. With the old demo (lr 1e-6, one policy step of 4 prompts a round) one round moved each weight by about
    1e-6 and the KL was ~1e-9."""
    from dynrubric.config_loader import PROFILES_DIR

    prompts = write_prompts(tmp_path / "prompts.jsonl", 48)
    demo = yaml.safe_load((PROFILES_DIR / "demo.yaml").read_text())["train"]
    r = runner(
        tmp_path / "state",
        tiny_model_dir,
        prompts,
        grpo=demo["grpo"],
        coevolve=demo["coevolve"],
        steps_per_round=demo["steps_per_round"],
        prompts_per_step=demo["prompts_per_step"],
        max_prompts_per_round=32,
        max_kl=demo["max_kl"],
        max_kl_to_base=demo["max_kl_to_base"],
    )
    summary = r.run()
    policy = [h for h in summary.steps if h.phase == "policy"]
    assert len(policy) == demo["coevolve"]["k_alt"] >= 4
    applied = sum(h.updated for h in policy)
    # AdamW's step counter runs on across the round's policy steps: one optimiser state, not a fresh one per step
    assert [h.updates for h in policy][-1] == applied * demo["grpo"]["updates_per_batch"] >= 3
    assert summary.eval.kl_to_parent > 1e-3, summary.eval


@pytest.mark.slow
def test_a_round_without_a_policy_update_registers_nothing(tmp_path: Path, tiny_model_dir: Path):
    """Issue 24/26: no rollout that cannot change anything. With a tie threshold no score spread reaches, every
    set is tied, no policy step applies an update, and the round registers no candidate: the summary says why
    and the next round builds on the same parent."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", 48)
    # a spread of at least 0.99 between scores in [0, 1]: every set is a tie
    r = runner(
        tmp_path / "state", tiny_model_dir, prompts, rubric={"eps": 0.99}, steps_per_round=2, coevolve={"k_alt": 2}
    )
    summary = r.run()
    assert [h.updated for h in summary.steps] == [False, False], summary.steps
    assert summary.version is None and summary.state == "unregistered", summary
    assert summary.guard.reason == "no_update" and "no policy update in 2 policy step(s)" in summary.guard.detail
    assert [c.version for c in r.registry.list()] == ["base"]
    assert r.head().version == "base"


def test_a_rounds_seconds_are_what_its_stages_took_whatever_the_wall_clock_does(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    """A round's `seconds` and its `stage_seconds` read one clock: the wall clock stepping mid-round (NTP; round_time
    once read a round 41 s longer than its stages, docs/benchmarks.md) is not round time."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", 48)
    r = runner(
        tmp_path / "state", tiny_model_dir, prompts, rubric={"eps": 0.99}, steps_per_round=1, coevolve={"k_alt": 1}
    )
    wall, readings = time.time, itertools.count()
    monkeypatch.setattr(time, "time", lambda: wall() + 3600.0 * next(readings))  # an hour later at every reading
    summary = r.run()
    stages = sum(summary.stage_seconds.values())
    assert stages > 0 and stages <= summary.seconds < stages + 60, (summary.seconds, summary.stage_seconds)


def test_every_seed_of_a_run_is_its_own():
    """The named seed derivation: over 40 rounds x 200 steps, every draw's seed block (the seed and the rubric
    generator's retries, +0..+9) is disjoint from every other's; integer offsets (`root + 101 step + i`, judging
    chunk j at i = 1000 + j) gave chunk j of step s the seed of index j - 10 of step s + 10."""
    from dynrubric.seeds import SEED_BLOCK, round_seed

    draws = [("candidates", 0), ("anchors", 0), ("rubrics", 0), *(("judging", j) for j in range(8))]
    seeds = [round_seed(7, r, purpose, step, i) for r in range(40) for step in range(200) for purpose, i in draws]
    seeds += [round_seed(7, r, "heldout", 0) for r in range(40)]
    assert all(0 <= s < 2**62 - SEED_BLOCK for s in seeds)
    blocks = sorted(seeds)
    assert min(b - a for a, b in zip(blocks, blocks[1:], strict=False)) >= 10  # no two blocks of 10 overlap
    assert round_seed(7, 1, "judging", 3, 2) == round_seed(7, 1, "judging", 3, 2)  # a pure function of the name
    assert len({round_seed(root, 1, "judging", 3, 2) for root in range(100)}) == 100  # train.seed reseeds all


@pytest.mark.slow
def test_two_rounds_carry_adamw_hold_to_the_parent_and_fill_their_batches_with_sets_that_spread(
    tmp_path: Path, tiny_model_dir: Path
):
    """Issue 38's options together, as rounds run them: dynamic sampling records what each step drew and kept, an
    accepted round keeps its AdamW state, and the next round goes on from it (the step counter continues) and takes
    its parent as the KL reference; the fresh-prompt rule holds for both plans."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", 40)
    r = runner(
        tmp_path / "state",
        tiny_model_dir,
        prompts,
        candidates=4,
        prompts_per_step=4,
        steps_per_round=2,
        max_prompts_per_round=20,
        heldout_prompts=2,
        min_new_prompts_per_set=0.5,
        max_kl=10.0,
        max_kl_to_base=10.0,
        max_reward_drop=1.0,
        dynamic_sampling={"oversample": 2.0},
        grpo={"optimizer_across_rounds": "carry", "kl_reference": "parent", "warmup_updates": 2},
    )
    first = r.run()
    assert first.guard.accepted, first.guard
    steps = [s for s in first.steps if s.phase == "policy"]
    assert all(s.sets_drawn >= 4 and s.sets_kept <= 4 and s.draws >= 1 for s in steps)
    # the batch is the sets kept: no tied set reaches the trainer
    assert all(s.sets == s.sets_kept and s.kept_share == s.sets_kept / s.sets_drawn for s in steps)
    assert (r.round_dir(1) / "policy_optimizer.pt").is_file() and not (r.round_dir(1) / "steps").exists()
    second = r.run()
    plan = json.loads((r.round_dir(2) / "plan.json").read_text())
    assert plan["parent"] == "r1" and plan["kl_reference"] == "r1"
    assert plan["optimizer_from"] == str(r.round_dir(1) / "policy_optimizer.pt")
    assert plan["new_prompts"] >= plan["new_prompts_needed"] == 4
    before = steps[-1].updates
    after = [s.updates for s in second.steps if s.phase == "policy"]
    assert after[0] == before + (1 if second.steps[0].updated else 0) and before >= 1
    assert second.prompts_needed == 4


def test_a_round_of_generator_steps_alone_trains_the_judge_and_registers_no_policy(
    tmp_path: Path, tiny_model_dir: Path
):
    """`train.coevolve.k_alt: 0` (issue 36, benchmarks/coevolution.py): a round of generator steps only. The policy
    stands still, so the round registers nothing and the next one builds on the same parent; the generator's weights
    as the round left them become the run's (what the next round's judge writes rubrics with)."""
    from dynrubric.registry import weights_sha256

    prompts = write_prompts(tmp_path / "prompts.jsonl", 16)
    r = runner(
        tmp_path / "state", tiny_model_dir, prompts, steps_per_round=2, coevolve={"k_alt": 0, "k_alt_generator": 2}
    )
    summary = r.run()
    assert [h.phase for h in summary.steps] == ["generator", "generator"], summary.steps
    assert summary.phases == {"policy": 0, "generator": 2}
    assert summary.version is None and summary.state == "unregistered", summary
    assert "no policy update in 0 policy step(s)" in summary.guard.detail
    assert [c.version for c in r.registry.list()] == ["base"] and r.head().version == "base"
    assert r.generator_dir() == r.run_dir / "generator" / "model", "kept for the next round's judge"
    assert r.next_round() == 2
    # the served policy is the base, byte for byte
    assert r.head().weights_sha256 == weights_sha256(tiny_model_dir)
