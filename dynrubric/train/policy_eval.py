"""Ground-truth evaluation of policy versions: is the loop learning, on what users care about?

Each version answers fixed prompt suites at the serving decode settings (greedy, the users' `max_tokens`),
and each answer is graded by something no reward reads. The suites (`SUITES`):

- `dev`: the bank's dev split (train/splits.py), prompts with ground truth. The round's guard and every
  tuned setting read this one only.
- the five reported figures (`FIGURES`), never decided on:
  - `test_seen`, `test_unseen`: the bank's test split with ground truth, without / with a held-out
    instruction type (types no training prompt carries);
  - `ifeval`, `ifbench`: the official IFEval and IFBench prompts graded by the official checkers, strict
    prompt-level accuracy (rubric/official.py; the types that cannot be graded offline are left out);
  - `open`: the bank's open test prompts (Arena-Hard, WritingBench, HealthBench), scored by
    `rubric/open_quality.py` against the strong models' answers and the experts' criteria of prompts that
    no round trains on.

Ground truth is the function the users and the judge use (rubric/groundtruth.py: official IFEval checkers,
computed answers). A prompt file without `split` fields (`evaluation.prompts_file`, `--prompts`) is one
evaluation set: its prompts under `train.heldout_share` by key are both dev and test.

    score(v)       = mean over prompts x of v's grade on x (1/0 for a check: the pass rate; [0, 1] for open)
    delta(v, u)    = score(v) - score(u), paired by prompt
    95% CI         = percentiles 2.5 / 97.5 of delta over `evaluation.bootstrap_samples` resamples of the
                     prompts with replacement (paired bootstrap: both versions keep their answers to
                     each resampled prompt)

Outcomes are kept per suite and version (`<train.run_dir>/groundtruth/<suite>/<version>.json`, keyed by the
prompts and decode settings), so each version is sampled once per suite and any two can be compared later.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, ValidationError

from dynrubric import atomic
from dynrubric.config import Settings
from dynrubric.engines.base import Engine, GenerationRequest, SamplingParams
from dynrubric.errors import DynrubricError
from dynrubric.jsonl import split_lines
from dynrubric.rubric.groundtruth import GroundTruth, derive
from dynrubric.train.prompts import TrainPrompt, heldout_bucket, make_prompt
from dynrubric.train.records import Comparison, Figure, TruthEvidence
from dynrubric.train.splits import HELDOUT_TYPES

Suite = Literal["dev", "test_seen", "test_unseen", "ifeval", "ifbench", "open"]
SUITES: tuple[Suite, ...] = ("dev", "test_seen", "test_unseen", "ifeval", "ifbench", "open")
FIGURES: tuple[Suite, ...] = ("test_seen", "test_unseen", "ifeval", "ifbench", "open")
FIGURE_TITLES: dict[str, str] = {
    "dev": "dev",
    "test_seen": "test seen types",
    "test_unseen": "test unseen types",
    "ifeval": "IFEval",
    "ifbench": "IFBench",
    "open": "open quality",
}


class Grader(Protocol):
    """What grades an answer to one evaluation prompt."""

    @property
    def kind(self) -> str: ...

    def score(self, response: str) -> float: ...


@dataclass(frozen=True)
class CheckGrader:
    """A prompt's own ground truth (official IFEval checkers, computed answers): 1 when every part passes."""

    truth: GroundTruth

    @property
    def kind(self) -> str:
        return self.truth.kind

    def score(self, response: str) -> float:
        return float(self.truth.passes(response))


@dataclass(frozen=True)
class OfficialGrader:
    """An official benchmark prompt (IFEval, IFBench): strict prompt-level accuracy by the official checkers."""

    benchmark: str
    passes: Callable[[str], bool]

    @property
    def kind(self) -> str:
        return self.benchmark

    def score(self, response: str) -> float:
        return float(self.passes(response))


@dataclass(frozen=True)
class OpenGrader:
    """An open prompt: closeness to strong models' answers and experts' criteria (rubric/open_quality.py)."""

    question: str
    references: tuple[str, ...]
    criteria: tuple[tuple[str, int], ...]

    @property
    def kind(self) -> str:
        return "open"

    def score(self, response: str) -> float:
        from dynrubric.rubric.open_quality import open_quality

        return float(open_quality(self.question, response, self.references, self.criteria))


@dataclass(frozen=True)
class EvalPrompt:
    prompt: TrainPrompt
    grader: Grader


