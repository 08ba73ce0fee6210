"""The retrieval probe and the policy ranking on the terminal (and as flat rows for markdown and csv)."""

from __future__ import annotations

import math

from rich.table import Table
from rich.text import Text

from . import render


def _num(x, fmt: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _share(x) -> str:
    return "-" if x is None else f"{x:.0%}"


def probe_document(report) -> dict:
    """The ``probe`` object of the JSON (built in core: :meth:`~decodelab.core.analysis.probe.ProbeReport.document`)."""
    return report.document()


def probe_summary(report) -> dict:
    """The probe's summary for one policy (built in core: :meth:`~decodelab.core.analysis.probe.ProbeReport.summary`)."""
    return report.summary()


def probe_rows(report) -> list[dict]:
    """One row per trial and policy."""
    rows = []
    for trial in probe_document(report)["trials"]:
        for r in trial["results"]:
            rows.append({"key": trial["key"], "depth": trial["depth"], "needle_start": trial["needle_start"],
                         "policy": r["policy"], "logprob": r["logprob"], "right": r["right"],
                         "needle_kept": r["needle_kept"], "baseline_logprob": trial["baseline_logprob"]})
    return rows


def probe_table(report, title: str) -> Table:
    """Per trial: where the needle is, the answer's log-probability and whether greedy decoding gets it, under the
    full cache and each policy; the baseline is the full cache without the needle."""
    table = Table(title=title, header_style="bold")
    for name in ("key", "depth", "needle at", "no needle"):
        table.add_column(name, justify="right", no_wrap=True)
    everyone = [report.full] + report.policies
    for p in everyone:
        table.add_column(p.policy if len(p.policy) <= 24 else p.policy[:23] + "…", justify="right")
    for i, trial in enumerate(report.trials):
        cells = [trial.key, f"{trial.depth:g}", f"{trial.needle_start}-{trial.needle_end - 1}",
                 f"{report.baseline_logprobs[i]:.2f}"]
        for p in everyone:
            r = p.results[i]
            kept = "" if r.needle_kept is None else f" k{r.needle_kept:.0%}"
            cells.append(Text(f"{r.logprob:.2f} {'ok' if r.right else 'MISS'}{kept}",
                              style="green" if r.right else "red"))
        table.add_row(*cells)
    table.caption = ("log P(answer) summed over its tokens, teacher-forced after the question; ok: greedy decoding "
                     "writes the key; k: share of (layer, head, needle token) entries kept; no needle: the full "
                     f"cache without the fact. {report.verdict}")
    return table


def ranking_rows(rows) -> list[dict]:
    return [render.clean(r) for r in rows]


def ranking_table(rows, title: str, probed: bool, by: str = "kl_vs_full") -> Table:
    """Every policy best first: bytes, damage against the full cache, perplexity, and the probe."""
    table = Table(title=title, header_style="bold")
    names = ["#", "policy", "KV bytes", "x full", "KL", "flips", "ppl"]
    names += ["probe", "logp", "needle"] if probed else []
    for name in names:
        table.add_column(name, justify="left" if name == "policy" else "right")
    for r in rows:
        cells = [str(r.rank), r.label, f"{r.kv_bytes_peak:,}", _num(r.bytes_ratio, ".2f"), _num(r.kl_mean, ".4f"),
                 "-" if r.top1_flips is None else str(r.top1_flips), _num(r.perplexity, ".2f")]
        if probed:
            cells += [_share(r.probe_accuracy), _num(r.probe_logprob, ".2f"), _share(r.needle_kept)]
        table.add_row(*cells)
    tokens = rows[0].tokens if rows else 0
    table.caption = (f"KL: mean KL(full || policy) over the {tokens} scored tokens, nats; flips: tokens whose most "
                     "likely next token differs from the full cache's; KV bytes: the most real bytes held; x full: "
                     "their share of the full cache's; ppl: perplexity"
                     + ("; probe: share of the keys the full cache retrieves that this policy retrieves too; logp: "
                        "mean log P(answer); needle: share of (layer, head, needle token) entries kept" if probed
                        else "")
                     + "; ranked by " + ("probe, then " if probed else "")
                     + ("KL" if by == "kl_vs_full" else "perplexity of the text's own tokens") + ", then bytes")
    return table
