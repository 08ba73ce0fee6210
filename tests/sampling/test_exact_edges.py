"""Exact edges of the processors, the emptiness check, the trace statistics, the step, the selector and the
speculative rule's inputs: the cases mutation testing (tests/mutation/run.sh) showed no other test pinned down.
Every vector is exact in float32 or compared with a stated tolerance."""

from __future__ import annotations

import math

import pytest
import torch

from decodelab.core.errors import ChainError
from decodelab.core.sampling.biases import LogitBias
from decodelab.core.sampling.filters import MinP, TypicalP
from decodelab.core.sampling.chain import build_chain, check_not_empty
from decodelab.core.sampling.distribution import softmax
from decodelab.core.methods.speculative.rule import point_masses

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
    from decodelab.core.sampling.filters import TopK
    from decodelab.core.trace.stats import stage_table

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


def test_residual_is_normalised_per_row():
    """Row 0: max(0, p - q) = (0, 1/2, 0) -> (0, 1, 0). Row 1: p == q leaves no excess: the row falls back to p."""
    from decodelab.core.methods.speculative.rule import residual_distribution

    p = torch.tensor([[0.5, 0.5, 0.0], [0.25, 0.25, 0.5]])
    q = torch.tensor([[1.0, 0.0, 0.0], [0.25, 0.25, 0.5]])
    assert residual_distribution(p, q).tolist() == [[0.0, 1.0, 0.0], [0.25, 0.25, 0.5]]


def test_a_draft_the_target_gives_probability_zero_is_never_accepted():
    """u = 0 and p(x) = 0: the rule accepts iff u < p/q, so 0 < 0 rejects (u <= p/q would accept an impossible
    token). The correction then comes from norm(max(0, p - q)) = the one token p allows."""
    from decodelab.core.methods.speculative.rule import verify_sampled

    p = torch.tensor([[[0.0, 1.0], [0.5, 0.5]]])  # [B=1, g+1=2, V=2]
    q = torch.tensor([[[1.0, 0.0]]])  # the draft proposed token 0 with certainty
    verdict = verify_sampled(p, q, torch.tensor([[0]]), torch.tensor([[0.0]]), torch.ones(1, 2))
    assert verdict.accepted.tolist() == [0] and verdict.token.tolist() == [1]


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


def test_the_emptiness_error_tells_an_overflow_from_a_chain_that_removed_everything():
    """NaN (inf - inf) or +inf in a row is an overflow, with its own message; a row of -inf is an emptied chain."""
    from decodelab.core.sampling.chain import empty_chain_error

    overflow = ("the chain [temperature] made a logit overflow to +inf or NaN: a value too extreme for float32 (such "
                "as a --temperature or --repetition-penalty near 0); use a less extreme value")
    with pytest.raises(ChainError) as err:
        check_not_empty(torch.tensor([[0.0, 1.0], [0.0, float("nan")]]), ["temperature"])
    assert str(err.value) == overflow
    assert str(empty_chain_error(["temperature"], torch.tensor([[float("inf"), 0.0]]))) == overflow
    emptied = "the chain [top-k, bias] removed every candidate token; loosen the filters or bans"
    assert str(empty_chain_error(["top-k", "bias"], torch.tensor([[NEG, NEG]]))) == emptied
    assert str(empty_chain_error(["top-k", "bias"])) == emptied


def test_chain_states_are_named_stage_dot_key_in_chain_order():
    """Only stages with a state() report; each value is the stage's own tensor, named "<stage>.<key>"."""
    from decodelab.core.sampling.chain import Chain
    from decodelab.core.sampling.scaling import Temperature

    class Stateful:
        def __init__(self, name, state):
            self.name, self._state = name, state

        def __call__(self, ids, logits):
            return logits

        def state(self):
            return self._state

    mu, coin, t = torch.tensor([3.0]), torch.tensor([1.0]), torch.tensor([0.5])
    chain = Chain([Stateful("mirostat", {"mu": mu}), Temperature(1.0), Stateful("xtc", {"coin": coin, "t": t})])
    names = [name for name, _ in chain.states()]
    assert names == ["mirostat.mu", "xtc.coin", "xtc.t"]
    assert all(value is want for (_, value), want in zip(chain.states(), (mu, coin, t)))
    assert Chain([Temperature(1.0)]).states() == []


