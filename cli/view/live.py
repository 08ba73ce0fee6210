"""A table that fills in as tokens are produced: in a terminal, the header at once, each row as its token comes, and a
status line under them (tokens so far, rate, how to stop); elsewhere nothing until the run ends."""

from __future__ import annotations

import time

from rich.console import Console
from rich.live import Live
from rich.spinner import Spinner

from .steps_view import StepsTable


class LiveSteps:
    """``with LiveSteps(console, table, limit) as live: ... live.add(step)``; ``live.shown`` says whether rows were
    printed (then the caller prints only what follows the table). ``table`` None: the status line alone (a run whose
    table is printed at the end); ``unit`` names what is counted; ``enabled`` False (a script format): nothing."""

    def __init__(self, console: Console, table: StepsTable | None, limit: int | None = None, unit: str = "tokens",
                 enabled: bool = True):
        self.console, self.table, self.limit, self.unit = console, table, limit, unit
        self.terminal = enabled and console.is_terminal
        self.shown = self.terminal and table is not None
        self.count, self.start, self.live = 0, 0.0, None

    def status(self) -> Spinner:
        rate = self.count / max(time.perf_counter() - self.start, 1e-9)
        done = f"{self.count}/{self.limit}" if self.limit else f"{self.count}"
        return Spinner("dots", f"{done} {self.unit} · {rate:.1f}/s · Ctrl-C stops and keeps them", style="cyan")

    def __enter__(self) -> "LiveSteps":
        if self.terminal:
            if self.shown:
                self.console.print(self.table.with_part("head"))
            self.start = time.perf_counter()
            self.live = Live(self.status(), console=self.console, transient=True, refresh_per_second=8)
            self.live.__enter__()
        return self

    def add(self, step) -> None:
        if self.live is None:
            return
        self.count += 1
        if self.shown:
            self.console.print(self.table.with_part("rows", [step]))  # printed above the status line
        self.live.update(self.status())

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)
