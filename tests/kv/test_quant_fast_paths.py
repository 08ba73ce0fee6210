"""The quantized cache's faster paths (issue 38, decode time) give the bits of the plain forms they replace.

Each reference here is the plain form the code used before: a zero scale replaced by 1 with ``ones_like``, codes
packed by shifting each lane and summing, one slice per stream. The decode-level pin is the recompute-from-scratch
oracle of test_quant_decode.py (logits bit for bit); these catch a fast path that moves a bit before any model runs.
"""

from __future__ import annotations

import math

import pytest
import torch

from decodelab.core.kv.quant import split_q
from decodelab.core.kv.quantize import QTensor, pack, quantize_over, round_down, round_up, unpack


def plain_quantize(x, bits, dims, symmetric, scale_dtype):
    """quantize_over as first written (the module docstring's formulas, term by term)."""
    v = x.float()
    if bits == "fp8":
        absmax = v.abs().amax(dim=dims, keepdim=True)
        scale = round_up(absmax / 448.0, scale_dtype)
        safe = torch.where(scale > 0, scale.float(), torch.ones_like(absmax))
        return (v / safe).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale, None
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = round_up(v.abs().amax(dim=dims, keepdim=True) / qmax, scale_dtype)
        safe = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
        q = torch.round(v / safe).clamp(-qmax, qmax) + 2 ** (bits - 1)
        return plain_pack(q.to(torch.uint8), bits), scale, None
    levels = 2**bits - 1
    zero = round_down(v.amin(dim=dims, keepdim=True), scale_dtype)
    scale = round_up((v.amax(dim=dims, keepdim=True) - zero.float()) / levels, scale_dtype)
    safe = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    q = torch.round((v - zero.float()) / safe).clamp(0, levels)
    return plain_pack(q.to(torch.uint8), bits), scale, zero


def plain_pack(codes, bits):
    """Code j of a byte in bits [j b, (j + 1) b): each lane shifted, then summed."""
    per = 8 // bits
    if per == 1:
        return codes
    pad = (-codes.shape[-1]) % per
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    grouped = codes.unflatten(-1, (-1, per)).to(torch.int32)
    return sum(grouped[..., j] << (j * bits) for j in range(per)).to(torch.uint8)


def inputs(dtype):
    """Tokens with an all-zero group, a constant group (zero scale, non-zero zero point), a tiny one (subnormal
    scales) and a wide one."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 8, 16, generator=g) * 3
    x[0, 0, 0] = 0
    x[0, 1, 1] = 0.5
    x[1, 2, 2] *= 1e-6
    x[1, 0, 3] *= 1e3
    return x.to(dtype)


@pytest.mark.parametrize("bits", [2, 4, 8] + (["fp8"] if hasattr(torch, "float8_e4m3fn") else []))
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dims", [(-1,), (-2,), (1, 2, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_over_gives_the_plain_forms_bits(bits, symmetric, dims, dtype):
    if bits == "fp8" and not symmetric:
        pytest.skip("fp8 is symmetric")
    scale_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float16
    x = inputs(dtype)
    q = quantize_over(x, bits, dims, symmetric, scale_dtype)
    codes, scale, zero = plain_quantize(x, bits, dims, symmetric, scale_dtype)
    same = (lambda a, b: torch.equal(a.view(torch.uint8), b.view(torch.uint8))) if bits == "fp8" else torch.equal
    assert same(q.codes, codes) and torch.equal(q.scale, scale)
    assert (q.zero is None and zero is None) or torch.equal(q.zero, zero)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("n", [1, 3, 8, 31])
def test_pack_equals_the_shifted_sum_and_round_trips(bits, n):
    codes = torch.randint(0, 2**bits, (3, 5, n), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    assert torch.equal(pack(codes, bits), plain_pack(codes, bits))
    assert torch.equal(unpack(pack(codes, bits), bits, n), codes)


def test_pack_of_a_bad_lane_order_would_fail():
    """Negative control: the two 4-bit codes of a byte swapped give other bytes."""
    codes = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    assert not torch.equal(pack(codes, 4), plain_pack(codes.flip(-1), 4).flip(-1))


@pytest.mark.parametrize("zero", [True, False])
def test_split_q_gives_each_streams_rows(zero):
    """split_q(q, rows)[i] = q's rows [i rows, (i + 1) rows) of codes, scales and zero points (what slicing gave)."""
    q = QTensor(torch.arange(24, dtype=torch.uint8).view(6, 4), torch.arange(6.0).view(6, 1).half(),
                torch.arange(6.0).view(6, 1).half() if zero else None, 4, 8)
    parts = split_q(q, 2)
    assert len(parts) == 3
    for i, part in enumerate(parts):
        want = q.map(lambda t: t[2 * i : 2 * i + 2])
        assert torch.equal(part.codes, want.codes) and torch.equal(part.scale, want.scale)
        assert (part.zero is None) == (not zero) and (part.zero is None or torch.equal(part.zero, want.zero))
        assert (part.bits, part.last) == (4, 8)


def test_the_reference_quantizer_is_not_vacuous():
    """The plain form tells a wrong zero-scale rule apart: dividing a constant group by its (zero) scale is NaN."""
    x = torch.full((1, 1, 1, 4), 0.5)
    zero = round_down(x.amin(dim=-1, keepdim=True), torch.float16)
    scale = round_up((x.amax(dim=-1, keepdim=True) - zero.float()) / 15, torch.float16)
    assert scale.item() == 0 and math.isnan(((x - zero.float()) / scale.float()).sum().item())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rounding_into_the_scale_dtype_gives_the_plain_forms_bits(dtype):
    """round_up / round_down (nextafter towards a cached 0-dim infinity) = the plain form (towards a full tensor of
    it), over 35 decades, zeros, subnormals and values beyond the dtype's range; and they bracket x."""
    x = torch.cat([torch.randn(2000, generator=torch.Generator().manual_seed(5)) * torch.logspace(-45, 6, 2000),
                   torch.tensor([0.0, -0.0, 1e-40, -1e-40, 7e4, -7e4])])
    y = x.to(dtype)
    up = torch.where(y.float() < x, torch.nextafter(y, torch.full_like(y, math.inf)), y)
    down = torch.where(y.float() > x, torch.nextafter(y, torch.full_like(y, -math.inf)), y)
    assert torch.equal(round_up(x, dtype), up) and torch.equal(round_down(x, dtype), down)
    assert bool((round_up(x, dtype).float() >= x).all()) and bool((round_down(x, dtype).float() <= x).all())
