"""Autoregressive decoding: prefill once, then one token per forward through the KV cache.

``decode_tokens`` is the bare loop (token ids, raw and processed logits per step); ``Sampler`` wraps it and turns
each step into a :class:`~decodelab.core.trace.Step` with both distributions labelled. Both are generators, so a
caller can stream steps as they come and an interrupted run keeps what it produced.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from .cache import FullCache, make_cache
from .errors import ConfigError
from .model import forward
from .processors import Chain, empty_chain_error, entropy, log_softmax, stage_table
from .trace import Alternative, StageStat, StageView, Step, TokenProb, TrackedToken, summarize


@dataclass
class StopRules:
    """When generation ends: an EOS id (unless ignored), a stop string in the generated text, -n, or the context."""

    max_new_tokens: int
    eos_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    context_length: int | None = None


def prefill(model, cache: FullCache, ids: Tensor) -> Tensor:
    """Run the whole prompt once; returns the logits [B, V] for the next token."""
    logits = forward(model, ids, cache.model_cache, cache.positions(ids.shape[1]), logits_to_keep=1)
    cache.after_forward()
    return logits[:, -1]


def decode_one(model, cache: FullCache, token: Tensor) -> Tensor:
    """Feed one token per row [B, 1]; returns the logits [B, V] for the token after it."""
    logits = forward(model, token, cache.model_cache, cache.positions(1), logits_to_keep=1)
    cache.after_forward()
    return logits[:, -1]


def check_prompt(prompt_len: int, context_length: int | None) -> None:
    if prompt_len == 0:
        raise ConfigError("PROMPT: the prompt is empty (0 tokens); give some text")
    if context_length is not None and prompt_len >= context_length:
        raise ConfigError(
            f"PROMPT: the prompt is {prompt_len} tokens but the model's context is {context_length}; shorten it"
        )


@dataclass
class DecodeState:
    """Why the loop ended (set when it ends) and the ids it produced."""

    stop_reason: str = "length"
    new_ids: list[int] = field(default_factory=list)


class Decoded(NamedTuple):
    token_id: int
    raw_logits: Tensor  # [V], the model's output
    processed_logits: Tensor  # [V], after the chain: the distribution the selector drew from
    stages: list[tuple[str, Tensor]] | None  # ("raw", logits), then each stage's output ([1, V]); when recorded


def decode_tokens(
    model,
    prompt_ids: list[int],
    chain: Chain,
    selector: Callable[[Tensor], Tensor],
    rules: StopRules,
    detok: Callable[[list[int]], str] | None = None,
    cache: FullCache | None = None,
    state: DecodeState | None = None,
    record: bool = False,
) -> Iterator[Decoded]:
    """Yield one :class:`Decoded` per generated token; ``record`` keeps every stage's logits for the trace."""
    check_prompt(len(prompt_ids), rules.context_length)
    device = next(model.parameters()).device
    cache = cache if cache is not None else make_cache("full", model.config)
    state = state if state is not None else DecodeState()
    # the whole sequence lives in one buffer; the chain sees the prefix view seq[:, :length]
    seq = torch.empty(1, len(prompt_ids) + rules.max_new_tokens, dtype=torch.long, device=device)
    seq[0, : len(prompt_ids)] = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    length = len(prompt_ids)
    logits = prefill(model, cache, seq[:, :length])
    eos = set(rules.eos_ids) if not rules.ignore_eos else set()
    for _ in range(rules.max_new_tokens):
        ids = seq[:, :length]
        if record:
            processed, stages = chain.run_recorded(ids, logits)
        else:
            processed, stages = chain.apply(ids, logits), None
        token = selector.from_logits(processed)
        token_id = int(token)
        if not math.isfinite(float(processed[0, token_id])):  # argmax over an all -inf (or NaN) row
            raise empty_chain_error(chain.names)
        state.new_ids.append(token_id)
        yield Decoded(token_id, logits[0], processed[0], stages)
        seq[0, length] = token_id
        length += 1
        if token_id in eos:
            state.stop_reason = "eos"
            return
        if rules.stop_strings and detok is not None:
            text = detok(state.new_ids)
            if any(s in text for s in rules.stop_strings):
                state.stop_reason = "stop"
                return
        if rules.context_length is not None and length >= rules.context_length:
            state.stop_reason = "context"
            return
        if len(state.new_ids) < rules.max_new_tokens:
            logits = decode_one(model, cache, seq[:, length - 1 : length])
    state.stop_reason = "length"


