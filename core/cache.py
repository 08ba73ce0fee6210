"""KV-cache policies: the object a decoding loop is handed to keep (or drop, or compress) past keys and values.

The seam
--------
A policy owns a transformers ``Cache`` (``policy.model_cache``, a list of per-layer objects with
``update(keys, values, ...)``) and is the only code that touches it; decoding algorithms talk to the policy:

* ``model_cache``: what :func:`decodelab.core.model.forward` passes to the model (``cache=`` in transformers 5);
* ``length``: positions currently stored (per row of the batch, all rows equal);
* ``positions(n)``: position ids for the next ``n`` tokens, or ``None`` to let the model count from the cache
  length (the full cache). A policy that evicts tokens returns the positions its re-rotated keys assume;
* ``after_forward()``: called after every forward; eviction policies drop tokens here;
* ``crop(length)``: roll back to the first ``length`` positions (speculative decoding rejects a draft suffix);
* ``reorder(rows)``: gather batch rows (beam search keeps the parents of the surviving beams);
* ``nbytes()``: real bytes held by the stored tensors (scales and zero points included for quantized layers).

Policies planned on this seam: ``FullCache`` (here); a sliding window and attention sinks + window, whose kept
keys are re-rotated by RoPE to their new cache positions inside the layer (rotation by delta:
R(p - d) k = R(-d) R(p) k, so no recompute); quantized layers storing int codes plus scales with a
full-precision residual window (KIVI-style), dequantized in ``update``; and paged blocks, where a block table
maps each sequence's logical positions to fixed-size physical blocks shared between prefixes.
"""

from __future__ import annotations

import torch
from torch import Tensor


def tensor_nbytes(t: Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class FullCache:
    """Keeps every position of every layer (the model's own cache layout: sliding layers stay sliding)."""

    name = "full"

    def __init__(self, config):
        from transformers import DynamicCache

        self.model_cache = DynamicCache(config=config)

    @property
    def length(self) -> int:
        return int(self.model_cache.get_seq_length())

    def positions(self, n: int) -> Tensor | None:
        return None

    def after_forward(self) -> None:
        return None

    def crop(self, length: int) -> None:
        """Drop every position from ``length`` on (transformers 5: crop(-k) removes the last k)."""
        drop = self.length - length
        if drop < 0:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        if drop:
            self.model_cache.crop(-drop)

    def reorder(self, rows: Tensor) -> None:
        self.model_cache.reorder_cache(rows)

    def nbytes(self) -> int:
        total = 0
        for layer in self.model_cache.layers:
            total += tensor_nbytes(getattr(layer, "keys", None)) + tensor_nbytes(getattr(layer, "values", None))
        return total


POLICIES = {"full": FullCache}


def make_cache(policy: str, config) -> FullCache:
    return POLICIES[policy](config)
