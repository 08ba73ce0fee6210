"""bench without timing anything: the settings it reads, the runs and pairings it builds, what it asks `generate`
for, the outputs it checks before timing, the rounds on a fake clock, and the rows worked by hand from given times.

Written for the mutation run of core/analysis/bench.py (2026-12-02): before it, bench had one unit test (in
test_compare.py) and the CLI's."""

from __future__ import annotations

import types

import pytest
import torch

from conftest import random_model
from decodelab.core.analysis import bench as bm
from decodelab.core.engine import warmup
from decodelab.core.errors import ConfigError

PROMPT = [5, 17, 42, 5, 17]
ALL = ("greedy", "sampling", "beam", "speculative", "prompt-lookup")


@pytest.fixture(scope="module")
def models():
    """The target (seed 3) and the draft (seed 9): random one-layer Llamas with spread-out logits."""
    return [random_model("llama", seed=seed, scale=4.0, num_hidden_layers=1) for seed in (3, 9)]


@pytest.fixture(scope="module")
def model(models):
    return models[0]


@pytest.fixture(scope="module")
def draft(models):
    return models[1]


def test_settings_read_from_the_option():
    assert bm.parse_settings(None) == ALL and bm.parse_settings("") == ALL  # not given: every setting
    assert bm.parse_settings(" beam, greedy ,,") == ("beam", "greedy")  # in the order given, blanks skipped
    allowed = "allowed: greedy, sampling, beam, speculative, prompt-lookup (comma-separated)"
    for text in ("greedy,warp", " , "):
        with pytest.raises(ConfigError) as e:
            bm.parse_settings(text)
        assert str(e.value) == f"--settings {text!r}: {allowed}"


def test_refusals_and_defaults(model, draft):
    with pytest.raises(ConfigError) as e:
        bm.Bench(model, PROMPT, 1, ("greedy",))
    assert str(e.value) == "--max-new-tokens 1: bench needs at least 2 tokens"
    with pytest.raises(ConfigError) as e:
        bm.Bench(model, PROMPT, 4)  # every setting by default, the speculative one included
    assert str(e.value) == "--draft: the speculative setting needs a draft model (or leave it out of --settings)"
    b = bm.Bench(model, tuple(PROMPT), 2, ("greedy",))
    assert (b.model, b.prompt_ids, b.n, b.settings, b.draft) == (model, PROMPT, 2, ("greedy",), None)
    assert (b.gammas, b.beams, b.ngram_size, b.seed, b.device) == ((1, 2, 4, 8), 4, 3, 0, torch.device("cpu"))
    assert (b.times, b.best) == ({}, {})
    assert bm.Bench(model, PROMPT, 4, draft=draft).settings == ALL


def test_each_setting_builds_its_runs_pairings_and_groups(model, draft):
    b = bm.Bench(model, PROMPT, 4, ALL, draft=draft, gammas=(2, 3), beams=3, ngram_size=2)
    assert list(b.runs) == ["ours greedy trace", "generate greedy", "ours greedy", "ours sampling trace",
                            "generate sampling", "ours sampling", "ours beam trace", "generate beam", "ours beam",
                            "ours draft g=2", "assisted g=2", "ours draft g=3", "assisted g=3", "assisted default",
                            "ours ngram g=2", "lookup g=2", "ours ngram g=3", "lookup g=3"]
    assert [(p.setting, p.ours, p.theirs, p.note) for p in b.pairings] == [
        ("greedy, trace on", "ours greedy trace", "generate greedy", ""),
        ("greedy, trace off", "ours greedy", "generate greedy", ""),
        ("sampling t=0.8 top-p=0.95, trace on", "ours sampling trace", "generate sampling", ""),
        ("sampling t=0.8 top-p=0.95, trace off", "ours sampling", "generate sampling", ""),
        ("beam 3, trace on", "ours beam trace", "generate beam", ""),
        ("beam 3, trace off", "ours beam", "generate beam", ""),
        ("speculative draft gamma=2, trace off", "ours draft g=2", "assisted g=2", ""),
        ("speculative draft gamma=3, trace off", "ours draft g=3", "assisted g=3", ""),
        ("prompt lookup gamma=2, trace off", "ours ngram g=2", "lookup g=2", ""),
        ("prompt lookup gamma=3, trace off", "ours ngram g=3", "lookup g=3", ""),
    ]
    assert b.groups == {
        "speculative draft: best vs best": (["ours draft g=2", "ours draft g=3"],
                                            ["assisted g=2", "assisted g=3", "assisted default"]),
        "prompt lookup: best vs best": (["ours ngram g=2", "ours ngram g=3"], ["lookup g=2", "lookup g=3"]),
    }
    only = bm.Bench(model, PROMPT, 4, ("beam",), beams=2)
    assert list(only.runs) == ["ours beam trace", "generate beam", "ours beam"] and only.groups == {}


