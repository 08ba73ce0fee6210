"""Every number of a traced position computed together on the device, moved to the host in one transfer.

``pack`` lays out, for one row, in one float32 vector (token ids, ranks and counts are exact integers in float32
below 2**24; every probability is a float32 value already, so nothing is rounded):

    [token, finite, prob, logprob, raw_prob, raw_logprob, raw_rank, entropy, raw_entropy, kept,
     alt_id * A, alt_prob * A, alt_raw_prob * A, (stage_kept, stage_entropy, stage_mass_removed) * S,
     winner * S, chosen_rank * S, removed_previous_winner * (S - 1)]

The last three groups say which stage decided the step (:mod:`decodelab.core.trace.why`): the token the selector's own
race draws would pick from each stage's distribution, the chosen token's rank there, and whether a stage removed
the previous stage's winner.

``unpack`` reads the host list back into named fields. A = min(top, V) alternatives, S recorded stages (the raw
distribution first).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import Tensor

from .why import chosen_ranks, race_noise, race_winners, split

HEAD = 10  # scalar fields before the alternatives
HEAD_FIELDS = ("token_id", "finite", "prob", "logprob", "raw_prob", "raw_logprob", "raw_rank", "entropy",
               "raw_entropy", "kept")  # their order (Numbers' first fields)
COLUMN = {name: i for i, name in enumerate(HEAD_FIELDS)}  # where each HEAD number sits in a packed row


KEPT_FIRST = 1 << 30  # added to a kept candidate's key: above every removed one (a float32 in [0, 1] is < 2**30)


def ranked_alternatives(probs: Tensor, raw_probs: Tensor, kept: Tensor, top: int) -> Tensor:
    """Ids of the ``top`` alternatives: kept candidates by processed probability, then removed ones by raw
    probability. One top-k over an exact integer key: a non-negative float32's bit pattern, read as an int32, orders
    as the float does (subnormals and 0 included), so kept candidates get 2**30 + bits(p) and removed ones bits(raw p)
    (every probability is <= 1.0 = 0x3F800000 < 2**30): no precision is lost mixing the two scales, and a kept
    candidate whose probability underflowed to 0 still ranks above every removed one."""
    k = min(top, probs.shape[-1])
    # a view of the same bits (a row of a [K, S, V] block is strided, its last dim is not: no copy needed)
    kept_key = probs.float().view(torch.int32) + KEPT_FIRST
    key = torch.where(kept, kept_key, raw_probs.float().view(torch.int32))
    return key.topk(k).indices


def stage_numbers(logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """For stage logits [S, V] (raw first): the probabilities [S, V], the removed candidates [S, V] (logit -inf) and
    per stage [S, 3] the candidates kept, the entropy (nats) and the mass removed, sum_i p^(s-1)_i [z^(s)_i = -inf].
    A candidate removed by an earlier stage has p^(s-1)_i = exp(-inf) = 0 exactly, so only what stage s newly
    removed counts; the first stage removes nothing."""
    probs, log_probs = torch.softmax(logits.float(), dim=-1), torch.log_softmax(logits.float(), dim=-1)
    removed = torch.isneginf(logits)
    kept, H = kept_and_entropy(probs, log_probs, removed)
    return probs, removed, torch.stack([kept.float(), H, removed_mass(probs, removed)], dim=-1)


def kept_and_entropy(P: Tensor, logP: Tensor, removed: Tensor) -> tuple[Tensor, Tensor]:
    """For stage rows [..., S, V] (probabilities, log-probabilities, removed candidates): the candidates kept (int32)
    and the entropy H = -sum p log p in nats (a removed candidate adds 0 * 0), [..., S] each. Only the removed
    candidates' -inf is zeroed: a NaN logit keeps H NaN (a sum that skips NaN would report such a row's entropy as 0)."""
    kept = removed.shape[-1] - removed.sum(dim=-1, dtype=torch.int32)
    return kept, -(P * logP.nan_to_num(neginf=0.0)).sum(dim=-1)


def removed_mass(P: Tensor, removed: Tensor) -> Tensor:
    """Per stage [..., S], the mass under the distribution before it of the candidates it removed,
    sum_i p^(s-1)_i [z^(s)_i = -inf]; the first stage removes nothing."""
    first = P.new_zeros(P.shape[:-2] + (1,))
    return torch.cat([first, torch.where(removed[..., 1:, :], P[..., :-1, :], 0.0).sum(dim=-1)], dim=-1)


def stage_rows(raw_logits: Tensor, processed: Tensor, stages: list[tuple[str, Tensor]] | None,
               out: Tensor | None = None) -> Tensor:
    """The distributions of one step (row 0) stacked as the rows of one [S, V] tensor (written into ``out`` if
    given): every recorded stage (raw first, processed last), or raw and processed alone without ``stages``."""
    rows = [z[0] for _, z in stages] if stages else [raw_logits[0], processed[0]]
    return torch.stack(rows) if out is None else torch.stack(rows, out=out)


def pack(token: Tensor, raw_logits: Tensor, processed: Tensor, stages: list[tuple[str, Tensor]] | None,
         top: int, race: Tensor | None = None) -> Tensor:
    """All numbers of one traced step (row 0) in one float32 vector on the device (layout in the module doc):
    :func:`pack_rows` of a block of one step. ``race``: the selector's Exp(1) draws of this step (None: greedy)."""
    return pack_rows(stage_rows(raw_logits, processed, stages)[None], token.reshape(-1)[:1], top,
                     None if race is None else race.reshape(-1, race.shape[-1])[:1], bool(stages))[0]


