from __future__ import annotations

from pathlib import Path

import pytest

from tests.tinymodel import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama + byte-level BPE tokenizer, built once per test session."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
