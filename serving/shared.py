"""The router's split and counters, shared by every router replica through the registry database (issue 37).

With several router replicas behind one Service (an HPA), the controller's POST reaches one pod and its
`GET /v1/router/state` another. So the split (the experiment id, the canary weight, the weights each variant
should serve) is a row in the registry's database (SQLite or PostgreSQL, through `Registry.transaction`):
the replica that takes a control call writes it with a sequence number one higher, and every replica reads
it every `serving.sync_interval_s` and adopts a higher sequence (a pod started mid-rollout adopts it before
it serves). Each replica also writes its own counters per experiment and arm there; a replica's state
reports its live counters plus the others' last written ones, so the gate sees every replica's requests
(up to one sync interval late for the others'). A replica that dies keeps its last written counters:
what it counted stays counted.

The database is the only shared thing: a router pod dying mid-rollout loses nothing the others need.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from dynrubric.registry import SCHEMA_LOCK

SPLIT_SCHEMA = """
CREATE TABLE IF NOT EXISTS router_split (
    id INTEGER PRIMARY KEY, seq BIGINT NOT NULL, experiment TEXT NOT NULL,
    canary_weight DOUBLE PRECISION NOT NULL, desired TEXT NOT NULL, updated_at DOUBLE PRECISION NOT NULL
)
"""
COUNTERS_SCHEMA = """
CREATE TABLE IF NOT EXISTS router_counters (
    experiment TEXT NOT NULL, replica TEXT NOT NULL, variant TEXT NOT NULL,
    requests BIGINT NOT NULL, errors BIGINT NOT NULL, settled BIGINT NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (experiment, replica, variant)
)
"""
FIELDS = ("requests", "errors", "settled")


@dataclass(frozen=True)
class Split:
    seq: int
    experiment: str
    canary_weight: float
    desired: dict[str, dict[str, str]]  # variant -> {"version", "path"}


class SharedSplit:
    """The split and every replica's counters in the registry's database (`registry`: a dynrubric Registry)."""

    def __init__(self, registry: Any):
        self.registry = registry
        with registry.transaction(write=True, lock=SCHEMA_LOCK) as cur:  # replicas start together
            cur.execute(SPLIT_SCHEMA)
            cur.execute(COUNTERS_SCHEMA)

    def read(self) -> Split | None:
        with self.registry.transaction() as cur:
            cur.execute("SELECT seq, experiment, canary_weight, desired FROM router_split WHERE id = 1")
            row = cur.fetchone()
        return None if row is None else Split(int(row[0]), row[1], float(row[2]), json.loads(row[3]))

    def write(self, experiment: str, canary_weight: float, desired: dict[str, dict[str, str]]) -> Split:
        """Record a new split; returns it with its sequence number (one above the last)."""
        with self.registry.transaction(write=True, lock="router_split") as cur:
            cur.execute("SELECT seq FROM router_split WHERE id = 1")
            row = cur.fetchone()
            seq = 1 if row is None else int(row[0]) + 1
            values = (experiment, float(canary_weight), json.dumps(desired, sort_keys=True), time.time())
            if row is None:
                cur.execute(
                    "INSERT INTO router_split (id, seq, experiment, canary_weight, desired, updated_at) "
                    "VALUES (1, ?, ?, ?, ?, ?)",
                    (seq, *values),
                )
            else:
                cur.execute(
                    "UPDATE router_split SET seq = ?, experiment = ?, canary_weight = ?, desired = ?, updated_at = ? "
                    "WHERE id = 1",
                    (seq, *values),
                )
        return Split(seq, experiment, float(canary_weight), desired)

    def flush(self, replica: str, counters: dict[str, dict[str, dict[str, int]]]) -> None:
        """Write this replica's counters: experiment -> variant -> {requests, errors, settled}."""
        rows = [
            (experiment, replica, variant, *(int(c[f]) for f in FIELDS), time.time())
            for experiment, arms in counters.items()
            if experiment
            for variant, c in arms.items()
        ]
        if not rows:
            return
        with self.registry.transaction(write=True, lock="router_counters") as cur:
            for row in rows:
                cur.execute(
                    "INSERT INTO router_counters (experiment, replica, variant, requests, errors, settled, updated_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (experiment, replica, variant) DO UPDATE SET "
                    "requests = excluded.requests, errors = excluded.errors, settled = excluded.settled, "
                    "updated_at = excluded.updated_at",
                    row,
                )

    def others(self, replica: str) -> dict[str, dict[str, dict[str, int]]]:
        """The other replicas' last written counters, summed: experiment -> variant -> {requests, errors, settled}."""
        with self.registry.transaction() as cur:
            cur.execute(
                "SELECT experiment, variant, SUM(requests), SUM(errors), SUM(settled) FROM router_counters "
                "WHERE replica <> ? GROUP BY experiment, variant",
                (replica,),
            )
            rows = cur.fetchall()
        out: dict[str, dict[str, dict[str, int]]] = {}
        for experiment, variant, *sums in rows:
            out.setdefault(experiment, {})[variant] = {f: int(v) for f, v in zip(FIELDS, sums, strict=True)}
        return out
