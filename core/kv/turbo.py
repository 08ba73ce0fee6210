"""``turbo``: TurboQuant-style codes (Zandieh et al. 2025, "TurboQuant: Online Vector Quantization with Near-optimal
Distortion Rate", arXiv 2504.19874): a random rotation, then Lloyd-Max scalar codes per coordinate, and for the keys a
1-bit QJL code of the residual so that inner products with a query are unbiased.

``turbo:bits=B[,keys=prod|mse][,residual=R][,residual_dtype=model|16]``, B in 2, 3, 4 (bits per coordinate).

One token's head vector x (D channels) is coded alone:

* norm n = ||x||_2 (stored in 16 bits) and direction u = x / n;
* rotation y = u P with P a random orthogonal matrix (fixed seed): every coordinate of y is then distributed as one
  coordinate of a uniformly random unit vector in R^D, density f(t) proportional to (1 - t^2)^((D - 3) / 2) on
  [-1, 1] (close to N(0, 1/D)), whatever x was;
* MSE code: each y_i replaced by the nearest of 2^b centroids c_k, the Lloyd-Max quantizer of f (the centroids
  that minimise E[(t - c(t))^2]: each centroid the mean of f over its cell, each boundary halfway between centroids),
  computed once per (D, b) by Lloyd's iteration on a fine grid;
* ``prod`` (the keys' default): b - 1 bits of MSE code, then the residual r = y - y_mse coded by QJL: s = sign(S r)
  with S a D x D Gaussian matrix (fixed seed), and ||r|| stored in 16 bits. For any vector w,
  E[<S w, sign(S r)>] = D sqrt(2/pi) <w, r> / ||r|| (each row s of S: E[(s.w) sign(s.r)] = sqrt(2/pi) (w.r)/||r||),
  so r_hat = ||r|| sqrt(pi/2) / D * S^T s gives E[<w, r_hat>] = <w, r>: an unbiased inner product;
* decoding: x_hat = n (y_mse + r_hat) P^T, so q . k_hat is the unbiased estimate of q . k. Attention takes it
  without forming x_hat (.attention): q' = [q P, c S (q P)] against k' = [n y_mse, n ||r|| s] (c = sqrt(pi/2) / D)
  gives q . k_hat in one call, values read as n y_mse with the output rotated back by P^T.

The MSE code alone shrinks inner products (E[<w, y_mse>] is below <w, y>: the centroids are conditional means),
which is the bias on attention scores this layout exists to remove; ``keys=mse`` keeps the full b bits for the
MSE code instead (lower variance, biased). Values always use the MSE code (attention needs them reconstructed, not
their inner products). Stored per token and KV head: b bit-planes of ceil(D / 8) bytes each (b - 1 MSE planes and the
sign plane for ``prod``), the norm, and for ``prod`` the residual norm: real bytes.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor

from .protocol import ModelInfo, choice, non_negative_int, register
from .quant import RESIDUAL_DTYPES, QuantPolicy, scale_dtype_for
from .quantize import QTensor, pack, unpack
from .rotation import as_dtype, as_float32, random_orthogonal

TURBO_BITS = (2, 3, 4)
KEY_CODES = ("prod", "mse")
ROTATION_SEED = 0  # P
QJL_SEED = 1  # S
GRID = 200_001  # points of the [-1, 1] grid Lloyd's iteration runs on


@lru_cache(maxsize=None)
def lloyd_max(dim: int, bits: int, iterations: int = 300) -> Tensor:
    """The 2^bits Lloyd-Max centroids (ascending, float64) of one coordinate of a uniformly random unit vector in
    R^dim: density proportional to (1 - t^2)^((dim - 3) / 2) on [-1, 1]."""
    t = torch.linspace(-1, 1, GRID, dtype=torch.float64)
    w = (1 - t * t).clamp_min(0) ** ((dim - 3) / 2)
    w = w / w.sum()
    levels = 2**bits
    # start at the quantiles of the cell midpoints: every cell begins non-empty
    cdf = w.cumsum(0)
    c = t[torch.searchsorted(cdf, (torch.arange(levels, dtype=torch.float64) + 0.5) / levels).clamp(max=GRID - 1)]
    for _ in range(iterations):
        edges = (c[1:] + c[:-1]) / 2
        cell = torch.bucketize(t, edges)
        mass = torch.zeros(levels, dtype=torch.float64).index_add_(0, cell, w)
        first = torch.zeros(levels, dtype=torch.float64).index_add_(0, cell, w * t)
        c = torch.where(mass > 0, first / mass.clamp_min(1e-300), c)
        c = (c - c.flip(0)) / 2  # f is even, so is its quantizer: no drift from the grid's cell edges
    return c


@lru_cache(maxsize=None)
def qjl_matrix(dim: int, seed: int = 0) -> Tensor:
    """S: dim x dim, iid N(0, 1), float32, from a fixed seed."""
    g = torch.Generator().manual_seed(QJL_SEED + 2 * seed)
    return torch.randn(dim, dim, generator=g, dtype=torch.float64).float()


@lru_cache(maxsize=None)
def turbo_rotation(dim: int, seed: int = 0) -> Tensor:
    return random_orthogonal(dim, ROTATION_SEED + 2 * seed)


def to_planes(codes: Tensor, bits: int) -> Tensor:
    """uint8 codes < 2^bits [..., D] -> bit-planes packed 8 to a byte: [..., bits * ceil(D / 8)] (plane j holds bit
    j of every code)."""
    return torch.cat([pack((codes >> j) & 1, 1) for j in range(bits)], dim=-1)


def from_planes(planes: Tensor, bits: int, dim: int) -> Tensor:
    """Inverse of :func:`to_planes`: uint8 codes [..., D]."""
    width = planes.shape[-1] // bits
    out = torch.zeros(*planes.shape[:-1], dim, dtype=torch.uint8, device=planes.device)
    for j in range(bits):
        out |= unpack(planes[..., j * width : (j + 1) * width], 1, dim) << j
    return out


def nibble_table(centroids: Tensor, bits: int) -> Tensor:
    """[2^(4 bits), 4] float32: row i holds the centroids of the four coordinates whose bits are the nibbles of i
    (plane j's nibble in bits [4 j, 4 j + 4) of i; coordinate k of the nibble is its bit k, as :func:`pack` puts
    coordinate 8 m + k in bit k of byte m): code_k = sum_j bit(i, 4 j + k) 2^j."""
    index = torch.arange(2 ** (4 * bits))
    codes = torch.zeros(index.shape[0], 4, dtype=torch.long)
    for j in range(bits):
        for k in range(4):
            codes[:, k] |= ((index >> (4 * j + k)) & 1) << j
    return centroids.float()[codes]


def byte_table(centroids: Tensor, bits: int) -> Tensor:
    """[2^(8 bits), 8] float32: row i holds the centroids of the eight coordinates of one byte position whose
    planes' bytes are the bytes of i (plane j's byte in bits [8 j, 8 j + 8) of i; coordinate k is bit k of each, as
    :func:`pack` puts coordinate 8 m + k in bit k of byte m): code_k = sum_j bit(i, 8 j + k) 2^j. One row gather
    per eight coordinates (256 rows for one plane, 65,536 for two)."""
    index = torch.arange(2 ** (8 * bits))
    codes = torch.zeros(index.shape[0], 8, dtype=torch.long)
    for j in range(bits):
        for k in range(8):
            codes[:, k] |= ((index >> (8 * j + k)) & 1) << j
    return centroids.float()[codes]


def byte_index(planes: Tensor, bits: int, width: int) -> Tensor:
    """Bit-planes [..., bits * width] (bits 1 or 2) -> int32 indices into :func:`byte_table` [..., width]: plane
    j's byte in bits [8 j, 8 j + 8)."""
    index = planes[..., :width].to(torch.int32)
    if bits == 2:
        index |= planes[..., width : 2 * width].to(torch.int32) << 8
    return index


