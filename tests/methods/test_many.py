"""`sample -N` core: N samples of one prompt, batched or one after another, and their spread.

mutation run of core/methods/many.py (2026-12-02): every row is checked against the single run with seed + i
(:class:`Sampler`, a separate code path), the spread against numbers worked by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from decodelab.core.engine.stopping import StopRules
from decodelab.core.errors import ChainError, ConfigError
from decodelab.core.kv import parse_cache_spec
from decodelab.core.methods.many import SampleRow, can_batch, row_races, sample_batched, sample_many, spread
from decodelab.core.methods.sample import Sampler
from decodelab.core.sampling.biases import MinNewTokens
from decodelab.core.sampling.chain import Chain, build_chain
from decodelab.core.sampling.select import Multinomial, make_generator, make_selector

from conftest import random_model

PROMPT = [5, 17, 42]


def singles(model, chain, seed: int, n: int, rules: StopRules, temperature: float = 1.0, detok=None):
    """Row i as `sample --seed seed+i` runs it: (token ids, processed log-probs, stop reason) per row."""
    out = []
    for i in range(n):
        selector = make_selector("greedy" if temperature == 0 else "multinomial", seed + i, "cpu")
        run = Sampler(model, PROMPT, chain, selector, rules, str, detok, top=0)
        steps = list(run)
        out.append(([s.token_id for s in steps], [s.logprob for s in steps], run.stop_reason))
    return out


def test_can_batch_by_policy():
    assert can_batch(None) and can_batch(parse_cache_spec("full")) and can_batch(parse_cache_spec("window:size=4"))
    assert not can_batch(parse_cache_spec("paged"))


def test_row_races_are_each_seeds_own_draws():
    """Row i is the [1, V] Exp(1) vector the single run's selector draws from generator i, step after step."""
    gens = [make_generator(3, "cpu"), make_generator(8, "cpu")]
    singles_ = [Multinomial(make_generator(3, "cpu")), Multinomial(make_generator(8, "cpu"))]
    for _ in range(2):
        races = row_races(gens, 5, "cpu")
        assert races.shape == (2, 5) and races.dtype == torch.float32
        want = torch.cat([m._race(torch.zeros(1, 5)) for m in singles_])
        torch.testing.assert_close(races, want, rtol=0, atol=0)


def test_rows_that_stop_at_different_steps_are_each_their_single_run():
    """An EOS id that row 0 draws at its third step: every row ends at its own first EOS (or at -n), batched or
    not, with the tokens and processed log-probabilities of the single run with seed + i."""
    model = random_model("llama", seed=2, scale=4.0)
    chain = build_chain({"temperature": 1.3, "top-k": 12})
    free = singles(model, chain, 20, 6, StopRules(7, ignore_eos=True))
    eos = free[0][0][2]
    rules = StopRules(7, eos_ids=(eos,))
    want = singles(model, chain, 20, 6, rules)
    assert sorted({len(ids) for ids, _, _ in want}) != [7]  # some row ends early, some later
    assert {reason for _, _, reason in want} >= {"eos"}
    for batched in (True, False):
        rows, summary = sample_many(model, PROMPT, chain, "multinomial", 20, 6, rules, batched=batched)
        assert summary.batched is batched and summary.num_samples == 6
        for i, (row, (ids, logps, reason)) in enumerate(zip(rows, want)):
            assert (row.index, row.seed, row.token_ids, row.length, row.stop_reason) == (i, 20 + i, ids, len(ids),
                                                                                         reason)
            assert row.text == " ".join(map(str, ids))  # no detokenizer: the ids
            assert row.sum_logprob == pytest.approx(sum(logps), abs=1e-4)
            assert row.mean_logprob == pytest.approx(sum(logps) / len(logps), abs=1e-4)
        assert summary.tokens_per_s > 0 and math.isfinite(summary.tokens_per_s)
        assert summary.distinct_outputs == len({tuple(ids) for ids, _, _ in want})


def test_batched_rows_stop_on_a_stop_string_and_at_the_context():
    model = random_model("llama", seed=2, scale=4.0)
    chain = build_chain({"temperature": 1.3})
    detok = lambda ids: "".join(f"<{t}>" for t in ids)  # noqa: E731
    free = singles(model, chain, 0, 4, StopRules(6, ignore_eos=True))
    stop = f"<{free[1][0][1]}>"
    rules = StopRules(6, stop_strings=(stop,), ignore_eos=True)
    want = singles(model, chain, 0, 4, rules, detok=detok)
    out, logps, reasons = sample_batched(model, PROMPT, chain, "multinomial", 0, 4, rules, detok)
    assert out == [ids for ids, _, _ in want] and reasons == [r for _, _, r in want] and reasons[1] == "stop"
    assert [len(lp) for lp in logps] == [len(ids) for ids in out]
    rows, _ = sample_many(model, PROMPT, chain, "multinomial", 0, 4, rules, detok, batched=True)
    assert rows[1].text == detok(out[1]) and rows[1].text.endswith(stop)
    out, _, reasons = sample_batched(model, PROMPT, chain, "multinomial", 0, 3, StopRules(10, ignore_eos=True,
                                                                                  context_length=6))
    assert [len(ids) for ids in out] == [3, 3, 3] and reasons == ["context"] * 3
    with pytest.raises(ConfigError, match="the prompt is 3 tokens but the model's context is 3"):
        sample_batched(model, PROMPT, chain, "multinomial", 0, 2, StopRules(4, context_length=3))


