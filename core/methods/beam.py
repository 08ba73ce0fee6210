"""Beam search with length normalization, transformers' semantics, and a beam-by-beam trace.

The search (what ``model.generate(num_beams=B, do_sample=False)`` of transformers 5 does, batch of one prompt)
----------------------------------------------------------------------------------------------------------------
B live beams are extended together, one forward per step over all of them (batch = beams); the KV cache of the
prompt is computed once and its rows are gathered after every step to follow the surviving parents (no recompute).

At each step, for live beam b with decoding score s_b (s = 0 for the first beam and -1e9 for the others at the
start, so the first step expands one copy of the prompt) and next-token logits z_b:

    l_b = log_softmax(z_b)                       the model's own log-probabilities ("raw")
    d_b = chain(ids_b, l_b)                      the processor chain runs on log-probabilities, as transformers
                                                 does for beam search; no renormalization afterwards
    c_{b,v} = s_b + d_{b,v}                      candidate (b, v): its decoding sum_logprob

The K = max(2, 1 + #eos) * B best candidates over all (b, v) are ranked by c (torch.topk). A candidate *finishes*
when its token is an EOS id or it reaches the last allowed length; only finishing candidates ranked among the
first B of the K may enter the pool of finished hypotheses, scored

    score = sum_logprob / norm(L)                L = generated tokens of the hypothesis (EOS included)

and the pool keeps the B best scores. The next live beams are the B best non-finishing candidates (the pool of K
guarantees B of them). Each hypothesis also carries raw_sum_logprob = sum of l_{b,v} of its tokens: its
log-probability under the unprocessed model, which the decoding score is not.

Length normalization (``length_norm``, penalty a = ``length_penalty``, P = prompt tokens):

    hf                norm(L) = L ** a                          (transformers; L excludes the prompt)
    gnmt              norm(L) = ((5 + L) / 6) ** a              (Wu et al. 2016, GNMT)
    prompt-inclusive  norm(L) = (P + L) ** a                    (the length counts the prompt, as vLLM does)
    none              norm(L) = 1                               (raw sum of log-probabilities; a ignored)

a > 0 favours longer hypotheses, a < 0 shorter ones, a = 0 is the raw sum.

When the search ends (``early_stopping``, transformers' meaning)
------------------------------------------------------------------
After each step, with t generated tokens so far, N = max new tokens and s* the best live beam's sum_logprob:

* the last allowed length is reached: every candidate of that step finished ("length");
* ``True``: as soon as the pool holds B hypotheses ("all-finished");
* ``False`` (the default): when the pool holds B hypotheses and s* / norm(t) <= the pool's worst score
  ("no-improvement": a heuristic, since a longer hypothesis can still score better when a > 0);
* ``"never"``: as False but with s* / norm(N) when a > 0, the best score a live beam could still reach, so the
  result is the exact best under the normalized score within N tokens.

All scores are float32 tensor operations in the order transformers uses, so scores agree to the last bit on the
same logits and token ids agree with ``generate``. raw_sum_logprob is summed in float64 (it is reported, never
ranked), so with no processors it can differ from sum_logprob in the seventh significant digit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from ..engine.models import LoadedModel
from ..engine.run import Origin, Run, Stopwatch
from ..engine.runtime import Runtime
from ..engine.tokens import TokenBuffer, check_prompt
from ..engine.warmup import warm_up
from ..errors import ConfigError
from ..inputs import parse_float
from ..kv import CacheSpec, require
from ..sampling.chain import (
    Chain,
    empty_chain_error,
    make_chain,
    refuse_stepwise_stages,
    validate_chain,
)
from ..sampling import registry
from ..sampling.settings import ChainSettings
from ..settings import _check, as_dict
from ..trace import reasoning

NORMS = ("hf", "gnmt", "prompt-inclusive", "none")
EARLY_STOPPING = {"true": True, "false": False, "never": "never"}
START_SCORE = -1e9  # transformers' initial score of every beam but the first: all start from one prompt


# --- settings ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BeamSettings(ChainSettings):
    """What `decodelab beam` runs. Sampling-only stages of ChainSettings must stay None (see validate_beam)."""

    beams: int = 4
    num_return: int | None = None  # None: every hypothesis of the pool (= beams)
    length_penalty: float = 1.0
    length_norm: str = "hf"
    early_stopping: str = "false"
    max_new_tokens: int = 32
    ignore_eos: bool = False

    @property
    def returned(self) -> int:
        return self.beams if self.num_return is None else self.num_return

    @property
    def early(self) -> bool | str:
        return EARLY_STOPPING[str(self.early_stopping).strip().lower()]


MAX_BEAMS = 256  # one batched forward of this many rows per step; more is not a workbench's search
MAX_PENALTY = 10.0  # L^a for a context of 10^6 tokens stays within float range: 10^60 (a = 10), 10^-60 (a = -10)


def check_beams_fit_vocabulary(beams: int, vocab_size: int) -> None:
    """The first step expands one prompt into at most V distinct continuations; with B > V the other live beams
    would extend transformers' -1e9 placeholder rows and could be returned as hypotheses scored near -1e9."""
    if beams > vocab_size:
        raise ConfigError(f"--beams {beams}: must be at most the model's vocabulary size ({vocab_size})")


