"""The trace statistics (core/trace/stats.py): raw and processed entropies of greedy and sampled steps, alternatives
ranked kept before removed, mass removed under the distribution before each stage, the stage table, and pack/unpack
reading row 0. Vectors are chosen so the arithmetic is exact in float32 or compared with a stated tolerance."""

from __future__ import annotations

import math

import pytest
import torch

from decodelab.core.sampling.biases import LogitBias
from decodelab.core.sampling.chain import Chain, build_chain
from decodelab.core.sampling.distribution import softmax
from decodelab.core.sampling.step import select
from conftest import stage_stats
from decodelab.core.trace.stats import pack, ranked_alternatives, unpack

from conftest import NEG

INF = float("inf")


# --- the processed entropy of a greedy step ---------------------------------------------------------------------


P4 = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
Z4 = P4.log()
H4 = -sum(p * math.log(p) for p in (0.1, 0.2, 0.3, 0.4))  # 1.27985 nats


def traced(chain: Chain, logits: torch.Tensor, top: int = 4):
    from decodelab.core.sampling.select import Greedy

    sel = select(chain, Greedy(), torch.zeros(1, 1, dtype=torch.long), logits, record=True)
    host = pack(sel.token, logits, sel.processed, sel.stages, top).tolist()
    return unpack(host, top, logits.shape[-1], len(sel.stages))


def test_greedy_step_entropy_is_zero_and_raw_entropy_is_the_models():
    """Bug: the processed entropy taken from the raw distribution. At temperature 0 the selector draws from a point
    mass: entropy 0, prob 1, kept 1; the raw entropy stays H(0.1, 0.2, 0.3, 0.4) = 1.27985 nats."""
    n = traced(build_chain({"temperature": 0}), Z4)
    assert n.token_id == 3 and n.prob == 1.0 and n.kept == 1
    assert n.entropy == 0.0
    assert n.raw_entropy == pytest.approx(H4, rel=1e-6)
    assert n.raw_prob == pytest.approx(0.4, rel=1e-6) and n.raw_rank == 1


def test_sampled_step_entropy_is_the_processed_distributions():
    """Temperature 1, top-k 2 keeps 0.3 and 0.4 -> 3/7, 4/7: entropy of that, not of the raw four."""
    n = traced(build_chain({"temperature": 1.0, "top-k": 2}), Z4)
    q = (3 / 7, 4 / 7)
    assert n.entropy == pytest.approx(-sum(p * math.log(p) for p in q), rel=1e-5)
    assert n.raw_entropy == pytest.approx(H4, rel=1e-6) and n.kept == 2


# --- alternatives: kept candidates first ------------------------------------------------------------------------


def test_removed_candidates_rank_below_every_kept_one():
    """Bug: alternatives ranked by one mixed score, so a removed token with a high raw probability comes before a
    kept one. Raw 0.1, 0.2, 0.3, 0.4 with token 3 banned: kept 1/6, 2/6, 3/6 (ids 0, 1, 2), removed id 3 (raw 0.4).
    Expected order: 2, 1, 0 (processed), then 3; with top 2, only the kept 2, 1."""
    banned = LogitBias({3: -INF})(None, Z4)
    probs, raw = softmax(banned)[0], softmax(Z4)[0]
    keep = torch.isfinite(banned[0])
    assert ranked_alternatives(probs, raw, keep, 4).tolist() == [2, 1, 0, 3]
    assert ranked_alternatives(probs, raw, keep, 2).tolist() == [2, 1]
    # two removed: ids 3 and 2 banned -> kept 1 (2/3), 0 (1/3), then removed by raw: 3 (0.4), 2 (0.3)
    two = LogitBias({3: -INF, 2: -INF})(None, Z4)
    assert ranked_alternatives(softmax(two)[0], raw, torch.isfinite(two[0]), 4).tolist() == [1, 0, 3, 2]
    # and through the packed trace, with both probabilities labelled
    n = traced(build_chain({"bias": {3: -INF}}), Z4)
    assert [a[0] for a in n.alternatives] == [2, 1, 0, 3]
    assert [round(a[1], 6) for a in n.alternatives] == [0.5, round(2 / 6, 6), round(1 / 6, 6), 0.0]
    assert [round(a[2], 6) for a in n.alternatives] == [0.3, 0.2, 0.1, 0.4]


