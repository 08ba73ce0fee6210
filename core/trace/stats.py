"""Every number of a traced position computed together on the device, moved to the host in one transfer.

``pack`` lays out, for one row, in one float32 vector (token ids, ranks and counts are exact integers in float32
below 2**24; every probability is a float32 value already, so nothing is rounded):

    [token, finite, prob, logprob, raw_prob, raw_logprob, raw_rank, entropy, raw_entropy, kept,
     alt_id * A, alt_prob * A, alt_raw_prob * A, (stage_kept, stage_entropy, stage_mass_removed) * S,
     winner * S, chosen_rank * S, removed_previous_winner * (S - 1)]

The last three groups say which stage decided the step (:mod:`decodelab.core.why`): the token the selector's own
race draws would pick from each stage's distribution, the chosen token's rank there, and whether a stage removed
the previous stage's winner.

``unpack`` reads the host list back into named fields. A = min(top, V) alternatives, S recorded stages (the raw
distribution first).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..sampling.distribution import entropy
from .records import StageStat
from .why import race_noise, split, stage_winners

HEAD = 10  # scalar fields before the alternatives


def ranked_alternatives(probs: Tensor, raw_probs: Tensor, kept: Tensor, top: int) -> Tensor:
    """Ids of the ``top`` alternatives: kept candidates by processed probability, then removed ones by raw
    probability. Two top-k's (each padded with -1 where its group has fewer than ``top``) and a stable sort that
    moves the padding last, so no precision is lost mixing the two scales."""
    k = min(top, probs.shape[-1])
    kept_vals, kept_ids = torch.where(kept, probs, -1.0).topk(k)
    removed_vals, removed_ids = torch.where(kept, -1.0, raw_probs).topk(k)
    ids = torch.cat([kept_ids, removed_ids])
    filler = torch.cat([kept_vals < 0, removed_vals < 0])  # -1: a candidate of the other group, padding a top-k
    order = torch.sort(filler.int(), stable=True).indices[:k]  # kept, then removed, each in its own order
    return ids[order]


def stage_stats(stages: list[tuple[str, Tensor]]) -> Tensor:
    """[S, 3] per stage of row 0: candidates kept, entropy after it (nats), and the probability mass, under the
    distribution before it, of the candidates it removed (the first stage removes nothing by definition)."""
    return stage_probs_and_stats(stages)[1]


def stage_probs_and_stats(stages: list[tuple[str, Tensor]]) -> tuple[Tensor, Tensor]:
    """Each stage's probabilities [S, V] (row 0) and its statistics [S, 3] (see :func:`stage_stats`)."""
    probs, _, stats = stage_numbers(torch.stack([z[0] for _, z in stages]))
    return probs, stats


