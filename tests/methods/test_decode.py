"""The decode loop against transformers `generate` and against a recompute without cache; the selector's law."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import ARCHS, random_model

from decodelab.core.methods.sample import DecodeState, Sampler, decode_tokens
from decodelab.core.engine.stopping import StopRules
from decodelab.core.methods.probs import next_token_stages
from decodelab.core.errors import ConfigError
from decodelab.core.sampling.chain import build_chain
from decodelab.core.sampling.select import Greedy, Multinomial, make_generator, make_selector

PROMPT = [5, 17, 42, 9, 77, 3]


def greedy_ids(model, prompt, n, chain=None, eos=()):
    chain = chain or build_chain({"temperature": 0})
    state = DecodeState()
    out = [d.token_id for d in decode_tokens(model, prompt, chain, Greedy(), StopRules(n, tuple(eos)), state=state)]
    return out, state.stop_reason


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_equals_generate(arch, seed):
    model = random_model(arch, seed=seed, scale=8.0)
    ours, reason = greedy_ids(model, PROMPT, 24)
    ref = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=24, min_new_tokens=24)
    assert ours == ref[0, len(PROMPT):].tolist()
    assert reason == "length"


def test_greedy_with_eos_stops_where_generate_stops():
    model = random_model("llama", seed=3, scale=8.0)
    free, _ = greedy_ids(model, PROMPT, 30)
    eos = free[7]  # a token the model emits at step 7 (maybe earlier too)
    model.generation_config.eos_token_id = eos
    ours, reason = greedy_ids(model, PROMPT, 30, eos=(eos,))
    ref = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=30, eos_token_id=eos,
                         pad_token_id=0)
    assert ours == ref[0, len(PROMPT):].tolist()
    assert ours[-1] == eos and reason == "eos" and len(ours) == free.index(eos) + 1


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_with_processors_equals_generate(arch):
    model = random_model(arch, seed=2, scale=4.0)
    chain = build_chain({"temperature": 0, "repetition-penalty": 1.5, "no-repeat-ngram": 2})
    ours, _ = greedy_ids(model, PROMPT, 20, chain)
    ref = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=20, min_new_tokens=20,
                         repetition_penalty=1.5, no_repeat_ngram_size=2)
    assert ours == ref[0, len(PROMPT):].tolist()


def test_gemma2_softcap_chain_reproduces_the_models_own_capping():
    capped = random_model("gemma2", seed=4, scale=40.0)  # large logits, so capping at 30 matters
    uncapped = random_model("gemma2", seed=4, scale=40.0, final_logit_softcapping=None)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        z_capped = capped(ids).logits[0, -1]
        z_raw = uncapped(ids).logits[0, -1]
    assert z_raw.abs().max() > 40  # the test is only meaningful if capping changes the logits
    ours = build_chain({"softcap": 30.0})(ids, z_raw[None])[0]
    torch.testing.assert_close(ours, z_capped, rtol=1e-5, atol=1e-4)
    chain = build_chain({"softcap": 30.0, "temperature": 0})
    ours_ids, _ = greedy_ids(uncapped, PROMPT, 16, chain)
    ref = capped.generate(ids, do_sample=False, max_new_tokens=16, min_new_tokens=16)
    assert ours_ids == ref[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_cached_logits_equal_a_recompute_from_scratch(arch):
    model = random_model(arch, seed=5, scale=4.0)
    chain = build_chain({"temperature": 0.9})
    sampler = Sampler(model, PROMPT, chain, make_selector("multinomial", 0, "cpu"), StopRules(12), str, None, top=3)
    steps = list(sampler)
    seq = PROMPT + [s.token_id for s in steps]
    with torch.no_grad():
        full = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), dim=-1)
    for s in steps:
        expected = full[s.position - 1, s.token_id].item()
        assert s.raw_logprob == pytest.approx(expected, abs=1e-4)
        assert s.raw_prob == pytest.approx(math.exp(expected), rel=1e-3)


def test_step_numbers_are_labelled_consistently():
    model = random_model("llama", seed=6, scale=4.0)
    chain = build_chain({"temperature": 0.7, "top-k": 5, "top-p": 0.8})
    steps = list(Sampler(model, PROMPT, chain, make_selector("multinomial", 1, "cpu"), StopRules(10), str, None, top=4))
    for s in steps:
        assert s.kept <= 5 and 1 <= s.raw_rank
        assert s.prob == pytest.approx(math.exp(s.logprob), rel=1e-5)
        assert [st.name for st in s.stages] == ["temperature", "top-k", "top-p"]
        assert s.stages[0].kept == 256 and s.stages[0].mass_removed == 0.0
        assert s.stages[-1].kept == s.kept
        assert s.alternatives[0].prob >= s.alternatives[-1].prob
        assert any(a.token_id == s.token_id for a in s.alternatives) or s.prob < s.alternatives[-1].prob


def test_same_seed_same_trace_other_seed_other_trace():
    model = random_model("llama", seed=7, scale=2.0)
    chain = build_chain({"temperature": 1.0})

    def run(seed):
        return [s.token_id for s in Sampler(model, PROMPT, chain, make_selector("multinomial", seed, "cpu"),
                                            StopRules(20), str, None)]

    assert run(0) == run(0)
    assert run(0) != run(1)


def test_stop_strings_and_context_limit():
    model = random_model("gpt2", seed=8, scale=8.0)  # context 128
    chain = build_chain({"temperature": 0})
    free, _ = greedy_ids(model, PROMPT, 10)
    detok = lambda ids: " ".join(map(str, ids))  # noqa: E731
    state = DecodeState()
    out = [d.token_id for d in decode_tokens(model, PROMPT, chain, Greedy(),
                                             StopRules(10, stop_strings=(str(free[3]),)), detok, state=state)]
    assert state.stop_reason == "stop" and out[-1] == free[3] and len(out) <= 4
    state = DecodeState()
    long_prompt = list(range(120))
    out = [d.token_id for d in decode_tokens(model, long_prompt, chain, Greedy(),
                                             StopRules(50, context_length=128), state=state)]
    assert state.stop_reason == "context" and len(out) == 8
    with pytest.raises(ConfigError, match="context is 128"):
        list(decode_tokens(model, list(range(128)), chain, Greedy(), StopRules(5, context_length=128)))
    with pytest.raises(ConfigError, match="empty"):
        list(decode_tokens(model, [], chain, Greedy(), StopRules(5)))


def test_probs_stages_show_temperature_keeps_order_and_top_p_count_varies():
    model = random_model("llama", seed=9, scale=4.0)
    chain = build_chain({"temperature": 0.5, "top-p": 0.9})
    stages, tracked = next_token_stages(model, PROMPT, chain, str, top=8)
    assert [s.name for s in stages] == ["raw", "temperature", "top-p"]
    raw_order = [t.token_id for t in stages[0].top]
    assert [t.token_id for t in stages[1].top] == raw_order  # same order, sharper
    assert stages[1].top[0].prob > stages[0].top[0].prob
    assert stages[1].entropy < stages[0].entropy
    assert stages[2].kept < 256 and stages[2].mass_removed > 0
    for t in tracked:
        assert t.probs["raw"] == pytest.approx(t.raw_prob)


# --- the selector's law ------------------------------------------------------------------------------------------

CHI2_999 = {5: 20.52}  # chi-square critical value at p = 0.001 for 5 degrees of freedom


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("space", ["probs", "logits"])
def test_multinomial_selector_follows_the_distribution(space):
    probs = torch.tensor([0.05, 0.1, 0.15, 0.2, 0.22, 0.28])
    n = 40_000
    selector = Multinomial(make_generator(123, "cpu"))
    batch = probs.expand(n, -1).contiguous()
    draws = selector(batch) if space == "probs" else selector.from_logits(batch.log() + 3.0)
    counts = torch.bincount(draws, minlength=6).double()
    assert chi_square(counts, probs.double()) < CHI2_999[5]


def test_the_chi_square_check_rejects_a_biased_sampler():
    probs = torch.tensor([0.05, 0.1, 0.15, 0.2, 0.22, 0.28])
    n = 40_000
    gen = make_generator(123, "cpu")
    race = torch.empty(n, 6).exponential_(generator=gen)
    wrong = (probs * race).argmax(dim=-1)  # multiplies instead of divides: not the right law
    counts = torch.bincount(wrong, minlength=6).double()
    assert chi_square(counts, probs.double()) > CHI2_999[5]


def test_multinomial_never_draws_a_removed_token():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5])
    selector = Multinomial(make_generator(0, "cpu"))
    draws = selector(probs.expand(5000, -1).contiguous())
    assert set(draws.tolist()) <= {1, 3}
    draws = selector.from_logits(probs.log().expand(5000, -1).contiguous())
    assert set(draws.tolist()) <= {1, 3}


def test_sampled_first_token_follows_the_processed_distribution_end_to_end():
    """Many seeded runs of the real loop (model, cache, chain, selector): the first token's frequencies match the
    chain's processed distribution (chi-square, 4 degrees of freedom), and removed tokens never appear."""
    model = random_model("llama", seed=11, vocab_size=16, scale=3.0)
    SHORT = [1, 5, 9]  # noqa: N806
    chain = build_chain({"temperature": 1.5, "top-k": 5})
    with torch.no_grad():
        raw = model(torch.tensor([SHORT])).logits[0, -1].float()
    probs = torch.softmax(chain(torch.tensor([SHORT]), raw[None])[0], dim=-1).double()
    kept = torch.nonzero(probs > 0).flatten()
    assert len(kept) == 5
    counts = torch.zeros(16, dtype=torch.float64)
    for seed in range(2000):
        step = next(iter(Sampler(model, SHORT, chain, make_selector("multinomial", seed, "cpu"), StopRules(1), str,
                                 None, top=0)))
        counts[step.token_id] += 1
        assert step.prob == pytest.approx(float(probs[step.token_id]), rel=1e-4)
    assert counts[probs == 0].sum() == 0
    assert chi_square(counts[kept], probs[kept]) < 18.47  # p = 0.001, 4 degrees of freedom


