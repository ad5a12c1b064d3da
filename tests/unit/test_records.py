"""The run records (dynrubric/train/records.py): they round-trip through their files, and every reader refuses a
record of another version, or with a field missing or renamed, with an error naming the file, the field and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynrubric.app.report import read_runlog
from dynrubric.errors import DynrubricError
from dynrubric.jsonl import split_lines
from dynrubric.train.records import (
    RECORD_VERSION,
    Collapse,
    Evaluation,
    Guard,
    OpenRLHFSummary,
    RoundLine,
    RunLogFile,
    read_record,
    read_steps,
    read_summary,
    round_line,
    step_line,
    write_record,
    write_steps,
)
from tests.run_records import evaluation, generator_step, policy_step, round_summary, write_runlog


def a_round():
    return round_summary(
        2,
        [policy_step(0, sampler_log_ratio=0.1, sampler_capped=0.02), generator_step(1, gen_judge_user_agreement=0.7)],
        refresh="collapse detected in round 1: starting with a generator phase",
    )


def test_a_round_summary_and_its_run_log_lines_round_trip(tmp_path: Path):
    summary = a_round()
    write_record(tmp_path / "summary.json", summary)
    assert read_summary(tmp_path / "summary.json") == summary
    assert json.loads((tmp_path / "summary.json").read_text())["schema_version"] == RECORD_VERSION

    write_runlog(tmp_path / "runlog.jsonl", [summary])
    lines = RunLogFile(tmp_path / "runlog.jsonl").records()
    assert lines == [step_line(2, s) for s in summary.steps] + [round_line(summary)]
    log = read_runlog(tmp_path / "runlog.jsonl")
    assert [s.step for s in log.steps] == [0] and [s.step for s in log.generator_steps] == [1]
    assert log.rounds == [round_line(summary)] and isinstance(log.rounds[0], RoundLine)

    write_steps(tmp_path / "history.json", summary.steps)
    assert read_steps(tmp_path / "history.json") == summary.steps
    write_record(tmp_path / "eval.json", summary.eval)
    assert read_record(tmp_path / "eval.json", Evaluation) == summary.eval


def test_an_openrlhf_summary_reads_back_as_one(tmp_path: Path):
    summary = OpenRLHFSummary(
        round=1,
        parent="base",
        version="r1",
        state="rejected",
        guard=Guard(accepted=False, reason="kl", detail="KL too large"),
        eval=evaluation(),
        refresh=None,
        collapse=Collapse(fired=False, note=None),
        watermark_before=None,
        watermark_after="8",
        prompts=8,
    )
    path = tmp_path / "summary.json"
    write_record(path, summary)
    assert read_summary(path) == summary


def edited(path: Path, edit) -> Path:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d["eval"].pop("reward_new"), "field 'eval.reward_new': field required"),
        (lambda d: d["steps"][0].pop("kl"), "field 'steps.0.policy.kl': field required"),
        (lambda d: d["guard"].update(accepted="maybe"), "field 'guard.accepted'"),
        # a renamed field: the new name is unknown, the old one missing
        (lambda d: d.update(rounds=d.pop("round")), "field 'round': field required; field 'rounds': extra inputs"),
    ],
)
def test_a_summary_with_a_field_missing_or_changed_is_refused_naming_file_and_field(tmp_path: Path, edit, field):
    path = tmp_path / "summary.json"
    write_record(path, a_round())
    edited(path, edit)
    with pytest.raises(DynrubricError) as e:
        read_summary(path)
    assert str(path) in e.value.problem and field in e.value.problem, e.value.problem
    assert "fresh run dir" in e.value.fix


@pytest.mark.parametrize(("version", "shown"), [(0, "schema_version 0"), (None, "schema_version none (unversioned)")])
def test_a_record_of_another_version_is_refused_with_what_to_do(tmp_path: Path, version, shown):
    path = tmp_path / "summary.json"
    write_record(path, a_round())
    edited(path, lambda d: d.update(schema_version=version) if version is not None else d.pop("schema_version"))
    for read in (read_summary, lambda p: read_record(p, Evaluation)):
        with pytest.raises(DynrubricError) as e:
            read(path)
        assert f"{path} is a run record of {shown}" in e.value.problem
        assert f"reads version {RECORD_VERSION}" in e.value.problem
        assert "another dynrubric version" in e.value.fix


def test_the_report_refuses_a_run_log_line_with_a_field_missing_naming_the_line(tmp_path: Path):
    path = write_runlog(tmp_path / "runlog.jsonl", [a_round()])
    lines = split_lines(path.read_text())
    doc = json.loads(lines[0])
    del doc["reward_mean"]
    path.write_text("\n".join([json.dumps(doc), *lines[1:]]) + "\n")
    with pytest.raises(DynrubricError) as e:
        read_runlog(path)
    assert f"{path} line 1" in e.value.problem and "field 'reward_mean': field required" in e.value.problem
    with pytest.raises(DynrubricError, match="line 1"):
        RunLogFile(path).records()


def test_the_trainers_readers_refuse_an_old_summary(tmp_path: Path):
    """The next round's plan reads the last summary: an unversioned one (written before records were typed)
    stops it with the file named, instead of a KeyError deep in the plan."""
    from dynrubric.config import Settings
    from dynrubric.registry import Registry
    from dynrubric.train.rounds import SUMMARY, RunState

    settings = Settings.model_validate({"paths": {"state_dir": str(tmp_path)}})
    state = RunState(settings, Registry(tmp_path / "registry.sqlite"), None)
    path = state.round_dir(1) / SUMMARY
    path.parent.mkdir(parents=True)
    old = a_round().model_dump()
    del old["schema_version"]
    path.write_text(json.dumps(old))
    with pytest.raises(DynrubricError, match="schema_version none"):
        state.last_summary()


def test_the_run_log_appends_each_key_once_and_skips_a_torn_last_line(tmp_path: Path):
    log = RunLogFile(tmp_path / "runlog.jsonl")
    a, b, c = (step_line(1, policy_step(i)) for i in range(3))
    log.append([a, b])
    log.append([b, c])
    with open(log.path, "a") as f:
        f.write('{"key": "torn')  # a crash mid-line
    assert [r.key for r in log.records()] == [a.key, b.key, c.key]


def test_the_cli_reports_a_round_from_its_summary(tmp_path: Path):
    from dynrubric.app.train_commands import round_report

    summary = a_round()
    lines = round_report(summary, tmp_path / "summary.json")
    assert lines[0] == "round 2: r2 candidate (parent base; guard accepted: within bounds)"
    assert "  steps: 1 policy, 1 generator; 8 prompts; 10s" in lines
    assert "ground truth on 200 dev prompts (the guard's): pass r1 0.420, base 0.360" in "\n".join(lines)
    unseen = "  test unseen types (95 test prompts): r1 0.300, base 0.250; vs parent +"
    assert any(line.startswith(unseen) for line in lines)
    assert f"  refresh: {summary.refresh}" in lines
    openrlhf = OpenRLHFSummary.model_validate(
        {k: v for k, v in summary.model_dump().items() if k in OpenRLHFSummary.model_fields} | {"trainer": "openrlhf"}
    )
    assert round_report(openrlhf, tmp_path / "summary.json")[0] == lines[0]


def test_an_evaluation_written_before_the_per_kind_comparisons_still_reads(tmp_path: Path):
    """`TruthEvidence.vs_parent_by_kind` was added with a default in version 2: an eval.json of version 2 without
    it reads back, with no per-kind comparison (the guard then decides on the total alone)."""
    path = tmp_path / "eval.json"
    write_record(path, evaluation())
    edited(path, lambda d: d["groundtruth"].pop("vs_parent_by_kind"))
    assert "vs_parent_by_kind" not in json.loads(path.read_text())["groundtruth"]
    old = read_record(path, Evaluation)
    assert old.groundtruth is not None and old.groundtruth.vs_parent_by_kind == {}
    assert old == evaluation()
