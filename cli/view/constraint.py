"""What a constraint did to a run, in one line of the terminal view (the numbers are the summary's)."""

from __future__ import annotations

import math

from rich.text import Text

from .render import show_token


def constraint_line(summary) -> Text | None:
    """``summary.constraint`` (a :class:`~decodelab.core.trace.records.ConstraintSummary`) as one line; None
    without a constraint."""
    c = getattr(summary, "constraint", None)
    if c is None:
        return None
    hardest = ", ".join(f"step {h.index} {show_token(h.token)} (kept {_kept(h.log_mass_kept)})" for h in c.hardest)
    return Text(f"constraint: removed log-mass {c.removed_log_mass:.3f} nats over {c.steps} steps · forced "
                f"{c.forced_steps} · removed the model's top-1 {c.top1_banned_steps} · whitespace-only allowed "
                f"{c.whitespace_only_steps}, longest whitespace run {c.longest_whitespace_run}"
                + (f" · bit hardest: {hardest}" if hardest else ""), style="cyan")


def _kept(log_mass: float) -> str:
    """The kept mass m = exp(log m), as a number a reader compares at a glance."""
    return f"{math.exp(log_mass):.3g}"
