"""The checkpoint registry: lineage, states, hashes, errors, and crash-safe registration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dynrubric.errors import DynrubricError
from dynrubric.registry import CheckpointState, Registry, weights_sha256


def fake_model(path: Path, payload: bytes) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (path / "model.safetensors").write_bytes(payload)
    return path


def pg_bin() -> Path:
    """Debian's server binaries (scripts/setup.sh installs the postgresql package): the newest version."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    assert found, "PostgreSQL server is not installed: `make setup` installs Debian's postgresql package"
    return found[-1].parent


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server on a private port and socket dir, in a fresh data dir. initdb refuses to
    run as root, so as root (CI) the server runs as Debian's `postgres` user."""
    import shutil
    import socket
    import tempfile

    bin_dir = pg_bin()
    root = Path(tempfile.mkdtemp(prefix="dynrubric-pg-"))  # pytest's tmp dirs are closed to other users
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    as_pg: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
        shutil.chown(sock, "postgres")
        os.chmod(root, 0o755)
        as_pg = ["runuser", "-u", "postgres", "--"]
    init = subprocess.run(
        as_pg + [str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"],
        capture_output=True,
        text=True,
    )
    assert init.returncode == 0, init.stdout + init.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = subprocess.run(
        as_pg
        + [
            str(bin_dir / "pg_ctl"),
            "-D",
            str(data),
            "-w",
            "-l",
            str(root / "log"),
            "-o",
            f"-p {port} -k {sock} -c listen_addresses=127.0.0.1",
            "start",
        ],
        capture_output=True,
        text=True,
    )
    assert start.returncode == 0, start.stdout + start.stderr + (root / "log").read_text(errors="replace")
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}"
    finally:
        subprocess.run(
            as_pg + [str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"], capture_output=True
        )
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgres"])
def registry(request: pytest.FixtureRequest, tmp_path: Path) -> Registry:
    if request.param == "sqlite":
        return Registry(tmp_path / "reg" / "registry.sqlite")
    import psycopg

    base = request.getfixturevalue("postgres")
    name = f"reg_{os.getpid()}_{abs(hash(str(tmp_path))) % 10**9}"
    with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return Registry(f"{base}/{name}", storage_dir=tmp_path / "reg" / "checkpoints")


def test_register_lineage_and_hash(registry: Registry, tmp_path: Path) -> None:
    base = registry.register(fake_model(tmp_path / "m0", b"w0"), parent=None, round=None, metrics={})
    v1 = registry.register(
        fake_model(tmp_path / "m1", b"w1"), parent=base.version, round=1, metrics={"reward_mean": 0.5, "kl": 0.01}
    )
    assert [c.version for c in registry.list()] == [base.version, v1.version]
    got = registry.get(v1.version)
    assert got.parent == base.version and got.round == 1
    assert got.metrics == {"reward_mean": 0.5, "kl": 0.01}
    assert got.state is CheckpointState.candidate
    assert got.path.parent == registry.storage_dir and (got.path / "model.safetensors").read_bytes() == b"w1"
    assert got.weights_sha256 == weights_sha256(tmp_path / "m1") != base.weights_sha256
    # the registry owns a copy: changing the source does not change the checkpoint
    (tmp_path / "m1" / "model.safetensors").write_bytes(b"changed")
    assert weights_sha256(got.path) == got.weights_sha256


def test_register_is_idempotent_per_version(registry: Registry, tmp_path: Path) -> None:
    m = fake_model(tmp_path / "m", b"w")
    a = registry.register(m, parent=None, round=3, metrics={}, version="run1-r3")
    b = registry.register(m, parent=None, round=3, metrics={}, version="run1-r3")
    assert a == b and len(registry.list()) == 1
    with pytest.raises(DynrubricError, match="different weights"):
        registry.register(fake_model(tmp_path / "other", b"x"), parent=None, round=3, metrics={}, version="run1-r3")


def test_unknown_version_and_bad_input_are_named(registry: Registry, tmp_path: Path) -> None:
    with pytest.raises(DynrubricError, match=r"'v9'.*dynrubric registry list"):
        registry.get("v9")
    with pytest.raises(DynrubricError, match="'nope'"):
        registry.register(fake_model(tmp_path / "m", b"w"), parent="nope", round=1, metrics={})
    with pytest.raises(DynrubricError, match="no weight files"):
        (tmp_path / "empty").mkdir()
        registry.register(tmp_path / "empty", parent=None, round=1, metrics={})
    with pytest.raises(DynrubricError, match="not a valid version"):
        registry.register(fake_model(tmp_path / "m", b"w"), parent=None, round=1, metrics={}, version="../x")
    assert registry.list() == []


def test_promote_retires_previous_stable_and_reject_is_final(registry: Registry, tmp_path: Path) -> None:
    a = registry.register(fake_model(tmp_path / "a", b"a"), None, None, {})
    b = registry.register(fake_model(tmp_path / "b", b"b"), a.version, 1, {})
    c = registry.register(fake_model(tmp_path / "c", b"c"), b.version, 2, {})
    assert registry.stable() is None
    registry.promote(a.version)
    registry.set_state(b.version, CheckpointState.canary)
    registry.promote(b.version)
    assert registry.stable().version == b.version
    assert registry.get(a.version).state is CheckpointState.retired
    registry.reject(c.version, "kl 0.9 > bound 0.1")
    got = registry.get(c.version)
    assert got.state is CheckpointState.rejected and got.reason == "kl 0.9 > bound 0.1"
    with pytest.raises(DynrubricError, match="cannot be promoted"):
        registry.promote(c.version)
    with pytest.raises(DynrubricError, match="cannot become canary"):
        registry.set_state(c.version, "canary")
    # a rollback: the retired version becomes stable again, and only one version is stable
    registry.promote(a.version)
    assert [x.version for x in registry.list() if x.state is CheckpointState.stable] == [a.version]
    # a second Registry over the same database (another process) sees the same state
    again = Registry(registry._url, registry.storage_dir) if registry._pg else Registry(registry._db)
    assert again.stable().version == a.version


def test_rollouts_live_in_the_registry_database(registry: Registry) -> None:
    """The rollout controller's table is in the registry's database (SQLite or PostgreSQL): one active
    rollout at a time, updates seen by a controller that opens the store afresh (a resume), times kept
    to the sub-second (PostgreSQL's REAL would round a timestamp to minutes)."""
    from serving.rollout import RolloutStore

    store = RolloutStore(registry)
    r = store.create("r1", "/ckpt/r1", "base", "/ckpt/base", [0.3, 0.6])
    assert (r.status, r.step, r.steps, r.last_gate) == ("loading", 0, [0.3, 0.6], None)
    with pytest.raises(DynrubricError, match=f"rollout {r.id} of r1 is still in progress"):
        store.create("r2", "/ckpt/r2", "base", "/ckpt/base", [0.5])
    at = 1_764_550_000.123456
    store.update(r.id, status="stepping", step=1, step_started_at=at, last_gate={"verdict": "inconclusive"})
    resumed = RolloutStore(registry)  # a restarted controller
    active = resumed.active()
    assert active is not None and active.id == r.id and active.step == 1 and active.status == "stepping"
    assert active.step_started_at == pytest.approx(at, abs=1e-3) and active.last_gate == {"verdict": "inconclusive"}
    resumed.update(r.id, status="rolled_back", reason="gate failed")
    assert store.active() is None and [x.status for x in store.list()] == ["rolled_back"]
    assert store.create("r2", "/ckpt/r2", "base", "/ckpt/base", [0.5]).version == "r2"


def test_a_rollouts_table_of_an_older_version_gets_the_plan_column(registry: Registry) -> None:
    """A table created before the gate's power plan (no `plan` column) keeps its rows and takes plans."""
    from serving.rollout import LEGACY_COLUMNS, RolloutStore

    with registry.transaction(write=True) as cur:
        cur.execute(SCHEMA_WITHOUT_PLAN)
        cur.execute(
            f"INSERT INTO rollouts ({LEGACY_COLUMNS}) VALUES ({','.join('?' * 13)})",
            ("ro-old", "r0", "/ckpt/r0", "base", "/ckpt/base", "[0.5]", "promoted", 0, 1.0, 1.0, 2.0, None, None),
        )
    store = RolloutStore(registry)
    assert [(r.id, r.plan) for r in store.list()] == [("ro-old", None)]
    r = store.create("r1", "/ckpt/r1", "base", "/ckpt/base", [0.5])
    assert store.update(r.id, plan={"lines": ["gate power at 1.00 requests/s"]}).plan == {
        "lines": ["gate power at 1.00 requests/s"]
    }
    assert RolloutStore(registry).get(r.id).plan["lines"] == ["gate power at 1.00 requests/s"]  # opened again: no-op


SCHEMA_WITHOUT_PLAN = """
CREATE TABLE rollouts (
    id TEXT PRIMARY KEY, version TEXT NOT NULL, version_path TEXT NOT NULL, baseline TEXT NOT NULL,
    baseline_path TEXT NOT NULL, steps TEXT NOT NULL, status TEXT NOT NULL, step INTEGER NOT NULL,
    step_started_at DOUBLE PRECISION NOT NULL, started_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL, reason TEXT,
    last_gate TEXT
)
"""


def test_postgres_url_without_psycopg_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)  # makes `import psycopg` raise ImportError
    with pytest.raises(DynrubricError, match="psycopg is not installed"):
        Registry("postgresql://u@localhost/db", storage_dir=tmp_path)