def test_typical_p_breaks_ties_by_vocabulary_order_in_a_long_row():
    """32 equal logits (past the length where torch's unstable sort keeps the input order): mass before id i is i/32,
    so mass 1/4 keeps ids 0..7 exactly, the lowest ids."""
    assert kept(TypicalP(0.25)(None, torch.zeros(1, 32))) == list(range(8))


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


# --- the step, the selector and the token buffer ------------------------------------------------------------------


def test_token_buffer_views_the_committed_ids_and_follows_parents():
    """Prompt (5, 6) in a [2, 5] buffer: prefix() is the committed ids, prefix(1) adds one scratch id, new_ids only
    the generated ones; push writes one token per row, reorder makes both rows copies of row 1."""
    from decodelab.core.engine.tokens import TokenBuffer

    buf = TokenBuffer([5, 6], 5, "cpu", rows=2)
    assert buf.prefix().tolist() == [[5, 6], [5, 6]] and buf.new_ids == []
    buf.append([7])
    assert buf.prefix().tolist() == [[5, 6, 7]] * 2 and buf.prefix(1).tolist() == [[5, 6, 7, 0]] * 2
    assert buf.new_ids == [7] and buf.length == 3 and buf.last().tolist() == [[7], [7]]
    buf.push(torch.tensor([[8], [9]]))
    assert buf.prefix().tolist() == [[5, 6, 7, 8], [5, 6, 7, 9]] and buf.length == 4
    buf.reorder(torch.tensor([1, 1]))
    assert buf.prefix().tolist() == [[5, 6, 7, 9], [5, 6, 7, 9]]
    assert buf.ids.dtype == torch.long and TokenBuffer([], 2, "cpu").prefix().tolist() == [[]]


def test_select_gives_the_chain_the_ids_and_records_only_when_asked():
    """Repetition penalty 4 on token 0 (seen): logits (2, 1) become (1/2, 1), so greedy picks 1; without the ids it
    would pick 0. finite is per row: row 1 has no finite logit left."""
    from decodelab.core.sampling.select import Greedy
    from decodelab.core.sampling.step import select

    chain = build_chain({"repetition-penalty": 4.0})
    ids, logits = torch.tensor([[0], [0]]), torch.tensor([[2.0, 1.0], [NEG, NEG]])
    plain = select(chain, Greedy(), ids, logits)
    assert plain.token.tolist() == [1, 0] and plain.stages is None
    assert plain.processed.tolist() == [[0.5, 1.0], [NEG, NEG]] and plain.finite.tolist() == [True, False]
    recorded = select(chain, Greedy(), ids, logits, record=True)
    assert recorded.token.tolist() == [1, 0] and recorded.finite.tolist() == [True, False]
    assert [name for name, _ in recorded.stages] == ["raw", "repetition-penalty"]
    assert recorded.stages[1][1].tolist() == [[0.5, 1.0], [NEG, NEG]]


def test_chain_hands_accept_the_token_and_run_recorded_the_ids():
    from decodelab.core.sampling.chain import Chain
    from decodelab.core.sampling.penalties import RepetitionPenalty
    from decodelab.core.sampling.scaling import Temperature

    class Counting:
        name = "counting"

        def __init__(self):
            self.seen = []

        def __call__(self, ids, logits):
            return logits

        def accept(self, token):
            self.seen.append(token.tolist())

        def reset(self, prompt_len):
            self.prompt_len = prompt_len

    stage = Counting()
    chain = Chain([Temperature(1.0), stage])
    chain.reset(7)
    chain.accept(torch.tensor([3]))
    chain.accept(torch.tensor([4]))
    assert stage.seen == [[3], [4]] and stage.prompt_len == 7
    out, stages = Chain([RepetitionPenalty(2.0)]).run_recorded(torch.tensor([[1]]), torch.tensor([[1.0, 4.0]]))
    assert out.tolist() == [[1.0, 2.0]] and [n for n, _ in stages] == ["raw", "repetition-penalty"]


