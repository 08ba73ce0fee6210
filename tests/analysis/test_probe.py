"""The retrieval probe (core/analysis/probe.py).

Oracles: a Llama wired by hand to retrieve the digit in its context (retrieval_model.py), so the right answer under
the full cache is known, and so is what each policy must do to it (evict every digit and the answer is a uniform
guess); the answer's probability against a plain transformers forward over the whole sequence, no cache; the
bundled `tiny`, which copies nothing from its context, must be reported as unable to judge (not as a policy that
lost the key).
"""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch
from conftest import BUNDLED_TOKENIZER, ROOT
from retrieval_model import retrieval_model
from transformers import AutoTokenizer

from decodelab.core.analysis.probe import (MARGIN, NEEDLE, QUESTION, Prober, ProbeReport, ProbeSettings, Trial,
                                          TrialResult, answer_logprobs, build_trials, check_probe, filler_count,
                                          needle_share, probe_keys, run_trial, summarize)
from decodelab.core.engine.runtime import Runtime
from decodelab.core.errors import ConfigError
from decodelab.core.kv import parse_cache_spec
from decodelab.core.kv.kept import kept_map

KEYS = ("7 7 7 7", "3 3 3 3")
TEXT = ROOT / "presets" / "models" / "validation.txt"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(BUNDLED_TOKENIZER)


@pytest.fixture(scope="module")
def model(tokenizer):
    return retrieval_model(tokenizer, len(tokenizer))


@pytest.fixture(scope="module")
def filler(tokenizer) -> list[int]:
    """Held-out text without a digit (the hand-wired head attends to every digit in context)."""
    return tokenizer.encode(re.sub(r"[0-9]", "", TEXT.read_text(encoding="utf-8")[:4000]))[:160]


def by_hand(model, trial) -> float:
    """log P(answer) from one forward over context + question + answer with no cache: the logits at the position
    before each answer token."""
    ids = trial.context_ids + trial.question_ids + trial.answer_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    start = len(ids) - len(trial.answer_ids)
    return sum(lp[start - 1 + i, t].item() for i, t in enumerate(trial.answer_ids))


def test_the_full_cache_gets_every_key_right_and_its_probability_is_a_plain_forward(model, tokenizer, filler):
    prober = Prober(model, tokenizer, filler, ProbeSettings(keys=KEYS, depths=(0.1, 0.5, 0.9)))
    full = prober.full()
    assert len(full) == 6 and all(r.right for r in full)
    for trial, result in zip(prober.trials, full):
        assert result.logprob == pytest.approx(by_hand(model, trial), abs=1e-5)
        assert result.logprob == pytest.approx(sum(result.token_logprobs))
        assert tokenizer.decode(trial.answer_ids) == " " + trial.key


def test_the_needle_sits_where_the_depth_puts_it_and_the_baseline_has_no_fact(model, tokenizer, filler):
    trials = build_trials(tokenizer, filler, ProbeSettings(keys=("7 7 7 7",), depths=(0.0, 0.5, 1.0)))
    for trial in trials:
        needle = tokenizer.decode(trial.context_ids[trial.needle_start : trial.needle_end])
        assert needle == " The pass key is 7 7 7 7. Remember it. 7 7 7 7 is the pass key."
        assert not any(str(d) in tokenizer.decode(trial.baseline_ids) for d in range(10))
    assert trials[0].needle_start == 0 and trials[-1].needle_end == len(trials[-1].context_ids)
    # without the needle no digit is in context: the first answer token is a uniform guess, the later ones copy
    # the answer's own digits
    report = Prober(model, tokenizer, filler, ProbeSettings(keys=("7 7 7 7",), depths=(0.5,))).report([])
    assert report.baseline_logprobs[0] == pytest.approx(-math.log(len(tokenizer)), abs=1e-3)


def needle_share_by_hand(spec: str, model, trial) -> float:
    runtime = Runtime.create(model, parse_cache_spec(spec))
    runtime.feed(torch.tensor([trial.context_ids]))
    kept = runtime.policy.kept_positions(0)
    held = sum(trial.needle_start <= p < trial.needle_end for layer in kept for head in layer for p in head)
    return held / (sum(len(layer) for layer in kept) * (trial.needle_end - trial.needle_start))


