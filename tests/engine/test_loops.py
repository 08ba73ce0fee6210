"""The repetition stop (core/engine/loops.py) against a brute force of vLLM's rule, the stop in a run, the option's
errors, and the loop attribution (core/analysis/loops.py) on the bundled tiny model: a logit bias that keeps a
one-token loop is named as the keeper by re-scoring, a constraint that forces a loop as the keeper by removal."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decodelab.core.analysis.loops import attribute
from decodelab.core.engine.loops import RepetitionRule, copies, parse_repetition_stop
from decodelab.core.engine.stopping import StopChecker, StopRules
from decodelab.core.errors import ConfigError
from decodelab.core.methods.sample import SampleSettings, build_sampler


def brute_period(g, max_size, min_count, min_size=0):
    """Every period p from the smallest: the tail of p * min_count tokens is the last p tokens min_count times."""
    if max_size <= 0 or min_count < 2:
        return None
    for p in range(max(min_size, 1), max_size + 1):
        if p * min_count <= len(g) and g[len(g) - p * min_count:] == g[len(g) - p:] * min_count:
            return p
    return None


@settings(max_examples=500, deadline=None)
@given(g=st.lists(st.integers(0, 2), max_size=30), max_size=st.integers(-1, 6), min_count=st.integers(0, 5),
       min_size=st.integers(0, 6))
def test_period_is_the_brute_force_of_vllms_rule(g, max_size, min_count, min_size):
    if min_size > max(max_size, 0):
        min_size = 0
    assert RepetitionRule(max_size, min_count, min_size).period(g) == brute_period(g, max_size, min_count, min_size)


@settings(max_examples=200, deadline=None)
@given(pattern=st.lists(st.integers(0, 3), min_size=1, max_size=4), k=st.integers(1, 6),
       head=st.lists(st.integers(4, 5), max_size=3))
def test_copies_counts_the_whole_copies_at_the_end(pattern, k, head):
    g = head + pattern * k
    n = copies(g, len(pattern))
    assert n >= k and g[len(g) - n * len(pattern):] == pattern * n
    assert g[len(g) - (n + 1) * len(pattern):] != pattern * (n + 1) or len(g) < (n + 1) * len(pattern)


def test_the_checker_stops_on_repetition_only_after_the_other_reasons():
    rules = StopRules(max_new_tokens=6, eos_ids=(9,), repetition=RepetitionRule(2, 3))
    checker = StopChecker(rules)
    assert checker.check([1, 2, 1, 2, 1], 5) is None
    assert checker.check([1, 2, 1, 2, 1, 2], 6) == "length"  # -n first, as vLLM checks length before repetition
    assert StopChecker(StopRules(10, repetition=RepetitionRule(2, 3))).check([1, 2, 1, 2, 1, 2], 6) == "repetition"
    assert checker.check([9, 9, 9], 3) == "eos"


@pytest.mark.parametrize("text,message", [
    ("max_pattern_size=4", "needs both"), ("min_count=3", "needs both"), ("max_pattern_size=4,min_count=1", ">= 2"),
    ("max_pattern_size=0,min_count=3", ">= 1"), ("max_pattern_size=2,min_count=3,min_pattern_size=3", "min_pattern"),
    ("size=2,min_count=3", "give max_pattern_size"), ("max_pattern_size=x,min_count=3", "must be an integer")])
def test_bad_repetition_stop_is_one_line_naming_the_option(text, message):
    with pytest.raises(ConfigError, match=f"--repetition-stop '{text}'.*{message}"):
        parse_repetition_stop(text)


@functools.lru_cache(maxsize=1)
def tiny():
    from decodelab.core.engine.models import load_model
    return load_model("tiny", device="cpu")


def run(**kw):
    lm = tiny()
    s = SampleSettings(temperature=0.0, max_new_tokens=40, **kw)
    prompt = lm.encode("Once upon a time")
    sampler = build_sampler(lm, s, prompt, record=False)
    for _ in sampler:
        pass
    return lm, s, prompt, sampler


def test_a_run_stops_at_the_first_position_the_rule_fires():
    lm, s, prompt, sampler = run(repetition_stop="max_pattern_size=8,min_count=3", regex="(a b )+")
    assert sampler.stop_reason == "repetition"
    rule = parse_repetition_stop(s.repetition_stop)
    ids = sampler.new_ids
    assert brute_period(ids, 8, 3) is not None
    assert all(brute_period(ids[:k], 8, 3) is None for k in range(len(ids)))


def test_a_bias_keeps_a_one_token_loop_by_rescoring():
    lm = tiny()
    token = lm.encode(" the")[0]
    _, s, prompt, sampler = run(repetition_stop="max_pattern_size=4,min_count=4", logit_bias=((str(token), 30.0),))
    assert sampler.stop_reason == "repetition" and set(sampler.new_ids[-4:]) == {token}
    report = attribute(lm, s, prompt, sampler.new_ids, parse_repetition_stop(s.repetition_stop))
    assert (report.period, report.pattern) == (1, [token])
    raw = torch.log_softmax(__import__("decodelab.core.engine.forward", fromlist=["forward"]).forward(
        lm.model, torch.tensor([prompt + sampler.new_ids]), logits_to_keep=0)[0], -1)
    for p in report.positions:
        model_top = int(raw[len(prompt) + p.index - 1].argmax())
        assert p.raw_top == model_top
        assert p.kept_by == ("model" if model_top == token else "bias")
        assert "bias" not in p.removed_by  # a bias re-scores, it removes nothing (greedy temperature 0 removes the rest)
    assert report.kept_by.get("bias", 0) > 0


def test_a_constraint_that_forces_the_loop_removed_every_breaker():
    lm, s, prompt, sampler = run(repetition_stop="max_pattern_size=8,min_count=3", regex="(a b )+")
    report = attribute(lm, s, prompt, sampler.new_ids, parse_repetition_stop(s.repetition_stop))
    assert report is not None and report.count >= 3
    for p in report.positions:
        if p.breakers:
            assert p.kept_by == "constraint"
            assert p.removed_by == {"constraint": p.breakers}  # each token the model preferred was masked
            assert all(stage == "constraint" for _, stage in p.strongest)
        else:
            assert p.kept_by == "model"
    assert report.kept_by.get("constraint", 0) > 0


def test_a_stage_with_state_is_named_in_the_note_and_a_pure_chain_has_none():
    lm, s, prompt, sampler = run(repetition_stop="max_pattern_size=8,min_count=3", regex="(a b )+")
    assert attribute(lm, s, prompt, sampler.new_ids, parse_repetition_stop(s.repetition_stop)).note is None
    lm, s, prompt, sampler = run(repetition_stop="max_pattern_size=8,min_count=3", regex="(a b )+",
                                 mirostat_tau=0.5)
    report = attribute(lm, s, prompt, sampler.new_ids, parse_repetition_stop(s.repetition_stop))
    assert report is not None and "mirostat" in report.note


def test_the_stop_waits_for_min_new_tokens_as_vllms_min_tokens_gates_it():
    lm, s, prompt, plain = run(repetition_stop="max_pattern_size=8,min_count=3", regex="(a b )+")
    n = len(plain.new_ids)
    lm, s, prompt, held = run(repetition_stop="max_pattern_size=8,min_count=3", regex="(a b )+",
                              min_new_tokens=n + 3)
    ids = held.new_ids
    assert held.stop_reason == "repetition" and len(ids) >= n + 3
    assert brute_period(ids[:n], 8, 3) is not None  # the loop was there before the gate: held back
    assert all(brute_period(ids[:k], 8, 3) is None for k in range(n + 3, len(ids)))  # the first check past it