def test_the_selectors_on_probabilities_and_the_race_dtype():
    """Greedy on probabilities is the per-row arg-max; a fresh sampler has drawn nothing; its Exp(1) race is float32
    whatever the logits' dtype (bfloat16 draws would tie and bias the draw), so a seed draws the same token from
    bfloat16 and float32 copies of the same logits."""
    from decodelab.core.sampling.select import Greedy, Multinomial, make_generator

    assert Greedy()(torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]])).tolist() == [1, 0]
    assert Multinomial(make_generator(0, "cpu")).last_race is None
    z = torch.linspace(-2.0, 2.0, 64)[None]
    for seed in range(4):
        low, full = Multinomial(make_generator(seed, "cpu")), Multinomial(make_generator(seed, "cpu"))
        assert low.from_logits(z.bfloat16()).tolist() == full.from_logits(z.bfloat16().float()).tolist()
        assert low.last_race.dtype == torch.float32
        assert low(softmax(z).double()).tolist() == full(softmax(z)).tolist() and low.last_race.dtype == torch.float32


def test_stop_rules_capacity_prompt_checks_and_the_selected_token_check():
    """Capacity: prompt + -n, never past the context, never below the prompt. The prompt checks and the check of
    the selected token each give their one line."""
    from decodelab.core.errors import ConfigError
    from decodelab.core.engine.stopping import StopRules
    from decodelab.core.engine.tokens import check_prompt
    from decodelab.core.sampling.step import check_selected

    assert StopRules(100).capacity(4) == 104
    assert StopRules(100, context_length=10).capacity(4) == 10 and StopRules(3, context_length=10).capacity(4) == 7
    assert StopRules(100, context_length=10).capacity(12) == 12
    with pytest.raises(ConfigError) as err:
        check_prompt(0, None)
    assert str(err.value) == "PROMPT: the prompt is empty (0 tokens); give some text"
    with pytest.raises(ConfigError) as err:
        check_prompt(5, 5)
    assert str(err.value) == "PROMPT: the prompt is 5 tokens but the model's context is 5; shorten it"
    check_prompt(4, 5)
    check_prompt(4, None)
    chain = build_chain({"temperature": 0.5})
    check_selected(True, chain)
    with pytest.raises(ChainError, match=r"^the chain \[temperature\] made a logit overflow"):
        check_selected(False, chain, torch.tensor([[float("nan"), 0.0]]))
    with pytest.raises(ChainError, match=r"^the chain \[temperature\] removed every candidate token"):
        check_selected(False, chain, torch.tensor([[NEG, NEG]]))


def test_stop_strings_detokenize_a_constant_window_and_need_a_detokenizer():
    """A stop string of 2 characters: each check detokenizes only the last 4 * 2 + 4 = 12 ids, however long the
    output (the cost per token is constant), and a match there is reason "stop". Without a detokenizer stop strings
    are not looked for; an empty stop string is dropped."""
    from decodelab.core.engine.stopping import StopChecker, StopRules

    sizes = []

    def detok(ids):
        sizes.append(len(ids))
        return "".join("ab"[i] for i in ids)

    checker = StopChecker(StopRules(100, stop_strings=("ba", "")), detok)
    assert checker.check([0] * 50, 50) is None and sizes == [12]
    assert checker.check([0] * 50 + [1, 0], 52) == "stop" and sizes == [12, 12]
    assert checker.strings == ("ba",)
    assert StopChecker(StopRules(100, stop_strings=("ba",)), None).check([1, 0], 2) is None


