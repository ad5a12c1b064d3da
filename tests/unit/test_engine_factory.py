"""Which weights the engines of `engine_factory` (dynrubric/app/train_commands.py) load on shared servers
(`engine.shared_servers`): each role on a server that a trained role reloads serves its own, the frozen verifier's
included; a verifier alone on its server loads nothing (it may lack the dev-mode reload endpoint)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dynrubric.app.train_commands import engine_factory
from dynrubric.config import Settings
from dynrubric.config_loader import override


class FakeEngine:
    """An OpenAIHTTPEngine that talks to no server: the weights it was made to load."""

    def __init__(self, url: str, model_dir: Path, **kw: Any) -> None:
        self.url, self.shared, self.loaded = url, kw.get("shared"), []
        self.concurrency = kw.get("concurrency")

    def load_weights(self, path: Path, version: str) -> None:
        self.loaded.append(str(path))


@pytest.fixture
def fake_http(monkeypatch: pytest.MonkeyPatch) -> None:
    import dynrubric.engines.http

    monkeypatch.setattr(dynrubric.engines.http, "OpenAIHTTPEngine", FakeEngine)


def settings(**engine: Any) -> Settings:
    return override(Settings(), {"engine": {"kind": "openai-http", "shared_servers": True} | engine})


def test_a_verifier_on_the_server_a_trained_role_reloads_loads_its_own_weights(fake_http: None) -> None:
    make = engine_factory(settings(base_url="http://127.0.0.1:1"))
    policy, verifier = make("policy", Path("/policy")), make("verifier", Path("/verifier"))
    assert policy.shared is verifier.shared is not None  # type: ignore[attr-defined]
    assert policy.loaded == ["/policy"] and verifier.loaded == ["/verifier"]  # type: ignore[attr-defined]


def test_a_verifier_alone_on_its_server_loads_nothing(fake_http: None) -> None:
    make = engine_factory(settings(base_url="http://127.0.0.1:1", verifier_url="http://127.0.0.1:2"))
    verifier = make("verifier", Path("/verifier"))
    assert verifier.loaded == []  # type: ignore[attr-defined]


@pytest.fixture
def fake_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    import dynrubric.engines.hf

    monkeypatch.setattr(dynrubric.engines.hf, "TransformersEngine", lambda model_dir, **kw: FakeEngine("", model_dir))


def test_the_judges_engines_go_where_each_role_is_configured(
    fake_http: None, fake_in_process: None, tmp_path: Path
) -> None:
    """`build_engine`/`judge_engines` (score, eval-judge, serve-reward, the rollout judge): each role on its own
    server (`engine.<role>_url`) or in process (`engine.in_process`). They used `engine.base_url` for every role, so
    a generator served apart from its verifier (a trained generator beside the frozen base) judged with one model."""
    from dynrubric.engines import judge_engines

    (tmp_path / "config.json").write_text("{}")  # a local model dir, as the model cache resolves one
    same = {"models": {"generator": str(tmp_path), "verifier": str(tmp_path)}}
    one = override(settings(base_url="http://127.0.0.1:1"), same)
    generator, verifier = judge_engines(one)
    assert generator is verifier and generator.url == "http://127.0.0.1:1"  # type: ignore[attr-defined]
    apart = override(one, {"engine": {"generator_url": "http://127.0.0.1:2"}})
    generator, verifier = judge_engines(apart)
    assert generator is not verifier
    assert (generator.url, verifier.url) == ("http://127.0.0.1:2", "http://127.0.0.1:1")  # type: ignore[attr-defined]
    local = override(one, {"engine": {"in_process": ["verifier"]}})
    generator, verifier = judge_engines(local)
    assert (generator.url, verifier.url) == ("http://127.0.0.1:1", "")  # type: ignore[attr-defined]


def test_every_server_engine_keeps_engine_concurrency_requests_in_flight(fake_http: None, tmp_path: Path) -> None:
    """`engine.concurrency` reaches the rounds' engines and the judges' (benchmarks/round_time.py: a round with 64
    in flight instead of a fixed 16 fills more of vLLM's batch)."""
    from dynrubric.engines import build_engine

    (tmp_path / "config.json").write_text("{}")
    s = override(settings(base_url="http://127.0.0.1:1", concurrency=48), {"models": {"generator": str(tmp_path)}})
    assert engine_factory(s)("policy", Path("/policy")).concurrency == 48  # type: ignore[attr-defined]
    assert build_engine(s, "generator").concurrency == 48  # type: ignore[attr-defined]
