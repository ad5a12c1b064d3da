"""The Grafana dashboard: provisionable JSON, every query parses (promtool) and selects only table
metrics or our recording rules, the collapse threshold drawn is the alert's."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import yaml

from tests.monitoring_support import (
    MONITORING,
    alerting_rules,
    metric_table,
    promql_metric_names,
    recording_rules,
    table_name_of,
    unknown_metrics,
)

DASHBOARD = MONITORING / "dashboards" / "dynrubric.json"
SECTIONS = ["Loop overview", "Score gaps", "Reward and KL per round", "Ingest", "A/B arms and gate", "Engines"]


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def exprs() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in panels() for t in p["targets"]]


def test_dashboard_is_provisionable():
    d = dashboard()
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
    assert "id" not in d or d["id"] is None  # provisioning assigns ids
    assert {"name": "datasource", "type": "datasource", "query": "prometheus"}.items() <= d["templating"]["list"][
        0
    ].items()
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    assert [p["title"] for p in d["panels"] if p["type"] == "row"] == SECTIONS
    for p in panels():
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]


def test_every_query_uses_table_metrics_or_recording_rules():
    table, recorded = metric_table(), set(recording_rules())
    bad = {title: sorted(u) for title, e in exprs() if (u := unknown_metrics(e, table, recorded))}
    assert not bad, f"dashboard queries with metrics missing from monitoring/README.md: {bad}"


def test_every_table_metric_is_on_the_dashboard():
    table, rules = metric_table(), recording_rules()
    shown = set()
    for _, e in exprs():
        for name in promql_metric_names(e):
            for n in promql_metric_names(rules[name]) if name in rules else {name}:
                if (base := table_name_of(n, table)) is not None:
                    shown.add(base)
    assert set(table) - shown == set(), f"table metrics not on the dashboard: {sorted(set(table) - shown)}"


def test_every_query_parses(tmp_path):
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: `make setup` installs Debian's prometheus package"
    rules = [
        {"record": f"dashboard:query_{i}:check", "expr": re.sub(r"\$\{?\w+\}?", "5m", e)}
        for i, (_, e) in enumerate(exprs())
    ]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_collapse_threshold_drawn_is_the_alerts():
    alert_expr = alerting_rules()["RubricScoreGapCollapse"]["expr"]
    threshold = float(re.search(r"job:dynrubric_rubric_mean_gap:mean10m\s*<\s*([0-9.]+)", alert_expr).group(1))
    panel = next(p for p in panels() if p["title"].startswith("Mean within-set score gap"))
    assert any("job:dynrubric_rubric_mean_gap:mean10m" in t["expr"] for t in panel["targets"])
    steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [s["value"] for s in steps if s["value"] is not None] == [threshold]
    assert panel["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"].startswith("line")
    nonsplit = float(re.search(r"> ([0-9.]+)", alerting_rules()["RubricNonSplittingItemsHigh"]["expr"]).group(1))
    panel = next(p for p in panels() if p["title"].startswith("Share of rubric items"))
    assert [s["value"] for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"] if s["value"] is not None] == [
        nonsplit
    ]