def ranked_alternatives(probs: Tensor, raw_probs: Tensor, kept: Tensor, top: int) -> Tensor:
    """Token ids of the top alternatives: kept candidates by processed probability, then removed ones by raw."""
    # kept candidates score 1 + p in [1, 2], removed ones their raw p in [0, 1]; float64 keeps the order exact
    score = torch.where(kept, 1.0 + probs.double(), raw_probs.double())
    return torch.topk(score, min(top, score.shape[-1])).indices


def build_step(index: int, position: int, out: Decoded, token_text: Callable[[int], str], top: int) -> Step:
    """Every number of one step, labelled: raw (model softmax) vs processed (what the selector drew from)."""
    token_id = out.token_id
    logp = log_softmax(out.processed_logits)
    raw_logp = log_softmax(out.raw_logits)
    probs, raw_probs = logp.exp(), raw_logp.exp()
    kept = ~torch.isneginf(logp)
    alt_ids = ranked_alternatives(probs, raw_probs, kept, top).tolist() if top > 0 else []
    return Step(
        index=index,
        position=position,
        token_id=token_id,
        token=token_text(token_id),
        prob=float(probs[token_id]),
        logprob=float(logp[token_id]),
        raw_prob=float(raw_probs[token_id]),
        raw_logprob=float(raw_logp[token_id]),
        raw_rank=int((raw_logp > raw_logp[token_id]).sum()) + 1,
        entropy=float(entropy(probs)),
        raw_entropy=float(entropy(raw_probs)),
        kept=int(kept.sum()),
        alternatives=[Alternative(i, token_text(i), float(probs[i]), float(raw_probs[i])) for i in alt_ids],
        stages=[stat for stat, _ in stage_table(out.stages or [])[1:]],
    )


class Sampler:
    """Iterate to get traced steps; afterwards ``stop_reason``, ``new_ids`` and ``summary()`` describe the run."""

    def __init__(self, model, prompt_ids, chain, selector, rules, token_text, detok, top: int = 5):
        self.model, self.prompt_ids, self.chain, self.selector = model, list(prompt_ids), chain, selector
        self.rules, self.token_text, self.detok, self.top = rules, token_text, detok, top
        self.state = DecodeState()
        self.steps: list[Step] = []
        self.seconds = 0.0

    def __iter__(self) -> Iterator[Step]:
        start = time.perf_counter()
        loop = decode_tokens(self.model, self.prompt_ids, self.chain, self.selector, self.rules, self.detok,
                             state=self.state, record=True)
        try:
            for index, out in enumerate(loop):
                step = build_step(index, len(self.prompt_ids) + index, out, self.token_text, self.top)
                self.steps.append(step)
                self.seconds = time.perf_counter() - start
                yield step
        finally:
            self.seconds = time.perf_counter() - start

    def interrupted(self) -> None:
        self.state.stop_reason = "interrupted"

    @property
    def stop_reason(self) -> str:
        return self.state.stop_reason

    @property
    def new_ids(self) -> list[int]:
        return [s.token_id for s in self.steps]

    def summary(self):
        return summarize(self.steps, self.seconds, self.stop_reason)


def next_token_stages(
    model, prompt_ids: list[int], chain: Chain, token_text: Callable[[int], str], top: int = 10,
    context_length: int | None = None,
) -> tuple[list[StageView], list[TrackedToken]]:
    """The next-token distribution after every stage (no generation): per stage its own top tokens, plus the
    union of those tokens followed through all stages (probability and rank after each)."""
    check_prompt(len(prompt_ids), context_length)
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    raw = prefill(model, make_cache("full", model.config), ids)
    _, stages = chain.run_recorded(ids, raw)
    table = stage_table(stages)
    prob_rows = [probs for _, probs in table]
    views = []
    for (name, logits), (stat, probs) in zip(stages, table):
        order = torch.topk(probs, min(top, probs.shape[-1])).indices.tolist()
        views.append(StageView(name, stat.kept, stat.entropy, stat.mass_removed, [
            TokenProb(t, token_text(t), float(logits[0, t]), float(probs[t])) for t in order if probs[t] > 0
        ]))
    union = list(dict.fromkeys(tp.token_id for view in views for tp in view.top))
    final = prob_rows[-1]
    union.sort(key=lambda t: (-float(final[t]), -float(prob_rows[0][t])))
    tracked = []
    for t in union:
        row = TrackedToken(t, token_text(t), float(raw[0, t]), float(prob_rows[0][t]))
        for (name, _), probs in zip(stages, prob_rows):
            p = float(probs[t])
            row.probs[name] = p
            row.ranks[name] = int((probs > probs[t]).sum()) + 1 if p > 0 else None
        tracked.append(row)
    return views, tracked
