"""What ruff does not check: its line-length rule measures a line without a trailing pragma (`# type: ignore`,
`# noqa`), so a long line can hide behind one. No tracked Python line is over 120 characters, pragmas included."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 120  # pyproject.toml: [tool.ruff] line-length


def long_lines(paths: list[Path]) -> list[tuple[str, int, int]]:
    """(path, line number, length) of every line over LIMIT characters."""
    return [
        (str(path), n, len(line))
        for path in paths
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if len(line) > LIMIT
    ]


def test_a_long_line_behind_a_pragma_is_found(tmp_path):
    code = tmp_path / "x.py"
    code.write_text("a = 1\n" + "b = [" + "1, " * 40 + "]  # type: ignore[arg-type]\n")
    assert long_lines([code]) == [(str(code), 2, 152)]


def test_no_python_line_over_120_characters():
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    paths = [ROOT / p for p in tracked.stdout.split() if (ROOT / p).is_file()]
    assert len(paths) > 100
    assert long_lines(paths) == []
