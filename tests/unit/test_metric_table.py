"""The metric table in monitoring/README.md is the contract between the services and the rules.

- every metric a rule (recording or alerting) selects is in the table (or a recording rule, or `up`);
- every metric in the table is exported by the Python code (dynrubric/, streaming/, serving/).
  This second test fails until the services that export the metrics are merged: that is intended.
"""

from __future__ import annotations

import re

import pytest

from tests.monitoring_support import (
    ROOT,
    alerting_rules,
    metric_table,
    promql_metric_names,
    recording_rules,
    unknown_metrics,
)

NAME = re.compile(r"^dynrubric_[a-z]+_[a-z0-9_]+$")
RECORD = re.compile(r"^[a-z_]+:[a-z0-9_]+:[a-z0-9_]+$")  # level:metric:operations


def test_table_rows_follow_the_naming_conventions():
    table = metric_table()
    assert len(table) >= 30, "the table in monitoring/README.md was not parsed"
    for m in table.values():
        assert NAME.match(m.name), m.name
        assert m.type in {"counter", "gauge", "histogram"}, (m.name, m.type)
        assert m.name.endswith("_total") == (m.type == "counter"), f"{m.name}: counters and only counters end in _total"
        assert "user" not in m.labels, f"{m.name}: no per-user labels"


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (job, le) (rate(a_bucket{job="x",le!="1"}[5m]))', {"a_bucket"}),
        ("histogram_quantile(0.95, sum by (variant, le) (rate(b[5m:1m] offset 1h)))", {"b"}),
        ('x{variant="canary"} > ignoring (variant) (1.5 * y) and on() z > bool 0.1', {"x", "y", "z"}),
        ('time() - max by (job) (ts_seconds) > 3600 unless absent(w{name="and"})', {"ts_seconds", "w"}),
        ("sum(rate(c_total[$__rate_interval])) / ${total}", {"c_total"}),
        ("level:metric:rate5m * 2e-3 + 1", {"level:metric:rate5m"}),
        ('{__name__="named_metric"}', {"named_metric"}),
    ],
)
def test_promql_metric_names_finds_selectors_only(expr, names):
    assert promql_metric_names(expr) == names


def test_recording_rules_are_named_level_metric_operations():
    for name in recording_rules():
        assert RECORD.match(name), name


def test_every_rule_expression_uses_table_metrics():
    table, recorded = metric_table(), set(recording_rules())
    exprs = {
        **{f"record {k}": v for k, v in recording_rules().items()},
        **{f"alert {k}": r["expr"] for k, r in alerting_rules().items()},
    }
    problems = {where: sorted(bad) for where, e in exprs.items() if (bad := unknown_metrics(e, table, recorded))}
    assert not problems, f"metrics missing from monitoring/README.md's table: {problems}"
    for where, e in exprs.items():
        assert promql_metric_names(e), f"{where} selects no metric at all"


def test_the_cross_check_catches_an_unknown_metric():
    table, recorded = metric_table(), set(recording_rules())
    expr = alerting_rules()["RubricScoreGapCollapse"]["expr"].replace("dynrubric_rubric_sets", "dynrubric_rubric_setz")
    assert unknown_metrics(expr, table, recorded) == {"job:dynrubric_rubric_setz:rate10m"}
    assert unknown_metrics("rate(dynrubric_ingest_lag_messages_bucket[5m])", table, recorded) == {
        "dynrubric_ingest_lag_messages_bucket"  # a gauge has no histogram series
    }


def _code_text() -> str:
    files = [p for pkg in ("dynrubric", "streaming", "serving") for p in (ROOT / pkg).rglob("*.py")]
    return "\n".join(p.read_text(errors="replace") for p in files)


def test_every_table_metric_is_exported_by_code():
    """Each table metric appears as a string literal in the services' code (prometheus_client accepts a
    counter's name with or without `_total`). Fails until the exporting services are merged."""
    code = _code_text()
    missing = []
    for m in metric_table().values():
        spellings = {m.name, m.name.removesuffix("_total")} if m.type == "counter" else {m.name}
        if not any(re.search(rf"""["']{re.escape(s)}["']""", code) for s in spellings):
            missing.append(m.name)
    assert not missing, (
        f"{len(missing)} table metrics are exported by no code in dynrubric/, streaming/, serving/: {missing}"
    )
