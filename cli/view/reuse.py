"""quantize-kv --reuse on the terminal: one compressed context, several questions, a bar per question."""

from __future__ import annotations

import math

from rich.table import Table

BAR = 10  # characters of a full bar (probability 1)
PLOT = 24  # characters of a full bar in the plot


def bar(logprob: float, width: int = BAR) -> str:
    """The answer's probability exp(logprob) as a bar of ``width`` characters."""
    p = math.exp(logprob) if math.isfinite(logprob) else 0.0
    filled = round(p * width)
    return "█" * filled + "·" * (width - filled)


def reuse_table(rows: list[dict]) -> Table:
    """Per cache: the question it was compressed with (first) and the others, as log-probabilities of the answer,
    greedy right or not, and a bar of each question's answer probability (first question leftmost)."""
    table = Table(title="one context compressed once, then every question asked of it · ranked by the questions "
                  "the compression did not see", header_style="bold")
    for name in ("cache", "stored", "first logp", "others logp", "gap", "others right", "answer p per question"):
        table.add_column(name, justify="left" if name in ("cache", "answer p per question") else "right",
                         no_wrap=True)
    for r in rows:
        bars = " ".join(bar(a["logprob"]) for a in r["answers"])
        table.add_row(r["policy"], str(r["stored"]), f"{r['first_logprob']:.3f}", f"{r['others_logprob']:.3f}",
                      f"{r['reuse_gap']:+.3f}", f"{r['others_right']:.0%}", bars)
    return table


def reuse_plot(rows: list[dict]) -> Table:
    """Per cache, in the table's order: the answer's probability exp(logprob) on the question the compression saw
    and its mean over the others (mean of exp, not exp of the mean logprob), as bars of PLOT characters, and the
    share of each greedy-right. Query-aware presses fall from the first bar to the second; query-free ones do not."""
    table = Table(title="answer probability: the question the cache was compressed with vs the others (bar: 0 .. 1)",
                  header_style="bold")
    for name in ("cache", "compressed-with question", "other questions (mean)", "right: first / others"):
        table.add_column(name, justify="right" if name.startswith("right") else "left", no_wrap=True)
    for r in rows:
        first = math.exp(r["first_logprob"]) if math.isfinite(r["first_logprob"]) else 0.0
        others = [math.exp(a["logprob"]) if math.isfinite(a["logprob"]) else 0.0 for a in r["answers"][1:]]
        mean = sum(others) / len(others)
        table.add_row(r["policy"], f"{bar(math.log(first) if first else -math.inf, PLOT)} {first:.2f}",
                      f"{bar(math.log(mean) if mean else -math.inf, PLOT)} {mean:.2f}",
                      f"{'yes' if r['first_right'] else 'no'} / {r['others_right']:.0%}")
    return table


def reuse_verdict(rows: list[dict]) -> str:
    """What the table can say: nothing about the policies when the full cache (the first row) answers no question
    (a model that does not copy facts from its context, as the bundled ones)."""
    full = rows[0]
    if not full["first_right"] and full["others_right"] == 0:
        return ("the full cache answers no question: this model does not copy facts from its context, so the table "
                "cannot rank the policies (the log-probabilities still compare them)")
    return "policies ranked by the questions the compression did not see; the gap is first minus others"
