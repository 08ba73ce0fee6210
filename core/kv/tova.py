"""``tova``: evict the tokens the last query attends to least (Oren et al. 2024, TOVA).

After a forward, when the cache holds more than B tokens, every layer keeps the B tokens of highest

    score[j] = mean over ALL query heads h of the layer of A_h[q, j]

where q is the forward's last query (the token just fed; for the prompt, its last token) and j runs over the kept
tokens and the forward's own (the last token's attention to itself included, as in the paper; ties: the earlier
position). One score per layer, so all KV heads of a layer keep the same positions (stored per head all the same).
B = size, or floor(ratio * t) with t the tokens seen. compress=decode (default, the paper: the cache stays at B
while decoding) or prefill (once, after the prompt).
"""

from __future__ import annotations

from torch import Tensor

from .protocol import ModelInfo, register
from .press import PressPolicy, Ratio, budget_params, check_budget


@register
class TOVAPolicy(PressPolicy):
    name = "tova"
    summary = ("the tokens the last query attends to most (mean over all heads, one choice per layer); size=S or "
               "ratio=R; compress=decode (default) or prefill")
    params = budget_params()
    default_compress = "decode"

    @staticmethod
    def check_options(values: dict) -> dict:
        return check_budget("tova", values, TOVAPolicy.default_compress)

    def __init__(self, info: ModelInfo, capacity: int | None = None, needs: frozenset[str] = frozenset(),
                 ratio: Ratio | None = None, size: int | None = None, compress: str | None = None):
        super().__init__(info, capacity, needs, ratio=ratio, size=size, compress=compress)

    def slot_scores(self, layer: int, n: int) -> Tensor:
        last = self._attentions[layer][:, :, -1, :].float()  # [B, H, L + n]
        score = last.mean(dim=1, keepdim=True)  # [B, 1, L + n]
        return score.expand(-1, self.info.kv_heads, -1)
