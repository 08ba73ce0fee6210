"""Autoregressive decoding: prefill once, then one token per forward through the runtime.

``decode_tokens`` is the bare loop (token ids, raw and processed logits per step); ``Sampler`` is the traced run:
each step becomes a :class:`~decodelab.core.trace.records.Step` with both distributions labelled, every number of it
moved to the host in one transfer (the step's own, or, traced in blocks, its block's). Both are generators, so a caller can stream steps as they come and an
interrupted run keeps what it produced. ``SampleSettings`` are the settings of ``sample`` (and the base of every
method that generates).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from ..engine.models import LoadedModel
from ..engine.run import Origin, Run, Stopwatch
from ..engine.warmup import warm_up
from ..engine.runtime import Runtime, runtime_for
from ..engine.loops import parse_repetition_stop
from ..engine.stopping import StopChecker, StopRules, stop_rules
from ..engine.tokens import TokenBuffer, check_prompt
from ..inputs import check_text
from ..kv import CacheSpec, require
from ..kv.kept import document_part, kept_after
from ..sampling.chain import Chain, make_chain, validate_chain
from ..sampling.semantics import plan as semantics_plan, trims_stop
from ..sampling.settings import ChainSettings
from ..sampling.step import check_selected, read_selected, select
from ..settings import _check, as_dict
from ..trace import reasoning
from ..trace.records import Alternative, StageStat, Step, Tally, summarize
from ..trace.stats import Numbers, TraceBlock, kept_ids, pack, unpack
from ..trace.why import decide


REPORT_BLOCK = 64  # the most steps traced together for a consumer that reports the steps at the end


@dataclass(frozen=True)
class SampleSettings(ChainSettings):
    max_new_tokens: int = 64
    seed: int = 0
    top: int = 5
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_id: tuple[int, ...] = ()  # token ids that end the run (stop_reason "stop")
    trim_stop: bool | None = None  # leave the stop string (or stop id) out of the text; None: the semantics' own
    compile: bool = False  # torch.compile the one-token decode step (needs cache=static)
    repetition_stop: str | None = None  # vLLM's repetition_detection: "max_pattern_size=P,min_count=C[,...]"


def validate_sample(s: SampleSettings) -> None:
    validate_chain(s)
    for token_id in s.stop_id:
        _check(token_id >= 0, "stop_id", token_id, "must be a token id >= 0")
    _check(s.max_new_tokens >= 1, "max_new_tokens", s.max_new_tokens, "must be >= 1")
    _check(s.top >= 0, "top", s.top, "must be >= 0")
    _check(0 <= s.seed < 2**64, "seed", s.seed, "must be an integer in [0, 2**64)")
    for text in s.stop:
        check_text("--stop", text)
        _check(text != "", "stop", "''", "an empty stop string matches everywhere; give some text")
    if s.repetition_stop is not None:
        parse_repetition_stop(s.repetition_stop)
    if s.compile:

        require(s.cache_spec, {"compile"}, "--compile")


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
    race: Tensor | None = None  # deferred trace: the selector's Exp(1) draws of the step (None: greedy)


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
    defer: bool = False,
) -> Iterator[Decoded]:
    """Yield one :class:`Decoded` per generated token. ``record`` also computes every trace number of the step
    (stages, alternatives: ``top``) and moves them to the host in the step's one transfer; otherwise the one
    transfer is the token id and the check that the chain left it a finite logit. ``defer`` (with ``record``): the
    step is yielded with its stages and race draws and no ``numbers``, for the caller to trace many steps in one
    block (:class:`~decodelab.core.trace.stats.TraceBlock`), and its one transfer is the untraced one; a chain with
    stateful stages is traced step by step all the same (their numbers are read as the step uses them)."""
    check_prompt(len(prompt_ids), rules.context_length)
    runtime = runtime or Runtime.create(model, cache, capacity=rules.capacity(len(prompt_ids)))
    state = state if state is not None else DecodeState()
    watch = watch or Stopwatch(runtime.device)
    buf = TokenBuffer(prompt_ids, rules.capacity(len(prompt_ids)), runtime.device)
    stopper = StopChecker(rules, detok)
    chain.reset(len(prompt_ids))
    watch.timing.warmup_s += warm_up(runtime.model, runtime.spec)  # first-call costs, before the timed part
    watch.start()
    logits = runtime.prefill(buf.prefix())
    watch.lap("prefill")
    while True:
        sel = select(chain, selector, buf.prefix(), logits, record)
        states = chain.states() if record else []
        chain.accept(sel.token)
        step_state, deferred = None, record and defer and not states
        if deferred:
            (token_id, finite), numbers = read_selected(sel), None
        elif record:
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
            (token_id, finite), numbers = read_selected(sel), None
        check_selected(bool(finite), chain, sel.processed)
        state.new_ids.append(token_id)
        buf.append([token_id], sel.token.view(1, 1))
        watch.lap("loop")
        watch.pause()
        race = getattr(selector, "last_race", None) if deferred else None
        yield Decoded(token_id, logits[0], sel.processed[0], sel.stages, numbers, step_state, race)
        watch.resume()
        reason = stopper.check(state.new_ids, buf.length)
        if reason is not None:
            state.stop_reason = reason
            watch.lap("loop")
            return
        logits = runtime.feed(buf.last())
        if runtime.compile_s is not None and watch.timing.compile_s is None:  # the first compiled call
            watch.set_aside("loop", runtime.compile_s, "compile")


def build_step(index: int, position: int, n: Numbers, state: dict[str, float] | None,
               token_text: Callable[[int], str], stage_names: list[str], greedy: bool = True) -> Step:
    """A traced step from its host numbers: raw (model softmax) vs processed (what the selector drew from)."""
    decision = decide(stage_names, n.token_id, n.winners, n.ranks, n.removed, greedy) if n.winners else None
    return Step(
        index=index, position=position, token_id=n.token_id, token=token_text(n.token_id),
        prob=n.prob, logprob=n.logprob, raw_prob=n.raw_prob, raw_logprob=n.raw_logprob, raw_rank=n.raw_rank,
        entropy=n.entropy, raw_entropy=n.raw_entropy, kept=n.kept,
        alternatives=[Alternative(i, token_text(i), p, r) for i, p, r in n.alternatives],
        stages=[StageStat(name, kept, h, mass) for name, (kept, h, mass) in zip(stage_names, n.stages)][1:],
        decided_by=decision.decided_by if decision else None, why=decision.why if decision else None,
        state=dict(state or {}),
    )


class Sampler(Run):
    """The traced run of ``sample``: iterate for steps; afterwards ``stop_reason``, ``new_ids``, ``summary()``.
    ``keep_steps=False``: the steps are yielded and not kept (``steps`` stays empty; the summary comes from their
    :class:`Tally`), for a consumer that writes each as it comes. ``block`` > 1: up to that many steps are traced
    together in one :func:`~decodelab.core.trace.stats.pack_rows` (one set of tensor operations and one transfer for
    the block), so the steps come in bursts, for a consumer that reports them at the end; an interrupt or an early end traces what is pending
    into ``steps``."""

    def __init__(self, model, prompt_ids, chain, selector, rules, token_text, detok, top: int = 5,
                 cache: CacheSpec | None = None, runtime: Runtime | None = None, record: bool = True,
                 keep_steps: bool = True, kept: bool = False, block: int = 1):
        self.model, self.prompt_ids, self.chain, self.selector = model, list(prompt_ids), chain, selector
        self.rules, self.token_text, self.detok, self.top = rules, token_text, detok, top
        self.cache, self.runtime, self.record, self.keep_steps = cache, runtime, record, keep_steps
        self.state = DecodeState()
        self.steps: list[Step] = []
        self.tally = Tally()
        self.watch: Stopwatch | None = None
        self.kept = kept  # also record, per step, the ids that survive each stage (--kept-ids)
        self.kept_sets: list[dict] = []  # {index, stages: [{name, kept, ids}]} per step
        self.block = 1 if kept else max(1, block)  # the kept ids are read from each step's own stages
        self._block = TraceBlock(self.block, top)  # deferred steps not yet traced
        self._pending: list[int] = []  # their indices
        self.decode = detok
        self.resumed: list[int] = []  # a resumed run's saved tokens (set by Branched): delivered before the new ones
        self.settings: SampleSettings | None = None  # what it delivers and reports by (set by build_sampler)
        self.lm: LoadedModel | None = None  # the model it ran (set by sample_run): its markers for the split
        self.loop_part: dict = {}  # a repetition stop's loop and who kept it (analysis/loops.py explain)

    def __iter__(self) -> Iterator[Step]:
        runtime = self.runtime or Runtime.create(self.model, self.cache,
                                                 capacity=self.rules.capacity(len(self.prompt_ids)))
        self.runtime = runtime
        self.watch = Stopwatch(runtime.device)
        loop = decode_tokens(self.model, self.prompt_ids, self.chain, self.selector, self.rules, self.detok,
                             runtime=runtime, state=self.state, record=self.record, top=self.top, watch=self.watch,
                             defer=self.block > 1)
        for index, out in enumerate(loop):
            if not self.record:
                continue
            if out.numbers is None:  # deferred: traced with its block
                self.watch.resume()
                full = self._block.add(out.token_id, out.raw_logits[None], out.processed_logits[None], out.stages,
                                       out.race)
                self._pending.append(index)
                self.watch.lap("trace")
                self.watch.pause()
                if full:
                    yield from self._trace_pending()
                continue
            self.watch.resume()
            step = self._keep(index, out.numbers, out.state, getattr(self.selector, "last_race", None) is None)
            if self.kept:
                self.kept_sets.append({"index": index, "stages": kept_ids(out.stages)})
            self.watch.lap("trace")
            self.watch.pause()
            yield step
        yield from self._trace_pending()

    def _keep(self, index: int, numbers: Numbers, state: dict[str, float] | None, greedy: bool) -> Step:
        step = build_step(index, len(self.prompt_ids) + index, numbers, state, self.token_text,
                          ["raw"] + self.chain.names, greedy)
        self.tally.add(step)
        if self.keep_steps:
            self.steps.append(step)
        return step

    def _trace_pending(self) -> list[Step]:
        """Trace the deferred steps as one block (:meth:`~decodelab.core.trace.stats.TraceBlock.trace`: one set of
        operations, one transfer)."""
        pending, greedy, self._pending = self._pending, list(self._block.greedy), []
        if not pending:
            return []
        self.watch.resume()
        vocab, n_stages = self._block.rows.shape[-1], self._block.rows.shape[1]
        host = self._block.trace()
        steps = [self._keep(index, unpack(row, self.top, vocab, n_stages), None, g)
                 for index, row, g in zip(pending, host, greedy)]
        self.watch.lap("trace")
        self.watch.pause()
        return steps

    def interrupt(self) -> None:
        self._trace_pending()
        super().interrupt()

    def end(self, reason: str) -> None:
        self._trace_pending()
        super().end(reason)

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
        return self.state.new_ids[: self.tally.steps] if self.record else list(self.state.new_ids)

    def summary(self):
        return summarize(self.steps if self.keep_steps else self.tally, self.watch.timing if self.watch else None, self.stop_reason,
                         len(self.new_ids))

    def text(self) -> str:
        return self.delivered(self.detok, self.resumed + list(self.new_ids))[1]

    def kv_kept(self):
        """The kept map of the run's cache (None: no run yet, or a policy that keeps by place)."""
        prompt = len(self.origin.prompt_ids) if self.origin is not None else len(self.prompt_ids)  # resumed: the first
        return kept_after(self.runtime, prompt)

    def document(self) -> dict:
        """``sample``'s JSON document: the head with the selector (and the semantics, the kept sets when asked),
        the steps, the delivered text and ids, the summary, the kept map of a score-based cache, the reasoning /
        answer split when the settings or the model name thinking markers (core/trace/reasoning.py), the loop
        that stopped it when it was explained (core/analysis/loops.py: ``explain``)."""
        s, kept = self.settings, self.kv_kept()
        extra = {"selector": self.selector.name}
        if s is not None and s.semantics is not None:
            extra["semantics"] = semantics_plan(s).describe()
        if self.kept:
            extra["kept_sets"] = self.kept_sets
        ids, text = self.delivered(self.detok, self.resumed + list(self.new_ids))
        return self.origin.head(**extra, steps=self.steps, text=text, token_ids=ids, summary=self.summary(),
                                **document_part(kept), **self.reasoning_part(), **self.loop_part)

    def reasoning_part(self) -> dict:
        """``{"reasoning": ...}``: the split of the traced steps after the prompt the model continued (a resumed
        run's: the prompt and the saved tokens); ``{}`` without markers."""
        if self.lm is None or self.settings is None:
            return {}
        return reasoning.for_run(self.settings, self.lm, self.prompt_ids, self.steps)


