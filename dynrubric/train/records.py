"""The run's records, typed and versioned: what the trainer writes under `train.run_dir` and every reader
(the report, the run page, the loop, the CLI, the tests) reads back.

    runlog.jsonl               one line per step (`PolicyStepLine`, `GeneratorStepLine`), per round
                               (`RoundLine`: the summary without its steps) and per worker failure
    rounds/NNNN/summary.json   `RoundSummary` (the embedded trainer) or `OpenRLHFSummary`
    rounds/NNNN/eval.json      `Evaluation`: the guards' evidence
    rounds/NNNN/steps/NNNN/history.json   the round's `Step`s so far

Each file's record carries `schema_version` (`RECORD_VERSION`; the steps inside a history or a summary are
versioned by it). Records are written with `model_dump` and read back with `read_record` / `parse_line`:
unknown fields are rejected, so a record of another version, or one with a field missing, renamed or of the
wrong type, is a `DynrubricError` naming the file (and line), the field and what to do. A change that records
already written cannot be read under (a field removed, renamed, retyped, or added without a default) is a new
`RECORD_VERSION`; a field added with a default that means "not recorded" keeps the version, so older records of
it still read (`TruthEvidence.vs_parent_by_kind`).

This module imports no torch: `dynrubric report` reads the run log without it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from dynrubric import atomic
from dynrubric.errors import DynrubricError
from dynrubric.jsonl import split_lines

RECORD_VERSION = 2  # 2: TruthEvidence.figures (the five reported figures of the test split and benchmarks)


class Part(BaseModel):
    """A piece of a record: unknown fields are rejected (a new field means a new RECORD_VERSION)."""

    model_config = ConfigDict(extra="forbid")


class Record(Part):
    """A record a file holds on its own (a run-log line, a summary, an evaluation)."""

    schema_version: int = Field(default=RECORD_VERSION, ge=RECORD_VERSION, le=RECORD_VERSION)


# ==================================================================== steps
class SetScores(Part):
    """One scored candidate set of a policy step: candidates' and calibration answers' scores under its rubric."""

    scores: list[float]
    calibration_scores: list[float] | None
    trusted: bool
    overruled_items: int


class Fallbacks(Part):
    parse_failures: int  # generator tries that gave no valid rubric
    prompt_only: int
    generic: int
    hard_verdict: int


class StepBase(Part):
    """What every step records: when, where its time went, and its GRPO batch (train/grpo.py `StepStats`)."""

    step: int
    time: float
    stage_seconds: dict[str, float]
    loss: float
    pg_loss: float
    kl: float
    clip_ratio: float
    grad_norm: float
    reward_mean: float
    sets: int
    no_gradient_sets: int
    samples: int
    tokens: int
    updated: bool
    nonfinite: bool
    updates: int
    sampler_tokens: int
    sampler_log_ratio: float | None
    sampler_capped: float | None
    lr: float | None = None  # the learning rate of the step's last update (None: none applied, or not recorded)


class PolicyStep(StepBase):
    """A policy step: its sets' score-gap diagnostics, trust and rubric sources."""

    phase: Literal["policy"] = "policy"
    mean_gap: float
    tie_rate: float
    nonsplit_share: float
    untrusted_sets: int
    set_scores: list[SetScores]
    rubric_sources: dict[str, int]
    fallbacks: Fallbacks
    collapse: bool
    # the step's draws of candidate sets (train.dynamic_sampling; None: not recorded, a record from before them):
    # the set fields above cover every set drawn, the GRPO fields (sets, no_gradient_sets, ...) the batch trained
    draws: int | None = None
    sets_drawn: int | None = None
    sets_kept: int | None = None  # sets with a real spread (trusted, not tied) in the batch
    kept_share: float | None = None  # sets_kept / sets_drawn


class GeneratorStep(StepBase):
    """A generator step: its batch's rubric rewards (train/coevolve.py `GeneratorBatchStats`, `gen_` prefixed)."""

    phase: Literal["generator"] = "generator"
    gen_sets: int
    gen_rubrics: int
    gen_parsed: int
    gen_anchored_sets: int
    gen_r_disc_mean: float
    gen_r_anchor_mean: float
    gen_user_ranked_sets: int
    gen_judge_user_pairs: int
    gen_judge_user_agreement: float | None


Step = Annotated[PolicyStep | GeneratorStep, Field(discriminator="phase")]
STEPS: TypeAdapter[list[Step]] = TypeAdapter(list[Step])


# ==================================================================== a round's evaluation and outcome
def delta_ci(delta: float, low: float, high: float, confidence: float) -> str:
    """'+0.050 (95% CI +0.010..+0.090)': a paired difference and its CI, at the level the CI was computed at."""
    return f"{delta:+.3f} ({confidence:.0%} CI {low:+.3f}..{high:+.3f})"


