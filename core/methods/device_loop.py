"""A decode loop that reads nothing from the device until it ends (issue 34, item 2): the step a CUDA graph captures.

Each step is one function of device tensors, :func:`device_step`: the chain on the logits, the selector, and the
step's statistics (token, raw and processed log-probability of it, raw and processed entropy, whether the chain left
it a finite logit) stacked into one row, all on the device. The loop writes the token into a preallocated id buffer
and the row into a preallocated [n, STATS] buffer, so no step synchronises; the host reads both once, at the end
(``decode_on_device``). A chain whose stages read the host (top-p's partial sort decides there how many candidates
hold mass p) still runs, with those reads.

The statistics are those of ``sample``'s trace (core/trace/stats.py), for the tokens kept:
  raw logprob = log softmax(z)[t], processed = log softmax(chain(z))[t], entropy = -sum p log p (nats).
Stop handling: EOS and stop strings are checked after the loop, on the host, and the tokens past a stop are dropped
(they were decoded and are not delivered: the loop is for fixed-length decoding, as benchmarks and speculative
drafts use it, not a replacement for ``sample``'s stop rules); an empty chain ends the run at its first step.

``step_fn(chain, selector, device)`` is the function CUDA graphs capture on a GPU (``torch.compile(...,
mode="reduce-overhead")``); on the CPU it is the same function, eager, so its logic is tested there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..engine.runtime import Runtime
from ..sampling.chain import Chain
from ..sampling.distribution import entropy, log_softmax

STATS = ("token", "raw_logprob", "logprob", "raw_entropy", "entropy", "finite")


def step_stats(raw: Tensor, processed: Tensor, token: Tensor) -> Tensor:
    """[STATS] float on the device for row 0: token id, raw and processed log-probability of it, raw and processed
    entropy, finite (1.0 / 0.0)."""
    raw_lp, lp = log_softmax(raw[0]), log_softmax(processed[0])
    t = token[0]
    return torch.stack([t.float(), raw_lp[t], lp[t], entropy(raw_lp.exp()), entropy(lp.exp()),
                        torch.isfinite(processed[0, t]).float()])


def device_step(chain: Chain, selector, ids: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
    """One step, no host read of its own: (token [1], statistics [STATS])."""
    processed = chain.apply(ids, logits)
    token = selector.from_logits(processed)
    chain.accept(token)  # stateful stages (mirostat's mu) take the token on the device
    return token, step_stats(logits, processed, token)


def step_fn(chain: Chain, selector, device, capture: bool = True):
    """The step as a function of (ids, logits): on CUDA, compiled for CUDA graphs where the chain reads no ids (a
    prefix that grows every step would be a new shape each time) and carries no state; elsewhere, or with
    ``capture`` off, eager."""

    def step(ids: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
        return device_step(chain, selector, ids, logits)

    kind = torch.device(device).type
    if capture and kind == "cuda" and not chain.uses_ids and not chain.stateful:
        captured = torch.compile(step, mode="reduce-overhead", dynamic=False)

        def replay(ids: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
            torch.compiler.cudagraph_mark_step_begin()  # the caller copies the outputs before the next replay
            return captured(ids, logits)

        return replay
    return step


@dataclass
class DeviceDecode:
    """What the loop delivered: the tokens kept and each one's statistics (host numbers, one transfer)."""

    new_ids: list[int] = field(default_factory=list)
    stats: list[dict[str, float]] = field(default_factory=list)
    stop_reason: str = "length"


def decode_on_device(runtime: Runtime, prompt_ids: list[int], chain: Chain, selector, n: int,
                     eos_ids: tuple[int, ...] = (), capture: bool = True) -> DeviceDecode:
    """Prefill, then ``n`` steps with every token and statistic kept on the device; one transfer at the end. Tokens
    after the first EOS, or after a step whose chain left no finite candidate (stop_reason ``empty_chain``, that
    step's token dropped), are not delivered."""
    device = runtime.device
    length = len(prompt_ids)
    ids = torch.zeros(1, length + n, dtype=torch.long, device=device)
    ids[0, :length] = torch.tensor(prompt_ids)
    rows = torch.empty(n, len(STATS), device=device)
    step = step_fn(chain, selector, device, capture)
    chain.reset(length)
    logits = runtime.prefill(ids[:, :length])
    for i in range(n):
        # a chain that reads no ids gets the whole buffer: one shape every step (a captured graph is per shape)
        token, row = step(ids[:, : length + i] if chain.uses_ids else ids, logits)
        ids[0, length + i] = token[0]
        rows[i] = row
        if i + 1 < n:
            logits = runtime.feed(ids[:, length + i : length + i + 1])
    return delivered(rows.tolist(), eos_ids)


def delivered(host_rows: list[list[float]], eos_ids: tuple[int, ...]) -> DeviceDecode:
    """The host side of the one transfer: rows up to the first stop."""
    out = DeviceDecode()
    for row in host_rows:
        values = dict(zip(STATS, row))
        if not values["finite"]:
            out.stop_reason = "empty_chain"
            break
        token = int(values["token"])
        out.new_ids.append(token)
        out.stats.append(values)
        if token in eos_ids:
            out.stop_reason = "eos"
            break
    return out
