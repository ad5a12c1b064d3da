"""Atomic writes: anything others read is written to a temp file or dir, fsynced, then renamed."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that a reader sees either the old or the whole new file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def write_text(path: Path, text: str) -> None:
    write_bytes(path, text.encode())


@contextlib.contextmanager
def directory(path: Path) -> Iterator[Path]:
    """Yield a temp dir beside `path`; on success fsync its files and rename it to `path`.

    `path` must not exist yet (a published directory is never modified in place).
    On failure the temp dir is removed and `path` stays absent.
    """
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} already exists; atomic directories are written once")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        fsync_dir(tmp)
        os.rename(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def link_tree(src: Path, dst: Path) -> None:
    """`dst` as a copy of the files under `src`, each a hard link where the file system allows (no byte written:
    a published directory's files are never modified in place, so sharing them is safe), else a copy."""
    shutil.copytree(src, dst, copy_function=_link_or_copy, dirs_exist_ok=True)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(src, dst)
