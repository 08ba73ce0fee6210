"""The run's records (core/trace/records.py): the summary's means and rates, and the constraint summary, on steps
built by hand so every number is worked out here.

mutation run of core/trace/records.py (2026-12-02, second round): before it, these functions were reached only
through whole runs (tests/methods/test_constrained.py, test_decode.py), whose numbers never met the edges below.
"""

from __future__ import annotations

import math

import pytest

from decodelab.core.engine.run import Timing
from decodelab.core.trace.records import (HARDEST, ConstraintStep, SampleSummary, StageStat, Step, Tally,
                                          constraint_summary, summarize)


def step(index: int, token: str = "a", logprob: float = -1.0, raw_logprob: float = -2.0, entropy: float = 0.5,
         raw_entropy: float = 1.5, state: dict | None = None, removed: float | None = None) -> Step:
    stages = [StageStat("temperature", 10, 1.0, 0.0)]
    if removed is not None:
        stages.append(StageStat("constraint", 3, 0.7, removed))
    return Step(index, 7 + index, 100 + index, token, math.exp(logprob), logprob, math.exp(raw_logprob), raw_logprob,
                1, entropy, raw_entropy, 3, stages=stages, state=state or {})


def constrained(log_mass_kept: float, allowed: int = 4, forced: float = 0.0, top1: float = 0.0,
                whitespace: float = 0.0) -> dict:
    return {"constraint.log_mass_kept": log_mass_kept, "constraint.allowed": float(allowed),
            "constraint.forced": forced, "constraint.top1_banned": top1, "constraint.whitespace_only": whitespace}


def test_no_constraint_state_means_no_constraint_summary():
    assert constraint_summary([step(0), step(1, state={"mirostat.mu": 3.0})]) is None
    assert constraint_summary([]) is None


def test_the_constraint_summary_counts_worked_by_hand():
    """Five constrained steps (log mass kept -0.5, 0, -2, -0.1, -1) and one without the constraint's state: removed
    log mass 3.6 nats; forced, top-1-banned and whitespace-only count the steps whose flag is above 0; the hardest
    are the three most negative, worst first, a step that lost nothing never among them."""
    steps = [
        step(0, "x", state=constrained(-0.5, allowed=2, forced=1.0), removed=1 - math.exp(-0.5)),
        step(1, " ", state=constrained(0.0, allowed=1, forced=1.0, whitespace=1.0), removed=0.0),
        step(2, "\n", state={"mirostat.mu": 2.0}),
        step(3, "\t", state=constrained(-2.0, allowed=9, top1=1.0, whitespace=1.0)),  # no constraint stage statistic
        step(4, "y", state=constrained(-0.1, allowed=5), removed=1 - math.exp(-0.1)),
        step(5, "", state=constrained(-1.0, allowed=3, top1=0.5), removed=1 - math.exp(-1.0)),
    ]
    summary = constraint_summary(steps)
    assert summary.removed_log_mass == pytest.approx(3.6)
    assert (summary.steps, summary.forced_steps, summary.top1_banned_steps, summary.whitespace_only_steps) == \
        (5, 2, 2, 2)
    # " ", "\n", "\t" are three whitespace-only tokens in a row (the unconstrained step counts too); "" is not one
    assert summary.longest_whitespace_run == 3
    assert HARDEST == 3 and [h.log_mass_kept for h in summary.hardest] == [-2.0, -1.0, -0.5]
    worst = summary.hardest[0]
    assert (worst.index, worst.position, worst.token, worst.allowed) == (3, 10, "\t", 9)
    assert math.isnan(worst.mass_removed)  # no constraint stage statistic that step
    assert summary.hardest[2] == ConstraintStep(0, 7, "x", 2, pytest.approx(1 - math.exp(-0.5)), -0.5)


def test_an_empty_token_ends_a_whitespace_run_and_a_run_at_the_end_counts():
    steps = [step(0, " ", state=constrained(0.0)), step(1, "", state=constrained(0.0)),
             step(2, " ", state=constrained(0.0)), step(3, "  ", state=constrained(0.0))]
    summary = constraint_summary(steps)
    assert summary.longest_whitespace_run == 2 and summary.hardest == [] and summary.removed_log_mass == 0