class Comparison(Part):
    """`version` against `reference` on the prompts both answered: paired difference and its bootstrap CI."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: str
    reference: str
    prompts: int
    delta: float
    low: float
    high: float
    # the prompts on which `version` scored above / below `reference` (the sign test's counts; guards.worse).
    # None in records written before they were counted: the guard then reads the CI alone
    wins: int | None = None
    losses: int | None = None
    confidence: float = 0.95  # the two-sided level of [low, high] (evaluation.confidence; older records: 0.95)

    def delta_ci(self) -> str:
        return delta_ci(self.delta, self.low, self.high, self.confidence)

    def line(self) -> str:
        return f"{self.delta_ci()} vs {self.reference}"


class Figure(Part):
    """One reported figure (a test slice or a benchmark) of a candidate, its parent and the base."""

    prompts: int
    score: dict[str, float]  # version -> mean score (pass rate; open quality for `open`)
    vs_parent: Comparison
    vs_base: Comparison


class TruthEvidence(Part):
    """A round's ground truth (train/policy_eval.py `round_evidence`): on the dev split, which the guard reads,
    pass rates of the candidate (`version`), its parent and the base, and the candidate's paired differences
    from both, in total and per kind of prompt (`vs_parent_by_kind`: arithmetic, instruction, ...; empty in
    records written before it, which the guard then reads as "not measured"); `figures`, the five reported
    figures (test seen and unseen types, IFEval, IFBench, open quality), which nothing decides on."""

    version: str
    prompts: int
    pass_rate: dict[str, float]  # version -> share of dev prompts it passes
    pass_rate_by_kind: dict[str, dict[str, float]]
    vs_parent: Comparison
    vs_base: Comparison
    figures: dict[str, Figure] = Field(default_factory=dict)
    vs_parent_by_kind: dict[str, Comparison] = Field(default_factory=dict)


class Evaluation(Record):
    """The guards' evidence (eval.json): the candidate against its parent on the held-out prompts."""

    groundtruth: TruthEvidence | None
    heldout_prompts: int
    heldout_keys: list[str]
    reward_parent: float
    reward_new: float
    kl_to_parent: float
    kl_to_base: float
    base: str
    judge: dict[str, str]  # role -> the engine version that judged
    mean_gap: float


class Guard(Part):
    accepted: bool
    reason: str | None  # None: accepted; a guard's name (train/guards.py), or "no_update"
    detail: str


class Collapse(Part):
    fired: bool
    note: str | None


class RoundOutcome(Record):
    """What every round records, whichever trainer ran it."""

    round: int
    parent: str
    version: str | None  # None: nothing registered
    state: str  # the checkpoint's state, or "unregistered"
    guard: Guard
    eval: Evaluation | None  # None: the round registered nothing, so nothing was evaluated
    refresh: str | None  # why the round started with a generator phase
    collapse: Collapse
    watermark_before: str | None
    watermark_after: str | None
    prompts: int


class EmbeddedOutcome(RoundOutcome):
    """A round of the embedded trainer (train/rounds.py), without its steps."""

    trainer: Literal["embedded"] = "embedded"
    metrics: dict[str, Any]  # the checkpoint's metrics in the registry (empty: nothing registered)
    phases: dict[str, int]  # steps per phase
    seconds: float
    stage_seconds: dict[str, float]  # where the round's time went, in the order it is spent
    prompts_needed: int | None = None  # distinct new prompts the round needed (train.min_new_prompts_per_set)


class RoundSummary(EmbeddedOutcome):
    """summary.json of an embedded round: written last, a round with one is complete."""

    steps: list[Step]


class OpenRLHFSummary(RoundOutcome):
    """summary.json of a round trained by OpenRLHF (train/openrlhf.py): no steps of ours."""

    trainer: Literal["openrlhf"] = "openrlhf"


# ==================================================================== run-log lines
class PolicyStepLine(PolicyStep, Record):
    kind: Literal["step"] = "step"
    key: str  # round/R/step/S: a resumed round logs a step once
    round: int


class GeneratorStepLine(GeneratorStep, Record):
    kind: Literal["step"] = "step"
    key: str
    round: int


class RoundLine(EmbeddedOutcome):
    kind: Literal["round"] = "round"
    key: str  # round/R


class WorkerFailureLine(Record):
    """A round worker (Ray actor, node) died; `resumed`: the round went on from its last published step."""

    kind: Literal["worker_failure"] = "worker_failure"
    key: str
    round: int
    time: float
    error: str
    resumed: bool


RunLogLine = PolicyStepLine | GeneratorStepLine | RoundLine | WorkerFailureLine


def step_line(round_id: int, step: PolicyStep | GeneratorStep) -> PolicyStepLine | GeneratorStepLine:
    """A step's run-log line."""
    line = PolicyStepLine if isinstance(step, PolicyStep) else GeneratorStepLine
    return line(key=f"round/{round_id}/step/{step.step}", round=round_id, **dict(step))


def round_line(summary: RoundSummary) -> RoundLine:
    """A round's run-log line: its summary without the steps (they have lines of their own)."""
    return RoundLine(key=f"round/{summary.round}", **{k: v for k, v in summary if k not in ("steps", "kind")})


