from __future__ import annotations

import json

import matplotlib.pyplot as plt
import pytest

from dynrubric.app.report import UNIT, Thresholds, draw, read_runlog, render
from dynrubric.errors import DynrubricError
from tests.run_records import generator_step, policy_step, round_summary, write_runlog

THRESHOLDS = Thresholds(
    collapse_min_mean_gap=0.03,
    collapse_max_nonsplit_share=0.8,
    collapse_window=20,
    max_kl=0.05,
    tis_low=0.5,
    tis_high=5.0,
)


def write_log(path, steps: int, sets_per_step: int = 4, generator_steps: int = 1, **policy_fields):
    """A one-round run log of `steps` policy steps and `generator_steps` generator steps; `policy_fields`: a
    list of values per policy step for the named fields."""
    policy = [
        policy_step(
            step,
            reward_mean=0.4 + 0.05 * step,
            kl=0.0001 * step,
            mean_gap=0.2 - 0.04 * step,
            tie_rate=0.1,
            nonsplit_share=1.0,
            untrusted_sets=step % 2,
            rubric_sources={"set": sets_per_step - 1, "prompt_only": 0, "generic": 1},
            fallbacks={"generic": 1, "prompt_only": 0, "parse_failures": 3, "hard_verdict": 0},
            **{k: v[step] for k, v in policy_fields.items()},
        )
        for step in range(steps)
    ]
    generator = [
        generator_step(steps + step, reward_mean=1.3, gen_judge_user_agreement=0.75) for step in range(generator_steps)
    ]
    summary = round_summary(1, [*policy, *generator], stage_seconds={})
    write_runlog(path, [summary])
    return read_runlog(path)


def panels(fig):
    return {ax.get_title(): ax for ax in fig.axes}


def test_report_plots_a_run_log(tmp_path):
    log = write_log(tmp_path / "runlog.jsonl", steps=4)
    assert (len(log.steps), len(log.generator_steps), len(log.rounds)) == (4, 1, 1)
    out = render(log, tmp_path / "report" / "run.png", THRESHOLDS)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rates_on_fixed_axes_thresholds_labelled_and_no_empty_legend_entries(tmp_path):
    fig = draw(write_log(tmp_path / "runlog.jsonl", steps=4), THRESHOLDS)
    p = panels(fig)
    # a KL of 3e-4 must not fill the panel: the axis runs from 0 to the guard's limit
    assert p["KL per policy step (per token), axis from 0 to the guard"].get_ylim()[0] <= 0
    assert p["KL per policy step (per token), axis from 0 to the guard"].get_ylim()[1] >= THRESHOLDS.max_kl
    for title in (
        "policy: mean set reward per step",
        "score gaps within candidate sets",
        "learning curve: held-out ground-truth pass rate per round",
    ):
        assert p[title].get_ylim() == UNIT, title
    gaps = p["score gaps within candidate sets"]
    threshold = [line for line in gaps.get_lines() if line.get_linestyle() == "--"]
    assert len(threshold) == 1 and threshold[0].get_label() == "collapse: mean gap < 0.03"
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is not None:
            assert all(t.get_text() and not t.get_text().startswith("_") for t in legend.get_texts())
    # sets (rubric sources) and failed tries (a count of attempts) are never stacked on one axis
    sources = p["where each scored set's rubric came from; untrusted sets"]
    assert sources.get_ylabel() == "sets"
    [untrusted] = [line for line in sources.get_lines() if line.get_label().startswith("untrusted")]
    assert list(untrusted.get_ydata()) == [0, 1, 0, 1]  # the run log's untrusted_sets per policy step
    assert p["failed rubric-generator tries per step"].get_ylabel() == "tries"
    plt.close(fig)