def test_each_policy_is_judged_by_what_it_kept(model, tokenizer, filler):
    """window:size=32 holds the needle only when it is the last thing before the question; knorm keeps the lowest key
    norms, and only digits have a key here, so it evicts them all; h2o and snapkv keep the tokens attended to: the
    digits. ratio=1 keeps everything: the full cache exactly."""
    prober = Prober(model, tokenizer, filler, ProbeSettings(keys=KEYS, depths=(0.1, 1.0)))
    report = prober.report([parse_cache_spec(s) for s in ("window:size=32", "knorm:ratio=0.5", "h2o:size=32",
                                                           "snapkv:ratio=0.25,window=8", "snapkv:ratio=1,window=8")])
    window, knorm, h2o, snapkv, everything = report.policies
    assert [r.right for r in window.results] == [False, True, False, True]  # depths 0.1, 1.0 for each key
    assert window.accuracy == 0.5 and window.judged == 4 and window.needle_kept is None
    assert knorm.accuracy == 0.0 and h2o.accuracy == 1.0 and snapkv.accuracy == 1.0
    for r, f in zip(everything.results, report.full.results):
        assert r.right and r.token_logprobs == f.token_logprobs
    assert everything.needle_kept == 1.0
    for policy, spec in ((knorm, "knorm:ratio=0.5"), (h2o, "h2o:size=32"), (snapkv, "snapkv:ratio=0.25,window=8")):
        for r, trial in zip(policy.results, prober.trials):
            assert r.needle_kept == pytest.approx(needle_share_by_hand(spec, model, trial))
    # a missed key is a uniform guess of its first token
    missed = knorm.results[0]
    assert missed.token_logprobs[0] == pytest.approx(-math.log(len(tokenizer)), abs=1e-3)


def test_a_policys_answer_probability_is_what_its_own_runtime_gives(model, tokenizer, filler):
    """The probe's numbers under a press are the runtime's: prefill the context, then the question in one forward,
    then the answer one token a forward (checked against the same steps taken by hand)."""
    trial = build_trials(tokenizer, filler, ProbeSettings(keys=("3 3 3 3",), depths=(0.5,)))[0]
    spec = parse_cache_spec("tova:size=40")
    lps, right, kept = answer_logprobs(model, trial.context_ids, trial.question_ids, trial.answer_ids, spec)
    runtime = Runtime.create(model, spec)
    runtime.feed(torch.tensor([trial.context_ids]))
    assert kept.layers[0].heads == kept_map(runtime.policy, len(trial.context_ids)).layers[0].heads
    logits = runtime.feed(torch.tensor([trial.question_ids]))
    expected = []
    for i, token in enumerate(trial.answer_ids):
        if i:
            logits = runtime.feed(torch.tensor([[trial.answer_ids[i - 1]]]))
        expected.append(torch.log_softmax(logits[0].float(), -1)[token].item())
    assert lps == expected


def test_the_bundled_tiny_model_cannot_be_judged(tokenizer):
    """`tiny` copies nothing from its context: the full cache misses the key, so no policy gets an accuracy."""
    from decodelab.core.engine.models import load_model
    lm = load_model("tiny", device="cpu")
    filler = lm.encode(TEXT.read_text(encoding="utf-8")[:2000])[:120]
    prober = Prober(lm.model, lm.tokenizer, filler, ProbeSettings(depths=(0.5,)), lm.context_length)
    report = prober.report([parse_cache_spec("window:size=32")])
    assert report.full.judged == 0 and report.full.accuracy is None and report.policies[0].accuracy is None
    assert "does not copy" in report.verdict


def test_the_filler_is_fitted_to_the_context(model, tokenizer, filler):
    trials = build_trials(tokenizer, filler, ProbeSettings(keys=("7 7 7 7",), depths=(0.5,)), context=100)
    assert len(trials[0].context_ids) + len(trials[0].question_ids) + len(trials[0].answer_ids) <= 100


