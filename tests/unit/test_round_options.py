"""What a round starts from and what it trains on, by its options (issue 38): the KL reference and the AdamW state
carried across rounds (`grpo.kl_reference`, `grpo.optimizer_across_rounds`), set up as a real round sets them up on
the tiny model (no step is trained)."""

from __future__ import annotations

from pathlib import Path

import torch

from dynrubric.jsonl import split_lines
from dynrubric.train.executor import InProcess
from dynrubric.train.grpo import CandidateSet, GRPOTrainer, SampledResponse, load_policy, load_reference
from dynrubric.train.rounds import OPTIMIZER, Quiet, RoundRunner, _Round, plan_line
from tests.tinymodel import build_tiny_model
from tests.train_harness import engines, runner, write_prompts


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()


def same_weights(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())


def trained_step_dir(r: RoundRunner, model_dir: Path, out: Path, updates: int) -> Path:
    """A published step's `policy/` as a round on `model_dir` leaves it after `updates` AdamW updates."""
    cfg = r.cfg.grpo
    trainer = GRPOTrainer(load_policy(model_dir, cfg), load_reference(model_dir, cfg), cfg, 0, r.settings.rubric.eps)
    prompt = (1, 5, 9, 13)
    batch = [CandidateSet(tuple(SampledResponse(prompt, (20 + i, 30 + i)) for i in range(4)), (1.0, 0.5, 0.2, 0.0))]
    for _ in range(updates):
        assert trainer.step(batch).updated
    trainer.save(out / "policy")
    return out


def round_2_on_r1(tmp_path: Path, tiny_model_dir: Path, **grpo) -> tuple[RoundRunner, Path]:
    """A run whose round 1 made r1 (other weights than the base) and, with carry, kept its AdamW state of 3 updates."""
    parent_dir = build_tiny_model(tmp_path / "r1-weights", seed=1)
    prompts = write_prompts(tmp_path / "prompts.jsonl", 24)
    r = runner(tmp_path / "state", tiny_model_dir, prompts, grpo=grpo)
    base = r.ensure_base()
    r.registry.register(parent_dir, parent="base", round=1, metrics={"guard": "accepted"}, version="r1")
    r.keep_optimizer(1, trained_step_dir(r, parent_dir, tmp_path / "r1-step", 3), base)
    return r, parent_dir


