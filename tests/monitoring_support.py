"""What the monitoring tests share: the metric table, the rule files, and the metric names in PromQL."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "monitoring"
RULES = sorted((MONITORING / "rules").glob("*.yml"))

# Series Prometheus makes itself for every target; not exported by our code, so not in the table.
PROMETHEUS_SYNTHETIC = {"up"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


@dataclass(frozen=True)
class TableMetric:
    name: str
    type: str
    labels: str


def metric_table() -> dict[str, TableMetric]:
    """The rows of THE metric table in monitoring/README.md."""
    rows: dict[str, TableMetric] = {}
    for line in (MONITORING / "README.md").read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) < 3 or not cells[0].startswith("dynrubric_"):
            continue
        rows[cells[0]] = TableMetric(cells[0], cells[1], cells[2])
    return rows


def rule_groups() -> list[dict]:
    return [g for path in RULES for g in yaml.safe_load(path.read_text())["groups"]]


def recording_rules() -> dict[str, str]:
    return {r["record"]: r["expr"] for g in rule_groups() for r in g["rules"] if "record" in r}


def alerting_rules() -> dict[str, dict]:
    return {r["alert"]: r for g in rule_groups() for r in g["rules"] if "alert" in r}


_KEYWORDS = {
    "and",
    "or",
    "unless",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "inf",
    "nan",
    "atan2",
}
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")


def promql_metric_names(expr: str) -> set[str]:
    """Every metric name a PromQL expression selects (functions, label names, keywords left out)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)  # string literals
    s = re.sub(r"\$\{[^}]*\}|\$\w+", "1", s)  # Grafana variables ($__rate_interval, ${variant})
    names = set(re.findall(r'\{[^}]*__name__\s*=\s*"([^"]+)"', expr))
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # range and subquery durations
    s = _GROUPING.sub(" ", s)  # label lists of aggregations and vector matching
    for m in re.finditer(r"(?<![\w.:])([A-Za-z_:][\w:]*)(\s*\()?", s):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names


def table_name_of(series: str, table: dict[str, TableMetric]) -> str | None:
    """The table row a raw series name belongs to (histogram series map to their base name)."""
    if series in table:
        return series
    for suffix in HISTOGRAM_SUFFIXES:
        base = series.removesuffix(suffix)
        if base != series and base in table and table[base].type == "histogram":
            return base
    return None


def unknown_metrics(expr: str, table: dict[str, TableMetric], recorded: set[str]) -> set[str]:
    """Names in `expr` that are neither table metrics, nor recording rules, nor Prometheus's own."""
    return {
        n
        for n in promql_metric_names(expr)
        if n not in recorded and n not in PROMETHEUS_SYNTHETIC and table_name_of(n, table) is None
    }
