"""Thinking in the methods that query many positions at once, on the bundled tiny model (the prompt opens the thinking
block, the budget closes it; docs/reasoning.md): speculative decoding and beam search give a constrained answer
after free thinking, exactly as plain decoding does, when the end of thinking falls inside a speculative round (the
case vLLM's grammar missed, vllm-project/vllm PR #36138) and inside a beam's rows."""

from __future__ import annotations

import functools
import math

import pytest

from decodelab.core.engine.models import load_model
from decodelab.core.errors import ConfigError
from decodelab.core.methods.beam import BeamSettings, build_beam
from decodelab.core.methods.sample import SampleSettings, build_sampler
from decodelab.core.methods.speculative.run import SpeculateSettings, build_speculator
from decodelab.core.sampling.chain import make_chain
from decodelab.core.sampling.thinking import answer_start

from test_constraint import RegexReference, token_bytes

PROMPT = "Q: yes or no?<think>"
REGEX = "( yes| no)!"
THINK = dict(think_tags="<think>,</think>", constraint_after_think=True, regex=REGEX)


@functools.lru_cache(maxsize=None)
def model(name: str):
    return load_model(name, device="cpu")


def answer_bytes(lm, row, prompt_len):
    tags_end = lm.encode("</think>")
    from decodelab.core.sampling.thinking import ThinkTags
    a = answer_start(row, prompt_len, ThinkTags(tuple(lm.encode("<think>")), tuple(tags_end)))
    assert a is not None, "the thinking never ended"
    out = []
    for t in row[a:]:
        if t in lm.eos_ids:
            break
        out.append(token_bytes()[t])
    return b"".join(out)


@pytest.mark.parametrize("budget", [2, 5])
def test_speculate_equals_plain_decoding_with_the_end_of_thinking_inside_a_round(budget):
    lm, draft = model("tiny"), model("tiny-draft")
    prompt = lm.encode(PROMPT)
    plain = build_sampler(lm, SampleSettings(**THINK, thinking_budget=budget, temperature=0.0, max_new_tokens=16),
                          prompt, record=False)
    for _ in plain:
        pass
    s = SpeculateSettings(**THINK, thinking_budget=budget, temperature=0.0, max_new_tokens=16, gamma=6)
    spec = build_speculator(lm, draft, s, prompt, s.gamma, make_chain(lm, s), record=True)
    rounds = list(spec)
    assert spec.new_ids == plain.new_ids
    assert RegexReference(REGEX).viable(answer_bytes(lm, prompt + spec.new_ids, len(prompt)))
    a = answer_start(prompt + spec.new_ids, len(prompt), make_chain(lm, s).processors[0].spec.after) - len(prompt)
    crossing = [r for r in rounds if r.position - len(prompt) < a < r.position - len(prompt) + len(r.emitted_ids)]
    assert crossing, "no round emitted tokens on both sides of the end of thinking"


@pytest.mark.parametrize("beams", [2, 3])
def test_every_beam_answers_within_the_constraint_after_thinking(beams):
    lm = model("tiny")
    prompt = lm.encode(PROMPT)
    s = BeamSettings(**THINK, thinking_budget=3, beams=beams, max_new_tokens=14)
    hyps = build_beam(lm, s, prompt, record=True).run()
    assert hyps
    for h in hyps:
        assert h.sum_logprob > float("-inf")
        assert RegexReference(REGEX).viable(answer_bytes(lm, prompt + h.token_ids, len(prompt)))


# --- score --choice --empty-think -----------------------------------------------------------------------------------

from decodelab.core.methods.choice import score_choices  # noqa: E402
from decodelab.core.methods.choice_thinking import empty_block  # noqa: E402
from decodelab.core.methods.score import ScoreSettings  # noqa: E402

from test_constrained import plain_logprob  # noqa: E402


@pytest.mark.parametrize("prompt,appended", [("Answer yes or no:", "<think></think>"),  # no block: START + END
                                             ("Answer yes or no:<think>", "</think>"),  # the template opened it
                                             ("Answer yes or no:<think>x</think>", "")])  # already closed
def test_empty_think_scores_the_labels_after_the_closed_block_by_a_plain_forward(prompt, appended):
    lm = model("tiny")
    s = ScoreSettings(choice=" yes, no", think_tags="<think>,</think>")
    ids = lm.encode(prompt)
    text, full, info = empty_block(lm, s, prompt, ids)
    assert info["appended"] == appended and text == prompt + appended
    assert full == ids + lm.encode(appended)  # ids appended, the prompt's own ids untouched
    report = score_choices(lm, s, text, full, make_chain(lm, s))
    for lab in report.scores.labels:
        by_hand = sum(math.exp(plain_logprob(lm.model, full, t)) for t, _ in lab.tokenizations)
        assert lab.exact == pytest.approx(by_hand, rel=1e-4)
    if appended == "<think></think>":  # P(START | prompt) by a plain forward
        start = lm.encode("<think>")
        assert info["p_start"] == pytest.approx(math.exp(plain_logprob(lm.model, ids, tuple(start))), rel=1e-6)
    else:
        assert info["p_start"] is None


def test_empty_think_without_markers_says_what_is_missing():
    lm = model("tiny")
    with pytest.raises(ConfigError, match="--empty-think: needs thinking markers"):
        empty_block(lm, ScoreSettings(choice=" yes, no"), "Q:", lm.encode("Q:"))
