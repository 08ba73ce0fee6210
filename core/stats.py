"""Every number of a traced position computed together on the device, moved to the host in one transfer.

``pack`` lays out, for one row, in one float32 vector (token ids, ranks and counts are exact integers in float32
below 2**24; every probability is a float32 value already, so nothing is rounded):

    [token, finite, prob, logprob, raw_prob, raw_logprob, raw_rank, entropy, raw_entropy, kept,
     alt_id * A, alt_prob * A, alt_raw_prob * A, (stage_kept, stage_entropy, stage_mass_removed) * S]

``unpack`` reads the host list back into named fields. A = min(top, V) alternatives, S recorded stages (the raw
distribution first).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .processors import entropy

HEAD = 10  # scalar fields before the alternatives


def ranked_alternatives(probs: Tensor, raw_probs: Tensor, kept: Tensor, top: int) -> Tensor:
    """Ids of the ``top`` alternatives: kept candidates by processed probability, then removed ones by raw
    probability. Two top-k's and a stable sort on the group, so no precision is lost mixing the two scales."""
    k = min(top, probs.shape[-1])
    kept_vals, kept_ids = torch.where(kept, probs, -1.0).topk(k)
    removed_vals, removed_ids = torch.where(kept, -1.0, raw_probs).topk(k)
    ids = torch.cat([kept_ids, removed_ids])
    group = torch.cat([torch.where(kept_vals >= 0, 0, 2), torch.where(removed_vals >= 0, 1, 2)])
    order = torch.sort(group, stable=True).indices[:k]
    return ids[order]


def stage_stats(stages: list[tuple[str, Tensor]]) -> Tensor:
    """[S, 3] per stage of row 0: candidates kept, entropy after it (nats), and the probability mass, under the
    distribution before it, of the candidates it removed (the first stage removes nothing by definition)."""
    return stage_probs_and_stats(stages)[1]


def stage_probs_and_stats(stages: list[tuple[str, Tensor]]) -> tuple[Tensor, Tensor]:
    """Each stage's probabilities [S, V] (row 0) and its statistics [S, 3] (see :func:`stage_stats`)."""
    logits = torch.stack([z[0] for _, z in stages])  # [S, V]
    probs = torch.softmax(logits.float(), dim=-1)
    removed = torch.isneginf(logits)
    newly = removed.clone()
    newly[1:] &= ~removed[:-1]
    newly[0] = False
    mass = torch.zeros(len(stages), device=logits.device)
    mass[1:] = (probs[:-1] * newly[1:]).sum(dim=-1)
    return probs, torch.stack([(~removed).sum(dim=-1).float(), entropy(probs), mass], dim=-1)


def pack(token: Tensor, raw_logits: Tensor, processed: Tensor, stages: list[tuple[str, Tensor]] | None,
         top: int) -> Tensor:
    """All numbers of one traced step (row 0) in one float32 vector on the device (layout in the module doc).

    The distributions of the step are stacked as rows of one [S, V] tensor (raw first, processed last; with
    ``stages`` recorded, every stage in between), so each statistic is one operation over all of them: a traced
    step costs a few dozen tensor operations whatever the chain, and one transfer."""
    t = token.reshape(-1)[:1]
    L = (torch.stack([z[0] for _, z in stages]) if stages else torch.stack([raw_logits[0], processed[0]])).float()
    P = torch.softmax(L, dim=-1)
    removed = torch.isneginf(L)
    at_t = L[:, t][:, 0]  # [S] each row's logit of the token
    logp_t = at_t - torch.logsumexp(L, dim=-1)  # log p_t = z_t - log sum exp z
    p_t = P[:, t][:, 0]
    H = torch.special.entr(P).sum(dim=-1)
    kept_n = (~removed).sum(dim=-1).float()
    mass = torch.cat([P.new_zeros(1), (P[:-1] * (removed[1:] & ~removed[:-1])).sum(dim=-1)])
    scalars = torch.cat([
        t.float(), torch.isfinite(at_t[-1:]).float(), p_t[-1:], logp_t[-1:], p_t[:1], logp_t[:1],
        (L[0] > at_t[0]).sum(dim=-1, keepdim=True).float() + 1,  # raw rank, by logits (softmax is monotone)
        H[-1:], H[:1], kept_n[-1:],
    ])
    parts = [scalars]
    if top > 0:
        alt = ranked_alternatives(P[-1], P[0], ~removed[-1], top)
        parts += [alt.float(), P[-1, alt], P[0, alt]]
    if stages:
        parts.append(torch.stack([kept_n, H, mass], dim=-1).reshape(-1))
    return torch.cat(parts)


class Numbers(NamedTuple):
    token_id: int
    finite: bool
    prob: float
    logprob: float
    raw_prob: float
    raw_logprob: float
    raw_rank: int
    entropy: float
    raw_entropy: float
    kept: int
    alternatives: list[tuple[int, float, float]]  # (token id, processed prob, raw prob)
    stages: list[tuple[int, float, float]]  # (kept, entropy, mass removed) per recorded stage


def unpack(host: list[float], top: int, vocab: int, n_stages: int) -> Numbers:
    a = min(top, vocab) if top > 0 else 0
    alt_ids = host[HEAD : HEAD + a]
    alt_p = host[HEAD + a : HEAD + 2 * a]
    alt_raw = host[HEAD + 2 * a : HEAD + 3 * a]
    st = host[HEAD + 3 * a : HEAD + 3 * a + 3 * n_stages]
    return Numbers(
        token_id=int(host[0]), finite=bool(host[1]), prob=host[2], logprob=host[3], raw_prob=host[4],
        raw_logprob=host[5], raw_rank=int(host[6]), entropy=host[7], raw_entropy=host[8], kept=int(host[9]),
        alternatives=[(int(i), p, r) for i, p, r in zip(alt_ids, alt_p, alt_raw)],
        stages=[(int(st[3 * i]), st[3 * i + 1], st[3 * i + 2]) for i in range(n_stages)],
    )
