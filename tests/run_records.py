"""Run records (dynrubric/train/records.py) for tests: every field filled with a plausible value, the ones a test
cares about passed in. Built through the models, so a record a test writes is one the trainer could write."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dynrubric.train.records import (
    Collapse,
    Comparison,
    Evaluation,
    Fallbacks,
    Figure,
    GeneratorStep,
    Guard,
    PolicyStep,
    RoundSummary,
    RunLogFile,
    RunLogLine,
    TruthEvidence,
    round_line,
    step_line,
)

GRPO = {
    "time": 1_795_000_000.0,
    "stage_seconds": {"candidates": 1.0, "update": 1.0},
    "loss": 0.1,
    "pg_loss": 0.1,
    "kl": 0.0,
    "clip_ratio": 0.0,
    "grad_norm": 1.0,
    "reward_mean": 0.5,
    "sets": 4,
    "no_gradient_sets": 0,
    "samples": 16,
    "tokens": 256,
    "updated": True,
    "nonfinite": False,
    "updates": 1,
    "sampler_tokens": 0,
    "sampler_log_ratio": None,
    "sampler_capped": None,
}


def policy_step(step: int, **fields: Any) -> PolicyStep:
    defaults = {
        **GRPO,
        "mean_gap": 0.2,
        "tie_rate": 0.1,
        "nonsplit_share": 0.5,
        "untrusted_sets": 0,
        "set_scores": [],
        "rubric_sources": {"set": 4, "prompt_only": 0, "generic": 0},
        "fallbacks": Fallbacks(parse_failures=0, prompt_only=0, generic=0, hard_verdict=0),
        "collapse": False,
    }
    return PolicyStep.model_validate({**defaults, "step": step, **fields})


def generator_step(step: int, **fields: Any) -> GeneratorStep:
    defaults = {
        **GRPO,
        "gen_sets": 4,
        "gen_rubrics": 16,
        "gen_parsed": 16,
        "gen_anchored_sets": 4,
        "gen_r_disc_mean": 0.3,
        "gen_r_anchor_mean": 0.2,
        "gen_user_ranked_sets": 0,
        "gen_judge_user_pairs": 0,
        "gen_judge_user_agreement": None,
    }
    return GeneratorStep.model_validate({**defaults, "step": step, **fields})


def comparison(version: str = "r1", reference: str = "base", delta: float = 0.06) -> Comparison:
    return Comparison(
        version=version, reference=reference, prompts=200, delta=delta, low=delta - 0.05, high=delta + 0.05
    )


def truth(version: str = "r1", rates: dict[str, float] | None = None) -> TruthEvidence:
    rates = rates or {version: 0.42, "base": 0.36}
    return TruthEvidence(
        version=version,
        prompts=200,
        pass_rate=rates,
        pass_rate_by_kind={v: {"arithmetic": r} for v, r in rates.items()},
        vs_parent=comparison(version),
        vs_base=comparison(version),
        figures={
            "test_unseen": Figure(
                prompts=95,
                score={version: 0.3, "base": 0.25},
                vs_parent=comparison(version),
                vs_base=comparison(version),
            )
        },
    )


def evaluation(**fields: Any) -> Evaluation:
    defaults = {
        "groundtruth": truth(),
        "heldout_prompts": 8,
        "heldout_keys": [f"{i:016x}" for i in range(8)],
        "reward_parent": 0.4,
        "reward_new": 0.55,
        "kl_to_parent": 0.001,
        "kl_to_base": 0.001,
        "base": "base",
        "judge": {"generator": "base", "verifier": "base"},
        "mean_gap": 0.2,
    }
    return Evaluation.model_validate({**defaults, **fields})


def round_summary(round_id: int, steps: list[PolicyStep | GeneratorStep], **fields: Any) -> RoundSummary:
    defaults = {
        "round": round_id,
        "parent": "base",
        "version": f"r{round_id}",
        "state": "candidate",
        "guard": Guard(accepted=True, reason=None, detail="within bounds"),
        "eval": evaluation(),
        "refresh": None,
        "collapse": Collapse(fired=False, note=None),
        "watermark_before": None,
        "watermark_after": "8",
        "prompts": 8,
        "metrics": {},
        "phases": {p: sum(s.phase == p for s in steps) for p in ("policy", "generator")},
        "seconds": 10.0,
        "stage_seconds": {"setup": 1.0},
        "steps": steps,
    }
    return RoundSummary.model_validate({**defaults, **fields})


def write_runlog(path: Path, summaries: list[RoundSummary]) -> Path:
    """The run log the trainer leaves after `summaries`: each round's steps, then the round."""
    lines: list[RunLogLine] = []
    for summary in summaries:
        lines += [step_line(summary.round, s) for s in summary.steps]
        lines.append(round_line(summary))
    RunLogFile(path).append(lines)
    return path