def test_greedy_rows_are_the_argmax_and_the_cache_is_used():
    model = random_model("llama", seed=2, scale=4.0)
    chain = build_chain({"top-k": 5})
    greedy = singles(model, chain, 0, 1, StopRules(5, ignore_eos=True), temperature=0)[0]
    for batched in (True, False):
        rows, summary = sample_many(model, PROMPT, chain, "greedy", 7, 3, StopRules(5, ignore_eos=True), batched=batched)
        assert [r.token_ids for r in rows] == [greedy[0]] * 3 and summary.distinct_outputs == 1
        assert [r.seed for r in rows] == [7, 8, 9]
        assert rows[0].sum_logprob == pytest.approx(sum(greedy[1]), abs=1e-4)
    # the cache policy reaches the forwards: recompute:size=2 sees one earlier token, as the single run does
    spec = parse_cache_spec("recompute:size=2")
    one = Sampler(model, PROMPT, chain, make_selector("greedy", 0, "cpu"), StopRules(4, ignore_eos=True), str, None,
                  top=0, cache=spec)
    want = [s.token_id for s in one]
    assert want != greedy[0][:4]
    for batched in (True, False):
        rows, _ = sample_many(model, PROMPT, chain, "greedy", 0, 2, StopRules(4, ignore_eos=True), cache=spec,
                              batched=batched)
        assert [r.token_ids for r in rows] == [want, want]
    # batched=None: batched when the policy holds rows
    assert sample_many(model, PROMPT, chain, "greedy", 0, 2, StopRules(2, ignore_eos=True))[1].batched
    assert not sample_many(model, PROMPT, chain, "greedy", 0, 2, StopRules(2, ignore_eos=True),
                           cache=parse_cache_spec("paged"))[1].batched


def test_batched_rows_see_their_own_history_and_an_empty_chain_is_refused():
    """A repetition penalty reads each row's own tokens (the prompt included: chain.reset after the prompt);
    a chain that leaves no candidate is refused, not drawn from."""
    model = random_model("llama", seed=2, scale=4.0)
    chain = build_chain({"temperature": 1.0, "repetition-penalty": 3.0})
    rules = StopRules(6, ignore_eos=True)
    want = singles(model, chain, 4, 3, rules)
    out, _, _ = sample_batched(model, PROMPT, chain, "multinomial", 4, 3, rules)
    assert out == [ids for ids, _, _ in want]
    banned = build_chain({"min-p": 1.0, "temperature": 1.0})  # keeps the argmax only
    out, logps, _ = sample_batched(model, PROMPT, banned, "multinomial", 0, 2, StopRules(2, ignore_eos=True))
    assert out[0] == out[1] and logps == [[0.0, 0.0], [0.0, 0.0]]
    with pytest.raises(ChainError):
        sample_batched(model, PROMPT, build_chain({"ban": [[t] for t in range(256)]}), "multinomial", 0, 2,
                       StopRules(2, ignore_eos=True))


def row(index: int, ids: list[int], logps: list[float]) -> SampleRow:
    total = sum(logps)
    return SampleRow(index, index, ids, "", len(ids), "length", total, total / len(logps) if logps else math.nan)


def test_spread_by_hand():
    rows = [row(0, [4, 1], [-1.0, -3.0]), row(1, [7, 2, 2], [-0.5, -0.5, -2.0]), row(2, [4, 1], [-1.0, -3.0]),
            row(3, [], [])]
    s = spread(rows, lambda t: f"<{t}>", batched=True, tokens_per_s=12.5)
    assert (s.num_samples, s.distinct_outputs, s.batched, s.tokens_per_s) == (4, 3, True, 12.5)
    # sums -4, -3, -4, 0: mean -2.75, population sd sqrt(((1.25^2) * 2 + 0.25^2 + 2.75^2) / 4)
    assert s.mean_sum_logprob == pytest.approx(-2.75)
    assert s.std_sum_logprob == pytest.approx(math.sqrt((1.25 ** 2 * 2 + 0.25 ** 2 + 2.75 ** 2) / 4))
    # means -2, -1, -2 (the empty row has none): mean -5/3, population sd sqrt(2/9)
    assert s.mean_logprob == pytest.approx(-5 / 3) and s.std_mean_logprob == pytest.approx(math.sqrt(2 / 9))
    assert [(f.token_id, f.token, f.count, f.frequency) for f in s.first_tokens] == [(4, "<4>", 2, 0.5),
                                                                                     (7, "<7>", 1, 0.25)]
    one = spread([row(0, [3], [-0.25])], str)
    assert (one.std_sum_logprob, one.std_mean_logprob, one.mean_sum_logprob, one.mean_logprob) == (0.0, 0.0, -0.25,
                                                                                                   -0.25)
    assert not one.batched and math.isnan(one.tokens_per_s) and one.first_tokens[0].frequency == 1.0
    none = spread([], str)
    assert math.isnan(none.mean_sum_logprob) and math.isnan(none.mean_logprob) and none.first_tokens == []
    assert none.to_dict()["num_samples"] == 0