# --- mutation run of core/methods/sample.py (2026-12-01, helper mutsam): build_step by hand, the stopwatch's
# buckets on a fake clock, the summary, build_sampler's wiring ------------------------------------------------------


def test_build_step_copies_every_number_and_names_the_deciding_stage_by_hand():
    """Stages raw, temperature, top-k; the race winners (4, 4, 7) for the chosen 7: the last stage that changed the
    winner is top-k (index 2), which removed the winner after temperature: "top-k removed the argmax after
    temperature" (greedy, the default), "... the pick (same draws) after temperature" sampled. Stage statistics
    leave raw out; no winners recorded: no decision."""
    from decodelab.core.methods.sample import build_step
    from decodelab.core.trace.records import Alternative, StageStat
    from decodelab.core.trace.stats import Numbers

    n = Numbers(token_id=7, finite=True, prob=0.5, logprob=-0.69, raw_prob=0.25, raw_logprob=-1.39, raw_rank=2,
                entropy=0.9, raw_entropy=1.8, kept=3, alternatives=[(7, 0.5, 0.25), (4, 0.3, 0.4)],
                stages=[(10, 1.8, 0.0), (10, 1.7, 0.0), (3, 0.9, 0.35)], winners=[4, 4, 7], ranks=[2, 2, 1],
                removed=[False, True])
    names = ["raw", "temperature", "top-k"]
    text = {7: "seven", 4: "four"}.get
    state = {"mirostat.mu": 5.0}
    step = build_step(3, 9, n, state, text, names)
    assert (step.index, step.position, step.token_id, step.token) == (3, 9, 7, "seven")
    assert (step.prob, step.logprob, step.raw_prob, step.raw_logprob, step.raw_rank) == (0.5, -0.69, 0.25, -1.39, 2)
    assert (step.entropy, step.raw_entropy, step.kept) == (0.9, 1.8, 3)
    assert step.alternatives == [Alternative(7, "seven", 0.5, 0.25), Alternative(4, "four", 0.3, 0.4)]
    assert step.stages == [StageStat("temperature", 10, 1.7, 0.0), StageStat("top-k", 3, 0.9, 0.35)]
    assert step.decided_by == "top-k" and step.why == "top-k removed the argmax after temperature"
    assert step.state == state and step.state is not state
    sampled = build_step(3, 9, n, None, text, names, greedy=False)
    assert sampled.why == "top-k removed the pick (same draws) after temperature" and sampled.state == {}
    bare = build_step(0, 6, n._replace(winners=[], ranks=[], removed=[]), None, text, names)
    assert bare.decided_by is None and bare.why is None