# --- mass_removed: under the distribution before the stage -------------------------------------------------------


def test_mass_removed_is_measured_before_the_stage_not_on_the_raw_distribution():
    """Bug: mass_removed measured against the raw distribution. Temperature 1/2 squares the probabilities:
    0.01, 0.04, 0.09, 0.16 over 0.30. Top-k 2 then removes ids 0 and 1: 5/30 = 1/6 of the tempered mass (0.3 of
    the raw). Top-p 0.5 after it: 9/25 and 16/25; 16/25 >= 0.5 alone, so it removes 9/25 = 0.36."""
    chain = build_chain({"temperature": 0.5, "top-k": 2, "top-p": 0.5})
    _, stages = chain.run_recorded(None, Z4)
    stats = stage_stats(stages).tolist()
    kept_counts = [int(k) for k, _, _ in stats]
    masses = [m for _, _, m in stats]
    assert kept_counts == [4, 4, 2, 1]
    assert masses == pytest.approx([0.0, 0.0, 1 / 6, 9 / 25], abs=1e-6)
    # a stage after one that already removed a token: that token is not counted again
    chain = build_chain({"bias": {0: -INF}, "top-k": 2})
    _, stages = chain.run_recorded(None, Z4)
    masses = [m for _, _, m in stage_stats(stages).tolist()]
    assert masses == pytest.approx([0.0, 0.1, 2 / 9], abs=1e-6)  # bias: 0.1; top-k drops id 1: 0.2 / 0.9


# --- exact edges: the cases mutation testing (tests/mutation/run.sh) showed no other test pinned down -------------


def test_stage_table_names_each_stage():
    from decodelab.core.sampling.filters import TopK
    from conftest import stage_table

    z = torch.tensor([[0.0, 1.0, 2.0]])
    assert [stat.name for stat, _ in stage_table([("raw", z), ("top-k", TopK(1)(None, z))])] == ["raw", "top-k"]


def test_a_kept_candidate_whose_probability_underflows_stays_among_the_kept():
    """Logit -200 is kept (finite) but its float32 probability is exactly 0: it still ranks before the removed id 2,
    whose raw probability is 0.99."""
    from decodelab.core.trace.stats import ranked_alternatives

    raw = torch.tensor([0.0, -200.0, 5.0])
    processed = torch.tensor([0.0, -200.0, NEG])
    probs = softmax(processed[None])[0]
    assert probs[1].item() == 0.0  # the premise
    alts = ranked_alternatives(probs, softmax(raw[None])[0], torch.isfinite(processed), 3)
    assert alts.tolist() == [0, 1, 2]


# --- found by the mutation run of 2026-11-30 (tests/mutation/SURVIVORS.md lists what no test can tell apart) ------


def test_pack_reads_row_0_of_every_tensor_and_works_without_recorded_stages():
    """Two rows, no stages recorded: the numbers are row 0's. Raw row 0 (0, ln 3) -> (1/4, 3/4); processed row 0
    (-inf, 0) -> (0, 1); token 1. Row 1 is the mirror image, so reading it would give other numbers."""
    from decodelab.core.trace.stats import pack, unpack

    raw = torch.tensor([[0.0, math.log(3.0)], [math.log(3.0), 0.0]])
    processed = torch.tensor([[NEG, 0.0], [0.0, NEG]])
    for top, alternatives in [(2, [(1, 1.0, 0.75), (0, 0.0, 0.25)]), (1, [(1, 1.0, 0.75)]), (0, [])]:
        n = unpack(pack(torch.tensor([1, 0]), raw, processed, None, top).tolist(), top, 2, 0)
        assert (n.token_id, n.finite, n.prob, n.logprob, n.kept, n.entropy) == (1, True, 1.0, 0.0, 1, 0.0)
        assert (n.raw_prob, n.raw_logprob, n.raw_rank) == (pytest.approx(0.75), pytest.approx(math.log(0.75)), 1)
        assert n.raw_entropy == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), rel=1e-6)
        assert [(i, p, pytest.approx(r)) for i, p, r in n.alternatives] == alternatives
        assert n.stages == [] and n.winners == []