def test_the_summary_means_and_rates_worked_by_hand():
    """Logprobs -1 and -3 (mean -2), raw -2 and -4 (mean -3, perplexity e^3), entropies 0.5 and 1.0, raw 1.5 and
    2.5; 2 tokens over prefill 1 s + loop 2 s + trace 1 s: 0.5 tokens/s end to end, 1 token/s in the loop."""
    steps = [step(0, logprob=-1.0, raw_logprob=-2.0, entropy=0.5, raw_entropy=1.5),
             step(1, logprob=-3.0, raw_logprob=-4.0, entropy=1.0, raw_entropy=2.5)]
    timing = Timing(prefill_s=1.0, loop_s=2.0, trace_s=1.0)
    for source in (steps, Tally.of(steps)):
        s = summarize(source, timing, "eos")
        assert (s.new_tokens, s.mean_logprob, s.mean_raw_logprob, s.stop_reason) == (2, -2.0, -3.0, "eos")
        assert s.raw_perplexity == pytest.approx(math.exp(3.0))
        assert (s.mean_entropy, s.mean_raw_entropy) == (0.75, 2.0)
        assert (s.tokens_per_s, s.decode_tokens_per_s, s.prefill_s) == (0.5, 1.0, 1.0)
        assert s.constraint is None
    # new_tokens counts what the run emitted when it kept fewer steps than it made (the rates use it)
    s = summarize(steps, timing, "length", new_tokens=4)
    assert (s.new_tokens, s.tokens_per_s, s.decode_tokens_per_s, s.mean_logprob) == (4, 1.0, 2.0, -2.0)


def test_an_unmeasured_run_has_nan_rates_and_an_empty_run_nan_means():
    s = summarize([step(0)], None, "length")
    assert math.isnan(s.tokens_per_s) and math.isnan(s.decode_tokens_per_s) and math.isnan(s.prefill_s)
    assert s.mean_logprob == -1.0
    empty = summarize([], Timing(prefill_s=1.0, loop_s=1.0), "interrupted")
    assert (empty.new_tokens, empty.stop_reason, empty.tokens_per_s, empty.decode_tokens_per_s, empty.prefill_s) == \
        (0, "interrupted", 0.0, 0.0, 1.0)
    for value in (empty.mean_logprob, empty.raw_perplexity, empty.mean_raw_logprob, empty.mean_entropy):
        assert math.isnan(value)


def test_the_constraint_summary_comes_with_the_steps_not_with_a_tally():
    steps = [step(0, state=constrained(-1.0), removed=1 - math.exp(-1.0))]
    assert summarize(steps, None, "eos").constraint.removed_log_mass == 1.0
    assert summarize(Tally.of(steps), None, "eos").constraint is None


def test_records_are_plain_dicts():
    s = summarize([step(0)], None, "eos")
    doc = s.to_dict()
    assert isinstance(s, SampleSummary) and doc["new_tokens"] == 1 and doc["constraint"] is None
    record = step(2, "z").to_dict()
    assert (record["index"], record["position"], record["token_id"], record["token"]) == (2, 9, 102, "z")
    assert record["stages"][0] == {"name": "temperature", "kept": 10, "entropy": 1.0, "mass_removed": 0.0}


def test_no_whitespace_token_means_a_longest_run_of_zero():
    steps = [step(0, "a", state=constrained(-0.5)), step(1, "b", state=constrained(0.0))]
    assert constraint_summary(steps).longest_whitespace_run == 0


def test_a_tally_without_steps_still_rates_the_tokens_it_is_told_of():
    """No step kept, 3 tokens emitted, prefill 1 s + loop 2 s + trace 1 s: 0.75 tokens/s end to end, 1.5 in the
    loop (the two rates are not interchangeable)."""
    s = summarize(Tally(), Timing(prefill_s=1.0, loop_s=2.0, trace_s=1.0), "length", new_tokens=3)
    assert (s.new_tokens, s.tokens_per_s, s.decode_tokens_per_s, s.prefill_s) == (3, 0.75, 1.5, 1.0)
    assert math.isnan(s.mean_logprob)
