"""The guards' evidence: a candidate policy evaluated against its parent on held-out prompts.

Both the embedded rounds and the OpenRLHF path call `evaluate_candidate` before registering:

    reward_new, reward_parent   mean score of the candidate's and the parent's K samples per held-out
                                prompt, judged together as ONE set of 2K (paired, one rubric)
    kl_to_parent, kl_to_base    per-token k3 estimate of KL(candidate || parent) and KL(candidate || base)
                                on the candidate's samples, log-probs at the sampling temperature

The judge is the frozen verifier with the previous rubric generator: the parent's weights in
single-model mode (the policy engine is switched to them before scoring), else the generator as it was
before the round. The engine versions that judged are recorded under `judge`.

    groundtruth                 the candidate, its parent and the base on the held-out prompts with ground
                                truth, no judge involved (train/policy_eval.py): pass rates, paired
                                differences with bootstrap CIs
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dynrubric.config import Settings
from dynrubric.engines.base import Completion, Engine, GenerationRequest, SamplingParams
from dynrubric.registry import Checkpoint
from dynrubric.rubric.evaluator import Evaluator
from dynrubric.train.prompts import TrainPrompt


def sample_sets(
    settings: Settings, engine: Engine, prompts: Sequence[TrainPrompt], k: int, seed: int
) -> tuple[list[str], list[list[Completion]]]:
    """(rendered prompts, K completions each) at the training sampling parameters."""
    cfg = settings.train
    texts = [engine.render_chat(p.chat()) for p in prompts]
    # one seed for the whole batch: requests with equal params are generated together
    # with the engine's own log-probs of each token: the trainer's importance weight (train.grpo.tis)
    params = SamplingParams(
        max_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        n=k,
        seed=seed,
        logprobs=cfg.grpo.tis,
    )
    return texts, engine.generate([GenerationRequest(t, params) for t in texts])


def load_frozen(model_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval().requires_grad_(False)
    return model


def evaluate_candidate(
    settings: Settings,
    *,
    candidate_dir: Path,
    candidate_version: str,
    candidate_model: Any | None,
    parent: Checkpoint,
    base: Checkpoint,
    heldout: Sequence[TrainPrompt],
    policy_engine: Engine,
    generator_engine: Engine | None,
    previous_generator: Path | None,
    verifier_engine: Engine,
    pad_id: int,
    seed: int,
) -> dict[str, Any]:
    """The guards' inputs for `candidate_dir` vs `parent`. `generator_engine` None: single-model mode
    (the policy engine at the parent's weights writes the rubrics). `candidate_model`: the candidate's
    torch model when the caller holds it (else loaded from `candidate_dir`). Leaves the policy engine
    at the weights of the last version it sampled."""
    from dynrubric.train.coevolve import completion_ids
    from dynrubric.train.grpo import SampledResponse, mean_kl

    k = settings.train.candidates
    policy_engine.load_weights(candidate_dir, candidate_version)
    texts, new = sample_sets(settings, policy_engine, heldout, k, seed)
    policy_engine.load_weights(parent.path, parent.version)
    _, old = sample_sets(settings, policy_engine, heldout, k, seed)
    if generator_engine is None:
        rubric_writer = policy_engine
    else:
        rubric_writer = generator_engine
        if previous_generator is not None:
            # named after the parent: the generator as the round that accepted the parent left it
            rubric_writer.load_weights(previous_generator, parent.version)
    judge = Evaluator(rubric_writer, verifier_engine, settings.rubric, metrics=None)
    judged_by = {"generator": rubric_writer.policy_version, "verifier": verifier_engine.policy_version}
    sets = [[c.text for c in o] + [c.text for c in n] for o, n in zip(old, new, strict=True)]
    scored = judge.score_sets([p.question for p in heldout], sets)

    tok = policy_engine.tokenizer
    rollouts = [
        SampledResponse(tuple(tok.encode(t, add_special_tokens=False)), completion_ids(c, tok))
        for t, cs in zip(texts, new, strict=True)
        for c in cs
    ]
    model = candidate_model if candidate_model is not None else load_frozen(candidate_dir)
    parent_model = load_frozen(parent.path)

    def kl_to(reference: Any) -> float:
        return mean_kl(
            model,
            reference,
            rollouts,
            settings.train.temperature,
            pad_id,
            settings.train.grpo.micro_batch_size,
            settings.train.grpo.logprob_chunk_mib,
        )

    kl_parent = kl_to(parent_model)
    if base.version == parent.version:
        kl_base = kl_parent
    else:
        del parent_model
        kl_base = kl_to(load_frozen(base.path))
    from dynrubric.train.policy_eval import round_evidence

    groundtruth = round_evidence(
        settings,
        policy_engine,
        (candidate_version, candidate_dir),
        (parent.version, parent.path),
        (base.version, base.path),
    )
    return {
        "groundtruth": groundtruth,
        "heldout_prompts": len(heldout),
        "heldout_keys": [p.key for p in heldout],
        "reward_parent": sum(sum(s.scores[:k]) / k for s in scored) / len(scored),
        "reward_new": sum(sum(s.scores[k:]) / k for s in scored) / len(scored),
        "kl_to_parent": kl_parent,
        "kl_to_base": kl_base,
        "base": base.version,
        "judge": judged_by,
        "mean_gap": sum(s.gaps.mean_abs_gap for s in scored) / len(scored),
    }
