"""`stream` core: scoring a long text under a policy, the attention-sink profile, the per-step cache state."""

from __future__ import annotations

import math

import torch

from decodelab.core.kv import parse_cache_spec
from decodelab.core.model import attention_weights, forward
from decodelab.core.runtime import Runtime
from decodelab.core.stream import cache_state, perplexity, score_stream, sink_profile

from conftest import random_model


def test_score_stream_full_equals_one_forward_and_spans_add_up():
    model = random_model("llama", seed=7)
    ids = torch.randint(0, 256, (1, 50), generator=torch.Generator().manual_seed(7))
    logits = forward(model, ids, None, torch.arange(50).unsqueeze(0), logits_to_keep=0)[0]
    nll = -torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:].view(-1, 1)).sum()
    spans = list(score_stream(model, ids[0].tolist(), parse_cache_spec("full"), chunk=3, report_every=10))
    assert sum(s.tokens for s in spans) == 49 and spans[0].start == 0 and spans[-1].end == 50
    assert [s.start for s in spans[1:]] == [s.end for s in spans[:-1]]
    assert math.isclose(sum(s.nll for s in spans), float(nll), rel_tol=1e-5)
    assert math.isclose(perplexity(spans), math.exp(float(nll) / 49), rel_tol=1e-5)
    assert spans[-1].cache_tokens == 50


def test_score_stream_bounded_memory_is_flat():
    model = random_model("llama", seed=7)
    ids = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(8)).tolist()
    spans = list(score_stream(model, ids, parse_cache_spec("sinks:sinks=2,recent=8"), chunk=1, report_every=10))
    assert {s.cache_tokens for s in spans[1:]} == {10}
    assert len({s.kv_bytes for s in spans[1:]}) == 1


def test_sink_profile_on_hand_weights():
    """Causal uniform attention gives ratio 1 everywhere; all weight on key 0 gives sink mass 1."""
    T = 8
    uniform = torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1).view(-1, 1)
    sink = torch.zeros(T, T)
    sink[:, 0] = 1.0
    weights = [torch.stack([uniform, sink]).unsqueeze(0)]  # one layer, two heads
    rows = sink_profile(weights, sinks=1, late_from=4)
    assert math.isclose(rows[0].ratio, 1.0, rel_tol=1e-6)
    # query q sees q + 1 keys, so key 0 gets 1 / (q + 1), averaged over q = 4..7
    assert math.isclose(rows[0].sink_mass, sum(1 / (q + 1) for q in range(4, 8)) / 4, rel_tol=1e-6)
    assert rows[1].sink_mass == 1.0 and rows[1].average_mass == 0.0 and rows[1].ratio == float("inf")


def test_attention_weights_restore_the_implementation():
    model = random_model("llama", seed=1)
    model.set_attn_implementation("sdpa")
    weights = attention_weights(model, torch.arange(12).view(1, -1))
    assert len(weights) == 2 and weights[0].shape == (1, 4, 12, 12)
    torch.testing.assert_close(weights[0].sum(-1), torch.ones(1, 4, 12))
    assert model.config._attn_implementation == "sdpa"


def test_cache_state_names_what_the_next_forward_sees():
    model = random_model("llama", seed=1)
    rt = Runtime.create(model, parse_cache_spec("sinks:sinks=2,recent=5"))
    rt.feed(torch.arange(9).view(1, -1))
    state = cache_state(rt.policy)
    assert state["cache_tokens"] == 7 and state["evicted"] == [2, 4]
    assert state["slots"] == [[0, 2, 0], [4, 9, 2]] and state["kv_bytes"] == rt.policy.nbytes()
    rec = Runtime.create(model, parse_cache_spec("recompute:size=4"))
    rec.feed(torch.arange(9).view(1, -1))
    assert cache_state(rec.policy) == {"cache_tokens": 0, "kv_bytes": 0, "evicted": [], "slots": [[6, 9, 0]]}