def refuse_sampling_stages(s: BeamSettings) -> None:
    """Every stage the registry marks as acting only when sampling (``warper``), or as defined on the raw logits
    (beam's chain runs on log-probabilities), refused when these settings switch it on."""
    for stage in registry.STAGES:
        if not (stage.warper or stage.logits_only) or not stage.switched_on(s):
            continue
        p = next(p for p in stage.params if getattr(s, p.field) not in (None, ()))
        why = ("transformers applies it only when sampling; every beam scores all tokens" if stage.warper else
               "it caps logits, and beam's chain runs on log-probabilities")
        raise ConfigError(f"{p.option} {getattr(s, p.field)}: not used by beam search ({why}); allowed processors: "
                          "--repetition-penalty, --no-repeat-ngram, --logit-bias, a constraint")


def validate_beam(s: BeamSettings) -> None:
    """Every check that needs no model, so bad input fails before anything loads."""
    validate_chain(s)
    refuse_sampling_stages(s)
    require(s.cache_spec, {"reorder", "rows"}, "beam search")
    if not isinstance(s.beams, int) or not 1 <= s.beams <= MAX_BEAMS:
        raise ConfigError(f"--beams {s.beams}: must be an integer in [1, {MAX_BEAMS}]")
    if s.num_return is not None and not 1 <= s.num_return <= s.beams:
        raise ConfigError(f"--return {s.num_return}: must be between 1 and --beams ({s.beams})")
    if s.length_norm not in NORMS:
        raise ConfigError(f"--length-norm {s.length_norm!r}: allowed: {', '.join(NORMS)}")
    if str(s.early_stopping).strip().lower() not in EARLY_STOPPING:
        raise ConfigError(f"--early-stopping {s.early_stopping!r}: allowed: true, false, never")
    _check(abs(s.length_penalty) <= MAX_PENALTY, "length_penalty", s.length_penalty,
           f"must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (norm(L) = L^a must stay a finite float)")
    _check(s.max_new_tokens >= 1, "max_new_tokens", s.max_new_tokens, "must be >= 1")


def parse_penalties(text: str) -> list[float]:
    """'0,0.5,1' -> [0.0, 0.5, 1.0] for --sweep-length-penalty."""
    values = []
    for part in text.split(","):
        part = part.strip()
        try:
            value = parse_float(part, "--sweep-length-penalty")
        except ConfigError:
            raise ConfigError(f"--sweep-length-penalty {text!r}: {part!r} is not a number; "
                              "give comma-separated penalties, e.g. 0,0.5,1,2") from None
        if not abs(value) <= MAX_PENALTY:
            raise ConfigError(f"--sweep-length-penalty {text!r}: every penalty must be in [-{MAX_PENALTY:g}, "
                              f"{MAX_PENALTY:g}]")
        values.append(value)
    return values


# --- length normalization ----------------------------------------------------------------------------------


def length_norm(kind: str, length: int, prompt_len: int, penalty: float) -> float:
    """The denominator of score = sum_logprob / norm (formulas in the module docstring)."""
    if kind == "hf":
        return float(length) ** penalty
    if kind == "gnmt":
        return ((5.0 + length) / 6.0) ** penalty
    if kind == "prompt-inclusive":
        return float(prompt_len + length) ** penalty
    if kind == "none":
        return 1.0
    raise ConfigError(f"--length-norm {kind!r}: allowed: {', '.join(NORMS)}")


