"""The attention diagnosis behind ``stream --attention``: how much attention mass each head puts on the first tokens
(the attention sinks a ``sinks`` policy keeps), early and late in a long text.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from ..engine.forward import attention_weights, rotary_parameters
from ..errors import ConfigError


def _has_rotary(model) -> bool:

    return rotary_parameters(model) is not None


# --- the attention-sink diagnosis ----------------------------------------------------------------------------------


@dataclass
class HeadSinkMass:
    layer: int
    head: int
    sink_mass: float  # mean over late queries of the attention weight summed over the first `sinks` positions
    average_mass: float  # mean over late queries of `sinks` x the mean weight on one other visible position
    ratio: float  # sink_mass / average_mass: 1 = the first positions get what any position gets; >> 1 = a sink

    def as_dict(self) -> dict:
        return asdict(self)


def attention_profile(model, token_ids: list[int], sinks: int, context: int | None) -> tuple[list[HeadSinkMass],
                                                                                           dict]:
    """One forward over the first min(len, context) tokens; late queries = the second half of them."""
    if sinks < 1:
        raise ConfigError("--sinks 0: --attention needs the first S >= 1 positions to measure")
    ids = token_ids[: context or len(token_ids)]
    if len(ids) < 2 * sinks + 2:
        raise ConfigError(f"--attention: {len(ids)} tokens; needs at least {2 * sinks + 2}")
    device = next(model.parameters()).device
    late_from = len(ids) // 2
    weights = attention_weights(model, torch.tensor([ids], dtype=torch.long, device=device))
    rows = sink_profile(weights, sinks, late_from)
    return rows, {"tokens": len(ids), "late_from": late_from, "sinks": sinks}


def sink_profile(weights: list[Tensor], sinks: int, late_from: int) -> list[HeadSinkMass]:
    """From per-layer attention weights [B, H, T, T] of one causal forward: for every query q >= late_from, the
    weight on keys 0..sinks-1 against ``sinks`` times the mean weight on one of the other q + 1 - sinks visible
    keys; averaged over the late queries (and rows)."""
    rows = []
    for layer, w in enumerate(weights):
        w = w.float()
        late = w[:, :, late_from:, :]  # [B, H, Q, T]
        q_index = torch.arange(late_from, w.shape[-1], device=w.device)
        on_sinks = late[..., :sinks].sum(-1)  # [B, H, Q]
        others = (late.sum(-1) - on_sinks) / (q_index + 1 - sinks).clamp(min=1)  # mean weight on one other key
        sink_mass = on_sinks.mean(dim=(0, 2))
        average = (sinks * others).mean(dim=(0, 2))
        for head in range(w.shape[1]):
            s, a = float(sink_mass[head]), float(average[head])
            rows.append(HeadSinkMass(layer, head, s, a, s / a if a > 0 else float("inf")))
    return rows
