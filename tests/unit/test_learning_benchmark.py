"""benchmarks/learning.py: a loop that `up` did not finish still gets the curve of the cycles it did."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
try:
    import learning
finally:
    sys.path.pop(0)

# what a stopped `up` prints last (dynrubric/app/cli.py `_print_up`): the cycles it finished
STOPPED_UP = """interrupted: stopping users, draining, stopping every component
==== 2 cycle(s)
cycle 1: round 1 r1 candidate; rollout promoted; serving r1; registered -> canary 5.8 s
cycle 2: round 2 r2 candidate; rollout rolled back; serving r1; registered -> canary 7.5 s
"""


def test_a_stopped_loop_prints_the_curve_of_its_finished_cycles_and_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(learning, "run_loop", lambda *a, **k: (130, STOPPED_UP))
    args = argparse.Namespace(cycles=4, minutes=45.0, engine_server=None, config=None)
    with pytest.raises(SystemExit, match=r"exit 130\) after 2 finished cycle"):
        learning.one_loop(args, seed=3, state=tmp_path / "seed-3")
    out = capsys.readouterr().out
    assert "learning curve (seed 3)" in out
    assert "cycle 1: round 1 r1 (candidate; rollout promoted; serving r1)" in out
    assert "cycle 2: round 2 r2 (candidate; rollout rolled back; serving r1)" in out
    assert out.count("no ground-truth evaluation") == 2  # no round summary under this empty state dir
