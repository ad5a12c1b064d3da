"""The evaluator: candidate sets in, set-conditioned scores and gap diagnostics out.

`Evaluator.score_sets` is what the trainer and the reward server call: one rubric per set (generated
from the question and all K candidates, joined by the items derived without a model), then per set:

1. checked items are answered by their deterministic check (checks.py), blended with the verifier's
   P(yes) when `rubric.check_weight` < 1; an empty response earns no checked item, whatever its polarity;
2. the other items get P(yes) from the verifier, one batched call for the K candidates and the A
   calibration answers (calibrate.py), and are de-biased against them;
3. an item a model or a vote wrote (generated, consensus) on which a calibration answer outranks a real candidate
   (any, or the best: `rubric.trust_rule`) is overruled: it is noise for this set and weighs nothing.
   Items read off the prompt (its ground truth, the echo item: derived.py) are never overruled;
   scores `E(y|C) = sum w' z / sum w'` with the weights of score.py (the prompt's ground truth holds
   `rubric.ground_truth_share`), the calibration answers scored with the same rubric; a set where every item but the
   echo item was overruled is untrusted (no signal left: zero advantage);
4. the per-set gap diagnostics, the rolling collapse detector and the Prometheus metrics of
   monitoring/README.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dynrubric.config import RubricConfig
from dynrubric.engines.base import Engine
from dynrubric.rubric.calibrate import calibrate_row, calibration_outranks, known_bad_answers
from dynrubric.rubric.checks import run_check
from dynrubric.rubric.gaps import CollapseDetector, GapStats, gap_stats
from dynrubric.rubric.generate import GenerationCounts, RubricGenerator, RubricSource
from dynrubric.rubric.items import NON_RANKING_ORIGINS, Rubric, RubricItem
from dynrubric.rubric.score import aggregate, item_weights
from dynrubric.rubric.verify import Verifier
from dynrubric.seeds import judge_call_seed

#: items a model or a vote wrote: calibration answers can overrule them
OVERRULABLE = frozenset({"generator", "consensus"})

GAP_BUCKETS = (0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
SHARE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def verifier_reads(item: RubricItem, check_weight: float) -> bool:
    """Does the verifier's P(yes) enter the item's verdict (`Evaluator.judge` asks it exactly for these)? Not for an
    item with a deterministic check while checks are not blended (`rubric.check_weight` 1): the check decides it."""
    return item.check is None or check_weight < 1.0


def generated_items_read(rubric: Rubric, check_weight: float) -> tuple[int, int]:
    """(generated items the verifier reads, generated items) of a rubric: a judge whose generator attaches a check to
    every item never reads its verifier on them (ARCHITECTURE.md section 2)."""
    generated = [i for i in rubric.items if i.origin == "generator"]
    return sum(verifier_reads(i, check_weight) for i in generated), len(generated)


@dataclass(frozen=True)
class ScoredSet:
    prompt: str  # the raw user question
    responses: list[str]
    rubric: Rubric
    rubric_source: RubricSource
    verdicts: list[
        list[float]
    ]  # M x K (item x response): the verdicts scored (checked, calibrated); polarity NOT applied
    scores: list[float]  # K, each in [0, 1], never NaN
    gaps: GapStats
    hard_verdict_fallbacks: int
    generator_raw: str
    verify_seconds: float = 0.0
    raw_verdicts: list[list[float]] | None = None  # M x K verifier P(yes) before checks and calibration
    calibration_scores: list[float] | None = None  # the calibration answers' scores under the same rubric
    calibration_raw_verdicts: list[list[float]] | None = None  # M x A verifier P(yes) of the calibration answers
    trusted: bool = True  # False: calibration answers overruled every item but the echo item: no signal left
    overruled_items: int = 0  # items a calibration answer overruled (weight 0 in the scores)

    def as_dict(self) -> dict[str, object]:
        return {
            "prompt": self.prompt,
            "responses": self.responses,
            "rubric": [i.model_dump() for i in self.rubric.items],
            "rubric_source": self.rubric_source,
            "verdicts": self.verdicts,
            "scores": self.scores,
            "gaps": self.gaps.as_dict(),
            "hard_verdict_fallbacks": self.hard_verdict_fallbacks,
            "generator_raw": self.generator_raw,
            "verify_seconds": self.verify_seconds,
            "raw_verdicts": self.raw_verdicts,
            "calibration_scores": self.calibration_scores,
            "calibration_raw_verdicts": self.calibration_raw_verdicts,
            "trusted": self.trusted,
            "overruled_items": self.overruled_items,
        }


@dataclass(frozen=True)
class Judgement:
    """One set judged under one rubric (Evaluator.judge)."""

    verdicts: list[list[float]]  # M x K, as ScoredSet.verdicts
    raw_verdicts: list[list[float]]  # M x K verifier P(yes); 0.5 where the verifier was not asked
    calibration_raw_verdicts: list[list[float]]  # M x A, the same for the calibration answers
    scores: list[float]
    calibration_scores: list[float]
    overruled: list[bool]  # M: items a calibration answer overruled (weight 0 in the scores)
    trusted: bool  # False when calibration answers overruled every item but the echo item (no signal left)
    hard_verdict_fallbacks: int


class EvaluatorMetrics:
    """The rubric metrics (monitoring/README.md), registered on the service's own registry."""

    def __init__(self, registry: CollectorRegistry):
        self.sets = Counter("dynrubric_rubric_sets", "candidate sets scored", registry=registry)
        self.mean_gap = Histogram(
            "dynrubric_rubric_mean_gap",
            "mean absolute pairwise score gap of each set",
            buckets=GAP_BUCKETS,
            registry=registry,
        )
        self.nonsplit_share = Histogram(
            "dynrubric_rubric_nonsplit_item_share",
            "share of rubric items that split no pair in a set",
            buckets=SHARE_BUCKETS,
            registry=registry,
        )
        self.collapse = Gauge(
            "dynrubric_rubric_collapse", "1 while the rolling collapse detector fires", registry=registry
        )
        self.parse_failures = Counter(
            "dynrubric_rubric_parse_failures", "generator outputs that failed to parse/validate", registry=registry
        )
        self.fallbacks = Counter("dynrubric_rubric_fallbacks", "fallback paths taken", ["kind"], registry=registry)
        for kind in ("prompt_only", "generic", "hard_verdict"):
            self.fallbacks.labels(kind=kind)
        self.dropped_checks = Counter(
            "dynrubric_rubric_dropped_checks",
            "malformed item checks dropped (the item is verifier-judged)",
            registry=registry,
        )
        self.untrusted = Counter(
            "dynrubric_rubric_untrusted_sets",
            "sets where calibration answers overruled every rubric item (rubric.trust_rule)",
            registry=registry,
        )

    def record_generation(self, counts: GenerationCounts) -> None:
        self.parse_failures.inc(counts.parse_failures)
        self.fallbacks.labels(kind="prompt_only").inc(counts.prompt_only_fallbacks)
        self.fallbacks.labels(kind="generic").inc(counts.generic_fallbacks)
        self.dropped_checks.inc(counts.dropped_checks)

    def record_set(self, scored: ScoredSet, collapsed: bool) -> None:
        self.sets.inc()
        self.mean_gap.observe(scored.gaps.mean_abs_gap)
        self.nonsplit_share.observe(scored.gaps.nonsplit_share)
        self.fallbacks.labels(kind="hard_verdict").inc(scored.hard_verdict_fallbacks)
        self.untrusted.inc(0 if scored.trusted else 1)
        self.collapse.set(1.0 if collapsed else 0.0)


