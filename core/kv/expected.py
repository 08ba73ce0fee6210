"""``expected-attention``: keep the tokens future queries are expected to attend to (Devoto et al. 2025, "Expected
Attention: KV Cache Compression by Estimating Attention from Future Queries Distribution", arXiv 2510.00636; kvpress's
ExpectedAttentionPress).

It compresses once, after the prompt, and needs the prompt's queries but not the question's: it models the queries
to come as a Gaussian fitted to the prompt's and scores every cached key by the attention such a query gives it in
expectation. Per layer and query head h, from the prompt's queries before RoPE q_t (t >= sinks):

    mu = mean_t q_t,   Sigma = (1/N) sum_t (q_t - mu)(q_t - mu)^T               (the Gaussian of a query)
    R_bar = (1/F) sum_{p=T}^{T+F-1} R(p)                                          (RoPE averaged over F future
        positions: R(p) x = cos(p f) * x + sin(p f) * rotate_half(x) on the rotary channels, the identity on others)
    mu' = R_bar mu,   Sigma' = R_bar Sigma R_bar^T

For q ~ N(mu', Sigma') and a cached key k (RoPE applied), E[exp(q . k / sqrt(D))] = exp(mu' . k / sqrt(D) +
k^T Sigma' k / (2 D)), so the expected attention of key j is the softmax over the keys of

    z_j = mu' . k_j / sqrt(D) + k_j^T Sigma' k_j / (2 D)            (``covariance=false`` drops the second term)

averaged over the query heads of each KV head, then multiplied by ||v_j|| (``vnorm=true``: what the token would add
to the output). The first ``sinks`` tokens are always kept (score +inf; their queries are left out of mu and
Sigma: attention sinks are outliers). Ties: the earlier position. ``ratio=R`` or ``size=S`` as every press;
``future=F`` (default 512), ``sinks=S`` (default 4). Models whose query projection is followed by a norm (Qwen3,
Gemma 3) or that have no separate query projection or no RoPE are refused with one line.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..errors import ConfigError
from .press import PressPolicy, Ratio, budget_params, check_budget
from .protocol import ModelInfo, boolean, non_negative_int, positive_int, register


def mean_rotation(inv_freq: Tensor, rotary_dim: int, head_dim: int, start: int, count: int,
                  scaling: float = 1.0) -> Tensor:
    """R_bar [D, D] (float64): the mean of R(p) over p = start .. start + count - 1, where on the first
    ``rotary_dim`` channels R(p) x = scaling * (cos(p f) x + sin(p f) rotate_half(x)) (f repeated over the two
    halves, rotate_half(x) = (-x2, x1)) and the identity on the others."""
    half = rotary_dim // 2
    positions = torch.arange(start, start + count, dtype=torch.float64)
    angles = positions[:, None] * inv_freq.double()[None, :half]  # [count, half]
    cos, sin = angles.cos().mean(0) * scaling, angles.sin().mean(0) * scaling  # [half]: the mean is linear
    r = torch.eye(head_dim, dtype=torch.float64)
    idx = torch.arange(half)
    r[idx, idx] = cos
    r[idx + half, idx + half] = cos
    r[idx, idx + half] = -sin  # out[:half] = cos x1 - sin x2
    r[idx + half, idx] = sin  # out[half:] = cos x2 + sin x1
    return r


def expected_scores(queries: Tensor, keys: Tensor, values: Tensor, rotation: Tensor, sinks: int,
                    covariance: bool = True, vnorm: bool = True) -> Tensor:
    """Scores [B, H_kv, L] of the cached ``keys``/``values`` [B, H_kv, L, D] from the prompt's ``queries``
    [B, H, T, D] (before RoPE) and ``rotation`` R_bar; the first ``sinks`` slots get +inf."""
    b, h, _, d = queries.shape
    kv_heads = keys.shape[1]
    q = queries[:, :, sinks:].double()
    mu = q.mean(dim=2)  # [B, H, D]
    r = rotation.to(q.device)
    mu = mu @ r.T  # R_bar mu
    k = keys.double().repeat_interleave(h // kv_heads, dim=1)  # [B, H, L, D]: query head h reads KV head h // group
    z = (k @ mu.unsqueeze(-1)).squeeze(-1) / math.sqrt(d)  # [B, H, L]
    if covariance:
        centred = q - q.mean(dim=2, keepdim=True)
        sigma = centred.transpose(-1, -2) @ centred / q.shape[2]  # [B, H, D, D]
        sigma = r @ sigma @ r.T
        z = z + torch.einsum("bhld,bhde,bhle->bhl", k, sigma, k) / (2 * d)
    z[..., :sinks] = -math.inf  # the sinks are kept apart: the softmax is over the others
    p = torch.softmax(z, dim=-1).view(b, kv_heads, h // kv_heads, -1).mean(dim=2)  # [B, H_kv, L]
    if vnorm:
        p = p * values.double().norm(dim=-1)
    p[..., :sinks] = math.inf
    return p.float()


@register
class ExpectedAttentionPolicy(PressPolicy):
    name = "expected-attention"
    summary = ("the tokens future queries are expected to attend to (a Gaussian of the prompt's queries, RoPE "
               "averaged over future positions); query-free; ratio=R or size=S; future=F, sinks=S")
    phases = ("prefill",)
    default_compress = "prefill"
    model_needs = frozenset({"queries"})
    params = {**budget_params(("prefill",)), "future": positive_int, "sinks": non_negative_int,
              "covariance": boolean, "vnorm": boolean}

    @staticmethod
    def check_options(values: dict) -> dict:
        values = check_budget("expected-attention", values, None)
        return {"future": 512, "sinks": 4, "covariance": True, "vnorm": True, **values}

    def __init__(self, info: ModelInfo, capacity: int | None = None, needs: frozenset[str] = frozenset(),
                 ratio: Ratio | None = None, size: int | None = None, future: int = 512, sinks: int = 4,
                 covariance: bool = True, vnorm: bool = True):
        if info.rotary is None:
            raise ConfigError("--cache expected-attention: this model has no RoPE (its future queries are not a "
                              "rotation of the prompt's); use keydiff or knorm")
        super().__init__(info, capacity, needs, ratio=ratio, size=size)
        self.future, self.sinks, self.covariance, self.vnorm = future, sinks, covariance, vnorm
        self._queries: tuple | None = None

    def spec_options(self) -> dict:
        return {**super().spec_options(), "future": self.future, "sinks": self.sinks,
                "covariance": str(self.covariance).lower(), "vnorm": str(self.vnorm).lower()}

    def wants_queries(self, n: int) -> bool:
        return self.compresses_after(n)

    def observe_queries(self, queries: tuple) -> None:
        if len(queries) != len(self.pos) or any(q is None for q in queries):
            raise ConfigError(f"--cache {self.spec_text()}: this model's query projection is not its query (no "
                              "q_proj, or a norm after it); use --cache keydiff or knorm (keys only)")
        self._queries = queries

    def after_forward(self, n: int) -> None:
        super().after_forward(n)
        self._queries = None

    def slot_scores(self, layer: int, n: int) -> Tensor:
        rot = self.info.rotary
        if self.seen <= self.sinks:
            raise ConfigError(f"--cache {self.spec_text()}: the prompt ({self.seen} tokens) must be longer than "
                              f"sinks={self.sinks}")
        rotation = mean_rotation(rot.inv_freq, rot.rotary_dim, self.info.head_dim, self.seen, self.future,
                                 rot.attention_scaling)
        cache = self.model_cache.layers[layer]
        return expected_scores(self._queries[layer], cache.keys, cache.values, rotation, self.sinks,
                               self.covariance, self.vnorm)