def test_generate_is_asked_for_the_same_settings(model, draft, monkeypatch):
    """What each transformers run passes to `model.generate` (the module docstring's list): sampling without
    transformers' default top-50, beam with the same beams, length penalty and early stopping, assisted generation at
    a fixed draft length without a confidence cut-off and at its default schedule, prompt lookup with our n-gram
    size."""
    calls = {}
    monkeypatch.setattr(bm, "hf_generate", lambda m, ids, n, **kw: calls.setdefault("last", (m, ids, n, kw)))
    b = bm.Bench(model, PROMPT, 4, ALL, draft=draft, gammas=(2,), beams=3, ngram_size=2)
    expected = {
        "generate greedy": {"do_sample": False},
        "generate sampling": {"do_sample": True, "temperature": 0.8, "top_p": 0.95, "top_k": 0},
        "generate beam": {"num_beams": 3, "do_sample": False, "length_penalty": 1.0, "early_stopping": False},
        "assisted g=2": {"do_sample": False, "assistant_model": draft, "num_assistant_tokens": 2,
                         "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0},
        "assisted default": {"do_sample": False, "assistant_model": draft},
        "lookup g=2": {"do_sample": False, "prompt_lookup_num_tokens": 2, "max_matching_ngram_size": 2},
    }
    for name, kwargs in expected.items():
        calls.clear()
        b.runs[name]()
        m, ids, n, kw = calls["last"]
        assert (m, ids, n) == (model, PROMPT, 4), name
        assert kw == kwargs, name


def generate(model, n, **kwargs):
    ids = torch.tensor([PROMPT])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, eos_token_id=None,
                         pad_token_id=0, **kwargs)
    return out[0, len(PROMPT):].tolist()


def test_our_runs_decode_what_generate_decodes(model, draft):
    """Every greedy run (traced or not, speculative with the draft or the n-gram proposer) is transformers' greedy
    output, the beam runs are `generate(num_beams=2)`'s; the check before timing returns them."""
    b = bm.Bench(model, PROMPT, 5, ALL, draft=draft, gammas=(2,), beams=2, ngram_size=2)
    out = b.check()
    greedy = generate(model, 5, do_sample=False)
    beam = generate(model, 5, do_sample=False, num_beams=2, length_penalty=1.0, early_stopping=False)
    assert greedy != beam, "a prompt where beam search finds another output than greedy"
    for name in ("ours greedy trace", "ours greedy", "ours draft g=2", "ours ngram g=2", "generate greedy"):
        assert out[name] == greedy, name
    assert out["ours beam trace"] == out["ours beam"] == beam
    assert len(out["ours sampling"]) == 5 and set(out) == set(b.runs)


def test_sampling_runs_use_the_bench_seed(model):
    """The sampling runs draw with bench's seed at t = 0.8 under top-p 0.95, traced or not: the same tokens as a
    plain sampler built with that seed, and (for this prompt) not those of another seed."""
    from decodelab.core.engine.stopping import StopRules
    from decodelab.core.methods.sample import Sampler
    from decodelab.core.sampling.chain import build_chain
    from decodelab.core.sampling.select import make_selector

    def by_hand(seed):
        chain = build_chain({"temperature": 0.8, "top-p": 0.95})
        return [s.token_id for s in Sampler(model, PROMPT, chain, make_selector("multinomial", seed, "cpu"),
                                            StopRules(6, ignore_eos=True), str, None, top=0)]

    runs = bm.Bench(model, PROMPT, 6, ("sampling",), seed=11).runs
    assert runs["ours sampling"]() == runs["ours sampling trace"]() == by_hand(11) != by_hand(0)


def test_trace_on_records_as_the_commands_do(model, draft, monkeypatch):
    """"trace on" traces: the sampler with 5 alternatives in blocks of REPORT_BLOCK steps, beam search and the
    speculator recording; "trace off" runs without (the speculative rows are all trace off)."""
    seen = []

    def spy(cls):
        class Spy(cls):
            def __init__(self, *args, **kwargs):
                seen.append((cls.__name__, kwargs))
                super().__init__(*args, **kwargs)
        return Spy

    for name in ("Sampler", "BeamSearch", "Speculator"):
        monkeypatch.setattr(bm, name, spy(getattr(bm, name)))
    b = bm.Bench(model, PROMPT, 3, ("greedy", "beam", "speculative", "prompt-lookup"), draft=draft, gammas=(2,),
                 beams=2)
    for name in ("ours greedy trace", "ours greedy", "ours beam trace", "ours beam", "ours draft g=2",
                 "ours ngram g=2"):
        b.runs[name]()
    assert seen == [("Sampler", {"top": 5, "block": bm.REPORT_BLOCK}), ("BeamSearch", {"record": True}),
                    ("BeamSearch", {"record": False}), ("Speculator", {"top": 5, "record": False}),
                    ("Speculator", {"top": 5, "record": False})]


