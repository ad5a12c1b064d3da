"""The judge benchmark: how well an evaluator ranks candidate sets whose order is known.

Input (JSONL), one set a line: `{"prompt", "responses", "order": [indices best..worst], "kind"}` for an
ordered set, `{"prompt", "responses", "collapsed": true, "kind"}` for a set of equal quality.

Per mode and kind, on ordered sets (s = scores, `eps` the rubric's tie threshold):
- pairwise accuracy: over pairs (a better than b), 1 when s_a - s_b >= eps, 1/2 when |s_a - s_b| < eps;
- Kendall tau-b between the known ranks and the scores (ties within eps count as ties);
- ordered gap: s_best - s_worst;
- empty on top: sets where an empty response scores at least as high as every other response while
  the set is not all tied (then GRPO would give the empty response a positive advantage);
- all tied: sets whose responses all score within eps of each other: the judge ranked nothing (every
  advantage is zero; the empty response is not "on top" of anything there);
- score-length correlation: Pearson r between scores and response length in words (a judge that
  follows length, not quality, shows here);
- untrusted: sets where a calibration answer outranked a real candidate.
The collapse detector runs over the ordered sets in order (its false alarm rate: alarms / decisions)
and over the equal-quality sets (its alarm rate), with the configured window, or the number of sets
when there are fewer.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from itertools import combinations
from pathlib import Path

from dynrubric.errors import DynrubricError
from dynrubric.jsonl import jsonl_lines
from dynrubric.rubric.gaps import CollapseDetector, GapStats
from dynrubric.rubric.items import MAX_ITEMS, MAX_TEXT_CHARS, Rubric, RubricItem


@dataclass(frozen=True)
class JudgeSet:
    prompt: str
    responses: list[str]
    kind: str
    order: list[int] | None  # indices best..worst; None for an equal-quality set

    @property
    def collapsed(self) -> bool:
        return self.order is None


def read_judge_sets(path: Path) -> list[JudgeSet]:
    """The benchmark's sets; a bad line is an error naming its number and what is wrong."""
    out = []
    for n, obj in jsonl_lines(path, "benchmark file", "pass a JSONL file of judge sets"):
        if not isinstance(obj, dict):
            raise DynrubricError(
                f"{path}:{n} is not a JSON object", "write one {prompt, responses, ...} object per line"
            )
        prompt, responses, order = obj.get("prompt"), obj.get("responses"), obj.get("order")
        if (
            not isinstance(prompt, str)
            or not isinstance(responses, list)
            or len(responses) < 2
            or not all(isinstance(r, str) for r in responses)
        ):
            raise DynrubricError(f"{path}:{n} needs 'prompt' (text) and 'responses' (2 or more texts)", "fix that line")
        if obj.get("collapsed") is True:
            order = None
        elif not (isinstance(order, list) and sorted(order) == list(range(len(responses)))):
            raise DynrubricError(
                f"{path}:{n} needs 'order' (every response index once, best first) or 'collapsed': true",
                "fix that line",
            )
        out.append(JudgeSet(prompt, responses, str(obj.get("kind", "all")), order))
    if not out:
        raise DynrubricError(f"benchmark file {path} holds no sets", "write one set per line")
    return out


def pairwise_accuracy(scores: Sequence[float], order: Sequence[int], eps: float) -> float:
    total = 0.0
    pairs = list(combinations(order, 2))  # (better, worse)
    for better, worse in pairs:
        gap = scores[better] - scores[worse]
        total += 1.0 if gap >= eps else 0.5 if abs(gap) < eps else 0.0
    return total / len(pairs)


def kendall_tau(scores: Sequence[float], order: Sequence[int], eps: float) -> float:
    """Kendall tau-b of scores against the known ranking (score ties within eps are ties)."""
    rank = {idx: -pos for pos, idx in enumerate(order)}  # higher is better
    concordant = discordant = tied_scores = 0
    for i, j in combinations(range(len(scores)), 2):
        gap = scores[i] - scores[j]
        if abs(gap) < eps:
            tied_scores += 1
            continue
        if (gap > 0) == (rank[i] > rank[j]):
            concordant += 1
        else:
            discordant += 1
    n_pairs = len(scores) * (len(scores) - 1) // 2
    denominator = math.sqrt(n_pairs * (n_pairs - tied_scores))
    return (concordant - discordant) / denominator if denominator else 0.0


