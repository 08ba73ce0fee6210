"""A speculative run (:class:`Speculator`): rounds of propose -> verify in one target forward -> accept, reject with a
residual draw, or take the bonus token; its trace and summary; its settings; and the timing rounds that pair it
with plain decoding (:class:`SpeedupRounds`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import NamedTuple

import torch
from torch import Tensor

from ...engine.models import LoadedModel
from ...engine.run import Origin, Run, Stopwatch, Timing, clock
from ...engine.runtime import Runtime
from ...engine.stopping import StopChecker, StopRules, stop_rules
from ...engine.tokens import check_prompt
from ...errors import ConfigError
from ...inputs import parse_int
from ...settings import as_dict
from ...kv import CacheSpec, require
from ...sampling import replay
from ...sampling.chain import Chain, make_chain, refuse_stepwise_stages
from ...sampling.distribution import softmax
from ...sampling.select import make_generator
from ...sampling.semantics import plan as semantics_plan, trims_stop
from ...sampling.step import check_selected
from ...trace import reasoning
from ..sample import SampleSettings, validate_sample
from .chained import make_proposer, proposer_spec
from .proposers import (
    Draft,
    Proposer,
    Sequence,
)
from .rule import (
    acceptance_probability,
    expected_tokens,
    final_kind,
    point_masses,
    predicted_speedup,
    verify_greedy,
    verify_sampled,
)
from .timing import (
    BaselineTiming,
    SpeedupRound,
    median_spread,
    speedup_round,
    time_plain_decoding,
)

# ---------------------------------------------------------------------------------------------------------------
# settings
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpeculateSettings(SampleSettings):
    draft: str = "tiny-draft"  # a model (bundled name or folder) or "ngram"
    gamma: int = 4  # tokens drafted per round
    ngram_size: int = 3  # longest n-gram the prompt-lookup proposer matches
    sweep_gamma: tuple[int, ...] = ()
    speedup_rounds: int = 3  # paired speculative / plain runs behind the measured speedup (median, min, max)


# A round emits (1 - a^(g+1)) / (1 - a) < 1 / (1 - a) tokens on average: past a few dozen drafts more only costs,
# even at an acceptance rate of 0.99; the bound keeps the per-position statistics a readable size.
MAX_GAMMA = 128
# Each timing round decodes the whole output twice (speculative, then plain, or the other way round).
MAX_SPEEDUP_ROUNDS = 100


def validate_speculate(s: SpeculateSettings) -> None:
    validate_sample(s)
    require(s.cache_spec, {"truncate"}, "speculative decoding (a rejected draft is rolled back)")
    if not 1 <= s.gamma <= MAX_GAMMA:
        raise ConfigError(f"--gamma {s.gamma}: must be an integer in [1, {MAX_GAMMA}]")
    if not 1 <= s.ngram_size <= MAX_GAMMA:
        raise ConfigError(f"--ngram-size {s.ngram_size}: must be an integer in [1, {MAX_GAMMA}]")
    parse_gammas(",".join(map(str, s.sweep_gamma)) if s.sweep_gamma else None)
    if not isinstance(s.speedup_rounds, int) or not 1 <= s.speedup_rounds <= MAX_SPEEDUP_ROUNDS:
        raise ConfigError(f"--speedup-rounds {s.speedup_rounds}: must be an integer in [1, {MAX_SPEEDUP_ROUNDS}] "
                          "(timing rounds, each a speculative and a plain run of the same output)")


def parse_gammas(text: str | None) -> tuple[int, ...] | None:
    """'1,2,4' -> (1, 2, 4); the message names --sweep-gamma."""
    if text is None:
        return None
    items = [t.strip() for t in text.split(",") if t.strip()]
    usage = f"--sweep-gamma {text!r}: a comma-separated list of integers in [1, {MAX_GAMMA}], e.g. 1,2,4,8"
    try:
        gammas = [parse_int(t, "--sweep-gamma", 1, MAX_GAMMA) for t in items]
    except ConfigError:
        raise ConfigError(usage) from None
    if not gammas:
        raise ConfigError(usage)
    return tuple(dict.fromkeys(gammas))


# ---------------------------------------------------------------------------------------------------------------
# trace records
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class ProposedToken:
    token_id: int
    token: str
    q: float  # the proposer's processed probability of this token (1 for the n-gram proposer)
    p: float  # the target's processed probability of it, same prefix
    u: float | None  # the uniform drawn for it (None: greedy, or never judged after an earlier rejection)
    accept_prob: float  # min(1, p/q); greedy: 1 if it is the target's argmax else 0
    accepted: bool
    reached: bool  # judged at all (False after the round's first rejection)
    raw_q: float | None  # the draft model's own softmax (temperature 1); None for the n-gram proposer
    raw_p: float  # the target model's own softmax


@dataclass
class ResidualEntry:
    token_id: int
    token: str
    prob: float  # in the distribution the final token was drawn from (residual or p)
    p: float  # the target's processed probability
    raw_p: float


@dataclass
class FinalToken:
    kind: str  # correction | bonus | plain (see final_kind)
    token_id: int
    token: str
    prob: float  # in the distribution it was drawn from: norm(max(0, p - q)) (correction) or p (bonus)
    p: float
    raw_p: float
    emitted: bool  # False when EOS / -n / a stop string ended the run before it
    top: list[ResidualEntry] = field(default_factory=list)


@dataclass
class Round:
    index: int
    position: int  # absolute position of the round's first emitted token
    drafted: int
    accepted: int
    emitted_ids: list[int]
    emitted_text: str = ""
    proposed: list[ProposedToken] = field(default_factory=list)
    final: FinalToken | None = None
    draft_ms: float = 0.0
    target_ms: float = 0.0
    source: str = ""  # the proposer that drafted this round (a chain's member that proposed first); "" if none did

    def to_dict(self) -> dict:
        out = {"index": self.index, "position": self.position, **({"source": self.source} if self.source else {}),
               "drafted": self.drafted,
               "proposed": [asdict(t) for t in self.proposed], "accepted": self.accepted,
               "emitted": {"token_ids": self.emitted_ids, "text": self.emitted_text},
               "draft_ms": self.draft_ms, "target_ms": self.target_ms}
        if self.final is not None:
            out[self.final.kind] = asdict(self.final)
        return out


# ---------------------------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class RunStats:
    """Counts and timings of one speculative run (the summary is computed from these)."""

    gamma: int
    rounds: int = 0
    drafted: int = 0
    judged: int = 0  # drafts whose verdict was reached: the accepted ones + the first rejected one per round
    accepted: int = 0
    reached_at: list[int] = field(default_factory=list)  # per draft position: judged there
    accepted_at: list[int] = field(default_factory=list)
    round_drafts: list[int] = field(default_factory=list)  # drafts per round (fewer near the end or no n-gram hit)
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    new_ids: list[int] = field(default_factory=list)
    stop_reason: str = "length"

    def __post_init__(self):
        self.reached_at = [0] * self.gamma
        self.accepted_at = [0] * self.gamma


class Speculator(Run):
    """Iterate to get one :class:`Round` per verification round; ``stats`` and ``summary(...)`` describe the run.

    ``generator`` None means greedy verification (temperature 0); otherwise the explicit RNG for u and the
    residual/bonus draws (the proposer's own selector should share it, for one seed per run). ``cache`` is the
    target's KV policy (it must be able to truncate: a rejected draft suffix is rolled back)."""

    lm: LoadedModel | None = None  # the target (set by speculate_run): its thinking markers for the split

    def __init__(self, target, proposer: Proposer, prompt_ids: list[int], chain: Chain, rules: StopRules,
                 gamma: int, generator: torch.Generator | None = None,
                 token_text: Callable[[int], str] | None = None, detok: Callable[[list[int]], str] | None = None,
                 top: int = 5, record: bool = True, cache: CacheSpec | None = None):
        if gamma < 1:
            raise ConfigError(f"--gamma {gamma}: must be an integer >= 1")
        self.target, self.proposer, self.chain, self.rules = target, proposer, chain, rules
        self.prompt_ids, self.gamma, self.generator = list(prompt_ids), gamma, generator
        self.token_text, self.detok, self.top, self.record = token_text, detok, top, record
        self.spec = cache
        self.stats = RunStats(gamma)
        self.rounds: list[Round] = []
        self.runtime: Runtime | None = None
        self.seq: Sequence | None = None
        self.stopper = StopChecker(rules, detok)
        self.watch: Stopwatch | None = None
        self.decode = detok
        self.settings: SpeculateSettings | None = None  # the draft and gamma the document names (set by the build)
        self.timed: list[SpeedupRound] | None = None  # the timing rounds behind the summary's speedups
        self.sweep_part: dict = {}  # sweep and best_gamma, when a gamma sweep chose this run's gamma
        self.analyses: dict = {}  # prediction and width_audit, when asked for (after the run)
        self.warmup_s = float("nan")  # the untimed warm-up rounds before this run (nan: none ran)

    @property
    def greedy(self) -> bool:
        return self.generator is None

    def context_limit(self) -> int | None:
        limits = [c for c in (self.rules.context_length, self.proposer.context_length) if c is not None]
        return min(limits) if limits else None

    def __iter__(self) -> Iterator[Round]:
        check_prompt(len(self.prompt_ids), self.rules.context_length)
        device = next(self.target.parameters()).device
        capacity = self.rules.capacity(len(self.prompt_ids)) + self.gamma + 2
        self.seq = Sequence(self.prompt_ids, capacity, device)
        self.watch = Stopwatch(device)
        self.watch.start()
        self.start()
        self.watch.lap("prefill")
        while True:
            outcome = self.step()
            self.watch.lap("loop")
            if outcome.stop is not None:
                self.stats.stop_reason = outcome.stop
            rnd = self.build_round(outcome)
            self.rounds.append(rnd)
            self.watch.lap("trace")
            self.watch.pause()
            yield rnd
            if outcome.stop is not None:
                return
            self.watch.resume()

    @torch.inference_mode()
    def start(self) -> None:
        """Target prefill of all but the last prompt token (fed with the first block); the proposer's own start."""
        seq = self.seq
        self.runtime = Runtime.create(self.target, self.spec, capacity=seq.ids.shape[1],
                                      needs=frozenset({"truncate"}))
        self.runtime.prefill(seq.prefix(), hold_last=True)
        self.proposer.start(seq)

    def draft_budget(self) -> int:
        """gamma, capped so one round never overshoots -n (it emits at most g + 1) nor the context."""
        g = min(self.gamma, self.rules.max_new_tokens - len(self.stats.new_ids) - 1)
        limit = self.context_limit()
        if limit is not None:
            g = min(g, limit - self.seq.length)
        return max(g, 0)

    @torch.inference_mode()
    def step(self) -> _Outcome:
        seq, stats, runtime = self.seq, self.stats, self.runtime
        n = seq.length
        g = self.draft_budget()
        device = seq.ids.device
        t0 = clock(device)
        draft = self.proposer.propose(seq, g) if g > 0 else Draft(seq.ids.new_zeros(0), None, None)
        g = int(draft.tokens.shape[0])
        t1 = clock(device)
        # one target forward over [s_last, x_1..x_g] at positions seen .. seen + g: logits for the g+1 positions
        logits = runtime.feed(seq.ids[:, n - 1 : n + g], keep="all")[0]
        # the chain on the g+1 rows, row i after s + x_1..x_i; unchecked: a row after a rejected draft is never
        # used, so only the row the emitted token comes from is checked (check_selected below)
        processed = replay.processed(self.chain, seq.ids, logits, n)
        if self.greedy:
            drafts, k, token, finite = self.verify_greedy(processed, draft)
            p = q = u = final = None
        else:
            drafts, k, token, finite, p, q, u, final = self.verify(processed, draft)
        check_selected(finite, self.chain, processed)  # the chain left nothing at the position decided
        runtime.rollback(g - k)  # keep s + x_1..x_k (x_{k+1}.. rejected); y is fed with the next round
        self.proposer.rollback(n + k)
        t2 = clock(device)
        stats.rounds += 1
        stats.draft_seconds += t1 - t0
        stats.target_seconds += t2 - t1
        stats.drafted += g
        stats.round_drafts.append(g)
        stats.accepted += k
        stats.judged += min(k + 1, g)
        for i in range(min(k + 1, g)):
            stats.reached_at[i] += 1
        for i in range(k):
            stats.accepted_at[i] += 1
        emitted, stop = self.commit(drafts[:k] + [token])
        return _Outcome(n, draft, drafts, logits, processed, p, q, u, final, k, token, emitted, stop,
                        (t1 - t0) * 1e3, (t2 - t1) * 1e3)

    def verify_greedy(self, processed: Tensor, draft: Draft) -> tuple[list[int], int, int, bool]:
        """Greedy verification; the drafts, the target's argmaxes and their finiteness in one transfer."""
        g = int(draft.tokens.shape[0])
        best = processed.argmax(dim=-1)
        finite = torch.isfinite(processed.gather(-1, best[:, None])[:, 0])
        host = torch.cat([draft.tokens.to(best.device), best, finite.long()]).tolist()
        drafts, best_ids = host[:g], host[g : 2 * g + 1]
        k, token = verify_greedy(best_ids, drafts)
        return drafts, k, token, bool(host[2 * g + 1 + k])

    def verify(self, processed: Tensor, draft: Draft):
        """Speculative sampling of one round, decided on the device and read in one transfer: (drafts, accepted,
        token, finite, p, q, u, the distribution the token came from)."""
        g = int(draft.tokens.shape[0])
        p = softmax(processed)  # [g+1, V]
        vocab = p.shape[-1]
        q = draft.q if draft.q is not None else point_masses(draft.tokens, vocab)
        u = torch.rand(g, generator=self.generator, device=p.device)
        race = torch.empty(vocab, device=p.device).exponential_(1.0, generator=self.generator)
        verdict = verify_sampled(p.unsqueeze(0), q.unsqueeze(0), draft.tokens.unsqueeze(0), u.unsqueeze(0),
                                 race.unsqueeze(0))
        finite = torch.isfinite(processed[verdict.accepted[0], verdict.token[0]])
        host = torch.cat([draft.tokens.to(p.device), verdict.accepted, verdict.token, finite.long()[None]]).tolist()
        return host[:g], host[g], host[g + 1], bool(host[g + 2]), p, q, u, verdict.final_probs[0]

    def commit(self, tokens: list[int]) -> tuple[list[int], str | None]:
        """Append the round's tokens one by one, stopping like plain decoding (the same stop checker)."""
        stats, seq = self.stats, self.seq
        stop, cut = None, len(tokens)
        for i, t in enumerate(tokens):
            stats.new_ids.append(t)
            stop = self.stopper.check(stats.new_ids, seq.length + i + 1)
            if stop is not None:
                cut = i + 1
                break
        seq.append(tokens[:cut])
        return tokens[:cut], stop

    def build_round(self, o: _Outcome) -> Round:
        """The traced record of a round: every number gathered on the device, read in one transfer."""
        rnd = Round(len(self.rounds), o.position, len(o.drafts), o.k, o.emitted, draft_ms=o.draft_ms,
                    target_ms=o.target_ms, source=(getattr(self.proposer, "source", None) or self.proposer.name)
                    if o.drafts else "")
        if not self.record:
            return rnd
        text = self.token_text or str
        g, k, y = len(o.drafts), o.k, o.token
        raw_p = softmax(o.logits)
        p = o.p if o.p is not None else softmax(o.processed)
        vocab = p.shape[-1]
        dev = p.device
        x = torch.tensor(o.drafts, dtype=torch.long, device=dev)
        rows = torch.arange(g, device=dev)
        q = o.q if o.q is not None else (o.draft.q if o.draft.q is not None else point_masses(o.draft.tokens, vocab))
        final = o.final if o.final is not None else point_masses(torch.tensor(y, device=dev), vocab)
        # greedy draws from a point mass, so its alternatives are ranked by the target's raw softmax instead
        ranking = raw_p[k] if self.greedy else final
        top = torch.topk(ranking, min(self.top, vocab)).indices if self.top > 0 else x.new_zeros(0)
        accept = ((p[rows].argmax(dim=-1) == x).float() if self.greedy
                  else acceptance_probability(p[rows, x], q[rows, x]))  # greedy: 1 iff x is the target's argmax
        parts = [q[rows, x], p[rows, x], raw_p[rows, x], accept,
                 softmax(torch.cat(o.draft.raw_logits))[rows, x] if o.draft.raw_logits else None,
                 o.u if not self.greedy else None,
                 top.float(), final[top], p[k, top], raw_p[k, top],
                 torch.stack([final[y], p[k, y], raw_p[k, y]])]
        host = torch.cat([t.reshape(-1).float() for t in parts if t is not None]).tolist()
        columns = [host[i * g : (i + 1) * g] for i in range(4)]
        host = host[4 * g :]
        raw_qx, host = (host[:g], host[g:]) if o.draft.raw_logits else ([None] * g, host)
        us, host = (host[:g], host[g:]) if not self.greedy else ([None] * g, host)
        t = (len(host) - 3) // 4
        top_ids, top_final, top_p, top_raw = (host[i * t : (i + 1) * t] for i in range(4))
        last = host[4 * t :]
        qx, px, raw_px, accept_p = columns
        for i, tok in enumerate(o.drafts):
            reached = i <= k
            u = us[i] if reached else None
            rnd.proposed.append(ProposedToken(tok, text(tok), qx[i], px[i], u, accept_p[i], i < k, reached,
                                              raw_qx[i], raw_px[i]))
        entries = [ResidualEntry(int(i), text(int(i)), f, pk, r)
                   for i, f, pk, r in zip(top_ids, top_final, top_p, top_raw) if self.greedy or f > 0]
        rnd.final = FinalToken(final_kind(g, k), y, text(y), last[0], last[1], last[2], len(o.emitted) == k + 1,
                               entries)
        rnd.emitted_text = self.detok(o.emitted) if self.detok is not None else ""
        return rnd

    @property
    def new_ids(self) -> list[int]:
        return self.stats.new_ids

    @property
    def stop_reason(self) -> str:
        return self.stats.stop_reason

    @stop_reason.setter
    def stop_reason(self, value: str) -> None:
        self.stats.stop_reason = value

    def summary(self, timed: BaselineTiming | list[SpeedupRound] | None = None) -> SpeculativeSummary:
        """The run's summary; its speedups from ``timed``: the timing rounds (see :class:`SpeedupRound`), or one
        plain reference run paired with this run, or None (the run's own ``timed``; none: speedups null)."""
        timed = timed if timed is not None else self.timed
        timing = self.watch.timing if self.watch is not None else Timing()  # never started: interrupted before
        if isinstance(timed, BaselineTiming):
            timed = [r for r in [speedup_round(self, timed)] if r is not None]
        out = summarize(self.stats, self.proposer.name, self.proposer.forwards, timed or [], timing)
        out.warmup_s = self.warmup_s
        return out


    def document(self) -> dict:
        """``speculate``'s JSON document: the head with the proposer, gamma and verification rule, a step per
        verification round, the text and ids, the summary (speedups from ``timed``), the sweep when one ran, the
        prediction and width audit when asked for, the reasoning / answer split of the new tokens when the settings
        or the model name thinking markers (parts and counts: rounds keep no per-token numbers in one list)."""
        extra = {} if self.settings is None else {"draft": self.settings.draft, "gamma": self.settings.gamma}
        head = self.origin.head(**extra, verification="greedy" if self.greedy else "speculative-sampling")
        ids, text = self.delivered(self.detok)
        return {**head, "steps": [r.to_dict() for r in self.rounds], "text": text, "token_ids": ids,
                "summary": self.summary().to_dict(), **self.sweep_part, **self.analyses, **self.reasoning_part()}

    def reasoning_part(self) -> dict:
        if self.lm is None or self.settings is None:
            return {}
        return reasoning.for_tokens(self.settings, self.lm, self.prompt_ids, self.new_ids)


class _Outcome(NamedTuple):
    position: int
    draft: Draft
    drafts: list[int]
    logits: Tensor
    processed: Tensor
    p: Tensor | None
    q: Tensor | None
    u: Tensor | None
    final: Tensor | None  # [V] the distribution the emitted token was drawn from (None: greedy, a point mass)
    k: int
    token: int
    emitted: list[int]
    stop: str | None
    draft_ms: float
    target_ms: float


@dataclass
class SpeculativeSummary:
    proposer: str
    gamma: int
    new_tokens: int
    rounds: int
    acceptance_rate: float  # a: accepted drafts / drafts judged (each round judges up to its first rejection)
    drafted_accepted_fraction: float  # accepted drafts / all drafted (including never-judged ones)
    mean_accepted: float  # accepted drafts per round
    mean_drafted: float  # drafts per round (fewer than gamma near the end, or when the n-gram finds no match)
    per_position_acceptance: list  # per draft position i: accepted there / judged there (None if never judged)
    tokens_per_target_call: float  # emitted tokens per verification forward
    expected_tokens_per_round: float  # (1 - a^(g+1)) / (1 - a): what the prediction assumes (independent accepts)
    target_calls: int  # verification forwards (the prefill excluded)
    draft_calls: int  # draft-model forwards (the prefill excluded); 0 for the n-gram proposer
    draft_step_ms: float  # drafting time per drafted token (median over the timing rounds)
    target_step_ms: float | None  # one plain decoding step of the target (the reference runs; median)
    verify_ms: float  # target verification time per round (forward over g+1 positions, chain, verify, rollback;
    # median over the timing rounds)
    cost_ratio: float | None  # c = draft_step_ms / target_step_ms
    verify_cost_ratio: float | None  # v = verify_ms / target_step_ms; the prediction assumes v = 1
    predicted_speedup: float | None  # (1 - a^(g+1)) / ((1 - a)(g c + 1)), g = gamma
    measured_speedup: float | None  # median over the timing rounds of plain time per token / speculative time per
    # token (decoding loops only)
    measured_speedup_min: float | None  # the smallest of those per-round ratios
    measured_speedup_max: float | None  # the largest
    speedup_rounds: int  # timing rounds behind them (fewer than asked when a Ctrl-C cut the measurement)
    tokens_per_s: float  # the shown (traced) run: new tokens / (prefill + rounds + trace), end to end
    baseline_tokens_per_s: float | None  # the plain loop, 1 / target_step (median over the timing rounds)
    stop_reason: str
    decode_tokens_per_s: float = float("nan")  # new tokens / the rounds' time (prefill and trace excluded)
    prefill_s: float = float("nan")
    # the speculative loop of the same timing rounds, 1 / median(time per emitted token): set beside
    # baseline_tokens_per_s it tells the same story as measured_speedup (both untraced, decoding loops only)
    speculative_tokens_per_s: float | None = None
    speedup_noisy: bool = False  # the rounds disagree too much to trust the median (see NOISY_SPREAD)
    warmup_s: float = float("nan")  # the untimed warm-up rounds before anything is timed (nan: none ran)

    def to_dict(self) -> dict:
        return asdict(self)


# The measured speedup is flagged as noisy when its rounds spread by more than this fraction of the median
# ((max - min) / median), or when they fall on both sides of 1 (faster in one round, slower in another).
NOISY_SPREAD = 0.25


def noisy(median: float, low: float, high: float) -> bool:
    return (high - low) > NOISY_SPREAD * median or (low < 1.0 < high)


def summarize(stats: RunStats, proposer: str, draft_calls: int, timed: list[SpeedupRound], timing):
    """Counts from this run's stats; times and speedups as medians over the timing rounds ``timed`` (this run's
    own draft and verification times when there are none)."""
    n, rounds = len(stats.new_ids), max(stats.rounds, 1)
    a = stats.accepted / stats.judged if stats.judged else 0.0
    draft_step = stats.draft_seconds / stats.drafted if stats.drafted else 0.0
    verify = stats.target_seconds / rounds
    speedup = median_spread([r.speedup for r in timed])
    target_step = None
    if timed:
        target_step = median_spread([r.plain_step_s for r in timed]).median
        draft_step = median_spread([r.draft_step_s for r in timed]).median
        verify = median_spread([r.verify_s for r in timed]).median
    c = draft_step / target_step if target_step else None
    return SpeculativeSummary(
        proposer=proposer,
        gamma=stats.gamma,
        new_tokens=n,
        rounds=stats.rounds,
        acceptance_rate=a,
        drafted_accepted_fraction=stats.accepted / stats.drafted if stats.drafted else 0.0,
        mean_accepted=stats.accepted / rounds,
        mean_drafted=stats.drafted / rounds,
        per_position_acceptance=[acc / seen if seen else None
                                 for acc, seen in zip(stats.accepted_at, stats.reached_at)],
        tokens_per_target_call=n / rounds,
        expected_tokens_per_round=expected_tokens(a, stats.gamma),
        target_calls=stats.rounds,
        draft_calls=draft_calls,
        draft_step_ms=draft_step * 1e3,
        target_step_ms=target_step * 1e3 if target_step is not None else None,
        verify_ms=verify * 1e3,
        cost_ratio=c,
        verify_cost_ratio=verify / target_step if target_step else None,
        predicted_speedup=predicted_speedup(a, c, stats.gamma) if c is not None else None,
        measured_speedup=speedup.median if speedup else None,
        measured_speedup_min=speedup.low if speedup else None,
        measured_speedup_max=speedup.high if speedup else None,
        speedup_rounds=speedup.count if speedup else 0,
        tokens_per_s=timing.tokens_per_s(n),
        baseline_tokens_per_s=1.0 / target_step if target_step else None,
        stop_reason=stats.stop_reason,
        decode_tokens_per_s=timing.decode_tokens_per_s(n),
        prefill_s=timing.prefill_s,
        speculative_tokens_per_s=1.0 / median_spread([r.spec_token_s for r in timed]).median if timed else None,
        speedup_noisy=noisy(speedup.median, speedup.low, speedup.high) if speedup and speedup.count > 1 else False,
    )


def best_gamma(rows: list[SpeculativeSummary]) -> int | None:
    """The gamma with the highest measured speedup (ties: the smaller gamma)."""
    scored = [r for r in rows if r.measured_speedup is not None and math.isfinite(r.measured_speedup)]
    if not scored:
        return None
    return max(scored, key=lambda r: (r.measured_speedup, -r.gamma)).gamma


def build_speculator(lm: LoadedModel, draft: LoadedModel | None, settings: SpeculateSettings,
                     prompt_ids: list[int], gamma: int, chain: Chain | None = None, record: bool = True,
                     max_new_tokens: int | None = None) -> Speculator:
    """A speculative run: the proposer (draft model or n-gram) and the target share the chain and, when sampling,
    one generator seeded by --seed. Both caches follow --cache."""
    chain = chain or make_chain(lm, settings)
    refuse_stepwise_stages(chain, "speculative decoding")
    chain.reset(len(prompt_ids))
    greedy = semantics_plan(settings).greedy
    gen = None if greedy else make_generator(settings.seed, lm.device)
    spec = settings.cache_spec
    proposer = make_proposer(proposer_spec(settings.draft, draft), draft, chain, greedy, gen, settings.ngram_size,
                             cache=spec)
    run = Speculator(lm.model, proposer, prompt_ids, chain, stop_rules(lm, settings, max_new_tokens), gamma, gen,
                     lm.token_text, lm.decode, settings.top, record, cache=spec)
    run.trim_stop = trims_stop(settings)
    return run


def speculate_run(lm: LoadedModel, settings: SpeculateSettings, prompt_text: str, prompt_ids: list[int],
                  draft: LoadedModel | None = None, chain: Chain | None = None, record: bool = True,
                  summary_only: bool = False) -> Speculator:
    """``speculate``'s run with its document head (the registry's build), at ``settings.gamma``; ``draft``: the
    draft model (None: the n-gram proposer); ``summary_only``: no per-round trace."""
    run = build_speculator(lm, draft, settings, prompt_ids, settings.gamma, chain, record=record and not summary_only)
    run.settings = settings
    run.origin = Origin.of("speculate", lm, as_dict(settings), run.chain.names, prompt_text, prompt_ids)
    run.lm = lm
    return run


def warm_up_speculate(lm: LoadedModel, draft: LoadedModel | None, settings: SpeculateSettings,
                      prompt_ids: list[int], chain: Chain) -> float:
    """A few untimed rounds: the first forwards of each model are slow. Returns their seconds (the summary's
    ``warmup_s``)."""
    start = clock(lm.device)
    for _ in build_speculator(lm, draft, settings, prompt_ids, settings.gamma, chain, record=False,
                              max_new_tokens=min(4, settings.max_new_tokens)):
        pass
    return clock(lm.device) - start


def plain_baseline(lm: LoadedModel, settings: SpeculateSettings, prompt_ids: list[int], chain: Chain,
                   tokens: int) -> BaselineTiming:
    """Plain target decoding of the same length, same chain and cache policy, timed in the same run."""
    return time_plain_decoding(lm.model, prompt_ids, chain, semantics_plan(settings).make_selector(settings.seed,
                                                                                                    lm.device),
                               tokens, lm.context_length, cache=settings.cache_spec)


class SpeedupRounds:
    """The measured speedup of one gamma over ``settings.speedup_rounds`` timing rounds. Each round pairs a
    speculative run with plain decoding of as many tokens (same prompt, settings, seed and chain, so every
    speculative run emits the same tokens); the order alternates, speculative first in rounds 1, 3, .. and plain
    first in rounds 2, 4, .., so a machine that slows down or speeds up during the measurement weighs on both sides
    alike. ``first``: the speculative run of round 1 when it has already run (the traced run a command shows; its
    loop time excludes the trace, like the untraced later runs). ``run()`` may be cut by Ctrl-C: ``rounds`` keeps
    the rounds completed, ``first`` the first speculative run once it is complete."""

    def __init__(self, lm: LoadedModel, draft: LoadedModel | None, settings: SpeculateSettings,
                 prompt_ids: list[int], chain: Chain, gamma: int, first: Speculator | None = None):
        self.lm, self.draft, self.settings, self.prompt_ids = lm, draft, settings, prompt_ids
        self.chain, self.gamma, self.first = chain, gamma, first
        self.rounds: list[SpeedupRound] = []

    def speculative(self) -> Speculator:
        run = build_speculator(self.lm, self.draft, self.settings, self.prompt_ids, self.gamma, self.chain,
                               record=False)
        for _ in run:
            pass
        return run

    def plain(self, tokens: int) -> BaselineTiming:
        return plain_baseline(self.lm, self.settings, self.prompt_ids, self.chain, tokens)

    def run(self) -> list[SpeedupRound]:
        for i in range(len(self.rounds), self.settings.speedup_rounds):
            if i == 0:
                if self.first is None:
                    self.first = self.speculative()
                run, baseline = self.first, self.plain(len(self.first.new_ids))
            elif i % 2:
                baseline = self.plain(len(self.first.new_ids))
                run = self.speculative()
            else:
                run = self.speculative()
                baseline = self.plain(len(run.new_ids))
            paired = speedup_round(run, baseline)
            if paired is None:
                break  # nothing to time (a run of no tokens)
            self.rounds.append(paired)
        return self.rounds


def with_gamma(settings: SpeculateSettings, gamma: int) -> SpeculateSettings:
    return replace(settings, gamma=gamma)
