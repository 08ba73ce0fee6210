"""The measured speedup of speculative decoding: plain target decoding of the same tokens timed with the same chain
and cache, paired with a speculative run in one round, and the median and spread over rounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ...engine.run import Stopwatch
from ...engine.stopping import StopRules
from ...kv import CacheSpec
from ...sampling.chain import Chain
from ..sample import decode_tokens

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


def speedup_round(run, baseline: BaselineTiming) -> SpeedupRound | None:
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








