"""JSON-schema constrained generation: a random model writes schema-valid JSON in both engines."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from dynrubric.engines.base import GenerationRequest, SamplingParams
from dynrubric.engines.grammar import json_text
from dynrubric.engines.hf import TransformersEngine

RUBRIC_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 2,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "text": json_text(1, 30),
                    "weight": {"type": "integer", "minimum": 1, "maximum": 5},
                    "polarity": {"enum": [1, -1]},
                },
                "required": ["text", "weight", "polarity"],
            },
        }
    },
    "required": ["items"],
}
PROMPT = "<|im_start|>user\nWrite a rubric as JSON.<|im_end|>\n<|im_start|>assistant\n"


def valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), RUBRIC_SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


@pytest.fixture(scope="module")
def padded_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with 37 LM-head rows the tokenizer has no tokens for, as padded vocabularies have."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-padded")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.resize_token_embeddings(len(tokenizer) + 37, mean_resizing=False)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_random_model_writes_valid_json_only_under_the_schema(padded_model_dir):
    engine = TransformersEngine(padded_model_dir)
    assert engine.model.config.vocab_size > len(engine.tokenizer)
    schema = json.dumps(RUBRIC_SCHEMA)
    free = SamplingParams(max_tokens=60, temperature=1.0, n=20, seed=3)
    constrained = SamplingParams(max_tokens=200, temperature=1.0, top_p=0.95, n=20, seed=3, json_schema=schema,
                                 logprobs=True)  # fmt: skip
    [unconstrained, samples] = engine.generate(
        [GenerationRequest(PROMPT, free), GenerationRequest(PROMPT, constrained)]
    )

    assert sum(valid(c.text) for c in unconstrained) == 0
    assert all(isinstance(json.loads(c.text)["items"], list) for c in samples)
    # the one hole (see json_text): an overlong UTF-8 sequence decodes to three U+FFFD and can make a
    # text longer than its bound; here it hits one of the 20 samples
    assert sum(valid(c.text) for c in samples) >= 19, [c.text for c in samples if not valid(c.text)]
    assert all(c.finish_reason == "stop" for c in samples)
    assert len({c.text for c in samples}) > 10  # sampling still samples, within the grammar
    for c in samples:
        assert max(c.token_ids) < len(engine.tokenizer)
        # the logprobs are those of the masked distribution: a forced token (a closing bracket) has 0
        assert len(c.logprobs) == len(c.token_ids) and max(c.logprobs) == pytest.approx(0.0, abs=1e-6)
    # each schema is compiled once per engine
    assert list(engine.grammars()._compiled) == [schema]


def test_greedy_constrained_output_is_a_prefix_of_the_grammar(tiny_model_dir):
    """Too few tokens: the row stops at max_tokens with the JSON cut, and says so."""
    engine = TransformersEngine(tiny_model_dir)
    params = SamplingParams(max_tokens=6, temperature=0, json_schema=json.dumps(RUBRIC_SCHEMA))
    [[cut]] = engine.generate([GenerationRequest(PROMPT, params)])
    assert cut.finish_reason == "length" and len(cut.token_ids) == 6
    assert cut.text.startswith('{"items":[')


def test_invalid_schema_is_a_clear_error(tiny_model_dir):
    engine = TransformersEngine(tiny_model_dir)
    with pytest.raises(ValueError, match="json_schema is not valid JSON"):
        engine.generate([GenerationRequest(PROMPT, SamplingParams(max_tokens=4, json_schema="{items"))])


def test_json_text_refuses_bounds_xgrammar_cannot_compile():
    with pytest.raises(ValueError, match="<= 128"):
        json_text(1, 129)
