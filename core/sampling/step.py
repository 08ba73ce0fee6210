"""One decode step: the chain on a row of logits, then the selector; with the check that a candidate was left."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .chain import Chain, empty_chain_error


class Selected(NamedTuple):
    token: Tensor  # [B] on the device
    processed: Tensor  # [B, V] the distribution the selector drew from (logits)
    stages: list[tuple[str, Tensor]] | None  # ("raw", logits), then each stage's output, when recorded
    finite: Tensor  # [B] bool: the chain left the selected token a finite logit


def select(chain: Chain, selector, ids: Tensor, logits: Tensor, record: bool = False) -> Selected:
    """Chain, then selector, on the device (no host read)."""
    if record:
        processed, stages = chain.run_recorded(ids, logits)
    else:
        processed, stages = chain.apply(ids, logits), None
    token = selector.from_logits(processed)
    finite = torch.isfinite(processed.gather(-1, token.unsqueeze(-1)).squeeze(-1))
    return Selected(token, processed, stages, finite)


def read_selected(sel: Selected) -> tuple[int, bool]:
    """Row 0's token id and whether the chain left it a finite logit, in one transfer of one number: the id where
    finite, else -1 (ids are >= 0)."""
    value = int(torch.where(sel.finite[:1], sel.token[:1], -1).item())
    return (value, True) if value >= 0 else (0, False)


def check_selected(finite: bool, chain: Chain, logits: Tensor | None = None) -> None:
    """The argmax of an all -inf (or NaN) row is meaningless: one clean error instead (``logits``, the processed
    rows, tell an overflow from a chain that removed everything)."""
    if not finite:
        raise empty_chain_error(chain.names, logits)