CRASHER = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    import dynrubric.registry as reg

    where, db, model = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    if where == "copy":        # half the files copied
        real = reg.shutil.copyfile
        calls = []
        def copyfile(src, dst, **k):
            calls.append(src)
            if len(calls) == 2:
                die()
            return real(src, dst, **k)
        reg.shutil.copyfile = copyfile
    elif where == "rename":    # everything staged, nothing published
        reg.os.rename = die
    elif where == "insert":    # directory published, row not yet written
        real_rename = reg.os.rename
        def rename(a, b):
            real_rename(a, b)
            die()
        reg.os.rename = rename
    reg.Registry(db).register(model, parent=None, round=1, metrics={}, version="r1")
    """
)


@pytest.mark.parametrize("where", ["copy", "rename", "insert"])
def test_kill_during_register_leaves_no_visible_checkpoint(tmp_path: Path, where: str) -> None:
    model = fake_model(tmp_path / "m", b"weights" * 1000)
    (model / "tokenizer.json").write_text("{}")
    db = tmp_path / "reg" / "registry.sqlite"
    proc = subprocess.run(
        [sys.executable, "-c", CRASHER, where, str(db), str(model)], cwd=Path(__file__).parents[2], capture_output=True
    )
    assert proc.returncode == -9, proc.stderr.decode()
    registry = Registry(db)
    assert registry.list() == []
    # the retry completes and publishes the whole checkpoint
    ckpt = registry.register(model, parent=None, round=1, metrics={}, version="r1")
    assert sorted(os.listdir(ckpt.path)) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert weights_sha256(ckpt.path) == weights_sha256(model)
    assert [c.version for c in registry.list()] == ["r1"]


def test_a_reader_opens_the_registry_on_a_read_only_weights_mount(tmp_path, monkeypatch):
    """The router and the rollout Job mount the models volume read-only (k8s): opening the registry must not
    need to create registry.storage_dir/.staging there; only registering does."""
    import errno

    writer = Registry(tmp_path / "db" / "registry.sqlite", storage_dir=tmp_path / "weights")
    writer.register(fake_model(tmp_path / "m", b"w"), None, 0, {}, version="v1")
    (tmp_path / "weights" / ".staging").rmdir()
    real_mkdir = Path.mkdir

    def read_only(self: Path, *args, **kwargs):
        if (tmp_path / "weights") in [self, *self.parents]:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    reader = Registry(tmp_path / "db" / "registry.sqlite", storage_dir=tmp_path / "weights")
    assert reader.get("v1").path.is_dir()
