"""Stages that rescale the logits: soft-capping, temperature (0 = greedy), dynamic temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .distribution import NEG_INF, entropy, softmax
from .stage import _bad, _finite
from .registry import implements


@implements("softcap")
@dataclass
class SoftCap:
    """z -> c * tanh(z / c): every logit ends in (-c, c); removed candidates (-inf) stay removed."""

    cap: float
    name: str = "softcap"

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        capped = self.cap * torch.tanh(logits / self.cap)
        return torch.where(torch.isneginf(logits), logits, capped)


@implements("temperature")
@dataclass
class Temperature:
    """z -> z / T. T = 0 is greedy: only the arg-max survives, so the processed distribution is a point mass."""

    temperature: float
    name: str = "temperature"

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        if self.temperature == 0:
            best = logits.argmax(dim=-1, keepdim=True)
            return torch.full_like(logits, NEG_INF).scatter(1, best, logits.gather(1, best))
        return logits / self.temperature


# --- temperature that follows the entropy --------------------------------------------------------------------


@implements("dynatemp")
@dataclass
class DynamicTemperature:
    """Dynamic temperature (llama.cpp ``llama_sampler_temp_ext_apply``): with K candidates and entropy H,
    T = T_min + (T_max - T_min) * (H / log K) ** exponent, T_min = max(0, t - range), T_max = t + range; then
    z -> z / T (T <= 0: only the arg-max stays). With one candidate nothing changes."""

    temperature: float
    range: float
    exponent: float = 1.0
    name: str = "dynatemp"

    def __post_init__(self):
        if not (_finite(self.temperature) and self.temperature >= 0):
            raise _bad("--temperature", self.temperature, "must be >= 0")
        if not (_finite(self.range) and self.range > 0):
            raise _bad("--dynatemp-range", self.range, "must be > 0 (0 = plain temperature)")
        if not (_finite(self.exponent) and self.exponent > 0):
            raise _bad("--dynatemp-exponent", self.exponent, "must be > 0")
        self._t: Tensor | None = None

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        lo, hi = max(0.0, self.temperature - self.range), self.temperature + self.range
        k = torch.isfinite(logits).sum(dim=-1, keepdim=True).float()
        h = entropy(softmax(logits)).unsqueeze(-1)
        norm = torch.where(k > 1, h / k.clamp(min=2).log(), 0.0)
        t = lo + (hi - lo) * norm.clamp(min=0) ** self.exponent
        self._t = torch.where(k > 1, t, 1.0).squeeze(-1)
        greedy = (t <= 0) & (k > 1)
        best = logits.argmax(dim=-1, keepdim=True)
        point = torch.full_like(logits, NEG_INF).scatter(1, best, logits.gather(1, best))
        scaled = torch.where(k > 1, logits / torch.where(t > 0, t, 1.0), logits)
        return torch.where(greedy, point, scaled)

    def state(self) -> dict[str, Tensor]:
        return {"temperature": self._t} if self._t is not None else {}
