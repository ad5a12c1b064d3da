"""Ground-truth evaluation of policy versions: is the loop learning?

Each version answers the same held-out prompts at the serving decode settings (greedy, the users'
`max_tokens`), and each answer is checked against the prompt's ground truth by the same function the
users and the judge use (rubric/groundtruth.py: official IFEval checkers, computed answers). The judge's
own reward never enters. The held-out prompts are those of `evaluation.prompts_file` (default: the
shipped prompt bank) that carry ground truth and whose key falls under `train.heldout_share`
(`prompts.heldout_bucket`): the rounds hold exactly these out of training, so no version ever trained on
them.

    pass(v)        = mean over prompts x of 1[v's answer to x passes x's ground truth]
    delta(v, u)    = pass(v) - pass(u), paired by prompt
    95% CI         = percentiles 2.5 / 97.5 of delta over `evaluation.bootstrap_samples` resamples of the
                     prompts with replacement (paired bootstrap: both versions keep their answers to
                     each resampled prompt)

Outcomes are kept per version (`<train.run_dir>/groundtruth/<version>.json`, keyed by the prompts and
decode settings), so each version is sampled once and any two can be compared later.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from dynrubric import atomic
from dynrubric.config import Settings
from dynrubric.engines.base import Engine, GenerationRequest, SamplingParams
from dynrubric.errors import DynrubricError
from dynrubric.rubric.groundtruth import GroundTruth, derive
from dynrubric.train.prompts import TrainPrompt, heldout_bucket, read_prompt_file
from dynrubric.train.records import Comparison, TruthEvidence


class EvalPrompt(BaseModel):
    model_config = ConfigDict(frozen=True)

    prompt: TrainPrompt
    truth: GroundTruth


class VersionOutcomes(BaseModel):
    """One version's answers to the held-out prompts and their verdicts."""

    model_config = ConfigDict(frozen=True)

    version: str
    eval_key: str  # which prompts and decode settings (outcomes of different keys are not comparable)
    passed: dict[str, bool]  # prompt key -> passes its ground truth
    kinds: dict[str, str]  # prompt key -> arithmetic | instruction
    responses: dict[str, str]

    def pass_rate(self, kind: str | None = None) -> float:
        keys = [k for k in self.passed if kind is None or self.kinds[k] == kind]
        return sum(self.passed[k] for k in keys) / len(keys) if keys else 0.0

    def by_kind(self) -> dict[str, float]:
        return {kind: self.pass_rate(kind) for kind in sorted(set(self.kinds.values()))}


def heldout_prompts(settings: Settings, path: Path | None = None) -> list[EvalPrompt]:
    """The held-out prompts with ground truth (module docstring), in key order, at most `evaluation.max_prompts`.
    `path`: every prompt with ground truth of that file instead (its owner vouches that none was trained on)."""
    source = path or settings.evaluation.prompts_file or default_prompts_file()
    chosen = []
    for p in read_prompt_file(source):
        truth = derive(p.question)
        if not truth.empty and (path is not None or heldout_bucket(p.key) < settings.train.heldout_share):
            chosen.append(EvalPrompt(prompt=p, truth=truth))
    chosen.sort(key=lambda e: e.prompt.key)
    if not chosen:
        raise DynrubricError(
            f"{source} has no held-out prompt with ground truth (train.heldout_share {settings.train.heldout_share})",
            "pass a file of checkable prompts (evaluation.prompts_file)",
        )
    return chosen[: settings.evaluation.max_prompts]


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
        json.dumps([[p.prompt.key for p in prompts], params.max_tokens, params.temperature, params.seed]).encode()
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
    """`engine`'s answers (it serves `version`) to `prompts`, checked."""
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
        passed={p.prompt.key: p.truth.passes(responses[p.prompt.key]) for p in prompts},
        kinds={p.prompt.key: p.truth.kind for p in prompts},
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


def compare(version: VersionOutcomes, reference: VersionOutcomes, samples: int, confidence: float) -> Comparison:
    if version.eval_key != reference.eval_key:
        raise DynrubricError(
            f"{version.version} and {reference.version} were evaluated on different prompts or decode settings",
            "evaluate both again with the same evaluation settings",
        )
    keys = sorted(version.passed)
    delta, low, high = paired_bootstrap(
        [float(version.passed[k]) for k in keys], [float(reference.passed[k]) for k in keys], samples, confidence
    )
    return Comparison(
        version=version.version, reference=reference.version, prompts=len(keys), delta=delta, low=low, high=high
    )


class OutcomeStore:
    """Each version's outcomes under `<train.run_dir>/groundtruth/`, written atomically."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)

    def path(self, version: str) -> Path:
        return self.dir / f"{version}.json"

    def get(self, version: str, key: str) -> VersionOutcomes | None:
        path = self.path(version)
        if not path.is_file():
            return None
        outcomes = VersionOutcomes.model_validate_json(path.read_text())
        return outcomes if outcomes.eval_key == key else None

    def put(self, outcomes: VersionOutcomes) -> None:
        atomic.write_text(self.path(outcomes.version), outcomes.model_dump_json())


def outcome_store(settings: Settings) -> OutcomeStore:
    return OutcomeStore(settings.train_run_dir() / "groundtruth")


def evaluate_versions(
    settings: Settings,
    engine: Engine,
    versions: Sequence[tuple[str, Path]],
    progress: Callable[[str, int], None] = lambda version, n: None,
    prompts: Sequence[EvalPrompt] | None = None,
) -> dict[str, VersionOutcomes]:
    """Each (version, weights dir)'s outcomes on `prompts` (default: `heldout_prompts`): from the store, else
    sampled on `engine` (which is left at the weights of the last version sampled) and stored."""
    prompts = heldout_prompts(settings) if prompts is None else prompts
    params = decode_params(settings)
    key = eval_key(prompts, params)
    store = outcome_store(settings)
    out = {}
    for version, path in versions:
        outcomes = store.get(version, key)
        if outcomes is None:
            engine.load_weights(path, version)
            outcomes = sample_outcomes(engine, version, prompts, params, partial(progress, version))
            store.put(outcomes)
        out[version] = outcomes
    return out


def round_evidence(
    settings: Settings, engine: Engine, candidate: tuple[str, Path], parent: tuple[str, Path], base: tuple[str, Path]
) -> TruthEvidence:
    """A round's ground-truth evidence (eval.json's `groundtruth`): pass rates of the candidate, its parent and
    the base, and the candidate's paired differences from both."""
    outcomes = evaluate_versions(settings, engine, list(dict.fromkeys([candidate, parent, base])))
    e = settings.evaluation
    new = outcomes[candidate[0]]
    return TruthEvidence(
        version=candidate[0],
        prompts=len(new.passed),
        pass_rate={v: o.pass_rate() for v, o in outcomes.items()},
        pass_rate_by_kind={v: o.by_kind() for v, o in outcomes.items()},
        vs_parent=compare(new, outcomes[parent[0]], e.bootstrap_samples, e.confidence),
        vs_base=compare(new, outcomes[base[0]], e.bootstrap_samples, e.confidence),
    )


def ground_truth_rates(settings: Settings, versions: Sequence[str]) -> dict[str, float | None]:
    """Each version's stored pass rate on the current held-out prompts and decode settings (None: not evaluated)."""
    key = eval_key(heldout_prompts(settings), decode_params(settings))
    store = outcome_store(settings)
    return {v: (o.pass_rate() if (o := store.get(v, key)) is not None else None) for v in versions}
