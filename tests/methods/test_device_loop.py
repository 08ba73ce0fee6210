"""The device-side decode loop (issue 34, item 2): the step CUDA graphs capture gives the tokens and the
statistics of the eager traced run, and reads nothing from the device until the loop ends."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import ARCHS, host_reads, random_model

from decodelab.core.engine.runtime import Runtime
from decodelab.core.engine.stopping import StopRules
from decodelab.core.methods.device_loop import STATS, decode_on_device, delivered, device_step, step_fn
from decodelab.core.methods.sample import Sampler
from decodelab.core.sampling.chain import build_chain
from decodelab.core.sampling.select import Greedy, make_selector

PROMPT = [5, 17, 42, 9, 77, 3, 17, 42]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("settings", [{"temperature": 0}, {"temperature": 0.8, "top-k": 20},
                                      {"repetition-penalty": 1.3, "temperature": 0.7, "min-p": 0.05}],
                         ids=["greedy", "top-k", "penalty-min-p"])
def test_the_device_loop_equals_the_traced_eager_run(arch, settings):
    model = random_model(arch, seed=2, scale=6.0)
    n, t = 12, settings["temperature"]
    eager = Sampler(model, PROMPT, build_chain(settings), make_selector(t, 5, "cpu"), StopRules(n, ignore_eos=True),
                    str, None)
    steps = list(eager)
    runtime = Runtime.create(model, None, capacity=len(PROMPT) + n)
    out = decode_on_device(runtime, PROMPT, build_chain(settings), make_selector(t, 5, "cpu"), n)
    assert out.new_ids == [s.token_id for s in steps] and out.stop_reason == "length"
    for row, s in zip(out.stats, steps):
        assert row["raw_logprob"] == pytest.approx(s.raw_logprob, abs=1e-5)
        assert row["logprob"] == pytest.approx(s.logprob, abs=1e-5)
        assert row["raw_entropy"] == pytest.approx(s.raw_entropy, abs=1e-5)
        assert row["entropy"] == pytest.approx(s.entropy, abs=1e-5)


def test_the_loop_reads_the_device_once():
    model = random_model("llama", seed=3, scale=6.0)
    n = 16
    runtime = Runtime.create(model, None, capacity=len(PROMPT) + n)
    with host_reads() as reads:
        out = decode_on_device(runtime, PROMPT, build_chain({"temperature": 0}), Greedy(), n)
    assert len(out.new_ids) == n
    assert dict(reads) == {"tolist": 1}, reads  # the one transfer at the end; the eager loop reads once a token


def test_step_stats_by_hand():
    """Logits [0, ln 3] -> raw p = (1/4, 3/4); greedy picks 1: raw logprob ln 3/4; entropy of (1/4, 3/4);
    a chain of temperature 0.5 gives z' = (0, 2 ln 3): p' = (1/10, 9/10)."""
    logits = torch.tensor([[0.0, math.log(3.0)]])
    token, row = device_step(build_chain({"temperature": 0.5}), Greedy(), torch.zeros(1, 1, dtype=torch.long),
                             logits)
    values = dict(zip(STATS, row.tolist()))
    h = lambda ps: -sum(p * math.log(p) for p in ps)  # noqa: E731
    assert token.tolist() == [1] and values["token"] == 1 and values["finite"] == 1.0
    assert values["raw_logprob"] == pytest.approx(math.log(0.75))
    assert values["logprob"] == pytest.approx(math.log(0.9))
    assert values["raw_entropy"] == pytest.approx(h([0.25, 0.75]))
    assert values["entropy"] == pytest.approx(h([0.1, 0.9]))


def test_delivered_stops_at_eos_and_at_an_empty_chain():
    row = lambda t, finite=1.0: [t, -1.0, -1.0, 1.0, 1.0, finite]  # noqa: E731
    out = delivered([row(4), row(9), row(7)], eos_ids=(9,))
    assert (out.new_ids, out.stop_reason) == ([4, 9], "eos")
    out = delivered([row(4), row(5, 0.0), row(7)], eos_ids=())
    assert (out.new_ids, out.stop_reason) == ([4], "empty_chain")


def test_the_step_is_captured_only_on_cuda_for_a_chain_that_reads_no_ids():
    plain = build_chain({"temperature": 0.8, "top-k": 5})
    assert step_fn(plain, Greedy(), "cpu").__name__ == "step"  # eager on the CPU: the same function
    with_ids = build_chain({"repetition-penalty": 1.2})
    assert with_ids.uses_ids and step_fn(with_ids, Greedy(), "cpu").__name__ == "step"
