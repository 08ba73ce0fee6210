"""Autoregressive decoding: prefill once, then one token per forward through the runtime.

``decode_tokens`` is the bare loop (token ids, raw and processed logits per step); ``Sampler`` is the traced run:
each step becomes a :class:`~decodelab.core.trace.Step` with both distributions labelled, every number of it moved
to the host in one transfer. Both are generators, so a caller can stream steps as they come and an interrupted run
keeps what it produced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from .kv import CacheSpec
from .processors import Chain, stage_table
from .run import Run, Stopwatch
from .runtime import Runtime
from .stats import Numbers, pack, unpack
from .step import StopChecker, StopRules, TokenBuffer, check_prompt, check_selected, select
from .trace import Alternative, StageStat, StageView, Step, TokenProb, TrackedToken, summarize
from .why import decide

__all__ = ["StopRules", "DecodeState", "Decoded", "decode_tokens", "Sampler", "next_token_stages", "check_prompt"]


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
    numbers: Numbers | None = None  # every trace number of the step, on the host (when traced)
    state: dict[str, float] | None = None  # stateful stages' numbers this step used (mirostat.mu, xtc.coin, ...)


def decode_tokens(
    model,
    prompt_ids: list[int],
    chain: Chain,
    selector,
    rules: StopRules,
    detok: Callable[[list[int]], str] | None = None,
    runtime: Runtime | None = None,
    state: DecodeState | None = None,
    record: bool = False,
    top: int = 0,
    watch: Stopwatch | None = None,
    cache: CacheSpec | None = None,
) -> Iterator[Decoded]:
    """Yield one :class:`Decoded` per generated token. ``record`` also computes every trace number of the step
    (stages, alternatives: ``top``) and moves them to the host in the step's one transfer; otherwise the one
    transfer is the token id and the check that the chain left it a finite logit."""
    check_prompt(len(prompt_ids), rules.context_length)
    runtime = runtime or Runtime.create(model, cache, capacity=rules.capacity(len(prompt_ids)))
    state = state if state is not None else DecodeState()
    watch = watch or Stopwatch(runtime.device)
    buf = TokenBuffer(prompt_ids, rules.capacity(len(prompt_ids)), runtime.device)
    stopper = StopChecker(rules, detok)
    chain.reset(len(prompt_ids))
    watch.start()
    logits = runtime.prefill(buf.prefix())
    watch.lap("prefill")
    while True:
        sel = select(chain, selector, buf.prefix(), logits, record)
        states = chain.states() if record else []
        chain.accept(sel.token)
        step_state = None
        if record:
            watch.lap("loop")
            packed = pack(sel.token, logits, sel.processed, sel.stages, top, getattr(selector, "last_race", None))
            if states:  # the stages' numbers travel in the same transfer
                packed = torch.cat([packed] + [v.reshape(-1)[:1].float() for _, v in states])
            host = packed.tolist()
            if states:
                step_state = dict(zip([k for k, _ in states], host[len(host) - len(states):]))
                host = host[: len(host) - len(states)]
            numbers = unpack(host, top, logits.shape[-1], len(sel.stages))
            watch.lap("trace")
            token_id, finite = numbers.token_id, numbers.finite
        else:
            token_id, finite = torch.stack([sel.token[0].float(), sel.finite[0].float()]).tolist()
            token_id, numbers = int(token_id), None
        check_selected(bool(finite), chain, sel.processed)
        state.new_ids.append(token_id)
        buf.append([token_id], sel.token.view(1, 1))
        watch.lap("loop")
        watch.pause()
        yield Decoded(token_id, logits[0], sel.processed[0], sel.stages, numbers, step_state)
        watch.resume()
        reason = stopper.check(state.new_ids, buf.length)
        if reason is not None:
            state.stop_reason = reason
            watch.lap("loop")
            return
        logits = runtime.feed(buf.last())


def build_step(index: int, position: int, out: Decoded, token_text: Callable[[int], str],
               stage_names: list[str], greedy: bool = True) -> Step:
    """A traced step from its host numbers: raw (model softmax) vs processed (what the selector drew from)."""
    n = out.numbers
    decision = decide(stage_names, n.token_id, n.winners, n.ranks, n.removed, greedy) if n.winners else None
    return Step(
        index=index, position=position, token_id=n.token_id, token=token_text(n.token_id),
        prob=n.prob, logprob=n.logprob, raw_prob=n.raw_prob, raw_logprob=n.raw_logprob, raw_rank=n.raw_rank,
        entropy=n.entropy, raw_entropy=n.raw_entropy, kept=n.kept,
        alternatives=[Alternative(i, token_text(i), p, r) for i, p, r in n.alternatives],
        stages=[StageStat(name, kept, h, mass) for name, (kept, h, mass) in zip(stage_names, n.stages)][1:],
        decided_by=decision.decided_by if decision else None, why=decision.why if decision else None,
        state=dict(out.state or {}),
    )


class Sampler(Run):
    """The traced run of ``sample``: iterate for steps; afterwards ``stop_reason``, ``new_ids``, ``summary()``."""

    def __init__(self, model, prompt_ids, chain, selector, rules, token_text, detok, top: int = 5,
                 cache: CacheSpec | None = None, runtime: Runtime | None = None, record: bool = True):
        self.model, self.prompt_ids, self.chain, self.selector = model, list(prompt_ids), chain, selector
        self.rules, self.token_text, self.detok, self.top = rules, token_text, detok, top
        self.cache, self.runtime, self.record = cache, runtime, record
        self.state = DecodeState()
        self.steps: list[Step] = []
        self.watch: Stopwatch | None = None

    def __iter__(self) -> Iterator[Step]:
        runtime = self.runtime or Runtime.create(self.model, self.cache,
                                                 capacity=self.rules.capacity(len(self.prompt_ids)))
        self.runtime = runtime
        self.watch = Stopwatch(runtime.device)
        names = ["raw"] + self.chain.names
        loop = decode_tokens(self.model, self.prompt_ids, self.chain, self.selector, self.rules, self.detok,
                             runtime=runtime, state=self.state, record=self.record, top=self.top, watch=self.watch)
        for index, out in enumerate(loop):
            if not self.record:
                continue
            self.watch.resume()
            step = build_step(index, len(self.prompt_ids) + index, out, self.token_text, names,
                              getattr(self.selector, "last_race", None) is None)
            self.steps.append(step)
            self.watch.lap("trace")
            self.watch.pause()
            yield step

    @property
    def stop_reason(self) -> str:
        return self.state.stop_reason

    @stop_reason.setter
    def stop_reason(self, value: str) -> None:
        self.state.stop_reason = value

    @property
    def new_ids(self) -> list[int]:
        """The tokens delivered: traced steps (an interrupt can land between a token and its trace), or every
        generated token when untraced."""
        return [s.token_id for s in self.steps] if self.record else list(self.state.new_ids)

    def summary(self):
        return summarize(self.steps, self.watch.timing if self.watch else None, self.stop_reason,
                         len(self.new_ids))


def next_token_stages(
    model, prompt_ids: list[int], chain: Chain, token_text: Callable[[int], str], top: int = 10,
    context_length: int | None = None, cache: CacheSpec | None = None,
) -> tuple[list[StageView], list[TrackedToken]]:
    """The next-token distribution after every stage (no generation): per stage its own top tokens, plus the
    union of those tokens followed through all stages (probability and rank after each)."""
    check_prompt(len(prompt_ids), context_length)
    runtime = Runtime.create(model, cache, capacity=len(prompt_ids))
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=runtime.device)
    raw = runtime.prefill(ids)
    chain.reset(len(prompt_ids))
    return stage_views(ids, raw, chain, token_text, top)


def stage_views(ids: Tensor, raw: Tensor, chain: Chain, token_text: Callable[[int], str],
                top: int = 10) -> tuple[list[StageView], list[TrackedToken]]:
    """The views of :func:`next_token_stages` for given raw logits [1, V] after the ids [1, T] (any source: a model,
    or a distribution typed in by hand, see :func:`decodelab.core.dist.dist_stages`)."""
    _, stages = chain.run_recorded(ids, raw)
    table = stage_table(stages)
    probs = torch.stack([p for _, p in table])  # [S, V]
    logits = torch.stack([z[0] for _, z in stages])  # [S, V]
    S, k = probs.shape[0], min(top, probs.shape[-1])
    top_ids = probs.topk(k, dim=-1).indices  # [S, k]: each stage's own top tokens
    cols = top_ids.flatten()  # [S * k]: every such token, followed through all stages
    followed = probs[:, cols]  # [S, S * k]
    ranks = (probs[:, None, :] > followed[:, :, None]).sum(dim=-1) + 1
    # one transfer: the tokens, their logit at each stage's top, their raw logit, probabilities and ranks everywhere
    host = torch.cat([cols.float(), logits.gather(1, top_ids).flatten(), raw[0, cols], followed.flatten(),
                      ranks.float().flatten()]).tolist()
    n = S * k
    ids = [int(t) for t in host[:n]]
    stage_logits, raw_logits = host[n : 2 * n], host[2 * n : 3 * n]
    p_at = lambda s, c: host[3 * n + s * n + c]  # noqa: E731  probability of column c after stage s
    rank_at = lambda s, c: int(host[3 * n + S * n + s * n + c])  # noqa: E731
    views, first_col = [], {}
    for s, ((name, _), (stat, _)) in enumerate(zip(stages, table)):
        entries = []
        for c in range(s * k, (s + 1) * k):
            if p_at(s, c) > 0:
                entries.append(TokenProb(ids[c], token_text(ids[c]), stage_logits[c], p_at(s, c)))
                first_col.setdefault(ids[c], c)
        views.append(StageView(name, stat.kept, stat.entropy, stat.mass_removed, entries))
    tracked = []
    for t, c in first_col.items():
        row = TrackedToken(t, token_text(t), raw_logits[c], p_at(0, c))
        for s, (name, _) in enumerate(stages):
            row.probs[name] = p_at(s, c)
            row.ranks[name] = rank_at(s, c) if p_at(s, c) > 0 else None
        tracked.append(row)
    tracked.sort(key=lambda r: (-r.probs[stages[-1][0]], -r.raw_prob))
    return views, tracked
