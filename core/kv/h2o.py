"""``h2o``: heavy hitters plus the most recent tokens (Zhang et al. 2023, H2O).

Every cached token j carries, per KV head, its accumulated attention

    acc[j] = sum over every query i that has attended to j (i >= j, in every forward since j was fed)
             of  mean over the query heads h of the KV group of A_h[i, j]

(per query the group mean first, then the sum over queries; A_h the probabilities of that forward, over the kept
tokens). When the cache holds more than B tokens it keeps the R most recent (by position) and the B - R others of
highest acc (ties: the earlier position); an evicted token's acc is dropped. B = size, or floor(ratio * t) with t
the tokens seen; R = recent, default B // 2 (the paper's even split), and R >= B keeps the last B tokens.

compress=decode (default, the paper): after the prompt and after every later forward, so every forward is scored
(eager attention throughout). compress=prefill: once, after the prompt.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .protocol import ModelInfo, non_negative_int, register
from .press import PressPolicy, Ratio, budget_params, check_budget, group_mean


@register
class H2OPolicy(PressPolicy):
    name = "h2o"
    summary = ("heavy hitters (accumulated attention) plus the recent=R last tokens, per KV head; ratio=R or size=S; "
               "compress=decode (default: every forward) or prefill")
    params = {**budget_params(), "recent": non_negative_int}
    default_compress = "decode"

    @staticmethod
    def check_options(values: dict) -> dict:
        values = check_budget("h2o", values, H2OPolicy.default_compress)
        if "size" in values and values.get("recent", 0) > values["size"]:
            raise ValueError(f"recent={values['recent']} is more than size={values['size']}")
        return values

    def __init__(self, info: ModelInfo, capacity: int | None = None, needs: frozenset[str] = frozenset(),
                 ratio: Ratio | None = None, size: int | None = None, compress: str | None = None,
                 recent: int | None = None):
        self.recent = recent
        super().__init__(info, capacity, needs, ratio=ratio, size=size, compress=compress)
        self.acc: list[Tensor | None] = [None] * len(self.pos)  # [B, H_kv, L] float32

    def spec_options(self) -> dict:
        return {**super().spec_options(), "recent": self.recent}

    def recent_for(self, layer: int) -> int:
        budget = self.budgets[layer]
        return min(budget // 2 if self.recent is None else self.recent, budget)

    def wants_attentions(self, n: int) -> bool:
        return self.seen == 0 or self.compress == "decode"  # the scores accumulate over every forward

    def per_slot(self) -> dict:
        return {"acc": self.acc}

    def on_appended(self, layer: int, n: int) -> None:
        """acc += this forward's attention (old slots), and the new tokens start with theirs."""
        if self._attentions is None:  # compress=prefill after the prompt: nothing is scored any more
            self.acc[layer] = None
            return
        attn = self._attentions[layer].float()  # [B, H, n, L + n]
        contrib = group_mean(attn, self.info.kv_heads).sum(dim=-2)  # [B, H_kv, L + n]
        old = self.acc[layer]
        held = 0 if old is None else old.shape[-1]
        self.acc[layer] = contrib if old is None else torch.cat([old + contrib[..., :held], contrib[..., held:]], -1)

    def slot_scores(self, layer: int, n: int) -> Tensor:
        score = self.acc[layer].clone()
        recent = self.recent_for(layer)
        if recent:
            score[..., -recent:] = float("inf")  # slots are in position order: the last ones are the most recent
        return score
