"""The reasoning / answer split of a trace (core/trace/reasoning.py): labels and per-part means against hand sums, and
on the bundled tiny model with the thinking block opened by the prompt and closed by the budget (the thinking model
of docs/reasoning.md)."""

from __future__ import annotations

import functools
import math

import pytest

from decodelab.core.methods.sample import SampleSettings, build_sampler
from decodelab.core.sampling.thinking import ThinkTags
from decodelab.core.trace import reasoning

TAGS = ThinkTags((1,), (2,))


def test_split_means_are_the_hand_means_of_each_part():
    prompt = [7, 1]  # the prompt opened the block
    tokens = [5, 6, 2, 8, 9, 9]  # reasoning x2, END, answer x3
    lp = [-1.0, -3.0, -0.5, -2.0, -4.0, -6.0]
    ent = [1.0, 2.0, 0.1, 3.0, 3.0, 3.0]
    r = reasoning.split(prompt, tokens, TAGS, ("<a>", "</a>"), lp, ent, [x - 1 for x in lp])
    assert r.parts == ["reasoning", "reasoning", "marker", "answer", "answer", "answer"]
    assert r.answer_starts_at == 3
    s = r.summary
    assert (s["reasoning"].tokens, s["reasoning"].mean_logprob, s["reasoning"].mean_entropy) == (2, -2.0, 1.5)
    assert (s["answer"].tokens, s["answer"].mean_logprob, s["answer"].mean_raw_logprob) == (3, -4.0, -5.0)
    assert (s["marker"].tokens, s["marker"].mean_logprob) == (1, -0.5)
    assert s["answer"].mean_raw_entropy is None  # not given: no number made up


def test_a_run_that_never_ends_its_thinking_has_no_answer():
    r = reasoning.split([1], [5, 5], TAGS, ("<a>", "</a>"), [-1.0, -1.0])
    assert r.parts == ["reasoning", "reasoning"] and r.answer_starts_at is None
    assert r.summary["answer"].tokens == 0 and r.summary["answer"].mean_logprob is None


@functools.lru_cache(maxsize=1)
def tiny():
    from decodelab.core.engine.models import load_model
    return load_model("tiny", device="cpu")


@pytest.mark.parametrize("budget", [0, 3])
def test_sample_on_tiny_thinks_for_the_budget_then_answers_and_the_split_says_so(budget):
    lm = tiny()
    s = SampleSettings(think_tags="<think>,</think>", thinking_budget=budget, temperature=0.0, max_new_tokens=12,
                       ignore_eos=True)
    prompt = lm.encode("Q: yes or no?<think>")
    sampler = build_sampler(lm, s, prompt)
    steps = list(sampler)
    end = lm.encode("</think>")
    assert sampler.new_ids[budget:budget + len(end)] == end  # forced exactly after the budget
    forced = [st.state["thinking-budget.forced"] for st in steps]
    assert forced == [0.0] * budget + [1.0] * len(end) + [0.0] * (12 - budget - len(end))
    doc = reasoning.for_run(s, lm, prompt, steps)["reasoning"]
    assert doc["parts"] == ["reasoning"] * budget + ["marker"] * len(end) + ["answer"] * (12 - budget - len(end))
    assert doc["answer_starts_at"] == budget + len(end)
    answer = steps[budget + len(end):]
    assert math.isclose(doc["summary"]["answer"]["mean_raw_logprob"],
                        sum(st.raw_logprob for st in answer) / len(answer), rel_tol=1e-12)


def test_score_splits_the_scored_tokens_by_the_same_rule():
    from decodelab.core.methods.score import ScoreSettings, build_scorer
    from decodelab.core.sampling.chain import make_chain

    lm = tiny()
    s = ScoreSettings(think_tags="<think>,</think>")
    q, think, end, ans = (lm.encode(t) for t in ("Q: yes?", "<think>hmm", "</think>", " yes"))
    ids = q + think + end + ans
    scorer = build_scorer(lm, s, ids, make_chain(lm, s))
    for _ in scorer:
        pass
    doc = reasoning.for_score(s, lm, ids, scorer.steps)["reasoning"]
    start = len(lm.encode("<think>"))
    expected = (["outside"] * (len(q) - 1) + ["marker"] * start + ["reasoning"] * (len(think) - start)
                + ["marker"] * len(end) + ["answer"] * len(ans))
    assert doc["parts"] == expected
    answer = scorer.steps[-len(ans):]
    assert doc["summary"]["answer"]["mean_raw_logprob"] == pytest.approx(
        sum(st.raw_logprob for st in answer) / len(answer), rel=1e-12)
    assert doc["summary"]["answer"]["mean_entropy"] is None  # score has no processed entropy: not made up


def test_the_constraint_summary_counts_only_the_steps_after_thinking():
    from decodelab.core.trace.records import constraint_summary

    lm = tiny()
    s = SampleSettings(think_tags="<think>,</think>", thinking_budget=3, regex="( yes| no)!",
                       constraint_after_think=True, temperature=0.0, max_new_tokens=14)
    sampler = build_sampler(lm, s, lm.encode("Q: yes or no?<think>"))
    steps = list(sampler)
    active = [st for st in steps if st.state["constraint.active"] == 1.0]
    assert 0 < len(active) < len(steps)
    summary = constraint_summary(steps)
    assert summary.steps == len(active)
    assert summary.removed_log_mass == pytest.approx(-sum(st.state["constraint.log_mass_kept"] for st in active))
    assert all(st.state["constraint.log_mass_kept"] == 0.0 for st in steps if st not in active)