def stage_numbers(logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """For stage logits [S, V] (raw first): the probabilities [S, V], the removed candidates [S, V] (logit -inf) and
    per stage [S, 3] the candidates kept, the entropy (nats) and the mass removed, sum_i p^(s-1)_i [z^(s)_i = -inf].
    A candidate removed by an earlier stage has p^(s-1)_i = exp(-inf) = 0 exactly, so only what stage s newly
    removed counts; the first stage removes nothing."""
    probs = torch.softmax(logits.float(), dim=-1)
    removed = torch.isneginf(logits)
    mass = torch.cat([probs.new_zeros(1), (probs[:-1] * removed[1:]).sum(dim=-1)])
    return probs, removed, torch.stack([(~removed).sum(dim=-1).float(), entropy(probs), mass], dim=-1)


def pack(token: Tensor, raw_logits: Tensor, processed: Tensor, stages: list[tuple[str, Tensor]] | None,
         top: int, race: Tensor | None = None) -> Tensor:
    """All numbers of one traced step (row 0) in one float32 vector on the device (layout in the module doc).

    The distributions of the step are stacked as rows of one [S, V] tensor (raw first, processed last; with
    ``stages`` recorded, every stage in between), so each statistic is one operation over all of them: a traced
    step costs a few dozen tensor operations whatever the chain, and one transfer. ``race``: the selector's Exp(1)
    draws of this step (None: greedy), for the deciding stage."""
    t = token.reshape(-1)[:1]
    L = (torch.stack([z[0] for _, z in stages]) if stages else torch.stack([raw_logits[0], processed[0]])).float()
    P, removed, per_stage = stage_numbers(L)
    kept_n, H = per_stage[:, 0], per_stage[:, 1]
    at_t = L[:, t][:, 0]  # [S] each row's logit of the token
    logp_t = at_t - torch.logsumexp(L, dim=-1)  # log p_t = z_t - log sum exp z
    p_t = P[:, t][:, 0]
    scalars = torch.cat([
        t.float(), torch.isfinite(at_t[-1:]).float(), p_t[-1:], logp_t[-1:], p_t[:1], logp_t[:1],
        (L[0] > at_t[0]).sum(dim=-1, keepdim=True).float() + 1,  # raw rank, by logits (softmax is monotone)
        H[-1:], H[:1], kept_n[-1:],
    ])
    alt = ranked_alternatives(P[-1], P[0], ~removed[-1], top)  # none for top 0
    parts = [scalars, alt.float(), P[-1, alt], P[0, alt]]
    if stages:
        parts.append(per_stage.reshape(-1))
        parts.append(stage_winners(L, race_noise(None if race is None else race[:1], L[0]), t))
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
    winners: list[int] = []  # per recorded stage: the token the step's race draws pick from its distribution
    ranks: list[int] = []  # per recorded stage: the chosen token's rank there
    removed: list[bool] = []  # per stage after the first: it removed the previous stage's winner


def unpack(host: list[float], top: int, vocab: int, n_stages: int) -> Numbers:
    a = min(top, vocab)
    st = HEAD + 3 * a  # where the stages begin
    winners, ranks, removed = split(host[st + 3 * n_stages :], n_stages)  # empty without stages
    return Numbers(
        token_id=int(host[0]), finite=bool(host[1]), prob=host[2], logprob=host[3], raw_prob=host[4],
        raw_logprob=host[5], raw_rank=int(host[6]), entropy=host[7], raw_entropy=host[8], kept=int(host[9]),
        alternatives=[(int(host[HEAD + i]), host[HEAD + a + i], host[HEAD + 2 * a + i]) for i in range(a)],
        stages=[(int(host[st + 3 * i]), host[st + 3 * i + 1], host[st + 3 * i + 2]) for i in range(n_stages)],
        winners=winners, ranks=ranks, removed=removed,
    )


def stage_table(stages: list[tuple[str, Tensor]]) -> list[tuple[StageStat, Tensor]]:
    """Per stage (row 0 of each [1, V] logits): candidates kept, entropy after it, and the probability mass
    (under the distribution before it) of the candidates it removed; with that stage's probabilities.
    Computed together on the device (:func:`decodelab.core.stats.stage_stats`), read in one transfer."""

    probs, stats = stage_probs_and_stats(stages)
    host = stats.tolist()
    return [(StageStat(name, int(k), h, m), probs[i]) for i, ((name, _), (k, h, m)) in enumerate(zip(stages, host))]


def kept_ids(stages: list[tuple[str, Tensor]]) -> list[dict]:
    """Per stage (raw excluded), the token ids that survive it (a finite logit): ``{name, kept, ids}``, ``ids``
    None where every token of the vocabulary survives (the list would be the whole vocabulary). The masks of every
    stage are stacked and read in one transfer."""
    named = [(name, z.reshape(-1)) for name, z in stages if name != "raw"]
    if not named:
        return []
    alive = torch.stack([torch.isfinite(z) for _, z in named])  # [S, V]
    vocab = alive.shape[-1]
    counts = alive.sum(dim=-1)
    rows, cols = alive.nonzero(as_tuple=True)
    host_counts, host_rows, host_cols = counts.tolist(), rows.tolist(), cols.tolist()
    out = [{"name": name, "kept": int(n), "ids": None if n == vocab else []}
           for (name, _), n in zip(named, host_counts)]
    for r, c in zip(host_rows, host_cols):
        if out[r]["ids"] is not None:
            out[r]["ids"].append(c)
    return out
