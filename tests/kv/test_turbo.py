"""``turbo``: TurboQuant-style codes. The Lloyd-Max codebook against its known Gaussian values, the QJL residual's
unbiased inner products against the MSE code's shrinkage (the negative control), real bytes, and the model path."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_model

from decodelab.core.engine.runtime import Runtime
from decodelab.core.errors import ConfigError
from decodelab.core.kv import parse_cache_spec, policy_capabilities
from decodelab.core.kv.turbo import TurboLayout, from_planes, inner_product_error, lloyd_max, to_planes


# --- the codebook ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits,gaussian", [(1, [0.7979]), (2, [0.4528, 1.5104]), (3, [0.2451, 0.7560, 1.3440,
                                                                                       2.1520])])
def test_lloyd_max_tends_to_the_gaussian_quantizer(bits, gaussian):
    """A coordinate of a random unit vector in R^D is close to N(0, 1/D) for large D: the centroids times sqrt(D)
    approach the Lloyd-Max quantizer of N(0, 1) (Max 1960: +-0.7979; +-0.4528, +-1.5104; +-0.2451, +-0.7560,
    +-1.3440, +-2.1520)."""
    d = 4096
    c = lloyd_max(d, bits) * math.sqrt(d)
    positive = c[c > 0].tolist()
    assert positive == pytest.approx(gaussian, rel=0.01)
    torch.testing.assert_close(c, -c.flip(0))  # symmetric


def test_lloyd_max_centroids_are_the_means_of_their_cells():
    """The fixed point: each centroid is the mean of the density over its cell (checked by integrating f on a finer,
    independent grid), for a small D where the density is far from Gaussian."""
    d, bits = 8, 2
    c = lloyd_max(d, bits)
    t = torch.linspace(-1, 1, 2_000_001, dtype=torch.float64)
    f = (1 - t * t).clamp_min(0) ** ((d - 3) / 2)
    edges = torch.cat([torch.tensor([-1.0], dtype=torch.float64), (c[1:] + c[:-1]) / 2,
                       torch.tensor([1.0], dtype=torch.float64)])
    for k in range(len(c)):
        cell = (t >= edges[k]) & (t < edges[k + 1])
        assert (f[cell] * t[cell]).sum() / f[cell].sum() == pytest.approx(c[k].item(), abs=1e-4)


@pytest.mark.parametrize("bits", [1, 2, 3])
@pytest.mark.parametrize("dim", [5, 16, 64])
def test_bit_planes_round_trip(bits, dim):
    codes = torch.randint(0, 2**bits, (2, 3, 7, dim), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    planes = to_planes(codes, bits)
    assert planes.shape[-1] == bits * -(-dim // 8)  # real bytes: b bits a coordinate, rounded up to whole bytes
    assert torch.equal(from_planes(planes, bits, dim), codes)


# --- the codes -------------------------------------------------------------------------------------------------------


def vectors(seed: int = 0, n: int = 4000, d: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 1, n, d, generator=g)
    x[..., 3] *= 20.0  # an outlier channel: the rotation makes it harmless
    return x


def self_inner_product_bias(bits: int, prod: bool, x: torch.Tensor, seeds: int = 40) -> tuple[float, float]:
    """Mean over draws of P and S (the quantizer's randomness, over which the paper's estimator is unbiased) of the
    mean over tokens of (<x, x_hat> - ||x||^2) / ||x||^2, and its standard error across the draws."""
    per_draw = []
    for seed in range(seeds):
        layout = TurboLayout(bits, prod, torch.float32, x.shape[-1], seed=seed)
        x_hat = layout.dequantize(layout.quantize(x), torch.float32)
        per_draw.append((((x * x_hat).sum(-1) - (x * x).sum(-1)) / (x * x).sum(-1)).mean())
    per_draw = torch.stack(per_draw)
    return per_draw.mean().item(), per_draw.std().item() / math.sqrt(seeds)


@pytest.mark.parametrize("bits", [2, 3])
def test_the_qjl_residual_makes_inner_products_unbiased_and_the_mse_code_shrinks_them(bits):
    """The reason for the residual code. With probe = the vector itself, the MSE code's inner product falls short
    by its distortion (Lloyd-Max centroids are conditional means: <y, y_mse> = ||y_mse||^2 < 1 on average: about
    -0.12 at 2 bits, -0.03 at 3); ``prod`` is unbiased over the draw of P and S, within 4 standard errors. The MSE
    code is the negative control: the same test with it must see the bias."""
    x = vectors(n=200, d=32)
    bias, se = self_inner_product_bias(bits, True, x, seeds=150)
    assert abs(bias) < 4 * se, (bias, se)
    shrink, se_mse = self_inner_product_bias(bits, False, x, seeds=20)
    assert shrink < -0.02 and shrink < bias - 6 * se and shrink < -5 * se_mse, (shrink, se_mse, bias, se)


def test_mse_codes_error_falls_with_bits_and_rotation_tames_the_outlier():
    x = vectors()
    err = {b: (TurboLayout(b, False, torch.float16, 64).dequantize(TurboLayout(b, False, torch.float16, 64)
                                                                     .quantize(x), torch.float32) - x).pow(2).mean()
           for b in (2, 3, 4)}
    assert err[2] > err[3] > err[4]
    # relative error per vector near the Lloyd-Max distortion at 4 bits (about 0.009 of ||x||^2 for a Gaussian)
    layout = TurboLayout(4, False, torch.float16, 64)
    rel = ((layout.dequantize(layout.quantize(x), torch.float32) - x).pow(2).sum(-1) / x.pow(2).sum(-1)).mean()
    assert rel < 0.015


def test_inner_product_error_per_head_reports_the_bias():
    x = vectors(n=512).expand(1, 2, 512, 64).clone()
    mean_prod, rms_prod = inner_product_error(x, x[:, :, :64], TurboLayout(2, True, torch.float16, 64))
    mean_mse, rms_mse = inner_product_error(x, x[:, :, :64], TurboLayout(2, False, torch.float16, 64))
    assert mean_prod.shape == (2,) and (rms_prod > 0).all()
    assert (mean_mse < 0).all()  # probes that include the tokens themselves: the shrinkage shows


# --- the policy ------------------------------------------------------------------------------------------------------


def test_spec_defaults_and_refusals():
    assert str(parse_cache_spec("turbo")) == "turbo:bits=3,keys=prod,residual=0"
    assert policy_capabilities(parse_cache_spec("turbo")) == frozenset({"truncate", "reorder", "rows"})
    assert "truncate" not in policy_capabilities(parse_cache_spec("turbo:residual=8"))
    with pytest.raises(ConfigError, match="bits must be 2, 3 or 4"):
        parse_cache_spec("turbo:bits=8")


def decode_logits(model, spec: str, ids: torch.Tensor) -> tuple[torch.Tensor, Runtime]:
    rt = Runtime.create(model, parse_cache_spec(spec))
    rows = [rt.prefill(ids[:, :8])[0]]
    rows += [rt.feed(ids[:, t : t + 1])[0] for t in range(8, ids.shape[1] - 1)]
    return torch.stack(rows), rt


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2"])
def test_turbo_through_the_model_is_close_to_the_full_cache_and_its_bytes_are_real(arch):
    model = random_model(arch, scale=4.0)
    ids = torch.arange(3, 50).unsqueeze(0)
    full = decode_logits(model, "full", ids)[0].log_softmax(-1)
    kls = {}
    for spec in ("turbo:bits=4", "turbo:bits=2"):
        got, rt = decode_logits(model, spec, ids)
        got = got.log_softmax(-1)
        kls[spec] = (full.exp() * (full - got)).sum(-1).mean().item()
        stored = sum(t.numel() * t.element_size() for layer in rt.policy.model_cache.layers
                     for s in (layer.k, layer.v) for t in (s.q.codes, s.q.scale, s.q.zero) if t is not None)
        assert rt.policy.nbytes() == stored
        if arch != "gemma2":  # sliding layers evict: the projection counts what the window keeps
            assert rt.policy.bytes_at(ids.shape[1] - 1) == stored
    assert kls["turbo:bits=4"] < 0.02, kls
    assert kls["turbo:bits=4"] < kls["turbo:bits=2"], kls


def test_turbo_rolls_back_exactly_without_a_residual():
    """One token a code: dropping the last tokens leaves what never feeding them would have."""
    model = random_model("llama", scale=4.0)
    ids = torch.arange(3, 30).unsqueeze(0)
    a = Runtime.create(model, parse_cache_spec("turbo:bits=3"), needs=frozenset({"truncate"}))
    a.feed(ids[:, :20])
    a.feed(ids[:, 20:25])
    a.truncate(20)
    b = Runtime.create(model, parse_cache_spec("turbo:bits=3"))
    b.feed(ids[:, :20])
    assert torch.equal(a.feed(ids[:, 25:27]), b.feed(ids[:, 25:27]))


def test_keys_and_values_keep_their_own_codes():
    """Keys (prod) and values (mse) hold different planes: never worked on as one layout."""
    rt = Runtime.create(random_model("llama"), parse_cache_spec("turbo:bits=3"))
    rt.feed(torch.arange(3, 20).unsqueeze(0))
    layer = rt.policy.model_cache.layers[0]
    assert layer.k.q.zero is not None and layer.v.q.zero is None
    assert layer.k.q.codes.shape[-1] == layer.v.q.codes.shape[-1]  # 2 MSE planes + 1 sign plane vs 3 MSE planes
    assert "QJL" in rt.policy.describe()["keys"] and "QJL" not in rt.policy.describe()["values"]


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("prod", [True, False])
@pytest.mark.parametrize("dim", [20, 32])
def test_the_stored_planes_are_the_nearest_centroids_bits_then_the_qjl_signs(bits, prod, dim):
    """The bytes a token is stored as, written out plane by plane: the nearest centroid of each rotated coordinate
    (argmin of the distance, not the midpoints), its bits as planes, then for ``prod`` the signs of S r packed."""
    from decodelab.core.kv.quantize import pack

    layout = TurboLayout(bits, prod, torch.float16, dim)
    x = torch.randn(2, 3, 5, dim, generator=torch.Generator().manual_seed(bits))
    q = layout.quantize(x)
    rotated = x @ layout.p
    y = rotated / rotated.norm(dim=-1, keepdim=True)
    codes = (y.unsqueeze(-1) - layout.centroids).abs().argmin(-1)
    planes = [to_planes(codes.to(torch.uint8), layout.mse_bits)]
    if prod:
        r = y - layout.centroids[codes]
        planes.append(pack((r @ layout.s.T >= 0).to(torch.uint8), 1))
    assert torch.equal(q.codes, torch.cat(planes, -1))