@pytest.mark.parametrize("settings,words", [
    (ProbeSettings(needle="no key here"), "{key}"),
    (ProbeSettings(depths=(1.5,)), "--probe-depths 1.5"),
    (ProbeSettings(keys=(" ",)), "--probe-keys"),
])
def test_bad_probe_settings_are_one_line(model, tokenizer, filler, settings, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        Prober(model, tokenizer, filler, settings)


@pytest.fixture(scope="module")
def retrieval_dir(tmp_path_factory, tokenizer, model):
    folder = tmp_path_factory.mktemp("retrieval")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_TOKENIZER / name, folder / name)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def digitless(tmp_path_factory, tokenizer) -> str:
    path = tmp_path_factory.mktemp("filler") / "filler.txt"
    path.write_text(tokenizer.decode(tokenizer.encode(re.sub(r"[0-9]", "", TEXT.read_text(encoding="utf-8")[:4000]))
                                     [:120]), encoding="utf-8")
    return str(path)


def test_stream_probe_reports_the_policy_against_the_full_cache(cli, retrieval_dir, digitless, model, tokenizer):
    code, out, err = cli("stream", "--text-file", digitless, "--probe", "--probe-keys", "7 7 7 7", "--probe-depths",
                         "0.1,0.9", "--cache", "window:size=32", "-m", retrieval_dir, "-f", "json")
    assert code == 0, err
    doc = json.loads(out)
    summary = doc["summary"]
    assert doc["mode"] == "probe" and summary["full_accuracy"] == 1.0 and summary["accuracy"] == 0.5
    assert summary["judged"] == 2 and summary["right"] == 1
    full = [t["results"][0] for t in doc["probe"]["trials"]]
    assert all(r["policy"] == "full" and r["right"] for r in full)
    assert [t["results"][1]["right"] for t in doc["probe"]["trials"]] == [False, True]
    # the numbers are those of the core's probe over the same filler
    ids = tokenizer.encode(open(digitless, encoding="utf-8").read())
    prober = Prober(model, tokenizer, ids, ProbeSettings(keys=("7 7 7 7",), depths=(0.1, 0.9)), 2048)
    policy = prober.policy(parse_cache_spec("window:size=32"))
    assert [t["results"][1]["logprob"] for t in doc["probe"]["trials"]] == [r.logprob for r in policy.results]
    assert summary["tokens"] == len(ids) and summary["policy"] == "window:positions=keep,size=32"
    code, out, err = cli("stream", "--text-file", digitless, "--probe", "--probe-keys", "7 7 7 7", "--cache",
                         "knorm:ratio=0.5", "-m", retrieval_dir)
    assert code == 0 and "MISS" in out and "the full cache retrieves every key" in " ".join(out.split())


def test_a_question_in_the_prompt_leaves_the_first_answer_token_to_the_exact_prefill(model, tokenizer, filler):
    """question_in_prompt: the prefill forward sees every token and its last logits give the first answer token, so
    every policy gets that token exactly as the full cache does; the baseline keeps the question."""
    s = ProbeSettings(keys=("7 7 7 7",), depths=(0.1,), question_in_prompt=True)
    prober = Prober(model, tokenizer, filler, s)
    trial = prober.trials[0]
    assert trial.question_ids == [] and tokenizer.decode(trial.context_ids).endswith("The pass key is")
    assert tokenizer.decode(trial.baseline_ids).endswith("The pass key is")
    window = prober.policy(parse_cache_spec("window:size=32"))
    assert window.results[0].token_logprobs[0] == prober.full()[0].token_logprobs[0]


# mutation run of core/analysis/probe.py (2026-12-02, second round): the survivors of the first run


def one_line(message: str) -> str:
    """pytest.raises(match=) for the whole message, nothing before or after it."""
    return "^" + re.escape(message) + "$"