class FakeClock:
    """A perf_counter that moves only when the test says: each piece of work advances it by a distinct amount, so
    each bucket's total is a sum worked by hand."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def wrap(self, fn, cost):
        def timed(*args, **kwargs):
            self.now += cost
            return fn(*args, **kwargs)
        return timed


@pytest.mark.parametrize("block", [1, 4])
def test_the_stopwatch_buckets_are_exact_on_a_fake_clock(monkeypatch, block):
    """6 steps. Costs: prefill 100 (and its own feed 10), each of the 5 decode feeds 10, a step's trace
    (pack+unpack, or add to a block, a block's trace, a row's unpack) 1, 2, 3, 1, a token's text 5, the consumer 1000
    a step (never counted). Step by step: prefill 110, loop 5 x 10 = 50, trace 6 x (1 + 5) = 36. Blocks of 4 (a
    full block at step 4, two pending at the end): trace 6 x 2 + 2 x 3 + 6 x 1 + 6 x 5 = 54. A lap dropped, a pause
    or a resume lost moves the consumer's time or the work of one bucket into another."""
    from types import SimpleNamespace

    from decodelab.core.engine import run as run_module
    from decodelab.core.engine.runtime import Runtime
    from decodelab.core.methods import sample as sample_module
    from decodelab.core.trace.stats import TraceBlock

    clock = FakeClock()
    monkeypatch.setattr(run_module, "time", SimpleNamespace(perf_counter=clock))
    monkeypatch.setattr(Runtime, "prefill", clock.wrap(Runtime.prefill, 100))
    monkeypatch.setattr(Runtime, "feed", clock.wrap(Runtime.feed, 10))
    monkeypatch.setattr(sample_module, "unpack", clock.wrap(sample_module.unpack, 1))
    monkeypatch.setattr(TraceBlock, "add", clock.wrap(TraceBlock.add, 2))
    monkeypatch.setattr(TraceBlock, "trace", clock.wrap(TraceBlock.trace, 3))
    model = random_model("llama", seed=11, scale=4.0)
    sampler = Sampler(model, PROMPT, build_chain({"temperature": 0.9, "top-k": 12}), make_selector("multinomial", 3, "cpu"),
                      StopRules(6), clock.wrap(str, 5), None, top=0, block=block)
    for _ in sampler:
        clock.now += 1000
    timing = sampler.watch.timing
    assert (timing.prefill_s, timing.loop_s, timing.trace_s) == (110.0, 50.0, 36.0 if block == 1 else 54.0)
    summary = sampler.summary()
    assert summary.tokens_per_s == 6 / timing.total_s and summary.decode_tokens_per_s == 6 / 50.0


