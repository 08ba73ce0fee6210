"""Steps traced together in blocks (``Sampler(block=K)``, what `sample -f json` uses) against the same run traced
step by step: every number equal, exactly, at every block boundary, at an early stop, after an interrupt and with
stateful stages; a greedy step inside a sampled block."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import random_model

from decodelab.core.engine.runtime import Runtime
from decodelab.core.engine.stopping import StopRules
from decodelab.core.methods.sample import Sampler
from decodelab.core.sampling.chain import build_chain
from decodelab.core.sampling.select import make_selector
from decodelab.core.trace import stats
from decodelab.core.trace.stats import TraceBlock, pack

PROMPT = [5, 17, 42, 9, 77, 3]

CHAINS = {
    "greedy": ({"temperature": 0}, 0.0),  # one row per step: the raw distribution alone
    "sampled filters": ({"temperature": 0.9, "top-k": 12, "top-p": 0.8}, 0.9),
    "greedy penalty": ({"temperature": 0, "repetition-penalty": 1.4}, 0.0),
    "mirostat": ({"temperature": 1.0, "mirostat": {"tau": 5.0, "eta": 0.1}}, 1.0),  # stateful: traced step by step whatever the block
}


def run(model, chain_settings, temperature, block, n=20, eos=(), seed=3, top=4):
    selector = make_selector("greedy" if temperature == 0 else "multinomial", seed, "cpu")
    sampler = Sampler(model, PROMPT, build_chain(chain_settings), selector,
                      StopRules(n, tuple(eos)), str, None, top=top, block=block)
    seen = []  # how many tokens the loop had made when each step reached the consumer
    for _ in sampler:
        seen.append(len(sampler.state.new_ids))
    return sampler, seen


def as_dicts(steps):
    return [dataclasses.asdict(s) for s in steps]


@pytest.fixture(scope="module")
def model():
    return random_model("llama", seed=11, scale=4.0)


@pytest.mark.parametrize("name", list(CHAINS))
@pytest.mark.parametrize("block", [3, 7, 64])
def test_a_block_traced_run_equals_the_step_by_step_run_exactly(model, name, block):
    """20 steps in blocks of 3 and 7 (neither divides 20: the last block is short) and of 64 (one block, flushed at
    the end): every number of every step is the same float. A block boundary off by one would drop, repeat or
    shift a step; a batched statistic reduced over the wrong dimension would change the numbers."""
    settings, t = CHAINS[name]
    ref, _ = run(model, settings, t, 1)
    got, _ = run(model, settings, t, block)
    assert as_dicts(got.steps) == as_dicts(ref.steps) and len(got.steps) == 20
    assert got.new_ids == ref.new_ids and got.stop_reason == ref.stop_reason == "length"
    assert got.summary().raw_perplexity == ref.summary().raw_perplexity


def test_steps_come_in_blocks_of_k_and_the_rest_at_the_end(model):
    """Blocks of 7 over 20 steps: the consumer gets steps 0-6 after the 7th token, 7-13 after the 14th and the last
    six at the end."""
    _, seen = run(model, CHAINS["sampled filters"][0], 0.9, 7)
    assert seen == [7] * 7 + [14] * 7 + [20] * 6
    _, seen = run(model, CHAINS["sampled filters"][0], 0.9, 1)
    assert seen == list(range(1, 21))


def test_a_block_is_also_bounded_by_its_bytes(model, monkeypatch):
    """A block holds at most BLOCK_BYTES of distributions: with room for two steps' rows (S = 4 rows of V = 256
    float32 each) a block of 64 flushes every 2 steps."""
    monkeypatch.setattr(stats, "BLOCK_BYTES", 2 * 4 * 256 * 4)
    _, seen = run(model, CHAINS["sampled filters"][0], 0.9, 64, n=7)
    assert seen == [2, 2, 4, 4, 6, 6, 7]


def test_a_stateful_chain_is_traced_step_by_step_with_its_state(model):
    got, seen = run(model, CHAINS["mirostat"][0], 1.0, 16)
    assert seen == list(range(1, 21))
    assert all("mirostat.mu" in s.state for s in got.steps)


def test_an_early_stop_inside_a_block_traces_the_pending_steps(model):
    """EOS at step 5 of blocks of 4: the run ends inside the second block, whose two steps still come."""
    free, _ = run(model, {"temperature": 0}, 0.0, 1, n=12)
    eos = free.new_ids[5]
    first = free.new_ids.index(eos)
    ref, _ = run(model, {"temperature": 0}, 0.0, 1, n=12, eos=(eos,))
    got, seen = run(model, {"temperature": 0}, 0.0, 4, n=12, eos=(eos,))
    assert got.stop_reason == ref.stop_reason == "eos" and len(got.steps) == first + 1
    assert as_dicts(got.steps) == as_dicts(ref.steps)
    assert seen[-1] == first + 1


def test_an_interrupt_inside_a_block_keeps_every_token_made_so_far_with_its_trace(model, monkeypatch):
    """Ctrl-C during the forward after the 9th token, in blocks of 8: nine tokens were made, eight traced and handed over;
    interrupt() traces the ninth (pending) too, as a step-by-step run would have handed it over."""
    ref, _ = run(model, CHAINS["sampled filters"][0], 0.9, 1)
    sampler = Sampler(model, PROMPT, build_chain(CHAINS["sampled filters"][0]), make_selector("multinomial", 3, "cpu"),
                      StopRules(20), str, None, top=4, block=8)
    real_feed = Runtime.feed

    def feed(self, ids, keep="last"):
        if len(sampler.state.new_ids) == 9:  # the forward after the 9th token
            raise KeyboardInterrupt
        return real_feed(self, ids, keep)

    monkeypatch.setattr(Runtime, "feed", feed)
    handed = []
    with pytest.raises(KeyboardInterrupt):
        for step in sampler:
            handed.append(step)
    assert len(handed) == 8 and len(sampler.state.new_ids) == 9
    sampler.interrupt()
    assert sampler.stop_reason == "interrupted" and len(sampler.steps) == 9 and sampler.new_ids == ref.new_ids[:9]
    assert as_dicts(sampler.steps) == as_dicts(ref.steps[:9])


def test_kept_ids_are_read_step_by_step(model):
    sampler = Sampler(model, PROMPT, build_chain({"temperature": 0.9, "top-k": 3}), make_selector("multinomial", 3, "cpu"),
                      StopRules(5), str, None, top=4, block=8, kept=True)
    assert sampler.block == 1
    list(sampler)
    assert len(sampler.kept_sets) == 5 and all(s["stages"][-1]["kept"] == 3 for s in sampler.kept_sets)


def test_a_greedy_step_in_a_sampled_block_races_without_noise():
    """A greedy step in a block of sampled ones races with E = 1 everywhere (g = -log 1 = 0): its winners are the
    plain argmax of each stage, as pack gives it alone; the sampled step keeps its draws. Logits (0, 1, 3) then a ban
    of id 2: greedy winners (2, 1); with draws E = (1, 1/e^4, 1) (g = (0, 4, 0)) the winners are (1, 1). The block's
    buffer is reused: a second block of the same steps in the other order gives the rows swapped."""
    raw = torch.tensor([[0.0, 1.0, 3.0]])
    banned = raw.clone()
    banned[0, 2] = -math.inf
    stages = [("raw", raw), ("ban", banned)]
    draws = torch.tensor([[1.0, math.exp(-4.0), 1.0]])
    alone_greedy = pack(torch.tensor([1]), raw, banned, stages, 2, None).tolist()
    alone_sampled = pack(torch.tensor([1]), raw, banned, stages, 2, draws).tolist()
    assert alone_greedy != alone_sampled  # the draws reach the winners: the rows differ
    block = TraceBlock(4, 2)
    assert not block.add(1, raw, banned, stages, None) and not block.add(1, raw, banned, stages, draws)
    assert block.trace() == [alone_greedy, alone_sampled] and len(block) == 0
    block.add(1, raw, banned, stages, draws)
    block.add(1, raw, banned, stages, None)
    assert block.trace() == [alone_sampled, alone_greedy]
    block.add(1, raw, banned, stages, None)
    assert block.trace() == [alone_greedy]  # all greedy: no race at all
    assert block.trace() == []


# --- mutation run of core/methods/sample.py (2026-12-01, helper mutsam): the Sampler's defaults, its own runtime,
# each step's index and position, the why of a greedy and of a sampled step, stepwise or in blocks ------------------


def test_the_sampler_defaults_one_step_a_token_five_alternatives_and_builds_its_runtime_from_cache(model):
    """Without block, top or runtime: every step reaches the consumer right after its token, with 5 alternatives;
    the runtime it builds follows ``cache`` (static) with room for exactly prompt + max_new_tokens positions (6 + 9),
    and is the one the loop feeds."""
    from decodelab.core.kv import CacheSpec

    sampler = Sampler(model, PROMPT, build_chain({"temperature": 0.9, "top-k": 12}),
                      make_selector("multinomial", 3, "cpu"), StopRules(9), str, None, cache=CacheSpec("static"))
    seen = [len(sampler.state.new_ids) for _ in sampler]
    assert seen == list(range(1, 10)) and sampler.block == 1
    assert all(len(s.alternatives) == 5 for s in sampler.steps)
    assert type(sampler.runtime.policy).__name__ == "StaticPolicy" and sampler.runtime.policy.capacity == 15
    assert sampler.runtime.seen == 6 + 8  # the run fed that runtime: the prompt, then each token but the last


def test_blocks_of_two_come_in_pairs(model):
    """The smallest block that defers: 5 steps in blocks of 2 reach the consumer after tokens 2, 4 and 5."""
    _, seen = run(model, CHAINS["sampled filters"][0], 0.9, 2, n=5)
    assert seen == [2, 2, 4, 4, 5]


@pytest.mark.parametrize("block", [1, 4])
def test_each_step_has_its_index_position_and_the_why_of_its_selector(model, block):
    """Indices 0..n-1 at positions 6..6+n-1 (after the 6-token prompt). A greedy run's steps are decided by an
    argmax, a sampled run's by a pick from the same draws: the why of a step names which (core/trace/why.py)."""
    for name, word, other in [("greedy", "argmax", "pick"), ("sampled filters", "pick (same draws)", "argmax")]:
        got, _ = run(model, CHAINS[name][0], CHAINS[name][1], block, n=10)
        assert [s.index for s in got.steps] == list(range(10))
        assert [s.position for s in got.steps] == list(range(6, 16))
        assert all(word in s.why and other not in s.why for s in got.steps)


