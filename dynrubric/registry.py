"""The checkpoint registry: every policy version, its lineage, its weights and what happened to it.

State lives in SQLite (default, one file) or PostgreSQL (a `postgresql://` URL, through psycopg).
The same database holds the rollout controller's table (serving/rollout.py), through `transaction`.
Weights live in a storage directory beside the database: `register` copies a model dir into a hidden
`<storage>/.staging/` dir, fsyncs it, renames it to `<storage>/<version>/` and inserts the row in one
transaction. A crash leaves either nothing visible, or an unreferenced complete directory that the
next `register` of that version replaces; a row always points at a whole checkpoint.

States: candidate -> canary -> stable -> retired; any state may become rejected, which is final; a
retired version may be promoted again (a rollback). At most one version is stable; `promote` retires
the previous one in the same transaction.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from dynrubric import atomic, sqlite
from dynrubric.errors import DynrubricError

VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


class CheckpointState(str, Enum):  # noqa: UP042 - StrEnum changes str() and format() of a member
    candidate = "candidate"
    canary = "canary"
    stable = "stable"
    rejected = "rejected"
    retired = "retired"


# Which states a version may move to with `set_state` (stable only through `promote`).
TRANSITIONS: dict[CheckpointState, frozenset[CheckpointState]] = {
    CheckpointState.candidate: frozenset({CheckpointState.canary, CheckpointState.rejected}),
    CheckpointState.canary: frozenset({CheckpointState.candidate, CheckpointState.rejected}),
    CheckpointState.stable: frozenset({CheckpointState.retired, CheckpointState.rejected}),
    CheckpointState.retired: frozenset({CheckpointState.rejected}),
    CheckpointState.rejected: frozenset(),
}
PROMOTABLE = frozenset({CheckpointState.candidate, CheckpointState.canary, CheckpointState.retired})


@dataclass(frozen=True)
class Checkpoint:
    version: str
    parent: str | None
    round: int | None
    path: Path
    weights_sha256: str
    metrics: dict[str, Any] = field(default_factory=dict)
    state: CheckpointState = CheckpointState.candidate
    reason: str | None = None
    created_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "parent": self.parent,
            "round": self.round,
            "path": str(self.path),
            "weights_sha256": self.weights_sha256,
            "metrics": self.metrics,
            "state": self.state.value,
            "reason": self.reason,
            "created_at": self.created_at,
        }


def weights_sha256(model_dir: Path) -> str:
    """SHA-256 over the weight files of a model dir (names and bytes, in name order)."""
    model_dir = Path(model_dir)
    files = sorted(p for p in model_dir.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not files:
        raise DynrubricError(
            f"{model_dir} holds no weight files ({', '.join(WEIGHT_SUFFIXES)})",
            "pass a directory written by save_pretrained",
        )
    h = hashlib.sha256()
    for p in files:
        h.update(str(p.relative_to(model_dir)).encode() + b"\0")
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


SCHEMA = """
CREATE TABLE IF NOT EXISTS checkpoints (
    seq {seq},
    version TEXT NOT NULL UNIQUE,
    parent TEXT,
    round INTEGER,
    path TEXT NOT NULL,
    weights_sha256 TEXT NOT NULL,
    metrics TEXT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT,
    created_at DOUBLE PRECISION NOT NULL
)
"""
COLUMNS = "version, parent, round, path, weights_sha256, metrics, state, reason, created_at"
# `transaction(write=True, lock=SCHEMA_LOCK)`: a transaction that creates tables. PostgreSQL does not serialise
# `CREATE TABLE IF NOT EXISTS` of one table in two sessions (the second fails with a unique violation in pg_type),
# and the processes that create them start together (the router Deployment's replicas); they take one advisory
# lock first. SQLite's write transactions are serialised already.
SCHEMA_LOCK = "schema"
_SCHEMA_LOCK_KEY = 0x6479_7275_6272_6963  # the bytes of "dyrubric": any fixed bigint the project owns


class Registry:
    """Checkpoints by version. `url_or_path`: a SQLite file path, or a `postgresql://` URL.

    `storage_dir` holds the weights; by default `checkpoints/` beside the SQLite file (required
    for PostgreSQL, whose database lives elsewhere).
    """

    def __init__(self, url_or_path: str | Path, storage_dir: Path | None = None):
        target = str(url_or_path)
        self._pg = target.startswith(("postgresql://", "postgres://"))
        if self._pg:
            try:
                import psycopg  # noqa: F401
            except ImportError:
                raise DynrubricError(
                    "the registry URL is PostgreSQL but psycopg is not installed",
                    "pip install 'dynrubric[postgres]', or use a SQLite path (registry.path)",
                ) from None
            if storage_dir is None:
                raise DynrubricError(
                    "a PostgreSQL registry needs a storage directory for the weights",
                    "set registry.storage_dir",
                )
            self._url = target
        else:
            self._db = Path(target).expanduser().resolve()
            self._db.parent.mkdir(parents=True, exist_ok=True)
        self.storage_dir = Path(storage_dir or self._db.parent / "checkpoints").expanduser().resolve()
        self._staging = self.storage_dir / ".staging"
        try:
            self._staging.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a reader's read-only mount (the router, the rollout Job in k8s): it never registers
            if e.errno not in (errno.EROFS, errno.EACCES):
                raise
        with self._tx(write=True, lock=SCHEMA_LOCK) as cur:
            seq = "BIGSERIAL PRIMARY KEY" if self._pg else "INTEGER PRIMARY KEY AUTOINCREMENT"
            cur.execute(SCHEMA.format(seq=seq))

    # ------------------------------------------------------------ connections
    @contextmanager
    def _tx(self, write: bool = False, lock: str | None = "checkpoints") -> Iterator[Any]:
        """One transaction (writes serialised across processes); commit on success, else roll back.
        PostgreSQL serialises writers by locking `lock`; SQLite's writers hold the database's write lock."""
        if self._pg:
            import psycopg

            with psycopg.connect(self._url) as conn, conn.cursor() as cur:  # commits on clean exit
                if write and lock == SCHEMA_LOCK:
                    cur.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK_KEY,))
                elif write and lock:
                    cur.execute(f"LOCK TABLE {lock} IN EXCLUSIVE MODE")
                yield _PgCursor(cur)
            return
        with sqlite.transaction(self._db, write) as cur:
            yield cur

    def transaction(self, write: bool = False, lock: str | None = None) -> Any:
        """A transaction on the registry's database for the tables that live beside `checkpoints` (the
        rollouts): `?` placeholders on both backends; `lock` names the table whose writers it serialises, or is
        SCHEMA_LOCK for a transaction that creates tables."""
        return self._tx(write, lock)

    # ------------------------------------------------------------ reads
    def _row(self, row: tuple) -> Checkpoint:
        version, parent, rnd, path, sha, metrics, state, reason, created = row
        return Checkpoint(
            version=version,
            parent=parent,
            round=rnd,
            path=Path(path),
            weights_sha256=sha,
            metrics=json.loads(metrics),
            state=CheckpointState(state),
            reason=reason,
            created_at=float(created),
        )

    def _find(self, cur: Any, version: str) -> Checkpoint | None:
        cur.execute(f"SELECT {COLUMNS} FROM checkpoints WHERE version = ?", (version,))
        row = cur.fetchone()
        return self._row(row) if row else None

    def _get(self, cur: Any, version: str) -> Checkpoint:
        ckpt = self._find(cur, version)
        if ckpt is None:
            raise DynrubricError(
                f"checkpoint version {version!r} is not in the registry",
                "`dynrubric registry list` shows the known versions",
            )
        return ckpt

    def get(self, version: str) -> Checkpoint:
        with self._tx() as cur:
            return self._get(cur, version)

    def find(self, version: str) -> Checkpoint | None:
        with self._tx() as cur:
            return self._find(cur, version)

    def list(self) -> list[Checkpoint]:
        """All versions, oldest first."""
        with self._tx() as cur:
            cur.execute(f"SELECT {COLUMNS} FROM checkpoints ORDER BY seq")
            return [self._row(r) for r in cur.fetchall()]

    def stable(self) -> Checkpoint | None:
        with self._tx() as cur:
            cur.execute(f"SELECT {COLUMNS} FROM checkpoints WHERE state = ?", (CheckpointState.stable.value,))
            row = cur.fetchone()
            return self._row(row) if row else None

    # ------------------------------------------------------------ writes
    def _next_version(self, cur: Any) -> str:
        cur.execute("SELECT COALESCE(MAX(seq), 0) FROM checkpoints")
        n = int(cur.fetchone()[0]) + 1
        while self._find(cur, f"v{n}") is not None:
            n += 1
        return f"v{n}"

    def register(
        self,
        model_dir: Path,
        parent: str | None,
        round: int | None,
        metrics: dict[str, Any],
        version: str | None = None,
        state: CheckpointState = CheckpointState.candidate,
        reason: str | None = None,
    ) -> Checkpoint:
        """Copy `model_dir` into the registry's storage and record it as a new version.

        Idempotent for a given `version`: registering the same weights again returns the existing
        checkpoint (a retried round), different weights under a known version are an error.
        """
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise DynrubricError(f"model dir {model_dir} does not exist", "pass a save_pretrained directory")
        if version is not None and not VERSION_RE.match(version):
            raise DynrubricError(
                f"version {version!r} is not a valid version id",
                "use letters, digits, '.', '_' and '-' (at most 128 characters)",
            )
        if state in (CheckpointState.stable, CheckpointState.retired):
            raise DynrubricError(f"cannot register directly as {state.value}", "register, then promote")
        sha = weights_sha256(model_dir)
        metrics_json = json.dumps(metrics, sort_keys=True, allow_nan=False, default=float)
        if version is not None:  # a retried registration copies nothing
            existing = self.find(version)
            if existing is not None:
                return self._same_weights(existing, sha)
        # Copy outside the lock into a hidden staging dir; publish by rename inside the transaction.
        staging = Path(tempfile.mkdtemp(prefix=f"{version or 'new'}.", dir=self._staging))
        try:
            shutil.copytree(model_dir, staging, dirs_exist_ok=True)
            for f in staging.rglob("*"):
                if f.is_file():
                    with open(f, "rb") as fh:
                        os.fsync(fh.fileno())
            atomic.fsync_dir(staging)
            with self._tx(write=True) as cur:
                if parent is not None:
                    self._get(cur, parent)
                if version is None:
                    version = self._next_version(cur)
                existing = self._find(cur, version)
                if existing is not None:
                    return self._same_weights(existing, sha)
                target = self.storage_dir / version
                if target.exists():  # left by a crash between the rename and the insert: unreferenced
                    shutil.rmtree(target)
                os.rename(staging, target)
                atomic.fsync_dir(self.storage_dir)
                ckpt = Checkpoint(
                    version=version,
                    parent=parent,
                    round=round,
                    path=target,
                    weights_sha256=sha,
                    metrics=json.loads(metrics_json),
                    state=state,
                    reason=reason,
                    created_at=time.time(),
                )
                cur.execute(
                    f"INSERT INTO checkpoints ({COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (version, parent, round, str(target), sha, metrics_json, state.value, reason, ckpt.created_at),
                )
                return ckpt
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    @staticmethod
    def _same_weights(existing: Checkpoint, sha: str) -> Checkpoint:
        if existing.weights_sha256 != sha:
            raise DynrubricError(
                f"version {existing.version!r} is already registered with different weights",
                "register under a new version id",
            )
        return existing

    def _write_state(self, cur: Any, version: str, state: CheckpointState, reason: str | None) -> None:
        cur.execute(
            "UPDATE checkpoints SET state = ?, reason = COALESCE(?, reason) WHERE version = ?",
            (state.value, reason, version),
        )

    def set_state(self, version: str, state: CheckpointState | str, reason: str | None = None) -> Checkpoint:
        state = CheckpointState(state)
        if state is CheckpointState.stable:
            return self.promote(version)
        with self._tx(write=True) as cur:
            ckpt = self._get(cur, version)
            if ckpt.state is state:
                return ckpt
            if state not in TRANSITIONS[ckpt.state]:
                raise DynrubricError(
                    f"checkpoint {version} is {ckpt.state.value} and cannot become {state.value}",
                    f"allowed from {ckpt.state.value}: "
                    + (", ".join(sorted(s.value for s in TRANSITIONS[ckpt.state])) or "nothing (final)"),
                )
            self._write_state(cur, version, state, reason)
            return self._get(cur, version)

    def promote(self, version: str) -> Checkpoint:
        """Make `version` the stable one; the previous stable version becomes retired."""
        with self._tx(write=True) as cur:
            ckpt = self._get(cur, version)
            if ckpt.state is CheckpointState.stable:
                return ckpt
            if ckpt.state not in PROMOTABLE:
                raise DynrubricError(
                    f"checkpoint {version} is {ckpt.state.value} and cannot be promoted",
                    "register the weights again under a new version",
                )
            cur.execute(
                "UPDATE checkpoints SET state = ? WHERE state = ?",
                (CheckpointState.retired.value, CheckpointState.stable.value),
            )
            self._write_state(cur, version, CheckpointState.stable, None)
            return self._get(cur, version)

    def reject(self, version: str, reason: str) -> Checkpoint:
        if not reason:
            raise DynrubricError(f"rejecting {version} needs a reason", "pass --reason TEXT")
        return self.set_state(version, CheckpointState.rejected, reason)


class _PgCursor:
    """psycopg with SQLite's `?` placeholders, so every statement above is written once."""

    def __init__(self, cur: Any):
        self._cur = cur

    def execute(self, sql: str, params: tuple = ()) -> None:
        self._cur.execute(sql.replace("?", "%s"), params)

    def fetchone(self) -> Any:
        return self._cur.fetchone()

    def fetchall(self) -> Any:
        return self._cur.fetchall()

    @property
    def description(self) -> Any:
        return self._cur.description


def sqlite_path(settings: Any) -> Path | None:
    """The SQLite file `settings.registry` names (under the state dir by default); None with a URL."""
    cfg = settings.registry
    if cfg.url is not None:
        return None
    return Path(cfg.path).expanduser() if cfg.path else settings.paths.resolved_state() / "registry" / "registry.sqlite"


def open_registry(settings: Any) -> Registry:
    """The registry that `settings.registry` names (SQLite under the state dir by default)."""
    cfg = settings.registry
    storage = Path(cfg.storage_dir).expanduser() if cfg.storage_dir else None
    path = sqlite_path(settings)
    return Registry(cfg.url.get_secret_value() if path is None else path, storage_dir=storage)


__all__ = [
    "SCHEMA_LOCK",
    "Checkpoint",
    "CheckpointState",
    "Registry",
    "open_registry",
    "sqlite_path",
    "weights_sha256",
]
