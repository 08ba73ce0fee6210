"""`score --choice` around the constraint's arithmetic (core/methods/choice.py): the settings it refuses word for
word, the prefix scorer against plain forwards, the report's summary and rows by hand, and score_choices' own
checks and what it passes on. The labels' numbers against transformers are in test_constrained.py.

Written for the mutation run of core/methods/choice.py (2026-12-02, helper mbeam)."""

from __future__ import annotations

import math
import time

import pytest
import torch
from conftest import ROOT, random_model

from decodelab.core.errors import ConfigError
from decodelab.core.kv import parse_cache_spec
from decodelab.core.methods.choice import ChoiceReport, PrefixScorer, check_choice_settings, score_choices
from decodelab.core.methods.score import ScoreSettings
from decodelab.core.sampling.chain import make_chain
from decodelab.core.sampling.constraint import ChoiceScores, LabelScore

TINY = ROOT / "presets" / "models" / "tiny"
PROMPT = [5, 9, 17, 2, 33]


@pytest.fixture(scope="module")
def lm():
    if not (TINY / "model.safetensors").is_file():
        pytest.skip("the bundled tiny model's weights are not installed")
    from decodelab.core.engine.models import load_model

    return load_model("tiny", device="cpu")


def plain(model, prompt, tokens) -> float:
    """log P(tokens | prompt) from one forward over prompt + tokens, no cache, float64 log-softmax."""
    with torch.inference_mode():
        logits = model(torch.tensor([list(prompt) + list(tokens)])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    return math.fsum(float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens))


def test_choice_settings_refused_word_for_word():
    """Another stage (the first named), each option of teacher-forced scoring, and --min-mass outside [0, 1)."""
    with pytest.raises(ConfigError) as err:
        check_choice_settings(ScoreSettings(choice="a,b", temperature=0.5, top_k=3))
    assert str(err.value) == ("--choice 'a,b': score gives the labels' probabilities under the model alone "
                              "(temperature 1); drop the temperature stage")
    tail = "applies to teacher-forced scoring of TEXT, not to --choice (which scores the labels after TEXT)"
    for key, value in (("limit", 3), ("chunk", 4), ("feed", 2), ("against", "tiny"), ("against_cache", "full")):
        with pytest.raises(ConfigError) as err:
            check_choice_settings(ScoreSettings(choice="a,b", **{key: value}))
        assert str(err.value) == f"--{key.replace('_', '-')}: {tail}"
    for ok in (0, 0.0, 0.5, 0.999):
        check_choice_settings(ScoreSettings(choice="a,b", min_mass=ok))
    for bad in (1.0, -0.1, 1, "0.5", None):
        with pytest.raises(ConfigError) as err:
            check_choice_settings(ScoreSettings(choice="a,b", min_mass=bad))
        assert str(err.value) == f"--min-mass {bad}: must be a number in [0, 1) (0 walks every token path)"
    check_choice_settings(ScoreSettings(choice="a,b"))


def test_prefix_scorer_equals_plain_forwards_and_feeds_each_prefix_once():
    """log P of one- and two-token continuations against a forward over prompt + tokens; (5,), (5, 6), (5, 7), (8,)
    and again (5, 6) need the prompt's row and one forward, of the prefix (5,); the cache is rolled back to the
    prompt after it; a static cache is sized as asked and the policy told the run truncates."""
    model = random_model("llama", seed=3, scale=4.0)
    scorer = PrefixScorer(model, PROMPT, len(PROMPT) + 3)
    assert scorer.forwards == 0 and scorer.prompt_len == len(PROMPT) and scorer(()) == 0.0
    for tokens in [(5,), (5, 6), (5, 7), (8,), (5, 6)]:
        assert scorer(tokens) == pytest.approx(plain(model, PROMPT, tokens), abs=1e-5)
    assert scorer.forwards == 1 and scorer.runtime.seen == len(PROMPT)
    assert scorer.runtime.policy.needs == frozenset({"truncate"})
    three = scorer((5, 6, 9))  # a second forward, of (5, 6)
    assert three == pytest.approx(plain(model, PROMPT, (5, 6, 9)), abs=1e-5) and scorer.forwards == 2
    row = scorer.conditionals((5,))
    assert row.dtype == torch.float32 and row.shape == (256,)
    assert float(torch.logsumexp(row, dim=-1)) == pytest.approx(0.0, abs=1e-5)
    static = PrefixScorer(model, PROMPT, len(PROMPT) + 2, parse_cache_spec("static"))
    assert static.runtime.policy.capacity == len(PROMPT) + 2
    assert static((5, 6)) == pytest.approx(plain(model, PROMPT, (5, 6)), abs=1e-5)
    with pytest.raises(ConfigError, match="exceed the preallocated"):
        static((5, 6, 7, 8))  # feeds the prefix (5, 6, 7): one position past the capacity


