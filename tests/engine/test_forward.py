"""core/engine/forward.py: the one call into a model (checked against the model called directly, and on a stand-in
that records what it is given), the eager-attention calls that restore the model's own implementation, and what a KV
policy is told about a model (RoPE frequencies recomputed from the config)."""

from __future__ import annotations

# mutation run of core/engine/forward.py (2026-12-02)

import types

import pytest
import torch
from conftest import random_model

from decodelab.core.engine import forward as fw


class StandIn:
    """A model stand-in: records the keyword arguments of each call, answers float16 logits [B, T, 3] and the
    attentions it was given; its attention implementation is a config field set through set_attn_implementation."""

    def __init__(self, attn="sdpa", attentions=(), kwarg="cache", fail=False):
        self.config = types.SimpleNamespace(_attn_implementation=attn)
        self.calls, self.switches, self.attentions, self.fail = [], [], attentions, fail
        self._decodelab_cache_kwarg = kwarg

    def set_attn_implementation(self, name):
        self.switches.append(name)
        self.config._attn_implementation = name

    def __call__(self, input_ids, **kwargs):
        self.calls.append(kwargs)
        self.attn_during = self.config._attn_implementation
        if self.fail:
            raise RuntimeError("boom")
        b, t = input_ids.shape
        return types.SimpleNamespace(logits=torch.ones(b, t, 3, dtype=torch.float16), attentions=self.attentions)


def test_the_cache_argument_is_named_from_the_forwards_signature_once():
    class New:
        def forward(self, input_ids, cache=None):
            pass

    class Old:
        def forward(self, input_ids, past_key_values=None):
            pass

    new, old = New(), Old()
    assert fw.cache_kwarg(new) == "cache" and new._decodelab_cache_kwarg == "cache"
    assert fw.cache_kwarg(old) == "past_key_values" and old._decodelab_cache_kwarg == "past_key_values"
    old._decodelab_cache_kwarg = "remembered"
    assert fw.cache_kwarg(old) == "remembered"
    assert fw.cache_kwarg(random_model("llama")) in ("cache", "past_key_values")


def test_forward_passes_the_cache_positions_mask_and_logits_wanted():
    model = StandIn()
    ids = torch.zeros(2, 4, dtype=torch.long)
    out = fw.forward(model, ids)
    assert model.calls[-1] == {"cache": None, "use_cache": False, "logits_to_keep": 1}
    assert out.dtype is torch.float32 and out.shape == (2, 4, 3) and torch.is_inference(out)
    cache, pos, mask = object(), torch.arange(4)[None], torch.ones(2, 4)
    out = fw.forward(model, ids, cache, pos, mask, logits_to_keep=0, inference=False)
    assert model.calls[-1] == {"cache": cache, "use_cache": True, "logits_to_keep": 0, "position_ids": pos,
                               "attention_mask": mask}
    assert not torch.is_inference(out)
    old = StandIn(kwarg="past_key_values")
    fw.forward(old, ids, cache, attention_mask=mask)
    assert old.calls[-1] == {"past_key_values": cache, "use_cache": True, "logits_to_keep": 1, "attention_mask": mask}


def test_forward_under_no_grad_when_not_inference():
    seen = {}

    class Probe(StandIn):
        def __call__(self, input_ids, **kwargs):
            seen["grad"], seen["inference"] = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
            return super().__call__(input_ids, **kwargs)

    fw.forward(Probe(), torch.zeros(1, 1, dtype=torch.long), inference=False)
    assert seen == {"grad": False, "inference": False}
    fw.forward(Probe(), torch.zeros(1, 1, dtype=torch.long))
    assert seen == {"grad": False, "inference": True}


