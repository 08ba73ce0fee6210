"""`stream`: decoding and scoring past the model's context under a bounded KV policy (window, sinks, recompute).

* Generation (:class:`StreamGenerate`): the ``sample`` loop under the policy, with no context stop for models with
  RoPE (positions past the trained context are the point); every step adds the cache state after the forward that
  produced its logits: ``cache_tokens``, ``kv_bytes``, ``evicted`` (original positions [start, end) that forward
  evicted) and ``slots`` (the slot map as runs [original start, original end, assigned start]).
* Scoring (:class:`StreamScore`): a long text through ``score``'s :class:`~decodelab.core.methods.score.Scorer`
  (raw model log-probabilities, teacher-forced), reported per span of ``chunk`` tokens with the cache tokens, KV bytes and
  tokens/s at the end of the span. Tokens per forward: ``feed`` (default 1: every query sees exactly what the
  policy keeps, as StreamingLLM; a larger feed lets a forward's queries also see the rest of it, see
  :mod:`decodelab.core.kv.window`). A feed-invariant policy (``full``, ``recompute``, ``static``, ``paged``:
  ``KVPolicy.feed_invariant``) gives the same numbers at any feed, so :func:`compare_policies` feeds it ``chunk``
  tokens at a time.
* The attention-sink diagnosis (:func:`decodelab.core.analysis.attention.attention_profile`): per layer and head,
  the weight late queries put on the first S positions against S times the weight of an average other position.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields

from ..engine.forward import rotary_parameters
from ..engine.run import Origin, Run
from ..engine.runtime import runtime_for
from ..engine.stopping import StopRules, check_unbounded
from ..errors import ConfigError
from ..kv import KVPolicy, compresses_once, feed_invariant, make_policy, parse_cache_spec, parse_policy_list
from ..kv.kept import document_part, kept_after
from ..sampling.chain import Chain, make_chain
from ..sampling.semantics import plan as semantics_plan, trims_stop
from ..sampling.settings import ChainSettings
from ..settings import _check, as_dict
from ..trace import reasoning
from ..trace.records import Step
from .sample import Sampler, SampleSettings, validate_sample
from .score import Scorer, ScoreSettings


@dataclass(frozen=True)
class StreamSettings(SampleSettings):
    cache: str = "sinks:sinks=4,recent=252"
    max_new_tokens: int = 600  # past the bundled models' 512 positions
    limit: int | None = None  # score only the first N tokens of the text
    chunk: int = 256  # tokens per reported span
    feed: int = 1  # tokens per forward when scoring
    window: int = 256  # --compare-policies: the cache size of every bounded policy
    sinks: int = 4  # --compare-policies and --attention: the first S positions
    compare_policies: bool = False
    attention: bool = False
    policies: str | None = None  # --compare-policies: the specs to rank (default: policy_set's place-based ones)
    prefill: int | None = None  # tokens of the first forward when scoring (the prompt a press compresses)
    probe: bool = False  # the retrieval probe (core/analysis/probe.py) over the text
    probe_keys: tuple[str, ...] = ()  # its passkeys (default: two random 5-digit keys from --seed)
    probe_depths: str = "0.1,0.5,0.9"  # where the needle goes, fractions of the filler


def validate_stream(s: StreamSettings) -> None:
    validate_sample(s)
    check_unbounded(s.max_new_tokens, "stream runs past the context")
    for key in ("chunk", "feed", "window"):
        _check(getattr(s, key) >= 1, key, getattr(s, key), "must be an integer >= 1")
    _check(s.prefill is None or s.prefill >= 1, "prefill", s.prefill, "must be an integer >= 1")
    probe_depths(s)
    _check(all(k.strip() for k in s.probe_keys), "probe_keys", ",".join(s.probe_keys),
           "a key is empty; give keys such as 71432,58210")
    if s.policies is not None:
        if not s.compare_policies:
            raise ConfigError("--policies: ranks policies with --compare-policies; add it (or give one --cache)")
        for spec in parse_policy_list(s.policies).values():
            if compresses_once(spec) and s.prefill is None:
                raise ConfigError(f"--policies {spec}: it compresses once, after the prompt, and a scored text has no "
                                  "prompt; give --prefill N (the first N tokens are its prompt)")
    _check(s.limit is None or s.limit >= 2, "limit", s.limit, "must be an integer >= 2")
    _check(0 <= s.sinks < s.window, "sinks", s.sinks, f"must be >= 0 and below --window ({s.window})")




def probe_depths(s: StreamSettings) -> tuple[float, ...]:
    """--probe-depths '0.1,0.5,0.9' -> floats in [0, 1]."""
    try:
        depths = tuple(float(d) for d in s.probe_depths.split(",") if d.strip())
    except ValueError:
        depths = (-1.0,)
    _check(bool(depths) and all(0 <= d <= 1 for d in depths), "probe_depths", s.probe_depths,
           "must be fractions in [0, 1], e.g. 0.1,0.5,0.9")
    return depths


def policy_set(s: StreamSettings) -> dict[str, str]:
    """--compare-policies: label -> spec: with --policies, full and the policies given (labelled as typed);
    else every place-based bounded cache holding --window tokens."""
    if s.policies is not None:
        given = {label: str(spec) for label, spec in parse_policy_list(s.policies).items() if spec.name != "full"}
        return {"full": "full", **given}
    w, k = s.window, s.sinks
    return {"full": "full", "window keep": f"window:size={w},positions=keep",
            "window rerotate": f"window:size={w},positions=rerotate",
            "sinks keep": f"sinks:sinks={k},recent={w - k},positions=keep",
            "sinks rerotate": f"sinks:sinks={k},recent={w - k},positions=rerotate",
            "recompute": f"recompute:size={w + 1}"}  # W + 1: the span a query of a W-token cache attends to


# --- scoring -------------------------------------------------------------------------------------------------------


@dataclass
class StreamChunk:
    """One span of a scored stream: scored positions [start, end)."""

    start: int
    end: int
    tokens: int
    perplexity: float  # exp(-mean raw log-probability) over the span
    cache_tokens: int  # positions the cache holds after the span
    kv_bytes: int  # real bytes of the cached tensors after the span
    tokens_per_s: float  # tokens scored in the span / its wall time

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class StreamSummary:
    policy: str
    tokens: int  # scored (or generated) tokens
    perplexity: float  # raw model perplexity over them
    max_cache_tokens: int
    kv_bytes_peak: int
    tokens_per_s: float
    stop_reason: str
    chunks: list[StreamChunk] = field(default_factory=list)
    mean_logprob: float | None = None  # generation: processed (what the selector drew from)
    kl_mean: float | None = None  # against the full cache (--compare-policies): mean KL(full || policy), nats
    top1_agreement: float | None = None  # fraction of tokens whose argmax equals the full cache's
    top1_flips: int | None = None  # tokens whose argmax differs from the full cache's

    def to_dict(self) -> dict:
        return asdict(self)


def score_settings(s: StreamSettings, feed: int | None = None) -> ScoreSettings:
    chain = {f.name: getattr(s, f.name) for f in fields(ChainSettings)}
    return ScoreSettings(**chain, limit=s.limit, chunk=s.chunk, feed=feed or s.feed, prefill=s.prefill, top=0)


class StreamScore(Run):
    """Iterate for one :class:`StreamChunk` per ``chunk`` scored tokens; ``summary()`` afterwards."""

    def __init__(self, model, token_ids: list[int], chain: Chain, token_text, settings: StreamSettings,
                 cache: str | None = None, feed: int | None = None, against_full: bool = False):
        """``against_full``: score the full cache in lockstep (KL and top-1 flips against it, as ``score
        --against-cache full`` with the same feed)."""
        self.spec = parse_cache_spec(cache) if cache else settings.cache_spec
        self.chunk = settings.chunk
        self.against_full = against_full  # the full cache against itself is not run: KL 0, no flips
        reference = dict(reference=model, reference_cache=parse_cache_spec("full"), reference_name="full") \
            if against_full and self.spec.name != "full" else {}
        self.scorer = Scorer(model, token_ids, chain, token_text, score_settings(settings, feed), self.spec,
                             **reference)
        self.chunks: list[StreamChunk] = []
        self.stop_reason = "end"
        self.seconds = 0.0

    @property
    def total(self) -> int:
        return self.scorer.total

    @property
    def new_ids(self) -> list[int]:
        return []

    def __iter__(self) -> Iterator[StreamChunk]:
        nll, count = 0.0, 0
        last = time.perf_counter()
        for row in self.scorer:
            nll -= row.raw_logprob
            count += 1
            if count == self.chunk or row.position == self.scorer.total:
                now = time.perf_counter()
                policy = self.scorer.runtime.policy
                chunk = StreamChunk(row.position + 1 - count, row.position + 1, count, math.exp(nll / count),
                                    policy.stored, policy.nbytes(), count / max(now - last, 1e-9))
                self.seconds += now - last
                self.chunks.append(chunk)
                yield chunk
                nll, count = 0.0, 0
                last = time.perf_counter()

    def interrupt(self) -> None:
        super().interrupt()
        self.scorer.interrupt()

    def document(self) -> dict:
        """``stream --text-file``'s JSON document: a step per span of scored tokens, no generated text, the summary,
        the kept map of a score-based cache."""
        kept = kept_after(getattr(self.scorer, "runtime", None), len(self.scorer.ids))
        return self.origin.head(mode="score", steps=self.chunks, text="", token_ids=[], summary=self.summary(),
                                **document_part(kept))

    def summary(self) -> StreamSummary:
        chunks = self.chunks
        tokens = sum(c.tokens for c in chunks)
        nll = sum(c.tokens * math.log(c.perplexity) for c in chunks)
        out = StreamSummary(str(self.spec), tokens, math.exp(nll / tokens) if tokens else float("nan"),
                            max((c.cache_tokens for c in chunks), default=0),
                            max((c.kv_bytes for c in chunks), default=0),
                            tokens / self.seconds if self.seconds else float("nan"), self.stop_reason, chunks)
        steps = self.scorer.steps
        if self.against_full and self.spec.name == "full" and steps:
            out.kl_mean, out.top1_agreement, out.top1_flips = 0.0, 1.0, 0
        elif self.scorer.reference is not None and steps:
            out.kl_mean = sum(r.kl for r in steps) / len(steps)
            out.top1_flips = sum(not r.agree for r in steps)
            out.top1_agreement = sum(r.agree for r in steps) / len(steps)  # as score's summary computes it
        return out


def compare_policies(model, token_ids: list[int], chain: Chain, token_text, settings: StreamSettings,
                     info=None) -> Iterator[tuple[str, StreamScore | str]]:
    """One :class:`StreamScore` per policy of :func:`policy_set` (label, run), or (label, why) for a policy the
    model cannot run (re-rotation without RoPE): the caller iterates each run."""
    for label, spec in policy_set(settings).items():
        exact_at_any_feed = feed_invariant(parse_cache_spec(spec))  # the policy declares it (full, recompute, ...)
        try:
            run = StreamScore(model, token_ids, chain, token_text, settings, spec,
                              feed=max(settings.chunk, settings.feed) if exact_at_any_feed else None,
                              against_full=True)
            if info is not None:

                make_policy(run.spec, info)  # refuse here (one line) rather than after the other policies ran
        except ConfigError as exc:
            yield label, str(exc)
            continue
        yield label, run


# --- generation ----------------------------------------------------------------------------------------------------


@dataclass
class StreamStep(Step):
    cache_tokens: int = 0
    kv_bytes: int = 0
    evicted: list[int] = field(default_factory=list)  # original positions [start, end) evicted by this forward
    slots: list[list[int]] = field(default_factory=list)  # [original start, original end, assigned start] runs


class Spans:
    """The summary of a generated stream built as its steps come: the spans of ``chunk`` steps (raw perplexity,
    cache tokens and bytes after the span's last step) and the largest cache, so no step need be kept."""

    def __init__(self, chunk: int):
        self.chunk, self.closed = chunk, []
        self.max_cache_tokens = self.max_kv_bytes = 0
        self._start, self._count, self._raw, self._last = 0, 0, 0.0, None

    def add(self, step: StreamStep) -> None:
        if self._count == 0:
            self._start = step.position
        self._count += 1
        self._raw += step.raw_logprob
        self._last = step
        self.max_cache_tokens = max(self.max_cache_tokens, step.cache_tokens)
        self.max_kv_bytes = max(self.max_kv_bytes, step.kv_bytes)
        if self._count == self.chunk:
            self.closed.append(self._span())
            self._count, self._raw = 0, 0.0

    def _span(self) -> StreamChunk:
        last = self._last
        return StreamChunk(self._start, last.position + 1, self._count, math.exp(-self._raw / self._count),
                           last.cache_tokens, last.kv_bytes, float("nan"))

    def spans(self) -> list[StreamChunk]:
        """Every span so far, the last one partial."""
        return self.closed + ([self._span()] if self._count else [])


class StreamGenerate(Run):
    """The ``sample`` loop under a bounded policy, past the context; steps carry the cache state. ``keep_steps=False``
    (a stream written as it comes): no step is kept, and the memory of the run does not grow with its steps."""

    def __init__(self, lm, prompt_ids: list[int], chain: Chain | None, settings: StreamSettings,
                 keep_steps: bool = True):
        """``chain`` None: the settings' chain, drawing XTC's coin from the selector's generator (as `sample`)."""

        self.lm, self.settings, self.spec = lm, settings, settings.cache_spec
        # RoPE models run on past their trained positions (the point); absolute positions end at the context
        context = None if rotary_parameters(lm.model) is not None else lm.context_length
        rules = StopRules(settings.max_new_tokens, tuple(lm.eos_ids), tuple(settings.stop), settings.ignore_eos,
                          context, tuple(settings.stop_id))
        selector = semantics_plan(settings).make_selector(settings.seed, lm.device)
        chain = chain if chain is not None else make_chain(lm, settings, getattr(selector, "generator", None))
        self.runtime = runtime_for(lm, self.spec, len(prompt_ids) + settings.max_new_tokens,
                                   compile=settings.compile)
        self.sampler = Sampler(lm.model, prompt_ids, chain, selector, rules, lm.token_text, lm.decode, settings.top,
                               runtime=self.runtime, keep_steps=False)
        self.keep_steps = keep_steps
        self.steps: list[StreamStep] = []
        self.spans = Spans(settings.chunk)
        self.chain, self.selector = chain, selector
        self.rules, self.trim_stop = rules, trims_stop(settings)

    @property
    def stop_reason(self) -> str:
        return self.sampler.stop_reason

    @stop_reason.setter
    def stop_reason(self, value: str) -> None:
        self.sampler.stop_reason = value

    @property
    def new_ids(self) -> list[int]:
        return self.sampler.new_ids

    def __iter__(self) -> Iterator[StreamStep]:
        for step in self.sampler:
            state = cache_state(self.runtime.policy)
            out = StreamStep(**{f.name: getattr(step, f.name) for f in fields(Step)}, **state)
            self.spans.add(out)
            if self.keep_steps:
                self.steps.append(out)
            yield out

    def text(self) -> str:
        return self.delivered(self.lm.decode)[1]

    def document(self) -> dict:
        """``stream``'s JSON document when it generates: the steps with their cache state, the text, the summary,
        the kept map of a score-based cache, the reasoning / answer split when the settings or the model name
        thinking markers (core/trace/reasoning.py)."""
        kept = kept_after(self.runtime, len(self.origin.prompt_ids))
        ids, text = self.delivered(self.lm.decode)
        split = reasoning.for_run(self.settings, self.lm, self.origin.prompt_ids, self.steps)
        return self.origin.head(mode="generate", selector=self.selector.name, steps=self.steps, text=text,
                                token_ids=ids, summary=self.summary(), **document_part(kept), **split)

    def summary(self) -> StreamSummary:
        base = self.sampler.summary()
        return StreamSummary(str(self.spec), self.sampler.tally.steps, base.raw_perplexity,
                             self.spans.max_cache_tokens, self.spans.max_kv_bytes, base.tokens_per_s, self.stop_reason,
                             self.spans.spans(), base.mean_logprob)


# --- generation past the context -----------------------------------------------------------------------------------


def stream_run(lm, settings: StreamSettings, prompt_text: str, prompt_ids: list[int], chain: Chain | None = None,
               keep_steps: bool = True) -> StreamGenerate:
    """``stream``'s generating run with its document head (the registry's build); ``chain`` None: the settings'
    chain, sharing the selector's generator (as `sample`)."""
    run = StreamGenerate(lm, prompt_ids, chain, settings, keep_steps=keep_steps)
    run.origin = Origin.of("stream", lm, as_dict(settings), run.chain.names, prompt_text, prompt_ids)
    return run


def stream_score_run(lm, settings: StreamSettings, text: str, token_ids: list[int],
                     chain: Chain | None = None) -> StreamScore:
    """``stream --text-file``'s scoring run with its document head."""
    chain = chain or make_chain(lm, settings)
    run = StreamScore(lm.model, token_ids, chain, lm.token_text, settings)
    run.origin = Origin.of("stream", lm, as_dict(settings), chain.names, text, token_ids)
    return run


def cache_state(policy: KVPolicy) -> dict:
    """The per-step cache fields of `stream` (after the forward that produced the step's logits); ``slots``: what
    the next forward attends to, as the policy declares it (``KVPolicy.slot_ranges``)."""
    evicted = list(policy.last_evicted)
    return {"cache_tokens": policy.stored, "kv_bytes": policy.nbytes(), "evicted": evicted if evicted[1] > evicted[0]
            else [], "slots": policy.slot_ranges()}
