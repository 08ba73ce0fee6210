"""``expected-attention`` against a reference written from the paper: the prompt's queries caught at the attention
module's input and projected here, RoPE's future rotations taken from the model's own rotary module one position
at a time and averaged as matrices, the expectation of exp(q . k / sqrt(D)) under the fitted Gaussian, and the
kept positions compared with the policy's, bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_model
from press_reference import top_by_rank
from test_presses import model_for

from decodelab.core.engine.runtime import Runtime
from decodelab.core.errors import ConfigError
from decodelab.core.kv import parse_cache_spec
from decodelab.core.kv.expected import mean_rotation

PROMPT = 40


def rotate_half_matrix(d: int) -> torch.Tensor:
    """P with P x = (-x2, x1)."""
    p = torch.zeros(d, d, dtype=torch.float64)
    half = d // 2
    p[:half, half:] = -torch.eye(half)
    p[half:, :half] = torch.eye(half)
    return p


@torch.inference_mode()
def reference_kept(model, ids: torch.Tensor, budget: int, future: int, sinks: int, covariance: bool = True,
                   vnorm: bool = True) -> list[torch.Tensor]:
    """Per layer, the positions [B, H_kv, budget] the paper's rule keeps after the prompt ``ids``."""
    layers = model.model.layers
    hidden: list[torch.Tensor] = [None] * len(layers)

    def catch(i):
        def hook(module, args, kwargs):
            hidden[i] = (args[0] if args else kwargs["hidden_states"]).detach()
        return hook

    handles = [layer.self_attn.register_forward_pre_hook(catch(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        rt = Runtime.create(model, parse_cache_spec("full"))
        rt.feed(ids)
    finally:
        for h in handles:
            h.remove()
    t = ids.shape[1]
    d = model.config.head_dim if getattr(model.config, "head_dim", None) else model.config.hidden_size // \
        model.config.num_attention_heads
    # R(p) = diag(cos_p) + diag(sin_p) P from the model's rotary module, averaged over the future positions
    x = torch.zeros(1, 1, d)
    cos, sin = model.model.rotary_emb(x, torch.arange(t, t + future).unsqueeze(0))
    p_mat = rotate_half_matrix(d)
    r_bar = sum(torch.diag(cos[0, i].double()) + torch.diag(sin[0, i].double()) @ p_mat for i in range(future)) / future
    kept = []
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        q = attn.q_proj(hidden[i]).double()  # [1, T, H * D]
        h = q.shape[-1] // d
        q = q.view(1, t, h, d).transpose(1, 2)[:, :, sinks:]  # [1, H, N, D]
        keys = rt.policy.model_cache.layers[i].keys.double()  # [1, H_kv, T, D], RoPE applied
        values = rt.policy.model_cache.layers[i].values.double()
        group = h // keys.shape[1]
        scores = torch.zeros(1, keys.shape[1], t, dtype=torch.float64)
        for head in range(h):
            mu = r_bar @ q[0, head].mean(0)
            centred = q[0, head] - q[0, head].mean(0)
            sigma = r_bar @ (centred.T @ centred / centred.shape[0]) @ r_bar.T
            k = keys[0, head // group]
            z = torch.tensor([(mu @ k[j]) / math.sqrt(d) + ((k[j] @ sigma @ k[j]) / (2 * d) if covariance else 0.0)
                              for j in range(t)], dtype=torch.float64)
            z[:sinks] = -math.inf
            scores[0, head // group] += torch.softmax(z, 0) / group
        if vnorm:
            scores = scores * values.norm(dim=-1)
        scores[..., :sinks] = math.inf
        positions = torch.arange(t).expand(1, keys.shape[1], t)
        kept.append(top_by_rank(scores.float(), positions, budget))
    return kept


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("options,budget", [("size=16,future=64,sinks=4", 16),
                                            ("ratio=0.5,future=16,sinks=2,covariance=false", 20),
                                            ("size=12,future=32,sinks=0,vnorm=false", 12)])
def test_kept_positions_equal_the_paper_reference(arch, options, budget):
    model = model_for(arch)
    ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    spec = parse_cache_spec("expected-attention:" + options)
    o = spec.options
    rt = Runtime.create(model, spec)
    rt.feed(ids)
    want = reference_kept(model, ids, budget, o["future"], o["sinks"], o["covariance"], o["vnorm"])
    got = rt.policy.kept()
    assert all(torch.equal(g.long(), w) for g, w in zip(got, want))
    assert rt.policy.stored == budget
    assert all(set(range(o["sinks"])) <= set(g[0, 0].tolist()) for g in got)  # the sinks stay


def test_the_average_rotation_matches_the_rotary_module_at_one_position():
    model = random_model("llama")
    d = 16
    cos, sin = model.model.rotary_emb(torch.zeros(1, 1, d), torch.tensor([[7]]))
    want = torch.diag(cos[0, 0].double()) + torch.diag(sin[0, 0].double()) @ rotate_half_matrix(d)
    inv = model.model.rotary_emb.inv_freq
    torch.testing.assert_close(mean_rotation(inv, d, d, 7, 1), want)


def test_models_it_cannot_score_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="no RoPE"):
        Runtime.create(random_model("gpt2"), parse_cache_spec("expected-attention:ratio=0.5"))
    with pytest.raises(ConfigError, match="exactly one of ratio"):
        parse_cache_spec("expected-attention:future=8")
