"""Reading a user's JSONL file: one JSON value per line, errors that name the file, the line and the fix."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dynrubric.errors import DynrubricError


def split_lines(text: str) -> list[str]:
    """A JSONL text's lines, as `str.splitlines` gives them for "\n" and "\r\n" endings. Only those end a line:
    `splitlines` also splits at U+2028, U+2029, U+0085 and \x1c-\x1e, which JSON leaves unescaped inside strings
    (pydantic's and `ensure_ascii=False` writers; a user's query pasted from a web page), so it would cut such a
    line in two."""
    lines = [line.removesuffix("\r") for line in text.split("\n")]
    if lines[-1] == "":  # the newline that ends the last line starts no line
        lines.pop()
    return lines


def jsonl_lines(path: Path, what: str, fix: str) -> Iterator[tuple[int, Any]]:
    """(line number, decoded value) for each non-blank line of `path`. `what` names the file in errors
    ("sets file"), `fix` says what to pass instead when it cannot be read."""
    try:
        lines = split_lines(path.read_text())
    except FileNotFoundError:
        raise DynrubricError(f"{what} {path} does not exist", fix) from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise DynrubricError(f"{what} {path} cannot be read ({e})", fix) from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except ValueError as e:
            raise DynrubricError(f"{path}:{n} is not valid JSON ({e})", "write one JSON object per line") from None
