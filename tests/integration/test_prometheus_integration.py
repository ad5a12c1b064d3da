"""A real Prometheus (Debian's binary) with our rules scrapes a real exporter whose score gaps collapse;
the test queries Prometheus's API until RubricScoreGapCollapse fires.

Time is compressed, not thresholds: the rule files are generated from monitoring/rules/ with every
duration (range windows, offsets, `for:`, group intervals) divided by TIME_SCALE = 60, so 10m windows
become 10s and `for: 15m` becomes 15s. Expressions and thresholds are the shipped ones, unchanged.
"""

from __future__ import annotations

import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from dynrubric.app.monitor import find_prometheus, render_config, start_prometheus
from dynrubric.ports import free_port
from tests.monitoring_support import ROOT, RULES, alerting_rules

TIME_SCALE = 60
UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
DURATION = re.compile(r"^(\d+)(ms|s|m|h|d|w)$")


def scaled(duration: str) -> str:
    m = DURATION.match(duration)
    assert m, f"unsupported duration {duration!r}"
    return f"{max(1, math.ceil(int(m.group(1)) * UNITS[m.group(2)] / TIME_SCALE))}s"


def time_scaled_rules(out_dir: Path) -> list[Path]:
    """The shipped rule files with every duration divided by TIME_SCALE (see the module docstring)."""
    out = []
    for path in RULES:
        spec = yaml.safe_load(path.read_text())
        for group in spec["groups"]:
            group["interval"] = "1s"
            for rule in group["rules"]:
                rule["expr"] = re.sub(
                    r"(\[|\boffset\s+)(\d+(?:ms|s|m|h|d|w))\b",
                    lambda m: f"{m.group(1)}{scaled(m.group(2))}",
                    rule["expr"],
                )
                if "for" in rule:
                    rule["for"] = scaled(rule["for"])
        target = out_dir / path.name
        target.write_text(yaml.safe_dump(spec, sort_keys=False))
        out.append(target)
    return out