def _pearson(xs: Sequence[float], ys: Sequence[float]) -> float:
    n = len(xs)
    if n < 3:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sx = math.sqrt(sum((x - mx) ** 2 for x in xs))
    sy = math.sqrt(sum((y - my) ** 2 for y in ys))
    return sxy / (sx * sy) if sx > 0 and sy > 0 else 0.0


def alarm_rate(stats: Sequence[GapStats], window: int, min_mean_gap: float, max_nonsplit: float) -> tuple[float, int]:
    """(share of the detector's decisions that fire, number of decisions) over `stats` in order."""
    detector = CollapseDetector(max(1, min(window, len(stats))), min_mean_gap, max_nonsplit)
    fired = decisions = 0
    for n, s in enumerate(stats, 1):
        alarm = detector.update(s)
        if n >= detector.window:
            decisions += 1
            fired += alarm
    return (fired / decisions if decisions else 0.0), decisions


def all_tied(scores: Sequence[float], eps: float) -> bool:
    """Every response within `eps` of every other: the set is ranked not at all."""
    return max(scores) - min(scores) < eps


def empty_on_top(scores: Sequence[float], responses: Sequence[str], eps: float) -> bool:
    """An empty response scores at least as high as every non-empty one, in a set that is not all tied."""
    empties = [j for j, r in enumerate(responses) if not r.strip()]
    others = [x for j, x in enumerate(scores) if j not in empties]
    return bool(others) and not all_tied(scores, eps) and any(scores[j] >= max(others) for j in empties)


@dataclass(frozen=True)
class KindResult:
    sets: int
    pairwise_accuracy: float
    # what GRPO receives: an untrusted set gives every answer the same advantage, so its pairs count 1/2
    trained_pairwise_accuracy: float
    kendall_tau: float
    ordered_gap: float
    empty_top: int
    all_tied: int
    untrusted: int


@dataclass(frozen=True)
class ModeResult:
    mode: str
    by_kind: dict[str, KindResult]  # "all" included
    score_length_r: float
    collapse_alarm_rate: float  # on equal-quality sets
    collapse_false_alarm_rate: float  # on ordered sets
    collapse_decisions: tuple[int, int]  # (equal-quality, ordered)
    rubric_sources: dict[str, int]
    parse_failures: int
    generation_tries: int
    prompt_only_fallbacks: int
    generic_fallbacks: int
    dropped_checks: int
    hard_verdicts: int
    seconds: float

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def summarise_mode(
    mode: str,
    sets: Sequence[JudgeSet],
    scores: Sequence[Sequence[float]],
    gaps: Sequence[GapStats],
    trusted: Sequence[bool],
    *,
    eps: float,
    window: int,
    min_mean_gap: float,
    max_nonsplit: float,
    rubric_sources: dict[str, int],
    parse_failures: int,
    generation_tries: int,
    prompt_only_fallbacks: int,
    generic_fallbacks: int,
    dropped_checks: int,
    hard_verdicts: int,
    seconds: float,
) -> ModeResult:
    ordered = [i for i, s in enumerate(sets) if not s.collapsed]
    kinds = sorted({sets[i].kind for i in ordered})
    by_kind = {}
    for kind in [*kinds, "all"]:
        members = [i for i in ordered if kind in ("all", sets[i].kind)]
        if not members:
            continue
        acc = [pairwise_accuracy(scores[i], sets[i].order or [], eps) for i in members]
        tau = [kendall_tau(scores[i], sets[i].order or [], eps) for i in members]
        gap = [scores[i][sets[i].order[0]] - scores[i][sets[i].order[-1]] for i in members]  # type: ignore[index]
        trained = [a if trusted[i] else 0.5 for a, i in zip(acc, members, strict=True)]
        by_kind[kind] = KindResult(
            sets=len(members),
            pairwise_accuracy=sum(acc) / len(acc),
            trained_pairwise_accuracy=sum(trained) / len(trained),
            kendall_tau=sum(tau) / len(tau),
            ordered_gap=sum(gap) / len(gap),
            empty_top=sum(empty_on_top(scores[i], sets[i].responses, eps) for i in members),
            all_tied=sum(all_tied(scores[i], eps) for i in members),
            untrusted=sum(not trusted[i] for i in members),
        )
    lengths = [float(len(r.split())) for i in ordered for r in sets[i].responses]
    flat = [x for i in ordered for x in scores[i]]
    collapsed_stats = [gaps[i] for i, s in enumerate(sets) if s.collapsed]
    ordered_stats = [gaps[i] for i in ordered]
    alarm, n_alarm = alarm_rate(collapsed_stats, window, min_mean_gap, max_nonsplit)
    false_alarm, n_false = alarm_rate(ordered_stats, window, min_mean_gap, max_nonsplit)
    return ModeResult(
        mode=mode,
        by_kind=by_kind,
        score_length_r=_pearson(flat, lengths),
        collapse_alarm_rate=alarm,
        collapse_false_alarm_rate=false_alarm,
        collapse_decisions=(n_alarm, n_false),
        rubric_sources=rubric_sources,
        parse_failures=parse_failures,
        generation_tries=generation_tries,
        prompt_only_fallbacks=prompt_only_fallbacks,
        generic_fallbacks=generic_fallbacks,
        dropped_checks=dropped_checks,
        hard_verdicts=hard_verdicts,
        seconds=seconds,
    )


