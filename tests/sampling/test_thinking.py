"""Thinking markers (core/sampling/thinking.py): the answer's start, the thinking count and each token's part against
token-by-token references (a reader that walks the row as a decoder would, written apart from the occurrence search);
the thinking-budget stage against vLLM's rule read from its ThinkingTokenBudgetLogitsProcessor; the constraint after
thinking against a plain constraint run on the answer alone (the same mask at every position)."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decodelab.core.errors import ConfigError
from decodelab.core.sampling.chain import chain_for
from decodelab.core.sampling.constraint import ConstraintStage, constraint_spec
from decodelab.core.sampling.settings import ChainSettings
from decodelab.core.sampling.thinking import (ThinkTags, ThinkingBudget, answer_start, parse_think_tags, parts,
                                              tags_from_template, thinking_count)
from decodelab.core.sampling.tokens import Tokens, resolve

S, E = 1, 2  # one-token markers
MULTI = ThinkTags((1, 3), (2, 3, 1))  # markers of several tokens that overlap each other
ONE = ThinkTags((S,), (E,))


def ref_answer_start(row, prompt_len, tags):
    """Walk the prompt keeping the last marker seen; then the generated tokens one at a time, stopping at the first
    position where the row so far ends with END."""
    last = None
    for i in range(1, prompt_len + 1):
        for name, marker in (("start", tags.start), ("end", tags.end)):
            if i >= len(marker) and tuple(row[i - len(marker):i]) == marker:
                last = name
    if last == "end":
        return prompt_len
    for i in range(prompt_len + 1, len(row) + 1):
        if i >= len(tags.end) and tuple(row[i - len(tags.end):i]) == tags.end:
            return i
    return None


def ref_thinking_count(row, tags):
    """vLLM's _init_state_entry: last start index > last end index -> in think, count = len - (start + len(START))."""
    def last(marker):
        return max((i for i in range(len(row) - len(marker) + 1) if tuple(row[i:i + len(marker)]) == marker),
                   default=-1)
    s, e = last(tags.start), last(tags.end)
    return len(row) - (s + len(tags.start)) if s > e else None


rows = st.lists(st.integers(0, 4), max_size=24)


@settings(max_examples=400, deadline=None)
@given(row=rows, cut=st.integers(0, 24), multi=st.booleans())
def test_answer_start_and_thinking_count_equal_the_token_by_token_readers(row, cut, multi):
    tags = MULTI if multi else ONE
    p = min(cut, len(row))
    assert answer_start(row, p, tags) == ref_answer_start(row, p, tags)
    assert thinking_count(row, tags) == ref_thinking_count(row, tags)


def test_parts_by_hand():
    #            prompt: x S x | generated: x x E y y S y
    row = [0, S, 0, 0, 0, E, 4, 4, S, 4]
    assert parts(row, 3, ONE) == ["reasoning", "reasoning", "marker", "answer", "answer", "answer", "answer"]
    assert parts(row, 3, MULTI) == ["outside"] * 7  # no marker of MULTI in the row: a model that did not think
    assert parts([S, 0, E, 4, 4], 3, ONE) == ["answer", "answer"]  # the prompt closed the block (<think></think>)
    assert parts([0, S, 0, S, 0, E], 0, ONE) == ["outside", "marker", "reasoning", "marker", "reasoning", "marker"]
    row = [9, 1, 3, 7, 2, 3, 1, 5]  # MULTI: START = 1 3, END = 2 3 1
    assert parts(row, 1, MULTI) == ["marker", "marker", "reasoning", "marker", "marker", "marker", "answer"]


@settings(max_examples=300, deadline=None)
@given(row=rows, cut=st.integers(0, 24))
def test_parts_agree_with_answer_start_and_count_every_token(row, cut):
    p = min(cut, len(row))
    labels = parts(row, p, ONE)
    assert len(labels) == len(row) - p
    a = answer_start(row, p, ONE)
    if a is not None:
        assert all(lab == "answer" for lab in labels[a - p:])
    for j, lab in enumerate(labels):  # a reasoning token sits inside an open block
        if lab == "reasoning":
            assert thinking_count(row[:p + j], ONE) is not None


def vllm_budget_run(prompt, budget, tags, proposals):
    """vLLM's processor as its source reads (state initialised from the prompt, then per new token): the tokens
    forced when the model would write ``proposals`` (one per step, taken unless a token is forced)."""
    row = list(prompt)
    forced = []
    for proposal in proposals:
        count = ref_thinking_count(row, tags)
        f = None
        if count is not None and count >= budget and count - budget < len(tags.end):
            f = tags.end[count - budget]
        row.append(proposal if f is None else f)
        forced.append(f is not None)
    return row[len(prompt):], forced


@pytest.mark.parametrize("budget", [0, 1, 3])
@pytest.mark.parametrize("tags", [ONE, MULTI])
def test_budget_stage_forces_end_after_n_thinking_tokens(budget, tags):
    prompt = [0, *tags.start]  # the template opened the block
    stage = ThinkingBudget(budget, tags)
    row = list(prompt)
    proposals = [4] * 12
    for proposal in proposals:
        logits = torch.zeros(1, 8)
        logits[0, proposal] = 5.0
        out = stage(torch.tensor([row]), logits)
        row.append(int(out.argmax()))
    generated = row[len(prompt):]
    assert generated[:budget] == [4] * budget
    assert tuple(generated[budget:budget + len(tags.end)]) == tags.end  # exactly after N thinking tokens
    assert generated[budget + len(tags.end):] == [4] * (12 - budget - len(tags.end))  # and never again
    assert generated == vllm_budget_run(prompt, budget, tags, proposals)[0]