class Evaluator:
    def __init__(
        self,
        generator: Engine,
        verifier: Engine,
        config: RubricConfig,
        metrics: EvaluatorMetrics | None = None,
    ):
        self.config = config
        self.metrics = metrics
        self.rubric_generator = RubricGenerator(generator, config)
        self.verifier = Verifier(verifier, config.verifier_response_token_budget)
        self.collapse = CollapseDetector(
            config.collapse_window, config.collapse_min_mean_gap, config.collapse_max_nonsplit_share
        )
        self._calls = 0
        #: running totals of the generation ladder since construction (for logs and tests)
        self.counts = GenerationCounts()

    def generate_rubric(self, prompt: str, responses: Sequence[str], seed: int) -> tuple[Rubric, RubricSource, str]:
        [generated], counts = self.rubric_generator.generate_many([prompt], [list(responses)], seed)
        self._record_generation(counts)
        return generated.rubric, generated.source, generated.raw

    def apply_rubric(self, prompt: str, rubric: Rubric, responses: Sequence[str]) -> list[float]:
        """Scores of `responses` under a given rubric (the generator's ranked responses); updates no diagnostics."""
        if not responses:
            return []
        return self.judge(prompt, rubric, responses).scores

    def judge(self, prompt: str, rubric: Rubric, responses: Sequence[str]) -> Judgement:
        """Steps 1-3 of the module docstring for one set under one rubric."""
        k = len(responses)
        judged = list(responses) + (known_bad_answers(prompt) if self.config.calibration_answers else [])
        cw = self.config.check_weight
        # items the verifier answers: those without a check, and all of them when checks are blended
        asked = [m for m, item in enumerate(rubric.items) if verifier_reads(item, cw)]
        raw: list[list[float]] = [[0.5] * len(judged) for _ in rubric.items]
        hard = 0
        if asked:
            verdicts, hard = self.verifier.verify_items(prompt, judged, [rubric.items[m] for m in asked])
            for m, row in zip(asked, verdicts, strict=True):
                raw[m] = row
        return weigh(rubric, judged, raw, k, self.config, hard)

    def score_sets(
        self,
        prompts: Sequence[str],
        candidate_sets: Sequence[Sequence[str]],
        progress: Callable[[int], None] | None = None,
        seed: int | None = None,
    ) -> list[ScoredSet]:
        """Score each set with its own rubric. `progress(n)` is called after every n sets scored.
        `seed`: the rubric generator's seed block (default: a new block per call)."""
        if len(prompts) != len(candidate_sets):
            raise ValueError(f"{len(prompts)} prompts but {len(candidate_sets)} candidate sets")
        if any(len(c) == 0 for c in candidate_sets):
            raise ValueError("every candidate set needs at least one response")
        if seed is None:  # a new seed block per call (dynrubric/seeds.py): retries within it add 1, 2, ...
            seed = judge_call_seed(self.config.seed, self._calls)
            self._calls += 1
        generated, counts = self.rubric_generator.generate_many(prompts, candidate_sets, seed)
        self._record_generation(counts)
        out = []
        for prompt, responses, gen in zip(prompts, candidate_sets, generated, strict=True):
            start = time.perf_counter()
            judged = self.judge(prompt, gen.rubric, responses)
            elapsed = time.perf_counter() - start
            scored = ScoredSet(
                prompt=prompt,
                responses=list(responses),
                rubric=gen.rubric,
                rubric_source=gen.source,
                verdicts=judged.verdicts,
                scores=judged.scores,
                gaps=gap_stats(judged.verdicts, gen.rubric, judged.scores, self.config.eps),
                hard_verdict_fallbacks=judged.hard_verdict_fallbacks,
                generator_raw=gen.raw,
                verify_seconds=elapsed,
                raw_verdicts=judged.raw_verdicts,
                calibration_scores=judged.calibration_scores,
                calibration_raw_verdicts=judged.calibration_raw_verdicts,
                trusted=judged.trusted,
                overruled_items=sum(judged.overruled),
            )
            collapsed = self.collapse.update(scored.gaps)
            if self.metrics is not None:
                self.metrics.record_set(scored, collapsed)
            out.append(scored)
            if progress is not None:
                progress(1)
        return out

    def _record_generation(self, counts: GenerationCounts) -> None:
        self.counts.parse_failures += counts.parse_failures
        self.counts.prompt_only_fallbacks += counts.prompt_only_fallbacks
        self.counts.generic_fallbacks += counts.generic_fallbacks
        self.counts.dropped_checks += counts.dropped_checks
        self.counts.reasons = (self.counts.reasons + counts.reasons)[-100:]  # the latest, for reports
        if self.metrics is not None:
            self.metrics.record_generation(counts)


