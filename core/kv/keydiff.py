"""``keydiff``: keep the keys least like the average key (Park et al. 2025, "KeyDiff: Key Similarity-Based KV Cache
Eviction for Long-Context LLM Inference in Resource-Constrained Environments", arXiv 2504.15364).

Query-free: it reads only the cached keys, so it needs no attention weights (the model keeps its own attention
implementation, fused kernels included) and its choice does not depend on which question comes next, which is
what a context compressed once and asked several questions needs. When the cache holds more than B tokens, every
layer keeps, per KV head, the B tokens of highest

    anchor = mean_i ( k_i / ||k_i||_2 )                 over the tokens the head holds (the new ones included)
    score[j] = - cos(k_j, anchor) = - (k_j . anchor) / (||k_j||_2 ||anchor||_2)

(keys as cached: RoPE applied; ties: the earlier position). A key pointing away from the average direction is
distinctive and kept; keys that all look alike are the ones evicted. B = size, or floor(ratio * t) with t the
tokens seen. compress=prefill (default: once, after the prompt) or decode (after every forward, the anchor
recomputed over what is held then).
"""

from __future__ import annotations

from torch import Tensor

from .protocol import ModelInfo, register
from .press import PressPolicy, Ratio, budget_params, check_budget

TINY = 1e-12  # a zero key has no direction: its cosine is taken as 0


def keydiff_scores(keys: Tensor) -> Tensor:
    """[B, H_kv, L, D] -> [B, H_kv, L]: minus the cosine similarity of each key to the mean unit key."""
    k = keys.float()
    unit = k / k.norm(dim=-1, keepdim=True).clamp_min(TINY)
    anchor = unit.mean(dim=-2, keepdim=True)  # [B, H_kv, 1, D]
    cos = (k * anchor).sum(-1) / (k.norm(dim=-1) * anchor.norm(dim=-1)).clamp_min(TINY)
    return -cos


@register
class KeyDiffPolicy(PressPolicy):
    name = "keydiff"
    summary = ("the keys least similar to the mean key, per KV head (keys only, query-free, any attention); "
               "ratio=R or size=S; compress=prefill (default) or decode")
    params = budget_params()
    model_needs = frozenset({"keys"})
    default_compress = "prefill"

    @staticmethod
    def check_options(values: dict) -> dict:
        return check_budget("keydiff", values, KeyDiffPolicy.default_compress)

    def __init__(self, info: ModelInfo, capacity: int | None = None, needs: frozenset[str] = frozenset(),
                 ratio: Ratio | None = None, size: int | None = None, compress: str | None = None):
        super().__init__(info, capacity, needs, ratio=ratio, size=size, compress=compress)

    def slot_scores(self, layer: int, n: int) -> Tensor:
        return keydiff_scores(self.model_cache.layers[layer].keys)
