"""Verification policies replayed offline on the recorded p and q of a teacher-forced forward (:mod:`.predict`): for
each, the law of the token a round emits first at position i (draft x ~ q_i, then the policy's verdict), enumerated
exactly over the vocabulary, against the target's processed p_i (TV and KL per position), and the acceptance per
position it would give, walked into tokens per round and speedup by :func:`.predict.plan_gamma`.

The one-step laws (a(x) = min(1, p(x) / q(x)), alpha = sum_x min(p, q), r = norm(max(0, p - q))):

* exact (Leviathan / Chen):      P(y) = q(y) a(y) + (1 - alpha) r(y) = p(y)                        (no distortion)
* adaptive budget (vLLM):        verifies a prefix of the draft only (slots admitted while their survival
                                 probability, the product of the per-depth acceptance rates, is worth their cost c):
                                 every verified draft is judged exactly: P(y) = p(y); only the speedup changes
* confidence-scheduled:          the same truncation, decided by the draft's own confidence max_x q_j(x) at each
                                 depth (running product >= a threshold): exact, P(y) = p(y)
* typical (Medusa 3.3.1):        accept x iff p(x) > min(eps, delta exp(-H(p))); a rejection emits argmax p:
                                 P(y) = q(y) [p(y) > thr] + (1 - sum_x q(x) [p(x) > thr]) [y = argmax p]
* synthetic (vLLM benchmarking): accept x with a fixed rate c whatever p says; a rejection emits a draw from p:
                                 P(y) = c q(y) + (1 - c) p(y)
* FLy (entropy-gated deferral):  a native rejection at a position whose target entropy (over its top-k processed
                                 probabilities, renormalised) exceeds tau is deferred, the draft kept, when the next
                                 w native decisions accept; their chance taken as alpha_{i+1} .. alpha_{i+w} along the
                                 text (an approximation: the text's next tokens stand for the drafts'): with g that
                                 chance (0 below the gate),
                                 P(y) = q(y) a(y) + g q(y) (1 - a(y)) + (1 - g)(1 - alpha) r(y)
* greedy drafting at T > 0:      the draft is argmax q (not a draw) but verified against the soft q, as an MTP head
                                 drafting greedily does (vllm#20459): x* = argmax q,
                                 P(y) = a(x*) [y = x*] + (1 - a(x*)) r(y)
                                 (verified against the point mass on x* instead, it would be exact: the n-gram case)

Where the emitted law puts mass on a token p gives 0, KL(P || p) is infinite: it is reported as null with that
mass (``outside``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from .predict import GammaPlan, plan_gamma, walk
from .rule import residual_distribution

# defaults (vLLM's and Medusa's where they have one; see docs/speculative.md for where we had to choose)
TYPICAL_EPS = 0.09  # Medusa's posterior_threshold
TYPICAL_DELTA = 0.3  # Medusa's posterior_alpha
SYNTHETIC_RATE = 0.7  # our choice: a constant conditional rate per depth
FLY_TAU = 0.3  # fly_entropy_threshold
FLY_TOP_K = 3  # fly_entropy_top_k
FLY_WINDOW = 6  # fly_window_size, at most gamma - 1
CONFIDENCE_THRESHOLD = 0.5  # our choice: verify while the running product of draft confidences stays above it

POLICIES = ("exact", "adaptive", "confidence", "typical", "synthetic", "fly", "greedy-draft")


# ---------------------------------------------------------------------------------------------------------------
# one-step laws: rows [N, V] -> (law [N, V], first-draft acceptance [N])
# ---------------------------------------------------------------------------------------------------------------


def exact_law(p: Tensor, q: Tensor) -> tuple[Tensor, Tensor]:
    accept = torch.minimum(p, q)  # q(y) a(y) = min(p, q)(y)
    alpha = accept.sum(-1)
    return accept + (1.0 - alpha)[:, None] * residual_distribution(p, q), alpha


def entropy(p: Tensor) -> Tensor:
    return -(p * torch.log(p.clamp_min(1e-30))).sum(-1)


def typical_threshold(p: Tensor, eps: float = TYPICAL_EPS, delta: float = TYPICAL_DELTA) -> Tensor:
    return torch.clamp(delta * torch.exp(-entropy(p)), max=eps)


def typical_law(p: Tensor, q: Tensor, eps: float = TYPICAL_EPS, delta: float = TYPICAL_DELTA):
    ok = (p > typical_threshold(p, eps, delta)[:, None]).float()
    kept = q * ok
    accept = kept.sum(-1)
    best = torch.nn.functional.one_hot(p.argmax(-1), p.shape[-1]).float()
    return kept + (1.0 - accept)[:, None] * best, accept


def synthetic_law(p: Tensor, q: Tensor, rate: float = SYNTHETIC_RATE):
    return rate * q + (1.0 - rate) * p, torch.full(p.shape[:1], rate)


def topk_entropy(p: Tensor, k: int = FLY_TOP_K) -> Tensor:
    top = p.topk(min(k, p.shape[-1]), dim=-1).values
    return entropy(top / top.sum(-1, keepdim=True).clamp_min(1e-30))


def fly_deferral(p: Tensor, alpha: Tensor, window: int, tau: float = FLY_TAU, k: int = FLY_TOP_K) -> Tensor:
    """g_i: the chance a native rejection at i is deferred: 0 below the entropy gate, else alpha_{i+1} .. alpha_{i+w}
    (positions past the text end count as accepted: nothing left to disagree)."""
    n = alpha.shape[0]
    g = torch.zeros(n)
    for i in range(n):
        g[i] = torch.prod(alpha[i + 1 : i + 1 + window]) if window > 0 else 0.0
    return torch.where(topk_entropy(p, k) > tau, g, torch.zeros_like(g))


def fly_law(p: Tensor, q: Tensor, window: int, tau: float = FLY_TAU, k: int = FLY_TOP_K):
    accept = torch.minimum(p, q)
    alpha = accept.sum(-1)
    g = fly_deferral(p, alpha, window, tau, k)
    law = accept + g[:, None] * (q - accept) + ((1.0 - g) * (1.0 - alpha))[:, None] * residual_distribution(p, q)
    return law, alpha + g * (1.0 - alpha)


def greedy_draft_law(p: Tensor, q: Tensor):
    best = q.argmax(-1)
    rows = torch.arange(p.shape[0])
    a = torch.clamp(p[rows, best] / q[rows, best].clamp_min(1e-30), max=1.0)
    point = torch.nn.functional.one_hot(best, p.shape[-1]).float()
    return a[:, None] * point + (1.0 - a)[:, None] * residual_distribution(p, q), a


# ---------------------------------------------------------------------------------------------------------------
# prefix-truncating policies: the walk with a per-round draft count
# ---------------------------------------------------------------------------------------------------------------


def adaptive_lengths(depth_rates: list, gamma: int, cost_ratio: float) -> int:
    """The verified prefix: slots j = 0.. admitted while their survival S_j = a_0 .. a_j (the per-depth acceptance
    estimates) is at least their cost c (at batch 1 a slot buys S_j tokens for c target steps): a fixed length when
    the estimates are per depth."""
    survive, length = 1.0, 0
    for j in range(gamma):
        rate = depth_rates[j] if j < len(depth_rates) and depth_rates[j] is not None else 0.0
        survive *= rate
        if survive < cost_ratio:
            break
        length += 1
    return max(length, 1)


def confidence_lengths(q: Tensor, gamma: int, threshold: float = CONFIDENCE_THRESHOLD) -> list[int]:
    """Per round start t: drafts verified while the running product of max_x q_{t+j}(x) stays >= threshold
    (at least 1)."""
    conf = q.max(-1).values.tolist()
    n = len(conf)
    out = []
    for t in range(n):
        survive, length = 1.0, 0
        for j in range(gamma):
            if t + j >= n:
                break
            survive *= conf[t + j]
            if survive < threshold:
                break
            length += 1
        out.append(max(length, 1))
    return out


def plan_truncated(alpha: list[float], lengths: list[int], gamma: int, cost_ratio: float | None) -> GammaPlan:
    """:func:`plan_gamma` with the round that starts at t drafting min(lengths[t], gamma) tokens (the rest of the
    block is never verified, so it is not drafted either)."""
    return walk(alpha, gamma, cost_ratio, lambda t: min(lengths[t], gamma))


# ---------------------------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class PolicyReport:
    policy: str
    lossless: bool  # in theory; the measured distortion beside it
    mean_tv: float  # mean over positions of TV(P_i, p_i)
    max_tv: float
    mean_kl: float | None  # mean over positions of KL(P_i || p_i) in nats; null when infinite somewhere
    outside: float  # mean mass the emitted law puts where p is 0
    first_acceptance: float  # mean acceptance of a round's first draft
    plan: GammaPlan  # tokens per round and speedup at the gamma asked
    tv: list[float]  # per position
    kl: list  # per position (null: infinite)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["plan"] = self.plan.to_dict()
        return d


def distortion(law: Tensor, p: Tensor) -> tuple[list[float], list, list[float]]:
    """Per position: TV = 1/2 sum |P - p|; KL(P || p) = sum P log(P / p) (null if P > 0 where p = 0); mass outside."""
    tv = 0.5 * (law - p).abs().sum(-1)
    outside = torch.where(p > 0, torch.zeros_like(law), law).sum(-1)
    terms = torch.where(law > 0, law * (torch.log(law.clamp_min(1e-30)) - torch.log(p.clamp_min(1e-30))),
                        torch.zeros_like(law))
    kl = terms.sum(-1).clamp_min(0.0)
    kl_list = [None if o > 1e-7 else float(v) for v, o in zip(kl.tolist(), outside.tolist())]
    return tv.tolist(), kl_list, outside.tolist()


def report(name: str, law: Tensor, accept: Tensor, p: Tensor, plan: GammaPlan, lossless: bool) -> PolicyReport:
    tv, kl, outside = distortion(law, p)
    n = max(len(tv), 1)
    finite = all(k is not None for k in kl)
    return PolicyReport(name, lossless, sum(tv) / n, max(tv, default=0.0),
                        sum(kl) / n if finite else None, sum(outside) / n, float(accept.mean()) if len(tv) else 0.0,
                        plan, tv, kl)


def replay(p: Tensor, q: Tensor, gamma: int, cost_ratio: float | None, synthetic_rate: float = SYNTHETIC_RATE,
           confidence_threshold: float = CONFIDENCE_THRESHOLD) -> list[PolicyReport]:
    """Every policy on the recorded rows at one gamma; p, q [N, V] processed distributions (sampled verification:
    at temperature 0 every policy is greedy verification and none of this applies)."""
    exact, alpha = exact_law(p, q)
    base = plan_gamma(alpha.tolist(), gamma, cost_ratio)
    out = [report("exact", exact, alpha, p, base, True)]
    length = adaptive_lengths(base.per_position_acceptance, gamma, cost_ratio if cost_ratio is not None else 0.0)
    out.append(report("adaptive", exact, alpha, p, plan_truncated(alpha.tolist(), [length] * len(alpha), gamma,
                                                                  cost_ratio), True))
    out.append(report("confidence", exact, alpha, p,
                      plan_truncated(alpha.tolist(), confidence_lengths(q, gamma, confidence_threshold), gamma,
                                     cost_ratio), True))
    for name, (law, accept) in (("typical", typical_law(p, q)), ("synthetic", synthetic_law(p, q, synthetic_rate)),
                                ("fly", fly_law(p, q, min(FLY_WINDOW, gamma - 1))),
                                ("greedy-draft", greedy_draft_law(p, q))):
        out.append(report(name, law, accept, p, plan_gamma(accept.tolist(), gamma, cost_ratio), False))
    return out

