"""What a served engine is asked: the settings read as vLLM reads them, every sampling field written, and a stage
vLLM lacks refused (one line naming the option)."""

from __future__ import annotations

import math

import pytest

from decodelab.core.engine.http.wire import SamplingSettings
from decodelab.core.errors import ConfigError
from decodelab.core.methods.sample import SampleSettings
from decodelab.core.sampling.export import llamacpp_server_neutral, served_settings


def request(**kw) -> tuple[SamplingSettings, list[str]]:
    return served_settings(SampleSettings(**{"max_new_tokens": 8, **kw}), 5, 4096)


def test_every_field_is_neutral_unless_set():
    s, notes = request(temperature=0.7, top_p=0.9, presence_penalty=0.5)
    assert (s.temperature, s.top_p, s.presence_penalty) == (0.7, 0.9, 0.5)
    assert (s.top_k, s.min_p, s.repetition_penalty, s.frequency_penalty, s.min_tokens) == (0, 0.0, 1.0, 0.0, 0)
    assert s.max_tokens == 8 and s.seed == 0 and s.logprobs == 5 and not notes


def test_vllms_reading_applies():
    s, notes = request(temperature=0, top_p=0.5, top_k=3)  # vLLM's greedy takes the argmax before the filters
    assert (s.temperature, s.top_p, s.top_k) == (0.0, 1.0, 0)
    s, _ = request(temperature=0.8, top_k=0)  # 0: all tokens
    assert s.top_k == 0


def test_biases_stops_and_masks():
    s, notes = request(temperature=1.0, logit_bias=(("5", -math.inf), ("7", 2.0)), stop=("\n",), stop_id=(9,),
                       ignore_eos=True, min_new_tokens=3, ban=("3 4",), allow=("5", "7", "9"))
    assert s.logit_bias == {5: -100.0, 7: 2.0} and any("-100" in n for n in notes)
    assert s.stop == ("\n",) and s.stop_token_ids == (9,) and s.ignore_eos and s.min_tokens == 3
    assert s.bad_words == ("3 4",) and s.allowed_token_ids == (5, 7, 9)  # (no tokenizer here: ids name tokens)
    assert s.include_stop_str_in_output is False  # vLLM leaves the stop string out


@pytest.mark.parametrize("kw, message", [
    (dict(temperature=0.7, typical_p=0.5), "--typical-p: vLLM has no such stage"),
    (dict(temperature=0.7, xtc_probability=0.5), "--xtc-probability: vLLM has no such stage"),
    (dict(temperature=0.7, no_repeat_ngram=3), "--no-repeat-ngram: vLLM has no such stage"),
    (dict(temperature=0.7, repetition_penalty=1.1, penalty_last_n=16), "--penalty-last-n: vLLM's penalties"),
    (dict(temperature=0.7, semantics="hf"), "--semantics hf: a served engine reads the settings as vLLM does"),
])
def test_what_vllm_lacks_is_refused(kw, message):
    with pytest.raises(ConfigError, match=message) as err:
        request(**kw)
    assert "\n" not in str(err.value)


def test_a_constraint_is_refused_not_dropped():
    """vLLM's export writes structured_outputs, which the served client does not send: refused in one line."""
    with pytest.raises(ConfigError, match="not sent to a served engine") as err:
        request(temperature=0.7, regex="[a-z]+")
    assert "\n" not in str(err.value)


# --- exact messages the mutation run (tests/mutation/run.sh, core/sampling/export.py) showed no test pinned ---------


@pytest.mark.parametrize("kw, message", [
    (dict(temperature=0.7, semantics="llamacpp"), "--semantics llamacpp: a served engine reads the settings as vLLM "
                                                  "does; drop --semantics or give vllm"),
    (dict(temperature=0.7, repetition_penalty=1.1, penalty_last_n=16),
     "--penalty-last-n: vLLM's penalties count the whole sequence (a served engine has no window); drop it or run "
     "without --engine"),
])
def test_refusals_word_for_word(kw, message):
    with pytest.raises(ConfigError) as err:
        request(**kw)
    assert str(err.value) == message


def test_the_whole_request():
    """Every field of the request, from settings that touch each: tuples where the client sends lists, integer
    token ids as logit_bias keys, the stop string left out (vLLM's reading)."""
    s, notes = request(temperature=0.5, top_k=4, min_p=0.1, repetition_penalty=1.2, frequency_penalty=0.3,
                       logit_bias=(("2", 1.5),), stop=("END",), stop_id=(7, 8), allow=("2", "3"), ban=("4",),
                       seed=11, min_new_tokens=2)
    assert s == SamplingSettings(max_tokens=8, temperature=0.5, top_p=1.0, top_k=4, min_p=0.1,
                                 repetition_penalty=1.2, presence_penalty=0.0, frequency_penalty=0.3, seed=11,
                                 min_tokens=2, ignore_eos=False, logprobs=5, logit_bias={2: 1.5},
                                 stop_token_ids=(7, 8), stop=("END",), include_stop_str_in_output=False,
                                 allowed_token_ids=(2, 3), bad_words=("4",),
                                 neutral={"llamacpp": llamacpp_server_neutral()})
    assert notes == []


def test_a_stage_vllm_lacks_is_refused_by_its_option():
    with pytest.raises(ConfigError) as err:
        request(temperature=0.7, dry_multiplier=0.5)
    assert str(err.value) == ("--dry-multiplier: vLLM has no such stage (a served engine has no equivalent); drop it "
                              "or run without --engine")
    with pytest.raises(ConfigError) as err:
        request(temperature=0.7, regex="[a-z]+")
    assert str(err.value) == ("--engine: structured_outputs (a constraint stage) is not sent to a served engine; drop "
                              "--regex/--json-schema/--grammar/--choice or run without --engine")


def test_token_texts_are_resolved_with_the_tokenizer_given():
    """A logit bias names one token (token_id), an allow-list text its encoding (encode): ids in the request."""
    ids = {"a": 7, "b": 8}
    s, _ = served_settings(SampleSettings(max_new_tokens=8, temperature=0.7, logit_bias=(("a", 1.0),),
                                          allow=("ab",)), 5, 100, encode=lambda text: [ids[c] for c in text],
                           token_id=lambda text: ids[text])
    assert s.logit_bias == {7: 1.0} and s.allowed_token_ids == (7, 8)
