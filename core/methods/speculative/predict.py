"""Acceptance predicted offline: ONE teacher-forced forward of the target and of the draft over a text gives, at
every position i, the target's and the draft's processed distributions p_i and q_i (the same chain, the same prefix
ids) and so the probability that a draft at i is accepted, with no generation:

    alpha_i = sum_x min(p_i(x), q_i(x))        (greedy: alpha_i = 1 if argmax p_i == argmax q_i else 0)

because a draft x ~ q_i is accepted with probability min(1, p_i(x) / q_i(x)) (see :mod:`.rule`).

From the alphas, for each gamma, a round that starts at position t with g = min(gamma, N - t - 1) drafts (the text's
N tokens bound the rounds as -n does) accepts k drafts with probability

    P(K = k) = alpha_t .. alpha_{t+k-1} (1 - alpha_{t+k})  (k < g),    P(K = g) = alpha_t .. alpha_{t+g-1},

and emits k + 1 tokens, so the next round starts at t + k + 1. :func:`plan_gamma` walks that renewal exactly
(rho(t) = the probability a round starts at t, rho(0) = 1): expected rounds R = sum_t rho(t), drafts D = sum_t rho(t)
g_t, judged and accepted drafts per depth, and

    E[tokens per round from t] = 1 + alpha_t + alpha_t alpha_{t+1} + .. + alpha_t .. alpha_{t+g-1}   (position-dependent)
                              = (1 - alpha^(g+1)) / (1 - alpha)                                  (iid alpha)
    predicted speedup        = N / (R + c D)        (plain decoding: N target steps; a round: one verify + g c)
                             = (1 - a^(g+1)) / ((1 - a)(g c + 1))    (iid, full rounds: the summary's formula)

with c the draft step / target step cost ratio. The walk is exact for greedy verification over the greedy output
(the alphas are 0 or 1: it replays the run); at temperature > 0 it assumes a draft's acceptance is alpha_i on THIS
text, while a real run's later prefix depends on which token was accepted, so it is a prediction, not an identity.

Over the run's own output it is an identity in expectation: every judged draft at position i is accepted with
probability exactly alpha_i given everything before (the prefix is the emitted text), so
sum over judged drafts of (accepted - alpha_i) has mean 0 and variance sum alpha_i (1 - alpha_i) (:func:`conditional`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

from ...sampling import replay
from ...sampling.chain import Chain
from ...sampling.distribution import softmax

# ---------------------------------------------------------------------------------------------------------------
# the teacher-forced rows
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Rows:
    """The processed p and q at every position of a text's continuation (row i: the token after prompt + new[:i])."""

    p: Tensor  # [N, V] target, processed (greedy: a point mass on its argmax)
    q: Tensor  # [N, V] draft, processed
    alpha: Tensor  # [N] sum_x min(p, q)
    tokens: list[int]  # the continuation's ids


def processed_rows(model, chain: Chain, prompt_ids: list[int], new_ids: list[int]) -> Tensor:
    """The chain on one forward's logits for the N positions that predict ``new_ids`` (row i follows prompt +
    new[:i]): the replay every method shares (:func:`decodelab.core.sampling.replay.along`)."""
    if not new_ids:
        return torch.zeros(0, model.config.vocab_size)
    return replay.along(chain, prompt_ids, new_ids, replay.forced_logits(model, prompt_ids, new_ids))


def point_mass_of_argmax(processed: Tensor) -> Tensor:
    return torch.nn.functional.one_hot(processed.argmax(dim=-1), processed.shape[-1]).float()


def teacher_forced(target, draft, chain: Chain, prompt_ids: list[int], new_ids: list[int], greedy: bool) -> Rows:
    """One forward of each model over prompt + text; p, q and alpha at every position of the text."""
    pt = processed_rows(target, chain, prompt_ids, new_ids)
    qt = processed_rows(draft, chain, prompt_ids, new_ids)
    if greedy:  # verification compares argmaxes: p and q are point masses
        p, q = point_mass_of_argmax(pt), point_mass_of_argmax(qt)
    else:
        p, q = softmax(pt), softmax(qt)
    return Rows(p, q, torch.minimum(p, q).sum(dim=-1).clamp(0.0, 1.0), list(new_ids))


# ---------------------------------------------------------------------------------------------------------------
# the renewal walk per gamma
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class GammaPlan:
    gamma: int
    rounds: float  # expected verification rounds over the text
    drafted: float
    judged: float  # drafts judged: the accepted ones + the first rejected one per round
    accepted: float
    acceptance_rate: float  # accepted / judged (the summary's a)
    per_position_acceptance: list  # per depth j: accepted there / judged there (None if never reached)
    tokens_per_round: float  # N / rounds (position-dependent)
    iid_tokens_per_round: float  # (1 - a^(g+1)) / (1 - a) with a = the mean alpha
    predicted_speedup: float | None  # N / (rounds + c drafted); None without a cost ratio
    iid_predicted_speedup: float | None  # (1 - a^(g+1)) / ((1 - a)(g c + 1))

    def to_dict(self) -> dict:
        return asdict(self)


def iid_tokens(a: float, g: int) -> float:
    return g + 1.0 if a >= 1.0 else (1.0 - a ** (g + 1)) / (1.0 - a)