# ---------------------------------------------------------------- real policy output, official checkers
@dataclass(frozen=True)
class RealSet:
    """K answers the policy sampled for a held-out prompt, and whether each passes its ground truth."""

    prompt: str
    responses: list[str]
    passed: list[bool]

    @property
    def separated(self) -> bool:
        """The checker tells some answers apart: the set has an order to recover."""
        return any(self.passed) and not all(self.passed)


def _graded_set(obj: object) -> bool:
    """A line of a graded sets file: `prompt`, two or more `responses`, one `passed` flag per response."""
    return (
        isinstance(obj, dict)
        and isinstance(obj.get("prompt"), str)
        and isinstance(obj.get("responses"), list)
        and isinstance(obj.get("passed"), list)
        and len(obj["passed"]) == len(obj["responses"]) >= 2
    )


def read_real_sets(path: Path) -> list[RealSet]:
    """`{prompt, responses, passed}` per line (written by `dynrubric eval-judge --real --sample N`)."""
    out = []
    fix = "pass a JSONL file of {prompt, responses, passed} per line, or write one with --real --sample N"
    for n, obj in jsonl_lines(path, "real-output sets file", fix):
        ok = _graded_set(obj)
        if not ok:
            raise DynrubricError(
                f"{path}:{n} needs 'prompt', 'responses' (2 or more) and one 'passed' per response", "fix that line"
            )
        out.append(RealSet(obj["prompt"], [str(r) for r in obj["responses"]], [bool(p) for p in obj["passed"]]))
    if not out:
        raise DynrubricError(f"real-output sets file {path} holds no sets", "sample some with --real --sample N")
    return out


