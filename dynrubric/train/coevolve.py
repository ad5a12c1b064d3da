"""Evaluator co-evolution: the rubric generator's reward, its anchors, and one generator GRPO batch.

For a candidate set C of the current policy the generator samples R rubrics (same set-conditioned
prompt as the evaluator uses). Each sampled rubric r gets three rewards (ARCHITECTURE section 2):

    R_disc(r)   = sum_m w_m Var_C(v_m) / sum_m w_m              how much its items split C, with
                  Var_C(v_m) = mean_i (v_mi - vbar_m)^2         v_mi = P(yes) of item m for candidate i
    R_anchor(r) = sum_{i<j} log sigmoid(S_i - S_j) / ((j - i) 2^(i-1))
                  with S the scores r gives a ranked anchor list (best first, i and j 1-based)
    R_format(r) = 1 when it parses into a valid rubric, else 0

and they are combined at the advantage level: A = norm(R_disc) + lambda norm(R_anchor) +
format_weight norm(R_format), each normalised within the R samples of the set, and zero when its
spread is below the rubric's tie threshold `rubric.eps` (engine noise is not a signal). A rubric that
does not parse gets R_disc = 0 and the worst R_anchor of its group.

R_disc is the spread of the verdicts across the candidates, not the verifier's uncertainty: an item
answered 0.5 for every candidate (the hard-verdict fallback, a NaN) splits nothing and earns 0, while
for 0/1 verdicts Var_C(v) = vbar (1 - vbar), in 0 .. 0.25.

Anchors, by `train.coevolve.ranking_source`:
- feedback (default): the users' own ranking of the responses logged for the prompt. Each distinct
  response's mean feedback value (thumbs up +1, thumbs down -1, regenerate -1; copy and dwell are no
  verdict) orders them, one response per value, best first. Where a prompt has no two responses the users
  told apart, temporal contrast stands in. The share of user-ranked pairs the sampled rubrics order as the
  users did is the judge's agreement with the users (`judge_user_agreement`), the first alarm of a judge
  that drifts from what users want.
- temporal: a response of the current policy ranks above responses logged by older policy versions,
  older ones lower, counting only versions whose age (lineage distance from the current policy) is
  within [min_age, max_age].
- file: a human-ranked JSONL file (`{prompt, responses: [best, ..., worst]}`).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dynrubric.config import CoevolveConfig
from dynrubric.engines.base import Completion, Engine, GenerationRequest, SamplingParams
from dynrubric.errors import DynrubricError
from dynrubric.jsonl import split_lines
from dynrubric.rubric.items import Rubric, RubricParseError, parse_rubric
from dynrubric.train.grpo import CandidateSet, SampledResponse
from dynrubric.train.prompts import TrainPrompt, make_prompt


def r_disc(verdicts: Sequence[Sequence[float]], rubric: Rubric) -> float:
    """Weighted mean over the items of the population variance of their verdicts across the set:
    0 (no item tells any two candidates apart) .. 0.25."""
    total = 0.0
    for item, row in zip(rubric.items, verdicts, strict=True):
        vbar = sum(row) / len(row) if row else 0.0
        total += item.weight * (sum((v - vbar) ** 2 for v in row) / len(row) if row else 0.0)
    return total / sum(rubric.weights)


def r_anchor(ranked_scores: Sequence[float]) -> float:
    """Agreement of scores with a best-first ranking; 0 is the supremum, pairs near the top weigh most."""
    total = 0.0
    n = len(ranked_scores)
    for i in range(n):
        for j in range(i + 1, n):
            d = ranked_scores[i] - ranked_scores[j]
            log_sig = -math.log1p(math.exp(-d)) if d > -30 else d  # log sigmoid, stable
            total += log_sig / ((j - i) * 2**i)  # i is 0-based here: 2^(i_1based - 1) = 2^i
    return total


def normalised(values: Sequence[float], tie_eps: float, eps: float = 1e-6) -> list[float]:
    """(x - mean) / (std + eps) with Bessel's std; all zeros when the values are tied, i.e. their
    spread max - min is below `tie_eps` (the rubric's tie threshold)."""
    n = len(values)
    if n < 2 or max(values) - min(values) < tie_eps:
        return [0.0] * n
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return [(v - mean) / (std + eps) for v in values]


FEEDBACK_VALUE = {"thumbs_up": 1.0, "thumbs_down": -1.0, "regenerate": -1.0}  # copy, dwell: no verdict


@dataclass(frozen=True)
class RankedAnchors:
    """Responses ranked best first, and who ranked them."""

    responses: list[str]
    source: Literal["users", "temporal", "file"]


def feedback_ranking(logged: Sequence[tuple[str, Sequence[str]]]) -> list[str] | None:
    """The users' ranking of one prompt's logged responses (module docstring), best first; None when fewer
    than two distinct responses got different mean feedback values."""
    values: dict[str, list[float]] = {}
    for response, kinds in logged:
        verdicts = [FEEDBACK_VALUE[k] for k in kinds if k in FEEDBACK_VALUE]
        if verdicts and response.strip():
            values.setdefault(response, []).extend(verdicts)
    by_value: dict[float, str] = {}
    for response, vs in values.items():
        by_value.setdefault(sum(vs) / len(vs), response)  # one response per value level, the first logged
    if len(by_value) < 2:
        return None
    return [by_value[v] for v in sorted(by_value, reverse=True)]


def agreement(ranked_scores: Sequence[float], eps: float) -> tuple[float, int]:
    """(share of the ranked pairs i < j scored S_i > S_j, ties within `eps` counting 1/2; number of pairs)."""
    n = len(ranked_scores)
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    if not pairs:
        return 0.0, 0
    won = sum(
        1.0
        if ranked_scores[i] - ranked_scores[j] >= eps
        else 0.5
        if abs(ranked_scores[i] - ranked_scores[j]) < eps
        else 0.0
        for i, j in pairs
    )
    return won / len(pairs), len(pairs)


def lineage_ages(versions: Mapping[str, str | None], current: str) -> dict[str, int]:
    """Distance of each ancestor from `current` along parent links (current itself: 0)."""
    ages: dict[str, int] = {}
    v: str | None = current
    age = 0
    while v is not None and v not in ages:
        ages[v] = age
        v, age = versions.get(v), age + 1
    return ages


def temporal_anchors(
    current_response: str,
    by_version: Mapping[str, Sequence[str]],
    ages: Mapping[str, int],
    min_age: int,
    max_age: int,
    rng: random.Random,
) -> list[str] | None:
    """[current response, one response per older version by increasing age]; None when no older
    version within [min_age, max_age] logged a response to the prompt."""
    older = sorted((ages[v], v) for v, rs in by_version.items() if rs and v in ages and min_age <= ages[v] <= max_age)
    if not older:
        return None
    return [current_response] + [rng.choice(list(by_version[v])) for _, v in older]


def read_anchor_file(path: Path) -> dict[str, list[str]]:
    """Human-ranked anchors by prompt key: JSONL `{"prompt" | "messages", "responses": [best..worst]}`."""
    path = Path(path)
    if not path.is_file():
        raise DynrubricError(
            f"rankings file {path} does not exist",
            "set train.coevolve.rankings_file, or train.coevolve.ranking_source: temporal",
        )
    out: dict[str, list[str]] = {}
    for n, line in enumerate(split_lines(path.read_text()), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            prompt = make_prompt(
                obj["prompt"] if "prompt" in obj else [(m["role"], m["content"]) for m in obj["messages"]]
            )
            responses = [str(r) for r in obj["responses"]]
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise DynrubricError(
                f"{path}:{n} is not an anchor record ({e})",
                'write {"prompt": "...", "responses": ["best", "...", "worst"]}',
            ) from None
        if len(responses) < 2:
            raise DynrubricError(f"{path}:{n} ranks fewer than 2 responses", "list at least two, best first")
        out[prompt.key] = responses
    return out


@dataclass(frozen=True)
class GeneratorBatchStats:
    sets: int
    rubrics: int
    parsed: int
    anchored_sets: int
    r_disc_mean: float
    r_anchor_mean: float  # over parsed rubrics of anchored sets; 0 when none
    user_ranked_sets: int = 0  # sets whose anchors the users ranked (feedback)
    judge_user_pairs: int = 0  # user-ranked pairs the parsed rubrics scored
    judge_user_agreement: float | None = None  # share of those pairs ordered as the users did (None: no pair)

    def as_dict(self) -> dict[str, float | int]:
        return self.__dict__.copy()


def generator_groups(
    generator: Engine,
    set_prompt: Callable[[str, Sequence[str]], str],
    verify: Callable[[str, Sequence[str], Rubric], list[list[float]]],
    apply_rubric: Callable[[str, Rubric, Sequence[str]], list[float]],
    sets: Sequence[tuple[TrainPrompt, Sequence[str]]],
    anchors: Sequence[RankedAnchors | None],
    config: CoevolveConfig,
    max_items: int,
    temperature: float,
    tie_eps: float,
    seed: int,
    json_schema: str | None = None,
    stated_checks_only: bool = False,
) -> tuple[list[CandidateSet], GeneratorBatchStats]:
    """Sample `rubric_samples` rubrics per set at `temperature` (decoded under `json_schema` when
    given, as the evaluator decodes them), reward them, and return GRPO groups for the generator
    (whose loss takes log-probs at that temperature). `tie_eps`: the rubric's tie threshold, below
    which a reward's spread within a set is no signal.

    Under a grammar the sampled tokens come from the masked distribution while the loss takes the
    model's unmasked log-probs (as vLLM-sampled structured outputs are trained elsewhere): masked-out
    tokens are never sampled, so the update only reweights choices the grammar allowed. `stated_checks_only`: a
    sampled rubric is read as the evaluator reads it (`rubric.stated_checks_only`)."""
    prompts = [set_prompt(p.question, responses) for p, responses in sets]
    params = SamplingParams(
        max_tokens=config.generator_max_tokens,
        temperature=temperature,
        n=config.rubric_samples,
        seed=seed,
        json_schema=json_schema,
    )
    outputs = generator.generate([GenerationRequest(p, params) for p in prompts])
    tok = generator.tokenizer
    groups: list[CandidateSet] = []
    parsed_total = anchored = user_sets = user_pairs = 0
    user_won = 0.0
    disc_all: list[float] = []
    anchor_all: list[float] = []
    for (prompt, responses), gen_prompt, completions, anchor in zip(sets, prompts, outputs, anchors, strict=True):
        disc: list[float] = []
        anch: list[float | None] = []
        fmt: list[float] = []
        user_sets += int(anchor is not None and anchor.source == "users")
        for c in completions:
            try:
                rubric = parse_rubric(c.text, max_items, stated_checks_only=stated_checks_only)
            except RubricParseError:
                disc.append(0.0)
                anch.append(None)
                fmt.append(0.0)
                continue
            disc.append(r_disc(verify(prompt.question, responses, rubric), rubric))
            if anchor is not None:
                scores = apply_rubric(prompt.question, rubric, anchor.responses)
                anch.append(r_anchor(scores))
                if anchor.source == "users":
                    share, n = agreement(scores, tie_eps)
                    user_won, user_pairs = user_won + share * n, user_pairs + n
            else:
                anch.append(None)
            fmt.append(1.0)
        parsed = [a for a in anch if a is not None]
        anch_filled = [a if a is not None else (min(parsed) if parsed else 0.0) for a in anch]
        parsed_total += int(sum(fmt))
        anchored += int(anchor is not None)
        disc_all.extend(d for d, f in zip(disc, fmt, strict=True) if f)
        anchor_all.extend(parsed)
        adv = [
            d + config.ranking_weight * a + config.format_weight * f
            for d, a, f in zip(
                normalised(disc, tie_eps), normalised(anch_filled, tie_eps), normalised(fmt, tie_eps), strict=True
            )
        ]
        prompt_ids = tuple(tok.encode(gen_prompt, add_special_tokens=False))
        rollouts = tuple(sampled_response(prompt_ids, c, tok) for c in completions)
        groups.append(CandidateSet(rollouts, tuple(disc), tuple(adv), temperature))
    stats = GeneratorBatchStats(
        sets=len(sets),
        rubrics=sum(len(c) for c in outputs),
        parsed=parsed_total,
        anchored_sets=anchored,
        r_disc_mean=sum(disc_all) / len(disc_all) if disc_all else 0.0,
        r_anchor_mean=sum(anchor_all) / len(anchor_all) if anchor_all else 0.0,
        user_ranked_sets=user_sets,
        judge_user_pairs=user_pairs,
        judge_user_agreement=user_won / user_pairs if user_pairs else None,
    )
    return groups, stats


def completion_ids(completion: Completion, tokenizer: Any) -> tuple[int, ...]:
    """The sampled token ids, with the end-of-sequence token the model chose to stop on (the tokenizer's
    when a stop string or a grammar ended it), so that the update also teaches when to stop."""
    ids = tuple(completion.token_ids)
    eos = completion.stop_token_id if completion.stop_token_id is not None else tokenizer.eos_token_id
    if completion.finish_reason == "stop" and eos is not None and (not ids or ids[-1] != eos):
        ids = ids + (eos,)
    return ids


def completion_logprobs(completion: Completion, tokenizer: Any) -> tuple[float, ...] | None:
    """The engine's log-probs of `completion_ids`' tokens, or None: the engine returned none, or the
    end-of-sequence token appended was not sampled (a stop string or a grammar ended the completion)."""
    if completion.logprobs is None:
        return None
    if len(completion_ids(completion, tokenizer)) == len(completion.token_ids):
        return tuple(completion.logprobs)
    if completion.stop_logprob is None:
        return None
    return (*completion.logprobs, completion.stop_logprob)


def sampled_response(prompt_ids: tuple[int, ...], completion: Completion, tokenizer: Any) -> SampledResponse:
    """A completion as the trainer's rollout: its ids with the stop token, and the engine's log-probs."""
    return SampledResponse(
        prompt_ids, completion_ids(completion, tokenizer), completion_logprobs(completion, tokenizer)
    )
