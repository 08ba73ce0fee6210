"""Honest timing (issue 34, item 1): a warm-up exists, runs before the timed part, is excluded from every rate and
reported on its own (``warmup_s``, ``compile_s``); comparisons are warm and interleaved, so the order of the
variants does not change who pays the warm-up. Pinned with instrumented models and a fake clock."""

from __future__ import annotations

import time

import torch
from conftest import random_model

from decodelab.core.engine import warmup
from decodelab.core.engine.models import LoadedModel
from decodelab.core.engine.run import Stopwatch
from decodelab.core.engine.runtime import runtime_for
from decodelab.core.engine.stopping import StopRules
from decodelab.core.kv import parse_cache_spec
from decodelab.core.methods.sample import Sampler, decode_tokens
from decodelab.core.sampling.chain import build_chain
from decodelab.core.sampling.select import Greedy

PROMPT = [5, 17, 42, 9, 77, 3, 17, 42]
FIRST_CALL_S = 0.6  # what the instrumented model's first forward costs (a CUDA first call, say)


def slow_first_call(model) -> list:
    """The model's first forward sleeps FIRST_CALL_S; later ones run at their own speed. Returns the call log."""
    calls = []

    def hook(module, args, kwargs):
        calls.append(time.perf_counter())
        if len(calls) == 1:
            time.sleep(FIRST_CALL_S)

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return calls


def test_the_first_call_cost_is_paid_before_the_stopwatch_and_reported_apart():
    model = random_model("llama", seed=3)
    calls = slow_first_call(model)
    run = Sampler(model, PROMPT, build_chain({}), Greedy(), StopRules(6), str, None)
    steps = list(run)
    summary = run.summary()
    timing = run.watch.timing
    assert len(steps) == 6
    assert summary.warmup_s >= FIRST_CALL_S  # reported
    assert timing.prefill_s + timing.loop_s + timing.trace_s < FIRST_CALL_S  # excluded from every rate
    assert summary.tokens_per_s == 6 / timing.total_s
    assert len(calls) == warmup.WARM_DECODES + 1 + 6  # the warm-up's forwards came first, then the run's


def test_a_warm_model_is_not_warmed_again():
    model = random_model("llama", seed=4)
    first = warmup.warm_up(model)
    assert first > 0 and warmup.is_warm(model)
    assert warmup.warm_up(model) == 0.0
    run = Sampler(model, PROMPT, build_chain({}), Greedy(), StopRules(3), str, None)
    list(run)
    assert run.summary().warmup_s == 0.0


def test_without_the_warm_up_the_first_call_would_land_in_the_prefill(monkeypatch):
    """The negative control: the same instrumented model with the warm-up switched off pays in the timed part."""
    model = random_model("llama", seed=5)
    slow_first_call(model)
    monkeypatch.setattr("decodelab.core.methods.sample.warm_up", lambda model, spec=None: 0.0)
    run = Sampler(model, PROMPT, build_chain({}), Greedy(), StopRules(3), str, None)
    list(run)
    assert run.watch.timing.prefill_s >= FIRST_CALL_S and run.summary().warmup_s == 0.0


def test_the_first_compiled_call_is_set_aside_as_compile_s():
    model = random_model("llama", seed=6)
    warmup.warm_up(model)
    made = []

    def step(ids, positions, cache):  # a compiled step whose first call compiles for COMPILE_S
        made.append(ids)
        if len(made) == 1:
            time.sleep(FIRST_CALL_S)
        return torch.zeros(ids.shape[0], 1, 256)

    model._decodelab_compiled_step = step
    lm = LoadedModel("x", model, None, torch.device("cpu"), torch.float32)
    runtime = runtime_for(lm, parse_cache_spec("full"), 16, {"truncate"}, compile=True)
    watch = Stopwatch("cpu")
    out = list(decode_tokens(model, PROMPT, build_chain({}), Greedy(), StopRules(5), runtime=runtime, watch=watch))
    assert len(out) == 5 and len(made) == 4
    assert watch.timing.compile_s == runtime.compile_s and runtime.compile_s >= FIRST_CALL_S
    assert 0 <= watch.timing.loop_s < FIRST_CALL_S  # the loop's rate is the steady state