def test_pack_with_stages_reads_the_race_of_row_0():
    """Two rows, raw then bias {2: -inf}. Row 0: raw logits (0, 0, 0) -> 1/3 each, entropy ln 3; after the bias
    (1/2, 1/2, 0), entropy ln 2, 2 kept, mass removed 1/3. Race draws E = (1, 1/e, 1/e^2) add g = -log E = (0, 1, 2):
    the raw winner is id 2, after the bias id 1 (the chosen token), and the bias removed the raw winner. Without the
    race (greedy) both winners would be id 0; row 1 (other logits, other draws) would give other numbers."""
    from decodelab.core.trace.stats import pack, unpack

    raw = torch.tensor([[0.0, 0.0, 0.0], [5.0, 0.0, 0.0]])
    biased = LogitBias({2: NEG})(None, raw)
    race = torch.tensor([[1.0, math.exp(-1.0), math.exp(-2.0)], [math.exp(-2.0), 1.0, 1.0]])
    host = pack(torch.tensor([1, 0]), raw, biased, [("raw", raw), ("bias", biased)], 3, race).tolist()
    n = unpack(host, 3, 3, 2)
    assert (n.token_id, n.finite, n.kept, n.raw_rank) == (1, True, 2, 1)
    assert (n.prob, n.raw_prob) == (pytest.approx(0.5), pytest.approx(1 / 3))
    assert (n.entropy, n.raw_entropy) == (pytest.approx(math.log(2.0)), pytest.approx(math.log(3.0)))
    assert [(k, pytest.approx(h), pytest.approx(m)) for k, h, m in n.stages] == [
        (3, math.log(3.0), 0.0), (2, math.log(2.0), 1 / 3)]
    assert (n.winners, n.ranks, n.removed) == ([2, 1], [1, 1], [True])
    ids = [i for i, _, _ in n.alternatives]
    assert sorted(ids[:2]) == [0, 1] and ids[2] == 2  # the kept pair (tied at 1/2), then the removed id
    assert [(pytest.approx(p), pytest.approx(r)) for _, p, r in n.alternatives] == [(0.5, 1 / 3)] * 2 + [(0.0, 1 / 3)]


def test_a_removed_candidate_whose_raw_probability_underflows_still_ranks_among_the_removed():
    """Raw logits (0, -200, ln 5, ln 7) with only id 0 kept: id 1's raw probability is exactly 0 in float32 but it is
    a real candidate (removed), not padding: the four alternatives are 0, then the removed by raw probability 3 (7/13),
    2 (5/13), 1 (0), each once."""
    from decodelab.core.trace.stats import ranked_alternatives

    raw = softmax(torch.tensor([[0.0, -200.0, math.log(5.0), math.log(7.0)]]))[0]
    assert raw[1].item() == 0.0  # the premise
    kept_mask = torch.tensor([True, False, False, False])
    probs = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert ranked_alternatives(probs, raw, kept_mask, 4).tolist() == [0, 3, 2, 1]
    assert ranked_alternatives(probs, raw, kept_mask, 2).tolist() == [0, 3]


def test_alternatives_keep_their_order_in_a_long_list():
    """20 candidates, the even ids kept: the first 10 alternatives are exactly the kept ones by probability (past the
    length where an unstable sort of the 20 padding flags would mix the two groups)."""
    from decodelab.core.trace.stats import ranked_alternatives

    z = torch.arange(20, dtype=torch.float32)
    kept_mask = torch.arange(20) % 2 == 0
    probs = softmax(torch.where(kept_mask, z, NEG)[None])[0]
    raw = softmax(z[None])[0]
    assert ranked_alternatives(probs, raw, kept_mask, 10).tolist() == list(range(18, -1, -2))
    assert ranked_alternatives(probs, raw, kept_mask, 20).tolist() == list(range(18, -1, -2)) + list(range(19, 0, -2))



