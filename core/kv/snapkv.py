"""``snapkv``: keep the prompt tokens the last prompt queries attend to (Li et al. 2024, SnapKV).

After the prompt (the first forward, T tokens) each layer keeps, per KV head, the observation window (the last w
prompt tokens, always kept) and the B - w prefix tokens of highest score, where for query head h

    s_h[j] = sum over window queries i in [T - w, T) of A_h[i, j]        for every prefix key j < T - w
    p_h    = pool(s_h)                  max (or avg) over the keys j - kernel//2 .. j + kernel//2, stride 1
    score  = mean of p_h over the query heads h of the KV group

(A_h the layer's attention probabilities in the prompt forward, softmax over all T keys under the causal mask; the
pool pads with -inf for max and with zeros counted in the mean for avg, as torch's pool1d does). B = size, or
floor(ratio * T), at least w; a prompt of at most B tokens is kept whole. Compression happens once, after the
prompt (the paper's setting); later tokens are appended.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from .protocol import ModelInfo, choice, positive_int, register
from .press import PressPolicy, Ratio, budget_params, check_budget, group_mean, odd_int

POOLS = ("max", "avg")


def pooled(scores: Tensor, kernel: int, pool: str) -> Tensor:
    """[B, H, N] -> [B, H, N]: pooling along the keys, stride 1, centred (kernel odd)."""
    pad = kernel // 2
    if pool == "max":
        return F.max_pool1d(scores, kernel_size=kernel, stride=1, padding=pad)
    return F.avg_pool1d(scores, kernel_size=kernel, stride=1, padding=pad)


class WindowScored(PressPolicy):
    """SnapKV's selection (shared with pyramidkv): observation-window attention over the prefix, pooled."""

    phases = ("prefill",)
    model_needs = frozenset({"attentions"})

    def __init__(self, info: ModelInfo, capacity: int | None = None, needs: frozenset[str] = frozenset(),
                 ratio: Ratio | None = None, size: int | None = None, window: int = 32, kernel: int = 5,
                 pool: str = "max"):
        self.window, self.kernel, self.pool = window, kernel, pool
        super().__init__(info, capacity, needs, ratio=ratio, size=size)

    def spec_options(self) -> dict:
        return {**super().spec_options(), "window": self.window, "kernel": self.kernel, "pool": self.pool}

    def first_budget(self, tokens: int) -> int:
        return min(max(super().first_budget(tokens), self.window), tokens)

    def slot_scores(self, layer: int, n: int) -> Tensor:
        """Prefix scores as above; the window's slots get +inf (always kept)."""
        attn = self._attentions[layer]  # [B, H, T, T]: the prompt forward, slots = positions
        t, w = attn.shape[-1], self.window
        summed = attn[:, :, t - w :, : t - w].float().sum(dim=-2)  # [B, H, T - w]
        score = group_mean(pooled(summed, self.kernel, self.pool), self.info.kv_heads)
        return F.pad(score, (0, w), value=float("inf"))


@register
class SnapKVPolicy(WindowScored):
    name = "snapkv"
    summary = ("after the prompt, per KV head: the last window=W tokens plus the prompt tokens they attend to most "
               "(pooled over kernel=K keys, pool=max|avg); ratio=R or size=S")
    params = {**budget_params(("prefill",)), "window": positive_int, "kernel": odd_int, "pool": choice(*POOLS)}

    @staticmethod
    def check_options(values: dict) -> dict:
        values = {"window": 32, "kernel": 5, "pool": "max", **check_budget("snapkv", values, None)}
        if "size" in values and values["size"] < values["window"]:
            raise ValueError(f"size={values['size']} is less than window={values['window']} (the window is kept)")
        return values