def test_the_summary_is_the_mean_of_the_steps_kept_or_streamed():
    """Recomputed from the steps handed over: mean processed logprob, exp(-mean raw logprob), the count and the
    reason, the same whether the run keeps its steps or only tallies them (keep_steps=False: steps stays empty); an
    untraced run counts its tokens; a run not yet started has no timing."""
    model = random_model("llama", seed=11, scale=4.0)

    def make(**kw):
        return Sampler(model, PROMPT, build_chain({"temperature": 0.9, "top-k": 12}), make_selector("multinomial", 3, "cpu"),
                       StopRules(7), str, None, top=2, **kw)

    for keep in (True, False):
        sampler = make(keep_steps=keep)
        steps = list(sampler)
        assert len(steps) == 7 and len(sampler.steps) == (7 if keep else 0)
        s = sampler.summary()
        assert s.new_tokens == 7 and s.stop_reason == "length"
        assert s.mean_logprob == pytest.approx(sum(x.logprob for x in steps) / 7, rel=1e-12)
        assert s.raw_perplexity == pytest.approx(math.exp(-sum(x.raw_logprob for x in steps) / 7), rel=1e-12)
        assert s.tokens_per_s > 0 and s.prefill_s >= 0
    untraced = make(record=False)
    assert list(untraced) == [] and len(untraced.new_ids) == 7 and untraced.summary().new_tokens == 7
    fresh = make().summary()
    assert fresh.new_tokens == 0 and math.isnan(fresh.tokens_per_s) and math.isnan(fresh.prefill_s)


