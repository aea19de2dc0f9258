"""Progress on stderr: a live spinner on a terminal, plain lines when stderr is a file or pipe.

Experiments report phases as short messages (``progress("cached run")``); loops report counts
(``done`` of ``total``, the total possibly unknown). On a terminal the current phase shows with a
spinner and its elapsed time (a bar and ``done/total`` only when the total is known), and each
finished phase leaves one line. Elsewhere (CI logs, ``2> file``, ``--json`` piped into a script)
each phase prints a line when it starts and one when it ends, and a long count prints at most one
line every ``interval_s``, so a long run is never silent. Messages are plain text, never markup.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console
from rich.progress import (
    BarColumn,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
)
from rich.progress import Progress as RichProgress
from rich.text import Text


class _BarIfTotal(BarColumn):
    """A bar when the total is known; nothing (the spinner says it is alive) otherwise."""

    def render(self, task: Task):
        return Text("") if task.total is None else super().render(task)


class _Count(ProgressColumn):
    """``done/total`` when the total is known, ``done`` alone when not: never ``0/None``."""

    def __init__(self, unit: str = "") -> None:
        super().__init__()
        self.unit = f" {unit}" if unit else ""

    def render(self, task: Task) -> Text:
        if task.total is None:
            return Text(f"{int(task.completed)}{self.unit}" if task.completed else "")
        return Text(f"{int(task.completed)}/{int(task.total)}{self.unit}")


def _seconds(value_s: float) -> str:
    if value_s < 60:
        return f"{value_s:.1f} s"
    minutes, seconds = divmod(int(round(value_s)), 60)
    return f"{minutes} min {seconds:02d} s"


class ProgressReporter:
    """Phases and counts of one command, on ``console`` (stderr).

    ``live`` defaults to whether the console is a terminal; ``clock`` is injectable for tests.
    """

    def __init__(
        self,
        console: Console,
        label: str,
        *,
        live: bool | None = None,
        interval_s: float = 10.0,
        unit: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.console = console
        self.label = label
        self.live = console.is_terminal if live is None else live
        self.interval_s = interval_s
        self.unit = unit
        self.clock = clock
        self._rich: RichProgress | None = None
        self._task = None
        self._phase: str | None = None
        self._phase_t0 = 0.0
        self._count_t0: float | None = None
        self._last_line_t = 0.0
        self._count: tuple[int, int | None] | None = None

    # ------------------------------------------------------------------ context
    def __enter__(self) -> ProgressReporter:
        if self.live:
            self._rich = RichProgress(
                SpinnerColumn(),
                TextColumn("{task.description}", markup=False),
                _BarIfTotal(),
                _Count(self.unit),
                TimeElapsedColumn(),
                console=self.console,
                transient=True,
            )
            self._rich.__enter__()
            self._task = self._rich.add_task(self.label, total=None)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self._close_phase()
            self._close_count()
        if self._rich is not None:
            self._rich.__exit__(exc_type, exc, tb)
            self._rich = None

    # ------------------------------------------------------------------ output
    def _line(self, text: str) -> None:
        line = Text(f"{self.label}: {text}", style="dim")
        if self._rich is not None:
            self._rich.console.print(line, soft_wrap=True)
        else:
            self.console.print(line, soft_wrap=True, highlight=False)

    def _describe(self, text: str) -> None:
        if self._rich is not None and self._task is not None:
            self._rich.update(self._task, description=f"{self.label}: {text}")

    # ------------------------------------------------------------------ phases
    def phase(self, message: str) -> None:
        """A new phase starts (the previous one, if any, is done)."""
        self._close_phase()
        self._phase, self._phase_t0 = str(message), self.clock()
        if self._rich is not None and self._task is not None:
            self._rich.reset(self._task, total=None, description=f"{self.label}: {message}")
        else:
            self._line(f"{message} ...")

    def _close_phase(self) -> None:
        if self._phase is not None:
            self._line(f"{self._phase} done in {_seconds(self.clock() - self._phase_t0)}")
            self._phase = None
            # counts inside a phase end with it; its "done" line already said so
            self._count, self._count_t0 = None, None

    # ------------------------------------------------------------------ counts
    def count(self, done: int, total: int | None, what: str | None = None) -> None:
        """``done`` of ``total`` (``None``: unknown) units of the current work."""
        now = self.clock()
        first = self._count_t0 is None
        if first:
            self._count_t0 = self._last_line_t = now
        if what is not None:
            self._describe(what)
        self._count = (int(done), total)
        if self._rich is not None and self._task is not None:
            self._rich.update(self._task, completed=done, total=total)
            return
        if first and self._phase is None:  # inside a phase, its own line said it started
            self._line(f"{what or 'started'}: {self._count_text()}")
        elif now - self._last_line_t >= self.interval_s:
            self._last_line_t = now
            self._line(f"{self._count_text()}, {_seconds(now - (self._count_t0 or now))}")

    def _count_text(self) -> str:
        done, total = self._count or (0, None)
        singular = done == 1 and total is None and self.unit.endswith("s")
        unit = f" {self.unit[:-1] if singular else self.unit}" if self.unit else ""
        return f"{done}/{total}{unit}" if total is not None else f"{done}{unit}"

    def _close_count(self) -> None:
        if self._count is not None and self._count_t0 is not None:
            elapsed = self.clock() - self._count_t0
            self._line(f"done, {self._count_text()} in {_seconds(elapsed)}")
            self._count = None