# --- the race winners, ranks, counts and masses at ties, infinities and underflow (2026-12-01: pinned before trying
# faster forms of them; benchmarks/README.md, Trace) ----------------------------------------------------------------


def test_race_winners_are_the_first_of_tied_maxima_as_argmax_gives_them():
    """The winner of each row against torch.argmax (the first maximum): rows whose maximum is tied at several places
    (the first must win, not the last), sits at index 0 or V - 1, is +inf (tied: inf == inf), or is -inf everywhere
    but one; and a row of -inf alone (every entry ties: 0). Catches a form that finds the last maximum, an off-by-one
    at either end, or an equality that misses infinities (a difference of two infinities is NaN)."""
    from decodelab.core.trace.why import race_winners

    V = 7
    rows = torch.tensor([
        [0.0, 3.0, 1.0, 3.0, 2.0, 3.0, 0.5],  # tied at 1, 3, 5: argmax 1
        [9.0, 1.0, 9.0, 0.0, 0.0, 0.0, 9.0],  # tied at 0, 2, 6: argmax 0
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0],  # at V - 1
        [0.0, INF, 1.0, INF, 2.0, 0.0, 0.0],  # +inf, tied: argmax 1
        [-INF, -INF, -INF, -INF, 0.0, -INF, -INF],  # one survivor: 4
        [-INF] * V,  # all removed: every entry ties, argmax 0
    ])
    z = rows.reshape(3, 2, V)  # three steps of two stages each
    winners, lost = race_winners(z, None, torch.isneginf(z))
    assert winners.reshape(-1).tolist() == rows.argmax(dim=-1).tolist() == [1, 0, 6, 1, 4, 0]
    # stage 1 removed stage 0's winner where its logit there is -inf: step 2 only (row 5 at row 4's winner, 4)
    assert lost.reshape(-1).tolist() == [False, False, True]
    # with race noise g: the winner of z + g, again the first of ties (g = 0 at the tied places, -1 elsewhere)
    g = torch.tensor([-1.0, 0.0, -1.0, 0.0, -1.0, 0.0, -1.0])
    w, _ = race_winners(rows[:1][None].expand(1, 2, V), g[None], torch.zeros(1, 2, V))
    assert w.reshape(-1).tolist() == [1, 1]


def test_chosen_ranks_count_strictly_larger_logits_through_infinities():
    """rank = 1 + #{i : z_i > z_t}, with ties not counted and infinities compared as numbers: the chosen token tied
    with two others (rank 1, not 3), below a +inf (rank 2), itself removed (-inf: every finite logit is larger), and
    against other -inf entries (never larger than a -inf chosen). Catches >= for >, and a difference z_i - z_t, which
    is NaN for two infinities of one sign."""
    from decodelab.core.trace.why import chosen_ranks

    z = torch.tensor([[[2.0, 2.0, 1.0, 2.0, -INF], [2.0, INF, 1.0, 0.0, -INF], [1.0, 0.0, -INF, 3.0, -INF]]])
    z_t = z.gather(2, torch.tensor([[[0], [0], [2]]]))  # the chosen token's logit in each row
    assert chosen_ranks(z, z_t).tolist() == [[1.0, 2.0, 4.0]]


