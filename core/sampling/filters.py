"""Stages that truncate the distribution: top-k, top-p, min-p, typical-p, top-n-sigma, epsilon and eta cutoffs,
XTC, mirostat v2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import ChainError
from .distribution import NEG_INF, entropy, log_softmax, softmax
from .stage import _bad, _finite
from .registry import implements


@implements("top-k")
@dataclass
class TopK:
    """Keep the k largest logits (and any tied with the k-th)."""

    k: int
    name: str = "top-k"

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        k = min(self.k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]
        return logits.masked_fill(logits < kth, NEG_INF)


def _keep_sorted_prefix(logits: Tensor, order: Tensor, keep_sorted: Tensor) -> Tensor:
    """Scatter a keep-mask computed over ``order`` (all or the first few ids by rank) back to vocabulary order;
    every id not kept there is masked."""
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter(1, order, keep_sorted)
    return logits.masked_fill(~keep, NEG_INF)


@implements("top-p")
@dataclass
class TopP:
    """Nucleus: keep the smallest set of most likely tokens whose mass reaches p.

    Sorted by probability, token i is kept iff the mass strictly before it, sum_{j<i} p_j, is below p.
    """

    p: float
    name: str = "top-p"
    head: int = 256  # rank only the most likely `head` tokens when they already hold mass p (no full sort)

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        if self.p >= 1.0:  # the whole distribution; no float cumsum may drop underflowed tails
            return logits.clone()
        full = softmax(logits)
        probs, order = full.topk(min(self.head, full.shape[-1]), dim=-1)
        if probs.shape[-1] < full.shape[-1] and bool((probs.sum(dim=-1) < self.p).any()):
            probs, order = full.sort(dim=-1, descending=True)
        mass_before = probs.cumsum(dim=-1) - probs
        keep = mass_before < self.p
        keep[..., 0] = True
        return _keep_sorted_prefix(logits, order, keep)


@implements("min-p")
@dataclass
class MinP:
    """Keep tokens with p_i >= min_p * max_j p_j."""

    min_p: float
    name: str = "min-p"

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        probs = softmax(logits)
        threshold = self.min_p * probs.amax(dim=-1, keepdim=True)
        return logits.masked_fill(probs < threshold, NEG_INF)


@implements("typical-p")
@dataclass
class TypicalP:
    """Locally typical sampling (Meister et al. 2022).

    Rank tokens by |(-log p_i) - H|, the distance of their surprisal from the entropy H, and keep the smallest
    prefix of that ranking whose mass reaches the given mass.
    """

    mass: float
    name: str = "typical-p"

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        logp = log_softmax(logits)
        probs = logp.exp()
        h = entropy(probs).unsqueeze(-1)
        distance = torch.where(torch.isneginf(logp), torch.inf, (-logp - h).abs())
        order = distance.argsort(dim=-1, stable=True)
        sorted_probs = probs.gather(1, order)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep = mass_before < self.mass
        keep[..., 0] = True
        return _keep_sorted_prefix(logits, order, keep)


# --- truncation by the shape of the distribution ---------------------------------------------------------------


@implements("xtc")
@dataclass
class XTC:
    """Exclude Top Choices (llama.cpp ``llama_sample_xtc_apply``): with probability ``probability`` (a coin from
    the run's generator, one per row and step), remove every token with p >= threshold except the least likely of
    them; nothing happens when fewer than two tokens reach the threshold. Ties are ordered by token id."""

    threshold: float
    probability: float
    generator: torch.Generator | None = None
    name: str = "xtc"

    def __post_init__(self):
        if not (_finite(self.threshold) and 0 <= self.threshold <= 1):
            raise _bad("--xtc-threshold", self.threshold, "must be in [0, 1] (above 0.5 it never acts)")
        if not (_finite(self.probability) and 0 <= self.probability <= 1):
            raise _bad("--xtc-probability", self.probability, "must be in [0, 1]")
        self._coin: Tensor | None = None

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        if self.generator is None:
            raise ChainError("xtc: built without the run's generator (its coin must come from the run's seed)")
        coin = torch.rand(logits.shape[0], generator=self.generator, device=self.generator.device)
        self._coin = coin.to(logits.device)
        probs = softmax(logits)
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        reach = (sorted_p >= self.threshold).sum(dim=-1, keepdim=True)  # c tokens reach the threshold
        rank = torch.arange(logits.shape[-1], device=logits.device)
        act = (self._coin <= self.probability).unsqueeze(-1)  # llama.cpp: skip when chance > probability
        remove_sorted = (rank < reach - 1) & act  # the c - 1 most likely go, the c-th stays
        remove = torch.zeros_like(remove_sorted).scatter(1, order, remove_sorted)
        return logits.masked_fill(remove, NEG_INF)

    def state(self) -> dict[str, Tensor]:
        return {"coin": self._coin} if self._coin is not None else {}


@implements("top-n-sigma")
@dataclass
class TopNSigma:
    """Top-n-sigma (Tang et al. 2024): keep z_i >= max z - n * sigma, sigma the population standard deviation of
    the finite logits (llama.cpp ``llama_sampler_top_n_sigma_apply``). Temperature scales max z - z_i and sigma
    alike, so what it keeps does not depend on the temperature."""

    n: float
    name: str = "top-n-sigma"

    def __post_init__(self):
        if not (_finite(self.n) and self.n > 0):
            raise _bad("--top-n-sigma", self.n, "must be > 0")

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        finite = torch.isfinite(logits)
        count = finite.sum(dim=-1, keepdim=True).clamp(min=1)
        z = torch.where(finite, logits, 0.0)
        mean = z.sum(dim=-1, keepdim=True) / count
        var = torch.where(finite, (logits - mean) ** 2, 0.0).sum(dim=-1, keepdim=True) / count
        top = logits.amax(dim=-1, keepdim=True)
        return logits.masked_fill(logits < top - self.n * var.sqrt(), NEG_INF)


@implements("epsilon-cutoff")
@dataclass
class EpsilonCutoff:
    """Epsilon sampling (Hewitt et al. 2022): remove tokens with p < epsilon, the most likely token always stays
    (transformers' ``EpsilonLogitsWarper`` with min_tokens_to_keep=1)."""

    epsilon: float
    name: str = "epsilon-cutoff"

    def __post_init__(self):
        if not (_finite(self.epsilon) and 0 < self.epsilon < 1):
            raise _bad("--epsilon-cutoff", self.epsilon, "must be in (0, 1)")

    def cutoff(self, logits: Tensor, probs: Tensor) -> Tensor | float:
        return self.epsilon

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        probs = softmax(logits)
        low = probs < self.cutoff(logits, probs)
        top = logits.amax(dim=-1, keepdim=True)
        return logits.masked_fill(low & (logits < top), NEG_INF)


@implements("eta-cutoff")
@dataclass
class EtaCutoff(EpsilonCutoff):
    """Eta sampling (Hewitt et al. 2022): remove tokens with p < eta = min(epsilon, sqrt(epsilon) * exp(-H)), H the
    entropy of the distribution (transformers' ``EtaLogitsWarper``); the most likely token always stays."""

    name: str = "eta-cutoff"

    def __post_init__(self):
        if not (_finite(self.epsilon) and 0 < self.epsilon < 1):
            raise _bad("--eta-cutoff", self.epsilon, "must be in (0, 1)")

    def cutoff(self, logits: Tensor, probs: Tensor) -> Tensor:
        h = entropy(probs).unsqueeze(-1)
        eps = torch.tensor(self.epsilon, dtype=probs.dtype, device=probs.device)
        return torch.minimum(eps, eps.sqrt() * torch.exp(-h))


# --- mirostat v2 -------------------------------------------------------------------------------------------------


@implements("mirostat")
@dataclass
class MirostatV2:
    """Mirostat 2.0 (Basu et al. 2021; llama.cpp ``llama_sampler_mirostat_v2_apply``): keep the tokens whose
    surprise -log2 p is at most mu (at least the most likely one); after the selector draws token x from what is
    kept (renormalized), mu <- mu - eta * (-log2 p_kept(x) - tau). mu starts at 2 tau; one mu per row."""

    tau: float = 5.0
    eta: float = 0.1
    name: str = "mirostat"

    def __post_init__(self):
        if not (_finite(self.tau) and self.tau > 0):
            raise _bad("--mirostat-tau", self.tau, "must be > 0 (the target surprise in bits)")
        if not (_finite(self.eta) and self.eta > 0):
            raise _bad("--mirostat-eta", self.eta, "must be > 0 (the learning rate)")
        self.mu: Tensor | None = None
        self._kept_logp: Tensor | None = None

    def reset(self, prompt_len: int = 0) -> None:
        self.mu, self._kept_logp = None, None

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        if self.mu is None or self.mu.shape[0] != logits.shape[0]:
            self.mu = torch.full((logits.shape[0],), 2.0 * self.tau, device=logits.device)
        surprise = -log_softmax(logits) / math.log(2.0)
        best = logits.argmax(dim=-1, keepdim=True)
        keep = (surprise <= self.mu.unsqueeze(-1)).scatter(1, best, True)
        out = logits.masked_fill(~keep, NEG_INF)
        self._kept_logp = log_softmax(out)
        return out

    def accept(self, token: Tensor) -> None:
        """Update mu from the selected token [B] (on the device; no host read). A new tensor, never in place, so
        a trace that captured this step's mu keeps it."""
        if self._kept_logp is None:
            return
        observed = -self._kept_logp.gather(1, token.reshape(-1, 1)).squeeze(-1) / math.log(2.0)
        self.mu = self.mu - self.eta * (observed - self.tau)

    def state(self) -> dict[str, Tensor]:
        return {"mu": self.mu} if self.mu is not None else {}
