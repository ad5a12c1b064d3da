"""Console output that reads well in a terminal and stays whole in a pipe or a log file.

In a terminal: rich (colour, tables fitted to the window). Anywhere else: no colour, no wrapping and
no truncation (a line is as long as its content), headings as plain lines. Machine-readable output
(`config show`, `registry list --json`) bypasses rich altogether.
"""

from __future__ import annotations

import sys

from rich.console import Console

UNBOUNDED_WIDTH = 1_000_000  # rich needs a number; tables only take the width their content needs


def make_console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=UNBOUNDED_WIDTH, soft_wrap=True, color_system=None)


def heading(console: Console, text: str) -> None:
    """A section heading: a rule across a terminal, one plain line in a log."""
    if console.is_terminal:
        console.rule(text)
    else:
        console.print(f"==== {text}", markup=False, highlight=False)
