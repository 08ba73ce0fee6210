"""Exact edges of the processors, the emptiness check and the speculative rule's inputs: the cases mutation testing
(tests/mutation/run.sh) showed no other test pinned down. Every vector is exact in float32."""

from __future__ import annotations

import pytest
import torch

from decodelab.core.errors import ChainError
from decodelab.core.processors import MinP, TypicalP, build_chain, check_not_empty, softmax
from decodelab.core.speculative import point_masses

NEG = float("-inf")


def kept(logits: torch.Tensor, row: int = 0) -> list[int]:
    return torch.isfinite(logits[row]).nonzero().flatten().tolist()


def test_min_p_keeps_a_token_exactly_at_the_threshold():
    """p >= min_p * p_max is kept: probabilities 1/2, 1/4, 1/4 with min_p 1/2 put both quarters exactly on the
    threshold (a strict > would drop them); min_p 1 keeps every token tied with the maximum."""
    logits = torch.tensor([[2.0, 1.0, 1.0]]) * torch.log(torch.tensor(2.0))
    assert softmax(logits)[0].tolist() == pytest.approx([0.5, 0.25, 0.25], abs=1e-7)
    assert kept(MinP(0.5)(None, logits)) == [0, 1, 2]
    assert kept(MinP(0.5000001)(None, logits)) == [0]
    assert kept(MinP(1.0)(None, torch.tensor([[1.0, 3.0, 3.0, 2.0]]))) == [1, 2]


def test_typical_p_breaks_ties_by_vocabulary_order():
    """Equal logits: every token is exactly as typical (distance 0); the stable ranking keeps the lowest ids."""
    assert kept(TypicalP(0.5)(None, torch.zeros(1, 4))) == [0, 1]
    assert kept(TypicalP(0.26)(None, torch.zeros(1, 8))) == [0, 1, 2]


def test_emptiness_is_checked_per_row():
    """A batch where one row still has candidates and another has none is an error; NaN anywhere is too."""
    rows = torch.tensor([[0.0, NEG, 1.0], [NEG, NEG, NEG]])
    with pytest.raises(ChainError, match=r"the chain \[top-k, top-p\] removed every candidate token"):
        check_not_empty(rows, ["top-k", "top-p"])
    check_not_empty(torch.tensor([[0.0, NEG, NEG], [NEG, 2.0, NEG]]), ["x"])  # every row has one: fine
    with pytest.raises(ChainError):
        check_not_empty(torch.tensor([[0.0, 1.0, 2.0], [0.0, float("nan"), 1.0]]), ["x"])


def test_the_checked_chain_passes_the_ids_to_its_stages():
    """Chain.__call__ with a stage that reads the sequence: repetition penalty 2 on tokens 0 and 1."""
    chain = build_chain({"repetition-penalty": 2.0})
    out = chain(torch.tensor([[0, 1]]), torch.tensor([[2.0, -2.0, 1.0]]))
    assert out.tolist() == [[1.0, -4.0, 1.0]]


def test_point_masses_are_float_distributions():
    q = point_masses(torch.tensor([2, 0]), 3)
    assert q.dtype == torch.float32 and q.tolist() == [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]


def test_stage_table_names_each_stage():
    from decodelab.core.processors import TopK, stage_table

    z = torch.tensor([[0.0, 1.0, 2.0]])
    assert [stat.name for stat, _ in stage_table([("raw", z), ("top-k", TopK(1)(None, z))])] == ["raw", "top-k"]


def test_a_kept_candidate_whose_probability_underflows_stays_among_the_kept():
    """Logit -200 is kept (finite) but its float32 probability is exactly 0: it still ranks before the removed id 2,
    whose raw probability is 0.99."""
    from decodelab.core.stats import ranked_alternatives

    raw = torch.tensor([0.0, -200.0, 5.0])
    processed = torch.tensor([0.0, -200.0, NEG])
    probs = softmax(processed[None])[0]
    assert probs[1].item() == 0.0  # the premise
    alts = ranked_alternatives(probs, softmax(raw[None])[0], torch.isfinite(processed), 3)
    assert alts.tolist() == [0, 1, 2]


def test_residual_is_normalised_per_row():
    """Row 0: max(0, p - q) = (0, 1/2, 0) -> (0, 1, 0). Row 1: p == q leaves no excess: the row falls back to p."""
    from decodelab.core.speculative import residual_distribution

    p = torch.tensor([[0.5, 0.5, 0.0], [0.25, 0.25, 0.5]])
    q = torch.tensor([[1.0, 0.0, 0.0], [0.25, 0.25, 0.5]])
    assert residual_distribution(p, q).tolist() == [[0.0, 1.0, 0.0], [0.25, 0.25, 0.5]]


def test_a_draft_the_target_gives_probability_zero_is_never_accepted():
    """u = 0 and p(x) = 0: the rule accepts iff u < p/q, so 0 < 0 rejects (u <= p/q would accept an impossible
    token). The correction then comes from norm(max(0, p - q)) = the one token p allows."""
    from decodelab.core.speculative import verify_sampled

    p = torch.tensor([[[0.0, 1.0], [0.5, 0.5]]])  # [B=1, g+1=2, V=2]
    q = torch.tensor([[[1.0, 0.0]]])  # the draft proposed token 0 with certainty
    verdict = verify_sampled(p, q, torch.tensor([[0]]), torch.tensor([[0.0]]), torch.ones(1, 2))
    assert verdict.accepted.tolist() == [0] and verdict.token.tolist() == [1]