def test_collapse_detector_annotation_only_when_it_saw_too_few_sets(tmp_path):
    def notes(fig):
        return [t.get_text() for ax in fig.axes for t in ax.texts if "collapse detector" in t.get_text()]

    few = draw(write_log(tmp_path / "few.jsonl", steps=2, sets_per_step=4), THRESHOLDS)  # 8 sets < 20
    assert any("8 sets scored in this run" in n and "could not fire" in n for n in notes(few))
    enough = draw(write_log(tmp_path / "enough.jsonl", steps=5, sets_per_step=4), THRESHOLDS)  # 20 sets
    assert notes(enough) == []
    plt.close("all")


def test_one_or_two_points_are_markers_not_a_line(tmp_path):
    fig = draw(write_log(tmp_path / "runlog.jsonl", steps=2, generator_steps=0), THRESHOLDS)
    reward = panels(fig)["policy: mean set reward per step"].get_lines()[0]
    assert reward.get_linestyle() == "None" and reward.get_marker() == "o"
    generator = panels(fig)["co-evolution: generator reward and the judge's agreement with users"]
    assert not generator.get_lines() and "no generator steps" in generator.texts[0].get_text()
    plt.close(fig)


def test_where_each_rounds_time_went_is_the_run_logs_stage_seconds(tmp_path):
    """One stacked bar per round: each stage's segment spans exactly the seconds the run log recorded,
    in the order the time is spent; the round's wall-clock time is marked; a round without stage times
    has no bar."""
    from dynrubric.app.report import STAGES

    stages = [
        {
            "setup": 3.0,
            "candidates": 10.0,
            "rubrics": 6.0,
            "verdicts": 4.0,
            "policy_update": 2.5,
            "generator_rubrics": 0.0,
            "generator_update": 0.0,
            "checkpoints": 1.5,
            "evaluate": 5.0,
            "guard": 0.5,
        },
        {
            "setup": 1.0,
            "candidates": 8.0,
            "rubrics": 5.0,
            "verdicts": 3.0,
            "policy_update": 0.0,
            "generator_rubrics": 7.0,
            "generator_update": 2.0,
            "checkpoints": 1.0,
            "evaluate": 4.0,
            "guard": 0.25,
        },
    ]
    path = tmp_path / "runlog.jsonl"
    summaries = [
        round_summary(i, [], seconds=sum(st.values()) + 0.5, stage_seconds=st) for i, st in enumerate(stages, 1)
    ]
    write_runlog(path, [*summaries, round_summary(3, [], stage_seconds={})])
    fig = draw(read_runlog(path), THRESHOLDS)
    ax = panels(fig)["where each round's time went (seconds per stage)"]
    assert ax.get_ylabel() == "seconds"
    bars = {c.get_label(): c for c in ax.containers}
    assert list(bars) == [label for label, _ in STAGES.values()]  # in the order the time is spent
    bottom = [0.0, 0.0]
    for key, (label, _) in STAGES.items():
        rects = bars[label].patches
        assert [r.get_x() + r.get_width() / 2 for r in rects] == pytest.approx([1, 2])  # round 3: no bar
        assert [r.get_y() for r in rects] == pytest.approx(bottom), key
        assert [r.get_height() for r in rects] == pytest.approx([stages[0][key], stages[1][key]]), key
        bottom = [b + r.get_height() for b, r in zip(bottom, rects, strict=True)]
    [wall] = [c for c in ax.collections if c.get_label() == "round wall-clock time"]
    assert [tuple(xy) for xy in wall.get_offsets().tolist()] == [
        (1, sum(stages[0].values()) + 0.5),
        (2, sum(stages[1].values()) + 0.5),
    ]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2"]
    plt.close(fig)

    # a run log without stage times says so instead of drawing an empty axis
    empty = panels(draw(write_log(tmp_path / "other.jsonl", steps=2), THRESHOLDS))
    assert (
        "no round recorded its stage times"
        in empty["where each round's time went (seconds per stage)"].texts[0].get_text()
    )
    plt.close("all")


