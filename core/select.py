"""The one selector at the end of a chain: greedy, or a draw from the processed distribution."""

from __future__ import annotations

import torch
from torch import Tensor


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """An explicit RNG on the logits' device, so a seed reproduces the same draws."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


class Greedy:
    name = "greedy"

    def __call__(self, probs: Tensor) -> Tensor:
        return probs.argmax(dim=-1)


class Multinomial:
    """Exact draw from probs by an exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) i.i.d.

    P(argmax = i) = p_i (the minimum of independent Exp(p_i)-distributed E_i / p_i is attained at i with
    probability p_i / sum p). No host sync and no cumulative-sum rounding.
    """

    name = "multinomial"

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def __call__(self, probs: Tensor) -> Tensor:
        race = torch.empty_like(probs).exponential_(1.0, generator=self.generator)
        return (probs / race).argmax(dim=-1)


def make_selector(temperature: float | None, seed: int, device) -> Greedy | Multinomial:
    if temperature == 0:
        return Greedy()
    return Multinomial(make_generator(seed, device))