@dataclass(frozen=True)
class RealResult:
    """The judge on the sets the checker separates: how often it orders a passing answer above a failing one,
    and how often the set's GRPO advantages point the checker's way (mean advantage of the passing answers
    > 0; an untrusted or tied set gives no advantage)."""

    sets: int
    separated_sets: int
    separated_pairs: int
    pairwise_accuracy: float  # over (pass, fail) pairs: 1 when s_pass - s_fail >= eps, 1/2 within eps
    trains_right: int  # separated sets with a non-zero advantage whose sign agrees with the checker
    trains_wrong: int  # ... whose sign disagrees
    no_advantage: int  # separated sets that give no advantage (tied or untrusted)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def summarise_real(
    sets: Sequence[RealSet],
    scores: Sequence[Sequence[float]],
    trusted: Sequence[bool],
    advantages: Callable[[Sequence[float]], list[float] | None],
    eps: float,
) -> RealResult:
    """`advantages(scores)`: the trainer's group advantages of a set (None when tied)."""
    won = pairs = right = wrong = none = 0.0
    separated = [i for i, s in enumerate(sets) if s.separated]
    for i in separated:
        s, ok = scores[i], sets[i].passed
        for a in (j for j in range(len(ok)) if ok[j]):
            for b in (j for j in range(len(ok)) if not ok[j]):
                gap = s[a] - s[b]
                won += 1.0 if gap >= eps else 0.5 if abs(gap) < eps else 0.0
                pairs += 1
        adv = advantages(s) if trusted[i] else None
        if adv is None:
            none += 1
            continue
        mean_pass = sum(x for x, p in zip(adv, ok, strict=True) if p) / sum(ok)
        right, wrong = (right + 1, wrong) if mean_pass > 0 else (right, wrong + 1)
    return RealResult(
        sets=len(sets),
        separated_sets=len(separated),
        separated_pairs=int(pairs),
        pairwise_accuracy=won / pairs if pairs else 0.0,
        trains_right=int(right),
        trains_wrong=int(wrong),
        no_advantage=int(none),
    )


# ---------------------------------------------------------------- open prompts: a strong answer beside the policy's
@dataclass(frozen=True)
class OpenSet:
    """One open prompt (no checker): a strong answer (`passed` true) beside K policy answers of the same token
    budget, the policy answers tied among themselves; HealthBench sets carry the physicians' rubric."""

    prompt: str
    responses: list[str]
    passed: list[bool]  # exactly one True: the strong answer
    source: str  # arena-hard | healthbench
    id: str
    rubric: list[tuple[str, float]]  # (criterion, points): negative points are a flaw; [] without one

    @property
    def strong(self) -> int:
        return self.passed.index(True)


def read_open_sets(path: Path) -> list[OpenSet]:
    """`{prompt, responses, passed, source, id[, rubric]}` per line (scripts/make_open_judge_benchmark.py)."""
    out = []
    fix = "regenerate it with scripts/make_open_judge_benchmark.py"
    for n, obj in jsonl_lines(path, "open-prompt sets file", fix):
        ok = (
            _graded_set(obj)
            and sum(p is True for p in obj["passed"]) == 1
            and isinstance(obj.get("source"), str)
            and isinstance(obj.get("rubric", []), list)
        )
        if not ok:
            raise DynrubricError(
                f"{path}:{n} needs 'prompt', 'source', 'responses' (2 or more) and one 'passed' per response, "
                "exactly one of them true (the strong answer)",
                fix,
            )
        rubric = [(str(r["criterion"]), float(r["points"])) for r in obj.get("rubric", [])]
        out.append(
            OpenSet(
                obj["prompt"],
                [str(r) for r in obj["responses"]],
                [p is True for p in obj["passed"]],
                obj["source"],
                str(obj.get("id", n)),
                rubric,
            )
        )
    if not out:
        raise DynrubricError(f"open-prompt sets file {path} holds no sets", fix)
    return out


def words(text: str) -> int:
    return len(text.split())


def strong_pair_outcomes(scores: Sequence[float], passed: Sequence[bool], eps: float) -> list[float]:
    """Per (strong, policy) pair: 1 when the strong answer scores at least `eps` above, 1/2 within `eps`, else 0."""
    strong = [j for j, p in enumerate(passed) if p]
    return [
        1.0 if scores[a] - scores[b] >= eps else 0.5 if abs(scores[a] - scores[b]) < eps else 0.0
        for a in strong
        for b in range(len(passed))
        if not passed[b]
    ]