def test_the_depth_bounds_are_inclusive_and_an_empty_list_or_key_is_refused_word_for_word():
    check_probe(ProbeSettings(depths=(0.0, 1.0)))  # both ends of [0, 1] are depths
    check_probe(ProbeSettings(filler_tokens=1))  # one filler token is enough
    with pytest.raises(ConfigError, match=one_line("--probe-depths: give at least one depth in [0, 1]")):
        check_probe(ProbeSettings(depths=()))
    with pytest.raises(ConfigError, match=one_line("--probe-keys: a key is empty; give keys such as 71432,58210")):
        check_probe(ProbeSettings(keys=("1", "")))
    with pytest.raises(ConfigError, match=one_line("probe filler_tokens 0: the probe needs at least 1 filler token")):
        check_probe(ProbeSettings(filler_tokens=0))


def test_the_default_keys_are_two_five_digit_draws_of_the_seed():
    """Two keys of five digits, each digit random.Random(seed).randrange(10): seed 0 draws 6,6,0,4,8 then 7,6,4,7,5;
    seed 1 is one whose draws would hold an 11th value (10) if the range were off by one."""
    assert probe_keys(ProbeSettings(seed=0)) == ["66048", "76475"]
    for seed in range(8):
        keys = probe_keys(ProbeSettings(seed=seed))
        assert len(keys) == 2 and all(re.fullmatch(r"[0-9]{5}", k) for k in keys), (seed, keys)
    assert probe_keys(ProbeSettings(keys=("12", "34", "56"))) == ["12", "34", "56"]


def test_a_trial_describes_itself_by_its_positions_and_lengths():
    trial = Trial("42", 0.5, 3, 9, context_ids=[1] * 12, question_ids=[2] * 4, answer_ids=[5, 6], baseline_ids=[1])
    assert trial.describe() == {"key": "42", "depth": 0.5, "needle_start": 3, "needle_end": 9, "context_tokens": 12,
                                "question_tokens": 4, "answer_ids": [5, 6]}


def test_the_filler_count_takes_the_least_of_the_text_the_setting_and_the_room(tokenizer):
    filler = list(range(300, 340))  # 40 tokens
    s = ProbeSettings(keys=("7 7 7 7",))
    extra = len(tokenizer.encode(NEEDLE.format(key="7 7 7 7") + QUESTION + " 7 7 7 7"))
    assert filler_count(tokenizer, filler, s) == 40
    assert filler_count(tokenizer, filler, ProbeSettings(keys=("7 7 7 7",), filler_tokens=3)) == 3
    assert filler_count(tokenizer, filler, ProbeSettings(keys=("7 7 7 7",), filler_tokens=50), 1000) == 40
    assert filler_count(tokenizer, filler, s, extra + MARGIN + 10) == 10
    assert filler_count(tokenizer, filler, s, 5) == 1  # no room at all: one filler token still
    assert filler_count(tokenizer, [300], s) == 1
    with pytest.raises(ConfigError, match=one_line(
            "--text-file: the probe's filler is empty; give a text to plant the key in")):
        filler_count(tokenizer, [], s)


def test_a_question_that_merges_into_the_needle_is_refused(tokenizer, filler):
    """' pass' + 'ing' is one token (' passing'): the prompt's tokens do not start with the context's, although the
    key still follows the question cleanly."""
    s = ProbeSettings(keys=("7 7 7 7",), depths=(1.0,), needle=" The pass key is {key}. Remember the pass",
                      question="ing key? The pass key is")
    with pytest.raises(ConfigError, match=one_line(
            "probe question: the tokenizer merges the text, the question and the key across their boundaries; "
            "start the question with a space and end it in a word")):
        build_trials(tokenizer, filler, s)


def test_a_tokenizer_that_adds_a_bos_gets_it_once_at_the_start(filler):
    """The filler as a user's tokenizer encodes it starts with BOS; the probe cuts it as text (special tokens
    skipped) and re-encodes with the tokenizer's own specials, so every sequence holds exactly one BOS, at 0, and
    the needle positions count it."""
    bos_tokenizer = _bos_tokenizer()
    text = bos_tokenizer.decode(filler)
    ids = bos_tokenizer.encode(text)
    assert ids[0] == 0 and ids.count(0) == 1
    for trial in build_trials(bos_tokenizer, ids, ProbeSettings(keys=("7 7 7 7",), depths=(0.0, 0.5))):
        for seq in (trial.context_ids, trial.baseline_ids):
            assert seq[0] == 0 and seq.count(0) == 1
        assert bos_tokenizer.decode(trial.context_ids[trial.needle_start : trial.needle_end]) == \
            NEEDLE.format(key="7 7 7 7")
        assert 0 not in trial.question_ids + trial.answer_ids