# --- trace records -----------------------------------------------------------------------------------------


@dataclass
class Hypothesis:
    """A finished sequence: sum_logprob under the processed step distributions, raw under the model alone."""

    rank: int  # 1 = best score (set when the pool is read)
    text: str
    token_ids: list[int]  # generated tokens, EOS included
    sum_logprob: float  # decoding score before normalization (after the chain)
    raw_sum_logprob: float  # sum of the model's own log-softmax of these tokens
    length: int  # generated tokens, the L of the normalization
    score: float  # sum_logprob / norm(L): what beam search ranks by
    step: int  # the step it finished at
    reason: str  # eos | length


@dataclass
class LiveBeam:
    beam: int  # row in the batch after this step
    parent: int  # row it extends
    token_ids: list[int]  # generated so far
    text: str
    sum_logprob: float
    raw_sum_logprob: float
    score: float  # sum_logprob / norm(tokens so far): the score it would get if it ended here


@dataclass
class Candidate:
    """One of the K = max(2, 1 + #eos) * beams continuations ranked at a step."""

    rank: int  # 1 = highest sum_logprob
    parent: int
    token_id: int
    token: str
    logprob: float  # processed step log-probability (after the chain)
    raw_logprob: float  # the model's own log-probability of the token
    sum_logprob: float
    score: float  # sum_logprob / norm(length), as if it ended here
    finishes: bool  # EOS or the last allowed length
    fate: str  # live | finished (entered the pool) | rejected (finished, pool better) | pruned (also: removed, -inf)


@dataclass
class BeamStep:
    index: int  # 0 = the first generated token
    length: int  # generated tokens of every candidate of this step
    beams: list[LiveBeam] = field(default_factory=list)  # live after this step
    candidates: list[Candidate] = field(default_factory=list)
    finished: list[Hypothesis] = field(default_factory=list)  # the pool after this step, best first


@dataclass
class BeamSummary:
    beams: int
    steps: int
    finished: int  # hypotheses in the finished pool at the end: at most `beams`, as transformers keeps them
    entered: int  # hypotheses that entered the pool during the search; a better one pushes the worst out, so this
    # can exceed `beams`
    returned: int
    best_length: int
    best_score: float
    forward_tokens: int  # steps * beams: tokens the model scored after the prompt
    tokens_per_s: float  # forward_tokens / (prefill + search + trace): end to end
    seconds: float  # prefill + search + trace
    stop_reason: str  # length | context | all-finished | no-improvement | interrupted
    decode_tokens_per_s: float = float("nan")  # forward_tokens / search time (prefill and trace excluded)
    prefill_s: float = float("nan")
    warmup_s: float = float("nan")  # first-call costs paid before the timed part (engine/warmup.py), in no rate


# --- the model behind the search ---------------------------------------------------------------------------


class ModelStepper:
    """Prefill once, then one batched forward per step; the cache rows follow the parents of the live beams."""

    def __init__(self, model, cache: CacheSpec | None = None, runtime: Runtime | None = None,
                 capacity: int | None = None):
        self.model, self.spec, self.capacity = model, cache, capacity
        self.runtime = runtime
        self.device = next(model.parameters()).device
        self.rows = 1  # batch rows in the cache: 1 after the prefill, beams afterwards

    def plan(self, positions: int) -> None:
        """The search says how many positions it may need (a static cache preallocates them)."""
        self.capacity = self.capacity or positions

    def warm_up(self, beams: int) -> float:
        """The model's first-call costs at this search's shapes (a one-row prefill, ``beams``-row decodes) under
        its kind of cache, paid once per process before anything is timed; seconds (0.0 once warm)."""
        return warm_up(self.model, self.spec, beams)

    def start(self, prompt_ids: list[int]) -> Tensor:
        """Logits [1, V] after the prompt (computed once, whatever the beam count)."""
        if self.runtime is None:
            self.runtime = Runtime.create(self.model, self.spec, self.capacity or len(prompt_ids) + 1,
                                          needs=frozenset({"reorder", "rows"}))
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        return self.runtime.prefill(ids)

    def advance(self, parents: list[int], parents_t: Tensor, tokens: Tensor) -> Tensor:
        """Keep the cache rows of ``parents`` (one per new beam), feed ``tokens`` [B]; returns logits [B, V]."""
        if self.rows == 1:
            # after the prefill every beam is the prompt: gathering row 0 B times expands the cache
            self.runtime.reorder(torch.zeros(len(parents), dtype=torch.long, device=self.device))
            self.rows = len(parents)
        elif parents != list(range(self.rows)):
            self.runtime.reorder(parents_t)
        return self.runtime.feed(tokens.view(-1, 1))