def length_pair_outcomes(responses: Sequence[str], passed: Sequence[bool]) -> list[float]:
    """The length-only judge on the same pairs: the answer with more words wins, equal counts are a tie (1/2)."""
    return strong_pair_outcomes([float(words(r)) for r in responses], passed, eps=0.5)


def strictly_first(scores: Sequence[float], passed: Sequence[bool], eps: float) -> bool:
    """The strong answer scores at least `eps` above every other answer (a tie within `eps` is not first)."""
    return all(x == 1.0 for x in strong_pair_outcomes(scores, passed, eps))


def bootstrap_ci(
    values: Sequence[float], samples: int = 2000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """The percentile bootstrap interval of the mean of `values` (one value per set: sets are resampled)."""
    if not values:
        return (0.0, 0.0)
    n = len(values)
    rng = random.Random(seed)
    means = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(samples))
    tail = (1.0 - confidence) / 2.0
    return means[min(samples - 1, int(tail * samples))], means[min(samples - 1, int((1.0 - tail) * samples))]


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


@dataclass(frozen=True)
class OpenResult:
    """The judge's own rubrics on open sets: does it rank the strong answer above the policy's, and does it beat
    "the longer answer wins" on the same pairs? CIs: percentile bootstrap over sets (each set's mean over its pairs)."""

    sets: int
    pairs: int
    pairwise_accuracy: float  # (strong, policy) pairs: 1 when s_strong - s_policy >= eps, 1/2 within eps
    accuracy_ci: tuple[float, float]
    length_baseline: float  # the same pairs, more words wins, equal = 1/2
    length_ci: tuple[float, float]
    strong_first: int  # sets where the strong answer is strictly above all policy answers
    tied_sets: int  # all answers within eps: the judge ranked nothing
    tied_share: float
    untrusted_sets: int
    generated_items: int  # items the rubric generator wrote (origin "generator")
    items_read: int  # ... whose verdict the verifier's P(yes) enters (not decided by a check alone)
    items_read_share: float
    rubric_sources: dict[str, int]

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def summarise_open(
    sets: Sequence[OpenSet],
    scores: Sequence[Sequence[float]],
    trusted: Sequence[bool],
    read: Sequence[tuple[int, int]],
    rubric_sources: Sequence[str],
    eps: float,
) -> OpenResult:
    """`read[i]`: (generated items the verifier read, generated items) of set i's rubric."""
    acc = [strong_pair_outcomes(scores[i], s.passed, eps) for i, s in enumerate(sets)]
    length = [length_pair_outcomes(s.responses, s.passed) for s in sets]
    tied = sum(all_tied(x, eps) for x in scores)
    n_read, n_generated = sum(r for r, _ in read), sum(g for _, g in read)
    return OpenResult(
        sets=len(sets),
        pairs=sum(len(a) for a in acc),
        pairwise_accuracy=_mean([x for a in acc for x in a]),
        accuracy_ci=bootstrap_ci([_mean(a) for a in acc]),
        length_baseline=_mean([x for a in length for x in a]),
        length_ci=bootstrap_ci([_mean(a) for a in length]),
        strong_first=sum(strictly_first(scores[i], s.passed, eps) for i, s in enumerate(sets)),
        tied_sets=tied,
        tied_share=tied / len(sets) if sets else 0.0,
        untrusted_sets=sum(not t for t in trusted),
        generated_items=n_generated,
        items_read=n_read,
        items_read_share=n_read / n_generated if n_generated else 0.0,
        rubric_sources=dict(sorted(Counter(rubric_sources).items())),
    )