def test_build_chain_maps_every_stage_name_to_its_processor_in_the_default_order():
    """Every stage of this module by name, with its value, in DEFAULT_ORDER; a stage of samplers.py gets its value
    and the context (min-new-tokens bans the context's end ids)."""
    from decodelab.core.sampling import biases, filters, penalties, scaling
    from decodelab.core.sampling.biases import MinNewTokens
    from decodelab.core.sampling.registry import StageContext

    settings = {"typical-p": 0.9, "min-p": 0.05, "top-p": 0.8, "top-k": 7, "temperature": 0.5, "bias": {1: 2.0},
                "no-repeat-ngram": 3, "repetition-penalty": 1.3, "softcap": 30.0}
    chain = build_chain(settings)
    want = [(scaling.SoftCap, "cap", 30.0), (penalties.RepetitionPenalty, "penalty", 1.3), (penalties.NoRepeatNGram, "n", 3),
            (biases.LogitBias, "bias", {1: 2.0}), (scaling.Temperature, "temperature", 0.5), (filters.TopK, "k", 7),
            (filters.TopP, "p", 0.8), (filters.MinP, "min_p", 0.05), (filters.TypicalP, "mass", 0.9)]
    assert [(type(p), getattr(p, field)) for p, (_, field, _) in zip(chain.processors, want)] == [
        (cls, value) for cls, _, value in want]
    (stage,) = build_chain({"min-new-tokens": 2}, context=StageContext(end_ids=(5,))).processors
    assert isinstance(stage, MinNewTokens) and (stage.n, stage.end_ids) == (2, (5,))


def test_build_chain_counts_the_repetition_penalty_as_the_context_says_and_names_chain_errors():
    """A context that counts repetition over the last 4 tokens builds the windowed penalty with that penalty; one
    that counts all tokens keeps the plain one. --chain errors are one line each."""
    from decodelab.core.errors import ConfigError
    from decodelab.core.sampling.registry import DEFAULT_ORDER
    from decodelab.core.sampling.penalties import RepetitionPenalty
    from decodelab.core.sampling.registry import StageContext
    from decodelab.core.sampling.penalties import WindowedRepetitionPenalty

    context = StageContext(counting={"repetition-penalty": ("all", 4)})
    (stage,) = build_chain({"repetition-penalty": 1.5}, context=context).processors
    assert isinstance(stage, WindowedRepetitionPenalty) and (stage.penalty, stage.last_n) == (1.5, 4)
    (plain,) = build_chain({"repetition-penalty": 1.5}, context=StageContext()).processors
    assert type(plain) is RepetitionPenalty
    settings = {"temperature": 0.5, "top-k": 3}
    for order, message in [
        (["temperature", "top-k", "top-k"], "--chain: a stage is named twice"),
        (["temperature", "nope"], f"--chain: unknown stage 'nope'; allowed: {', '.join(DEFAULT_ORDER)}"),
        (["temperature", "top-k", "top-p"], "--chain names 'top-p' but that stage has no value set; set it or drop it"),
        (["top-k"], "--chain leaves out 'temperature', which is set; add it to --chain or unset it"),
    ]:
        with pytest.raises(ConfigError) as err:
            build_chain(settings, order)
        assert str(err.value) == message
    assert [p.name for p in build_chain(settings, ["top-k", "temperature"]).processors] == ["top-k", "temperature"]


def test_trim_stop_cuts_the_first_occurrence_of_a_stop_string_present_in_the_text():
    """Ids 0 1 3 1 3 read "ab" "EN" "Dx" "EN" "Dx": "END" first occurs at 2, so the text is cut to "ab"; an absent
    stop string ("ZZ") takes no part; a stop id is dropped only when it is the last id; no match leaves the text."""
    from decodelab.core.engine.stopping import StopRules, trim_stop

    rules = StopRules(10, stop_strings=("ZZ", "", "END"), stop_ids=(9,))
    detok = lambda ids: "".join({0: "ab", 1: "EN", 3: "Dx", 9: "<s>"}[i] for i in ids)  # noqa: E731
    assert trim_stop([0, 1, 3, 1, 3], "stop", rules, detok) == ([0, 1, 3, 1, 3], "ab")
    assert trim_stop([0, 3, 9], "stop", rules, detok) == ([0, 3], "abDx")
    assert trim_stop([0, 9, 3], "stop", rules, detok) == ([0, 9, 3], "ab<s>Dx")
    assert trim_stop([0, 3], "stop", rules, detok) == ([0, 3], "abDx")
    assert trim_stop([0, 1, 3], "eos", rules, detok) == ([0, 1, 3], "abENDx")


# --- issue 22: a window shorter than the history, -inf candidates, values between two thresholds or on one ---------