def fake_bench(model, outputs: dict, n: int = 2) -> bm.Bench:
    b = bm.Bench(model, PROMPT, n, ("greedy",))
    b.runs = {name: (lambda ids=ids: list(ids)) for name, ids in outputs.items()}
    return b


def refusal(b) -> str:
    with pytest.raises(RuntimeError) as e:
        b.check()
    return str(e.value)


def test_check_before_timing(model):
    """Each run's token count, greedy runs (every name without "sampling" or "beam") equal to the first of them,
    decodelab's untraced beam equal to generate's."""
    fine = {"ours sampling trace": [3, 4], "a": [1, 2], "generate sampling": [5, 6], "ours beam": [7, 8],
            "generate beam": [7, 8], "ours beam trace": [9, 9], "b": [1, 2]}
    assert fake_bench(model, fine).check() == fine
    assert refusal(fake_bench(model, {**fine, "b": [1, 2, 3]})) == "bench: b produced 3 tokens, not 2"
    assert refusal(fake_bench(model, {**fine, "b": [2, 1]})) == \
        "bench: greedy outputs differ (b vs a); not the same search"
    assert refusal(fake_bench(model, {**fine, "generate beam": [7, 9]})) == \
        "bench: decodelab's beam search and generate(num_beams) disagree"
    traced_only = {"ours beam trace": [1, 1], "generate beam": [2, 2]}  # only the untraced beam run is compared
    assert fake_bench(model, traced_only).check() == traced_only
    assert fake_bench(model, {"ours sampling": [1, 2]}).check() == {"ours sampling": [1, 2]}  # no greedy run