BYTE_TABLE_BITS = (1,)  # MSE codes read a byte position at a time (two planes: a nibble at a time, the 65,536-row
# byte table measured slower inside a forward, where it falls out of the cache between decodes)


def sign_table() -> Tensor:
    """[256, 8] float32: row b holds the signs (+1 for a set bit, -1 else) of the eight coordinates of byte b: the
    one-plane :func:`byte_table` of the two "centroids" -1 (bit 0) and +1 (bit 1)."""
    return byte_table(torch.tensor([-1.0, 1.0]), 1)


def nibble_index(planes: Tensor, bits: int, width: int) -> Tensor:
    """Bit-planes [..., bits * width] -> int32 indices into :func:`nibble_table` [..., width, 2] (each byte's low
    and high nibble of every plane, side by side): operations on the packed bytes only (on the bytes themselves
    while the index fits in 8 bits: one or two planes). The planes are first laid out one after another, each
    contiguous (one copy), so that every operation runs over contiguous memory rather than a strided slice."""
    p = planes.unflatten(-1, (bits, width)).movedim(-2, 0).contiguous()  # [bits, ..., width]: p[j] is plane j
    if bits <= 2:
        if bits == 1:
            low, high = p[0] & 15, p[0] >> 4
        else:
            low = (p[0] & 15) | (p[1] << 4)  # the second plane's low nibble into bits 4-7 (uint8 drops the rest)
            high = (p[0] >> 4) | (p[1] & 240)  # the second plane's high nibble already in bits 4-7
        return torch.stack([low, high], -1).to(torch.int32)
    p = p.to(torch.int32)
    low, high = p[0] & 15, p[0] >> 4
    for j in range(1, bits):
        low |= (p[j] & 15) << (4 * j)
        high |= (p[j] >> 4) << (4 * j)
    return torch.stack([low, high], -1)


