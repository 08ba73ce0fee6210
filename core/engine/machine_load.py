"""Whether the machine was oversubscribed while a run was timed: its speed figures (tokens/s, speedups) then measure
the other jobs as much as the run, and the output says so.

Oversubscribed: the 1-minute load average was at least the physical cores when the run started (other processes
alone already filled every core), or more than the physical cores when it ended (the run's own threads included:
more runnable threads than cores). The load average lags by about a minute, so a short run under a job that just
started can be missed; a flagged run is certain to have competed for its cores only in that sense."""

from __future__ import annotations

import os


def load_average() -> float:
    """The 1-minute load average (0 where the OS has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def oversubscribed(start: float, end: float, cores: int) -> bool:
    """The rule above: ``start >= cores`` or ``end > cores``."""
    return start >= cores or end > cores


def machine_record(start: float, end: float, cores: int) -> dict | None:
    """The ``machine`` field of a run's document when it was oversubscribed, else None."""
    if not oversubscribed(start, end, cores):
        return None
    return {"oversubscribed": True, "load_average_start": round(start, 2), "load_average_end": round(end, 2),
            "physical_cores": cores}


def machine_note(record: dict) -> str:
    """The one line on stderr beside the field."""
    return (f"note: load average {record['load_average_start']:.1f} at the start and {record['load_average_end']:.1f}"
            f" at the end on {record['physical_cores']} cores: the machine was oversubscribed, so this run's speed "
            "figures (tokens/s, speedups) measure the other jobs too")
