"""``knorm``: keep the keys of lowest L2 norm (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy
for KV Cache Compression").

When the cache holds more than B tokens, every layer keeps, per KV head, the B tokens of highest

    score[j] = - || k_j ||_2          (the key as cached: RoPE applied, as kvpress scores it)

(ties: the earlier position). It needs only the keys, so the model keeps its own attention implementation.
B = size, or floor(ratio * t) with t the tokens seen. compress=prefill (default: once, after the prompt) or
decode (after every forward).
"""

from __future__ import annotations

from torch import Tensor

from .protocol import ModelInfo, register
from .press import PressPolicy, Ratio, budget_params, check_budget


@register
class KNormPolicy(PressPolicy):
    name = "knorm"
    summary = ("the keys of lowest L2 norm, per KV head (keys only, any attention); ratio=R or size=S; "
               "compress=prefill (default) or decode")
    params = budget_params()
    model_needs = frozenset({"keys"})
    default_compress = "prefill"

    @staticmethod
    def check_options(values: dict) -> dict:
        return check_budget("knorm", values, KNormPolicy.default_compress)

    def __init__(self, info: ModelInfo, capacity: int | None = None, needs: frozenset[str] = frozenset(),
                 ratio: Ratio | None = None, size: int | None = None, compress: str | None = None):
        super().__init__(info, capacity, needs, ratio=ratio, size=size, compress=compress)

    def slot_scores(self, layer: int, n: int) -> Tensor:
        keys = self.model_cache.layers[layer].keys  # [B, H_kv, L, D]
        return -keys.float().norm(dim=-1)
