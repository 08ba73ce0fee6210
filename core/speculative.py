"""Speculative decoding: a cheap proposer drafts gamma tokens, the target scores them all in one forward.

One verification round, with the sequence so far s (its last token not yet fed to the target):

1. the proposer drafts x_1..x_g and, for each, q_i = its processed distribution given s + x_1..x_{i-1}
   (a draft model: g single-token forwards through its own cache; the n-gram proposer: a point mass, q_i(x_i) = 1);
2. the target runs ONE forward over [s_last, x_1, .., x_g] and keeps the logits of all g+1 positions;
   p_i = the processed distribution (the same chain, the same prefix ids) for the token after s + x_1..x_{i-1};
3. sampling (temperature > 0, Leviathan et al. 2023 / Chen et al. 2023): accept x_i iff u_i < p_i(x_i) / q_i(x_i),
   u_i ~ U(0, 1), i.e. with probability min(1, p/q), stopping at the first rejection; at a rejection at i emit a
   correction y ~ norm(max(0, p_i - q_i)); if all g are accepted emit a bonus y ~ p_{g+1}. Every emitted token is
   then distributed exactly as under the target alone:
       P(y) = min(p, q)(y) + (1 - sum_z min(p, q)(z)) * max(0, p - q)(y) / sum_z max(0, p - q)(z) = p(y),
   because sum_z max(0, p - q) = 1 - sum_z min(p, q);
   greedy (temperature 0): accept while x_i == argmax p_i, then emit argmax p at the first mismatch (correction)
   or after the last draft (bonus): exactly the target's greedy output;
4. both caches are cropped to the accepted prefix (the runtime's ``truncate``): the accepted positions are never recomputed.
   The target's cache keeps s + x_1..x_k (the emitted token y is fed as the first token of the next round); the
   draft model's cache keeps at most that and catches up at the start of its next round (1 or 2 tokens).

Expected tokens per round with a per-token acceptance probability a and g drafts: (1 - a^(g+1)) / (1 - a)
(g + 1 at a = 1); with a draft step costing c target steps, the speedup over plain decoding is that divided by
g c + 1.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from .config import SampleSettings, cache_spec, validate_sample
from .decode import decode_tokens
from .errors import ConfigError
from .kv import CacheSpec, require
from .model import LoadedModel
from .processors import Chain, softmax
from .run import Run, Stopwatch, Timing, synchronize
from .runtime import Runtime
from .select import Greedy, Multinomial
from .step import StopChecker, StopRules, TokenBuffer, check_prompt, check_selected

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
    require(cache_spec(s), {"truncate"}, "speculative decoding (a rejected draft is rolled back)")
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
    if not items or not all(t.isdecimal() and 1 <= int(t) <= MAX_GAMMA for t in items):
        raise ConfigError(f"--sweep-gamma {text!r}: a comma-separated list of integers in [1, {MAX_GAMMA}], "
                          "e.g. 1,2,4,8")
    return tuple(dict.fromkeys(int(t) for t in items))


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel, spec: str) -> None:
    """The draft's q and the target's p must be distributions over the same token ids."""
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"--draft {spec}: vocabulary {draft.vocab_size} differs from the target's "
                          f"{target.vocab_size}; the draft must share the target's tokenizer and output size")
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ConfigError(f"--draft {spec}: its tokenizer maps tokens to ids differently from the target's "
                          f"(both have {target.vocab_size} outputs); use a draft trained with the same tokenizer")


# ---------------------------------------------------------------------------------------------------------------
# the verification rule: pure functions (sampling batched over rows [B, ...], so tests can run thousands at once)
# ---------------------------------------------------------------------------------------------------------------


def final_kind(drafted: int, accepted: int) -> str:
    """What the token after a round's accepted drafts is: "correction" (a draft was rejected, y ~ norm(max(0, p -
    q))), "bonus" (every one of >= 1 drafts accepted, y ~ p), or "plain" (nothing was drafted: no n-gram match, or
    the last token of -n; y ~ p is an ordinary target step, earned by no draft)."""
    if drafted == 0:
        return "plain"
    return "bonus" if accepted == drafted else "correction"


class Verdict(NamedTuple):
    accepted: Tensor  # [B] number of drafts accepted (a prefix)
    token: Tensor  # [B] the token emitted after them: correction (accepted < g) or bonus (accepted == g)
    final_probs: Tensor  # [B, V] the distribution that token was drawn from: norm(max(0, p - q)) or p


def acceptance_probability(p_x: Tensor, q_x: Tensor) -> Tensor:
    """min(1, p(x) / q(x)): q >= p only lowers the chance; q <= p always accepts."""
    return torch.clamp(p_x / q_x, max=1.0)


def residual_distribution(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(0, p - q)) over the last dim: the mass p has beyond q. Where p <= q everywhere (only when p == q,
    where a rejection cannot happen) the row falls back to p."""
    excess = (p - q).clamp_min(0.0)
    total = excess.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, excess / total.clamp_min(1e-30), p)