def test_a_round_carries_the_parents_adamw_state_and_takes_the_parent_as_kl_reference(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """`grpo.optimizer_across_rounds: carry`: round 2's trainer starts from the AdamW state round 1 ended with (its step
    counter goes on at 3); `grpo.kl_reference: parent`: its reference weights are r1's, not the base's. The plan
    names both, so a resumed round starts from the same."""
    r, parent_dir = round_2_on_r1(tmp_path, tiny_model_dir, kl_reference="parent", optimizer_across_rounds="carry")
    plan = r.make_plan(2)
    assert plan["parent"] == "r1" and plan["kl_reference"] == "r1"
    assert plan["optimizer_from"] == str(r.round_dir(1) / OPTIMIZER)
    rnd = _Round(r, 2, InProcess(r.settings, engines), r.metrics, r.evaluator_metrics, Quiet())
    try:
        rnd.setup()
        policy = rnd.loaded().trainers.policy
        assert policy.updates == 3
        assert same_weights(policy.ref_model, weights(r.registry.get("r1").path))
        assert not same_weights(policy.ref_model, weights(tiny_model_dir))
    finally:
        rnd.close()


def test_by_default_a_round_starts_a_fresh_adamw_and_pulls_toward_the_base(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Today's behaviour, the defaults: nothing is kept for the next round, its AdamW starts at step 0 and its KL
    reference is the lineage's base."""
    r, _ = round_2_on_r1(tmp_path, tiny_model_dir)
    assert not (r.round_dir(1) / OPTIMIZER).exists()
    plan = r.make_plan(2)
    assert plan["kl_reference"] == "base" and plan["optimizer_from"] is None
    rnd = _Round(r, 2, InProcess(r.settings, engines), r.metrics, r.evaluator_metrics, Quiet())
    try:
        rnd.setup()
        policy = rnd.loaded().trainers.policy
        assert policy.updates == 0 and same_weights(policy.ref_model, weights(tiny_model_dir))
    finally:
        rnd.close()


def test_only_the_newest_accepted_round_and_its_parents_adamw_states_are_kept(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Each state is about twice the policy's weights: an accepted round keeps its own and its parent's (which the
    next round builds on again if the gate rolls this one back), and drops the older ones."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", 8)
    r = runner(tmp_path / "state", tiny_model_dir, prompts, grpo={"optimizer_across_rounds": "carry"})
    base = r.ensure_base()
    step = trained_step_dir(r, tiny_model_dir, tmp_path / "step", 1)
    r.keep_optimizer(1, step, base)
    r1 = r.registry.register(tiny_model_dir, parent="base", round=1, metrics={"guard": "accepted"}, version="r1")
    r.keep_optimizer(2, step, r1)
    r2 = r.registry.register(tiny_model_dir, parent="r1", round=2, metrics={"guard": "accepted"}, version="r2")
    r.keep_optimizer(3, step, r2)
    kept = sorted(p.parent.name for p in (r.run_dir / "rounds").glob(f"*/{OPTIMIZER}"))
    assert kept == ["0002", "0003"]
    assert r.carried_optimizer(r2) == r.round_dir(2) / OPTIMIZER and r.carried_optimizer(base) is None


def test_carrying_adamw_across_rounds_is_refused_with_lora() -> None:
    """Each LoRA round trains a new adapter on the merged parent: carried moments would belong to other parameters."""
    import pytest
    from pydantic import ValidationError

    from dynrubric.config import GRPOConfig

    with pytest.raises(ValidationError, match="lora_rank 0"):
        GRPOConfig(optimizer_across_rounds="carry", lora_rank=4)
    assert GRPOConfig(optimizer_across_rounds="carry").lora_rank == 0


def test_a_round_needs_distinct_new_prompts_for_half_its_sets_and_is_refused_with_fewer(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """`train.min_new_prompts_per_set` 0.5 (the demo's): a round of 4 policy steps x 4 sets needs 8 distinct new
    training prompts (held-out and dev/test ones do not count). With fewer its plan is refused, naming the count and
    the keys, and nothing is consumed; once enough are logged the plan records the count, the report prints it."""
    import json

    import pytest

    from dynrubric.errors import DynrubricError

    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 6)
    train = {"prompts_per_step": 4, "steps_per_round": 4, "heldout_share": 0.2, "min_new_prompts_per_set": 0.5}
    r = runner(tmp_path / "state", tiny_model_dir, prompts, **train)
    r.ensure_base()
    short = r.new_prompts(1)
    assert short.needed == 8 and short.sets == 16 and short.distinct < 8 and not short.enough
    with pytest.raises(DynrubricError, match=rf"{short.distinct} distinct new prompts .* fewer than the 8") as e:
        r.make_plan(1)
    assert "min_new_prompts_per_set" in e.value.problem + e.value.fix
    assert not (r.round_dir(1) / "plan.json").exists()
    # the same prompt logged twice counts once
    lines = split_lines(prompts.read_text())
    prompts.write_text(
        "\n".join([*lines, lines[-1], *(json.dumps({"prompt": f"Name a colour (#{i})."}) for i in range(8))])
    )
    plan = r.make_plan(1)
    assert plan["new_prompts"] == len({p["key"] for p in plan["prompts"]}) >= 8 and plan["new_prompts_needed"] == 8
    assert "distinct new prompts to train on (at least 8)" in plan_line(plan)
    # off (the default): any number will do
    assert runner(tmp_path / "other", tiny_model_dir, prompts, prompts_per_step=4).new_prompts(1).needed == 1


def test_the_loop_waits_until_the_round_has_the_distinct_prompts_it_needs(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch
) -> None:
    """`dynrubric up` waits (users keep sending prompts), where a round planned on too few would be refused: past
    loop.min_new_prompts raw prompts it waits on the round's own count, and says so."""
    from types import SimpleNamespace

    import streaming.store
    from dynrubric.app.loop import ClosedLoop
    from dynrubric.train.prompts import JsonlPromptSource, ResponseHistory

    prompts = tmp_path / "prompts.jsonl"
    train = {"prompts_per_step": 4, "steps_per_round": 4, "heldout_share": 0.2, "min_new_prompts_per_set": 0.5}
    r = runner(tmp_path / "state", tiny_model_dir, prompts, **train)
    logged = [0]

    def arrive(n: int) -> None:  # the users' traffic: n more distinct prompts logged
        logged[0] += n
        write_prompts(prompts, logged[0])

    arrive(4)
    monkeypatch.setattr(
        streaming.store, "replay_prompt_source", lambda s: JsonlPromptSource(prompts, ResponseHistory(tmp_path / "h"))
    )

    def wait(seconds: float) -> None:
        assert logged[0] < 40, "still waiting with 40 distinct prompts logged"
        arrive(3)

    monkeypatch.setattr("dynrubric.app.loop.time.sleep", wait)
    lines: list[str] = []
    loop = SimpleNamespace(
        settings=r.settings.model_copy(update={"loop": r.settings.loop.model_copy(update={"min_new_prompts": 4})}),
        supervisor=SimpleNamespace(check_alive=lambda: None),
        log=lines.append,
        dir=tmp_path,
    )
    ClosedLoop._wait_for_prompts(loop, r, 1)  # type: ignore[arg-type]
    assert r.new_prompts(1).enough and lines[-1].startswith("cycle 1: ")
    assert lines[-1].endswith("the round needs 8") and "distinct to train on" in lines[-1]
    assert any(line.startswith("cycle 1: waiting for new prompts (") and "the round needs 8" in line for line in lines)
