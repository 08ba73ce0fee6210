"""Rotation before quantization (``quant:rotate=hadamard|random``): the matrices, the exact unquantized limit through
the model, the outlier channel it exists for, and llama.cpp's reading."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_model

from decodelab.core.engine.runtime import Runtime
from decodelab.core.errors import ConfigError
from decodelab.core.kv import engine_reading, parse_cache_spec
from decodelab.core.kv import quant as quant_module
from decodelab.core.kv.quant import Layout
from decodelab.core.kv.quantize import QTensor
from decodelab.core.kv.rotation import block_hadamard, hadamard, make_rotation, random_orthogonal
from decodelab.core.sampling.settings import ChainSettings


# --- the matrices ----------------------------------------------------------------------------------------------------


def test_hadamard_by_hand():
    h = hadamard(4) * 2  # entries +-1 before the 1/sqrt(4) scale
    assert h.tolist() == [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]


@pytest.mark.parametrize("dim", [1, 2, 16, 64, 128])
def test_hadamard_is_orthonormal_and_its_own_inverse(dim):
    h = hadamard(dim)
    torch.testing.assert_close(h @ h.T, torch.eye(dim), rtol=0, atol=1e-6)
    torch.testing.assert_close(h, h.T)


def test_hadamard_refuses_a_size_that_is_not_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        hadamard(24)


def test_block_hadamard_for_a_head_dim_that_is_not_a_power_of_two():
    m = block_hadamard(96)  # 96 = 3 x 32: three 32 x 32 blocks
    torch.testing.assert_close(m @ m.T, torch.eye(96), rtol=0, atol=1e-6)
    torch.testing.assert_close(m[:32, :32], hadamard(32))
    assert torch.count_nonzero(m[:32, 32:]) == 0
    assert make_rotation("hadamard", 96).describe() == "hadamard (blocks of 32)"


def test_random_rotation_is_orthogonal_reproducible_and_not_a_permutation():
    a, b = random_orthogonal(32), random_orthogonal(32)
    torch.testing.assert_close(a @ a.T, torch.eye(32), rtol=0, atol=1e-5)
    assert torch.equal(a, b)
    assert not torch.equal(a, random_orthogonal(32, seed=1))
    assert (a.abs() > 1e-3).float().mean() > 0.9  # dense: every channel mixed into every other


def test_random_rotation_is_haar_distributed():
    """The sign fix of QR: without it, Q's diagonal leans positive. Over many seeds the mean of Q[0, 0] is 0 within
    its standard error (Var = 1/d for a Haar matrix's entry)."""
    d, n = 8, 400
    first = torch.tensor([random_orthogonal(d, seed=s)[0, 0].item() for s in range(n)])
    assert abs(first.mean().item()) < 4 * math.sqrt(1 / d / n)
    assert abs(first.pow(2).mean().item() - 1 / d) < 0.05


# --- the layout ------------------------------------------------------------------------------------------------------


def keys_with_an_outlier_channel(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 2, 40, 64, generator=g)
    x[..., 5] *= 30.0  # one channel 30x the others, as keys' outlier channels are
    return x


def test_hadamard_rotation_cuts_the_per_token_error_of_an_outlier_channel():
    """The reason rotation exists: one scale per token spends the 4-bit grid on the outlier; rotated, the outlier's
    energy is spread over 64 channels and the mean squared error falls several-fold."""
    x = keys_with_an_outlier_channel()
    err = {}
    for kind in ("none", "hadamard", "random"):
        layout = Layout("token", 32, 4, False, torch.float16, make_rotation(kind, 64))
        err[kind] = (layout.dequantize(layout.quantize(x), torch.float32) - x).pow(2).mean().item()
    assert err["hadamard"] < err["none"] / 3, err
    assert err["random"] < err["none"] / 3, err


def test_rotated_dequantization_writes_into_a_given_tensor():
    x = keys_with_an_outlier_channel()
    layout = Layout("group", 32, 4, False, torch.float16, make_rotation("hadamard", 64))
    q = layout.quantize(x)
    out = torch.empty_like(x)
    assert layout.dequantize(q, torch.float32, out=out) is out
    assert torch.equal(out, layout.dequantize(q, torch.float32))


def lossless(monkeypatch):
    """Codes that keep every float32 value (the 'unquantized limit'): quantize stores the view itself."""

    def store(view, bits, dims, symmetric=True, scale_dtype=torch.float16):
        scale = torch.ones_like(view.float().amax(dim=dims, keepdim=True))  # sliced and gathered like a real one
        return QTensor(view.float().clone(), scale, None, "lossless", view.shape[-1])

    def give_back(q, dtype=torch.float32, out=None):
        if out is None:
            return q.codes.to(dtype)
        return out.copy_(q.codes)

    monkeypatch.setattr(quant_module, "quantize_over", store)
    monkeypatch.setattr(quant_module, "dequantize_view", give_back)


def decode_logits(model, spec: str, ids: torch.Tensor) -> torch.Tensor:
    rt = Runtime.create(model, parse_cache_spec(spec))
    rows = [rt.prefill(ids[:, :8])[0]]
    rows += [rt.feed(ids[:, t : t + 1])[0] for t in range(8, ids.shape[1] - 1)]
    return torch.stack(rows)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "gpt2"])