# ==================================================================== reading and writing
R = TypeVar("R", bound=BaseModel)


def dumps(record: BaseModel | Sequence[BaseModel], indent: int | None = None) -> str:
    """A record (or a list of them) as JSON; NaN and infinity are refused, as JSON has neither."""
    data = [r.model_dump() for r in record] if isinstance(record, Sequence) else record.model_dump()
    return json.dumps(data, indent=indent, allow_nan=False, default=float)


def write_record(path: Path, record: BaseModel) -> None:
    atomic.write_text(path, dumps(record, indent=2))


def check_version(doc: Any, where: str) -> None:
    """Refuse a record of another RECORD_VERSION before its fields are read."""
    found = doc.get("schema_version") if isinstance(doc, dict) else None
    if found != RECORD_VERSION:
        raise DynrubricError(
            f"{where} is a run record of schema_version {found if found is not None else 'none (unversioned)'}; "
            f"this dynrubric reads version {RECORD_VERSION}",
            "it was written by another dynrubric version: read it with that version, or train into a fresh "
            "run dir (train.run_dir or paths.state_dir)",
        )


def validated(adapter: TypeAdapter[Any] | type[BaseModel], doc: Any, where: str) -> Any:
    """`doc` validated, or a DynrubricError naming `where` and each field that is missing or wrong."""
    try:
        if isinstance(adapter, TypeAdapter):
            return adapter.validate_python(doc)
        return adapter.model_validate(doc)
    except ValidationError as e:
        fields = "; ".join(
            f"field '{'.'.join(str(p) for p in err['loc'])}': {err['msg'].lower()}" for err in e.errors()[:5]
        )
        raise DynrubricError(
            f"{where} does not match run record version {RECORD_VERSION}: {fields}",
            "the file was changed by hand or by another dynrubric version: restore it, or train into a fresh "
            "run dir (train.run_dir or paths.state_dir)",
        ) from None


def load_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise DynrubricError(f"{path} is not JSON ({e})", "restore the file, or run the round again") from None


def read_record(path: Path, model: type[R]) -> R:
    """The record `path` holds, checked: its version, then every field."""
    doc = load_json(path)
    check_version(doc, str(path))
    out: R = validated(model, doc, str(path))
    return out


def read_summary(path: Path) -> RoundSummary | OpenRLHFSummary:
    """A round's summary.json, of either trainer (its `trainer` field names the model)."""
    doc = load_json(path)
    check_version(doc, str(path))
    model = OpenRLHFSummary if doc.get("trainer") == "openrlhf" else RoundSummary
    summary: RoundSummary | OpenRLHFSummary = validated(model, doc, str(path))
    return summary


def read_steps(path: Path) -> list[PolicyStep | GeneratorStep]:
    """A published step's history.json: the round's steps so far."""
    steps: list[PolicyStep | GeneratorStep] = validated(STEPS, load_json(path), str(path))
    return steps


def write_steps(path: Path, steps: Sequence[PolicyStep | GeneratorStep]) -> None:
    Path(path).write_text(dumps(steps))


def parse_line(doc: Any, where: str) -> RunLogLine:
    """One decoded run-log line as its record: the line's `kind` (and a step's `phase`) names the model."""
    check_version(doc, where)
    kind, phase = doc.get("kind"), doc.get("phase")
    model: type[RunLogLine]
    if kind == "step":
        model = GeneratorStepLine if phase == "generator" else PolicyStepLine
    elif kind == "round":
        model = RoundLine
    elif kind == "worker_failure":
        model = WorkerFailureLine
    else:
        raise DynrubricError(
            f"{where} has kind {kind!r}: not a run-log record (step, round, worker_failure)",
            "restore the run log, or train into a fresh run dir",
        )
    line: RunLogLine = validated(model, doc, where)
    return line


RUNLOG = "runlog.jsonl"  # under train.run_dir: the trainer appends, the report and the CLI read


class RunLogFile:
    """runlog.jsonl: append-only; `append` skips keys already present, so a resumed round never logs a step
    twice. A torn last line (a crash mid-write) is skipped; any other line must be a record of this version."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def _decoded(self) -> list[tuple[int, Any]]:
        if not self.path.exists():
            return []
        out = []
        for n, line in enumerate(split_lines(self.path.read_text()), 1):
            if not line.strip():
                continue
            try:
                out.append((n, json.loads(line)))
            except json.JSONDecodeError:  # a torn last line after a crash
                continue
        return out

    def keys(self) -> set[str]:
        return {doc["key"] for _, doc in self._decoded() if isinstance(doc, dict) and "key" in doc}

    def append(self, records: Sequence[RunLogLine]) -> None:
        known = self.keys()
        new = [r for r in records if r.key not in known]
        if not new:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            for r in new:
                f.write(dumps(r) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def records(self) -> list[RunLogLine]:
        return [parse_line(doc, f"{self.path} line {n}") for n, doc in self._decoded()]