def _bos_tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast
    inner = Tokenizer.from_file(str(BUNDLED_TOKENIZER / "tokenizer.json"))
    inner.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


def test_a_static_cache_is_sized_to_context_question_and_answer(model, tokenizer, filler):
    """static preallocates exactly the capacity it is given and refuses a token past it: the probe's capacity must be
    context + question + answer (a shorter one stops at the question or the answer)."""
    prober = Prober(model, tokenizer, filler, ProbeSettings(keys=("7 7 7 7",), depths=(0.5,)))
    static = prober.policy(parse_cache_spec("static"))
    assert static.results[0].right
    assert static.results[0].token_logprobs == pytest.approx(prober.full()[0].token_logprobs, abs=1e-5)


def test_the_needle_share_of_an_empty_span_is_none(model, tokenizer, filler):
    trial = build_trials(tokenizer, filler, ProbeSettings(keys=("3 3 3 3",), depths=(0.5,)))[0]
    kept = answer_logprobs(model, trial.context_ids, trial.question_ids, trial.answer_ids,
                           parse_cache_spec("h2o:size=32"))[2]
    assert needle_share(kept, 5, 5) is None and needle_share(None, 0, 4) is None


def test_results_carry_their_label_key_and_depth_and_the_means_are_means(model, tokenizer, filler):
    prober = Prober(model, tokenizer, filler, ProbeSettings(keys=("7 7 7 7", "3 3 3 3"), depths=(0.1, 0.9)))
    trial = prober.trials[3]
    spec = parse_cache_spec("window:size=32")
    assert run_trial(model, trial, spec, "mine").policy == "mine"
    result = run_trial(model, trial, spec)
    assert (result.policy, result.key, result.depth) == (str(spec), "3 3 3 3", 0.9)
    assert all(r.policy == "full" for r in prober.full())
    labelled = prober.policy(spec, "mine")
    assert labelled.policy == "mine" and all(r.policy == "mine" for r in labelled.results)
    assert prober.policy(spec).policy == str(spec)
    # the full spec is the reference itself, not a rerun of it
    assert prober.policy(parse_cache_spec("full")).results is prober.full()
    report = prober.report([spec])
    assert report.policies[0].policy == str(spec) and report.policies[0].results[0].policy == str(spec)
    report = prober.report([spec], ["named"])
    assert report.policies[0].results[0].policy == "named"


def test_summarize_and_the_baseline_take_means_over_the_trials():
    """Two trials with log-probabilities -1 and -3: mean -2, mean probability (e^-1 + e^-3) / 2; judged only where
    the full cache is right."""
    a = TrialResult("p", "1", 0.5, -1.0, [-1.0], True, 0.5)
    b = TrialResult("p", "2", 0.5, -3.0, [-3.0], False, None)
    probe = summarize("p", [a, b], [a, a])
    assert probe.mean_logprob == -2.0 and probe.mean_answer_prob == pytest.approx((math.exp(-1) + math.exp(-3)) / 2)
    assert (probe.trials, probe.judged, probe.right, probe.accuracy, probe.needle_kept) == (2, 2, 1, 0.5, 0.5)
    report = ProbeReport([], probe, [-1.0, -3.0, -5.0])
    assert report.baseline_mean() == -3.0


def test_a_prober_fits_its_filler_and_trials_to_the_context(model, tokenizer, filler):
    prober = Prober(model, tokenizer, filler, ProbeSettings(keys=("7 7 7 7",), depths=(0.5,)), context=100)
    assert prober.filler_tokens == filler_count(tokenizer, filler, ProbeSettings(keys=("7 7 7 7",)), 100) < len(filler)
    trial = prober.trials[0]
    assert len(trial.context_ids) + len(trial.question_ids) + len(trial.answer_ids) <= 100