def test_missing_or_corrupt_run_log_is_a_clear_error(tmp_path):
    with pytest.raises(DynrubricError, match="no run log"):
        read_runlog(tmp_path / "runlog.jsonl")
    write_runlog(tmp_path / "runlog.jsonl", [round_summary(1, [])])
    with open(tmp_path / "runlog.jsonl", "a") as f:
        f.write("not json\n")
    with pytest.raises(DynrubricError, match="line 2"):
        read_runlog(tmp_path / "runlog.jsonl")


def judged_store(registry_db):
    """A rollout store (in the registry database `registry_db`) as the controller leaves it: one canary the
    judged check failed, one it passed (the gate results are the real gate's, from the judge's tallies)."""
    from dynrubric.config import GateConfig
    from dynrubric.registry import Registry
    from serving.gate import JudgeStats, evaluate
    from serving.rollout import RolloutStore
    from tests.unit.test_gate import arm

    store = RolloutStore(Registry(registry_db))
    for version, judge, status in (
        ("r1", JudgeStats(pairs=60, canary_score=6.0), "rolled_back"),
        ("r2", JudgeStats(pairs=40, canary_score=22.0), "promoted"),
    ):
        gate = evaluate(arm(), arm(), 0.5, GateConfig(), require_non_inferiority=False, judge=judge)
        r = store.create(version, f"/ckpt/{version}", "base", "/ckpt/base", [0.5])
        reason = f"gate failed at step 0: {gate.reason}" if gate.verdict.value == "fail" else None
        store.update(r.id, status=status, reason=reason, last_gate=gate.model_dump(mode="json"))
    return store


def test_the_judged_online_check_is_in_the_report(tmp_path):
    from dynrubric.app.report import judged_rollouts

    store = judged_store(tmp_path / "registry.sqlite")
    failed, passed = judged_rollouts(r.to_json() for r in store.list())
    assert (failed.version, failed.status, failed.verdict, failed.pairs) == ("r1", "rolled_back", "fail", 60)
    assert failed.win_rate == pytest.approx(0.1) and failed.upper < failed.bar == pytest.approx(0.45)
    assert (passed.version, passed.verdict, passed.pairs, passed.win_rate) == ("r2", "pass", 40, 0.55)
    assert passed.lower < passed.win_rate < passed.upper

    fig = draw(write_log(tmp_path / "runlog.jsonl", steps=2), THRESHOLDS, [failed, passed])
    p = panels(fig)
    plot = p["rollouts: rubric-judged canary win rate (shadow pairs)"]
    assert plot.get_ylim() == UNIT and [t.get_text() for t in plot.get_xticklabels()] == ["r1", "r2"]
    [bar] = [line for line in plot.get_lines() if line.get_linestyle() == "--"]
    assert bar.get_label() == "fail: upper bound < 0.45" and bar.get_ydata()[0] == pytest.approx(0.45)
    bars = {c.get_label(): c for c in plot.containers}  # errorbar containers: lines = (points, caps, intervals)
    assert bars["judged check: fail"].lines[0].get_ydata() == pytest.approx([0.1])
    assert bars["judged check: pass"].lines[0].get_ydata() == pytest.approx([0.55])
    [[(_, low), (_, high)]] = bars["judged check: fail"].lines[2][0].get_segments()
    assert (low, high) == pytest.approx((max(failed.lower, 0.0), failed.upper))  # clipped to 0..1
    [table] = p["rollout decisions and the judged check"].texts
    text = " ".join(table.get_text().split())  # the lines are wrapped to the panel's width
    assert "(r1): rolled_back; judged fail: canary win rate 0.10 over 60 pairs" in text
    assert "(r2): promoted; judged pass: canary win rate 0.55 over 40 pairs" in text
    plt.close(fig)

    empty = panels(draw(write_log(tmp_path / "other.jsonl", steps=2), THRESHOLDS))
    assert (
        "no rollout with judged pairs"
        in empty["rollouts: rubric-judged canary win rate (shadow pairs)"].texts[0].get_text()
    )
    plt.close("all")