class CollapsingExporter:
    """Scores one candidate set every 50 ms; gaps are healthy (~0.3) until collapse() is called, then
    decay geometrically to 0.01, as when the rubric generator stops separating candidates."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.sets = Counter("dynrubric_rubric_sets", "candidate sets scored", registry=self.registry)
        self.mean_gap = Histogram(
            "dynrubric_rubric_mean_gap",
            "mean absolute pairwise score gap of each set",
            buckets=(0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0),
            registry=self.registry,
        )
        self.collapsed_at: float | None = None
        self.stopped = threading.Event()
        self.server, _ = start_http_server(0, addr="127.0.0.1", registry=self.registry)
        self.address = f"127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self._feed, daemon=True)
        self.thread.start()

    def gap(self, now: float) -> float:
        if self.collapsed_at is None:
            return 0.3
        return max(0.01, 0.3 * 0.5 ** ((now - self.collapsed_at) / 0.5))

    def _feed(self) -> None:
        while not self.stopped.wait(0.05):
            self.mean_gap.observe(self.gap(time.monotonic()))
            self.sets.inc()

    def collapse(self) -> None:
        self.collapsed_at = time.monotonic()

    def close(self) -> None:
        self.stopped.set()
        self.thread.join()
        self.server.shutdown()
        self.server.server_close()


def api(url: str, path: str, **params) -> dict:
    reply = httpx.get(f"{url}/api/v1/{path}", params=params, timeout=5.0)
    reply.raise_for_status()
    return reply.json()["data"]


def collapse_alert_state(url: str) -> str:
    states = [
        a["state"]
        for a in api(url, "alerts")["alerts"]
        if a["labels"]["alertname"] == "RubricScoreGapCollapse" and a["labels"]["job"] == "dynrubric-reward-server"
    ]
    return states[0] if states else "inactive"


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def test_collapse_alert_fires_in_a_real_prometheus(tmp_path):
    exporter = CollapsingExporter()
    rules = time_scaled_rules(tmp_path)
    config = render_config({"dynrubric-reward-server": [exporter.address]}, rules, 1, 1)
    prometheus = start_prometheus(config, tmp_path / "prom", "127.0.0.1", free_port())
    try:
        gap_query = "job:dynrubric_rubric_mean_gap:mean10m"

        def healthy_gap():  # Prometheus's timestamp of a healthy recorded gap
            result = api(prometheus.url, "query", query=gap_query)["result"]
            return result and float(result[0]["value"][1]) > 0.05 and float(result[0]["value"][0])

        healthy_at = wait_for(healthy_gap, 60, "the recorded mean gap of the healthy phase")

        def evaluated_on_healthy_data():  # the alert rule, once evaluated twice (1 s interval) after that
            rule = next(
                r
                for g in api(prometheus.url, "rules")["groups"]
                for r in g["rules"]
                if r["name"] == "RubricScoreGapCollapse"
            )
            evaluated = datetime.fromisoformat(rule["lastEvaluation"]).timestamp()
            return rule["health"] == "ok" and evaluated >= healthy_at + 2 and rule

        assert (
            wait_for(evaluated_on_healthy_data, 30, "the alert rule's evaluation on healthy data")["state"]
            == "inactive"
        )
        assert collapse_alert_state(prometheus.url) == "inactive"

        exporter.collapse()
        seen = set()

        def firing():
            seen.add(state := collapse_alert_state(prometheus.url))
            return state == "firing"

        wait_for(firing, 120, "RubricScoreGapCollapse to fire")
        assert "pending" in seen, "the alert must wait out its (scaled) `for:` before firing"
        value = float(api(prometheus.url, "query", query=gap_query)["result"][0]["value"][1])
        assert value < 0.05
        alert = next(
            a for a in api(prometheus.url, "alerts")["alerts"] if a["labels"]["alertname"] == "RubricScoreGapCollapse"
        )
        assert alert["labels"]["severity"] == "warning"
        assert "dynrubric-reward-server" in alert["annotations"]["summary"]
    finally:
        prometheus.stop()
        exporter.close()


def test_time_scaling_keeps_expressions_and_thresholds(tmp_path):
    shipped = alerting_rules()
    scaled_rules = {
        r["alert"]: r
        for p in time_scaled_rules(tmp_path)
        for g in yaml.safe_load(p.read_text())["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    assert scaled_rules.keys() == shipped.keys()
    strip = lambda e: re.sub(r"\[[^\]]+\]|\boffset\s+\w+", "[]", e)  # noqa: E731
    for name, rule in shipped.items():
        assert strip(scaled_rules[name]["expr"]) == strip(rule["expr"]), name
    assert scaled_rules["RubricScoreGapCollapse"]["for"] == "15s"
    assert (
        "[10s]" in scaled_rules["RubricScoreGapCollapse"]["expr"] or "[10s]" in (tmp_path / "recording.yml").read_text()
    )
    assert (
        "offset 30s" in scaled_rules["LoopChildRestarting"]["expr"]
        and "[30s]" in scaled_rules["LoopChildRestarting"]["expr"]
    )


def _cli(args: list[str], env: dict[str, str], **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dynrubric", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def test_monitor_up_serves_our_rules_and_local_targets(tmp_path):
    find_prometheus()
    port = free_port()
    env = {
        **os.environ,
        "DYNRUBRIC_PATHS__STATE_DIR": str(tmp_path),
        "DYNRUBRIC_MONITORING__PROMETHEUS_PORT": str(port),
        "DYNRUBRIC_MONITORING__TARGETS": '{"dynrubric-router": ["127.0.0.1:1"]}',
    }
    # started with SIGINT ignored, as a background job of a non-interactive shell is: Ctrl-C must still stop it
    proc = _cli(["monitor", "up"], env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    url = f"http://127.0.0.1:{port}"
    try:

        def ready():
            assert proc.poll() is None, proc.stdout.read()
            try:
                return httpx.get(f"{url}/-/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, 60, "`dynrubric monitor up` to serve")
        alerts = {r["name"] for g in api(url, "rules")["groups"] for r in g["rules"] if r["type"] == "alerting"}
        assert alerts == set(alerting_rules())
        jobs = lambda: {t["labels"]["job"] for t in api(url, "targets")["activeTargets"]}  # noqa: E731
        wait_for(lambda: {"dynrubric-reward-server", "dynrubric-router"} <= jobs(), 30, "both scrape jobs")
        assert (tmp_path / "monitoring" / "prometheus.yml").is_file()
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "Prometheus ready" in out


def test_monitor_up_without_prometheus_says_how_to_install(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path), "DYNRUBRIC_PATHS__STATE_DIR": str(tmp_path)}
    proc = _cli(["monitor", "up"], env)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "Prometheus is not installed" in out and "apt-get install prometheus" in out
    assert not (tmp_path / "monitoring").exists()


def test_local_targets_follow_the_config():
    from dynrubric.app.monitor import local_targets
    from dynrubric.config_loader import load_settings

    settings = load_settings(
        environ={"DYNRUBRIC_REWARD_SERVER__PORT": "8111", "DYNRUBRIC_MONITORING__TARGETS": '{"extra": ["10.1.2.3:9"]}'}
    )
    jobs = local_targets(settings)
    assert jobs["dynrubric-reward-server"] == ["127.0.0.1:8111"]
    assert jobs["extra"] == ["10.1.2.3:9"]


def test_start_prometheus_refuses_a_busy_port(tmp_path):
    from dynrubric.errors import DynrubricError

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(DynrubricError, match=f"127.0.0.1:{port} is already in use"):
            start_prometheus(render_config({}, RULES, 5, 15), tmp_path, "127.0.0.1", port)