class VersionOutcomes(BaseModel):
    """One version's answers to a suite's prompts and their grades."""

    model_config = ConfigDict(frozen=True)

    version: str
    eval_key: str  # which prompts and decode settings (outcomes of different keys are not comparable)
    scores: dict[str, float]  # prompt key -> grade (1/0: passes its ground truth; open: quality in [0, 1])
    kinds: dict[str, str]  # prompt key -> arithmetic | instruction | ifeval | ifbench | open
    responses: dict[str, str]

    def pass_rate(self, kind: str | None = None) -> float:
        keys = [k for k in self.scores if kind is None or self.kinds[k] == kind]
        return sum(self.scores[k] for k in keys) / len(keys) if keys else 0.0

    def by_kind(self) -> dict[str, float]:
        return {kind: self.pass_rate(kind) for kind in sorted(set(self.kinds.values()))}


def _bank_lines(path: Path) -> list[dict[str, Any]]:
    lines = []
    for n, text in enumerate(split_lines(path.read_text()), 1):
        if text.strip():
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise DynrubricError(f"{path}:{n} is not JSON: {e}", "fix the prompt file") from None
            if not isinstance(obj, dict):
                raise DynrubricError(f"{path}:{n}: expected a JSON object", "fix the prompt file")
            lines.append(obj)
    return lines


def _prompt_of(obj: dict[str, Any]) -> TrainPrompt:
    if isinstance(obj.get("prompt"), str):
        return make_prompt(str(obj["prompt"]))
    messages = obj.get("messages")
    if not isinstance(messages, list):
        raise DynrubricError(f"prompt line {obj.get('id')!r} has neither prompt nor messages", "fix the prompt file")
    return make_prompt([(str(m.get("role", "user")), str(m["content"])) for m in messages])


def bank_suite(settings: Settings, suite: Suite, path: Path | None = None) -> list[EvalPrompt]:
    """The prompts of a bank suite (`dev`, `test_seen`, `test_unseen`, `open`), in key order, capped
    (`evaluation.max_prompts` for dev, `evaluation.report_prompts` for the figures). `path`: that file instead
    of `evaluation.prompts_file` or the shipped bank."""
    source = path or settings.evaluation.prompts_file or default_prompts_file()
    chosen = []
    for obj in _bank_lines(Path(source)):
        p = _prompt_of(obj)
        split = obj.get("split")
        if split is None:  # a file without splits: one evaluation set, the old rule by key (module docstring)
            held = heldout_bucket(p.key) < settings.train.heldout_share
            in_suite = held and suite != "open"
            if suite in ("test_seen", "test_unseen"):
                ids = {i.id for i in derive(p.question).instructions}
                in_suite = in_suite and (bool(ids & HELDOUT_TYPES) == (suite == "test_unseen"))
        elif obj.get("kind") == "open":
            in_suite = suite == "open" and split == "test"
        else:
            ids = {i.id for i in derive(p.question).instructions}
            unseen = bool(ids & HELDOUT_TYPES)
            in_suite = (suite == "dev" and split == "dev") or (
                split == "test" and suite == ("test_unseen" if unseen else "test_seen")
            )
        if not in_suite:
            continue
        grader: Grader
        if suite == "open":
            refs = obj.get("references") or []
            crit = obj.get("criteria") or []
            grader = OpenGrader(
                "\n".join(content for _, content in p.messages),  # the whole conversation, as the users read it
                tuple(str(r) for r in refs),
                tuple((str(c["text"]), int(c.get("points", 1))) for c in crit),
            )
        else:
            truth = derive(p.question)
            if truth.empty:
                continue
            grader = CheckGrader(truth)
        chosen.append(EvalPrompt(prompt=p, grader=grader))
    chosen.sort(key=lambda e: e.prompt.key)
    if not chosen and suite == "dev":
        raise DynrubricError(
            f"{source} has no dev prompt with ground truth (train.heldout_share {settings.train.heldout_share})",
            "pass a file of checkable prompts (evaluation.prompts_file)",
        )
    cap = settings.evaluation.max_prompts if suite == "dev" else settings.evaluation.report_prompts
    return chosen[:cap]


def official_suite(settings: Settings, benchmark: Literal["ifeval", "ifbench"]) -> list[EvalPrompt]:
    """The official benchmark's gradable prompts, the first `evaluation.report_prompts` by key."""
    from dynrubric.train.official_prompts import official_prompts

    chosen = [
        EvalPrompt(prompt=prompt, grader=OfficialGrader(benchmark, truth.passes))
        for prompt, truth in official_prompts(benchmark)
    ]
    chosen.sort(key=lambda e: e.prompt.key)
    return chosen[: settings.evaluation.report_prompts]


def suite_prompts(settings: Settings, suite: Suite, path: Path | None = None) -> list[EvalPrompt]:
    if suite in ("ifeval", "ifbench"):
        return official_suite(settings, suite)
    return bank_suite(settings, suite, path)