def label(name, tokenizations, exact, share, first, sampler, paths):
    return LabelScore(name, tokenizations, exact, share, first, sampler, paths)


def test_choice_report_summary_and_rows_by_hand():
    yes = label(" yes", (((10,), 0.25), ((11, 12), 0.05)), 0.3, 0.75, 0.8, 0.7, 0.31)
    no = label(" no", (((13,), 0.1),), 0.1, 0.25, 0.2, 0.2, 0.1)
    scores = ChoiceScores((yes, no), 0.06, 0.04)
    texts = {10: " yes", 11: " y", 12: "es", 13: " no"}
    report = ChoiceReport(scores, texts, 1e-3, 4, 0.5)
    assert report.summary() == {"labels": 2, "exact_total": pytest.approx(0.4), "all_paths_total": pytest.approx(0.41),
                                "sampler_lost": 0.06, "sampler_unexplored": 0.04, "min_mass": 1e-3, "forwards": 4,
                                "seconds": 0.5}
    rows = report.rows()
    assert rows[0] == {"label": " yes", "exact": 0.3, "share": 0.75, "first_token": 0.8,
                       "first_token_error": pytest.approx(0.05), "sampler": 0.7,
                       "sampler_error": pytest.approx(-0.05), "all_paths": 0.31,
                       "tokenizations": [{"token_ids": [10], "tokens": [" yes"], "probability": 0.25},
                                         {"token_ids": [11, 12], "tokens": [" y", "es"], "probability": 0.05}]}
    assert rows[1]["label"] == " no" and rows[1]["tokenizations"] == [{"token_ids": [13], "tokens": [" no"],
                                                                       "probability": 0.1}]
    assert (rows[1]["first_token_error"], rows[1]["sampler_error"]) == (pytest.approx(-0.05), pytest.approx(-0.05))


def test_score_choices_checks_its_chain_and_prompt_and_reports_what_it_walked(lm):
    """A chain whose stage is not the --choice constraint is refused, and so is a prompt filling the context; the
    report carries every listed token's text, the min-mass given, the scorer's forwards and a time."""
    prompt = "Q: Is the sky blue? A:"
    ids = lm.encode(prompt)
    s = ScoreSettings(choice=" yes, no", min_mass=0.0)
    report = score_choices(lm, s, prompt, ids, make_chain(lm, s))
    listed = {t for lab in report.scores.labels for toks, _ in lab.tokenizations for t in toks}
    assert report.token_texts == {t: lm.token_text(t) for t in listed} and listed
    assert report.min_mass == 0.0 and report.forwards >= 1 and report.seconds > 0
    for lab in report.scores.labels:
        for toks, p in lab.tokenizations:
            assert p == pytest.approx(math.exp(plain(lm.model, ids, toks)), rel=1e-4)
    pruned = score_choices(lm, ScoreSettings(choice=" yes, no", min_mass=0.5), prompt, ids,
                           make_chain(lm, ScoreSettings(choice=" yes, no", min_mass=0.5)))
    assert pruned.min_mass == 0.5 and pruned.scores.sampler_unexplored > 0 == report.scores.sampler_unexplored
    regex = ScoreSettings(regex="[0-9]+")
    with pytest.raises(ConfigError) as err:
        score_choices(lm, s, prompt, ids, make_chain(lm, regex))
    assert str(err.value) == "--choice: score --choice needs the --choice constraint as its only stage"
    with pytest.raises(ConfigError) as err:
        score_choices(lm, s, prompt, list(range(1, lm.context_length + 1)), make_chain(lm, s))
    assert str(err.value) == f"PROMPT: the prompt is {lm.context_length} tokens but the model's context is " \
                             f"{lm.context_length}; shorten it"