def test_budget_counts_prompt_thinking_tokens_as_vllm_does_and_acts_on_each_beam_row():
    stage = ThinkingBudget(3, ONE)
    ids = torch.tensor([[S, 0, 0, 0], [0, 0, 0, 0], [S, 0, E, 0]])  # 3 thinking tokens / no block / closed
    out = stage(ids, torch.zeros(3, 5))
    assert out[0].tolist() == [float("-inf")] * 2 + [0.0] + [float("-inf")] * 2
    assert out[1].tolist() == [0.0] * 5 and out[2].tolist() == [0.0] * 5
    assert stage.state()["forced"].tolist() == [1.0, 0.0, 0.0]


def test_think_tags_parsing_and_the_chat_template_default():
    assert parse_think_tags("<think>,</think>") == ("<think>", "</think>")
    for bad in ("<think>", "<think>,", ",</think>", "a,a", "a,b,c"):
        with pytest.raises(ConfigError, match="--think-tags"):
            parse_think_tags(bad)
    assert tags_from_template("{{ '<think>' }}...{{ '</think>' }}") == ("<think>", "</think>")
    assert tags_from_template("{{ messages }}") is None and tags_from_template(None) is None


@functools.lru_cache(maxsize=1)
def tiny():
    from decodelab.core.engine.models import load_model
    return load_model("tiny", device="cpu")


def test_options_that_need_markers_or_a_constraint_say_so():
    lm = tiny()
    tokens = Tokens.of(lm)
    with pytest.raises(ConfigError, match="--thinking-budget 3: needs thinking markers"):
        resolve(ChainSettings(thinking_budget=3), tokens)
    with pytest.raises(ConfigError, match="--constraint-after-think: give a constraint"):
        resolve(ChainSettings(constraint_after_think=True, think_tags="<think>,</think>"), tokens)
    with pytest.raises(ConfigError, match="--constraint-after-think: needs thinking markers"):
        resolve(ChainSettings(constraint_after_think=True, regex="a+"), tokens)


def test_constraint_after_think_is_the_plain_constraint_on_the_answer_alone():
    """At every position of rows that think, end thinking and answer: inactive (nothing removed) before the answer's
    start a, and from a on exactly the mask of a plain constraint whose prompt ends at a."""
    lm = tiny()
    tokens = Tokens.of(lm)
    s = ChainSettings(regex="(yes|no)!", constraint_after_think=True, think_tags="<think>,</think>")
    chain = chain_for(s, tokens, eos_ids=lm.eos_ids)[1]
    stage = chain.processors[0]
    tags = resolve(s, tokens)["think-tags"]
    plain = ConstraintStage(constraint_spec(regex="(yes|no)!"), lm.tokenizer, lm.eos_ids, lm.vocab_size)
    prompt = lm.encode("Q?<think>")
    answer = lm.encode("yes")
    row = prompt + lm.encode("hmm") + list(tags.end) + answer
    stage.reset(len(prompt))
    a = len(row) - len(answer)
    logits = torch.randn(1, lm.vocab_size, generator=torch.Generator().manual_seed(0))
    for n in range(len(prompt), len(row) + 1):
        out = stage(torch.tensor([row[:n]]), logits)
        active = stage.state()["active"].item()
        if n < a:
            assert torch.equal(out, logits) and active == 0.0
        else:
            plain.reset(a)
            assert torch.equal(out, plain(torch.tensor([row[:n]]), logits)) and active == 1.0


def test_export_writes_vllms_fields_and_says_what_the_server_must_provide():
    from decodelab.core.methods.sample import SampleSettings
    from decodelab.core.sampling.export import export

    s = SampleSettings(thinking_budget=7, think_tags="1,2", regex="a+", constraint_after_think=True,
                       repetition_stop="max_pattern_size=5,min_count=3")
    out = export(s, "vllm", vocab=16)
    assert out.arguments["thinking_token_budget"] == 7
    assert out.arguments["repetition_detection"] == {"max_pattern_size": 5, "min_count": 3, "min_pattern_size": 0}
    assert any("reasoning config" in n for n in out.notes) and any("--reasoning-parser" in n for n in out.notes)
    hf = export(s, "hf", vocab=16)
    assert {u.split(":")[0] for u in hf.unsupported} >= {"thinking-budget", "constraint-after-think",
                                                          "repetition-stop"}


def test_markers_default_to_the_chat_templates_and_the_option_wins():
    from decodelab.core.sampling.tokens import think_tags

    class Template:
        chat_template = "{% if thinking %}<think>\n{% endif %}...</think>"

    def encode(text):
        return [ord(c) % 97 for c in text]

    tokens = Tokens(vocab=97, encode=encode, tokenizer=Template())
    assert think_tags(ChainSettings(), tokens) == ThinkTags(tuple(encode("<think>")), tuple(encode("</think>")))
    assert think_tags(ChainSettings(think_tags="<a>,</a>"), tokens) == ThinkTags(tuple(encode("<a>")),
                                                                              tuple(encode("</a>")))
    Template.chat_template = "{{ messages }}"
    assert think_tags(ChainSettings(), tokens) is None
