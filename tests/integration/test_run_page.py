"""The run report's HTML page, rendered by a real headless Chromium (Debian's `chromium`, installed by
scripts/setup.sh): the page loads without console errors and the screenshot shows the embedded plots."""

from __future__ import annotations

import shutil
import subprocess
import time

import numpy as np
from matplotlib.image import imread

from dynrubric.app.report import render
from dynrubric.app.run_page import RunPage, render_html
from tests.unit.test_report import THRESHOLDS, write_log

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--enable-logging=stderr",
    "--v=0",
]


def page_data(tmp_path) -> RunPage:
    png = render(write_log(tmp_path / "runlog.jsonl", steps=3), tmp_path / "report" / "run.png", THRESHOLDS)
    t0 = time.time() - 100
    requests = [
        {
            "request_id": f"q{i}",
            "ts": t0 + i,
            "variant": "canary" if i % 3 == 0 else "stable",
            "policy_version": "r1" if i % 3 == 0 else "base",
            "latency_ms": 100.0 + i,
            "shadow": False,
        }
        for i in range(90)
    ]
    return RunPage(
        cycles=[
            {
                "cycle": 1,
                "round": 1,
                "version": "r1",
                "round_state": "candidate",
                "decision": "rolled_back",
                "reason": "ro-r1-x: gate failed at step 0: error_rate: canary worse <script>",
                "serving": "base",
                "registered_to_canary_s": 2.5,
            }
        ],
        rollouts=[
            {
                "id": "ro-r1-x",
                "version": "r1",
                "baseline": "base",
                "status": "rolled_back",
                "reason": "gate failed",
                "steps": [0.3, 0.6],
                "started_at": t0,
                "updated_at": t0 + 90,
                "plan": {
                    "lines": [
                        "gate power at 1.00 requests/s from 40 users, 0.50 judged pairs/s (router)",
                        "  judged win rate (0.500): a fall below 1/2 of 0.381 / 0.381 at steps 30% / 60%",
                        "  an equal canary is promoted after about 159 s (step 0 34 s, step 1 125 s)",
                    ]
                },
            }
        ],
        gate_log=[
            {"ts": t0 + 40, "rollout": "ro-r1-x", "step": 0, "verdict": "inconclusive", "line": "min_samples"},
            {"ts": t0 + 80, "rollout": "ro-r1-x", "step": 0, "verdict": "fail", "line": "error_rate"},
        ],
        lineage=[
            {"version": "base", "parent": None, "round": None, "state": "stable", "reason": None},
            {"version": "r1", "parent": "base", "round": 1, "state": "rejected", "reason": "gate failed"},
        ],
        requests=requests,
        feedback=[{"request_id": f"q{i}", "kind": "thumbs_up" if i % 2 else "thumbs_down"} for i in range(90)],
        alerts=[{"alertname": "DynrubricCanaryErrors", "severity": "page", "first": "10:00:00", "last": "10:01:00"}],
        training_png=png,
    )


def test_run_page_renders_in_headless_chromium(tmp_path):
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is missing: run scripts/setup.sh (apt-get install chromium)"
    out = render_html(page_data(tmp_path), tmp_path / "report" / "run.html")
    text = out.read_text()
    assert "<script>" not in text and "&lt;script&gt;" in text  # data is escaped, the page runs nothing
    assert 'src="http' not in text and text.count("data:image/png;base64,") == 2  # self-contained
    assert (tmp_path / "report" / "rollout-ro-r1-x.png").read_bytes()[:4] == b"\x89PNG"
    # beside the rollout: what its gate could detect at the traffic it started with
    assert "gate power at 1.00 requests/s from 40 users" in text and "a fall below 1/2 of 0.381" in text

    shot = tmp_path / "shot.png"
    run = subprocess.run(
        [chromium, *CHROMIUM_FLAGS, "--window-size=1200,2400", f"--screenshot={shot}", out.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and shot.is_file(), run.stderr[-2000:]
    console = [line for line in run.stderr.splitlines() if "CONSOLE" in line or "Failed to load" in line]
    assert not console, console
    pixels = imread(shot)[..., :3]
    assert pixels.std() > 0.05  # not blank
    # the embedded plots drew: matplotlib's blue and red lines and bars are on the screenshot
    blue = np.all(np.abs(pixels - np.array([0.12, 0.47, 0.71])) < 0.08, axis=-1).sum()
    red = np.all(np.abs(pixels - np.array([0.84, 0.15, 0.16])) < 0.08, axis=-1).sum()
    assert blue > 200 and red > 200, (blue, red)
