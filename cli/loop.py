"""The one loop every command streams its run through: JSONL lines flushed as steps come, Ctrl-C kept."""

from __future__ import annotations

from collections.abc import Callable

from . import render
from .options import Format


def drive(run, fmt: Format, row: Callable[[object], dict] = render.clean) -> None:
    """Iterate ``run``; with ``-f jsonl`` print each step as one flushed line. An interrupt ends the run with what it
    produced (``run.interrupt()``: stop_reason "interrupted"); the caller then prints the summary as usual."""
    try:
        for step in run:
            if fmt == Format.jsonl:
                render.print_jsonl({"type": "step", **row(step)})
    except KeyboardInterrupt:
        run.interrupt()
