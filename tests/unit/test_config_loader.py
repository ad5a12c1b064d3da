"""The settings' sources and their order (dynrubric/config_loader.py): schema defaults < profile < -c files in
order < DYNRUBRIC_* environment; profiles shipped as files; settings frozen once loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import SecretStr, ValidationError

from dynrubric.config_loader import PROFILES_DIR, load_settings, override, profile_names
from dynrubric.errors import DynrubricError


def write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def test_each_source_overrides_the_one_before(tmp_path):
    """train.grpo.lr: 1e-6 by default, 5e-5 in the demo profile, then the -c files in order, then the environment."""
    first = write(tmp_path / "first.yaml", {"train": {"grpo": {"lr": 1e-4}, "steps_per_round": 3}})
    second = write(tmp_path / "second.yaml", {"train": {"grpo": {"lr": 2e-4}}})

    def lr(files: list[Path], environ: dict[str, str], profile: str = "demo") -> float:
        return load_settings(files, environ, profile).train.grpo.lr

    assert lr([], {}, "production") == 1e-6
    assert lr([], {}) == 5e-5
    assert lr([first], {}) == 1e-4
    assert lr([first, second], {}) == 2e-4
    assert lr([second, first], {}) == 1e-4
    assert lr([first, second], {"DYNRUBRIC_TRAIN__GRPO__LR": "3e-4"}) == 3e-4
    # key by key: a later source leaves the keys it does not name as the earlier ones set them
    layered = load_settings([first, second], {}, "demo")
    assert layered.train.steps_per_round == 3 and layered.train.grpo.clip_high == 0.28  # first's; the profile's


def test_without_c_the_file_named_by_dynrubric_config_goes_over_the_profile(tmp_path):
    cfg = write(tmp_path / "c.yaml", {"gate": {"min_users_per_arm": 7}})
    s = load_settings(None, {"DYNRUBRIC_CONFIG": str(cfg)}, "demo")
    assert s.gate.min_users_per_arm == 7 and s.gate.promote_on == ["judged"]


def test_an_unknown_profile_names_the_option_and_the_choices():
    with pytest.raises(DynrubricError) as e:
        load_settings(environ={}, profile="staging")
    assert str(e.value) == "unknown profile 'staging' (--profile) -> use one of: demo, production"


def test_every_shipped_profile_is_valid_and_production_is_the_schema_defaults():
    from dynrubric.config import Settings

    assert profile_names() == sorted(p.stem for p in PROFILES_DIR.glob("*.yaml")) == ["demo", "production"]
    for name in profile_names():
        load_settings(environ={}, profile=name)
    assert load_settings(environ={}, profile="production") == Settings.model_validate({})


def test_loaded_settings_refuse_assignment_and_override_makes_a_new_object():
    """Nothing changes the settings a command loaded (the loop used to write its broker address and token into
    them): an assignment fails, at any depth; a derived configuration is a new, validated object."""
    s = load_settings(environ={}, profile="demo")
    with pytest.raises(ValidationError, match="frozen"):
        s.kafka.bootstrap_servers = "elsewhere:9092"  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        s.train.grpo.lr = 1.0  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        s.train = s.train  # type: ignore[misc]
    token = SecretStr("t0ken")
    derived = override(s, {"kafka": {"bootstrap_servers": "elsewhere:9092"}, "serving": {"token": token}})
    assert derived.kafka.bootstrap_servers == "elsewhere:9092" and derived.serving.token == token
    assert s.kafka.bootstrap_servers == "127.0.0.1:9092" and s.serving.token is None
    assert derived.train == s.train  # the keys it does not name stay
    with pytest.raises(DynrubricError, match="config key 'loop.drill_cycle'"):
        override(s, {"loop": {"drill_cycle": 0}})


def test_the_loop_runtime_leaves_the_loaded_settings_as_they_were():
    """`dynrubric up`'s start-up values (the broker it started, a generated token, the ports it picked) are the
    components' settings, not the loaded ones."""
    from dynrubric.app.loop import LoopRuntime

    loaded = load_settings(environ={"DYNRUBRIC_SERVING__PORT": "0"}, profile="demo")
    before = loaded.model_dump()
    runtime = LoopRuntime(
        bootstrap_servers="127.0.0.1:40001", control_token=SecretStr("t"), router_port=40002, ingest_metrics_port=40003
    )
    s = runtime.component_settings(loaded)
    assert (s.kafka.bootstrap_servers, s.serving.port, s.ingest.metrics_port) == ("127.0.0.1:40001", 40002, 40003)
    assert s.serving.token == SecretStr("t") and s.train.prompt_source == "replay"
    assert s.train == loaded.train.model_copy(update={"prompt_source": "replay"})
    assert loaded.model_dump() == before and loaded.serving.port == 0


