"""Processors against transformers' own, on random logits; hand-checkable vectors; hypothesis properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation import logits_process as hf

from decodelab.core.errors import ChainError, ConfigError
from decodelab.core.sampling.chain import Chain, build_chain
from decodelab.core.sampling.biases import LogitBias
from decodelab.core.sampling.filters import MinP, TopK, TopP, TypicalP
from decodelab.core.sampling.penalties import NoRepeatNGram, RepetitionPenalty
from decodelab.core.sampling.scaling import SoftCap, Temperature
from decodelab.core.sampling.distribution import softmax
from conftest import stage_table

V = 50


def random_case(seed: int, batch: int = 4, length: int = 12, vocab: int = V, masked: bool = True):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen) * 3
    if masked:  # some candidates already removed by an earlier stage
        logits[0, :5] = float("-inf")
    ids = torch.randint(0, vocab // 3, (batch, length), generator=gen)  # small id range -> repeats and n-grams
    return ids, logits


def kept(logits: torch.Tensor, row: int = 0) -> list[int]:
    """Ids left with a finite logit in one row (row 0 unless told)."""
    return torch.isfinite(logits[row]).nonzero().flatten().tolist()


PAIRS = [
    (Temperature(0.7), hf.TemperatureLogitsWarper(0.7)),
    (Temperature(1.9), hf.TemperatureLogitsWarper(1.9)),
    (TopK(1), hf.TopKLogitsWarper(1)),
    (TopK(7), hf.TopKLogitsWarper(7)),
    (TopP(0.3), hf.TopPLogitsWarper(0.3)),
    (TopP(0.9), hf.TopPLogitsWarper(0.9)),
    (MinP(0.05), hf.MinPLogitsWarper(0.05)),
    (MinP(0.5), hf.MinPLogitsWarper(0.5)),
    (TypicalP(0.2), hf.TypicalLogitsWarper(0.2)),
    (TypicalP(0.9), hf.TypicalLogitsWarper(0.9)),
    (RepetitionPenalty(1.3), hf.RepetitionPenaltyLogitsProcessor(1.3)),
    (RepetitionPenalty(0.8), hf.RepetitionPenaltyLogitsProcessor(0.8)),
    (NoRepeatNGram(1), hf.NoRepeatNGramLogitsProcessor(1)),
    (NoRepeatNGram(2), hf.NoRepeatNGramLogitsProcessor(2)),
    (NoRepeatNGram(3), hf.NoRepeatNGramLogitsProcessor(3)),
    (LogitBias({3: 2.5, 7: -1.0, 11: float("-inf")}),
     hf.SequenceBiasLogitsProcessor({(3,): 2.5, (7,): -1.0, (11,): float("-inf")})),
]


@pytest.mark.parametrize("ours,theirs", PAIRS, ids=lambda p: getattr(p, "name", type(p).__name__))
@pytest.mark.parametrize("seed", range(5))
def test_matches_transformers(ours, theirs, seed):
    ids, logits = random_case(seed)
    expected = theirs(ids.clone(), logits.clone())
    got = ours(ids, logits)
    assert torch.equal(torch.isneginf(got), torch.isneginf(expected))
    finite = ~torch.isneginf(expected)
    torch.testing.assert_close(got[finite], expected[finite], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.999])
@pytest.mark.parametrize("spread", [0.5, 4.0])
def test_top_p_large_vocab_fast_path_matches_transformers(p, spread):
    """With 4096 candidates, top-p ranks only the head when it already holds mass p; both paths are exact."""
    ids, logits = random_case(7, vocab=4096, masked=False)
    logits = logits * spread
    expected = hf.TopPLogitsWarper(p)(ids, logits.clone())
    got = TopP(p)(ids, logits)
    assert torch.equal(torch.isneginf(got), torch.isneginf(expected))


def test_top_p_one_keeps_everything():
    ids, logits = random_case(7, vocab=4096, masked=True)
    got = TopP(1.0)(ids, logits * 8)
    assert torch.equal(torch.isneginf(got), torch.isneginf(logits))


@pytest.mark.parametrize("ours,_", PAIRS + [(SoftCap(5.0), None)], ids=lambda p: getattr(p, "name", "x"))
def test_never_modifies_its_input(ours, _):
    ids, logits = random_case(0)
    ids_before, logits_before = ids.clone(), logits.clone()
    ours(ids, logits)
    assert torch.equal(ids, ids_before)
    assert torch.equal(logits, logits_before)


def test_softcap_matches_gemma_formula_and_keeps_removed_tokens_removed():
    logits = torch.tensor([[-1e4, -50.0, 0.0, 3.0, 50.0, 1e4, float("-inf")]])
    got = SoftCap(30.0)(None, logits)
    expected = 30.0 * torch.tanh(logits[0, :6] / 30.0)
    torch.testing.assert_close(got[0, :6], expected)
    assert got[0, 6] == float("-inf")
    assert got[0, :6].abs().max() <= 30.0  # tanh saturates to exactly +-1 in float32


# --- hand-checkable vectors (probabilities 0.1, 0.2, 0.3, 0.4) ---------------------------------------------

P = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
Z = P.log()


def kept_probs(proc) -> list[float]:
    return [round(x, 3) for x in softmax(proc(None, Z))[0].tolist()]


def test_top_k_hand_vector():
    assert kept_probs(TopK(3)) == [0.0, 0.222, 0.333, 0.444]


def test_top_p_hand_vector():
    # sorted 0.4, 0.3, 0.2, 0.1: 0.4 < 0.5, 0.4 + 0.3 reaches it -> keep {0.4, 0.3}
    assert kept_probs(TopP(0.5)) == [0.0, 0.0, 0.429, 0.571]
    assert kept_probs(TopP(0.4)) == [0.0, 0.0, 0.0, 1.0]
    assert kept_probs(TopP(1.0)) == [0.1, 0.2, 0.3, 0.4]


def test_min_p_hand_vector():
    # threshold 0.45 * 0.4 = 0.18 keeps 0.2, 0.3, 0.4; 0.6 * 0.4 = 0.24 keeps 0.3, 0.4
    assert kept_probs(MinP(0.45)) == [0.0, 0.222, 0.333, 0.444]
    assert kept_probs(MinP(0.6)) == [0.0, 0.0, 0.429, 0.571]


def test_typical_hand_vector():
    # H = 1.2799 nats; |-ln p - H| = 1.023, 0.330, 0.076, 0.364 -> order 0.3, 0.2, 0.4, 0.1; mass 0.5 keeps {0.3, 0.2}
    assert kept_probs(TypicalP(0.5)) == [0.0, 0.4, 0.6, 0.0]


def test_temperature_zero_is_a_point_mass_on_the_argmax():
    assert kept_probs(Temperature(0)) == [0.0, 0.0, 0.0, 1.0]


def test_repetition_penalty_hand_vector():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    got = RepetitionPenalty(2.0)(torch.tensor([[0, 1]]), logits)
    assert got.tolist() == [[1.0, -4.0, 1.0]]


def test_no_repeat_ngram_hand_vector():
    # sequence 1 2 3 1 2: the bigram (2, 3) exists, so after "... 2" the token 3 is banned (n=2)
    logits = torch.zeros(1, 5)
    got = NoRepeatNGram(2)(torch.tensor([[1, 2, 3, 1, 2]]), logits)
    assert torch.isneginf(got[0]).tolist() == [False, False, False, True, False]
    # trigram: "1 2" was followed by 3
    got3 = NoRepeatNGram(3)(torch.tensor([[1, 2, 3, 1, 2]]), logits)
    assert torch.isneginf(got3[0]).tolist() == [False, False, False, True, False]


def test_stage_stats_hand_vector():
    after = TopK(2)(None, Z)
    (raw, _), (stat, probs) = stage_table([("raw", Z), ("top-k", after)])
    assert raw.kept == 4 and raw.mass_removed == 0.0
    assert stat.kept == 2
    assert stat.mass_removed == pytest.approx(0.3)
    q = torch.tensor([3 / 7, 4 / 7])
    assert stat.entropy == pytest.approx(float(-(q * q.log()).sum()), rel=1e-5)
    torch.testing.assert_close(probs[2:], q)


# --- the chain -------------------------------------------------------------------------------------------------


def test_default_order_and_explicit_order():
    chain = build_chain({"top-p": 0.9, "temperature": 0.7, "softcap": 30.0})
    assert chain.names == ["softcap", "temperature", "top-p"]
    chain = build_chain({"top-p": 0.9, "temperature": 0.7}, ["top-p", "temperature"])
    assert chain.names == ["top-p", "temperature"]


def test_bias_position_in_the_chain_changes_the_result():
    # a bias applied before top-k can lift a token into the kept set; applied after, it cannot revive it
    values = {"bias": {0: 10.0}, "top-k": 2}
    before = build_chain(values, ["bias", "top-k"])(None, Z)
    after = build_chain(values, ["top-k", "bias"])(None, Z)
    assert not torch.isneginf(before[0, 0])
    assert torch.isneginf(after[0, 0])


@pytest.mark.parametrize("order,message", [
    (["top-p", "nonsense"], "unknown stage"),
    (["top-p"], "leaves out 'temperature'"),
    (["top-p", "temperature", "top-k"], "names 'top-k'"),
])
def test_bad_chain_orders_are_config_errors(order, message):
    with pytest.raises(ConfigError, match=message):
        build_chain({"top-p": 0.9, "temperature": 0.7}, order)


def test_a_chain_that_removes_everything_is_an_error_not_nan():
    chain = Chain([LogitBias({i: float("-inf") for i in range(4)})])
    with pytest.raises(ChainError, match="removed every candidate"):
        chain(None, Z)


def test_extreme_logits_are_stable():
    logits = torch.tensor([[1e4, -1e4, 0.0, float("-inf")]])
    probs = softmax(logits)
    assert torch.isfinite(probs).all()
    assert probs[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    chain = build_chain({"temperature": 0.5, "top-p": 0.9})
    out = chain(None, logits)
    assert torch.isfinite(softmax(out)).all()


# --- properties ------------------------------------------------------------------------------------------------

logit_rows = st.lists(st.floats(-30, 30, allow_nan=False), min_size=2, max_size=40).map(
    lambda xs: torch.tensor([xs], dtype=torch.float32))


@settings(max_examples=60, deadline=None)
@given(logit_rows)
def test_probabilities_sum_to_one(row):
    for proc in (Temperature(0.5), TopK(3), TopP(0.7), MinP(0.1), TypicalP(0.6), SoftCap(3.0)):
        total = float(softmax(proc(None, row)).sum())
        assert total == pytest.approx(1.0, abs=1e-5)


@settings(max_examples=60, deadline=None)
@given(logit_rows, st.floats(0.05, 5.0))
def test_temperature_preserves_order(row, t):
    out = Temperature(t)(None, row)
    a, b = row[0], out[0]
    for i in range(len(a)):
        for j in range(len(a)):
            if a[i] > a[j]:
                assert b[i] >= b[j]


@settings(max_examples=80, deadline=None)
@given(logit_rows, st.floats(0.01, 1.0))
def test_top_p_keeps_the_smallest_prefix_reaching_p(row, p):
    probs = softmax(row)[0].double()
    kept = ~torch.isneginf(TopP(p)(None, row)[0])
    n = int(kept.sum())
    ranked = probs.sort(descending=True).values
    kept_mass = float(probs[kept].sum())
    # the kept set is the top-n by probability, reaches p, and dropping its least likely member would not
    assert float(probs[kept].min()) >= float(probs[~kept].max()) if n < len(probs) else True
    assert kept_mass >= p - 1e-5 or n == len(probs)
    assert n == 1 or float(ranked[: n - 1].sum()) < p + 1e-5


@settings(max_examples=80, deadline=None)
@given(logit_rows)
def test_stable_softmax_equals_naive_where_finite(row):
    naive = row.double().exp() / row.double().exp().sum()
    torch.testing.assert_close(softmax(row)[0].double(), naive[0], rtol=1e-5, atol=1e-7)


def test_entropy_of_uniform_is_log_v():
    ((stat, _),) = stage_table([("raw", torch.zeros(1, 8))])
    assert stat.entropy == pytest.approx(math.log(8))


# --- top-k: ties with the k-th value are kept ------------------------------------------------------------------


def test_top_k_keeps_every_token_tied_with_the_kth():
    """Bug: top-k keeps exactly k ids (topk indices) and drops those tied with the k-th value.
    Logits 1, 2, 2, 3 with k = 2: the k-th largest is 2, held by ids 1 and 2, so three ids survive."""
    logits = torch.tensor([[1.0, 2.0, 2.0, 3.0]])
    assert kept(TopK(2)(None, logits)) == [1, 2, 3]
    assert kept(TopK(1)(None, logits)) == [3]
    assert kept(TopK(3)(None, logits)) == [1, 2, 3]
    # all equal: any k keeps all of them
    assert kept(TopK(1)(None, torch.zeros(1, 4))) == [0, 1, 2, 3]


# --- top-p: the boundary where the mass before a token equals p exactly ----------------------------------------


def test_top_p_stops_when_the_mass_before_a_token_equals_p_exactly():
    """Bug: `mass_before <= p` keeps one token too many when the mass before it is exactly p.
    Four equal logits give p = 1/4 each (exact in float32); the masses before them are 0, 1/4, 1/2, 3/4. With
    top-p 1/2 the third token has exactly 1/2 before it: the first two already reach p, so exactly two stay."""
    logits = torch.zeros(1, 4)
    assert softmax(logits)[0].tolist() == [0.25] * 4  # the premise: exact quarters
    assert len(kept(TopP(0.5)(None, logits))) == 2
    assert len(kept(TopP(0.25)(None, logits))) == 1
    assert len(kept(TopP(0.75)(None, logits))) == 3
    assert len(kept(TopP(0.75 + 2**-20)(None, logits))) == 4  # just past the boundary: the fourth is needed


def test_top_p_exact_powers_of_two():
    """Probabilities 1/2, 1/4, 1/8, 1/8 (logits log 4, log 2, 0, 0 -> exp differences 4, 2, 1, 1 over 8, exact):
    top-p 3/4 keeps {1/2, 1/4} (the mass before the third is exactly 3/4), top-p 1/2 keeps {1/2}."""
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0]]) * math.log(2.0)
    probs = softmax(logits)[0].tolist()
    assert probs == pytest.approx([0.5, 0.25, 0.125, 0.125], abs=1e-7)
    assert kept(TopP(0.75)(None, logits)) == [0, 1]
    assert kept(TopP(0.5)(None, logits)) == [0]


# --- no-repeat-ngram: a sequence exactly n long, and a prompt of n-1 tokens ------------------------------------


def test_no_repeat_ngram_bans_inside_a_sequence_exactly_n_long():
    """Bug: a sequence of exactly n tokens is skipped (`length <= n` before any work).
    [3, 3] with n = 2: the bigram (3, 3) exists and the last token is 3, so 3 is banned next.
    [4, 4, 4] with n = 3: (4, 4, 4) exists and the tail is (4, 4), so 4 is banned."""
    logits = torch.zeros(1, 6)
    assert torch.isneginf(NoRepeatNGram(2)(torch.tensor([[3, 3]]), logits)[0]).nonzero().flatten().tolist() == [3]
    assert torch.isneginf(NoRepeatNGram(3)(torch.tensor([[4, 4, 4]]), logits)[0]).nonzero().flatten().tolist() == [4]
    # exactly n long without a repeat in the tail: nothing banned ((1, 2) would need the tail 1)
    assert not torch.isneginf(NoRepeatNGram(2)(torch.tensor([[1, 2]]), logits)).any()


@pytest.mark.parametrize("n", [2, 3, 5])
def test_no_repeat_ngram_on_fewer_than_n_tokens_bans_nothing_and_does_not_crash(n):
    """Bug (a crash today): n-1 tokens form no n-gram, but the old guard let them through to unfold(1, n, 1)."""
    logits = torch.arange(8, dtype=torch.float32)[None]
    for length in range(1, n):
        ids = torch.full((1, length), 2)
        out = NoRepeatNGram(n)(ids, logits)
        assert torch.equal(out, logits) and out is not logits  # unchanged, and a new tensor (pure)


# --- exact edges: the cases mutation testing (tests/mutation/run.sh) showed no other test pinned down -------------


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


# --- found by the mutation run of 2026-11-30 (tests/mutation/SURVIVORS.md lists what no test can tell apart) ------


def test_softmax_helpers_work_over_the_last_axis_of_any_shape():
    """log_softmax, softmax and entropy normalise over the last axis: a 1-D vector (the scheduler and the many-samples
    trace pass one) and [B, T, V] alike. Logits (0, ln 3) give (1/4, 3/4); a row of equal logits gives (1/2, 1/2),
    so the 3-D case differs from a normalisation over axis 1."""
    from decodelab.core.sampling.distribution import entropy, log_softmax

    z = torch.tensor([0.0, math.log(3.0)])
    assert softmax(z).tolist() == pytest.approx([0.25, 0.75], rel=1e-6)
    assert log_softmax(z).tolist() == pytest.approx([math.log(0.25), math.log(0.75)], rel=1e-6)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert entropy(torch.tensor([0.25, 0.75])).item() == pytest.approx(h, rel=1e-6)
    z3 = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0]]])  # [1, 2, 2]
    assert softmax(z3).tolist() == [[pytest.approx([0.25, 0.75], rel=1e-6), [0.5, 0.5]]]
    assert log_softmax(z3).exp().tolist() == [[pytest.approx([0.25, 0.75], rel=1e-6), pytest.approx([0.5, 0.5])]]
    assert entropy(softmax(z3)).tolist() == [pytest.approx([h, math.log(2.0)], rel=1e-6)]


def test_typical_p_breaks_ties_by_vocabulary_order_in_a_long_row():
    """32 equal logits (past the length where torch's unstable sort keeps the input order): mass before id i is i/32,
    so mass 1/4 keeps ids 0..7 exactly, the lowest ids."""
    assert kept(TypicalP(0.25)(None, torch.zeros(1, 32))) == list(range(8))


# --- issue 22: a removed candidate -------------------------------------------------------------------------------


def test_typical_p_ranks_a_removed_candidate_last():
    """z = (0, 0, -inf): the two live tokens are exactly typical (distance 0), the removed one infinitely far;
    mass 0.5 keeps token 0, mass 0.75 both live ones, never the removed one."""
    logits = torch.tensor([[0.0, 0.0, float("-inf")]])
    assert kept(TypicalP(0.5)(None, logits)) == [0]
    assert kept(TypicalP(0.75)(None, logits)) == [0, 1]
    assert kept(TypicalP(1.0)(None, logits)) == [0, 1]
