"""promtool checks the rule files and runs their unit tests (monitoring/tests/*.test.yml); every alert
has at least one test case where it fires and one where it stays silent."""

from __future__ import annotations

import shutil
import subprocess

import yaml

from tests.monitoring_support import MONITORING, RULES, alerting_rules

RULE_TESTS = sorted((MONITORING / "tests").glob("*.test.yml"))


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is missing: `make setup` installs Debian's prometheus package (apt-get install prometheus)"
    return path


def test_promtool_check_rules():
    result = subprocess.run([promtool(), "check", "rules", *map(str, RULES)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_test_rules():
    assert RULE_TESTS, "no promtool rule tests found"
    result = subprocess.run([promtool(), "test", "rules", *map(str, RULE_TESTS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAILED" not in result.stdout


def test_every_alert_has_a_firing_and_a_silent_case():
    firing, silent = set(), set()
    for path in RULE_TESTS:
        spec = yaml.safe_load(path.read_text())
        assert {str((path.parent / f).resolve()) for f in spec["rule_files"]} == {str(p.resolve()) for p in RULES}, (
            f"{path.name} must load every rule file"
        )
        for case in spec["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check.get("exp_alerts") else silent).add(check["alertname"])
    alerts = set(alerting_rules())
    assert not alerts - firing, f"alerts never tested firing: {sorted(alerts - firing)}"
    assert not alerts - silent, f"alerts never tested silent: {sorted(alerts - silent)}"
    assert not (firing | silent) - alerts, f"tests name unknown alerts: {sorted((firing | silent) - alerts)}"


def test_promtool_test_rules_fails_when_a_threshold_changes(tmp_path):
    """The unit tests pin the shipped thresholds: a copy of the rules with a looser one must fail them."""
    (tmp_path / "rules").mkdir()
    (tmp_path / "tests").mkdir()
    for rule in RULES:
        text = rule.read_text().replace(
            "job:dynrubric_rubric_mean_gap:mean10m < 0.05", "job:dynrubric_rubric_mean_gap:mean10m < 0.01"
        )
        (tmp_path / "rules" / rule.name).write_text(text)
    shutil.copy(MONITORING / "tests" / "rubric.test.yml", tmp_path / "tests")
    result = subprocess.run(
        [promtool(), "test", "rules", str(tmp_path / "tests" / "rubric.test.yml")], capture_output=True, text=True
    )
    assert result.returncode != 0 and "RubricScoreGapCollapse" in result.stdout + result.stderr
