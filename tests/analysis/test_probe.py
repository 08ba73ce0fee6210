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

from decodelab.core.analysis.probe import Prober, ProbeSettings, answer_logprobs, build_trials
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