def test_counts_entropies_masses_and_alternatives_at_a_removed_and_an_underflowed_candidate():
    """A kept candidate whose probability underflows to 0 (logit -200; log p finite) beside two removed ones (-inf):
    the kept counts, the entropies (a removed candidate's 0 * -inf left out, the underflowed one's 0 * log p adding
    0), the mass the stage removed and the alternatives (the underflowed candidate kept, so before every removed
    one)."""
    from decodelab.core.trace.stats import kept_and_entropy, ranked_alternatives, removed_mass

    raw = torch.tensor([1.0, 0.9, -200.0, 0.5, 3.0, 1.0])
    processed = torch.tensor([1.0, 0.9, -200.0, -INF, 3.0, -INF])
    L = torch.stack([raw, processed])  # [S = 2, V]
    P, logP = torch.softmax(L, dim=-1), torch.log_softmax(L, dim=-1)
    assert P[1, 2].item() == 0.0 and math.isfinite(logP[1, 2].item())  # the premise
    removed = torch.isneginf(L)
    kept, H = kept_and_entropy(P, logP, removed)
    assert kept.tolist() == [6, 4]
    want_H = [-sum(p * math.log(p) for p in row.tolist() if p > 0) for row in P]
    assert H.tolist() == pytest.approx(want_H, rel=1e-6) and all(math.isfinite(h) for h in H.tolist())
    assert removed_mass(P, removed).tolist() == pytest.approx([0.0, (P[0, 3] + P[0, 5]).item()], rel=1e-6)
    assert ranked_alternatives(P[1], P[0], ~removed[1], 6).tolist() == [4, 0, 1, 2, 5, 3]


# --- found by the mutation run of 2026-12-01 (stats.py against this file and test_trace_blocks.py; the survivors
# left are in tests/mutation/SURVIVORS.md) ------------------------------------------------------------------------

Z5 = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])  # raw logits: order 0, 1, 2, 4, 3


def reference(rows: list[torch.Tensor]) -> list[tuple[list[float], int, float, float]]:
    """Per stage row [V]: probabilities, kept count, entropy (nats) and the mass it removed under the row before,
    in float64 from the definitions."""
    out, before = [], None
    for z in rows:
        z = z.double()
        p = torch.softmax(z, dim=-1)
        kept = int(torch.isfinite(z).sum())
        H = -sum(v * math.log(v) for v in p.tolist() if v > 0)
        mass = 0.0 if before is None else float(before[torch.isneginf(z)].sum())
        out.append((p.tolist(), kept, H, mass))
        before = p
    return out


def three_stage(values: dict, token: int, top: int = 5):
    chain = build_chain(values, order=list(values))  # the stages in the order given
    processed, stages = chain.run_recorded(None, Z5)
    host = pack(torch.tensor([token]), Z5, processed, stages, top).tolist()
    return unpack(host, top, 5, len(stages)), [z[0] for _, z in stages]


def test_three_stages_whose_last_reorders_the_kept_candidates():
    """raw -> top-k 3 -> bias {2: +3}: the last stage lifts id 2 over 0 and 1, so its row (not the one before it)
    orders the alternatives, 2, 0, 1, then the removed ones by raw probability, 4 (logit 0) before 3 (logit -1); every
    field of the step against float64 from the definitions. With S = 3, row -1 is not row +1 nor row -2, and stage 2's
    numbers sit at other offsets than stage 1's: a read of the wrong row or offset gives other numbers."""
    n, rows = three_stage({"top-k": 3, "bias": {2: 3.0}}, token=2)
    ref = reference(rows)
    p_last, p_raw = ref[-1][0], ref[0][0]
    assert [a[0] for a in n.alternatives] == [2, 0, 1, 4, 3]
    assert [a[1] for a in n.alternatives] == pytest.approx([p_last[i] for i in (2, 0, 1, 4, 3)], rel=1e-6)
    assert [a[2] for a in n.alternatives] == pytest.approx([p_raw[i] for i in (2, 0, 1, 4, 3)], rel=1e-6)
    assert (n.token_id, n.finite, n.kept) == (2, True, 3)
    assert (n.prob, n.raw_prob) == (pytest.approx(p_last[2], rel=1e-6), pytest.approx(p_raw[2], rel=1e-6))
    assert (n.logprob, n.raw_logprob) == (pytest.approx(math.log(p_last[2]), rel=1e-6),
                                          pytest.approx(math.log(p_raw[2]), rel=1e-6))
    assert n.raw_rank == 3 and n.ranks == [3, 3, 1]
    assert (n.entropy, n.raw_entropy) == (pytest.approx(ref[-1][2], rel=1e-6), pytest.approx(ref[0][2], rel=1e-6))
    assert [k for k, _, _ in n.stages] == [5, 3, 3]
    assert [h for _, h, _ in n.stages] == pytest.approx([r[2] for r in ref], rel=1e-6)
    assert [m for _, _, m in n.stages] == pytest.approx([0.0, ref[1][3], 0.0], abs=1e-7)
    assert ref[1][3] > 0.05  # the premise: top-k removed real mass
    # greedy: the raw and top-k winner is id 0, the bias's is id 2 (the chosen token); the bias removed nothing
    assert (n.winners, n.removed) == ([0, 0, 2], [False, False])


