from __future__ import annotations

import json

import pytest

from dynrubric import atomic, modelcache
from dynrubric.errors import DynrubricError


def test_resolve_accepts_a_model_dir(tiny_model_dir):
    assert modelcache.resolve(tiny_model_dir.parent, str(tiny_model_dir)) == tiny_model_dir


def test_resolve_unknown_reference(tmp_path):
    with pytest.raises(DynrubricError, match="neither a known model"):
        modelcache.resolve(tmp_path, str(tmp_path / "nope"))


def test_half_built_cache_entry_is_not_ready(tmp_path):
    (modelcache.models_dir(tmp_path) / "smollm2-135m").mkdir(parents=True)
    with pytest.raises(DynrubricError, match="models prepare"):
        modelcache.resolve(tmp_path, "smollm2-135m")


def test_atomic_directory_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "ckpt"
    with pytest.raises(RuntimeError), atomic.directory(target) as tmp:
        (tmp / "weights").write_bytes(b"half")
        raise RuntimeError("crash mid-write")
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_cached_smollm_is_clean_for_vllm(smollm_dir):
    config = json.loads((smollm_dir / "config.json").read_text())
    assert "quantization_config" not in config  # vLLM refuses a leftover gguf quantization_config
    assert modelcache.is_ready(smollm_dir)
    assert "Paris" in modelcache.greedy_answer(smollm_dir, "What is the capital of France?")
