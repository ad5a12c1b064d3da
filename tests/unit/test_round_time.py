"""benchmarks/round_time.py: today's round is timed against the round of the commit issue 38 measured, run on that
commit's own code."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
saved = list(sys.path)
try:  # round_time.py puts its checkout and benchmarks/ on sys.path as it imports: both taken off again
    sys.path.insert(0, str(REPO / "benchmarks"))
    round_time = importlib.import_module("round_time")
finally:
    sys.path[:] = saved


def test_the_ratio_is_todays_round_over_the_filed_commits_and_the_settings_ratio_is_apart() -> None:
    stages = {"after": {"rubrics": 100.0}, "filed": {"rubrics": 250.0}, "before": {"rubrics": 200.0}}
    lines = round_time.stage_table(stages, {"after": 500.0, "filed": 1250.0, "before": 1000.0})
    assert lines[-2] == "settings ratio: 0.50 (after / before)"
    assert lines[-1] == f"ratio: 0.40 (after / filed, {round_time.FILED})"
    assert any(line.split() == ["rubrics", "100.0", "250.0", "200.0"] for line in lines)


def test_the_filed_round_runs_this_file_on_the_old_checkout_with_the_parents_prompts(tmp_path: Path) -> None:
    cmd = round_time.filed_command(tmp_path / "checkout", tmp_path / "filed", tmp_path / "prompts.jsonl", quick=True)
    assert cmd[1] == str(REPO / "benchmarks" / "round_time.py")
    assert cmd[cmd.index("--checkout") + 1] == str(tmp_path / "checkout")
    assert cmd[cmd.index("--prompts-file") + 1] == str(tmp_path / "prompts.jsonl")
    assert cmd[cmd.index("--arms") + 1 :][:1] == ["after"] and "--quick" in cmd
    assert round_time.checkout_root(["x", "--checkout", str(tmp_path)]) == tmp_path.resolve()
    assert round_time.checkout_root(["x"]) == REPO


def test_the_filed_commits_code_has_every_name_the_child_imports(tmp_path: Path) -> None:
    """The child imports its round runner from FILED's tree (`git archive`): a name this file starts importing that
    FILED lacks fails here, not an hour into a benchmark."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", round_time.FILED], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive, check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYNRUBRIC_")} | {"PYTHONPATH": str(tmp_path)}
    # the script's module-level imports, run as the child runs them (not as __main__: main() is not called)
    probe = (
        "import runpy, sys; script, checkout = sys.argv[1:3]; sys.argv = [script, '--checkout', checkout]; "
        "runpy.run_path(script, run_name='probe'); import dynrubric; print(dynrubric.__file__)"
    )
    script = str(REPO / "benchmarks" / "round_time.py")
    done = subprocess.run(
        [sys.executable, "-c", probe, script, str(tmp_path)], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(tmp_path / "dynrubric" / "__init__.py")