def test_build_sampler_wires_the_settings_into_the_run(monkeypatch):
    """build_sampler on the bundled tiny model against a run assembled from the parts by hand: the selector and
    XTC's coin share one generator seeded by --seed (XTC bites at some step, so a second generator would change the
    draws), --top alternatives, a static cache of exactly prompt + max_new_tokens positions, one step a token (no
    blocks, no kept sets by default); a stop string found by scanning the decoded prefixes ends it where the scan
    says; --compile asks the runtime to compile its decode step."""
    from decodelab.core.engine.models import load_model
    from decodelab.core.engine.runtime import Runtime
    from decodelab.core.engine.stopping import stop_rules
    from decodelab.core.methods.sample import SampleSettings, build_sampler
    from decodelab.core.sampling.chain import make_chain
    from decodelab.core.sampling.semantics import plan

    lm = load_model("tiny", device="cpu", dtype="float32")
    prompt = lm.encode("Once upon a time")
    s = SampleSettings(temperature=1.0, xtc_probability=0.5, xtc_threshold=0.02, seed=7, top=3, max_new_tokens=12,
                       ignore_eos=True, cache="static")
    run = build_sampler(lm, s, prompt)
    assert type(run.runtime.policy).__name__ == "StaticPolicy" and run.runtime.policy.capacity == len(prompt) + 12
    assert run.block == 1 and run.record and not run.kept
    seen = []
    steps = [seen.append(len(run.state.new_ids)) or step for step in run]
    assert seen == list(range(1, 13)) and run.kept_sets == [] and all(len(x.alternatives) == 3 for x in steps)
    assert any(st.name == "xtc" and st.mass_removed > 0 for x in steps for st in x.stages)  # the coin came up
    selector = plan(s).make_selector(7, "cpu")
    ref = Sampler(lm.model, prompt, make_chain(lm, s, selector.generator), selector, stop_rules(lm, s),
                  lm.token_text, lm.decode, top=3, runtime=Runtime.create(lm.model, s.cache_spec, len(prompt) + 12))
    assert [x.to_dict() for x in steps] == [x.to_dict() for x in ref]
    free = run.new_ids
    text = lm.decode(free[:6])[-3:]
    first = next(k for k in range(1, 13) if text in lm.decode(free[:k]))
    stopped = build_sampler(lm, dataclasses.replace(s, stop=(text,)), prompt)
    list(stopped)
    assert stopped.stop_reason == "stop" and stopped.new_ids == free[:first]
    compiled = []
    monkeypatch.setattr(Runtime, "compile_decode", lambda self: compiled.append(self))
    built = build_sampler(lm, dataclasses.replace(s, compile=True), prompt)
    assert compiled == [built.runtime]


