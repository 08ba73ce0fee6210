"""Streaming under a bounded KV policy: score a text longer than the context chunk by chunk (perplexity, cache
tokens and KV bytes over time), and the attention-sink diagnosis (how much weight late queries put on the first
positions).

Scoring: token t (t >= 1) is scored by the raw model log-probability log p(x_t | what the policy kept of x_<t),
from the logits of the forward that fed x_{t-1}. Chunks of ``chunk`` tokens are fed in one forward each; with
``chunk=1`` (the default here) every query sees exactly what the policy keeps (StreamingLLM), a larger chunk lets
its queries also see the chunk (see :mod:`decodelab.core.kv.window`). ``full`` and ``recompute`` do not depend on
the chunk size.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from .kv import CacheSpec
from .run import synchronize
from .runtime import Runtime


@dataclass
class ChunkScore:
    """One reported span of the stream: tokens [start, end), their summed raw negative log-likelihood."""

    start: int
    end: int
    tokens: int  # tokens scored in the span (the first token of the text has no prediction)
    nll: float  # sum of -log p(x_t | kept context), natural log, raw model probabilities
    perplexity: float  # exp(nll / tokens)
    cache_tokens: int  # positions the cache holds after the span (policy.stored)
    kv_bytes: int  # real bytes of the cached tensors after the span
    seconds: float  # wall time of the span's forwards (device-synchronised)

    def as_dict(self) -> dict:
        return asdict(self)


@torch.inference_mode()
def score_stream(model, ids: list[int] | Tensor, spec: CacheSpec, chunk: int = 1, report_every: int = 256):
    """Yield one :class:`ChunkScore` per ``report_every`` tokens (rounded up to whole chunks) of ``ids``."""
    runtime = Runtime.create(model, spec)
    device = runtime.device
    ids = torch.as_tensor(ids, dtype=torch.long, device=device).view(1, -1)
    n = ids.shape[1]
    prev: Tensor | None = None  # logits [V] that predict the first token of the next chunk
    span = _Span(0)
    for start in range(0, n, chunk):
        piece = ids[:, start : start + chunk]
        synchronize(device)
        t0 = time.perf_counter()
        logits = runtime.feed(piece, keep="all")[0]  # [c, V]
        # predictions for piece[0] (from the previous chunk) and piece[1:] (from this one)
        if prev is None:  # the text's first token has no prediction
            preds, targets = logits[:-1], piece[0, 1:]
        else:
            preds, targets = torch.cat([prev.unsqueeze(0), logits[:-1]]), piece[0]
        nll = -torch.log_softmax(preds.float(), dim=-1).gather(1, targets.view(-1, 1)).sum()
        prev = logits[-1]
        nll_value = float(nll)  # the one transfer of the chunk
        synchronize(device)
        span.add(nll_value, targets.numel(), time.perf_counter() - t0)
        end = start + piece.shape[1]
        if end - span.start >= report_every or end == n:
            yield span.close(end, runtime.policy.stored, runtime.policy.nbytes())
            span = _Span(end)


class _Span:
    def __init__(self, start: int):
        self.start, self.nll, self.tokens, self.seconds = start, 0.0, 0, 0.0

    def add(self, nll: float, tokens: int, seconds: float) -> None:
        self.nll += nll
        self.tokens += tokens
        self.seconds += seconds

    def close(self, end: int, stored: int, nbytes: int) -> ChunkScore:
        ppl = math.exp(self.nll / self.tokens) if self.tokens else float("nan")
        return ChunkScore(self.start, end, self.tokens, self.nll, ppl, stored, nbytes, self.seconds)


def perplexity(spans: list[ChunkScore], start: int = 0) -> float:
    """exp of the mean NLL over the spans starting at or after ``start``."""
    chosen = [s for s in spans if s.start >= start]
    tokens = sum(s.tokens for s in chosen)
    return math.exp(sum(s.nll for s in chosen) / tokens) if tokens else float("nan")


# --- the attention-sink diagnosis ----------------------------------------------------------------------------------


@dataclass
class HeadSinkMass:
    layer: int
    head: int
    sink_mass: float  # mean over late queries of the attention weight summed over the first `sinks` positions
    average_mass: float  # mean over late queries of `sinks` x the mean weight on one other visible position
    ratio: float  # sink_mass / average_mass: 1 = the first positions get what any position gets; >> 1 = a sink

    def as_dict(self) -> dict:
        return asdict(self)


def sink_profile(weights: list[Tensor], sinks: int, late_from: int) -> list[HeadSinkMass]:
    """From per-layer attention weights [B, H, T, T] of one causal forward: for every query q >= late_from, the
    weight on keys 0..sinks-1 against ``sinks`` times the mean weight on one of the other q + 1 - sinks visible
    keys; averaged over the late queries (and rows)."""
    rows = []
    for layer, w in enumerate(weights):
        w = w.float()
        late = w[:, :, late_from:, :]  # [B, H, Q, T]
        q_index = torch.arange(late_from, w.shape[-1], device=w.device)
        on_sinks = late[..., :sinks].sum(-1)  # [B, H, Q]
        others = (late.sum(-1) - on_sinks) / (q_index + 1 - sinks).clamp(min=1)  # mean weight on one other key
        sink_mass = on_sinks.mean(dim=(0, 2))
        average = (sinks * others).mean(dim=(0, 2))
        for head in range(w.shape[1]):
            s, a = float(sink_mass[head]), float(average[head])
            rows.append(HeadSinkMass(layer, head, s, a, s / a if a > 0 else float("inf")))
    return rows


# --- generation past the context -----------------------------------------------------------------------------------


def slot_ranges(policy) -> list[list[int]]:
    """What the next forward attends to: [original start, original end, assigned start] per contiguous run of
    tokens (full: everything at its own position; recompute: the last W - 1 tokens, re-encoded from position 0)."""
    own = getattr(policy, "slot_ranges", None)
    if own is not None:
        return own()
    size = getattr(policy, "size", None)
    if policy.name == "recompute" and size is not None:
        start = max(policy.seen - (size - 1), 0)
        return [[start, policy.seen, 0]] if policy.seen > start else []
    return [[0, policy.seen, 0]] if policy.seen else []


def cache_state(policy) -> dict:
    """The per-step cache fields of `stream` (after the forward that produced the step's logits)."""
    evicted = list(getattr(policy, "last_evicted", (0, 0)))
    return {"cache_tokens": policy.stored, "kv_bytes": policy.nbytes(), "evicted": evicted if evicted[1] > evicted[0]
            else [], "slots": slot_ranges(policy)}