def verify_sampled(p: Tensor, q: Tensor, drafts: Tensor, u: Tensor, race: Tensor) -> Verdict:
    """Speculative sampling for B rows at once.

    p [B, g+1, V] target (processed) distributions, q [B, g, V] the proposer's, drafts [B, g] the drafted ids,
    u [B, g] uniforms in [0, 1), race [B, V] Exp(1) draws for the emitted token (argmax r_i / E_i ~ r).
    """
    rows, g = drafts.shape
    p_x = p[:, :g].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    q_x = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    accept = u * q_x < p_x  # u < p/q  <=>  accepted with probability min(1, p/q)
    accepted = accept.long().cumprod(dim=-1).sum(dim=-1)  # length of the accepted prefix
    # position `accepted` of q padded with zeros: at g (all accepted) the residual max(0, p - 0) is p: the bonus
    q_pad = torch.cat([q, q.new_zeros(rows, 1, q.shape[-1])], dim=1)
    at = torch.arange(rows, device=p.device)
    final = residual_distribution(p[at, accepted], q_pad[at, accepted])
    return Verdict(accepted, (final / race).argmax(dim=-1), final)


def verify_greedy(best: list[int], drafts: list[int]) -> tuple[int, int]:
    """Greedy verification: accept while x_i == argmax p_i, then emit argmax p at the first mismatch (correction)
    or after the last draft (bonus). ``best`` = the g+1 argmaxes of the target's processed rows; returns
    (accepted, token). Plain lists: one round is a handful of ints, cheaper than tensor ops."""
    k = 0
    while k < len(drafts) and drafts[k] == best[k]:
        k += 1
    return k, best[k]


def point_masses(tokens: Tensor, vocab: int) -> Tensor:
    """q for a deterministic proposer: q_i(x_i) = 1, so its acceptance probability is min(1, p(x_i))."""
    return torch.nn.functional.one_hot(tokens, vocab).to(torch.float32)


def expected_tokens(a: float, g: int) -> float:
    """Tokens per round: 1 + a + a^2 + .. + a^g = (1 - a^(g+1)) / (1 - a), and g + 1 in the limit a -> 1."""
    if a >= 1.0:
        return g + 1.0
    return (1.0 - a ** (g + 1)) / (1.0 - a)


def predicted_speedup(a: float, c: float, g: int) -> float:
    """(1 - a^(g+1)) / ((1 - a)(g c + 1)): expected tokens per round over the round's cost in target steps."""
    return expected_tokens(a, g) / (g * c + 1.0)


# ---------------------------------------------------------------------------------------------------------------
# the sequence and the proposers
# ---------------------------------------------------------------------------------------------------------------


Sequence = TokenBuffer  # the ids so far; drafts are written past its length as scratch


