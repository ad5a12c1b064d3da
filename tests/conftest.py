from __future__ import annotations

from pathlib import Path

import pytest

from tests.tinymodel import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama + byte-level BPE tokenizer, built once per test session."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


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
