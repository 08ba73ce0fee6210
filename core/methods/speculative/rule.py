"""Speculative decoding: a cheap proposer drafts gamma tokens, the target scores them all in one forward.

One verification round, with the sequence so far s (its last token not yet fed to the target):

1. the proposer drafts x_1..x_g and, for each, q_i = its processed distribution given s + x_1..x_{i-1}
   (a draft model: g single-token forwards through its own cache; the n-gram proposer: a point mass, q_i(x_i) = 1);
2. the target runs ONE forward over [s_last, x_1, .., x_g] and keeps the logits of all g+1 positions;
   p_i = the processed distribution (the same chain, the same prefix ids) for the token after s + x_1..x_{i-1};
3. sampling (temperature > 0, Leviathan et al. 2023 / Chen et al. 2023): accept x_i iff u_i < p_i(x_i) / q_i(x_i),
   u_i ~ U(0, 1), i.e. with probability min(1, p/q), stopping at the first rejection; at a rejection at i emit a
   correction y ~ norm(max(0, p_i - q_i)); if all g are accepted emit a bonus y ~ p_{g+1}. Every emitted token is
   then distributed exactly as under the target alone:
       P(y) = min(p, q)(y) + (1 - sum_z min(p, q)(z)) * max(0, p - q)(y) / sum_z max(0, p - q)(z) = p(y),
   because sum_z max(0, p - q) = 1 - sum_z min(p, q);
   greedy (temperature 0): accept while x_i == argmax p_i, then emit argmax p at the first mismatch (correction)
   or after the last draft (bonus): exactly the target's greedy output;
4. both caches are cropped to the accepted prefix (the runtime's ``truncate``): the accepted positions are never recomputed.
   The target's cache keeps s + x_1..x_k (the emitted token y is fed as the first token of the next round); the
   draft model's cache keeps at most that and catches up at the start of its next round (1 or 2 tokens).

Expected tokens per round with a per-token acceptance probability a and g drafts: (1 - a^(g+1)) / (1 - a)
(g + 1 at a = 1); with a draft step costing c target steps, the speedup over plain decoding is that divided by
g c + 1.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

# ---------------------------------------------------------------------------------------------------------------
# the verification rule: pure functions (sampling batched over rows [B, ...], so tests can run thousands at once)
# ---------------------------------------------------------------------------------------------------------------


def final_kind(drafted: int, accepted: int) -> str:
    """What the token after a round's accepted drafts is: "correction" (a draft was rejected, y ~ norm(max(0, p -
    q))), "bonus" (every one of >= 1 drafts accepted, y ~ p), or "plain" (nothing was drafted: no n-gram match, or
    the last token of -n; y ~ p is an ordinary target step, earned by no draft)."""
    if drafted == 0:
        return "plain"
    return "bonus" if accepted == drafted else "correction"


class Verdict(NamedTuple):
    accepted: Tensor  # [B] number of drafts accepted (a prefix)
    token: Tensor  # [B] the token emitted after them: correction (accepted < g) or bonus (accepted == g)
    final_probs: Tensor  # [B, V] the distribution that token was drawn from: norm(max(0, p - q)) or p


def acceptance_probability(p_x: Tensor, q_x: Tensor) -> Tensor:
    """min(1, p(x) / q(x)): q >= p only lowers the chance; q <= p always accepts."""
    return torch.clamp(p_x / q_x, max=1.0)


def residual_distribution(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(0, p - q)) over the last dim: the mass p has beyond q. Where p <= q everywhere (only when p == q,
    where a rejection cannot happen) the row falls back to p."""
    excess = (p - q).clamp_min(0.0)
    total = excess.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, excess / total.clamp_min(1e-30), p)


def verify_sampled(p: Tensor, q: Tensor, drafts: Tensor, u: Tensor, race: Tensor) -> Verdict:
    """Speculative sampling for B rows at once.

    p [B, g+1, V] target (processed) distributions, q [B, g, V] the proposer's, drafts [B, g] the drafted ids,
    u [B, g] uniforms in [0, 1), race [B, V] Exp(1) draws for the emitted token (argmax r_i / E_i ~ r).
    """
    rows, g = drafts.shape
    p_x = p[:, :g].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    q_x = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    accept = u * q_x < p_x  # u < p/q  <=>  accepted with probability min(1, p/q)
    accepted = accept.long().cumprod(dim=-1).sum(dim=-1)  # length of the accepted prefix
    # position `accepted` of q padded with zeros: at g (all accepted) the residual max(0, p - 0) is p: the bonus
    q_pad = torch.cat([q, q.new_zeros(rows, 1, q.shape[-1])], dim=1)
    at = torch.arange(rows, device=p.device)
    final = residual_distribution(p[at, accepted], q_pad[at, accepted])
    return Verdict(accepted, (final / race).argmax(dim=-1), final)


def verify_greedy(best: list[int], drafts: list[int]) -> tuple[int, int]:
    """Greedy verification: accept while x_i == argmax p_i, then emit argmax p at the first mismatch (correction)
    or after the last draft (bonus). ``best`` = the g+1 argmaxes of the target's processed rows; returns
    (accepted, token). Plain lists: one round is a handful of ints, cheaper than tensor ops."""
    k = 0
    while k < len(drafts) and drafts[k] == best[k]:
        k += 1
    return k, best[k]


def point_masses(tokens: Tensor, vocab: int) -> Tensor:
    """q for a deterministic proposer: q_i(x_i) = 1, so its acceptance probability is min(1, p(x_i))."""
    return torch.nn.functional.one_hot(tokens, vocab).to(torch.float32)


def expected_tokens(a: float, g: int) -> float:
    """Tokens per round: 1 + a + a^2 + .. + a^g = (1 - a^(g+1)) / (1 - a), and g + 1 in the limit a -> 1."""
    if a >= 1.0:
        return g + 1.0
    return (1.0 - a ** (g + 1)) / (1.0 - a)


def predicted_speedup(a: float, c: float, g: int) -> float:
    """(1 - a^(g+1)) / ((1 - a)(g c + 1)): expected tokens per round over the round's cost in target steps."""
    return expected_tokens(a, g) / (g * c + 1.0)