def heldout_prompts(settings: Settings, path: Path | None = None) -> list[EvalPrompt]:
    """The dev prompts with ground truth: what the round's guard reads (`path`: a file of the caller's)."""
    return bank_suite(settings, "dev", path)


def default_prompts_file() -> Path:
    from importlib import resources

    return Path(str(resources.files("dynrubric").joinpath("data", "prompts.jsonl")))


def decode_params(settings: Settings) -> SamplingParams:
    """The serving decode settings: what the users ask the router for."""
    e = settings.evaluation
    return SamplingParams(
        max_tokens=e.max_tokens or settings.loop.users_max_tokens,
        temperature=e.temperature,
        seed=settings.train.seed if e.temperature > 0 else None,
    )  # greedy needs no seed


def eval_key(prompts: Sequence[EvalPrompt], params: SamplingParams) -> str:
    h = hashlib.sha256(
        json.dumps(
            [[p.prompt.key for p in prompts], [p.grader.kind for p in prompts], params.max_tokens]
            + [params.temperature, params.seed]
        ).encode()
    )
    return h.hexdigest()[:16]


def sample_outcomes(
    engine: Engine,
    version: str,
    prompts: Sequence[EvalPrompt],
    params: SamplingParams,
    progress: Callable[[int], None] = lambda n: None,
    batch: int = 32,
) -> VersionOutcomes:
    """`engine`'s answers (it serves `version`) to `prompts`, graded."""
    responses: dict[str, str] = {}
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        outs = engine.generate([GenerationRequest(engine.render_chat(p.prompt.chat()), params) for p in chunk])
        for p, [out] in zip(chunk, outs, strict=True):
            responses[p.prompt.key] = out.text
        progress(len(chunk))
    return VersionOutcomes(
        version=version,
        eval_key=eval_key(prompts, params),
        scores={p.prompt.key: p.grader.score(responses[p.prompt.key]) for p in prompts},
        kinds={p.prompt.key: p.grader.kind for p in prompts},
        responses=responses,
    )


def paired_bootstrap(
    a: Sequence[float], b: Sequence[float], samples: int, confidence: float, seed: int = 0
) -> tuple[float, float, float]:
    """(mean(a - b), low, high): the percentile bootstrap CI of the mean paired difference."""
    if len(a) != len(b) or not a:
        raise ValueError("paired samples need equal, non-zero lengths")
    d = [x - y for x, y in zip(a, b, strict=True)]
    n = len(d)
    rng = random.Random(seed)
    means = sorted(sum(d[rng.randrange(n)] for _ in range(n)) / n for _ in range(samples))
    tail = (1.0 - confidence) / 2.0
    low = means[min(samples - 1, int(tail * samples))]
    high = means[min(samples - 1, int((1.0 - tail) * samples))]
    return sum(d) / n, low, high


def compare(
    version: VersionOutcomes, reference: VersionOutcomes, samples: int, confidence: float, kind: str | None = None
) -> Comparison:
    """`version` against `reference`, paired by prompt: on all prompts, or on those of `kind` (arithmetic,
    instruction, ...)."""
    if version.eval_key != reference.eval_key:
        raise DynrubricError(
            f"{version.version} and {reference.version} were evaluated on different prompts or decode settings",
            "evaluate both again with the same evaluation settings",
        )
    keys = sorted(k for k in version.scores if kind is None or version.kinds[k] == kind)
    ours, theirs = [version.scores[k] for k in keys], [reference.scores[k] for k in keys]
    delta, low, high = paired_bootstrap(ours, theirs, samples, confidence)
    return Comparison(
        version=version.version,
        reference=reference.version,
        prompts=len(keys),
        delta=delta,
        low=low,
        high=high,
        wins=sum(a > b for a, b in zip(ours, theirs, strict=True)),
        losses=sum(a < b for a, b in zip(ours, theirs, strict=True)),
        confidence=confidence,
    )


