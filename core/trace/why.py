"""Why this token: which stage of the chain decided a step's outcome.

The selector picks ``argmax_i (z_i + g_i)`` over the processed logits z, with g_i = -log E_i (E_i ~ Exp(1), the
step's race draws; g = 0 for greedy). Running that same race on every stage's logits z^(s) (the raw logits first)
gives the token each stage's distribution would have produced with the same draws, w_s = argmax_i (z^(s)_i + g_i).
The last stage's winner is the chosen token c (unless the token was forced). So:

* if w_s = c for every s, the model decided: its own distribution, with the same draws, already gives c
  (greedy: c is the raw argmax);
* otherwise the deciding stage is the one after which the winner became c for good, s* = 1 + max{s : w_s != c}:
  either it removed the previous winner w_{s*-1} (its logit went to -inf: "top-p removed the raw argmax"), or it
  reshaped the logits so that c overtook it ("temperature lifted it from rank 3", c's rank before that stage).

A truncation filter (top-k, top-p, min-p, typical-p, bans) only ever sets logits to -inf, so it changes the
winner exactly when it removes the current winner; temperature, soft-capping, penalties and biases change it by
re-scoring. All of it is computed on the device with the step's other trace numbers (:mod:`decodelab.core.trace.stats`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..sampling import registry

MODEL = "model"
FORCED = "forced"


def race_noise(race: Tensor | None, like: Tensor) -> Tensor | None:
    """g = -log E for a race draw E [V] (the selector's); None for greedy (the argmax is the race without noise)."""
    if race is None:
        return None
    return -race.reshape(like.shape).float().log()


def chosen_ranks(z: Tensor, z_t: Tensor) -> Tensor:
    """For logits [..., S, V] and the chosen token's logit in each row [..., S, 1]: its rank there, 1 + the number of strictly
    larger logits (counted in int32: exact, and cheaper than int64 on a CPU)."""
    return (z > z_t).sum(dim=-1, dtype=torch.int32) + 1


def race_winners(z: Tensor, noise: Tensor | None, removed: Tensor) -> tuple[Tensor, Tensor]:
    """For stage logits [..., S, V], the race noise [..., V] (None: greedy) and the removed candidates [..., S, V]
    (z = -inf): each row's winner w_s = argmax_i z_i + g_i [..., S], and whether stage s removed w_{s-1}
    [..., S - 1]. The leading dimensions, if any, are steps traced together."""
    # max's indices are argmax's (the first of tied maxima, both), and max runs faster on a CPU
    winners = (z if noise is None else z + noise.unsqueeze(-2)).max(dim=-1).indices
    return winners, removed[..., 1:, :].gather(-1, winners[..., :-1, None])[..., 0]


class Decision(NamedTuple):
    decided_by: str  # a stage name, "model" or "forced"
    why: str  # one sentence


def split(host: list[float], n_stages: int) -> tuple[list[int], list[int], list[bool]]:
    s = n_stages
    return ([int(v) for v in host[:s]], [int(v) for v in host[s : 2 * s]],
            [bool(v) for v in host[2 * s : 3 * s - 1]])


def decide(names: list[str], chosen: int, winners: list[int], ranks: list[int], removed: list[bool],
           greedy: bool) -> Decision:
    """The deciding stage from the per-stage winners (``names``: "raw" first, then the chain's stages)."""
    if not winners:
        return Decision(MODEL, "no stage recorded")
    if winners[-1] != chosen:
        return Decision(FORCED, "not the selector's pick")
    off = [s for s, w in enumerate(winners) if w != chosen]
    pick = "argmax" if greedy else "pick (same draws)"
    if not off:
        return Decision(MODEL, f"the model's own {pick}; no stage changed it")
    s = off[-1] + 1
    stage = names[s]
    before = "the raw " + pick if s == 1 else f"the {pick} after {names[s - 1]}"
    if removed[s - 1]:
        return Decision(stage, f"{stage} removed {before}")
    row = registry.BY_NAME.get(stage)  # a stage of the registry's (a library's own processor: none)
    verb = "brought it in" if row is not None and row.biases else "lifted it"
    return Decision(stage, f"{stage} {verb} from rank {ranks[s - 1]}")
