"""The three functions every stage and statistic shares: log-softmax, softmax and entropy, in float32, with -inf
(a removed candidate) kept exact.
"""

from __future__ import annotations

import torch
from torch import Tensor

NEG_INF = float("-inf")


def log_softmax(logits: Tensor) -> Tensor:
    """log p_i = z_i - m - log sum_j exp(z_j - m), m = max z: finite for logits of +-1e4, exactly -inf for -inf."""
    return torch.log_softmax(logits.float(), dim=-1)


def softmax(logits: Tensor) -> Tensor:
    """p_i = exp(z_i - m) / sum_j exp(z_j - m), m = max z (torch subtracts the max; -inf gives exactly 0)."""
    return torch.softmax(logits.float(), dim=-1)


def entropy(probs: Tensor) -> Tensor:
    """H = -sum p log p in nats, with 0 log 0 = 0."""
    return torch.special.entr(probs).sum(dim=-1)
