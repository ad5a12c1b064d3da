"""Progress of long work (rounds, steps, scored sets, model loading), as people can follow it.

In a terminal: rich bars that move as work is done. In a pipe or a log file: one plain line per update,
`[  12.3s] score sets 3/8`, printed as it happens (rich's live display would print only at the end).
Also silences the model-loading progress bars of transformers / huggingface_hub, which in a log file
are pages of carriage-return noise.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress


def quiet_model_loading() -> None:
    """Turn off third-party progress bars and info logs; call before transformers is imported."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read by transformers' logging.tqdm too
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


class Bars:
    """`start(phase, total)` and `advance(phase, n)`: the callbacks long-running work reports to."""

    def __init__(self, console: Console):
        self.console = console
        self.live = console.is_terminal
        self.rich = (
            RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
            )
            if self.live
            else None
        )
        self.tasks: dict[str, TaskID] = {}
        self.done: dict[str, tuple[int, int]] = {}  # plain mode: phase -> (done, total)
        self.t0 = time.monotonic()

    def start(self, phase: str, total: int) -> None:
        if self.rich is not None:
            if phase in self.tasks:
                self.rich.reset(self.tasks[phase], total=total)
            else:
                self.tasks[phase] = self.rich.add_task(phase, total=total)
            return
        self.done[phase] = (0, total)
        self._line(phase, 0, total)

    def advance(self, phase: str, n: int = 1) -> None:
        if n <= 0:
            return
        if self.rich is not None:
            if phase in self.tasks:
                self.rich.advance(self.tasks[phase], n)
            return
        done, total = self.done.get(phase, (0, 0))
        self.done[phase] = (done + n, total)
        self._line(phase, done + n, total)

    def note(self, text: str) -> None:
        """A line about work inside the current unit (a rubric try, a verdict batch), with the time."""
        console = self.rich.console if self.rich is not None else self.console  # above live bars
        console.print(f"[{time.monotonic() - self.t0:7.1f}s]   {text}", markup=False, highlight=False)

    def _line(self, phase: str, done: int, total: int) -> None:
        elapsed = time.monotonic() - self.t0
        self.console.print(f"[{elapsed:7.1f}s] {phase} {done}/{total}", markup=False, highlight=False)

    def __enter__(self) -> Bars:
        if self.rich is not None:
            self.rich.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.rich is not None:
            self.rich.stop()


@contextmanager
def status(console: Console, text: str) -> Iterator[None]:
    """A spinner in a terminal; a start line and a done line with the seconds it took elsewhere."""
    if console.is_terminal:
        with console.status(text):
            yield
        return
    t0 = time.monotonic()
    console.print(f"{text} ...", markup=False, highlight=False)
    yield
    console.print(f"{text}: done in {time.monotonic() - t0:.1f}s", markup=False, highlight=False)