def physician_rubrics(criteria: Sequence[tuple[str, float]]) -> list[tuple[Rubric, float]]:
    """The physicians' criteria as rubrics of at most MAX_ITEMS items, each with its total weight: weight = |points|
    rounded and clamped into 1..5 (the parser's rule for a weight out of range), polarity = the sign of the points,
    origin "ground_truth" (written by no model: no calibration answer overrules it); 0-point criteria are left out.
    A set's score is the weight-averaged score over its rubrics (`combine_scores`), what one rubric of all the
    criteria would give (every item weighs its own weight, independently of the others)."""
    items = [
        RubricItem(
            id=f"physician-{n}",
            text=text[:MAX_TEXT_CHARS],
            weight=min(5, max(1, round(abs(points)))),
            polarity=1 if points > 0 else -1,
            origin="ground_truth",
        )
        for n, (text, points) in enumerate(criteria)
        if points != 0
    ]
    chunks = [items[i : i + MAX_ITEMS] for i in range(0, len(items), MAX_ITEMS)]
    return [(Rubric(items=chunk), float(sum(i.weight for i in chunk))) for chunk in chunks]


def combine_scores(parts: Sequence[tuple[Sequence[float], float]]) -> list[float]:
    """Scores of one set under several rubrics, `(scores, total weight)` each, as one weight-averaged score."""
    total = sum(w for _, w in parts)
    k = len(parts[0][0]) if parts else 0
    return [sum(s[j] * w for s, w in parts) / total if total else 0.0 for j in range(k)]


@dataclass(frozen=True)
class PhysicianResult:
    """The verifier under the physicians' rubric (HealthBench): how often it puts the ideal completion strictly
    first among its set, and its (ideal, policy) pairwise accuracy; the length-only judge beside it."""

    sets: int
    items: int  # physician criteria judged, over all sets
    ideal_first: int
    ideal_first_rate: float
    ideal_first_ci: tuple[float, float]
    pairwise_accuracy: float
    accuracy_ci: tuple[float, float]
    length_baseline: float
    tied_sets: int

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def summarise_physician(sets: Sequence[OpenSet], scores: Sequence[Sequence[float]], eps: float) -> PhysicianResult:
    first = [1.0 if strictly_first(scores[i], s.passed, eps) else 0.0 for i, s in enumerate(sets)]
    acc = [strong_pair_outcomes(scores[i], s.passed, eps) for i, s in enumerate(sets)]
    return PhysicianResult(
        sets=len(sets),
        items=sum(len(s.rubric) for s in sets),
        ideal_first=int(sum(first)),
        ideal_first_rate=_mean(first),
        ideal_first_ci=bootstrap_ci(first),
        pairwise_accuracy=_mean([x for a in acc for x in a]),
        accuracy_ci=bootstrap_ci([_mean(a) for a in acc]),
        length_baseline=_mean([x for s in sets for x in length_pair_outcomes(s.responses, s.passed)]),
        tied_sets=sum(all_tied(x, eps) for x in scores),
    )


def plot(results: Sequence[ModeResult], path: Path) -> None:
    """Pairwise accuracy per mode and kind (chance = 0.5 dashed), and the collapse detector's rates."""
    from dynrubric.extras import require

    require("matplotlib", "report", "the eval-judge plot").use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in results[0].by_kind if k != "all"] + ["all"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1.3]})
    width = 0.8 / len(results)
    for n, r in enumerate(results):
        xs = [k + n * width for k in range(len(kinds))]
        ax1.bar(xs, [r.by_kind[k].pairwise_accuracy if k in r.by_kind else 0 for k in kinds], width, label=r.mode)
    ax1.axhline(0.5, color="grey", linestyle="--", linewidth=1, label="chance")
    ax1.set_xticks([k + width * (len(results) - 1) / 2 for k in range(len(kinds))], kinds)
    ax1.set_ylim(0, 1)
    ax1.set_ylabel("pairwise accuracy (ties = 1/2)")
    ax1.set_title("ranking of ordered sets")
    ax1.legend(loc="lower right", fontsize=8)
    modes = range(len(results))
    ax2.bar([x - 0.2 for x in modes], [r.collapse_alarm_rate for r in results], 0.4, label="alarm, equal-quality")
    ax2.bar([x + 0.2 for x in modes], [r.collapse_false_alarm_rate for r in results], 0.4, label="false alarm, ordered")
    ax2.set_xticks(list(modes), [r.mode for r in results])
    ax2.set_ylim(0, 1)
    ax2.set_title("collapse detector")
    ax2.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