@pytest.mark.parametrize("where", ["registry", "legacy rollouts.sqlite"])
def test_report_command_reads_the_rollouts_of_the_state_dir(tmp_path, where):
    """The rollouts are read from the registry's database; a legacy `rollouts.sqlite` is migrated into it."""
    import os
    import sqlite3
    import subprocess
    import sys
    from pathlib import Path

    from serving.rollout import LEGACY_COLUMNS, SCHEMA

    state = tmp_path / "state"
    (state / "train").mkdir(parents=True)
    write_log(state / "train" / "runlog.jsonl", steps=2)
    legacy = state / "rollout" / "rollouts.sqlite"
    if where == "registry":
        judged_store(state / "registry" / "registry.sqlite")
    else:  # what versions before the move left: the same table in a file of its own
        rows = [
            tuple(r.to_json()[c.strip()] for c in LEGACY_COLUMNS.split(","))
            for r in judged_store(tmp_path / "elsewhere.sqlite").list()
        ]
        legacy.parent.mkdir(parents=True)
        with sqlite3.connect(legacy) as conn:
            conn.execute(SCHEMA)
            conn.executemany(
                f"INSERT INTO rollouts ({LEGACY_COLUMNS}) VALUES ({','.join('?' * 13)})",
                [r[:5] + (json.dumps(r[5]),) + r[6:12] + (json.dumps(r[12]),) for r in rows],
            )
        conn.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYNRUBRIC_")}
    env |= {"DYNRUBRIC_PATHS__STATE_DIR": str(state), "COLUMNS": "200"}
    run = subprocess.run(
        [sys.executable, "-m", "dynrubric", "report"],
        env=env,
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 rollouts with judged pairs" in run.stdout
    assert "(r1): rolled_back; judged fail: canary win rate 0.10 over 60 pairs" in run.stdout
    assert (state / "report" / "run.png").read_bytes()[:4] == b"\x89PNG"
    if where != "registry":  # migrated once: the file is renamed, the registry holds the rows
        assert not legacy.exists() and legacy.with_name("rollouts.sqlite.migrated").is_file()
        rerun = subprocess.run(
            [sys.executable, "-m", "dynrubric", "report"],
            env=env,
            cwd=Path(__file__).parents[2],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert "2 rollouts with judged pairs" in rerun.stdout, rerun.stdout + rerun.stderr


def test_the_learning_curve_plots_ground_truth_beside_the_judges_reward_and_users_agreement(tmp_path):
    fig = draw(write_log(tmp_path / "runlog.jsonl", steps=2), THRESHOLDS)
    p = panels(fig)
    curve = p["learning curve: held-out ground-truth pass rate per round"]
    labels = [t.get_text() for t in curve.get_legend().get_texts()]
    assert "ground truth: parent" in labels and "ground truth: new checkpoint, accepted" in labels
    assert "judge's held-out reward (not ground truth)" in labels
    [new] = [c for c in curve.collections if c.get_label() == "ground truth: new checkpoint, accepted"]
    assert list(new.get_offsets()[0]) == [1.0, 0.42]
    [parent] = [line for line in curve.get_lines() if line.get_label() == "ground truth: parent"]
    assert list(parent.get_ydata()) == [0.36]
    assert any("+0.06 vs base" in t.get_text() for t in curve.texts)
    users = p["co-evolution: generator reward and the judge's agreement with users"]
    [agree] = [line for line in users.get_lines() if line.get_label().startswith("judge-user agreement")]
    assert list(agree.get_ydata()) == [0.75]
    plt.close(fig)


def test_each_rounds_ground_truth_label_stays_inside_the_learning_curve(tmp_path):
    """The last round's point sits at the axis' right edge: its label must not run out of the panel."""
    from tests.run_records import evaluation, truth

    summaries = [
        round_summary(
            n,
            [policy_step(0)],
            parent=parent,
            eval=evaluation(groundtruth=truth(f"r{n}", {f"r{n}": rate, parent: 0.4, "base": 0.2})),
        )
        for n, parent, rate in ((1, "base", 0.43), (2, "r1", 0.41), (3, "r2", 0.45))
    ]
    fig = draw(read_runlog(write_runlog(tmp_path / "runlog.jsonl", summaries)), THRESHOLDS)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    curve = panels(fig)["learning curve: held-out ground-truth pass rate per round"]
    box = curve.get_window_extent(renderer)
    labels = [t for t in curve.texts if "vs base" in t.get_text()]
    assert [t.get_text() for t in labels] == ["r1 +0.06 vs base", "r2 +0.06 vs base", "r3 +0.06 vs base"]
    for t in labels:
        extent = t.get_window_extent(renderer)
        assert box.x0 <= extent.x0 and extent.x1 <= box.x1, f"{t.get_text()!r} runs out of the panel"
    plt.close(fig)


def test_the_sampler_trainer_mismatch_is_drawn_per_policy_step(tmp_path):
    """The run log's sampler_log_ratio and sampler_capped, per policy step: the mismatch against the |log
    ratio| past which a weight is truncated (log 2 for the band [0.5, 5]), the truncated share on 0..1; a
    run whose engine returned no log-probs says so."""
    import math

    log = write_log(
        tmp_path / "runlog.jsonl",
        steps=3,
        sampler_log_ratio=[0.01, 0.2, 0.9],
        sampler_capped=[0.0, 0.05, 0.3],
        sampler_tokens=[100] * 3,
    )
    p = panels(draw(log, THRESHOLDS))
    mismatch = p["sampler vs trainer: log-prob mismatch per policy step"]
    [data] = [line for line in mismatch.get_lines() if line.get_linestyle() != "--"]
    assert list(data.get_xdata()) == [0, 1, 2] and list(data.get_ydata()) == [0.01, 0.2, 0.9]
    [cap] = [line for line in mismatch.get_lines() if line.get_linestyle() == "--"]
    assert cap.get_ydata()[0] == pytest.approx(math.log(2)) and "[0.5, 5.0]" in cap.get_label()
    capped = p["sampler vs trainer: truncated importance weights"]
    assert capped.get_ylim() == UNIT and list(capped.get_lines()[0].get_ydata()) == [0.0, 0.05, 0.3]
    plt.close("all")

    empty = panels(draw(write_log(tmp_path / "other.jsonl", steps=2), THRESHOLDS))
    note = empty["sampler vs trainer: log-prob mismatch per policy step"].texts[0].get_text()
    assert "no policy step carried the sampling engine's log-probs" in note
    plt.close("all")


def test_titles_ticks_and_the_rollout_lines_are_legible(tmp_path):
    from dynrubric.app.report import judged_rollouts

    judged = judged_rollouts(r.to_json() for r in judged_store(tmp_path / "registry.sqlite").list())
    fig = draw(write_log(tmp_path / "runlog.jsonl", steps=3), THRESHOLDS, judged)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    suptitle = fig._suptitle.get_window_extent(renderer)
    for ax in fig.axes:
        title = ax.title.get_window_extent(renderer)
        assert not suptitle.overlaps(title), f"the run's title covers the panel title {ax.get_title()!r}"
    generator = panels(fig)["co-evolution: generator reward and the judge's agreement with users"]
    assert [t.get_text() for t in generator.get_xticklabels()] == ["0"], "one integer tick for one generator step"
    [table] = panels(fig)["rollout decisions and the judged check"].texts
    lines = table.get_window_extent(renderer)
    assert lines.x1 <= fig.bbox.x1, f"the rollout lines run {lines.x1 - fig.bbox.x1:.0f} px past the figure's edge"
    plt.close(fig)