def test_score_choices_scores_under_the_cache_policy_given(lm):
    """A 2-bit quantized cache changes the conditionals after the prompt: the labels' probabilities are those of a
    prefix scorer under that policy, not the full cache's; a static cache is sized for the longest label (each token
    spells at least a byte) and one more position."""
    prompt = "The colour of the sea is"
    ids = lm.encode(prompt)
    s = ScoreSettings(choice=" blue, green")
    spec = parse_cache_spec("quant:bits=2,residual=0")
    quant = score_choices(lm, s, prompt, ids, make_chain(lm, s), cache=spec)
    full = score_choices(lm, s, prompt, ids, make_chain(lm, s))
    by_hand = PrefixScorer(lm.model, ids, len(ids) + 7, spec)
    for q, f in zip(quant.scores.labels, full.scores.labels):
        assert q.exact != pytest.approx(f.exact, rel=1e-3)
        assert q.exact == pytest.approx(sum(math.exp(by_hand(t)) for t, _ in q.tokenizations), rel=1e-5)
    static = score_choices(lm, s, prompt, ids, make_chain(lm, s), cache=parse_cache_spec("static"))
    assert [lab.exact for lab in static.scores.labels] == pytest.approx([lab.exact for lab in full.scores.labels],
                                                                        rel=1e-4)


def test_score_choices_lists_the_labels_tokenization_after_the_prompt_too(lm):
    """After "Answer:" the tokenizer splits the label "'s" as ' + s, on its own as the one token 's: both listed (the
    tokenizer's own first), and the label's probability is their sum, each against a plain forward."""
    prompt = "Answer:"
    ids = lm.encode(prompt)
    s = ScoreSettings(choice="'s,no")
    report = score_choices(lm, s, prompt, ids, make_chain(lm, s))
    quote_s = report.scores.labels[0]
    alone = tuple(lm.tokenizer.encode("'s", add_special_tokens=False))
    joint = lm.tokenizer.encode(prompt + "'s", add_special_tokens=False)
    base = lm.tokenizer.encode(prompt, add_special_tokens=False)
    assert joint[: len(base)] == base
    after = tuple(joint[len(base):])
    assert len(alone) == 1 and len(after) == 2
    assert quote_s.label == "'s" and [t for t, _ in quote_s.tokenizations] == [alone, after]
    assert quote_s.exact == pytest.approx(sum(math.exp(plain(lm.model, ids, t)) for t in (alone, after)), rel=1e-4)


def test_score_choices_walks_every_path_the_constraint_allows_and_ends_a_label_on_eos(lm):
    """min-mass 0: the sampler walks every token path the --choice constraint allows (" b" + "lue" as well as " blue"),
    so it scores more prefixes than the listed tokenizations have (what a walk of those alone would score). "no" is
    a prefix of "no way": after it the sampler draws EOS (the label "no") or goes on, so "no" gets sampler mass; the
    sampler's mass is all accounted for. The time is the call's own."""
    prompt = "The colour of the sea is"
    ids = lm.encode(prompt)
    s = ScoreSettings(choice=" blue, green", min_mass=0.0)
    before = time.perf_counter()
    report = score_choices(lm, s, prompt, ids, make_chain(lm, s))
    took = time.perf_counter() - before
    assert 0 < report.seconds <= took
    listed = {t[:i] for lab in report.scores.labels for t, _ in lab.tokenizations for i in range(1, len(t) + 1)}
    assert report.forwards > len(listed)
    s = ScoreSettings(choice="no,no way", min_mass=0.0)
    ids = lm.encode("Q: Is the sea green? A:")
    nested = score_choices(lm, s, "Q: Is the sea green? A:", ids, make_chain(lm, s))
    no, no_way = nested.scores.labels
    assert no.label == "no" and no.sampler > 0 and no_way.sampler > 0
    total = no.sampler + no_way.sampler + nested.scores.sampler_lost + nested.scores.sampler_unexplored
    assert total == pytest.approx(1.0, abs=1e-6)


def test_score_choices_sizes_a_static_cache_for_every_byte_of_the_longest_label(lm):
    """Every path walked (min-mass 0), a label spelled one byte a token included: a static cache sized from the
    longest label's bytes holds every prefix scored, and the numbers are the full cache's."""
    prompt = "Once upon a"
    ids = lm.encode(prompt)
    s = ScoreSettings(choice=" time, day", min_mass=0.0)
    static = score_choices(lm, s, prompt, ids, make_chain(lm, s), cache=parse_cache_spec("static"))
    full = score_choices(lm, s, prompt, ids, make_chain(lm, s))
    assert [lab.sampler for lab in static.scores.labels] == pytest.approx([lab.sampler for lab in full.scores.labels],
                                                                          rel=1e-4)
    assert static.forwards == full.forwards > 5