def test_an_empty_chain_inside_a_block_ends_the_run_with_the_pending_steps_traced(model, monkeypatch):
    """The chain empties in the forward after the 6th token, in blocks of 4 (``drain``, what a report of many runs
    uses): 4 steps were handed over, end(EMPTY_CHAIN) traces the two pending ones, equal to a step-by-step run's
    first six, and says why."""
    from decodelab.core.engine.run import drain
    from decodelab.core.errors import EMPTY_CHAIN, ChainError

    ref, _ = run(model, CHAINS["sampled filters"][0], 0.9, 1)
    sampler = Sampler(model, PROMPT, build_chain(CHAINS["sampled filters"][0]), make_selector("multinomial", 3, "cpu"),
                      StopRules(20), str, None, top=4, block=4)
    real_feed = Runtime.feed

    def feed(self, ids, keep="last"):
        if len(sampler.state.new_ids) == 6:
            raise ChainError("the chain removed every candidate")
        return real_feed(self, ids, keep)

    monkeypatch.setattr(Runtime, "feed", feed)
    handed = drain(sampler)
    assert len(handed) == 4 and sampler.stop_reason == EMPTY_CHAIN
    assert as_dicts(sampler.steps) == as_dicts(ref.steps[:6]) and sampler.new_ids == ref.new_ids[:6]


def test_a_stateful_steps_mu_follows_the_mirostat_update_worked_from_its_own_numbers(model):
    """Mirostat 2 (tau 5, eta 0.1, temperature 1: the step's processed prob is the kept, renormalized one): mu starts at
    2 tau = 10 and after token x moves to mu - eta (-log2 p_kept(x) - tau). Each step's state is the mu that step
    used, read in the step's own transfer after its numbers; the same, whatever the block."""
    for block in (1, 16):
        got, _ = run(model, CHAINS["mirostat"][0], 1.0, block, n=8)
        mu = 10.0
        for step in got.steps:
            assert list(step.state) == ["mirostat.mu"]
            assert step.state["mirostat.mu"] == pytest.approx(mu, rel=1e-5)
            mu -= 0.1 * (-math.log2(step.prob) - 5.0)
        assert len({s.state["mirostat.mu"] for s in got.steps}) == 8  # mu moved at every step
