"""Orthogonal rotations of a head's channels before quantization (``quant:rotate=hadamard|random``).

Why: a few key channels carry most of the magnitude (outlier channels), so one scale per token spends its grid on
them. An orthogonal R (R R^T = I) spreads every channel over all of them, and leaves attention unchanged:

* keys: q . k = (q R) . (k R), so storing Q(k R) and giving attention deq(Q(k R)) R^T is the same as rotating the
  query and the key together and attending over the rotated, quantized keys;
* values: attention's output sum_i a_i v_i is linear, so sum_i a_i deq(Q(v_i R)) R^T = (sum_i a_i deq(Q(v_i R))) R^T:
  rotating each stored value back equals rotating the output back after attention.

Decoding takes the right-hand sides (.attention): the query rotated, the stored tokens read as they are, the output
rotated back; a stream's exact window is stored rotated as well (x R, rotated once, when a token enters it).

With lossless codes deq(Q(x R)) R^T = x R R^T = x: exact in the unquantized limit (up to float32 rounding of the two
products). The rotation itself stores nothing per token: a Hadamard matrix is computed, a random one regenerated
from its seed.

* ``hadamard``: the Walsh-Hadamard matrix of Sylvester's construction, H_1 = [1], H_2n = [[H, H], [H, -H]], scaled
  by 1/sqrt(n) so that it is orthonormal (and symmetric: its own inverse). A head_dim that is not a power of two is
  rotated block by block: block-diagonal, with the largest power of two that divides head_dim as the block.
* ``random``: a Haar-random orthogonal matrix, the Q of a QR factorisation of a Gaussian matrix with the signs of R's
  diagonal moved into Q (without that fix Q is not uniformly distributed), from a fixed seed.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

KINDS = ("none", "hadamard", "random")
RANDOM_SEED = 0  # the seed of the ``random`` rotation (one matrix for every layer, keys and values alike)


def hadamard(n: int) -> Tensor:
    """The n x n orthonormal Walsh-Hadamard matrix (n a power of two), float32."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard matrix of Sylvester's construction needs a power of two, not {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def largest_power_of_two_dividing(n: int) -> int:
    return n & -n


def block_hadamard(dim: int) -> Tensor:
    """dim x dim: Hadamard blocks of the largest power of two dividing ``dim`` on the diagonal."""
    block = largest_power_of_two_dividing(dim)
    return torch.block_diag(*[hadamard(block)] * (dim // block))


def random_orthogonal(dim: int, seed: int = RANDOM_SEED) -> Tensor:
    """A Haar-random dim x dim orthogonal matrix (float32) from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)  # column j times sign(r_jj): Haar-distributed
    return q.float()


class Rotation:
    """x -> x R before quantization, y -> y R^T after dequantization, over the last dim (float32 arithmetic)."""

    def __init__(self, kind: str, matrix: Tensor):
        self.kind, self.matrix = kind, matrix
        self._on: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def _m(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """(R, R^T contiguous) on ``device``."""
        if device not in self._on:
            m = self.matrix.to(device)
            self._on[device] = (m, m.T.contiguous())
        return self._on[device]

    def forward(self, x: Tensor) -> Tensor:
        """x R in float32 (what is quantized)."""
        return as_float32(x) @ self._m(x.device)[0]

    def back(self, y: Tensor) -> Tensor:
        """y R^T in float32 (the stored values in the model's channels)."""
        return as_float32(y) @ self._m(y.device)[1]

    def describe(self) -> str:
        if self.kind == "hadamard":
            block = largest_power_of_two_dividing(self.matrix.shape[0])
            return "hadamard" if block == self.matrix.shape[0] else f"hadamard (blocks of {block})"
        return f"random orthogonal (seed {RANDOM_SEED})"


def as_float32(x: Tensor) -> Tensor:
    """x in float32 (x itself when it is: no operation, where a decode step counts them)."""
    return x if x.dtype == torch.float32 else x.float()


def as_dtype(x: Tensor, dtype: torch.dtype) -> Tensor:
    return x if x.dtype == dtype else x.to(dtype)


def make_rotation(kind: str, dim: int) -> Rotation | None:
    """The rotation named ``kind`` for vectors of ``dim`` channels (None for ``none``)."""
    if kind == "none":
        return None
    if kind == "hadamard":
        return Rotation(kind, block_hadamard(dim))
    if kind == "random":
        return Rotation(kind, random_orthogonal(dim))
    raise ValueError(f"rotate must be one of {', '.join(KINDS)}")
