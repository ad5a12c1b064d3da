"""One SQLite transaction per call, safe across processes: WAL, fsync'd commits, writers serialised."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def transaction(path: Path, write: bool = True) -> Iterator[sqlite3.Cursor]:
    """Commit on success, roll back on any exception; `write` takes the write lock up front."""
    conn = sqlite3.connect(path, timeout=30.0, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        try:
            yield conn.cursor()
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    finally:
        conn.close()