def test_three_stages_whose_last_removes_candidates():
    """raw -> bias {2: +3} -> top-k 2: the last stage is the one that removes (ids 1, 3, 4), so the kept mask must be
    its row's: the alternatives are 2, 0, then the removed by raw probability 1, 4, 3 (an earlier row's mask keeps all
    five, which would rank the removed ones by their processed probability, 0 each, a tie)."""
    n, rows = three_stage({"bias": {2: 3.0}, "top-k": 2}, token=2)
    ref = reference(rows)
    assert [a[0] for a in n.alternatives] == [2, 0, 1, 4, 3]
    assert [a[1] for a in n.alternatives][2:] == [0.0, 0.0, 0.0]
    assert (n.kept, [k for k, _, _ in n.stages]) == (2, [5, 5, 2])
    assert [m for _, _, m in n.stages] == pytest.approx([0.0, 0.0, ref[2][3]], abs=1e-7)


def test_a_token_removed_by_the_last_of_three_stages_is_not_finite():
    """A forced token (not the selector's) that top-k, the last stage, removed while the bias before it kept it:
    finite is read from the last row (False), not from the row before (True)."""
    n, _ = three_stage({"bias": {2: 3.0}, "top-k": 2}, token=1)
    assert (n.token_id, n.finite, n.prob) == (1, False, 0.0)


def test_a_kept_token_whose_probability_underflows_is_finite():
    """finite says the chain left the token a finite logit, not that its probability is above 0: a forced token at
    logit -200 (kept by every stage) has probability 0.0 in float32 and is finite."""
    z = torch.tensor([[0.0, -200.0, 1.0]])
    chain = build_chain({"temperature": 1.0})
    processed, stages = chain.run_recorded(None, z)
    n = unpack(pack(torch.tensor([1]), z, processed, stages, 3).tolist(), 3, 3, len(stages))
    assert (n.token_id, n.finite, n.prob) == (1, True, 0.0)


def test_stage_table_reports_each_stages_kept_count_entropy_and_removed_mass():
    """stage_table's numbers against float64 from the definitions on raw -> temperature 1/2 -> top-k 2 over Z5:
    kept 5, 5, 2; each row's entropy (the entropies of the three rows differ, so a softmax or a log-softmax over the
    wrong dim, or a field dropped, shows); top-k's removed mass under the tempered distribution."""
    from conftest import stage_table

    chain = build_chain({"temperature": 0.5, "top-k": 2}, order=["temperature", "top-k"])
    _, stages = chain.run_recorded(None, Z5)
    ref = reference([z[0] for _, z in stages])
    table = stage_table(stages)
    assert [s.name for s, _ in table] == ["raw", "temperature", "top-k"]
    assert [s.kept for s, _ in table] == [5, 5, 2] and all(isinstance(s.kept, int) for s, _ in table)
    assert [s.entropy for s, _ in table] == pytest.approx([r[2] for r in ref], rel=1e-6)
    assert [s.mass_removed for s, _ in table] == pytest.approx([r[3] for r in ref], abs=1e-7)
    assert len({round(r[2], 3) for r in ref}) == 3  # the premise: three different entropies
    assert [p.tolist() for _, p in table] == [pytest.approx(r[0], rel=1e-6) for r in ref]


