"""One table that ranks cache policies on the user's own text: real bytes, the damage against the full cache, and
the retrieval probe.

Each row comes from runs a user can repeat one at a time:

* ``kv_bytes_peak``, ``perplexity``: ``stream --text-file F --cache X`` (the same ``--feed`` and ``--prefill``);
  in ``quantize-kv --policies`` the bytes the cache holds after the text (the peak for every policy that only
  grows or stays flat);
* ``kl_mean``, ``top1_agreement``, ``top1_flips``: ``score --text-file F --cache X --against-cache full`` with the
  same feed and prefill: per token KL(full || X) of the two raw softmaxes, and the tokens whose argmax differs;
* ``probe_accuracy``, ``probe_logprob``, ``needle_kept``: ``stream --probe --text-file F --cache X``
  (:mod:`.probe`).

``bytes_ratio`` = kv_bytes_peak / the full cache's kv_bytes_peak on the same text. Rows are ranked by probe accuracy
(higher first; with the probe), then mean KL (lower first), then bytes (fewer first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class PolicyRow:
    label: str
    spec: str
    tokens: int  # tokens scored
    kv_bytes_peak: int  # most real bytes the cache held
    bytes_ratio: float  # kv_bytes_peak / the full cache's on the same text
    perplexity: float
    kl_mean: float | None  # mean KL(full || policy), nats
    top1_agreement: float | None
    top1_flips: int | None  # tokens whose most likely next token differs from the full cache's
    probe_accuracy: float | None = None  # of the trials the full cache gets right, the share this policy gets right
    probe_logprob: float | None = None  # mean log-probability of the probe's answer
    needle_kept: float | None = None  # share of (layer, head, needle token) entries kept (presses)
    rank: int = 0  # 1 = best (see the module docstring)


def policy_row(label: str, summary, full_bytes: int, probe=None) -> PolicyRow:
    """A row from a stream score summary (with its KL against the full cache) and a probe result (or None)."""
    return PolicyRow(label, summary.policy, summary.tokens, summary.kv_bytes_peak,
                     summary.kv_bytes_peak / full_bytes if full_bytes else float("nan"), summary.perplexity,
                     summary.kl_mean, summary.top1_agreement, summary.top1_flips,
                     None if probe is None else probe.accuracy, None if probe is None else probe.mean_logprob,
                     None if probe is None else probe.needle_kept)


def fidelity_row(label: str, fidelity, full_bytes: int, probe=None) -> PolicyRow:
    """A row from quantize-kv's fidelity run (``score --against-cache full`` under the cache; the bytes it holds after
    the text) and a probe result (or None)."""
    steps = fidelity.steps
    flips = sum(not s.agree for s in steps) if steps else None
    return PolicyRow(label, fidelity.cache, fidelity.tokens, fidelity.kv_bytes,
                     fidelity.kv_bytes / full_bytes if full_bytes else float("nan"), fidelity.perplexity,
                     fidelity.kl_mean, fidelity.top1_agreement, flips,
                     None if probe is None else probe.accuracy, None if probe is None else probe.mean_logprob,
                     None if probe is None else probe.needle_kept)


def _order(row: PolicyRow) -> tuple:
    accuracy = -row.probe_accuracy if row.probe_accuracy is not None else 0.0
    kl = row.kl_mean if row.kl_mean is not None and not math.isnan(row.kl_mean) else math.inf
    return accuracy, kl, row.kv_bytes_peak


def ranked(rows: list[PolicyRow]) -> list[PolicyRow]:
    """The rows best first, each with its ``rank`` set (the input order breaks exact ties)."""
    out = sorted(rows, key=_order)
    for i, row in enumerate(out, 1):
        row.rank = i
    return out