def test_dry_counts_only_the_window_even_when_the_history_repeats_before_it():
    """History 0 1 2 3 0 1: the repeat "0 1" is followed by 2 at the start. Only a window of all 6 tokens sees it
    (n = 2 = L, so z_2 -= 1 * 1.75^0 = 1); windows of 3, 4 and 5 tokens start after the first "0" and see no
    earlier "0 1" (at 5 the earlier "1" is a repeat of length 1 < L)."""
    from decodelab.core.sampling.penalties import DRY

    h = [0, 1, 2, 3, 0, 1]
    assert DRY(1.0).penalties(h) == {2: 1.0}
    logits = torch.zeros(1, 4)
    for last_n, expected in [(3, [0, 0, 0, 0]), (4, [0, 0, 0, 0]), (5, [0, 0, 0, 0]), (6, [0, 0, -1.0, 0]),
                             (None, [0, 0, -1.0, 0])]:
        out = DRY(1.0, last_n=last_n)(torch.tensor([h]), logits)
        assert out[0].tolist() == expected, last_n


def test_top_n_sigma_measures_the_spread_of_the_finite_logits_only():
    """z = (3, 1, -1, -inf): over the three finite logits mean 1, sigma sqrt(8/3) = 1.633; N = 1.3 keeps z >=
    3 - 2.123 = 0.877: tokens 0 and 1. Counting the -inf as a fourth candidate (mean 0.75, sigma 1.431) would cut
    at 1.14 and keep token 0 only."""
    from decodelab.core.sampling.filters import TopNSigma

    logits = torch.tensor([[3.0, 1.0, -1.0, NEG]])
    assert kept(TopNSigma(1.3)(None, logits)) == [0, 1]
    assert kept(TopNSigma(1.0)(None, logits)) == [0]  # 3 - 1.633 = 1.367


def test_eta_cutoff_takes_the_smaller_of_its_two_thresholds():
    """p = (0.5, 0.3, 0.2) and a removed token: H = 1.0297 nats, sqrt(0.25) e^-H = 0.1786 < 0.25, so eta keeps
    p = 0.2, which lies between the two thresholds (the larger, epsilon 0.25, removes it)."""
    from decodelab.core.sampling.filters import EpsilonCutoff, EtaCutoff

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0]]))
    assert kept(EtaCutoff(0.25)(None, logits)) == [0, 1, 2]
    assert kept(EpsilonCutoff(0.25)(None, logits)) == [0, 1]


def test_cutoffs_keep_a_probability_exactly_on_the_threshold():
    """p = (1/2, 1/4, 1/4) exactly in float32: epsilon 1/4 removes only p < 1/4 (nothing here); just above, both
    quarters go. XTC's top choices are p >= T: with T = 1/4 all three reach it and all but the least likely (the
    last quarter, ties by id) go; just above, only 1/2 reaches it and XTC does nothing."""
    from decodelab.core.sampling.filters import XTC, EpsilonCutoff
    from decodelab.core.sampling.select import make_generator

    logits = torch.tensor([[2.0, 1.0, 1.0]]) * torch.log(torch.tensor(2.0))
    assert kept(EpsilonCutoff(0.25)(None, logits)) == [0, 1, 2]
    assert kept(EpsilonCutoff(0.2500001)(None, logits)) == [0]
    assert kept(XTC(0.25, 1.0, make_generator(0, "cpu"))(None, logits)) == [2]
    assert kept(XTC(0.2500001, 1.0, make_generator(0, "cpu"))(None, logits)) == [0, 1, 2]


def test_typical_p_ranks_a_removed_candidate_last():
    """z = (0, 0, -inf): the two live tokens are exactly typical (distance 0), the removed one infinitely far;
    mass 0.5 keeps token 0, mass 0.75 both live ones, never the removed one."""
    logits = torch.tensor([[0.0, 0.0, NEG]])
    assert kept(TypicalP(0.5)(None, logits)) == [0]
    assert kept(TypicalP(0.75)(None, logits)) == [0, 1]
    assert kept(TypicalP(1.0)(None, logits)) == [0, 1]
