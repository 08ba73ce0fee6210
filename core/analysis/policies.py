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
(higher first; with the probe), then mean KL (lower first) or, for a text longer than the model's trained context,
perplexity (lower first; :func:`rank_basis`), then bytes (fewer first).
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


# What the rows are ranked against after the probe: the full cache (mean KL, lower first), or, where the full cache
# is no reference (a text longer than the model's trained context: past it the full cache extrapolates positions it
# never saw and its own perplexity collapses), the text's own tokens (perplexity, lower first).
KL_VS_FULL, TEXT_PERPLEXITY = "kl_vs_full", "text_perplexity"


def _finite(x: float | None) -> float:
    return x if x is not None and not math.isnan(x) else math.inf


def _order(row: PolicyRow, by: str = KL_VS_FULL) -> tuple:
    accuracy = -row.probe_accuracy if row.probe_accuracy is not None else 0.0
    measure = _finite(row.kl_mean) if by == KL_VS_FULL else _finite(row.perplexity)
    return accuracy, measure, row.kv_bytes_peak


def rank_basis(tokens: int, trained_context: int | None) -> str:
    """KL against the full cache while the text fits the trained context, else the text's own perplexity."""
    return TEXT_PERPLEXITY if trained_context is not None and tokens > trained_context else KL_VS_FULL


def ranked(rows: list[PolicyRow], by: str = KL_VS_FULL) -> list[PolicyRow]:
    """The rows best first (``by``: ``KL_VS_FULL`` or ``TEXT_PERPLEXITY`` after the probe), each with its
    ``rank`` set (the input order breaks exact ties)."""
    out = sorted(rows, key=lambda row: _order(row, by))
    for i, row in enumerate(out, 1):
        row.rank = i
    return out