# --- the search --------------------------------------------------------------------------------------------


@dataclass
class _Beam:
    tokens: list[int]
    raw: float


class _Ranked(NamedTuple):
    """The K best candidates of a step, best first (host lists)."""

    sums: list[float]  # sum_logprob = running score + processed step log-prob
    scores: list[float]  # sum / norm(length): the score if it finishes here
    best: list[float]  # sum / norm(heuristic length): the early-stopping bound
    raw: list[float]  # the model's own log-prob of the token
    logp: list[float]  # the processed log-prob of the token
    flat: list[int]  # parent * V + token


class BeamSearch(Run):
    """Iterate for one :class:`BeamStep` per step (detailed when ``record``); then read ``hypotheses``, ``summary()``.

    ``stepper`` supplies logits: ``start(prompt_ids) -> [1, V]`` and ``advance(parents, parents_t, tokens) ->
    [B, V]`` (:class:`ModelStepper`, or a table of fixed logits in tests).
    """

    lm: LoadedModel | None = None  # the model it searched with (set by beam_run): its markers for the split

    def __init__(self, stepper, prompt_ids: list[int], chain: Chain, settings: BeamSettings,
                 eos_ids: tuple[int, ...] = (), detok: Callable[[list[int]], str] | None = None,
                 context_length: int | None = None, record: bool = False,
                 token_text: Callable[[int], str] | None = None):
        check_prompt(len(prompt_ids), context_length)
        self.stepper, self.prompt_ids, self.chain, self.s = stepper, list(prompt_ids), chain, settings
        self.eos = frozenset(() if settings.ignore_eos else eos_ids)
        self.detok = detok or (lambda ids: " ".join(map(str, ids)))
        self.token_text = token_text or (lambda token: self.detok([token]))
        self.record = record
        self.max_new = settings.max_new_tokens
        self.capped = False
        if context_length is not None and len(prompt_ids) + self.max_new > context_length:
            self.max_new, self.capped = context_length - len(prompt_ids), True
        self.pool: list[Hypothesis] = []  # best first, at most `beams`
        self.entered = 0
        self.steps: list[BeamStep] = []
        self.stop_reason = "length"
        self.n_steps = 0
        self.watch: Stopwatch | None = None
        self.sweep: list[SweepRow] | None = None  # --sweep-length-penalty: the winner per penalty (run_sweep)
        self.new_stepper: Callable[[], object] | None = None  # a fresh stepper for each sweep search (set by build)
        self.eos_ids, self.context_length = tuple(eos_ids), context_length

    # normalization of this search
    def norm(self, length: int) -> float:
        return length_norm(self.s.length_norm, length, len(self.prompt_ids), self.s.length_penalty)

    def heuristic_length(self, length: int) -> int:
        """The length at which the best live beam is assumed to finish when testing for improvement."""
        if self.s.early == "never" and self.s.length_penalty > 0 and self.s.length_norm != "none":
            return self.max_new
        return length

    def __iter__(self) -> Iterator[BeamStep]:
        self.watch = Stopwatch(getattr(self.stepper, "device", "cpu"))
        warm = getattr(self.stepper, "warm_up", None)  # a table of fixed logits has nothing to warm
        self.watch.timing.warmup_s += warm(self.s.beams) if warm else 0.0  # before the stopwatch starts
        self.watch.start()
        for step in self._run():
            self.watch.lap("trace" if self.record else "loop")
            self.watch.pause()
            yield step
            self.watch.resume()

    def run(self) -> list[Hypothesis]:
        for _ in self:
            pass
        return self.hypotheses

    def _run(self) -> Iterator[BeamStep]:
        B = self.s.beams
        n_eos = len(self.eos)
        if hasattr(self.stepper, "plan"):
            self.stepper.plan(len(self.prompt_ids) + self.max_new)
        logits = self.stepper.start(self.prompt_ids)  # [1, V]
        self.watch.lap("prefill")
        V = logits.shape[-1]
        k = min(max(2, 1 + n_eos) * B, B * V)
        dev = logits.device
        running = torch.full((B,), START_SCORE, dtype=torch.float32, device=dev)
        running[0] = 0.0
        beams = [_Beam([], 0.0) for _ in range(B)]
        use_ids = bool(self.chain.processors)
        # the B rows' ids (prompt + generated), for the stages that read them; rows follow their parents
        buf = TokenBuffer(self.prompt_ids, len(self.prompt_ids) + self.max_new, dev, rows=B) if use_ids else None
        for step in range(self.max_new):
            length = step + 1
            logp = torch.log_softmax(logits.float(), dim=-1)
            if logp.shape[0] != B:
                logp = logp.expand(B, V).contiguous()
            proc = self.chain.apply(buf.prefix(), logp) if use_ids else logp  # emptiness: checked on the best one
            total = proc + running[:, None]  # c_{b,v} = s_b + d_{b,v}
            vals, idx = torch.topk(total.view(1, -1), k)  # ranked by sum_logprob, as transformers
            vals, idx = vals[0], idx[0]
            host = self._to_host(vals, idx, logp, proc, length)
            if host.sums[0] == float("-inf"):
                raise empty_chain_error(self.chain.names)
            live, fates = self._select(host, step, length, beams, V)
            self.n_steps = length
            parents = [host.flat[i] // V for i in live]
            tokens = [host.flat[i] % V for i in live]
            beams = [_Beam(beams[p].tokens + [t], beams[p].raw + host.raw[i]) for p, t, i in zip(parents, tokens, live)]
            stop = self._stop_reason(length, host, live)
            self.watch.lap("loop")
            if self.record:
                self.steps.append(self._snapshot(step, length, host, fates, live, parents, beams, V))
                yield self.steps[-1]
            else:
                yield BeamStep(step, length)
            if stop is not None:
                self.stop_reason = stop
                return
            chosen = slice(0, B) if live == list(range(B)) else torch.tensor(live, dtype=torch.long, device=dev)
            running, flat = vals[chosen], idx[chosen]
            parents_t = flat // V
            tokens_t = flat - parents_t * V
            if use_ids:
                buf.reorder(parents_t)
                buf.push(tokens_t[:, None])
            logits = self.stepper.advance(parents, parents_t, tokens_t)

    def _to_host(self, vals: Tensor, idx: Tensor, logp: Tensor, proc: Tensor, length: int) -> _Ranked:
        """The K candidates' numbers in one device-to-host transfer (the one sync of a step)."""
        finish = vals / self.norm(length)  # float32, as transformers scores a finished hypothesis
        best = vals / self.norm(self.heuristic_length(length))  # the early-stopping test's bound
        raw = logp.view(-1)[idx]
        step_logp = raw if proc is logp else proc.view(-1)[idx]
        # float32 bits and int64 ids in one int64 tensor (no float64: MPS has none); exact both ways
        bits = torch.stack([vals, finish, best, raw, step_logp]).float().contiguous().view(torch.int32).long()
        host = np.asarray(torch.cat([bits.flatten(), idx]).tolist(), dtype=np.int64)
        k = idx.shape[0]
        rows = host[: 5 * k].astype(np.int32).view(np.float32).astype(np.float64).reshape(5, k).tolist()
        return _Ranked(rows[0], rows[1], rows[2], rows[3], rows[4], host[5 * k :].tolist())

    def _select(self, host, step: int, length: int, beams: list[_Beam], V: int) -> tuple[list[int], list[str]]:
        """Fates of the K candidates: the finished pool takes finishing ones among the first B; the B best
        non-finishing ones stay live."""
        B = self.s.beams
        vals, scores, flat, raw = host.sums, host.scores, host.flat, host.raw
        at_end = length >= self.max_new
        live: list[int] = []
        fates = ["pruned"] * len(vals)
        new: list[tuple[int, Hypothesis]] = []
        for i in range(len(vals)):
            parent, token = flat[i] // V, flat[i] % V
            if at_end or token in self.eos:
                # a candidate the chain removed (sum -inf: fewer allowed tokens than K, as under a constraint) never
                # finishes; transformers' pool starts at -1e9, which it cannot beat either
                if i < B and vals[i] != float("-inf"):
                    tokens = beams[parent].tokens + [token]
                    reason = "eos" if token in self.eos else ("context" if self.capped else "length")
                    hyp = Hypothesis(0, "", tokens, vals[i], beams[parent].raw + raw[i], length, scores[i], step,
                                     reason)
                    new.append((i, hyp))
            elif len(live) < B:
                live.append(i)
                fates[i] = "live"
        if at_end and not live:  # the search ends here; the live beams no longer matter
            live = list(range(min(B, len(vals))))
        for i, hyp in new:
            if len(self.pool) < B or hyp.score > self.pool[-1].score:
                self.pool.append(hyp)
                self.pool.sort(key=lambda h: -h.score)  # stable: on a tie the earlier hypothesis stays ahead
                del self.pool[B:]
                fates[i] = "finished"
                self.entered += 1
            else:
                fates[i] = "rejected"
        return live, fates

    def _stop_reason(self, length: int, host, live: list[int]) -> str | None:
        """transformers' stopping rules (module docstring), checked after the pool update of a step."""
        if length >= self.max_new:
            return "context" if self.capped else "length"
        if len(self.pool) < self.s.beams:
            return None
        if self.s.early is True:
            return "all-finished"
        best_possible = host.best[live[0]]  # the best live beam's sum_logprob / norm(heuristic length)
        if not best_possible > self.pool[-1].score:
            return "no-improvement"
        return None

    def _snapshot(self, step, length, host, fates, live, parents, beams, V) -> BeamStep:
        vals, scores, flat, raw, proc = host.sums, host.scores, host.flat, host.raw, host.logp
        token_text = self.token_text
        cands = []
        for i, fate in enumerate(fates):
            parent, token = flat[i] // V, flat[i] % V
            cands.append(Candidate(i + 1, parent, token, token_text(token), proc[i], raw[i], vals[i], scores[i],
                                   length >= self.max_new or token in self.eos, fate))
        live_rows = []
        for row, (i, parent, beam) in enumerate(zip(live, parents, beams)):
            live_rows.append(LiveBeam(row, parent, list(beam.tokens), self.detok(beam.tokens), vals[i], beam.raw,
                                      scores[i]))
        return BeamStep(step, length, live_rows, cands, self._ranked(self.pool))

    def _ranked(self, hyps: list[Hypothesis]) -> list[Hypothesis]:
        out = []
        for rank, h in enumerate(hyps, start=1):
            out.append(Hypothesis(rank, h.text or self.detok(h.token_ids), list(h.token_ids), h.sum_logprob,
                                  h.raw_sum_logprob, h.length, h.score, h.step, h.reason))
        return out

    @property
    def new_ids(self) -> list[int]:
        return list(self.pool[0].token_ids) if self.pool else []

    @property
    def hypotheses(self) -> list[Hypothesis]:
        """The best ``--return`` hypotheses of the pool, best first (rank 1 = the result)."""
        return self._ranked(self.pool[: self.s.returned])

    def best(self) -> Hypothesis | None:
        """The result: the best hypothesis (rank 1), None when the search finished none."""
        hyps = self.hypotheses
        return hyps[0] if hyps else None

    def text(self) -> str:
        best = self.best()
        return best.text if best else ""

    def run_sweep(self, penalties: list[float]) -> list[SweepRow]:
        """One full search per length penalty on this run's prompt, chain and settings (``sweep`` in the document)."""
        self.sweep = sweep_length_penalty(self.new_stepper, self.prompt_ids, self.chain, self.s, penalties,
                                          self.eos_ids, self.detok, self.context_length)
        return self.sweep

    def document(self) -> dict:
        """``beam``'s JSON document: the steps, the best hypothesis's text and ids, every returned hypothesis, the
        sweep when one ran, the summary, the best hypothesis's reasoning / answer split when the settings or the
        model name thinking markers (parts and counts: a hypothesis keeps no per-token numbers in one list)."""
        hyps = self.hypotheses
        best = hyps[0] if hyps else None
        result = {"text": best.text if best else "", "token_ids": best.token_ids if best else [], "hypotheses": hyps}
        if self.sweep is not None:
            result["sweep"] = self.sweep
        split = {} if self.lm is None else reasoning.for_tokens(self.s, self.lm, self.prompt_ids, result["token_ids"])
        return self.origin.head(steps=self.steps, **result, summary=self.summary(), **split)

    def summary(self) -> BeamSummary:
        best = self.pool[0] if self.pool else None
        forward_tokens = self.n_steps * self.s.beams
        timing = self.watch.timing
        return BeamSummary(
            beams=self.s.beams,
            steps=self.n_steps,
            finished=len(self.pool),
            entered=self.entered,
            returned=min(self.s.returned, len(self.pool)),
            best_length=best.length if best else 0,
            best_score=best.score if best else float("nan"),
            forward_tokens=forward_tokens,
            tokens_per_s=timing.tokens_per_s(forward_tokens),
            seconds=timing.total_s,
            stop_reason=self.stop_reason,
            decode_tokens_per_s=timing.decode_tokens_per_s(forward_tokens),
            prefill_s=timing.prefill_s,
            warmup_s=timing.warmup_s,
        )


def beam_search(model, prompt_ids: list[int], chain: Chain, settings: BeamSettings, eos_ids=(),
                detok=None, context_length: int | None = None, record: bool = False,
                token_text=None, cache: CacheSpec | None = None) -> BeamSearch:
    """Run a whole search over a transformers model; returns the finished :class:`BeamSearch`."""
    search = BeamSearch(ModelStepper(model, cache), prompt_ids, chain, settings, tuple(eos_ids), detok, context_length,
                        record, token_text)
    search.run()
    return search


# --- sweeping the length penalty ---------------------------------------------------------------------------


@dataclass
class SweepRow:
    length_penalty: float
    winner: Hypothesis
    changed: bool  # the winner differs from the previous row's
    stop_reason: str
    steps: int


def sweep_length_penalty(make_stepper: Callable[[], object], prompt_ids: list[int], chain: Chain,
                         settings: BeamSettings, penalties: list[float], eos_ids=(), detok=None,
                         context_length: int | None = None) -> list[SweepRow]:
    """One full search per penalty (the stopping rule depends on it too); the winner of each, flips marked."""
    rows: list[SweepRow] = []
    for penalty in penalties:
        s = _with_penalty(settings, penalty)
        search = BeamSearch(make_stepper(), prompt_ids, chain, s, tuple(eos_ids), detok, context_length)
        hyps = search.run()
        if not hyps:
            raise ConfigError("--sweep-length-penalty: a search finished no hypothesis (every candidate removed)")
        winner = hyps[0]
        changed = bool(rows) and rows[-1].winner.token_ids != winner.token_ids
        rows.append(SweepRow(penalty, winner, changed, search.stop_reason, search.n_steps))
    return rows


def _with_penalty(settings: BeamSettings, penalty: float) -> BeamSettings:
    return replace(settings, length_penalty=penalty)


# --- beam ------------------------------------------------------------------------------------------------------


def build_beam(lm: LoadedModel, settings: BeamSettings, prompt_ids: list[int], chain: Chain | None = None,
               record: bool = True) -> BeamSearch:
    check_beams_fit_vocabulary(settings.beams, lm.vocab_size)
    chain = chain or make_chain(lm, settings)
    refuse_stepwise_stages(chain, "beam search")
    chain.reset(len(prompt_ids))
    return BeamSearch(beam_stepper(lm, settings), prompt_ids, chain, settings, tuple(lm.eos_ids), lm.decode,
                      lm.context_length, record=record, token_text=lm.token_text)


def beam_run(lm: LoadedModel, settings: BeamSettings, prompt_text: str, prompt_ids: list[int],
             chain: Chain | None = None, record: bool = True, summary_only: bool = False) -> BeamSearch:
    """``beam``'s run with its document head (the registry's build); ``summary_only``: no per-step trace (a caller
    that reads the result alone)."""
    run = build_beam(lm, settings, prompt_ids, chain, record=record and not summary_only)
    run.origin = Origin.of("beam", lm, as_dict(settings), run.chain.names, prompt_text, prompt_ids)
    run.lm = lm
    run.new_stepper = lambda: beam_stepper(lm, settings)
    return run


def beam_stepper(lm: LoadedModel, settings: BeamSettings) -> ModelStepper:
    return ModelStepper(lm.model, settings.cache_spec)