def test_decode_tokens_defaults_untraced_and_builds_its_runtime_from_cache(monkeypatch):
    """Called bare, the loop traces nothing (no numbers, no stages, no race); record=True alone traces each step in
    its own transfer with no alternatives (top 0). Without a runtime it builds one from ``cache`` (static here) with
    room for exactly prompt + max_new_tokens positions (6 + 5), and feeds it."""
    from decodelab.core.engine.runtime import Runtime
    from decodelab.core.kv import CacheSpec

    model = random_model("llama", seed=11, scale=4.0)
    made = []
    real_create = Runtime.create.__func__

    def create(cls, *args, **kwargs):
        made.append(real_create(cls, *args, **kwargs))
        return made[-1]

    monkeypatch.setattr(Runtime, "create", classmethod(create))
    chain = build_chain({"temperature": 0.9, "top-k": 12})
    bare = list(decode_tokens(model, PROMPT, chain, make_selector("multinomial", 3, "cpu"), StopRules(5),
                              cache=CacheSpec("static")))
    assert len(bare) == 5 and all(d.numbers is None and d.stages is None and d.race is None for d in bare)
    assert len(made) == 1 and type(made[0].policy).__name__ == "StaticPolicy"
    assert made[0].policy.capacity == 11 and made[0].seen == 6 + 4
    traced = list(decode_tokens(model, PROMPT, chain, make_selector("multinomial", 3, "cpu"), StopRules(5), record=True))
    assert [d.token_id for d in traced] == [d.token_id for d in bare]
    assert all(d.numbers is not None and d.numbers.alternatives == [] and d.race is None for d in traced)


def test_a_chain_that_empties_raises_at_the_step_a_scan_of_the_greedy_run_predicts():
    """top-k 1 keeps the raw argmax, then a 1-gram ban removes it if it is already in the sequence (prompt
    included): the loop yields the free greedy run up to the first token already seen, and raises there, whether
    the step is untraced, traced or deferred."""
    from decodelab.core.errors import ChainError

    model = random_model("llama", seed=11, scale=4.0)
    free, _ = greedy_ids(model, PROMPT, 30)
    k = next(i for i, t in enumerate(free) if t in PROMPT + free[:i])
    assert 0 < k < 30
    for record, defer in [(False, False), (True, False), (True, True)]:
        chain = build_chain({"temperature": 0.5, "top-k": 1, "no-repeat-ngram": 1},
                            ["temperature", "top-k", "no-repeat-ngram"])
        got = []
        with pytest.raises(ChainError, match="removed every candidate"):
            for d in decode_tokens(model, PROMPT, chain, make_selector("multinomial", 3, "cpu"), StopRules(30),
                                   record=record, top=2, defer=defer):
                got.append(d.token_id)
        assert got == free[:k]


def test_a_temperature_that_overflows_float32_is_told_apart_from_an_empty_chain():
    """Logits of a few units over temperature 1e-40 exceed float32's 3.4e38: +inf, and NaN in the softmax. The loop
    hands the processed row to the check, which names the overflow (not "removed every candidate")."""
    from decodelab.core.errors import ChainError

    model = random_model("llama", seed=11, scale=4.0)
    for record in (False, True):
        with pytest.raises(ChainError, match=r"^the chain \[temperature\] made a logit overflow to \+inf or NaN"):
            list(decode_tokens(model, PROMPT, build_chain({"temperature": 1e-40}), make_selector("multinomial", 3, "cpu"),
                               StopRules(3), record=record))


def test_build_sampler_greedy_equals_generate_traced_in_blocks_or_untraced():
    """Greedy through build_sampler (a selector without a generator) on the bundled tiny model: the ids of
    transformers' greedy ``generate``, traced in blocks of 4 (steps reach the consumer after tokens 4, 8 and 10) or
    untraced (no steps at all). A constrained run keeps its steps' constraint numbers for the summary."""
    from decodelab.core.engine.models import load_model
    from decodelab.core.methods.sample import SampleSettings, build_sampler

    lm = load_model("tiny", device="cpu", dtype="float32")
    prompt = lm.encode("Once upon a time")
    ref = lm.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10, min_new_tokens=10)
    expected = ref[0, len(prompt):].tolist()
    s = SampleSettings(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    blocks = build_sampler(lm, s, prompt, block=4)
    seen = [len(blocks.state.new_ids) for _ in blocks]
    assert seen == [4] * 4 + [8] * 4 + [10] * 2 and blocks.new_ids == expected
    untraced = build_sampler(lm, s, prompt, record=False)
    assert list(untraced) == [] and untraced.new_ids == expected
    constrained = build_sampler(lm, SampleSettings(regex=r"[0-9]{1,3}", temperature=0.0, max_new_tokens=3), prompt)
    list(constrained)
    assert constrained.summary().constraint is not None