def test_kept_ids_lists_each_stages_survivors_and_none_for_the_whole_vocabulary():
    """kept_ids on raw -> bias {3: -inf} -> top-k 2 over Z5: the raw row is left out; the bias keeps four of five
    (ids listed), top-k keeps ids 0 and 1; a stage that keeps every token gets ids None (temperature, added first)."""
    from decodelab.core.trace.stats import kept_ids

    chain = build_chain({"temperature": 1.5, "bias": {3: -INF}, "top-k": 2}, order=["temperature", "bias", "top-k"])
    _, stages = chain.run_recorded(None, Z5)
    assert kept_ids(stages) == [
        {"name": "temperature", "kept": 5, "ids": None},
        {"name": "bias", "kept": 4, "ids": [0, 1, 2, 4]},
        {"name": "top-k", "kept": 2, "ids": [0, 1]},
    ]
    assert kept_ids(stages[:1]) == []  # raw alone: no stage


def test_a_block_smaller_than_one_step_traces_every_step_alone(monkeypatch):
    """BLOCK_BYTES below one step's rows: a block of one step (not two), so each add fills the block."""
    from decodelab.core.trace import stats

    monkeypatch.setattr(stats, "BLOCK_BYTES", 8)
    block = stats.TraceBlock(64, 2)
    z = Z5.clone()
    stages = build_chain({"top-k": 2}).run_recorded(None, z)[1]
    assert block.add(0, z, stages[-1][1], stages, None) is True
    assert len(block.trace()) == 1 and len(block) == 0


def test_a_nan_logit_leaves_the_entropy_nan_not_zero():
    """Only a removed candidate's -inf is zeroed in p log p: a row holding a NaN logit (an overflowed model) has NaN
    probabilities, and its entropy must say NaN, where a sum that skips NaN would report 0 nats, a confident-looking
    number for a broken row; the clean row beside it keeps its entropy."""
    from decodelab.core.trace.stats import kept_and_entropy

    L = torch.tensor([[0.0, float("nan"), 1.0], [0.0, -INF, 0.0]])
    P, logP = torch.softmax(L, dim=-1), torch.log_softmax(L, dim=-1)
    _, H = kept_and_entropy(P, logP, torch.isneginf(L))
    assert math.isnan(H[0].item())
    assert H[1].item() == pytest.approx(math.log(2.0), rel=1e-6)


def test_scored_rows_are_each_rows_own_numbers_whatever_the_split(monkeypatch):
    """scored_rows packs a long sequence a slice at a time: split into slices of 1 and 3 rows, every number equals
    the one-slice result bit for bit; and each is the definition's (float64): log-probs, the rank by strictly larger
    logits, the entropies, the kept count of the processed row."""
    from decodelab.core.trace import stats

    torch.manual_seed(1)
    raw = torch.randn(7, 11) * 3
    processed = (raw / 0.7).masked_fill(raw < -1.0, float("-inf"))
    tokens = torch.tensor([0, 3, 5, 1, 10, 2, 7])
    whole = stats.scored_rows(raw, processed, tokens)
    for rows in (1, 3):
        monkeypatch.setattr(stats, "SCORED_BYTES", rows * 2 * 11 * 4)
        assert torch.equal(stats.scored_rows(raw, processed, tokens), whole)
    c = stats.COLUMN
    r64, p64 = torch.log_softmax(raw.double(), -1), torch.log_softmax(processed.double(), -1)
    at = tokens[:, None]
    assert whole[:, c["token_id"]].tolist() == tokens.float().tolist()
    assert whole[:, c["raw_logprob"]].tolist() == pytest.approx(r64.gather(1, at)[:, 0].tolist(), abs=1e-5)
    assert whole[:, c["logprob"]].tolist() == pytest.approx(p64.gather(1, at)[:, 0].tolist(), abs=1e-5)
    assert whole[:, c["raw_rank"]].tolist() == [1 + int((raw[i] > raw[i, t]).sum()) for i, t in enumerate(tokens)]
    assert whole[:, c["raw_entropy"]].tolist() == pytest.approx((-(r64.exp() * r64).sum(-1)).tolist(), abs=1e-5)
    h = -(p64.exp() * p64.nan_to_num(neginf=0.0)).sum(-1)
    assert whole[:, c["entropy"]].tolist() == pytest.approx(h.tolist(), abs=1e-5)
    assert whole[:, c["kept"]].tolist() == (~torch.isneginf(processed)).sum(-1).float().tolist()