# the survivors of the first run (2026-12-02)


def test_batched_rows_start_their_output_after_the_prompt():
    """--min-new-tokens 3 bans the EOS id for each row's first three new tokens (counted after the prompt), as in
    the single runs; the EOS is the token row 0 draws first without the ban."""
    model = random_model("llama", seed=2, scale=4.0)
    free = singles(model, build_chain({}), 30, 4, StopRules(6, ignore_eos=True))
    eos = free[0][0][0]
    chain = Chain([MinNewTokens(3, (eos,))])
    rules = StopRules(6, eos_ids=(eos,))
    want = singles(model, chain, 30, 4, rules)
    assert want[0][0][0] != eos
    out, logps, reasons = sample_batched(model, PROMPT, chain, "multinomial", 30, 4, rules)
    assert out == [ids for ids, _, _ in want] and reasons == [r for _, _, r in want]
    assert logps == [pytest.approx(lp, abs=1e-4) for _, lp, _ in want]


def test_batched_rows_preallocate_the_prompt_and_new_tokens():
    """--cache static holds exactly the prompt and -n new tokens per row: the rows of the full cache."""
    model = random_model("llama", seed=2, scale=4.0)
    chain = build_chain({"temperature": 1.3})
    rules = StopRules(5, ignore_eos=True)
    full, _, _ = sample_batched(model, PROMPT, chain, "multinomial", 0, 3, rules)
    static, _, _ = sample_batched(model, PROMPT, chain, "multinomial", 0, 3, rules, cache=parse_cache_spec("static"))
    assert static == full == [ids for ids, _, _ in singles(model, chain, 0, 3, rules)]


def test_rows_one_after_another_stop_on_a_stop_string():
    model = random_model("llama", seed=2, scale=4.0)
    chain = build_chain({"temperature": 1.3})
    detok = lambda ids: "".join(f"<{t}>" for t in ids)  # noqa: E731
    free = singles(model, chain, 0, 3, StopRules(6, ignore_eos=True))
    rules = StopRules(6, stop_strings=(f"<{free[2][0][2]}>",), ignore_eos=True)
    want = singles(model, chain, 0, 3, rules, detok=detok)
    rows, summary = sample_many(model, PROMPT, chain, "multinomial", 0, 3, rules, detok, batched=False)
    assert [r.token_ids for r in rows] == [ids for ids, _, _ in want] and rows[2].stop_reason == "stop"
    assert not summary.batched


def test_tokens_per_second_on_a_fake_clock(monkeypatch):
    """All generated tokens over the wall time between the two clock reads; no time passed: nan. Without a
    token_text the first tokens read as their ids."""
    import decodelab.core.methods.many as many

    model = random_model("llama", seed=2, scale=4.0)
    reads = iter([10.0, 12.5, 7.0, 7.0])
    monkeypatch.setattr(many, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: next(reads))}))
    rules = StopRules(3, ignore_eos=True)
    rows, summary = sample_many(model, PROMPT, build_chain({}), "greedy", 0, 2, rules)
    assert summary.tokens_per_s == 6 / 2.5
    assert summary.first_tokens[0].token == str(rows[0].token_ids[0])
    _, frozen = sample_many(model, PROMPT, build_chain({}), "greedy", 0, 2, rules)
    assert math.isnan(frozen.tokens_per_s)


def test_spread_of_two_samples():
    s = spread([row(0, [1], [-1.0]), row(1, [2, 3], [-1.0, -2.0])], str)
    assert s.std_sum_logprob == pytest.approx(1.0) and s.std_mean_logprob == pytest.approx(0.25)


def test_rows_draw_with_the_plans_selector_transformers_multinomial_too():
    """Under --semantics hf a sampled row draws as transformers does (torch.multinomial), batched or not: row i is the
    single run with that selector and seed + i. (On the CPU torch.multinomial of one sample is itself an exponential
    race, argmax p / q, so its tokens equal Multinomial's here: the test holds the row-by-row path to the single run.)"""
    model = random_model("llama", seed=2, scale=4.0)
    chain = build_chain({"temperature": 1.3})
    rules = StopRules(6, ignore_eos=True)
    want = [[s.token_id for s in Sampler(model, PROMPT, chain, make_selector("hf-multinomial", 5 + i, "cpu"), rules,
                                         str, None, top=0)] for i in range(3)]
    for batched in (True, False):
        rows, _ = sample_many(model, PROMPT, chain, "hf-multinomial", 5, 3, rules, batched=batched)
        assert [r.token_ids for r in rows] == want
