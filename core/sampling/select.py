"""The one selector at the end of a chain: greedy, or a draw from the processed distribution."""

from __future__ import annotations

import torch
from torch import Tensor

from .distribution import softmax


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """An explicit RNG on the logits' device, so a seed reproduces the same draws."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


class Greedy:
    """The arg-max of the processed distribution (softmax is monotone, so the arg-max of the logits too)."""

    name = "greedy"

    def __call__(self, probs: Tensor) -> Tensor:
        return probs.argmax(dim=-1)

    def from_logits(self, logits: Tensor) -> Tensor:
        return logits.argmax(dim=-1)


class Multinomial:
    """Exact draw from probs by an exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) i.i.d.

    E_i / p_i ~ Exp(p_i), and the smallest of independent exponentials is the i-th with probability p_i / sum p.
    From logits: argmax_i z_i - log E_i (the softmax normaliser is the same for every i), so no softmax. No
    cumulative-sum rounding and no host sync; removed tokens (p = 0, z = -inf) never win.
    """

    name = "multinomial"

    def __init__(self, generator: torch.Generator):
        self.generator = generator
        self.last_race: Tensor | None = None  # this step's draws E, kept for the trace's "why this token"

    def _race(self, like: Tensor) -> Tensor:
        self.last_race = torch.empty_like(like, dtype=torch.float32).exponential_(1.0, generator=self.generator)
        return self.last_race

    def __call__(self, probs: Tensor) -> Tensor:
        return (probs.float() / self._race(probs)).argmax(dim=-1)

    def from_logits(self, logits: Tensor) -> Tensor:
        return (logits.float() - self._race(logits).log()).argmax(dim=-1)


class HFMultinomial:
    """transformers' draw: ``torch.multinomial(softmax(scores), 1)`` (``generation/utils.py`` ``_sample``). With a
    generator seeded by s it draws what ``generate(do_sample=True)`` draws after ``torch.manual_seed(s)`` (the
    default CPU generator and a fresh one seeded alike give the same stream)."""

    name = "hf-multinomial"

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def __call__(self, probs: Tensor) -> Tensor:
        return torch.multinomial(probs.float(), 1, generator=self.generator).squeeze(-1)

    def from_logits(self, logits: Tensor) -> Tensor:
        return self(softmax(logits))


SELECTORS = {"greedy": Greedy, "multinomial": Multinomial, "hf-multinomial": HFMultinomial}


def make_selector(name: str, seed: int, device) -> Greedy | Multinomial | HFMultinomial:
    """The selector a plan names (:attr:`~.semantics.Plan.selector`; whether a run is greedy is the plan's to say),
    a sampling one with its own generator seeded by ``seed``."""
    if name == "greedy":
        return Greedy()
    return SELECTORS[name](make_generator(seed, device))


# --- one step ----------------------------------------------------------------------------------------------------






