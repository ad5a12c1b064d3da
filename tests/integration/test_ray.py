"""The round on Ray (train.executor: ray) on the tiny model: the same seed gives the same round as the
in-process executor, with the step's sets judged by a pool of two judge actors.

The task is tests/train_harness.py's (policy and rubric writer: the real tiny model in the real
TransformersEngine, inside Ray actors here; verifier: the keyword rule).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from dynrubric.train.records import RoundSummary
from tests.train_harness import runner, write_prompts

ray = pytest.importorskip("ray")

#: a small round with a policy and a generator step (k_alt=1), its sets judged in two chunks
SMALL = {
    "steps_per_round": 2,
    "prompts_per_step": 4,
    "candidates": 4,
    "max_prompts_per_round": 8,
    "heldout_prompts": 2,
    "judge_chunks": 2,
    "coevolve": {"k_alt": 1},
}


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two JSON-like values differ; floats compare to a relative 1e-5 (absolute 1e-7)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(a.keys() ^ b.keys())}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} vs {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float):
        return [] if math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7) else [f"{path}: {a} vs {b}"]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def comparable(summary: RoundSummary) -> dict[str, Any]:
    """The summary without its clock readings."""
    clocks = {"seconds", "time", "stage_seconds"}
    out = summary.model_dump(exclude=clocks | {"steps"})
    out["steps"] = [s.model_dump(exclude=clocks) for s in summary.steps]
    return out


def test_ray_rounds_equal_the_in_process_rounds(tmp_path: Path, tiny_model_dir: Path, local_ray) -> None:
    """Two rounds of one step each (a policy step, then a generator step): the second round on Ray reuses
    the first round's actors, reset to the new parent."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", 24)
    one_step = {**SMALL, "steps_per_round": 1}
    local = runner(tmp_path / "inprocess", tiny_model_dir, prompts, **one_step)
    on_ray = runner(tmp_path / "ray", tiny_model_dir, prompts, ray={"judges": 2}, executor="ray", **one_step)
    try:
        a = [local.run(), local.run()]
        b = [on_ray.run(), on_ray.run()]
    finally:
        on_ray.close()

    assert [s.steps[0].phase for s in a] == ["policy", "generator"]
    assert a[0].steps[0].sets == 4 and a[0].steps[0].tokens > 0  # the comparison covers a real update
    assert a[1].parent == ("r1" if a[0].guard.accepted else "base")
    for x, y in zip(a, b, strict=True):
        assert differences(comparable(x), comparable(y)) == []
    assert_stage_times(a, tmp_path / "inprocess")
    assert_stage_times(b, tmp_path / "ray")


def assert_stage_times(summaries: list[RoundSummary], state: Path) -> None:
    """Both executors time the same stages (the report's panel of where a round's time went): the policy
    round's judging split into rubrics and verdicts, the generator round's rubric sampling; together
    they account for the round's wall-clock time, and the run log's round records carry them."""
    from dynrubric.app.report import STAGES, read_runlog

    policy, generator = (s.stage_seconds for s in summaries)
    for stages, summary in ((policy, summaries[0]), (generator, summaries[1])):
        assert list(stages) == list(STAGES) and all(v >= 0 for v in stages.values()), stages
        assert 0.8 * summary.seconds <= sum(stages.values()) <= summary.seconds, (stages, summary.seconds)
    assert policy["candidates"] > 0 and policy["rubrics"] > 0 and policy["verdicts"] > 0 and policy["policy_update"] > 0
    assert policy["generator_rubrics"] == generator["rubrics"] == generator["verdicts"] == 0
    assert generator["candidates"] > 0 and generator["generator_rubrics"] > 0
    assert [r.stage_seconds for r in read_runlog(state / "train" / "runlog.jsonl").rounds] == [policy, generator]


def test_an_actor_uses_the_cores_the_in_process_round_would(local_ray) -> None:
    """Ray gives a worker that reserves under one CPU OMP_NUM_THREADS=1, so torch in the round's actors
    (ray.actor_cpus 0) would use one core of an otherwise idle node: the round on Ray ran 1.3x the
    in-process round on 2 cores. `use_cores` sets the threads the config asks for, else the reserved CPUs,
    else every core of the node."""
    import os

    from dynrubric.ray_cluster import use_cores

    def threads(asked: int, sharers: int = 1) -> tuple[int, int, int]:
        import torch

        before = torch.get_num_threads()
        return before, use_cores(asked, sharers), torch.get_num_threads()

    cores = len(os.sched_getaffinity(0))
    unreserved = ray.remote(num_cpus=0)(threads)
    assert ray.get(unreserved.remote(0)) == (1, cores, cores)  # Ray's one thread, then every core
    assert ray.get(unreserved.remote(3))[1:] == (3, 3)  # engine.threads wins
    share = max(1, cores // 2)
    assert ray.get(unreserved.remote(0, 2))[1:] == (share, share)  # two judges at once split the cores
    assert ray.get(ray.remote(num_cpus=1)(threads).remote(0))[1:] == (1, 1)  # the one CPU it reserved
