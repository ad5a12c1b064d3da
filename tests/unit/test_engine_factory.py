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