class TurboLayout:
    """A stream's TurboQuant code: one token at a time (``block`` 1). ``QTensor`` fields: ``codes`` the bit-planes
    [B, H, n, planes * ceil(D / 8)], ``scale`` the norms [B, H, n, 1], ``zero`` the residual norms (``prod``) or None,
    ``bits`` this layout's name, ``last`` D."""

    axis, group, symmetric, block = "turbo", 0, True, 1

    def __init__(self, bits: int, prod: bool, scale_dtype: torch.dtype, head_dim: int, seed: int = 0):
        """``seed``: which P and S (the policy uses 0; the unbiasedness is over their draw, which tests vary)."""
        self.bits, self.prod, self.scale_dtype, self.dim = bits, prod, scale_dtype, head_dim
        self.mse_bits = bits - 1 if prod else bits
        self.centroids = lloyd_max(head_dim, self.mse_bits).float()
        self.edges = (self.centroids[1:] + self.centroids[:-1]) / 2
        self.p = turbo_rotation(head_dim, seed)
        self.s = qjl_matrix(head_dim, seed) if prod else None
        self._on: dict = {}

    def _dev(self, device) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        if device not in self._on:
            self._on[device] = tuple(None if t is None else t.to(device)
                                     for t in (self.centroids, self.edges, self.p, self.s))
        return self._on[device]

    def quantize(self, x: Tensor) -> QTensor:
        return self.code(self.rotate_in(x))

    def rotate_in(self, x: Tensor) -> Tensor:
        """What a stream stores, its exact window included: x P (float32 product rounded into x's dtype)."""
        return as_dtype(as_float32(x) @ self._dev(x.device)[2], x.dtype)

    def rotate_out(self, x: Tensor, dtype: torch.dtype) -> Tensor:
        """Stored (rotated) tokens back in the model's channels: x P^T in ``dtype``."""
        return as_dtype(as_float32(x) @ self._transposed(x.device), dtype)

    def code(self, x: Tensor) -> QTensor:
        """Code tokens already rotated (:meth:`rotate_in`): the norm ||x P|| = ||x||, the direction x P / ||x||."""
        centroids, edges, p, s = self._dev(x.device)
        v = x.float()
        norm = v.norm(dim=-1, keepdim=True)
        y = v / norm.clamp_min(1e-30)  # unit direction, rotated
        codes = torch.bucketize(y, edges)  # nearest centroid (edges halfway between)
        bits = (codes.unsqueeze(-2) >> self._plane_shifts(x.device)) & 1  # [..., mse_bits, D]: bit j of each code
        residual_norm = None
        if self.prod:
            r = y - centroids[codes]
            bits = torch.cat([bits, (r @ s.T >= 0).unsqueeze(-2)], -2)  # the last plane: sign(S r)
            residual_norm = r.norm(dim=-1, keepdim=True).to(self.scale_dtype)
        planes = pack(bits.to(torch.uint8), 1).flatten(-2)  # every plane packed in one pass: as :func:`to_planes`
        return QTensor(planes, norm.to(self.scale_dtype), residual_norm, self.name, self.dim)

    def _plane_shifts(self, device) -> Tensor:
        """[mse_bits, 1]: 0, 1, ..., mse_bits - 1 (code >> j & 1 is plane j's bit)."""
        key = ("shifts", device)
        if key not in self._on:
            self._on[key] = torch.arange(self.mse_bits, device=device).unsqueeze(-1)
        return self._on[key]

    def dequantize(self, q: QTensor, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
        centroids, _, p, s = self._dev(q.codes.device)
        width = -(-self.dim // 8)
        y = centroids[from_planes(q.codes[..., : self.mse_bits * width], self.mse_bits, self.dim).long()]
        if self.prod:
            signs = unpack(q.codes[..., self.mse_bits * width :], 1, self.dim, torch.float32) * 2 - 1
            y = y + q.zero.float() * (math.sqrt(math.pi / 2) / self.dim) * (signs @ s)  # ||r|| sqrt(pi/2)/D S^T s
        x = q.scale.float() * (y @ p.T)
        if out is None:
            return x.to(dtype)
        return out.copy_(x)

    # the attention space (see .attention): the stored tokens read as n y (y the rotated direction's centroids),
    # never rotated back; for ``prod`` keys widened by the QJL term, so that one attention call gives
    # <q, k_mse> + the residual's estimate

    rotates = True

    def space_width(self, head_dim: int) -> int:
        return 2 * head_dim if self.prod else head_dim

    @property
    def qjl_scale(self) -> float:
        return math.sqrt(math.pi / 2) / self.dim  # r_hat = ||r|| sqrt(pi/2) / D * S^T s

    def dequantize_in_space(self, q: QTensor, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
        """n y_mse, and for ``prod`` keys [n y_mse, n ||r|| s] (s the signs of S r): q . k_hat = (q P) . (n y_mse)
        + (qjl_scale S (q P)) . (n ||r|| s), the terms of :meth:`dequantize`'s n (y_mse + r_hat) P^T. The centroids
        are read eight coordinates at a time from :func:`byte_table` for one MSE plane (its byte as the index),
        else four at a time from :func:`nibble_table` (the planes' nibbles as one index), the signs eight
        at a time from :func:`sign_table`: row gathers, no per-coordinate shift or lookup."""
        width = -(-self.dim // 8)
        centroids, signs = self._tables(q.codes.device)
        shape = (*q.codes.shape[:-1], self.space_width(self.dim))
        if out is None:
            out = torch.empty(shape, dtype=dtype, device=q.codes.device)
        norm = q.scale.float()
        planes = q.codes[..., : self.mse_bits * width]
        if self.mse_bits in BYTE_TABLE_BITS:
            y = F.embedding(byte_index(planes, self.mse_bits, width), centroids).flatten(-2)
        else:
            y = F.embedding(nibble_index(planes, self.mse_bits, width), centroids).flatten(-3)
        torch.mul(y[..., : self.dim], norm, out=out[..., : self.dim])
        if self.prod:
            s = F.embedding(q.codes[..., self.mse_bits * width :].to(torch.int32), signs).flatten(-2)[..., : self.dim]
            torch.mul(s, norm * q.zero.float(), out=out[..., self.dim :])
        return out

    def _tables(self, device) -> tuple[Tensor, Tensor]:
        key = ("tables", device)
        if key not in self._on:
            table = byte_table if self.mse_bits in BYTE_TABLE_BITS else nibble_table
            self._on[key] = (table(self.centroids, self.mse_bits).to(device), sign_table().to(device))
        return self._on[key]

    def _query_matrix(self, device) -> Tensor:
        """[D, W]: q -> [q P, qjl_scale (q P) S^T] for ``prod`` keys (one product), P otherwise."""
        key = ("query", device)
        if key not in self._on:
            p = self.p
            if self.prod:
                p = torch.cat([p, (p.double() @ self.s.double().T * self.qjl_scale).float()], 1)
            self._on[key] = p.to(device)
        return self._on[key]

    def widen(self, x: Tensor) -> Tensor:
        """Stored exact tokens (x P) as attention reads them: [x P, 0] for ``prod`` keys (no residual)."""
        return torch.cat([x, torch.zeros_like(x)], -1) if self.prod else x

    def query_to_space(self, q: Tensor) -> Tensor:
        """q P, and for ``prod`` keys [q P, qjl_scale S (q P)] = q [P, qjl_scale P S^T]."""
        return as_dtype(as_float32(q) @ self._query_matrix(q.device), q.dtype)

    def output_from_space(self, o: Tensor) -> Tensor:
        """o P^T: attention's output over values stored as v P, back in the model's channels."""
        return as_dtype(as_float32(o) @ self._transposed(o.device), o.dtype)

    def _transposed(self, device) -> Tensor:
        key = ("p.T", device)
        if key not in self._on:
            self._on[key] = self.p.T.contiguous().to(device)
        return self._on[key]

    @property
    def rotation_kind(self) -> str:  # what tells two layouts apart where streams are worked on together
        return self.name

    def tokens(self, q: QTensor) -> int:
        return q.codes.shape[2]

    @property
    def name(self) -> str:
        return f"turbo{self.bits}" + ("-prod" if self.prod else "")

    def nbytes_for(self, tokens: int, rows: int, heads: int, head_dim: int) -> int:
        planes = self.mse_bits + (1 if self.prod else 0)
        norm_bytes = torch.empty(0, dtype=self.scale_dtype).element_size() * (2 if self.prod else 1)
        return rows * heads * tokens * (planes * -(-head_dim // 8) + norm_bytes)

    def describe(self) -> str:
        if self.prod:
            return (f"turbo {self.bits}-bit per token: {self.mse_bits}-bit Lloyd-Max codes after a random rotation "
                    "+ 1-bit QJL residual (unbiased inner products)")
        return f"turbo {self.bits}-bit per token: Lloyd-Max codes after a random rotation"


def inner_product_error(x: Tensor, probes: Tensor, layout: TurboLayout) -> tuple[Tensor, Tensor]:
    """Per head: the mean signed and the root-mean-square error of <probe, x_hat> - <probe, x> over every pair of a
    probe and a token, divided by sqrt(D) as attention scales it. x [B, H, n, D], probes [B, H, m, D]."""
    x_hat = layout.dequantize(layout.quantize(x), torch.float32)
    err = (probes.float() @ (x_hat - x.float()).transpose(-1, -2)) / math.sqrt(x.shape[-1])  # [B, H, m, n]
    return err.mean(dim=(0, 2, 3)), err.pow(2).mean(dim=(0, 2, 3)).sqrt()


def parse_turbo_bits(key: str, text: str) -> int:
    if text not in ("2", "3", "4"):
        raise ValueError(f"{key} must be 2, 3 or 4 (bits per coordinate)")
    return int(text)


@register
class TurboPolicy(QuantPolicy):
    """Keys and values in TurboQuant-style codes (module docstring); the exact window, rows, reorder and rollback
    as ``quant`` (one token a code: rollback is exact with ``residual=0``)."""

    name = "turbo"
    summary = ("TurboQuant-style codes: random rotation, Lloyd-Max codes, 1-bit QJL residual for the keys "
               "(unbiased attention scores); bits=2|3|4")
    params = {"bits": parse_turbo_bits, "keys": choice(*KEY_CODES), "residual": non_negative_int,
              "residual_dtype": choice(*RESIDUAL_DTYPES)}
    engine_defaults = {}

    @staticmethod
    def check_options(values: dict) -> dict:
        """Defaults named in the spec: bits=3, keys=prod, residual=0."""
        return {"bits": 3, "keys": "prod", "residual": 0, **values}

    @staticmethod
    def capabilities_for(options: dict) -> frozenset[str]:
        return frozenset({"reorder", "rows"} | ({"truncate"} if options.get("residual", 0) == 0 else set()))

    def __init__(self, info: ModelInfo, capacity: int | None = None, needs: frozenset[str] = frozenset(),
                 bits: int = 3, keys: str = "prod", residual: int = 0, residual_dtype: str = "model"):
        self.turbo_bits, self.key_code = bits, keys
        super().__init__(info, capacity, needs, bits=bits, axis="token", residual=residual,
                         residual_dtype=residual_dtype)

    def _layout(self, which: str, scale_dtype: torch.dtype) -> TurboLayout:
        prod = which == "key" and self.key_code == "prod"
        return TurboLayout(self.turbo_bits, prod, scale_dtype_for(self.info.dtype), self.info.head_dim)
