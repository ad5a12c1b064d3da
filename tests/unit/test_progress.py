"""Progress in a log file: one plain line per update, as it happens (rich's live display would print
only when the work is over)."""

from __future__ import annotations

import io

from rich.console import Console

from dynrubric.progress import Bars, status


def test_plain_progress_is_one_line_per_update():
    out = io.StringIO()
    console = Console(file=out, width=200)  # not a terminal
    with Bars(console) as bars:
        bars.start("score sets", 3)
        printed_after_first = out.getvalue()
        bars.advance("score sets", 1)
        assert out.getvalue() != printed_after_first  # written at once, not at the end
        bars.advance("score sets", 2)
        bars.advance("score sets", 0)  # nothing done: no line
    lines = out.getvalue().splitlines()
    assert [line.split("] ", 1)[1] for line in lines] == ["score sets 0/3", "score sets 1/3", "score sets 3/3"]


def test_plain_status_says_start_and_done():
    out = io.StringIO()
    with status(Console(file=out, width=200), "loading the engine"):
        pass
    lines = out.getvalue().splitlines()
    assert lines[0] == "loading the engine ..." and lines[1].startswith("loading the engine: done in ")
