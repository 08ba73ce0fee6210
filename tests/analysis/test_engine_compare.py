"""The top-N-truncated KL of compare --engine: its bounds hold the exact KL, are exact without a tail, and the
upper one is attained (so it is the tightest these facts allow)."""

from __future__ import annotations

import math

import pytest
import torch

from decodelab.core.analysis.engine_compare import tail_bound, truncated_kl


def kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return float((p.exp() * (p - q)).sum())


def top(logp: torch.Tensor, n: int) -> list[tuple[int, float]]:
    t = logp.topk(n)
    return list(zip(t.indices.tolist(), t.values.tolist()))


@pytest.mark.parametrize("vocab, n, scale", [(20, 3, 1.0), (50, 5, 3.0), (1000, 20, 3.0), (4096, 20, 5.0)])
def test_bounds_hold_the_exact_kl(vocab, n, scale):
    gen = torch.Generator().manual_seed(vocab + n)
    for _ in range(100):
        p = torch.log_softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * scale, -1)
        q = torch.log_softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * scale, -1)
        lower, upper, tail = truncated_kl(top(p, n), q)
        exact = kl(p, q)
        assert lower - 1e-9 <= exact <= upper + 1e-9
        assert tail == pytest.approx(1 - float(p.exp().topk(n).values.sum()), abs=1e-12)


def test_no_tail_no_gap():
    p = torch.log_softmax(torch.tensor([2.0, 1.0, 0.0, -1.0], dtype=torch.float64), -1)
    q = torch.log_softmax(torch.tensor([0.0, 1.0, 2.0, 0.5], dtype=torch.float64), -1)
    lower, upper, tail = truncated_kl(top(p, 4), q)
    assert lower == pytest.approx(kl(p, q), abs=1e-12) and upper == pytest.approx(kl(p, q), abs=1e-12)


def test_lower_bound_is_the_kl_with_the_tail_as_one_bucket():
    p = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.1], dtype=torch.float64)
    q = torch.tensor([0.3, 0.3, 0.2, 0.1, 0.1], dtype=torch.float64)
    lower, _, tail = truncated_kl([(0, math.log(0.5)), (1, math.log(0.2))], q.log())
    by_hand = 0.5 * math.log(0.5 / 0.3) + 0.2 * math.log(0.2 / 0.3) + 0.3 * math.log(0.3 / 0.4)
    assert tail == pytest.approx(0.3) and lower == pytest.approx(by_hand, abs=1e-12)


def test_upper_bound_is_attained():
    """P puts the cap on the unlisted tokens Q likes least, the rest on the next: the bound is its exact KL."""
    q = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.05, 0.03, 0.02], dtype=torch.float64)
    # listed: tokens 0, 1 with p 0.4, 0.2 (cap c = 0.2); tail 0.4 = 0.2 on token 6, 0.2 on token 5
    p = torch.tensor([0.4, 0.2, 0.0, 0.0, 0.0, 0.2, 0.2], dtype=torch.float64)
    exact = float(sum(pi * math.log(pi / qi) for pi, qi in zip(p.tolist(), q.tolist()) if pi > 0))
    lower, upper, tail = truncated_kl([(0, math.log(0.4)), (1, math.log(0.2))], q.log())
    assert upper == pytest.approx(exact, abs=1e-12) and lower <= exact


def test_tail_bound_by_hand():
    q = torch.tensor([0.5, 0.1, 0.2], dtype=torch.float64)
    # tail 0.25 under cap 0.1: 0.1 on q = 0.1, 0.1 on q = 0.2, 0.05 on q = 0.5
    expected = 0.1 * math.log(0.1 / 0.1) + 0.1 * math.log(0.1 / 0.2) + 0.05 * math.log(0.05 / 0.5)
    assert tail_bound(0.25, 0.1, q) == pytest.approx(expected, abs=1e-12)


def test_a_listed_token_the_local_model_removes_makes_the_kl_infinite():
    q = torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64).log()
    lower, upper, _ = truncated_kl([(0, math.log(0.6)), (1, math.log(0.4))], q)
    assert lower == math.inf and upper == math.inf