def test_forward_equals_the_model_called_directly():
    model = random_model("llama")
    ids = torch.tensor([[5, 17, 42, 9]])
    with torch.no_grad():
        direct = model(input_ids=ids, position_ids=torch.arange(3, 7)[None]).logits
    got = fw.forward(model, ids, None, torch.arange(3, 7)[None], logits_to_keep=0)
    assert torch.allclose(got, direct, atol=1e-6)
    last = fw.forward(model, ids, None, torch.arange(3, 7)[None])
    assert last.shape == (1, 1, 256) and torch.allclose(last[0, 0], direct[0, -1], atol=1e-6)
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    fw.forward(model, ids, cache)
    assert cache.get_seq_length() == 4


def test_forward_attending_switches_to_eager_and_back():
    weights = (torch.ones(1), None)
    model = StandIn("sdpa", attentions=weights)
    ids, cache, pos = torch.zeros(1, 2, dtype=torch.long), object(), torch.arange(2)[None]
    logits, attentions = fw.forward_attending(model, ids, cache, pos)
    assert model.attn_during == "eager" and model.switches == ["eager", "sdpa"]
    assert model.calls[-1] == {"cache": cache, "use_cache": True, "logits_to_keep": 1, "position_ids": pos,
                               "output_attentions": True}
    assert attentions == weights and logits.dtype is torch.float32 and logits.shape == (1, 2, 3)
    mask = torch.ones(1, 2)
    _, attentions = fw.forward_attending(StandIn("eager", attentions=None), ids, cache, pos, mask, logits_to_keep=0)
    eager = StandIn("eager")
    fw.forward_attending(eager, ids, cache, pos, mask, logits_to_keep=0)
    assert eager.switches == [] and attentions == ()
    assert eager.calls[-1]["attention_mask"] is mask and eager.calls[-1]["logits_to_keep"] == 0
    unset = StandIn(None)
    fw.forward_attending(unset, ids, cache, pos)
    assert unset.switches == ["eager"]  # nothing to restore
    failing = StandIn("sdpa", fail=True)
    with pytest.raises(RuntimeError):
        fw.forward_attending(failing, ids, cache, pos)
    assert failing.switches == ["eager", "sdpa"]


def test_the_attention_calls_run_in_inference_mode():
    seen = []

    class Probe(StandIn):
        def __call__(self, input_ids, **kwargs):
            seen.append(torch.is_inference_mode_enabled())
            return super().__call__(input_ids, **kwargs)

    ids = torch.zeros(1, 2, dtype=torch.long)
    fw.forward_attending(Probe("eager"), ids, None, torch.arange(2)[None])
    fw.attention_weights(Probe("eager"), ids)
    assert seen == [True, True]


def test_attention_weights_switch_to_eager_keep_the_real_weights_and_restore():
    w = torch.ones(1, 1, 2, 2)
    model = StandIn("sdpa", attentions=(w, None, w))
    out = fw.attention_weights(model, torch.zeros(1, 2, dtype=torch.long))
    assert out == [w, w] and model.attn_during == "eager" and model.switches == ["eager", "sdpa"]
    assert model.calls[-1] == {"use_cache": False, "output_attentions": True}
    eager = StandIn("eager", attentions=())
    assert fw.attention_weights(eager, torch.zeros(1, 2, dtype=torch.long)) == [] and eager.switches == []
    unset = StandIn(None, attentions=())
    fw.attention_weights(unset, torch.zeros(1, 2, dtype=torch.long))
    assert unset.switches == ["eager"]
    failing = StandIn("sdpa", fail=True)
    with pytest.raises(RuntimeError):
        fw.attention_weights(failing, torch.zeros(1, 2, dtype=torch.long))
    assert failing.switches == ["eager", "sdpa"]


def test_attention_weights_of_a_real_model_are_causal_rows_of_probabilities():
    model = random_model("llama")
    weights = fw.attention_weights(model, torch.arange(6)[None])
    assert len(weights) == 2 and weights[0].shape == (1, 4, 6, 6)
    assert torch.allclose(weights[1].sum(-1), torch.ones(1, 4, 6), atol=1e-5)
    assert torch.all(weights[0].triu(1) == 0)