@pytest.mark.parametrize("rotate", ["hadamard", "random", "rotate_keys=hadamard", "rotate_values=random"])
def test_rotation_with_lossless_codes_equals_no_rotation(monkeypatch, arch, rotate):
    """Exact in the unquantized limit: keys rotated and rotated back, values rotated and rotated back, through every
    layer of the model (GQA, sliding layers, absolute positions) give the logits of the same cache without rotation,
    within float32 rounding of the two products; and rotation with real 4-bit codes does change them (so the
    rotation is really in the path)."""
    model = random_model(arch, scale=4.0)
    ids = torch.arange(3, 40).unsqueeze(0)
    option = rotate if "=" in rotate else f"rotate={rotate}"
    real = decode_logits(model, f"quant:bits=4,axis=token,{option}", ids)
    plain_real = decode_logits(model, "quant:bits=4,axis=token", ids)
    assert not torch.allclose(real, plain_real, atol=1e-4)
    lossless(monkeypatch)
    rotated = decode_logits(model, f"quant:bits=4,axis=token,{option}", ids)
    plain = decode_logits(model, "quant:bits=4,axis=token", ids)
    full = decode_logits(model, "full", ids)
    torch.testing.assert_close(plain, full, rtol=0, atol=1e-6)  # the stand-in codes are lossless
    torch.testing.assert_close(rotated, plain, rtol=0, atol=2e-5)


def test_rotated_kivi_through_the_model_stays_close_to_the_full_cache():
    model = random_model("llama", scale=4.0)
    ids = torch.arange(3, 60).unsqueeze(0)
    full = decode_logits(model, "full", ids).log_softmax(-1)
    for spec in ("quant:bits=4,axis=kivi,residual=4,kivi_keys=window,rotate=hadamard", "quant:bits=8,axis=token,rotate=random"):
        q = decode_logits(model, spec, ids).log_softmax(-1)
        kl = (full.exp() * (full - q)).sum(-1).mean().item()
        assert kl < 0.05, (spec, kl)


# --- the spec and llama.cpp's reading --------------------------------------------------------------------------------


def test_rotate_is_shorthand_for_both_streams_and_either_wins_alone():
    spec = parse_cache_spec("quant:bits=4,rotate=hadamard,rotate_values=none")
    assert spec.options["rotate_keys"] == "hadamard" and spec.options["rotate_values"] == "none"
    assert "rotate" not in spec.options
    assert "rotate_keys" not in parse_cache_spec("int4").options  # a spec that does not rotate names no rotation


def test_a_bad_rotation_is_one_line():
    with pytest.raises(ConfigError, match="rotate must be one of none, hadamard, random"):
        parse_cache_spec("quant:bits=4,rotate=givens")


def test_the_policy_describes_its_rotation():
    model = random_model("llama")
    rt = Runtime.create(model, parse_cache_spec("quant:bits=4,axis=kivi,rotate_keys=hadamard"))
    described = rt.policy.describe()
    assert described["keys"].endswith("rotated (hadamard)")
    assert "rotated" not in described["values"]


def test_llamacpp_semantics_rotates_a_quantized_cache_unless_told_otherwise():
    read = ChainSettings(cache="int4", semantics="llamacpp").cache_spec
    assert read.options["rotate_keys"] == read.options["rotate_values"] == "hadamard"
    assert "rotate_keys" not in ChainSettings(cache="int4").cache_spec.options
    assert "rotate_keys" not in ChainSettings(cache="int4", semantics="vllm").cache_spec.options
    told = ChainSettings(cache="quant:bits=4,rotate=none", semantics="llamacpp").cache_spec
    assert told.options["rotate_keys"] == "none"
    assert ChainSettings(cache="full", semantics="llamacpp").cache_spec == parse_cache_spec("full")
    assert engine_reading(parse_cache_spec("int8"), None) == parse_cache_spec("int8")