@pytest.mark.parametrize(
    ("old", "value", "new"),
    [
        ("rubric.anchors", False, "rubric.calibration_answers"),
        ("train.coevolve.anchors", "temporal", "train.coevolve.ranking_source"),
        ("train.coevolve.anchors_file", "ranked.jsonl", "train.coevolve.rankings_file"),
        ("train.coevolve.anchor_lambda", 0.5, "train.coevolve.ranking_weight"),
    ],
)
def test_a_renamed_key_is_an_error_naming_its_new_name(tmp_path, old, value, new):
    """ "anchor" named three things (calibration answers, the generator's ranked lists, path resolution); a config
    written with an old name fails with the new one, in a file and in the environment."""
    data: dict = {}
    *sections, key = old.split(".")
    node = data
    for section in sections:
        node = node.setdefault(section, {})
    node[key] = value
    with pytest.raises(DynrubricError) as e:
        load_settings(write(tmp_path / "old.yaml", data), {})
    assert f"config key '{old}' was renamed to '{new}'" in str(e.value)
    env = "DYNRUBRIC_" + old.replace(".", "__").upper()
    with pytest.raises(DynrubricError) as e:
        load_settings(None, {env: str(value)})
    assert f"{env} sets '{old}', which was renamed to '{new}'" in str(e.value)
    assert "DYNRUBRIC_" + new.replace(".", "__").upper() in str(e.value)


def test_a_fleet_engine_kind_is_an_error_naming_server(tmp_path):
    """`engine.kind` says how a command reaches its models; a fleet engine's server program is `server`."""
    engines = [{"name": "e0", "variant": "stable", "kind": "transformers", "port": 8301}]
    with pytest.raises(DynrubricError) as e:
        load_settings(write(tmp_path / "old.yaml", {"serving": {"engines": engines}}), {})
    assert "config key 'serving.engines.0.kind' was renamed to 'serving.engines[].server'" in str(e.value)
    engines[0]["server"] = engines[0].pop("kind")
    assert load_settings(write(tmp_path / "new.yaml", {"serving": {"engines": engines}}), {}).serving.engines[0].server


def test_an_engine_has_a_loopback_port_or_a_url():
    """serving.engines: a local engine the fleet starts (port), or a Service the router calls (url; issue 37)."""
    from dynrubric.config import FleetEngineConfig

    assert FleetEngineConfig(name="e", port=8301).base_url == "http://127.0.0.1:8301"
    assert FleetEngineConfig(name="e", url="http://vllm-stable:8000/").base_url == "http://vllm-stable:8000"
    for both_or_none in ({}, {"port": 8301, "url": "http://vllm-stable:8000"}):
        with pytest.raises(ValueError, match="give a port .* or a url"):
            FleetEngineConfig(name="e", **both_or_none)


def kubernetes_service_env(service: str, ip: str, port: int, port_name: str | None = "http") -> dict[str, str]:
    """What the kubelet puts in a pod's environment for a Service of its namespace (enableServiceLinks)."""
    name = service.upper().replace("-", "_")
    env = {
        f"{name}_SERVICE_HOST": ip,
        f"{name}_SERVICE_PORT": str(port),
        f"{name}_PORT": f"tcp://{ip}:{port}",
        f"{name}_PORT_{port}_TCP": f"tcp://{ip}:{port}",
        f"{name}_PORT_{port}_TCP_PROTO": "tcp",
        f"{name}_PORT_{port}_TCP_PORT": str(port),
        f"{name}_PORT_{port}_TCP_ADDR": ip,
    }
    if port_name:
        env[f"{name}_SERVICE_PORT_{port_name.upper().replace('-', '_')}"] = str(port)
    return env


def test_the_variables_kubernetes_sets_for_the_namespaces_services_are_no_settings():
    """A pod in a namespace with the Service dynrubric-router gets DYNRUBRIC_ROUTER_SERVICE_HOST, DYNRUBRIC_ROUTER_PORT
    and the rest of that family: every dynrubric container started with `unknown environment variable
    DYNRUBRIC_ROUTER_PORT` (found by tests/e2e/test_k8s_processes.py, whose kubelet sets them)."""
    env = {
        **kubernetes_service_env("dynrubric-router", "10.96.0.10", 8200),
        **kubernetes_service_env("dynrubric-kafka-bootstrap", "10.96.0.11", 9092, port_name="tcp-clients"),
        **kubernetes_service_env("dynrubric-reward-server", "10.96.0.12", 8100),
        "DYNRUBRIC_SERVING__PORT": "8201",
    }
    s = load_settings(environ=env)
    assert s.serving.port == 8201 and s.reward_server.port == 8100
    # a typo is still an error, even beside the Services' variables
    for typo in ("DYNRUBRIC_SERVING_PORT", "DYNRUBRIC_ROUTER_PORTS", "DYNRUBRIC_ROUTER__PORT"):
        with pytest.raises(DynrubricError, match=f"unknown environment variable {typo}"):
            load_settings(environ=env | {typo: "1"})
    # without its _SERVICE_HOST a _PORT variable is not a Service's
    with pytest.raises(DynrubricError, match="unknown environment variable DYNRUBRIC_ROUTER_PORT"):
        load_settings(environ={"DYNRUBRIC_ROUTER_PORT": "tcp://10.96.0.10:8200"})