def weigh(
    rubric: Rubric, judged: Sequence[str], raw: Sequence[Sequence[float]], k: int, config: RubricConfig, hard: int = 0
) -> Judgement:
    """Steps 1 and 3 of the module docstring, given the verifier's answers: `judged` is the K candidates then the
    A calibration answers (when `config.calibration_answers`), `raw` their M x (K + A) P(yes) (0.5 where the
    verifier was not asked).
    Pure: `eval_judge.json` keeps `raw`, so a set can be weighed again under another rule
    (benchmarks/trust_rules.py)."""
    cw = config.check_weight
    oriented = []  # M x (K + A): how much each response earns each item, polarity applied
    for item, row in zip(rubric.items, raw, strict=True):
        z = [v if item.polarity == 1 else 1.0 - v for v in row]
        z = calibrate_row(z, k) if config.calibration_answers else z
        if item.check is not None:
            checked = [run_check(item.check, r) for r in judged]
            # an empty response meets no check and earns no credit for avoiding a flaw either
            # ("not_contains X" at polarity -1 would otherwise score an empty answer above the rest)
            checked = [
                0.0 if not r.strip() else c if item.polarity == 1 else 1.0 - c
                for c, r in zip(checked, judged, strict=True)
            ]
            z = [cw * c + (1.0 - cw) * x for c, x in zip(checked, z, strict=True)] if cw < 1.0 else checked
        oriented.append(z)
    # an item on which a calibration answer beats a real candidate is noise for this set; items read off the
    # prompt itself stand (the echoed question that contains the required keyword meets it for real)
    overruled = [
        config.calibration_answers
        and item.origin in OVERRULABLE
        and calibration_outranks(z[:k], z[k:], config.eps, config.trust_rule)
        for item, z in zip(rubric.items, oriented, strict=True)
    ]
    weights = item_weights(rubric, overruled, config.ground_truth_share)
    effective = [
        [x if item.polarity == 1 else 1.0 - x for x in z] for item, z in zip(rubric.items, oriented, strict=True)
    ]
    all_scores = aggregate(effective, rubric, weights)
    scores, calibration_scores = all_scores[:k], all_scores[k:]
    return Judgement(
        verdicts=[row[:k] for row in effective],
        raw_verdicts=[list(row[:k]) for row in raw],
        calibration_raw_verdicts=[list(row[k:]) for row in raw],
        scores=scores,
        calibration_scores=calibration_scores,
        overruled=overruled,
        # the echo and floor items alone rank nothing but echoes and empty answers: a set is trusted while
        # another item weighs
        trusted=any(
            w > 0 and item.origin not in NON_RANKING_ORIGINS for item, w in zip(rubric.items, weights, strict=True)
        ),
        hard_verdict_fallbacks=hard,
    )