def pack_rows(L: Tensor, t: Tensor, top: int, race: Tensor | None, stages: bool) -> Tensor:
    """All numbers of K traced steps [K, F] from their distributions L [K, S, V] (raw first, processed last) and
    chosen tokens t [K]; ``race`` [K, V]: each step's Exp(1) draws (None: greedy); ``stages``: the rows of L are the
    recorded stages (per-stage numbers, winners and removed mass are packed), else raw and processed alone.

    Each statistic is one operation over the whole block, so a block of K steps costs about as many tensor
    operations as one step: p = softmax z, log p = log-softmax z (exact 0 for a point mass, exactly -inf for a
    removed candidate), H = -sum p log p (a removed candidate adds 0), counts summed in int32. The
    chosen token's rank under each row, 1 + #{i : z_i > z_t}, serves the raw rank and the deciding stage alike. On a
    CPU each operation costs a fixed few microseconds, so the cheap forms are chosen: softmax and log-softmax rather
    than exp of the log-softmax, a product rather than ``special.entr``. The masks stay bool: comparisons that write
    float32 run faster on a block in the cache, but not inside a run, where the block is cold and four times the
    bytes cost what they save (benchmarks/README.md, Trace). What is not reported is not computed: no alternatives
    for ``top`` 0; no per-stage numbers, winners or removed mass without ``stages``."""
    L = L.float()
    K, S, _ = L.shape
    P, logP = torch.softmax(L, dim=-1), torch.log_softmax(L, dim=-1)
    removed = torch.isneginf(L)
    kept_n, H = kept_and_entropy(P, logP, removed)  # [K, S] each
    at_t = t.reshape(K, 1, 1).expand(K, S, 1)
    z_t = L.gather(2, at_t)  # [K, S, 1] each row's logit of the token
    ranks = chosen_ranks(L, z_t)  # [K, S] (softmax is monotone: the rank by logits is the rank by probability)
    logp_t, p_t = logP.gather(2, at_t)[..., 0], P.gather(2, at_t)[..., 0]
    # the HEAD scalars picked out of one block by one gather (a dozen single-element picks cost a dozen operations);
    # torch.cat promotes the integer and bool parts to float32 as it copies them (ids and counts < 2**24: exact)
    rows = torch.cat([t.reshape(K, 1), torch.isfinite(z_t[:, -1]), p_t, logp_t, ranks, H, kept_n], dim=1)
    parts = [rows.index_select(1, head_index(S, L.device))]
    if top > 0:
        alt = ranked_alternatives(P[:, -1], P[:, 0], ~removed[:, -1], top)  # [K, A]
        parts += [alt, P[:, -1].gather(1, alt), P[:, 0].gather(1, alt)]
    if stages:
        winners, lost = race_winners(L, race_noise(race, L[:, 0]), removed)
        parts += [torch.stack([kept_n.float(), H, removed_mass(P, removed)], dim=-1).reshape(K, -1), winners, ranks,
                  lost]
    return torch.cat(parts, dim=1)


SCORED_BYTES = 64 << 20  # a replayed sequence's distributions packed at once at most (bytes): bounds the temporaries


