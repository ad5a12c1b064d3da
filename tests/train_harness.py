"""A synthetic training task the tiny model can learn on CPU, for the round tests.

Task: responses that contain the letter KEYWORD are better. The verifier is `KeywordVerifier`, a
rule-based Engine behind the same interface as a real verifier: for a criterion that names the keyword
it answers Yes/No logprobs by checking the response, for any other criterion it is undecided (P(yes) =
1/2). The tiny random model cannot judge, which is why the verifier is a rule here; the policy and the
rubric generator are the real tiny model through the real TransformersEngine, and the generator's
(unparseable) rubrics go through the real fallback ladder to the configured generic rubric, whose first
item names the keyword.

Run as a script (`python -m tests.train_harness STATE_DIR MODEL_DIR PROMPTS ROUNDS`) it trains in a
separate process, so that a test can kill -9 it.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path

from dynrubric.config import Settings
from dynrubric.engines.base import Completion, Engine, GenerationRequest
from dynrubric.rubric.verify import CRITERION_MARK

KEYWORD = "u"
CRITERION = f"The response contains the letter '{KEYWORD}'."


class KeywordVerifier(Engine):
    def __init__(self, model_dir: Path):
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.policy_version = "keyword-rule"

    @property
    def tokenizer(self):
        return self._tokenizer

    @staticmethod
    def judge(prompt: str) -> float | None:
        response = prompt.split("\n\nResponse:\n", 1)[1].split(CRITERION_MARK, 1)[0]
        criterion = prompt.split(CRITERION_MARK, 1)[1].split("\n", 1)[0]
        if f"'{KEYWORD}'" not in criterion:
            return None
        return 0.97 if KEYWORD in response else 0.03

    def score_next_token(self, prompts: Sequence[str], candidates: Sequence[str]) -> list[dict[str, float]]:
        out = []
        for p in prompts:
            v = self.judge(p)
            p_yes = 0.5 if v is None else v
            out.append({c: math.log(p_yes if c.strip().lower() == "yes" else 1.0 - p_yes) for c in candidates})
        return out

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Completion]]:
        answers = []
        for r in requests:
            v = self.judge(r.prompt)
            answers.append([Completion("Yes" if v and v > 0.5 else "No", (), "stop")] * r.params.n)
        return answers

    def load_weights(self, path: Path, version: str) -> None:
        raise NotImplementedError("the keyword verifier has no weights")


def engines(role: str, model_dir: Path) -> Engine:
    if role == "verifier":
        return KeywordVerifier(model_dir)
    from dynrubric.engines.hf import TransformersEngine

    return TransformersEngine(model_dir, max_batch_size=64)


def settings(
    state_dir: Path, model_dir: Path, prompts_file: Path, ray: dict | None = None, rubric: dict | None = None, **train
) -> Settings:
    """Small settings for the task (measured: ~2 min per round on the shared 2-core machine at load 17),
    with the guards at their defaults; `rubric` and `train` (keyword arguments) change their sections' keys."""
    train_cfg = {
        "prompts_file": str(prompts_file),
        "candidates": 8,
        "prompts_per_step": 8,
        "steps_per_round": 8,
        "max_prompts_per_round": 16,
        "heldout_prompts": 8,
        "heldout_share": 0.25,
        "max_new_tokens": 8,
        # many small steps and a strong pull toward the base: the guard's default per-round KL bound
        # (0.05 per token) leaves little room, and noise, not signal, is what large steps add
        "grpo": {"lr": 4e-4, "kl_beta": 2.0, "micro_batch_size": 32},
        "coevolve": {"k_alt": 50, "rubric_samples": 2, "sets_per_step": 2, "generator_max_tokens": 16},
    }
    for key, value in train.items():
        if isinstance(value, dict):
            train_cfg[key] = {**train_cfg.get(key, {}), **value}
        else:
            train_cfg[key] = value
    return Settings.model_validate(
        {
            "paths": {"state_dir": str(state_dir), "home": str(state_dir / "home")},
            "models": {"policy": str(model_dir), "generator": str(model_dir), "verifier": str(model_dir)},
            "rubric": {
                "mode": "prompt_only",
                # the anchors meet this task's criterion (the off-topic one says "full", the echo "about"), so
                # an anchor outranks every candidate without a 'u': exactly the sets this task learns from
                "trust_rule": "best",
                "retries": 0,
                "prompt_only_retries": 0,
                "generator_max_tokens": 16,
                "generic_rubric": [
                    {"text": CRITERION, "weight": 3},
                    {"text": "The response is polite.", "weight": 1},
                ],
            }
            | (rubric or {}),
            "train": train_cfg,
            # the ground-truth evaluation of every version: a few of the bank's held-out prompts, short answers
            "evaluation": {"max_prompts": 8, "max_tokens": 8, "report_prompts": 4},
            "ray": ray or {},
        }
    )


def write_prompts(path: Path, n: int) -> Path:
    import json

    topics = ["the sea", "a fox", "numbers", "colours", "the sky", "music", "bread", "trains"]
    path.write_text(
        "".join(
            json.dumps({"prompt": f"Say something short about {topics[i % len(topics)]} (#{i})."}) + "\n"
            for i in range(n)
        )
    )
    return path


def runner(
    state_dir: Path,
    model_dir: Path,
    prompts_file: Path,
    ray: dict | None = None,
    progress=None,
    rubric: dict | None = None,
    **train,
):
    from dynrubric.registry import open_registry
    from dynrubric.train.prompts import JsonlPromptSource
    from dynrubric.train.rounds import RoundRunner, response_history

    s = settings(state_dir, model_dir, prompts_file, ray, rubric, **train)
    return RoundRunner(
        s, open_registry(s), JsonlPromptSource(prompts_file, response_history(s)), engines, progress=progress
    )


class PrintedPhases:
    """A round's progress as lines on stdout (`start evaluate`), flushed: what a test can wait for."""

    @staticmethod
    def start(phase: str, total: int) -> None:
        print(f"start {phase}", flush=True)

    @staticmethod
    def advance(phase: str, n: int) -> None:
        pass

    @staticmethod
    def note(text: str) -> None:
        print(text, flush=True)


def keyword_rate(model_dir: Path, prompts: Sequence[str], n: int, seed: int) -> float:
    """Share of sampled responses (n per prompt, temperature 1) that contain the keyword."""
    from dynrubric.engines.base import SamplingParams
    from dynrubric.engines.hf import TransformersEngine

    engine = TransformersEngine(model_dir, max_batch_size=64)
    params = SamplingParams(max_tokens=8, temperature=1.0, n=n, seed=seed)
    outs = engine.generate(
        [GenerationRequest(engine.render_chat([{"role": "user", "content": p}]), params) for p in prompts]
    )
    texts = [c.text for cs in outs for c in cs]
    return sum(KEYWORD in t for t in texts) / len(texts)


if __name__ == "__main__":
    state, model, prompts, rounds = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    r = runner(state, model, prompts, progress=PrintedPhases())
    while len(r.completed_rounds()) < rounds:
        summary = r.run()
        print(f"round {summary.round} -> {summary.version} {summary.state}", flush=True)
