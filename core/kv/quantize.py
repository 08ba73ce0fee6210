"""Quantization math: integer (8, 4, 2 bits) and fp8 (e4m3) codes with scales over a chosen axis.

A tensor is quantized over *groups*: the elements that share one scale (and, asymmetric, one zero point). The
group is what the amax/amin reduce over:

* ``tensor``  every element of the tensor;
* ``token``   one token's head vector (the last dim, D);
* ``channel`` one channel across tokens (the token dim, -2);
* ``group``   G consecutive channels of one token (the last dim split into D / G groups of G).

Integer grids (b bits, L = 2^b - 1 steps):

* asymmetric: zero z = min rounded *down* to the scale dtype, scale s = (max - z) / L rounded *up*; code
  q = round((x - z) / s) in [0, L]; x' = z + q s. Rounding z down and s up keeps [min, max] inside the grid
  [z, z + L s], so |x - x'| <= s / 2 for every element (no clamping error).
* symmetric: s = absmax / (2^(b-1) - 1) rounded up; q = round(x / s) in [-(2^(b-1) - 1), 2^(b-1) - 1], stored as
  q + 2^(b-1) (unsigned); x' = q s; |x - x'| <= s / 2.

fp8 (e4m3, symmetric): s = absmax / 448 rounded up, code = fp8(x / s); x' = code * s. The error is relative: half a
unit in the last place of 3 mantissa bits, |x - x'| <= 2^-4 |x| for normal codes and <= 2^-10 s for subnormal ones.

4- and 2-bit codes are packed along the last dim, 8 / b codes per uint8 byte (code j of a byte in bits
[j b, (j + 1) b)), the last byte zero-padded when the dim is not a multiple of 8 / b. So ``QTensor.nbytes`` is the
real storage: packed codes + scales + zero points.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

BITS = (2, 4, 8, "fp8")
AXES = ("tensor", "token", "channel", "group")
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def fp8_supported() -> bool:
    return hasattr(torch, "float8_e4m3fn")


@dataclass
class QTensor:
    """Codes, scales and zero points of a quantized tensor. ``codes`` has the quantized view's shape with its last
    dim packed (``last`` = that dim's length before packing); ``scale``/``zero`` broadcast against the unpacked view.
    """

    codes: Tensor
    scale: Tensor
    zero: Tensor | None  # asymmetric only: the grid's lowest value
    bits: int | str
    last: int

    @property
    def symmetric(self) -> bool:
        return self.zero is None

    @property
    def nbytes(self) -> int:
        """Real bytes of the stored tensors: codes + scales + zero points."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero) if t is not None)

    def step(self) -> Tensor:
        """The quantization step of each element's group (broadcastable to the view): the scale."""
        return self.scale.float()

    def map(self, fn) -> QTensor:
        """The same quantization with ``fn`` applied to codes, scale and zero (slicing or gathering a dim that
        every one of them has in full, e.g. the batch or the block dim)."""
        return QTensor(fn(self.codes), fn(self.scale), None if self.zero is None else fn(self.zero), self.bits,
                       self.last)


# --- rounding into the scale dtype, in the safe direction ------------------------------------------------------------


_INFINITIES: dict = {}


def infinity(sign: float, like: Tensor) -> Tensor:
    """+-inf as a 0-dim tensor of ``like``'s dtype and device, made once (nextafter broadcasts it: one operation
    fewer a call than a full tensor of it)."""
    key = (sign, like.dtype, like.device)
    if key not in _INFINITIES:
        _INFINITIES[key] = torch.tensor(sign * math.inf, dtype=like.dtype, device=like.device)
    return _INFINITIES[key]


def round_down(x: Tensor, dtype: torch.dtype) -> Tensor:
    """The largest value of ``dtype`` <= x (x float32)."""
    y = x.to(dtype)
    return torch.where(y.float() > x, torch.nextafter(y, infinity(-1.0, y)), y)


def round_up(x: Tensor, dtype: torch.dtype) -> Tensor:
    """The smallest value of ``dtype`` >= x (x float32)."""
    y = x.to(dtype)
    return torch.where(y.float() < x, torch.nextafter(y, infinity(1.0, y)), y)


# --- packing ---------------------------------------------------------------------------------------------------------


def pack(codes: Tensor, bits: int) -> Tensor:
    """uint8 codes < 2^bits along the last dim -> 8 / bits codes per byte (last byte zero-padded)."""
    per = 8 // bits
    if per == 1:
        return codes
    n = codes.shape[-1]
    pad = (-n) % per
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    if per == 2:  # two operations: the low code, or the high one shifted up (the bits do not overlap: or = sum)
        return codes[..., 0::2] | (codes[..., 1::2] << 4)
    grouped = codes.unflatten(-1, (-1, per))  # [..., bytes, per]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)  # code j in bits [j b, (j + 1) b)
    return (grouped << shifts).sum(dim=-1, dtype=torch.uint8)


def unpack(packed: Tensor, bits: int, n: int, dtype: torch.dtype = torch.uint8) -> Tensor:
    """Inverse of :func:`pack`: the first ``n`` codes of the last dim, as ``dtype`` (uint8, or a float dtype the
    codes are written into directly: every code is a small integer, exact in any float)."""
    per = 8 // bits
    if per == 1:
        return packed.to(dtype)
    mask = (1 << bits) - 1
    # code j = (byte >> j b) & mask, one shift by a plain number per j (a CPU shifts uint8 by a scalar several times
    # faster than by a broadcast tensor of shifts); the top code needs no mask
    codes = torch.empty(*packed.shape, per, dtype=dtype, device=packed.device)  # [..., bytes, per]
    for j in range(per):
        shifted = packed >> (j * bits) if j else packed
        codes[..., j] = shifted & mask if j < per - 1 else shifted
    return codes.flatten(-2)[..., :n]


# --- quantize / dequantize over explicit reduce dims -----------------------------------------------------------------


def divisor(scale: Tensor) -> Tensor:
    """A scale to divide by, in float32: a zero scale (a group whose elements are all zero, or all equal to its
    zero point: every numerator is zero) replaced by 1."""
    return torch.where(scale > 0, scale.float(), 1.0)


def quantize_over(x: Tensor, bits: int | str, dims: tuple[int, ...], symmetric: bool = True,
                  scale_dtype: torch.dtype = torch.float16) -> QTensor:
    """Quantize ``x`` with one scale (and zero point) per slice over ``dims`` (the dims reduced)."""
    v = x.float()
    if bits == "fp8":
        absmax = v.abs().amax(dim=dims, keepdim=True)
        scale = round_up(absmax / FP8_MAX, scale_dtype)
        codes = (v / divisor(scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return QTensor(codes, scale, None, bits, x.shape[-1])
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = round_up(v.abs().amax(dim=dims, keepdim=True) / qmax, scale_dtype)
        q = torch.round(v / divisor(scale)).clamp(-qmax, qmax) + 2 ** (bits - 1)
        return QTensor(pack(q.to(torch.uint8), bits), scale, None, bits, x.shape[-1])
    levels = 2**bits - 1
    zero = round_down(v.amin(dim=dims, keepdim=True), scale_dtype)
    low = zero.float()
    scale = round_up((v.amax(dim=dims, keepdim=True) - low) / levels, scale_dtype)
    q = torch.round((v - low) / divisor(scale)).clamp(0, levels)
    return QTensor(pack(q.to(torch.uint8), bits), scale, zero, bits, x.shape[-1])


def dequantize_view(q: QTensor, dtype: torch.dtype = torch.float32, out: Tensor | None = None) -> Tensor:
    """The quantized view's values x' (see the module docstring), in ``dtype``; computed in float32 either way.
    ``out``: a tensor of the view's shape (and ``dtype``) to write into, instead of a new one.

    The codes are first written out as float32 (every code is a small integer: exact), then scaled in place: x' =
    (q - 2^(b-1)) s symmetric, q s fp8, z + q s asymmetric. The same bits as any other order of the same operations:
    q s is exact in float32 (an integer below 2^8 times a 16-bit scale has at most 8 + 11 significant bits), so the
    sum with z (or the cast to ``dtype``) is the only rounding. On a CPU this is the fast form: operations between
    tensors of one dtype run vectorized; a uint8 or int8 code tensor times a float scale runs 4-6x slower."""
    f32 = out if out is not None and out.dtype == torch.float32 else None
    v = _scaled(q, _codes_as_float(q, f32))
    if out is None:
        return v.to(dtype)
    if v is not out:
        out.copy_(v)  # one rounding, float32 -> dtype
    return out


def _codes_as_float(q: QTensor, out: Tensor | None) -> Tensor:
    """The codes as float32 in the view's shape (packed codes unpacked straight into it), in ``out`` if given."""
    shape = q.codes.shape[:-1] + (q.last,)
    w = torch.empty(shape, dtype=torch.float32, device=q.codes.device) if out is None else out
    per = 1 if q.bits in (8, "fp8") else 8 // q.bits
    if per == 1:
        return w.copy_(q.codes)
    if q.last % per:  # a padded last byte: unpack, then drop the padding
        return w.copy_(unpack(q.codes, q.bits, q.last))
    mask, lanes = (1 << q.bits) - 1, w.unflatten(-1, (-1, per))  # [..., bytes, per]: code j of each byte
    for j in range(per):  # code j = (byte >> j b) & mask; the top code needs no mask
        shifted = q.codes >> (j * q.bits) if j else q.codes
        lanes[..., j].copy_(shifted & mask if j < per - 1 else shifted)
    return w


def _scaled(q: QTensor, w: Tensor) -> Tensor:
    """x' from the float32 codes ``w``, in place."""
    if q.bits == "fp8":
        return w.mul_(q.scale.float())
    if q.zero is None:
        return w.sub_(float(2 ** (q.bits - 1))).mul_(q.scale.float())
    if q.scale.shape[-1] > 1:  # scales along the last dim (per channel): z + q s in one pass (addcmul is faster
        return torch.addcmul(q.zero.float(), w, q.scale.float(), out=w)  # there, slower with one scale a row)
    return w.mul_(q.scale.float()).add_(q.zero.float())


# --- named layouts on a [..., T, D] tensor ---------------------------------------------------------------------------


def layout_view(x: Tensor, axis: str, group: int | None = None) -> tuple[Tensor, tuple[int, ...]]:
    """The view of ``x`` [..., T, D] whose ``dims`` one scale spans, for a named axis."""
    if axis == "tensor":
        return x, tuple(range(x.dim()))
    if axis == "token":
        return x, (-1,)
    if axis == "channel":
        return x, (-2,)
    if axis == "group":
        if group is None or x.shape[-1] % group:
            raise ValueError(f"group={group} must divide the last dim ({x.shape[-1]})")
        return x.unflatten(-1, (x.shape[-1] // group, group)), (-1,)
    raise ValueError(f"axis must be one of {', '.join(AXES)}")


@dataclass
class Quantized:
    """A tensor quantized with a named layout: its codes, and the shape to give back."""

    q: QTensor
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        return self.q.nbytes

    def step(self) -> Tensor:
        """Each element's quantization step (its group's scale), in the original shape."""
        view_shape = self.q.codes.shape[:-1] + (self.q.last,)
        return self.q.step().expand(view_shape).reshape(self.shape)


def quantize(x: Tensor, bits: int | str, axis: str, group: int | None = None, symmetric: bool = True,
             scale_dtype: torch.dtype = torch.float16) -> Quantized:
    """Quantize ``x`` [..., T, D] with one scale per tensor, token, channel or group of ``group`` channels."""
    view, dims = layout_view(x, axis, group)
    return Quantized(quantize_over(view, bits, dims, symmetric, scale_dtype), x.shape)


def dequantize(qx: Quantized, dtype: torch.dtype = torch.float32) -> Tensor:
    return dequantize_view(qx.q, dtype).reshape(qx.shape)