def test_time_runs_each_round_in_a_rotated_order_on_a_fake_clock(model, monkeypatch):
    """The check first (one call each: the warm-up, its seconds ``warmup_s``), then per round every run between two
    synchronisations of bench's device (the one clock, engine/run.py), its time the clock's advance during the call;
    the order rotated each round (issue 34: whichever runs first pays no more); on_round after each round."""
    from decodelab.core.engine import run as run_module

    clock, log = [0.0], []
    durations = {"a": iter([7.0, 1.0, 2.0, 4.0]), "b": iter([0.0, 3.0, 0.5, 0.25])}

    def run(name):
        def fn():
            log.append(name)
            clock[0] += next(durations[name])
            return [1, 2]
        return fn

    warmup.warm_up(model)  # the model's own warm-up done: bench's is 0 s and reads no clock
    monkeypatch.setattr(run_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(run_module, "synchronize", lambda device: log.append(("sync", device)))
    b = bm.Bench(model, PROMPT, 2, ("greedy",))
    b.runs = {"a": run("a"), "b": run("b")}
    rounds = []
    b.time(3, on_round=lambda r: log.append(("round", r)) or rounds.append(r))
    cpu = ("sync", torch.device("cpu"))
    assert b.times == {"a": [1.0, 2.0, 4.0], "b": [3.0, 0.5, 0.25]} and rounds == [0, 1, 2]
    assert b.warmup_s == 7.0
    assert b.warmups == {"a": 7.0, "b": 0.0} and b.model_warmup_s == 0.0  # each run's warm-up timed apart
    assert log == [cpu, "a", cpu, cpu, "b", cpu] + [cpu, "a", cpu, cpu, "b", cpu, ("round", 0)] + \
        [cpu, "b", cpu, cpu, "a", cpu, ("round", 1)] + [cpu, "a", cpu, cpu, "b", cpu, ("round", 2)]
    b.runs = {"a": lambda: [1, 2]}
    b.time(0)
    assert b.times == {"a": []}


def test_keep_whole_rounds_drops_a_round_cut_half_way(model):
    b = bm.Bench(model, PROMPT, 2, ("greedy",))
    assert b.keep_whole_rounds() == 0  # nothing timed
    b.times = {"a": [1.0, 2.0, 3.0], "b": [1.0, 2.0], "c": [1.0, 2.0, 3.0]}
    assert b.keep_whole_rounds() == 2 and b.times == {"a": [1.0, 2.0], "b": [1.0, 2.0], "c": [1.0, 2.0]}
    del b.times  # interrupted before time() set them
    assert b.keep_whole_rounds() == 0


def test_rows_worked_by_hand(model):
    """Given times for greedy and prompt lookup at gammas 1 and 2 (4 tokens, 3 rounds): tokens/s is 4 / the median
    time, the ratio the median of the per-round time ratios theirs / ours; the group row pairs the fastest of ours
    (ngram g=2, 4 / 0.5 = 8 tokens/s) with the fastest of theirs (lookup g=1, 4 / 2 = 2)."""
    b = bm.Bench(model, PROMPT, 4, ("greedy", "prompt-lookup"), gammas=(1, 2))
    b.times = {"ours greedy trace": [1.0, 2.0, 4.0], "generate greedy": [2.0, 2.0, 2.0], "ours greedy": [0.5, 1.0, 1.0],
               "ours ngram g=1": [1.0, 1.0, 1.0], "lookup g=1": [2.0, 2.0, 2.0], "ours ngram g=2": [0.5, 0.5, 0.5],
               "lookup g=2": [4.0, 4.0, 4.0]}
    assert b.tps("ours greedy trace") == 2.0  # the median 2, not the mean 7/3
    rows = [r.to_dict() for r in b.rows()]
    keys = ("setting", "decodelab_tokens_per_s", "transformers_tokens_per_s", "ratio", "ratio_low", "ratio_high",
            "tokens", "rounds", "note")
    assert [tuple(r[k] for k in keys) for r in rows] == [
        ("greedy, trace on", 2.0, 2.0, 1.0, 0.5, 2.0, 4, 3, ""),  # ratios 2/1, 2/2, 2/4
        ("greedy, trace off", 4.0, 2.0, 2.0, 2.0, 4.0, 4, 3, ""),  # ratios 4, 2, 2
        ("prompt lookup gamma=1, trace off", 4.0, 2.0, 2.0, 2.0, 2.0, 4, 3, ""),
        ("prompt lookup gamma=2, trace off", 8.0, 1.0, 8.0, 8.0, 8.0, 4, 3, ""),
        ("prompt lookup: best vs best", 8.0, 2.0, 4.0, 4.0, 4.0, 4, 3, "ours ngram g=2 vs lookup g=1"),
    ]
    warm = {"decodelab_warmup_s", "transformers_warmup_s"}  # issue 34: each side's untimed first call (none here)
    assert set(rows[0]) == set(keys) | warm and all(r[k] is None for r in rows for k in warm)


# mutation run of core/analysis/bench.py (2026-12-02): the chains and selectors of our runs, beam's width, the
# fastest of ours when it is not the last named


def test_our_runs_build_the_chain_and_selector_of_their_command(model, draft, monkeypatch):
    """Greedy runs decode under a temperature-0 chain with the greedy selector (as `sample -t 0`), sampling runs
    under temperature 0.8 and top-p 0.95 with the race, beam search with bench's beams and no stages, speculation
    under a temperature-0 chain; each for bench's token count."""
    seen = []

    def spy(name, real, chain_at, selector_at=None):
        def fn(*args, **kwargs):
            selector = type(args[selector_at]).__name__ if selector_at is not None else None
            seen.append((name, args[chain_at].names, selector))
            return real(*args, **kwargs)
        return fn

    monkeypatch.setattr(bm, "Sampler", spy("Sampler", bm.Sampler, 2, 3))
    monkeypatch.setattr(bm, "decode_tokens", spy("decode_tokens", bm.decode_tokens, 2, 3))
    monkeypatch.setattr(bm, "Speculator", spy("Speculator", bm.Speculator, 3))
    widths = []
    real_beam = bm.BeamSearch

    def beam(stepper, prompt_ids, chain, settings, *args, **kwargs):
        widths.append((chain.names, settings.beams, settings.max_new_tokens))
        return real_beam(stepper, prompt_ids, chain, settings, *args, **kwargs)

    monkeypatch.setattr(bm, "BeamSearch", beam)
    b = bm.Bench(model, PROMPT, 3, ALL, draft=draft, gammas=(2,), beams=3)
    for name in ("ours greedy trace", "ours greedy", "ours sampling trace", "ours sampling", "ours beam",
                 "ours draft g=2", "ours ngram g=2"):
        assert len(b.runs[name]()) == 3, name
    assert seen == [("Sampler", ["temperature"], "Greedy"), ("decode_tokens", ["temperature"], "Greedy"),
                    ("Sampler", ["temperature", "top-p"], "Multinomial"),
                    ("decode_tokens", ["temperature", "top-p"], "Multinomial"),
                    ("Speculator", ["temperature"], None), ("Speculator", ["temperature"], None)]
    assert widths == [([], 3, 3)]


def test_the_best_of_ours_is_the_fastest_not_the_last_named(model):
    b = bm.Bench(model, PROMPT, 4, ("prompt-lookup",), gammas=(1, 2))
    b.times = {"ours ngram g=1": [0.5], "lookup g=1": [4.0], "ours ngram g=2": [1.0], "lookup g=2": [2.0]}
    group = b.rows()[-1]
    assert (group.setting, group.decodelab_tokens_per_s, group.transformers_tokens_per_s, group.ratio, group.note) == \
        ("prompt lookup: best vs best", 8.0, 2.0, 4.0, "ours ngram g=1 vs lookup g=2")
