"""Replay: the chain applied at each position of a given sequence, as the run that produced it applied it.

Row r of a block of logits z [n, V] was computed after the prefix ids[:, :start + r]; its processed logits are

    chain(ids[:, :start + r], z_r)

the same call a decoding step makes. Every caller that holds a sequence and wants the chain's view of it comes here:
``score`` (the text's tokens), speculative verification (the target's rows over the drafts), the served commands and
``check-logprobs`` (the local recomputation of an engine's tokens) and ``compare`` (its scored rows).

* **Reset.** A replay starts where its sequence's prompt ends (:func:`start`): stages that count or read generated
  tokens only (output-only penalties, min-new-tokens, a constraint) count from there, whatever the chain did before.
* **Stateful refusal.** A stage that draws its own coin or carries state from step to step (xtc, mirostat) makes a
  row depend on more than its prefix: such a chain cannot be replayed exactly and is refused.
* **Fast path.** When no stage reads the ids (``chain.uses_ids`` false) the prefix does not enter the result, so the
  whole block is processed in one call; otherwise each row gets its own prefix.
* **Recorded stages.** With :func:`recorded`, each row's logits after every stage, raw first.

Teacher-forced logits (:func:`forced_logits`) are the model's own rows for given tokens, from one forward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..engine.runtime import Runtime
from ..errors import ConfigError
from .chain import Chain
from .registry import BY_NAME


def stateful(names) -> list[str]:
    """The stages among ``names`` that carry state (or draw their own coin) from step to step: the registry row's
    ``state`` need says which."""
    return [name for name in names if "state" in BY_NAME[name].needs]


def refuse_stateful_settings(order, command: str) -> None:
    """Before any model loads: the first stateful stage of a chain ``order`` (the plan's), by its options."""
    for name in stateful(order):
        options = "/".join(p.option for p in BY_NAME[name].params if p.field != "xtc_threshold")
        raise ConfigError(f"{options}: {command} replays the chain over given tokens, and {name} draws its own coin "
                          "or carries state from step to step (no replay of it is exact); drop it for this command")


def refuse_stateful(chain: Chain) -> None:
    """A chain with a stage that carries state (or draws its own coin) from step to step has no replay."""
    if stateful(chain.names):
        raise ConfigError(f"the chain [{', '.join(chain.names)}] carries state from step to step (xtc, mirostat): "
                          "it cannot be replayed over given tokens")


def start(chain: Chain, prompt_len: int) -> None:
    """Before replaying a sequence whose prompt is its first ``prompt_len`` tokens: refuse a stateful chain, then
    tell every stage where the prompt ends."""
    refuse_stateful(chain)
    chain.reset(prompt_len)


def processed(chain: Chain, ids: Tensor, logits: Tensor, start: int) -> Tensor:
    """The chain's output [n, V] (unchecked) for rows z [n, V], row r after the prefix ids[:, :start + r]."""
    if not chain.uses_ids:
        return chain.apply(ids[:, :start].expand(logits.shape[0], -1), logits)
    return torch.cat([chain.apply(ids[:, : start + r], logits[r : r + 1]) for r in range(logits.shape[0])])


def recorded(chain: Chain, ids: Tensor, logits: Tensor, start: int) -> list[list[tuple[str, Tensor]]]:
    """Per row r (prefix ids[:, :start + r]), each stage's logits [V] in order, ("raw", z_r) first."""
    if not chain.uses_ids:
        _, stages = chain.run_recorded(ids[:, :start].expand(logits.shape[0], -1), logits)
        return [[(name, z[r]) for name, z in stages] for r in range(logits.shape[0])]
    out = []
    for r in range(logits.shape[0]):
        _, stages = chain.run_recorded(ids[:, : start + r], logits[r : r + 1])
        out.append([(name, z[0]) for name, z in stages])
    return out


@torch.inference_mode()
def forced_logits(model, prompt_ids: list[int], out_ids: list[int]) -> Tensor:
    """The model's raw logits [len(out_ids), V] (float32) for each given token, teacher-forced in one forward over
    prompt + output (no cache reuse): row i is the distribution out_ids[i] was drawn from."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(out_ids)], dtype=torch.long, device=device)
    runtime = Runtime.create(model, None, capacity=ids.shape[1])
    return runtime.feed(ids, keep="all")[0, len(prompt_ids) - 1 : -1].float()


@torch.inference_mode()
def along(chain: Chain, prompt_ids: list[int], out_ids: list[int], logits: Tensor, record: bool = False):
    """The chain at each position of ``out_ids`` after ``prompt_ids``, as a run applied it (:func:`start`, then
    each row given its own prefix): the processed logits [T, V] (row i: out_ids[i]'s), or with ``record`` per
    position the list of (stage name, logits [V]) starting with ("raw", ...)."""
    start(chain, len(prompt_ids))
    ids = torch.tensor([list(prompt_ids) + list(out_ids)], dtype=torch.long, device=logits.device)
    rows = logits[: len(out_ids)]
    if record:
        return recorded(chain, ids, rows, len(prompt_ids))
    return processed(chain, ids, rows, len(prompt_ids))
