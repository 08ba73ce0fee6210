"""The verify-width audit: speculative verification scores a round's drafts with ONE target forward over k + 1 query
rows, where plain decoding runs one row per forward; on a GPU those are different kernels (split-K, tile shapes,
batch-invariance), so the logits of the same token after the same prefix can differ (vllm#54506: acceptance fell
until that was fixed). Over a text, the target's logits for every position are computed both ways, each through
the KV cache as the real loops do:

* plain: the prompt prefilled (all but its last token), then one token per forward;
* verify: the same prefill, then blocks of ``width`` = k + 1 tokens per forward (the rows a round would score);

and compared per token: the largest |logit difference|, whether the argmax flips, and the plain top-1 / top-2
margin there (a flip can only happen where the margin is below the drift). On a CPU the two are often bit-identical:
a drift of 0 is a measurement, not a default.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from ...engine.runtime import Runtime
from ...engine.tokens import TokenBuffer


@dataclass
class WidthAudit:
    width: int  # rows per verify forward (gamma + 1)
    tokens: int
    device: str
    max_drift: float  # the largest |logit difference| over every position and token
    mean_drift: float  # mean over positions of the per-position largest difference
    identical: int  # positions whose logits are bit-identical both ways
    flips: int  # positions whose argmax differs
    drift: list[float] = field(default_factory=list)  # per position: max |plain - verify|
    margin: list[float] = field(default_factory=list)  # per position: plain top-1 minus top-2 logit
    flip_at: list[int] = field(default_factory=list)  # positions (into the text) where the argmax flips
    row: list[int] = field(default_factory=list)  # per position: its row within the verify block (0 .. width-1)

    def to_dict(self) -> dict:
        return asdict(self)


@torch.inference_mode()
def plain_rows(model, ids: list[int], prompt_len: int, cache=None) -> torch.Tensor:
    device = next(model.parameters()).device
    seq = TokenBuffer(ids, len(ids), device)
    rt = Runtime.create(model, cache, capacity=len(ids))
    rt.prefill(seq.ids[:, :prompt_len], hold_last=True)
    return torch.stack([rt.feed(seq.ids[:, i : i + 1])[0] for i in range(prompt_len - 1, len(ids) - 1)])


@torch.inference_mode()
def verify_rows(model, ids: list[int], prompt_len: int, width: int, cache=None) -> torch.Tensor:
    device = next(model.parameters()).device
    seq = TokenBuffer(ids, len(ids), device)
    rt = Runtime.create(model, cache, capacity=len(ids))
    rt.prefill(seq.ids[:, :prompt_len], hold_last=True)
    out, start, end = [], prompt_len - 1, len(ids) - 1
    while start < end:
        stop = min(start + width, end)
        out.append(rt.feed(seq.ids[:, start:stop], keep="all")[0])
        start = stop
    return torch.cat(out)


def audit_width(model, prompt_ids: list[int], new_ids: list[int], width: int, cache=None) -> WidthAudit:
    ids = list(prompt_ids) + list(new_ids)
    device = str(next(model.parameters()).device)
    if not new_ids:
        return WidthAudit(width, 0, device, 0.0, 0.0, 0, 0)
    plain = plain_rows(model, ids, len(prompt_ids), cache)
    wide = verify_rows(model, ids, len(prompt_ids), width, cache)
    diff = (plain - wide).abs().amax(dim=-1)
    top = plain.topk(2, dim=-1).values
    flips = (plain.argmax(-1) != wide.argmax(-1)).nonzero().flatten().tolist()
    drift = diff.tolist()
    return WidthAudit(width, len(new_ids), device, max(drift), sum(drift) / len(drift),
                      int((diff == 0).sum()), len(flips), drift, (top[:, 0] - top[:, 1]).tolist(), flips,
                      [i % width for i in range(len(new_ids))])