def scored_rows(raw_logits: Tensor, processed: Tensor, tokens: Tensor) -> Tensor:
    """The HEAD numbers [n, HEAD] of n given tokens ``tokens`` [n], each under its row's raw logits and processed
    logits [n, V] (a replayed sequence: ``score``, ``compare``'s scored rows): :func:`pack_rows` of the raw and
    processed rows alone, no alternatives; ``COLUMN[name]`` says where each number sits. Packed SCORED_BYTES of
    distributions at a time (every number is a row's own: the split changes none), left on the device."""
    n, V = raw_logits.shape
    step = max(1, SCORED_BYTES // (2 * V * 4))
    return torch.cat([pack_rows(torch.stack([raw_logits[a : a + step].float(), processed[a : a + step].float()],
                                            dim=1), tokens[a : a + step], 0, None, False) for a in range(0, n, step)])


def chosen_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """[B] log softmax(z_b)[t_b] of each row's token under logits [B, V] (exactly -inf where a stage removed it):
    the ``logprob`` number of :func:`pack_rows` alone, for a method that reports no other (many, batch)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(1, tokens.reshape(-1, 1))[:, 0]


# A block's distributions at most (bytes), before its steps are traced together. Measured on a CPU
# (benchmarks/README.md, Trace): the trace's cost per step falls with the block (one set of operations for the
# block) down to blocks of about 256 KiB, then rises again (larger temporaries pay fresh pages).
BLOCK_BYTES = 256 << 10


class TraceBlock:
    """Steps whose trace is deferred, to be traced together. Each step's distributions [S, V] (raw first) and race
    draws [V] are copied into one preallocated [K, S, V] (and [K, V]) buffer, reused block after block: a deferred
    step costs one copy and keeps none of its own tensors alive. K is ``steps`` or fewer, so that the buffer holds at
    most BLOCK_BYTES. :meth:`trace` packs the pending steps with one :func:`pack_rows` and one transfer."""

    def __init__(self, steps: int, top: int):
        self.steps, self.top = steps, top
        self.rows: Tensor | None = None  # [K, S, V]
        self.races: Tensor | None = None  # [K, V] float32
        self.ids: list[int] = []
        self.greedy: list[bool] = []

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, token_id: int, raw_logits: Tensor, processed: Tensor, stages: list[tuple[str, Tensor]] | None,
            race: Tensor | None) -> bool:
        """Keep one step (row 0); True when the block is full."""
        if self.rows is None:
            rows = stage_rows(raw_logits, processed, stages)
            S, V = rows.shape
            K = max(1, min(self.steps, BLOCK_BYTES // (S * V * rows.element_size())))
            self.rows = rows.new_empty(K, S, V)
            self.races = rows.new_empty(K, V, dtype=torch.float32)
            self.rows[0].copy_(rows)
        else:
            stage_rows(raw_logits, processed, stages, out=self.rows[len(self.ids)])
        if race is not None:
            self.races[len(self.ids)].copy_(race.reshape(-1, race.shape[-1])[0])
        self.ids.append(token_id)
        self.greedy.append(race is None)
        return len(self.ids) == self.rows.shape[0]

    def trace(self) -> list[list[float]]:
        """The pending steps' packed numbers on the host (one transfer), in order; the block is then empty. A greedy
        step among sampled ones races with E = 1 for every token: g = -log 1 = 0, the plain argmax."""
        n = len(self.ids)
        if n == 0:
            return []
        race = None
        if not all(self.greedy):
            for i in (i for i, g in enumerate(self.greedy) if g):
                self.races[i].fill_(1.0)
            race = self.races[:n]
        chosen = torch.tensor(self.ids, device=self.rows.device)
        host = pack_rows(self.rows[:n], chosen, self.top, race, True).tolist()
        self.ids, self.greedy = [], []
        return host


@functools.lru_cache(maxsize=64)
def head_index(stages: int, device: torch.device) -> Tensor:
    """Where the HEAD scalars sit in [token, finite, p_t (S), log p_t (S), ranks (S), H (S), kept (S)]: token,
    finite, prob and logprob (last row), raw prob and raw logprob (row 0), raw rank, entropy (last), raw entropy,
    kept (last)."""
    S, p, lp, r, h, k = stages, 2, 2 + stages, 2 + 2 * stages, 2 + 3 * stages, 2 + 4 * stages
    return torch.tensor([0, 1, p + S - 1, lp + S - 1, p, lp, r, h + S - 1, h, k + S - 1], device=device)


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