# --- sample and probs ----------------------------------------------------------------------------------------------


def build_sampler(lm: LoadedModel, settings: SampleSettings, prompt_ids: list[int], chain: Chain | None = None,
                  record: bool = True, kept: bool = False, block: int = 1) -> Sampler:
    selector = semantics_plan(settings).make_selector(settings.seed, lm.device)
    chain = chain or make_chain(lm, settings, getattr(selector, "generator", None))
    rules = stop_rules(lm, settings)
    runtime = runtime_for(lm, settings.cache_spec, len(prompt_ids) + rules.max_new_tokens,
                          compile=settings.compile)
    run = Sampler(lm.model, prompt_ids, chain, selector, rules, lm.token_text, lm.decode, settings.top,
                  runtime=runtime, record=record, kept=kept, block=block)
    run.settings = settings
    run.trim_stop = trims_stop(settings)
    return run


def sample_run(lm: LoadedModel, settings: SampleSettings, prompt_text: str, prompt_ids: list[int],
               context_ids: list[int] | None = None, summary_only: bool = False, **parts) -> Sampler:
    """``sample``'s run with its document head (the registry's build): ``context_ids`` (a resumed run: the prompt
    and the saved tokens) is what the model continues; ``summary_only``: its steps are read at the end (traced in
    blocks); ``parts``: :func:`build_sampler`'s."""
    if summary_only:
        parts.setdefault("block", REPORT_BLOCK)
    run = build_sampler(lm, settings, context_ids if context_ids is not None else prompt_ids, **parts)
    run.origin = Origin.of("sample", lm, as_dict(settings), run.chain.names, prompt_text, prompt_ids)
    run.lm = lm
    return run
