"""`up`'s rollout judge writes its rubrics with the run's co-evolved generator as the candidate's round left it
(dynrubric/app/loop.py: ClosedLoop._roll_out), not the one it was built with."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from dynrubric.app.loop import ClosedLoop
from dynrubric.config import Settings
from dynrubric.config_loader import override


class Writer:
    """The judge's rubric writer: the weights it will write with."""

    def __init__(self) -> None:
        self.weights: tuple[str, str] | None = None

    def use_weights(self, path: Path, version: str) -> None:
        self.weights = (str(path), version)


class Controller:
    def __init__(self, writer: Writer) -> None:
        self.writer = writer
        self.judged_with: list[tuple[str, str] | None] = []

    def start(self, version: str) -> Any:
        self.judged_with.append(self.writer.weights)
        return SimpleNamespace(id=f"ro-{version}")

    def run(self, rollout_id: str) -> Any:
        return SimpleNamespace(id=rollout_id, status="promoted", reason="", last_gate=None)


def test_each_rollout_is_judged_by_the_generator_its_round_left(tmp_path: Path):
    settings = override(Settings(), {"paths": {"state_dir": str(tmp_path)}})
    loop = ClosedLoop(settings, log=lambda _: None)
    generator = {"dir": tmp_path / "train" / "generator" / "model"}
    loop.runner = SimpleNamespace(generator_dir=lambda: generator["dir"])
    loop.judge_writer = writer = Writer()
    loop.router = SimpleNamespace(state=SimpleNamespace(replicas=[]))
    registry = SimpleNamespace(get=lambda version: SimpleNamespace(created_at=0.0))
    controller = Controller(writer)
    loop._roll_out("r1", controller, registry)
    generator["dir"] = tmp_path / "elsewhere"  # round 2's generator step moved it on
    loop._roll_out("r2", controller, registry)
    assert controller.judged_with == [
        (str(tmp_path / "train" / "generator" / "model"), "r1-generator"),
        (str(tmp_path / "elsewhere"), "r2-generator"),
    ]