class OutcomeStore:
    """Each suite's and version's outcomes under `<train.run_dir>/groundtruth/<suite>/`, written atomically."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)

    def path(self, version: str, suite: Suite = "dev") -> Path:
        return self.dir / suite / f"{version}.json"

    def get(self, version: str, key: str, suite: Suite = "dev") -> VersionOutcomes | None:
        path = self.path(version, suite)
        if not path.is_file():
            return None
        try:
            outcomes = VersionOutcomes.model_validate_json(path.read_text())
        except ValidationError:  # written by an older dynrubric: sampled again
            return None
        return outcomes if outcomes.eval_key == key else None

    def put(self, outcomes: VersionOutcomes, suite: Suite = "dev") -> None:
        atomic.write_text(self.path(outcomes.version, suite), outcomes.model_dump_json())


def outcome_store(settings: Settings) -> OutcomeStore:
    return OutcomeStore(settings.train_run_dir() / "groundtruth")


def evaluate_suites(
    settings: Settings,
    engine: Engine,
    versions: Sequence[tuple[str, Path]],
    suites: Mapping[Suite, Sequence[EvalPrompt]],
    progress: Callable[[str, int], None] = lambda version, n: None,
) -> dict[Suite, dict[str, VersionOutcomes]]:
    """Each (version, weights dir)'s outcomes on each suite's prompts: from the store, else sampled on `engine`
    (loaded once per version, and left at the weights of the last version sampled) and stored."""
    params = decode_params(settings)
    store = outcome_store(settings)
    out: dict[Suite, dict[str, VersionOutcomes]] = {suite: {} for suite in suites}
    for version, path in versions:
        loaded = False
        for suite, prompts in suites.items():
            key = eval_key(prompts, params)
            outcomes = store.get(version, key, suite)
            if outcomes is None:
                if not loaded:
                    engine.load_weights(path, version)
                    loaded = True
                outcomes = sample_outcomes(
                    engine, version, prompts, params, partial(progress, version), settings.evaluation.decode_batch
                )
                store.put(outcomes, suite)
            out[suite][version] = outcomes
    return out


def evaluate_versions(
    settings: Settings,
    engine: Engine,
    versions: Sequence[tuple[str, Path]],
    progress: Callable[[str, int], None] = lambda version, n: None,
    prompts: Sequence[EvalPrompt] | None = None,
) -> dict[str, VersionOutcomes]:
    """Each (version, weights dir)'s outcomes on `prompts` (default: the dev suite), as `evaluate_suites`."""
    chosen = heldout_prompts(settings) if prompts is None else prompts
    return evaluate_suites(settings, engine, versions, {"dev": chosen}, progress)["dev"]


def report_suites(settings: Settings) -> dict[Suite, list[EvalPrompt]]:
    """The five reported figures' prompts (`evaluation.figures`); a figure with no prompt is left out."""
    suites = {suite: suite_prompts(settings, suite) for suite in FIGURES if suite in settings.evaluation.figures}
    return {suite: prompts for suite, prompts in suites.items() if prompts}


def figure(outcomes: dict[str, VersionOutcomes], candidate: str, parent: str, base: str, e: Settings) -> Figure:
    new = outcomes[candidate]
    ev = e.evaluation
    return Figure(
        prompts=len(new.scores),
        score={v: o.pass_rate() for v, o in outcomes.items()},
        vs_parent=compare(new, outcomes[parent], ev.bootstrap_samples, ev.confidence),
        vs_base=compare(new, outcomes[base], ev.bootstrap_samples, ev.confidence),
    )


def round_evidence(
    settings: Settings, engine: Engine, candidate: tuple[str, Path], parent: tuple[str, Path], base: tuple[str, Path]
) -> TruthEvidence:
    """A round's ground-truth evidence (eval.json's `groundtruth`): on the dev split (what the guard reads),
    pass rates of the candidate, its parent and the base, and the candidate's paired differences from both (and
    from the parent per kind of prompt);
    and the five reported figures (`figures`), which nothing decides on."""
    suites: dict[Suite, Sequence[EvalPrompt]] = {"dev": heldout_prompts(settings), **report_suites(settings)}
    versions = list(dict.fromkeys([candidate, parent, base]))
    outcomes = evaluate_suites(settings, engine, versions, suites)
    e = settings.evaluation
    dev = outcomes["dev"]
    new = dev[candidate[0]]
    return TruthEvidence(
        version=candidate[0],
        prompts=len(new.scores),
        pass_rate={v: o.pass_rate() for v, o in dev.items()},
        pass_rate_by_kind={v: o.by_kind() for v, o in dev.items()},
        vs_parent=compare(new, dev[parent[0]], e.bootstrap_samples, e.confidence),
        vs_base=compare(new, dev[base[0]], e.bootstrap_samples, e.confidence),
        vs_parent_by_kind={
            kind: compare(new, dev[parent[0]], e.bootstrap_samples, e.confidence, kind)
            for kind in sorted(set(new.kinds.values()))
        },
        figures={
            suite: figure(outcomes[suite], candidate[0], parent[0], base[0], settings)
            for suite in suites
            if suite != "dev"
        },
    )


def ground_truth_rates(settings: Settings, versions: Sequence[str]) -> dict[str, float | None]:
    """Each version's stored pass rate on the current dev prompts and decode settings (None: not evaluated)."""
    key = eval_key(heldout_prompts(settings), decode_params(settings))
    store = outcome_store(settings)
    return {v: (o.pass_rate() if (o := store.get(v, key)) is not None else None) for v in versions}