def test_rotary_parameters_recomputed_from_the_config():
    model = random_model("llama", head_dim=8)  # hidden 64 over 4 heads would be 16
    rotary = fw.rotary_parameters(model)
    theta = model.config.rope_parameters["rope_theta"]
    expected = 1.0 / theta ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    assert torch.allclose(rotary.inv_freq, expected) and rotary.inv_freq.dtype is torch.float32
    assert rotary.rope_type == "default" and rotary.rotary_dim == 8 and rotary.head_dim == 8
    assert rotary.attention_scaling == 1.0 and type(rotary.head_dim) is int
    assert fw.rotary_parameters(random_model("llama")).head_dim == 16
    assert fw.rotary_parameters(random_model("gpt2")) is None


def test_rotary_parameters_of_a_stand_in_rope():
    emb = types.SimpleNamespace(inv_freq=torch.tensor([1.0, 0.5, 0.25], dtype=torch.float64), rope_type="yarn",
                                attention_scaling=1.25)
    plain = types.SimpleNamespace(rope_type="x")  # no frequencies: not the RoPE module
    cfg = types.SimpleNamespace(hidden_size=48, num_attention_heads=4, head_dim=None)
    model = types.SimpleNamespace(modules=lambda: iter([plain, emb]), config=cfg)
    rotary = fw.rotary_parameters(model)
    assert rotary.rope_type == "yarn" and rotary.rotary_dim == 6 and rotary.head_dim == 12
    assert rotary.attention_scaling == 1.25 and rotary.inv_freq.dtype is torch.float32
    del emb.attention_scaling
    assert fw.rotary_parameters(model).attention_scaling == 1.0
    text = types.SimpleNamespace(hidden_size=64, num_attention_heads=2, head_dim=None)
    model.config = types.SimpleNamespace(get_text_config=lambda: text)
    assert fw.rotary_parameters(model).head_dim == 32


def test_model_info_per_architecture():
    for arch, layers, kv_heads, head_dim in (("llama", 2, 2, 16), ("qwen2", 2, 1, 16), ("gpt2", 2, 4, 16),
                                             ("gemma2", 2, 2, 16)):
        model = random_model(arch)
        info = fw.model_info(model)
        assert (info.num_layers, info.kv_heads, info.head_dim) == (layers, kv_heads, head_dim), arch
        assert info.config is model.config and info.device == torch.device("cpu") and info.dtype is torch.float32
        assert (info.rotary is None) == (arch == "gpt2")
    info = fw.model_info(random_model("llama", head_dim=8).to(torch.bfloat16))
    assert info.head_dim == 8 and info.dtype is torch.bfloat16


def test_model_info_of_configs_that_spell_their_sizes_otherwise():
    param = torch.nn.Parameter(torch.zeros(1, dtype=torch.float16))

    def stand_in(cfg):
        return types.SimpleNamespace(config=cfg, parameters=lambda: iter([param]), modules=lambda: iter([]))

    info = fw.model_info(stand_in(types.SimpleNamespace(n_layer=3, n_head=6, n_embd=48)))
    assert (info.num_layers, info.kv_heads, info.head_dim, info.dtype) == (3, 6, 8, torch.float16)
    info = fw.model_info(stand_in(types.SimpleNamespace(num_hidden_layers=None, n_layer=5, num_attention_heads=None,
                                                        n_head=2, num_key_value_heads=None, hidden_size=None,
                                                        n_embd=20, head_dim=None)))
    assert (info.num_layers, info.kv_heads, info.head_dim) == (5, 2, 10)
    info = fw.model_info(stand_in(types.SimpleNamespace()))
    assert (info.num_layers, info.kv_heads, info.head_dim) == (0, 1, 0)
    text = types.SimpleNamespace(num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2, hidden_size=32)
    outer = types.SimpleNamespace(get_text_config=lambda: text, num_hidden_layers=99)
    info = fw.model_info(stand_in(outer))
    assert (info.num_layers, info.kv_heads, info.head_dim) == (7, 2, 8) and info.config is outer
    assert all(type(v) is int for v in (info.num_layers, info.kv_heads, info.head_dim))