class Draft(NamedTuple):
    tokens: Tensor  # [g] drafted ids
    q: Tensor | None  # [g, V] processed draft distributions; None = point masses (greedy, or the n-gram)
    raw_logits: list[Tensor] | None  # g rows [1, V]: the draft model's own logits (None for the n-gram)


class Proposer(Protocol):
    name: str
    forwards: int  # draft forwards so far (prefill excluded)
    context_length: int | None

    def start(self, seq: Sequence) -> None: ...  # a new run on this prompt

    def propose(self, seq: Sequence, gamma: int) -> Draft: ...  # up to gamma tokens (may be fewer, even 0)

    def rollback(self, length: int) -> None: ...  # keep only the first `length` positions of the sequence


class ModelProposer:
    """A small model with the target's vocabulary drafts from its processed distribution q (same chain)."""

    def __init__(self, model, chain: Chain, selector: Callable[[Tensor], Tensor], name: str = "draft",
                 context_length: int | None = None, cache: CacheSpec | None = None):
        self.model, self.chain, self.selector, self.name = model, chain, selector, name
        self.context_length, self.spec = context_length, cache
        self.uses_ids = chain.uses_ids  # a stage reads the prefix: each position needs its own
        self.forwards = 0
        self.runtime: Runtime | None = None

    def start(self, seq: Sequence) -> None:
        """Prefill everything but the last prompt token (it is fed with the first round)."""
        self.runtime = Runtime.create(self.model, self.spec, capacity=seq.ids.shape[1],
                                      needs=frozenset({"truncate"}))
        self.forwards = 0
        self.runtime.prefill(seq.prefix(), hold_last=True)

    @torch.inference_mode()
    def propose(self, seq: Sequence, gamma: int) -> Draft:
        runtime, n = self.runtime, seq.length
        # 1 token behind, or 2 after a round that accepted every draft
        logits = runtime.feed(seq.ids[:, runtime.fed : n])
        greedy = isinstance(self.selector, Greedy)
        tokens, q_rows, raw_rows = [], [], []
        for i in range(gamma):
            # same chain and prefix as the target's p; unchecked: only bans (-inf biases, no-repeat n-grams of the
            # prefix) can empty a row, and the target's checked chain on the same prefix raises that in this round
            processed = self.chain.apply(seq.prefix(i), logits)
            # greedy: q is the point mass on the argmax, so the logits' argmax is the draw (no softmax needed)
            q = processed if greedy else softmax(processed)
            token = self.selector(q)
            if self.uses_ids:
                seq.ids[0, n + i] = token[0]  # the next position's prefix includes this draft
            tokens.append(token)
            q_rows.append(q)
            raw_rows.append(logits)
            if i + 1 < gamma:
                logits = runtime.feed(token.view(1, 1))
        self.forwards += gamma
        drafted = torch.cat(tokens)
        if not self.uses_ids:
            seq.ids[0, n : n + gamma] = drafted  # scratch: the target's forward reads the drafts from here
        return Draft(drafted, None if greedy else torch.cat(q_rows), raw_rows)

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` tokens of the sequence (the draft cache may already hold fewer)."""
        if self.runtime.fed > length:
            self.runtime.rollback(self.runtime.fed - length)


class NGramProposer:
    """Prompt lookup: find the most recent earlier occurrence of the last n tokens (n = size, size-1, .., 1) and
    propose the tokens that followed it (copying on through the proposal itself when the match is close to the end,
    so a repeating pattern continues). Deterministic: q is a point mass on each proposed token."""

    context_length = None

    def __init__(self, size: int = 3):
        self.size = size
        self.name = f"ngram-{size}"
        self.forwards = 0
        self.follow: list[dict[tuple[int, ...], int]] = []
        self.indexed = 0

    def start(self, seq: Sequence) -> None:
        self.follow = [{} for _ in range(self.size)]  # per n: n-gram -> where its latest continuation starts
        self.indexed = 0
        self.forwards = 0

    def _index(self, tokens: list[int]) -> None:
        """Record every n-gram that ends before the last token, i.e. that has a continuation."""
        for end in range(max(self.indexed, 1), len(tokens)):
            for n in range(1, min(self.size, end) + 1):
                self.follow[n - 1][tuple(tokens[end - n : end])] = end
        self.indexed = len(tokens)

    def lookup(self, tokens: list[int], gamma: int) -> list[int]:
        self._index(tokens)
        for n in range(min(self.size, len(tokens)), 0, -1):
            start = self.follow[n - 1].get(tuple(tokens[len(tokens) - n :]))
            if start is not None:
                out: list[int] = []
                for i in range(gamma):
                    src = start + i  # < len(tokens) + i: the copy may run on into its own output
                    out.append(tokens[src] if src < len(tokens) else out[src - len(tokens)])
                return out
        return []

    def propose(self, seq: Sequence, gamma: int) -> Draft:
        out = self.lookup(seq.tokens, gamma)
        if out:
            seq.ids[0, seq.length : seq.length + len(out)] = torch.tensor(out, dtype=torch.long)
        return Draft(torch.tensor(out, dtype=torch.long, device=seq.ids.device), None, None)

    def rollback(self, length: int) -> None:
        return None  # the index only ever holds committed tokens


def process_block(chain: Chain, seq: Sequence, logits: Tensor, uses_ids: bool) -> Tensor:
    """The chain on the target's g+1 rows; row i follows the prefix s + x_1..x_i. Unchecked: a row after a rejected
    draft is never used, so only the row the emitted token comes from is checked (in ``Speculator.step``)."""
    if uses_ids:
        return torch.cat([chain.apply(seq.prefix(i), logits[i : i + 1]) for i in range(logits.shape[0])])
    return chain.apply(seq.prefix().expand(logits.shape[0], -1), logits)


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

    def to_dict(self) -> dict:
        out = {"index": self.index, "position": self.position, "drafted": self.drafted,
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
        self.uses_ids = chain.uses_ids  # a stage reads the prefix: each position needs its own
        self.stats = RunStats(gamma)
        self.rounds: list[Round] = []
        self.runtime: Runtime | None = None
        self.seq: Sequence | None = None
        self.stopper = StopChecker(rules, detok)
        self.watch: Stopwatch | None = None

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
        synchronize(device)
        t0 = time.perf_counter()
        draft = self.proposer.propose(seq, g) if g > 0 else Draft(seq.ids.new_zeros(0), None, None)
        g = int(draft.tokens.shape[0])
        synchronize(device)
        t1 = time.perf_counter()
        # one target forward over [s_last, x_1..x_g] at positions seen .. seen + g: logits for the g+1 positions
        logits = runtime.feed(seq.ids[:, n - 1 : n + g], keep="all")[0]
        processed = process_block(self.chain, seq, logits, self.uses_ids)
        if self.greedy:
            drafts, k, token, finite = self.verify_greedy(processed, draft)
            p = q = u = final = None
        else:
            drafts, k, token, finite, p, q, u, final = self.verify(processed, draft)
        check_selected(finite, self.chain, processed)  # the chain left nothing at the position decided
        runtime.rollback(g - k)  # keep s + x_1..x_k (x_{k+1}.. rejected); y is fed with the next round
        self.proposer.rollback(n + k)
        synchronize(device)
        t2 = time.perf_counter()
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
                    target_ms=o.target_ms)
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

    def summary(self, timed: BaselineTiming | list[SpeedupRound] | None) -> SpeculativeSummary:
        """The run's summary; its speedups from ``timed``: the timing rounds (see :class:`SpeedupRound`), or one
        plain reference run paired with this run, or None (no reference: speedups null)."""
        timing = self.watch.timing if self.watch is not None else Timing()  # never started: interrupted before
        if isinstance(timed, BaselineTiming):
            timed = [r for r in [speedup_round(self, timed)] if r is not None]
        return summarize(self.stats, self.proposer.name, self.proposer.forwards, timed or [], timing)


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


# ---------------------------------------------------------------------------------------------------------------
# the reference run and the summary
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class BaselineTiming:
    """Plain target decoding (decode_tokens, same chain) of the same number of tokens, timed in the same run."""

    tokens: int
    decode_seconds: float  # the loop after the prefill (its loop_s): one decode forward per token after the first

    @property
    def step_seconds(self) -> float:
        return self.decode_seconds / max(self.tokens - 1, 1)


@dataclass
class SpeedupRound:
    """One timing round: a speculative run and plain decoding of the same number of tokens, back to back, both
    timed over their decoding loops only (prefills and the trace excluded)."""

    plain_step_s: float  # plain decoding: seconds per decode step
    spec_token_s: float  # speculative decoding: seconds per emitted token
    draft_step_s: float  # drafting seconds per drafted token (0 when nothing was drafted)
    verify_s: float  # verification seconds per round

    @property
    def speedup(self) -> float:
        """plain time per token / speculative time per token."""
        return self.plain_step_s / self.spec_token_s


def speedup_round(run: Speculator, baseline: BaselineTiming) -> SpeedupRound | None:
    """Pair a finished speculative run with its plain reference; None when the run emitted nothing or was never
    timed (interrupted before its first round)."""
    stats, n = run.stats, len(run.new_ids)
    if run.watch is None or n == 0 or stats.rounds == 0 or baseline.decode_seconds <= 0:
        return None
    return SpeedupRound(baseline.step_seconds, run.watch.timing.loop_s / n,
                        stats.draft_seconds / stats.drafted if stats.drafted else 0.0,
                        stats.target_seconds / stats.rounds)


class Spread(NamedTuple):
    median: float
    low: float  # the smallest value
    high: float  # the largest value
    count: int


def median_spread(values: list[float]) -> Spread | None:
    """Median (the mean of the middle two for an even count), minimum and maximum; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    n, mid = len(ordered), len(ordered) // 2
    median = ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0
    return Spread(median, ordered[0], ordered[-1], n)


def time_plain_decoding(target, prompt_ids: list[int], chain: Chain, selector, tokens: int,
                        context_length: int | None, cache: CacheSpec | None = None) -> BaselineTiming:
    """Generate exactly ``tokens`` tokens (EOS ignored) with the bare loop under the same KV policy; its loop time
    (the prefill excluded, as for the speculative run)."""
    rules = StopRules(max(tokens, 2), ignore_eos=True, context_length=context_length)
    watch = Stopwatch(next(target.parameters()).device)
    produced = sum(1 for _ in decode_tokens(target, prompt_ids, chain, selector, rules, watch=watch, cache=cache))
    return BaselineTiming(produced, watch.timing.loop_s)


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
    tokens_per_s: float  # new tokens / (prefill + rounds + trace): end to end
    baseline_tokens_per_s: float | None  # the plain loop, 1 / target_step
    stop_reason: str
    decode_tokens_per_s: float = float("nan")  # new tokens / the rounds' time (prefill and trace excluded)
    prefill_s: float = float("nan")

    def to_dict(self) -> dict:
        return asdict(self)


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
    )


def best_gamma(rows: list[SpeculativeSummary]) -> int | None:
    """The gamma with the highest measured speedup (ties: the smaller gamma)."""
    scored = [r for r in rows if r.measured_speedup is not None and math.isfinite(r.measured_speedup)]
    if not scored:
        return None
    return max(scored, key=lambda r: (r.measured_speedup, -r.gamma)).gamma


def make_selector_for(greedy: bool, generator: torch.Generator | None):
    """The proposer's selector: argmax at temperature 0, else a draw sharing the run's generator."""
    return Greedy() if greedy else Multinomial(generator)
