"""Bulk judging on Ray Data (`dynrubric score INPUT --ray`): many candidate sets, a pool of judge actors,
scored Parquet out. The offline path for re-scoring logged traffic with a new evaluator.

Input, as a Ray Dataset of sets `{prompt, responses}`:

- a JSONL sets file (`{"prompt", "responses": [...]}` per line, validated like `dynrubric score`);
- a Parquet file or directory with the columns `prompt` (string) and `responses` (list of strings);
- the replay store's query log (its registered shards only): every logged response to the same
  prompt (same prompt key, across policy versions) forms one set, in the order the responses were logged.

Each set is scored by `SetScorer` in `map_batches` over an actor pool of `ray.judges` actors, each
holding its rubric writer and verifier engines once. A set's rubric seed is derived from its content
(`set_seed`), so its scores are the same whichever actor scores it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dynrubric import atomic
from dynrubric.config import Settings
from dynrubric.rubric.evaluator import Evaluator, ScoredSet
from dynrubric.seeds import set_seed

SCORED_SCHEMA = pa.schema(
    [
        ("prompt_key", pa.string()),
        ("prompt", pa.string()),
        ("responses", pa.list_(pa.string())),
        ("scores", pa.list_(pa.float64())),
        ("rubric_source", pa.string()),
        ("rubric", pa.string()),  # JSON: the items
        ("verdicts", pa.string()),  # JSON: M x K
        ("mean_abs_gap", pa.float64()),
        ("tie_rate", pa.float64()),
        ("nonsplit_share", pa.float64()),
        ("trusted", pa.bool_()),
        ("hard_verdict_fallbacks", pa.int64()),
    ]
)


def scored_row(prompt_key: str | None, s: ScoredSet) -> dict[str, Any]:
    return {
        "prompt_key": prompt_key,
        "prompt": s.prompt,
        "responses": s.responses,
        "scores": s.scores,
        "rubric_source": s.rubric_source,
        "rubric": json.dumps([i.model_dump() for i in s.rubric.items]),
        "verdicts": json.dumps(s.verdicts),
        "mean_abs_gap": s.gaps.mean_abs_gap,
        "tie_rate": s.gaps.tie_rate,
        "nonsplit_share": s.gaps.nonsplit_share,
        "trusted": s.trusted,
        "hard_verdict_fallbacks": s.hard_verdict_fallbacks,
    }


class SetScorer:
    """The `map_batches` callable of one judge actor: its engines are built once, in the actor."""

    def __init__(self, settings: Settings):
        from dynrubric.engines import judge_engines
        from dynrubric.ray_cluster import use_cores

        use_cores(settings.engine.threads, sharers=settings.ray.judges)  # the pool's judges work at once
        self.settings = settings
        self.generator, self.verifier = judge_engines(settings)
        self.evaluator = Evaluator(self.generator, self.verifier, settings.rubric)

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[Any]]:
        rows: dict[str, list[Any]] = {name: [] for name in SCORED_SCHEMA.names}
        keys = batch.get("prompt_key")
        for i, (prompt, responses) in enumerate(zip(batch["prompt"], batch["responses"], strict=True)):
            responses = [str(r) for r in responses]
            [scored] = self.evaluator.score_sets(
                [str(prompt)], [responses], seed=set_seed(self.settings.rubric.seed, str(prompt), responses)
            )
            for name, value in scored_row(None if keys is None else keys[i], scored).items():
                rows[name].append(value)
        return rows


def replay_sets(shards: Sequence[Path]) -> Any:  # a ray.data.Dataset (ray is untyped)
    """A Dataset of `{prompt_key, prompt, responses}`: the query-log shards' responses grouped by prompt key."""
    import ray.data

    def to_set(group: dict[str, Any]) -> dict[str, list[Any]]:
        return {
            "prompt_key": [str(group["prompt_key"][0])],
            "prompt": [str(group["prompt_text"][0])],
            "responses": [[str(r) for r in group["response"]]],
        }

    rows = ray.data.read_parquet([str(p) for p in shards], columns=["prompt_key", "prompt_text", "response", "ts"])
    return rows.sort(["prompt_key", "ts"]).groupby("prompt_key").map_groups(to_set, batch_format="numpy")


def file_sets(path: Path, read_jsonl: Callable[[Path], list[tuple[str, list[str]]]]) -> Any:  # a ray.data.Dataset
    """A Dataset of `{prompt, responses}` from a JSONL sets file or Parquet with those columns."""
    import ray.data

    if path.suffix == ".jsonl":
        return ray.data.from_items([{"prompt": p, "responses": r} for p, r in read_jsonl(path)])
    return ray.data.read_parquet(str(path), columns=["prompt", "responses"])


def score_dataset(settings: Settings, sets: Any, advance: Callable[[int], None]) -> Iterator[dict[str, Any]]:
    """Scored rows of `sets` (a Dataset), in input order, scored on `ray.judges` actors; `advance(1)`
    per set as its row arrives."""
    import ray.data

    scored = sets.map_batches(
        SetScorer,
        fn_constructor_args=(settings,),
        batch_size=1,
        compute=ray.data.ActorPoolStrategy(size=settings.ray.judges),
        num_cpus=settings.ray.actor_cpus,
    )
    for row in scored.iter_rows():
        advance(1)
        yield row


def write_scored(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """The scored sets as one Parquet file, written atomically."""
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(list(rows), schema=SCORED_SCHEMA), sink)
    atomic.write_bytes(path, sink.getvalue().to_pybytes())