def test_set_aside_moves_time_between_buckets():
    watch = Stopwatch("cpu")
    watch.timing.loop_s = 5.0
    watch.set_aside("loop", 2.0, "compile")
    watch.set_aside("loop", 1.0, "warmup")
    assert (watch.timing.loop_s, watch.timing.compile_s, watch.timing.warmup_s) == (2.0, 2.0, 1.0)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def variants_with_first_call_costs(clock: FakeClock, first_cost: float, shared: dict) -> dict:
    """Two variants that each cost 1 s a call, plus ``first_cost`` the first time ANY of them runs (a process-wide
    warm-up, as CUDA's) and 0.5 s their own first time (their own kernels)."""

    def make(name, cost):
        seen = []

        def call():
            if not shared:
                shared["warm"] = True
                clock.now += first_cost
            if not seen:
                seen.append(1)
                clock.now += 0.5
            clock.now += cost
            return name

        return call

    return {"ours": make("ours", 1.0), "baseline": make("baseline", 2.0)}


def test_interleaved_comparisons_are_warm_and_the_order_does_not_change_who_pays():
    results = {}
    for order in (["ours", "baseline"], ["baseline", "ours"]):
        clock = FakeClock()
        made = variants_with_first_call_costs(clock, first_cost=10.0, shared={})
        out = warmup.interleaved({name: made[name] for name in order}, rounds=4, device="cpu", timer=clock)
        results[tuple(order)] = out
        assert out.seconds == {"ours": [1.0] * 4, "baseline": [2.0] * 4}  # warm: no first-call cost in any round
        expected = {"ours": 1.5, "baseline": 2.5}  # a warm-up call: its own first cost and one call
        expected[order[0]] += 10.0  # the process-wide first-call cost: reported apart, in the warm-up
        assert out.warmup_s == expected
        firsts = [r[0] for r in out.order]
        assert firsts.count("ours") == firsts.count("baseline") == 2  # each runs first equally often
    a, b = results.values()
    assert a.median("ours") / a.median("baseline") == b.median("ours") / b.median("baseline") == 0.5


def test_without_the_warm_round_the_first_variant_pays():
    """The negative control: warm=False lets the process-wide first-call cost fall on whichever ran first."""
    clock = FakeClock()
    made = variants_with_first_call_costs(clock, first_cost=10.0, shared={})
    out = warmup.interleaved(made, rounds=1, device="cpu", warm=False, timer=clock)
    assert out.seconds["ours"] == [11.5] and out.seconds["baseline"] == [2.5]


def test_a_cache_the_warm_up_cannot_build_falls_back_to_the_default():
    """gpt2 has no rotary embedding, so a re-rotating sinks cache is refused for it: the warm-up (which the run's own
    policy creation would have refused first) still warms with the default cache instead of failing."""
    from decodelab.core.kv import parse_cache_spec

    model = random_model("gpt2", seed=8)
    assert warmup.warm_up(model, parse_cache_spec("sinks:sinks=2,recent=4")) > 0
    assert warmup.is_warm(model)


def test_on_cuda_the_compiled_step_is_captured_in_graphs_and_its_output_copied(monkeypatch):
    """The CUDA branch's logic, on the CPU: compiled with mode reduce-overhead (CUDA graphs), each call marks a new
    graph step and returns a copy of the logits (a replay overwrites the graph's own output buffer, and the trace
    keeps a step's logits past the next step)."""
    from decodelab.core.engine import runtime as rt_module

    model = random_model("llama", seed=9)
    graph_out = torch.full((1, 1, 256), 3.0)
    compiled_with, marks = {}, []

    def fake_compile(fn, **kwargs):
        compiled_with.update(kwargs)
        return lambda ids, positions, cache: graph_out

    monkeypatch.setattr(rt_module, "on_cuda", lambda device: True)
    monkeypatch.setattr(rt_module.torch, "compile", fake_compile)
    monkeypatch.setattr(rt_module.torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    lm = LoadedModel("x", model, None, torch.device("cpu"), torch.float32)
    runtime = runtime_for(lm, parse_cache_spec("static"), 16, compile=True)
    runtime.feed(torch.tensor([[5, 17]]))
    logits = runtime.feed(torch.tensor([[9]]))
    assert compiled_with == {"dynamic": False, "fullgraph": False, "mode": "reduce-overhead"} and marks == [1]
    assert torch.equal(logits, graph_out[:, -1]) and logits.data_ptr() != graph_out.data_ptr()
