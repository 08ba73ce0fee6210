"""Plain records of what a decoding run did: the single source of every number decodelab prints.

Two distributions are reported for every token and are never mixed up:

* ``raw_*``: the model's own softmax over its logits at temperature 1, before any processor;
* ``prob`` / ``logprob`` / ``entropy`` / ``kept``: the processed distribution at the end of the chain, the one the
  selector actually drew from (a point mass for greedy decoding at temperature 0).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ..sampling.registry import constraint_stage


@dataclass
class Alternative:
    token_id: int
    token: str
    prob: float  # processed distribution
    raw_prob: float  # model softmax


@dataclass
class StageStat:
    name: str
    kept: int  # candidates with non-zero probability after this stage
    entropy: float  # nats, of the distribution after this stage
    mass_removed: float  # probability mass (before this stage) of the candidates this stage removed


@dataclass
class Step:
    index: int  # 0 for the first generated token
    position: int  # absolute position of the token in the sequence (prompt included)
    token_id: int
    token: str
    prob: float
    logprob: float
    raw_prob: float
    raw_logprob: float
    raw_rank: int  # 1 = the model's own most likely token
    entropy: float
    raw_entropy: float
    kept: int
    alternatives: list[Alternative] = field(default_factory=list)
    stages: list[StageStat] = field(default_factory=list)
    decided_by: str | None = None  # the stage that decided this token, "model" or "forced" (core/why.py)
    why: str | None = None  # the same in one sentence
    state: dict[str, float] = field(default_factory=dict)  # stateful stages this step: mirostat.mu, xtc.coin, ...

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class SampleSummary:
    new_tokens: int
    mean_logprob: float  # mean processed log-probability of the emitted tokens
    raw_perplexity: float  # exp(-mean raw log-probability): how surprised the model itself was
    tokens_per_s: float  # new tokens / (prefill + loop + trace): end to end
    stop_reason: str  # eos | stop | length | context | interrupted
    decode_tokens_per_s: float = float("nan")  # new tokens / loop time (prefill and trace excluded)
    prefill_s: float = float("nan")  # the forward over the prompt
    # the model's own numbers beside the processed ones, so runs compare on the same scale whatever their chain (a
    # greedy run's processed logprobs are all 0 and its processed entropies all 0)
    mean_raw_logprob: float = float("nan")  # mean raw log-probability of the emitted tokens
    mean_raw_entropy: float = float("nan")  # mean entropy of the model's own distribution, nats
    mean_entropy: float = float("nan")  # mean entropy of the processed distribution drawn from, nats
    constraint: ConstraintSummary | None = None  # what a constraint stage did over the run (None: no constraint)
    warmup_s: float = float("nan")  # first-call costs paid before the timed part, in no rate above
    compile_s: float | None = None  # the first compiled call (--compile), in no rate above; None: nothing compiled

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ConstraintStep:
    """One step where the constraint bit: the mass it removed (the chain's stage statistic, under the distribution
    before it) and the log of the mass it kept (the stage's own number, precise where the kept mass is tiny)."""

    index: int
    position: int
    token: str
    allowed: int  # tokens the constraint allowed there (end ids included)
    mass_removed: float
    log_mass_kept: float  # log(1 - mass_removed), <= 0


@dataclass
class ConstraintSummary:
    """A constrained run in numbers. With m_t the mass the constraint kept at step t (under its input distribution),
    the constrained probability of each token is its unconstrained one divided by m_t, so

        removed_log_mass = -sum_t log m_t  (nats, >= 0)

    is how much less likely, in log-probability, the output is under the stage's input distributions than under the
    constrained ones: 0 when the constraint never removed anything the model wanted."""

    removed_log_mass: float
    steps: int  # traced steps under the constraint
    forced_steps: int  # steps where it allowed exactly one token
    top1_banned_steps: int  # steps where it removed the model's own most likely token(s)
    whitespace_only_steps: int  # steps where every text token it allowed was whitespace-only
    longest_whitespace_run: int  # most consecutive emitted tokens that are whitespace-only text
    hardest: list[ConstraintStep] = field(default_factory=list)  # the steps with the least mass kept, worst first


HARDEST = 3  # steps listed in ConstraintSummary.hardest


def constraint_summary(steps: list[Step]) -> ConstraintSummary | None:
    """From the steps' ``constraint.*`` state (the stage's name, then its key) and the constraint's stage statistic
    (None: no constraint ran)."""
    name = constraint_stage()
    key = lambda k: f"{name}.{k}"  # noqa: E731
    rows = [s for s in steps if key("log_mass_kept") in s.state]
    if not rows:
        return None
    rows = [s for s in rows if s.state.get(key("active"), 1.0) > 0]  # --constraint-after-think: while active
    bitten = []
    for s in rows:
        removed = next((st.mass_removed for st in s.stages if st.name == name), float("nan"))
        bitten.append(ConstraintStep(s.index, s.position, s.token, int(s.state[key("allowed")]), removed,
                                     s.state[key("log_mass_kept")]))
    run = longest = 0
    for s in steps:
        run = run + 1 if s.token.isspace() else 0  # "".isspace() is False
        longest = max(longest, run)
    count = lambda k: sum(1 for s in rows if s.state[key(k)] > 0)  # noqa: E731
    worst = sorted((b for b in bitten if b.log_mass_kept < 0), key=lambda b: b.log_mass_kept)[:HARDEST]
    return ConstraintSummary(-sum(b.log_mass_kept for b in bitten), len(rows), count("forced"),
                             count("top1_banned"), count("whitespace_only"), longest, worst)


@dataclass
class Tally:
    """The running sums a run's summary needs, added step by step (the same sums, in the same order, as over the
    kept steps), so that a run which does not keep its steps (a stream to JSONL) holds no memory per token."""

    steps: int = 0
    logprob: float = 0.0  # sums of the processed and the raw log-probabilities
    raw_logprob: float = 0.0
    entropy: float = 0.0  # sums of the processed and the raw entropies
    raw_entropy: float = 0.0

    def add(self, step: Step) -> None:
        self.steps += 1
        self.logprob += step.logprob
        self.raw_logprob += step.raw_logprob
        self.entropy += step.entropy
        self.raw_entropy += step.raw_entropy

    @classmethod
    def of(cls, steps: list[Step]) -> Tally:
        tally = cls()
        for step in steps:
            tally.add(step)
        return tally


def summarize(steps: list[Step] | Tally, timing, stop_reason: str, new_tokens: int | None = None) -> SampleSummary:
    """``steps``: the run's steps, or their :class:`Tally` for a run that keeps none (then no constraint summary);
    ``timing``: a :class:`~decodelab.core.engine.run.Timing` (None: unmeasured)."""
    tally = steps if isinstance(steps, Tally) else Tally.of(steps)
    n = tally.steps if new_tokens is None else new_tokens
    nan = float("nan")
    rates = (timing.tokens_per_s(n), timing.decode_tokens_per_s(n), timing.prefill_s) if timing else (nan,) * 3
    warm = {"warmup_s": timing.warmup_s, "compile_s": timing.compile_s} if timing else {}
    if not tally.steps:
        return SampleSummary(n, nan, nan, rates[0], stop_reason, rates[1], rates[2], **warm)
    mean_raw = tally.raw_logprob / tally.steps
    return SampleSummary(n, tally.logprob / tally.steps, math.exp(-mean_raw), rates[0], stop_reason, rates[1],
                         rates[2], mean_raw, tally.raw_entropy / tally.steps, tally.entropy / tally.steps,
                         None if isinstance(steps, Tally) else constraint_summary(steps), **warm)


@dataclass
class TokenProb:
    token_id: int
    token: str
    logit: float  # this stage's logit (-inf once removed)
    prob: float  # this stage's probability


@dataclass
class StageView:
    """The next-token distribution after one stage of the chain ('raw' is the model's own softmax)."""

    name: str
    kept: int
    entropy: float
    mass_removed: float
    top: list[TokenProb] = field(default_factory=list)


@dataclass
class TrackedToken:
    """One candidate followed through every stage: its probability (and rank) after each."""

    token_id: int
    token: str
    logit: float  # the model's raw logit
    raw_prob: float
    probs: dict[str, float] = field(default_factory=dict)
    ranks: dict[str, int | None] = field(default_factory=dict)  # None once removed
