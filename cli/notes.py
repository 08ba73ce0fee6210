"""Notes for a run that succeeded (the machine was oversubscribed while it was timed; a temperature that looks like a
thread count): queued while the run goes and written to stderr, one line each, only when it exits 0, so that an
error stays the one line on stderr and an interrupted run ends with "interrupted"."""

from __future__ import annotations

import sys

pending: list[str] = []


def add(line: str) -> None:
    if line not in pending:
        pending.append(line)


def clear() -> None:
    pending.clear()


def flush() -> None:
    """Write the queued notes (the run exits 0)."""
    try:
        for line in pending:
            sys.stderr.write(line + "\n")
    except (OSError, ValueError):
        pass
    pending.clear()