def plan_gamma(alpha: list[float], gamma: int, cost_ratio: float | None = None) -> GammaPlan:
    """The renewal walk above over the alphas of an N-token text."""
    return walk(alpha, gamma, cost_ratio, None)


def walk(alpha: list[float], gamma: int, cost_ratio: float | None, drafts_at) -> GammaPlan:
    """The walk; ``drafts_at(t)`` (None: gamma) caps the drafts of a round that starts at t (a policy that verifies
    only a prefix of the block)."""
    n = len(alpha)
    rho = [0.0] * (n + 1)
    rho[0] = 1.0
    rounds = drafted = judged = accepted = 0.0
    reached_at, accepted_at = [0.0] * gamma, [0.0] * gamma
    for t in range(n):
        r = rho[t]
        if r == 0.0:
            continue
        g = max(min(gamma if drafts_at is None else drafts_at(t), n - t - 1), 0)
        rounds += r
        drafted += r * g
        survive = 1.0  # P(the first j drafts of this round accepted)
        for j in range(g):
            reached_at[j] += r * survive
            rho[t + j + 1] += r * survive * (1.0 - alpha[t + j])  # rejected at depth j: j + 1 tokens emitted
            survive *= alpha[t + j]
            accepted_at[j] += r * survive
        rho[t + g + 1] += r * survive  # all g accepted: g tokens and the bonus
    judged, accepted = sum(reached_at), sum(accepted_at)
    mean = sum(alpha) / n if n else 0.0
    iid = iid_tokens(mean, gamma)
    return GammaPlan(
        gamma=gamma, rounds=rounds, drafted=drafted, judged=judged, accepted=accepted,
        acceptance_rate=accepted / judged if judged else 0.0,
        per_position_acceptance=[a / s if s > 0 else None for a, s in zip(accepted_at, reached_at)],
        tokens_per_round=n / rounds if rounds else 0.0,
        iid_tokens_per_round=iid,
        predicted_speedup=n / (rounds + cost_ratio * drafted) if cost_ratio is not None and rounds else None,
        iid_predicted_speedup=iid / (gamma * cost_ratio + 1.0) if cost_ratio is not None else None,
    )


# ---------------------------------------------------------------------------------------------------------------
# against an executed run
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Conditional:
    """Measured acceptance against alpha on the judged drafts of an executed run (its own output as the text)."""

    judged: int
    accepted: int
    expected_accepted: float  # sum of alpha_i over the judged drafts
    std: float  # sqrt(sum alpha_i (1 - alpha_i)): the sampling error of the accepted count
    z: float | None  # (accepted - expected) / std; None when std is 0 (greedy: then they must be equal)
    measured_rate: float
    predicted_rate: float

    def to_dict(self) -> dict:
        return asdict(self)


def judged_positions(rounds, prompt_len: int) -> list[tuple[int, bool]]:
    """(index into the new tokens, accepted) of every judged draft of the traced rounds."""
    out = []
    for r in rounds:
        t = r.position - prompt_len
        for j in range(min(r.accepted + 1, r.drafted)):
            out.append((t + j, j < r.accepted))
    return out


def conditional(alpha: list[float], rounds, prompt_len: int) -> Conditional:
    pairs = [(alpha[i], acc) for i, acc in judged_positions(rounds, prompt_len) if i < len(alpha)]
    judged = len(pairs)
    acc = sum(1 for _, a in pairs if a)
    expected = sum(a for a, _ in pairs)
    var = sum(a * (1.0 - a) for a, _ in pairs)
    std = math.sqrt(var)
    return Conditional(judged, acc, expected, std, (acc - expected) / std if std > 0 else None,
                       acc / judged if judged else 0.0, expected / judged if judged else 0.0)


@dataclass
class Prediction:
    """What ``speculate --predict`` reports: the alphas, their decay by draft depth, and a plan per gamma."""

    source: str  # "run" (the executed run's output) | "plain" (a plain target continuation) | "text" (given)
    tokens: int
    verification: str  # greedy | speculative-sampling
    alpha: list[float]
    mean_alpha: float
    cost_ratio: float | None  # draft step / target step, measured by plain decoding of each (None: not measured)
    plans: list[GammaPlan] = field(default_factory=list)
    conditional: Conditional | None = None
    policies: list = field(default_factory=list)  # :class:`.policies.PolicyReport` per policy, at --gamma (sampled)
    policies_gamma: int | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["plans"] = [p.to_dict() for p in self.plans]
        d["conditional"] = self.conditional.to_dict() if self.conditional else None
        d["policies"] = [p.to_dict() for p in self.policies]
        return d


def predict(rows: Rows, gammas: list[int], cost_ratio: float | None, source: str, greedy: bool,
            rounds=None, prompt_len: int = 0) -> Prediction:
    alpha = rows.alpha.tolist()
    out = Prediction(source, len(alpha), "greedy" if greedy else "speculative-sampling", alpha,
                     sum(alpha) / len(alpha) if alpha else 0.0, cost_ratio,
                     [plan_gamma(alpha, g, cost_ratio) for g in gammas])
    if rounds is not None:
        out.conditional = conditional(alpha, rounds, prompt_len)
    return out
