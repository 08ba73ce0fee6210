"""--semantics and --export: llama.cpp's own sampler test vectors through the no-model distribution function, each
engine's plan (order, defaults, clamps, counting), transformers' `generate` reproduced greedy and sampled, and the
exported `generate` keyword arguments fed back to `generate`."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_model

from decodelab.core.sampling.settings import ChainSettings
from decodelab.core.methods.sample import SampleSettings, validate_sample
from decodelab.core.sampling.chain import validate_chain
from decodelab.core.methods.sample import DecodeState, decode_tokens
from decodelab.core.engine.stopping import StopRules
from decodelab.core.methods.probs import dist_stages, given_logits
from decodelab.core.errors import ConfigError
from decodelab.core.sampling.export import _gbnf_string, export
from conftest import build
from decodelab.core.sampling.chain import chain_for
from decodelab.core.sampling.select import Greedy, make_generator
from decodelab.core.sampling.tokens import Tokens
from decodelab.core.sampling.semantics import merge_order, plan

# --- llama.cpp tests/test-sampling.cpp, to 1e-5 -----------------------------------------------------------------
# llama.cpp's tester sets logits = log(p) and checks p after the sampler (then `dist`, which renormalizes) in the
# array's final order; here the expected values are written by token id (0 where the token was removed). The other
# llama.cpp defaults are switched off the way a llama.cpp user would: --top-k 0 --top-p 1 --min-p 0 --temp 1.

NEUTRAL = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "temperature": 1.0}
P4 = "0.1,0.2,0.3,0.4"
U5 = "0.2,0.2,0.2,0.2,0.2"
U4 = "0.25,0.25,0.25,0.25"

LLAMACPP_VECTORS = [
    # test_temp, test_temp_ext
    (P4, (), {"temperature": 1.0}, [0.1, 0.2, 0.3, 0.4]),
    (P4, (), {"temperature": 0.0}, [0, 0, 0, 1]),
    (P4, (), {"temperature": 1.0, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0}, [0.1, 0.2, 0.3, 0.4]),
    (P4, (), {"temperature": 0.0, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0}, [0, 0, 0, 1]),
    # test_top_k
    (P4, (), {"top_k": 1}, [0, 0, 0, 1]),
    (P4, (), {"top_k": 3}, [0, 0.22222, 0.33333, 0.44444]),
    (P4, (), {"top_k": 4}, [0.1, 0.2, 0.3, 0.4]),
    (P4, (), {"top_k": 0}, [0.1, 0.2, 0.3, 0.4]),
    # test_top_p
    (P4, (), {"top_p": 0.0}, [0, 0, 0, 1]),
    (P4, (), {"top_p": 0.7}, [0, 0, 0.428571, 0.571429]),
    (P4, (), {"top_p": 0.8}, [0, 0.22222, 0.33333, 0.44444]),
    (P4, (), {"top_p": 1.0}, [0.1, 0.2, 0.3, 0.4]),
    # test_min_p
    (P4, (), {"min_p": 0.00}, [0.1, 0.2, 0.3, 0.4]),
    (P4, (), {"min_p": 0.24}, [0.1, 0.2, 0.3, 0.4]),
    (P4, (), {"min_p": 0.26}, [0, 0.2 / 0.9, 0.3 / 0.9, 0.4 / 0.9]),
    (P4, (), {"min_p": 0.49}, [0, 0.2 / 0.9, 0.3 / 0.9, 0.4 / 0.9]),
    (P4, (), {"min_p": 0.51}, [0, 0, 0.3 / 0.7, 0.4 / 0.7]),
    (P4, (), {"min_p": 0.74}, [0, 0, 0.3 / 0.7, 0.4 / 0.7]),
    (P4, (), {"min_p": 0.76}, [0, 0, 0, 1]),
    (P4, (), {"min_p": 1.00}, [0, 0, 0, 1]),
    (P4, (), {"min_p": 1.05}, [0, 0, 0, 1]),
    # test_typical (no `dist` after it there: its p are renormalized here)
    ("0.97,0.01,0.01,0.01", (), {"typical_p": 0.5}, [1, 0, 0, 0]),
    ("0.4,0.2,0.2,0.2", (), {"typical_p": 0.5}, [0, 1 / 3, 1 / 3, 1 / 3]),
    # test_penalties (penalty_last_n = the history's length, as the test builds them)
    (U5, (0,), {"repetition_penalty": 50.0}, [0, 0.25, 0.25, 0.25, 0.25]),
    (U5, (0, 1, 2), {"repetition_penalty": 50.0}, [0, 0, 0, 0.5, 0.5]),
    (U5, (0, 1, 2, 0, 0), {"repetition_penalty": 50.0}, [0, 0, 0, 0.5, 0.5]),
    (U5, (0,), {"frequency_penalty": 5.0, "presence_penalty": 5.0},
     [0.000011, 0.249997, 0.249997, 0.249997, 0.249997]),
    (U5, (0, 1, 2), {"frequency_penalty": 5.0, "presence_penalty": 5.0},
     [0.000023, 0.000023, 0.000023, 0.499966, 0.499966]),
    (U5, (0, 1, 2, 0, 0), {"frequency_penalty": 5.0, "presence_penalty": 5.0},
     [0.000000, 0.000023, 0.000023, 0.499977, 0.499977]),
    # test_dry
    (U4, (0, 1), {"dry_multiplier": 1.0, "dry_base": 1.1, "dry_allowed_length": 2, "dry_penalty_last_n": 4},
     [0.25, 0.25, 0.25, 0.25]),
    (U4, (0, 1, 2, 0, 1), {"dry_multiplier": 1.0, "dry_base": 1.1, "dry_allowed_length": 2,
                           "dry_penalty_last_n": 5}, [0.296923, 0.296923, 0.109232, 0.296923]),
    (U5, (0, 1, 3, 4, 0, 1), {"dry_multiplier": 1.0, "dry_base": 1.1, "dry_allowed_length": 2,
                              "dry_penalty_last_n": 6, "dry_breaker": ("3",)}, [0.2] * 5),
    (U5, (0, 1, 2, 0, 1), {"dry_multiplier": 2.0, "dry_base": 1.1, "dry_allowed_length": 2,
                           "dry_penalty_last_n": 5}, [0.241818, 0.241818, 0.032727, 0.241818, 0.241818]),
    (U5, (0, 1, 2, 3, 4, 0, 1), {"dry_multiplier": 1.0, "dry_base": 1.1, "dry_allowed_length": 4,
                                 "dry_penalty_last_n": 7}, [0.2] * 5),
    # test_top_n_sigma (0 is off since llama.cpp PR 13345)
    (P4, (), {"top_n_sigma": 1.0}, [0, 0, 0.428571, 0.571429]),
    (P4, (), {"top_n_sigma": 0.0}, [0.1, 0.2, 0.3, 0.4]),
    (P4, (), {"top_n_sigma": 3.0}, [0.1, 0.2, 0.3, 0.4]),
]


def llamacpp(dist: str, history=(), seed: int = 0, **fields):
    s = ChainSettings(semantics="llamacpp", **{**NEUTRAL, **fields})
    validate_chain(s)
    return dist_stages(s, given_logits(dist=dist), list(history), seed=seed)


@pytest.mark.parametrize("dist,history,fields,expected", LLAMACPP_VECTORS,
                         ids=[f"{i}-{'-'.join(f)}" for i, (_, _, f, _) in enumerate(LLAMACPP_VECTORS)])
def test_llamacpp_sampler_vectors(dist, history, fields, expected):
    got = llamacpp(dist, history, **fields).probs()
    assert got == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("threshold,kept", [(0.09, [0.1]), (0.19, [0.2, 0.1]), (0.29, [0.3, 0.2, 0.1]),
                                            (0.39, [0.4, 0.3, 0.2, 0.1])])
def test_llamacpp_xtc_vectors(threshold, kept):
    """test_xtc: probability 0.99; llama.cpp's test reads p without renormalizing (XTC shifts the array), so the
    expected kept probabilities are renormalized here. The coin of seed 0 is below 0.99, so XTC acts."""
    r = llamacpp("0.4,0.3,0.2,0.1", xtc_probability=0.99, xtc_threshold=threshold)
    assert r.state["xtc.coin"] <= 0.99
    expected = [0.0] * (4 - len(kept)) + [k / sum(kept) for k in kept]
    assert r.probs() == pytest.approx(expected, abs=1e-5)


def test_the_dist_function_matches_the_model_path_views():
    """Same chain, same logits: the views of the no-model path are those next_token_stages builds."""
    r = dist_stages(ChainSettings(temperature=0.5, top_k=3), given_logits(logits="1,2,3,-inf,0.5"), [])
    assert [v.name for v in r.stages] == ["raw", "temperature", "top-k"]
    assert r.stages[0].kept == 4 and r.stages[-1].kept == 3
    assert r.stages[-1].mass_removed == pytest.approx(torch.softmax(torch.tensor([1, 2, 3, 0.5]) / 0.5, 0)[3].item())


@pytest.mark.parametrize("kwargs,message", [
    ({"dist": "0.1,x"}, "--dist 'x'"), ({"dist": "0,0"}, "--dist: the probabilities sum to 0"),
    ({"dist": "0.5,-0.1"}, "--dist -0.1"), ({"logits": "1,inf"}, r"--logits: \+inf"),
    ({"dist": "1", "logits": "1"}, "exactly one"),
])
def test_given_distribution_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        given_logits(**kwargs)


def test_history_and_token_ids_are_checked():
    with pytest.raises(ConfigError, match="--history 7"):
        dist_stages(ChainSettings(), given_logits(dist=P4), [7])
    with pytest.raises(ConfigError, match="--ban 'a b'"):
        dist_stages(ChainSettings(ban=("a b",)), given_logits(dist=P4), [])


# --- each engine's plan ------------------------------------------------------------------------------------------


def test_hf_plan_defaults_and_greedy():
    p = plan(ChainSettings(semantics="hf", temperature=0.7, repetition_penalty=1.2, logit_bias=(("3", 1.0),)))
    assert p.order == ["bias", "repetition-penalty", "temperature", "top-k"]  # sequence_bias first, top_k=50 added
    assert p.settings.top_k == 50 and p.selector == "hf-multinomial" and p.logprobs == "processed"
    g = plan(ChainSettings(semantics="hf", top_p=0.9, repetition_penalty=1.2))  # no temperature: greedy
    assert g.order == ["repetition-penalty"] and g.selector == "greedy"
    assert any("top-p" in n and "do_sample=False" in n for n in g.notes)


def test_vllm_plan_counts_output_only_and_greedy_before_filters():
    p = plan(ChainSettings(semantics="vllm", temperature=0.8, top_k=-1, top_p=0.9, min_p=0.1,
                           presence_penalty=0.5, repetition_penalty=1.1))
    assert p.order == ["repetition-penalty", "presence-penalty", "temperature", "min-p", "top-p"]
    assert p.counting["presence-penalty"] == ("output", None) and "repetition-penalty" not in p.counting
    assert p.logprobs == "raw" and p.trim_stop
    g = plan(ChainSettings(semantics="vllm", temperature=0.0, top_p=0.5, frequency_penalty=1.0))
    assert g.order == ["frequency-penalty", "temperature"] and g.settings.temperature == 0.0
    # vLLM 0.32's SamplingParams raises a temperature in (0, 0.01) to 0.01 before its greedy check (sampling_params.py
    # __post_init__): only 0 is greedy (this case once read 1e-6 as greedy, vLLM's sampler-level eps)
    tiny = plan(ChainSettings(semantics="vllm", temperature=1e-6, top_p=0.5))
    assert tiny.selector == "multinomial" and tiny.settings.temperature == 0.01 and "top-p" in tiny.order
    with pytest.raises(ConfigError, match=r"--presence-penalty 3.0: vLLM allows \[-2, 2\]"):
        plan(ChainSettings(semantics="vllm", presence_penalty=3.0))


def test_llamacpp_plan_defaults_order_and_mirostat():
    p = plan(ChainSettings(semantics="llamacpp", repetition_penalty=1.1, xtc_probability=0.5))
    assert p.settings.top_k == 40 and p.settings.top_p == 0.95 and p.settings.min_p == 0.05
    assert p.order == ["repetition-penalty", "top-k", "top-p", "min-p", "xtc", "temperature"]  # temperature last
    assert p.counting["repetition-penalty"] == ("all", 64)
    m = plan(ChainSettings(semantics="llamacpp", mirostat_tau=4.0, top_k=10, repetition_penalty=1.3))
    assert m.order == ["temperature", "mirostat"]
    assert any("mirostat" in n and "top-k" in n for n in m.notes)
    off = plan(ChainSettings(semantics="llamacpp", xtc_probability=0.5, xtc_threshold=0.6, penalty_last_n=0,
                             presence_penalty=1.0, temperature=1.0))
    assert "xtc" not in off.order and "presence-penalty" not in off.order and "temperature" not in off.order


def test_stages_an_engine_lacks_keep_decodelabs_position_and_are_noted():
    p = plan(ChainSettings(semantics="hf", temperature=0.5, softcap=30.0, dry_multiplier=0.8, top_p=0.9))
    assert p.order == ["softcap", "dry", "temperature", "top-k", "top-p"]
    assert any("has no softcap, dry" in n for n in p.notes)
    assert merge_order(("top-p", "top-k"), ["softcap", "top-k", "top-p"]) == ["softcap", "top-p", "top-k"]
    assert merge_order(("top-p", "top-k"), ["top-k", "top-p", "xtc"]) == ["top-p", "top-k", "xtc"]


def test_user_chain_wins_over_the_engine_order():
    p = plan(ChainSettings(semantics="llamacpp", temperature=0.5, top_k=5, top_p=1.0, min_p=0.0,
                           chain=("temperature", "top-k")))
    assert p.order == ["temperature", "top-k"]
    validate_chain(ChainSettings(semantics="llamacpp", temperature=0.5, top_k=5, top_p=1.0, min_p=0.0,
                                 chain=("temperature", "top-k")))


# --- transformers generate, reproduced ------------------------------------------------------------------------

PROMPT = [5, 17, 42, 9, 77, 3]


def our_ids(model, settings: SampleSettings, eos=()):
    validate_sample(settings)
    _, chain, selector = build(settings, model.config.vocab_size, settings.seed, "cpu", eos_ids=eos,
                               stop_ids=settings.stop_id)
    state = DecodeState()
    rules = StopRules(settings.max_new_tokens, tuple(eos))
    return [d.token_id for d in decode_tokens(model, PROMPT, chain, selector, rules, state=state)], state


def hf_ids(model, seed=None, **kwargs):
    if seed is not None:
        torch.manual_seed(seed)
    out = model.generate(torch.tensor([PROMPT]), pad_token_id=0, **kwargs)
    return out[0, len(PROMPT):].tolist()


def penalized(model, n=16):
    """Greedy hf settings with penalties, bans and biases that really bite: chosen from the run without them."""
    base = SampleSettings(semantics="hf", temperature=0.0, repetition_penalty=1.3, no_repeat_ngram=3,
                          max_new_tokens=n)
    free, _ = our_ids(model, base)
    settings = SampleSettings(**{**base.__dict__, "ban": (f"{free[2]} {free[3]}",),
                                 "sequence_bias": ((f"{free[5]}", -4.0), (f"{free[0]} {free[1]}", 3.0)),
                                 "logit_bias": ((str(free[6]), -2.5),), "min_new_tokens": 4})
    return free, settings, free[1]  # eos: the second free token (banned for 4 steps)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_hf_greedy_with_penalties_equals_generate(arch):
    model = random_model(arch, seed=2, scale=4.0)
    free, settings, eos = penalized(model)
    ours, state = our_ids(model, settings, eos=(eos,))
    ref = hf_ids(model, do_sample=False, max_new_tokens=16, repetition_penalty=1.3, no_repeat_ngram_size=3,
                 bad_words_ids=[[free[2], free[3]]], min_new_tokens=4, eos_token_id=eos,
                 sequence_bias=[[[free[5]], -4.0], [[free[0], free[1]], 3.0], [[free[6]], -2.5]])
    assert ours == ref
    assert ours != free  # the bans and biases changed the text


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_exported_hf_kwargs_reproduce_the_greedy_output(arch):
    model = random_model(arch, seed=2, scale=4.0)
    _, settings, eos = penalized(model)
    native = SampleSettings(**{**settings.__dict__, "semantics": None})
    ours, _ = our_ids(model, native, eos=(eos,))
    kwargs = export(native, "hf", model.config.vocab_size).arguments
    assert kwargs["do_sample"] is False and "sequence_bias" in kwargs and "bad_words_ids" in kwargs
    assert ours == hf_ids(model, eos_token_id=eos, **kwargs)


def test_hf_stop_id_waits_for_min_new_tokens_as_the_exported_generate_does():
    """--semantics hf and --export hf agree: the export writes the stop id into eos_token_id, and generate's
    min_new_tokens bans every eos_token_id, so the stop id cannot end the run before N tokens (it once could)."""
    model = random_model("llama", seed=2, scale=4.0)
    free, _ = our_ids(model, SampleSettings(temperature=0.0, max_new_tokens=8))
    stop = free[0]  # the first greedy token: without the ban the run ends at once
    settings = SampleSettings(semantics="hf", temperature=0.0, max_new_tokens=8, stop_id=(stop,), min_new_tokens=3)
    validate_sample(settings)
    _, chain, selector = build(settings, model.config.vocab_size, settings.seed, "cpu", stop_ids=settings.stop_id)
    rules = StopRules(settings.max_new_tokens, stop_ids=settings.stop_id)
    ours = [d.token_id for d in decode_tokens(model, PROMPT, chain, selector, rules, state=DecodeState())]
    kwargs = export(settings, "hf", model.config.vocab_size).arguments
    assert kwargs["eos_token_id"] == [stop] and kwargs["min_new_tokens"] == 3
    ref = hf_ids(model, **kwargs)
    assert len(ours) >= 3 and stop not in ours[:3]
    assert ours == ref


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hf_sampling_equals_generate_do_sample_token_for_token(arch, seed):
    model = random_model(arch, seed=4, scale=2.0)
    settings = SampleSettings(semantics="hf", temperature=0.8, top_p=0.95, repetition_penalty=1.2,
                              max_new_tokens=16, seed=seed)
    ours, _ = our_ids(model, settings)
    ref = hf_ids(model, seed=seed, do_sample=True, temperature=0.8, top_p=0.95, repetition_penalty=1.2,
                 max_new_tokens=16)  # top_k=50: transformers' default, which the hf plan adds too
    assert ours == ref
    greedy = hf_ids(model, do_sample=False, max_new_tokens=16, repetition_penalty=1.2)
    assert ours != greedy  # really sampled


def test_export_unsupported_and_llamacpp_flags():
    s = SampleSettings(temperature=0.7, dry_multiplier=0.8, mirostat_tau=4.0, top_k=20, max_new_tokens=8, seed=1)
    hf = export(s, "hf", 100)
    assert any(u.startswith("dry") for u in hf.unsupported) and any(u.startswith("mirostat") for u in hf.unsupported)
    flags = export(s, "llamacpp", 100).arguments
    assert flags[flags.index("--top-k") + 1] == "20" and flags[flags.index("--min-p") + 1] == "0"
    assert flags[flags.index("--mirostat") + 1] == "2" and flags[flags.index("--mirostat-ent") + 1] == "4"
    v = export(SampleSettings(temperature=0.0, presence_penalty=0.5, stop=("x",), trim_stop=False), "vllm", 100)
    assert v.arguments["temperature"] == 0.0 and v.arguments["include_stop_str_in_output"] is True
    with pytest.raises(ConfigError, match="--export 'tgi'"):
        export(s, "tgi", 100)


# --- where --semantics llamacpp once departed from llama.cpp (each case failed before the fix) ---------------------


def softmax_of(z) -> list[float]:
    return torch.softmax(torch.tensor(z, dtype=torch.float64), 0).tolist()


def test_llamacpp_dry_scans_the_last_64_tokens_by_default():
    """dry_penalty_last_n defaults to 64 in llama.cpp: the early "0 1 2" lies outside the last 64 tokens, so the
    repeat "0 1" earns no penalty; decodelab's own DRY (every token) and an explicit window of 75 see it."""
    history = (0, 1, 2) + (3,) * 70 + (0, 1)
    assert llamacpp(U4, history, dry_multiplier=1.0).probs() == pytest.approx([0.25] * 4, abs=1e-6)
    penalized = softmax_of([0, 0, -1.0, 0])  # the repeat "0 1" (n = 2 = L) is followed by 2: z_2 -= 1 * 1.75^0
    assert llamacpp(U4, history, dry_multiplier=1.0, dry_penalty_last_n=75).probs() == pytest.approx(penalized)
    native = dist_stages(ChainSettings(dry_multiplier=1.0), given_logits(dist=U4), list(history)).probs()
    assert native == pytest.approx(penalized)
    assert plan(ChainSettings(semantics="llamacpp", dry_multiplier=1.0)).settings.dry_penalty_last_n == 64


def test_llamacpp_ignores_a_dry_base_below_one():
    """llama-cli ignores --dry-base below 1 (the server substitutes its default): DRY runs with 1.75. The repeat
    "0 1 2 0 1" (n = 5) is followed by 2: z_2 -= 1 * 1.75^(5 - 2)."""
    history = (0, 1, 2, 0, 1, 2, 0, 1)
    got = llamacpp(U4, history, dry_multiplier=1.0, dry_base=0.5, dry_allowed_length=2, dry_penalty_last_n=8)
    assert got.probs() == pytest.approx(softmax_of([0, 0, -1.75 ** 3, 0]))
    assert any("dry_base 0.5" in n for n in plan(ChainSettings(semantics="llamacpp", dry_multiplier=1.0,
                                                                dry_base=0.5)).notes)
    with pytest.raises(ConfigError, match="--dry-base 0.5: must be >= 1"):  # decodelab's own reading refuses it
        dist_stages(ChainSettings(dry_multiplier=1.0, dry_base=0.5), given_logits(dist=U4), list(history))


def test_llamacpp_dynamic_temperature_at_zero_runs_from_zero_to_the_range():
    """llama.cpp's temp_ext with t = 0: T = max(0, t - r) + 2r (H / log K) ^ e over [0, r] (decodelab's own reading
    refuses -t 0 with a range: greedy and dynamic at once)."""
    p = [0.1, 0.2, 0.3, 0.4]
    h = -sum(x * math.log(x) for x in p)
    t = 0.0 + (0.5 - 0.0) * (h / math.log(4))
    r = llamacpp(P4, temperature=0.0, dynatemp_range=0.5)
    assert r.state["dynatemp.temperature"] == pytest.approx(t, rel=1e-5)
    assert r.probs() == pytest.approx(softmax_of([math.log(x) / t for x in p]), abs=1e-5)
    with pytest.raises(ConfigError, match="--dynatemp-range 0.5: needs a temperature > 0"):
        validate_chain(ChainSettings(temperature=0.0, dynatemp_range=0.5))


def test_llamacpp_top_k_keeps_exactly_k_and_min_p_above_one_keeps_one():
    """Three tokens tied at 0.3, top-k 2: llama.cpp's heap keeps tokens 1 and 2 (decodelab's own top-k keeps all
    three); min-p 1.05 with two tokens tied at the top keeps one, the lower id (min-p 1 keeps both)."""
    assert llamacpp("0.1,0.3,0.3,0.3", top_k=2).probs() == pytest.approx([0, 0.5, 0.5, 0], abs=1e-6)
    native = dist_stages(ChainSettings(top_k=2), given_logits(dist="0.1,0.3,0.3,0.3"), []).probs()
    assert native == pytest.approx([0, 1 / 3, 1 / 3, 1 / 3], abs=1e-6)
    assert llamacpp("0.3,0.35,0.35", min_p=1.05).probs() == pytest.approx([0, 1, 0], abs=1e-6)
    assert llamacpp("0.3,0.35,0.35", min_p=1.0).probs() == pytest.approx([0, 0.5, 0.5], abs=1e-6)


@pytest.mark.parametrize("field", ["penalty_last_n", "dry_penalty_last_n"])
def test_llamacpp_refuses_negative_windows(field):
    """The current llama-cli refuses a negative --repeat-last-n or --dry-penalty-last-n (its library reads -1 as
    off); -1 once meant "every token" here."""
    option = "--" + field.replace("_", "-")
    with pytest.raises(ConfigError, match=rf"^{option} -1: llama-cli refuses a negative window"):
        plan(ChainSettings(semantics="llamacpp", dry_multiplier=1.0, repetition_penalty=1.1, **{field: -1}))


@pytest.mark.parametrize("temperature", [2.5, -0.5])
def test_vllm_refuses_a_temperature_outside_0_2(temperature):
    with pytest.raises(ConfigError, match=rf"^--temperature {temperature}: vLLM allows \[0, 2\]"):
        plan(ChainSettings(semantics="vllm", temperature=temperature))
    plan(ChainSettings(semantics="vllm", temperature=2.0))


GENERATION_CONFIG = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.1, "repetition_penalty": 1.3,
                     "presence_penalty": 0.4, "frequency_penalty": 0.4}


@pytest.mark.parametrize("settings, reads", [
    (SampleSettings(temperature=0.7, top_p=0.95), {"temperature": 0.7, "top_p": 0.95, "top_k": 0, "min_p": 0.0,
                                                   "repetition_penalty": 1.0, "presence_penalty": 0.0,
                                                   "frequency_penalty": 0.0}),
    (SampleSettings(temperature=0.0, presence_penalty=0.5), {"temperature": 0.0, "top_p": 1.0, "top_k": 0,
                                                              "min_p": 0.0, "repetition_penalty": 1.0,
                                                              "presence_penalty": 0.5, "frequency_penalty": 0.0}),
])
def test_vllm_export_leaves_nothing_for_the_generation_config_to_fill(settings, reads):
    """A vLLM server fills every sampling field a request lacks from the model's generation_config
    (get_diff_sampling_param); a request built from the export, merged over a generation_config that sets all
    seven, must still read as decodelab does."""
    kwargs = export(settings, "vllm", 100).arguments
    merged = {**GENERATION_CONFIG, **kwargs}
    assert {k: merged[k] for k in GENERATION_CONFIG} == reads


def test_hf_export_switches_off_what_a_generation_config_would_switch_on():
    """generate merges the model's generation_config under the keyword arguments: with do_sample the export
    names every warper's value, off ones too (top_k 0, top_p 1, ...)."""
    kwargs = export(SampleSettings(temperature=0.7, top_p=0.9), "hf", 100).arguments
    assert kwargs["do_sample"] is True and kwargs["top_k"] == 0 and kwargs["typical_p"] == 1.0
    assert kwargs["min_p"] == 0.0 and kwargs["epsilon_cutoff"] == 0.0 and kwargs["repetition_penalty"] == 1.0


def test_llamacpp_export_writes_every_token_windows_as_the_context():
    s = SampleSettings(temperature=0.7, dry_multiplier=0.8, repetition_penalty=1.1)
    flags = export(s, "llamacpp", 100, context=512).arguments
    assert flags[flags.index("--dry-penalty-last-n") + 1] == "512"
    assert flags[flags.index("--repeat-last-n") + 1] == "512" and "-1" not in flags
    unknown = export(s, "llamacpp", 100)
    assert "--dry-penalty-last-n" not in unknown.arguments
    assert any(u.startswith("DRY over every token") for u in unknown.unsupported)


# --- engine orders, by behaviour: one distribution each pair of orders maps differently --------------------------


def test_vllm_adds_the_logit_bias_before_the_repetition_penalty():
    """z = (1, 0), token 0 seen, bias +1 on it, penalty 2: vLLM (bias, then penalties) gives z_0 = (1 + 1) / 2 = 1;
    decodelab's default order (penalties, then bias) gives 1 / 2 + 1 = 1.5."""
    fields = dict(logit_bias=(("0", 1.0),), repetition_penalty=2.0, temperature=1.0)
    vllm = dist_stages(ChainSettings(semantics="vllm", **fields), given_logits(logits="1,0"), [0]).probs()
    ours = dist_stages(ChainSettings(**fields), given_logits(logits="1,0"), [0]).probs()
    assert vllm == pytest.approx(softmax_of([1.0, 0.0]), abs=1e-6)
    assert ours == pytest.approx(softmax_of([1.5, 0.0]), abs=1e-6)


def test_llamacpp_tempers_after_the_filters_and_transformers_before():
    """p = (0.1, 0.2, 0.3, 0.4), T = 0.5, top-p 0.8. llama.cpp (temperature last): top-p keeps 0.4, 0.3, 0.2 (mass
    0.9), then p^2 renormalized: (0, 0.04, 0.09, 0.16) / 0.29. transformers (temperature first): p^2 / 0.30, whose
    top-p 0.8 keeps 0.16 / 0.30 and 0.09 / 0.30 only."""
    fields = dict(temperature=0.5, top_p=0.8)
    llama = llamacpp(P4, **fields).probs()
    hf = dist_stages(ChainSettings(semantics="hf", **fields, top_k=0), given_logits(dist=P4), []).probs()
    assert llama == pytest.approx([0, 0.04 / 0.29, 0.09 / 0.29, 0.16 / 0.29], abs=1e-5)
    assert hf == pytest.approx([0, 0, 0.09 / 0.25, 0.16 / 0.25], abs=1e-5)


# --- where llama.cpp misbehaves: decodelab's rule kept, and said in semantics.notes -------------------------------


def test_llamacpp_typical_with_a_removed_candidate_keeps_decodelabs_rule_and_says_so():
    """p = (0.97, 0.01, 0.01, 0.01, 0): llama.cpp's entropy is NaN (0 x log 0) and its typical stage keeps all four
    live tokens; decodelab's (0 log 0 = 0) keeps the one typical token, and the plan names the difference."""
    assert llamacpp("0.97,0.01,0.01,0.01,0", typical_p=0.5).probs() == pytest.approx([1, 0, 0, 0, 0])
    notes = plan(ChainSettings(semantics="llamacpp", typical_p=0.5)).notes
    assert [n for n in notes if n.startswith("typical_p:")] == [
        "typical_p: llama.cpp's typical sampling does nothing once a candidate is at -inf (its entropy takes "
        "0 x log 0 = NaN); decodelab keeps its rule (0 log 0 = 0, removed candidates ranked last)"]
    # mirostat drops typical-p in llama.cpp: no note about a stage that does not run
    assert not any(n.startswith("typical_p:") for n in plan(ChainSettings(semantics="llamacpp", typical_p=0.5,
                                                                          mirostat_tau=5.0)).notes)
    assert not any(n.startswith(("typical_p:", "dynatemp:")) for n in plan(ChainSettings(semantics="llamacpp")).notes)


def test_llamacpp_dynamic_temperature_normalizes_by_the_candidates_left_and_says_so():
    """p = (0.7, 0.3, 0), t = 1, r = 0.5, e = 1: H = 0.6109 nats over the two live tokens; decodelab normalizes by
    log 2 (T = 0.5 + 0.8813 = 1.3813), llama.cpp by log 3, the removed token counted (T = 1.0560)."""
    h = -(0.7 * math.log(0.7) + 0.3 * math.log(0.3))
    t = 0.5 + h / math.log(2)
    got = llamacpp("0.7,0.3,0", temperature=1.0, dynatemp_range=0.5, dynatemp_exponent=1.0).probs()
    assert got == pytest.approx(softmax_of([math.log(0.7) / t, math.log(0.3) / t, -math.inf]), abs=1e-6)
    notes = plan(ChainSettings(semantics="llamacpp", temperature=1.0, dynatemp_range=0.5)).notes
    assert any(n.startswith("dynatemp: llama.cpp normalizes the entropy by log of every candidate") for n in notes)


# --- exact edges the mutation run (tests/mutation/run.sh, core/sampling/semantics.py) showed no test pinned ----------


def chain_probs(settings: ChainSettings, logits, history=(), prompt_len: int = 0) -> list[float]:
    """softmax of ``settings``' chain (as its semantics reads it) on raw logits ``z`` after ``history``, whose first
    ``prompt_len`` ids are the prompt (the rest generated: what an output-only penalty counts)."""
    _, chain = chain_for(settings, Tokens(len(logits)))
    chain.reset(prompt_len)
    ids = torch.tensor([list(history)], dtype=torch.long).reshape(1, len(history))
    return torch.softmax(chain.apply(ids, torch.tensor([logits], dtype=torch.float32)), -1)[0].tolist()


VLLM_OUTPUT_ONLY = "frequency and presence penalties count generated tokens only; repetition counts the prompt too"


@pytest.mark.parametrize("temperature, users, vllms", [
    # z = (1, -0.3), token 0 generated once, presence 1 and repetition 2. The user's order (presence, then
    # repetition): z_0 = (1 - 1) = 0, and 0 stays 0 under the penalty; vLLM's (repetition, then presence):
    # z_0 = 1 / 2 - 1 = -0.5. Greedy: 0 > -0.3 picks token 0, vLLM's order token 1.
    (0.0, [1.0, 0.0], [0.0, 1.0]),
    (1.0, softmax_of([0.0, -0.3]), softmax_of([-0.5, -0.3])),
])
def test_vllm_runs_the_users_chain_greedy_or_sampled(temperature, users, vllms):
    fields = dict(semantics="vllm", temperature=temperature, presence_penalty=1.0, repetition_penalty=2.0)
    user = ChainSettings(**fields, chain=("presence-penalty", "repetition-penalty", "temperature"))
    assert chain_probs(user, [1.0, -0.3], [0]) == pytest.approx(users, abs=1e-6)
    assert "order from --chain, not vLLM's" in plan(user).notes
    assert chain_probs(ChainSettings(**fields), [1.0, -0.3], [0]) == pytest.approx(vllms, abs=1e-6)


def test_vllm_greedy_takes_the_argmax_after_the_allowed_ids_whatever_the_chain():
    """z = (1, 0), allowed ids {1}, temperature 0 written first in --chain: vLLM's greedy takes the arg-max after
    every logits processor, so token 1 (the arg-max first would keep token 0 only, which allow then removes)."""
    s = ChainSettings(semantics="vllm", temperature=0.0, allow=("1",), chain=("temperature", "allow"))
    assert chain_probs(s, [1.0, 0.0]) == [0.0, 1.0]
    p = plan(s)
    assert isinstance(p.make_selector(0, "cpu"), Greedy) and p.describe()["selector"] == "greedy"


def test_vllm_greedy_notes_and_off_values():
    """Greedy drops the warpers (noted by name), switches off what vLLM reads as off (repetition 1, presence 0:
    no stage runs), and keeps a stage vLLM lacks at decodelab's position, noted."""
    p = plan(ChainSettings(semantics="vllm", temperature=0.0, top_p=0.9, top_k=5, dry_multiplier=0.8,
                           repetition_penalty=1.0, presence_penalty=0.0))
    assert p.notes == ["temperature, top-k, top-p: vLLM's greedy takes the arg-max before temperature and the filters",
                       "vLLM has no dry: kept at decodelab's position", VLLM_OUTPUT_ONLY]
    assert p.describe()["chain"] == ["dry", "temperature"]


def test_vllm_raises_only_a_temperature_below_0_01():
    assert plan(ChainSettings(semantics="vllm", temperature=0.005)).notes == [
        "temperature 0.005: vLLM raises a temperature in (0, 0.01) to 0.01 (only 0 is greedy)", VLLM_OUTPUT_ONLY]
    assert plan(ChainSettings(semantics="vllm", temperature=0.01)).notes == [VLLM_OUTPUT_ONLY]


def test_vllm_penalties_ignore_the_window_and_count_as_vllm_does():
    """Repetition 2, window 1, z = (1, 1), history (0, 1): vLLM counts the whole sequence, so both tokens are
    penalized, z = (0.5, 0.5); decodelab's own window sees token 1 only, z = (1, 0.5)."""
    fields = dict(repetition_penalty=2.0, penalty_last_n=1, temperature=1.0)
    vllm = ChainSettings(semantics="vllm", **fields)
    assert chain_probs(vllm, [1.0, 1.0], [0, 1]) == pytest.approx([0.5, 0.5], abs=1e-6)
    assert chain_probs(ChainSettings(**fields), [1.0, 1.0], [0, 1]) == pytest.approx(softmax_of([1.0, 0.5]))
    assert plan(vllm).notes == ["penalty_last_n: vLLM's penalties count the whole sequence; window ignored",
                                VLLM_OUTPUT_ONLY]
    assert plan(vllm).settings.penalty_last_n is None


@pytest.mark.parametrize("field, native", [
    # z = 0, history (0, 0 | 1): the prompt is (0, 0), the output (1). vLLM's frequency 1 counts the output, z_1 -= 1;
    # decodelab's own counts all three tokens, z_0 -= 2, z_1 -= 1. Presence 1: vLLM z_1 -= 1; decodelab's z_0, z_1 -= 1.
    ("frequency_penalty", [-2.0, -1.0, 0.0]),
    ("presence_penalty", [-1.0, -1.0, 0.0]),
])
def test_vllm_frequency_and_presence_count_the_output_only(field, native):
    fields = {field: 1.0, "temperature": 1.0}
    got = chain_probs(ChainSettings(semantics="vllm", **fields), [0.0] * 3, [0, 0, 1], prompt_len=2)
    assert got == pytest.approx(softmax_of([0.0, -1.0, 0.0]), abs=1e-6)
    assert chain_probs(ChainSettings(**fields), [0.0] * 3, [0, 0, 1], prompt_len=2) == pytest.approx(
        softmax_of(native), abs=1e-6)


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_vllm_penalty_ranges_are_closed(field):
    for value in (-2.0, 2.0):
        plan(ChainSettings(semantics="vllm", **{field: value}))
    option = "--" + field.replace("_", "-")
    for value in (-2.5, 2.5):
        with pytest.raises(ConfigError, match=rf"^{option} {value}: vLLM allows \[-2, 2\]$"):
            plan(ChainSettings(semantics="vllm", **{field: value}))


def test_vllm_top_k_allows_minus_one_and_refuses_below():
    assert "top-k" not in plan(ChainSettings(semantics="vllm", temperature=1.0, top_k=-1)).order
    with pytest.raises(ConfigError, match=r"^--top-k -2: vLLM allows -1, 0 \(off\) or >= 1$"):
        plan(ChainSettings(semantics="vllm", top_k=-2))


def test_hf_greedy_names_every_warper_it_drops():
    """-t 0 under transformers is greedy: the warpers set are noted by name, temperature included even where
    dynatemp takes it as its centre (it is then no stage of its own)."""
    p = plan(ChainSettings(semantics="hf", temperature=0.0, dynatemp_range=0.5))
    assert p.notes == ["temperature, dynatemp: not applied by transformers when do_sample=False"] and p.order == []
    p = plan(ChainSettings(semantics="hf", temperature=0.0, top_p=0.9, top_k=5))
    assert p.notes == ["temperature, top-k, top-p: not applied by transformers when do_sample=False"]


def test_llamacpp_notes_the_defaults_of_the_stages_that_run():
    """llama.cpp's common_params_sampling: temp 0.8, top_k 40, top_p 0.95, min_p 0.05, penalty_last_n 64; DRY's
    base 1.75, allowed length 2, window 64 are noted only once DRY runs (XTC's and mirostat's never here)."""
    assert plan(ChainSettings(semantics="llamacpp")).notes == [
        "llama.cpp defaults: temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, penalty_last_n=64"]
    assert plan(ChainSettings(semantics="llamacpp", dry_multiplier=0.5)).notes == [
        "llama.cpp defaults: dry_base=1.75, dry_allowed_length=2, dry_penalty_last_n=64, temperature=0.8, top_k=40, "
        "top_p=0.95, min_p=0.05, penalty_last_n=64"]


def test_llamacpp_negative_window_message_is_whole():
    with pytest.raises(ConfigError) as err:
        plan(ChainSettings(semantics="llamacpp", dry_multiplier=1.0, dry_penalty_last_n=-1))
    assert str(err.value) == ("--dry-penalty-last-n -1: llama-cli refuses a negative window (its library reads -1 as "
                              "0, off); give 0 (off) or N >= 1 tokens")


def test_llamacpp_reads_a_negative_temperature_as_greedy():
    """llama-cli clamps -t below 0 to 0: greedy, the arg-max of p = (0.1, 0.2, 0.3, 0.4) (-t 1 would keep the
    distribution, llama.cpp's temperature 1 being off)."""
    p = plan(ChainSettings(semantics="llamacpp", **{**NEUTRAL, "temperature": -0.5}))
    assert p.settings.temperature == 0.0 and p.selector == "greedy"
    assert llamacpp(P4, temperature=-0.5).probs() == pytest.approx([0, 0, 0, 1])


@pytest.mark.parametrize("base", [1.0, 1.5])
def test_llamacpp_keeps_a_dry_base_of_one_or_more(base):
    """Only a base below 1 is replaced by 1.75: the repeat "0 1 2 0 1" (n = 5, allowed length 2) is followed by
    2, z_2 -= 1 * base^(5 - 2) with the base as given."""
    history = (0, 1, 2, 0, 1, 2, 0, 1)
    got = llamacpp(U4, history, dry_multiplier=1.0, dry_base=base, dry_allowed_length=2, dry_penalty_last_n=8)
    assert got.probs() == pytest.approx(softmax_of([0, 0, -base ** 3, 0]))
    assert not any(n.startswith("dry_base") for n in plan(ChainSettings(semantics="llamacpp", dry_multiplier=1.0,
                                                                         dry_base=base)).notes)


def test_llamacpp_dry_base_note_names_the_base_it_keeps_and_only_when_dry_runs():
    notes = plan(ChainSettings(semantics="llamacpp", dry_multiplier=1.0, dry_base=0.5)).notes
    assert "dry_base 0.5: llama.cpp ignores a DRY base below 1 and keeps 1.75" in notes
    assert not any(n.startswith("dry_base") for n in plan(ChainSettings(semantics="llamacpp", dry_base=0.5)).notes)


def test_llamacpp_export_writes_the_dry_window_once():
    """DRY's window is one flag: N as given (it was also written a second time among the stage's values)."""
    flags = export(SampleSettings(temperature=0.7, dry_multiplier=0.8, dry_penalty_last_n=16), "llamacpp", 100).arguments
    assert flags.count("--dry-penalty-last-n") == 1 and flags[flags.index("--dry-penalty-last-n") + 1] == "16"


def test_llamacpp_export_of_a_greedy_plan_lists_the_temperature_sampler():
    """llama.cpp's common_sampler_init adds only the --samplers listed, then its draw (dist): --temp 0 makes the
    run greedy only through the temperature sampler (temp_ext at t <= 0 keeps the arg-max). transformers' greedy
    (no -t) has no temperature stage, so the export must list it (it wrote `--samplers penalties`, and llama.cpp
    then sampled)."""
    flags = export(SampleSettings(semantics="hf", repetition_penalty=1.3, max_new_tokens=4), "llamacpp", 100).arguments
    assert flags[flags.index("--temp") + 1] == "0"
    assert flags[flags.index("--samplers") + 1] == "penalties;temperature"


# the exported llama-cli lines, flag by flag (llama.cpp common/arg.cpp names; --logit-bias TOKEN(+|-)BIAS)

def test_llamacpp_export_writes_the_whole_line():
    """Every llama.cpp default stage switched off where decodelab has it off (top-k 0, top-p 1, min-p 0), the
    penalties with their window, DRY with its defaults filled, its window and breakers, each bias with its sign
    (a bias of 0 is +0, -inf written as such), decodelab's order in --samplers, then the run settings."""
    s = SampleSettings(temperature=0.7, repetition_penalty=1.1, frequency_penalty=0.2, penalty_last_n=32,
                       dry_multiplier=0.8, dry_penalty_last_n=16, dry_breaker=("7", "8 9"),
                       logit_bias=(("3", 1.5), ("4", -2.0), ("5", -math.inf), ("6", 0.0)), seed=7, max_new_tokens=5,
                       stop=("END",), ignore_eos=True, stop_id=(9,))
    out = export(s, "llamacpp", 100)
    assert out.arguments == [
        "--temp", "0.7", "--top-k", "0", "--top-p", "1", "--min-p", "0", "--repeat-penalty", "1.1",
        "--frequency-penalty", "0.2", "--dry-multiplier", "0.8", "--dry-base", "1.75", "--dry-allowed-length", "2",
        "--repeat-last-n", "32", "--dry-penalty-last-n", "16", "--dry-sequence-breaker", "7",
        "--dry-sequence-breaker", "8 9", "--logit-bias", "3+1.5", "--logit-bias", "4-2", "--logit-bias", "5-inf",
        "--logit-bias", "6+0", "--samplers", "penalties;dry;temperature", "--seed", "7", "-n", "5",
        "--reverse-prompt", "END", "--ignore-eos"]
    assert out.unsupported == ["stop-id: llama.cpp stops on the model's end-of-generation tokens only"]
    assert out.notes == ["llama.cpp draws with its own RNG (std::mt19937): the same law, not the same tokens"]
    assert out.to_dict() == {"export": "llamacpp", "arguments": out.arguments, "unsupported": out.unsupported,
                             "notes": out.notes, "command": out.command()}
    assert out.command().startswith("llama-cli --temp 0.7 --top-k 0 ") and "'8 9'" in out.command()


def test_hf_export_document_has_no_command():
    out = export(SampleSettings(temperature=0.0), "hf", 100)
    assert out.to_dict() == {"export": "hf", "arguments": out.arguments, "unsupported": [], "notes": []}
    assert out.command() is None


def test_llamacpp_export_of_transformers_greedy_writes_temperature_zero():
    """--semantics hf without -t is greedy with no temperature stage: --temp 0 (1 would be llama.cpp's "off")."""
    out = export(SampleSettings(semantics="hf", top_k=5, max_new_tokens=4, seed=3), "llamacpp", 100)
    assert out.arguments == ["--temp", "0", "--top-k", "0", "--top-p", "1", "--min-p", "0", "--samplers",
                             "temperature", "--seed", "3", "-n", "4"]
    assert out.notes == [] and out.unsupported == []


def test_llamacpp_export_of_mirostat_and_of_vllms_output_only_penalties():
    m = export(SampleSettings(temperature=0.7, mirostat_eta=0.2, max_new_tokens=4), "llamacpp", 100)
    assert m.arguments == ["--temp", "0.7", "--top-k", "0", "--top-p", "1", "--min-p", "0", "--mirostat-ent", "5",
                           "--mirostat-lr", "0.2", "--mirostat", "2", "--samplers", "temperature", "--seed", "0",
                           "-n", "4"]
    assert m.notes == ["with --mirostat llama.cpp runs only logit bias, temperature and mirostat",
                       "llama.cpp draws with its own RNG (std::mt19937): the same law, not the same tokens"]
    s = SampleSettings(semantics="vllm", temperature=0.7, presence_penalty=0.5, max_new_tokens=4)
    v = export(s, "llamacpp", 100, context=256)
    assert v.arguments[8:12] == ["--presence-penalty", "0.5", "--repeat-last-n", "256"]
    assert v.notes[:2] == ["penalties over every token: written as the model's context, 256 (llama-cli refuses -1)",
                           "llama.cpp's penalties count prompt and output; decodelab counted the output only"]
    unknown = export(s, "llamacpp", 100)
    assert "--repeat-last-n" not in unknown.arguments
    assert unknown.unsupported == ["penalties over every token: llama-cli refuses -1; give a window of at least the "
                                   "prompt plus -n tokens"]


def test_gbnf_string_escapes_backslash_quote_and_control_characters():
    """GBNF literals (llama.cpp grammars/README.md): \\\\, \\", \\n, \\r, \\t inside double quotes."""
    assert _gbnf_string('a\\b"c\nd\re\tf') == '"a\\\\b\\"c\\nd\\re\\tf"'


def test_exports_name_the_penalty_counting_of_the_penalties_that_run():
    """llama.cpp's reading counts every penalty over the last 64 tokens: vLLM (whole sequence) cannot say that, and
    the export says so (it said nothing). With no penalty on, transformers has nothing to object to (the window
    was reported unsupported), and vLLM's repetition penalty alone counts the prompt too (the llama.cpp line
    once said decodelab counted the output only)."""
    window = export(SampleSettings(semantics="llamacpp", temperature=0.7, repetition_penalty=1.3), "vllm", 100)
    assert window.unsupported == ["penalty_last_n: vLLM's penalties count the whole sequence"]
    assert export(SampleSettings(semantics="llamacpp", temperature=0.7), "hf", 100).unsupported == []
    assert export(SampleSettings(temperature=0.7, penalty_last_n=8), "hf", 100).unsupported == []
    hf = export(SampleSettings(temperature=0.7, penalty_last_n=8, repetition_penalty=1.2), "hf", 100)
    assert hf.unsupported == ["penalty window / output-only counting: transformers counts the whole sequence"]
    line = export(SampleSettings(semantics="vllm", temperature=0.7, repetition_penalty=1.2), "llamacpp", 100,
                  context=256)
    assert not any("output only" in n for n in line.notes)
    assert any("output only" in n for n in export(SampleSettings(semantics="vllm", temperature=0.7,
                                                                 frequency_penalty=0.5), "llamacpp", 100).notes)


@pytest.mark.parametrize("field, value", [("repetition_penalty", 50.0), ("frequency_penalty", 5.0),
                                          ("presence_penalty", 5.0)])
def test_llamacpp_window_zero_switches_each_penalty_off(field, value):
    """llama_sampler_init_penalties with penalty_last_n 0 is a no-op: token 0 seen, p stays uniform (the window of
    the test vectors above, 5, cuts p_0 to ~0)."""
    assert llamacpp(U5, (0,), penalty_last_n=0, **{field: value}).probs() == pytest.approx([0.2] * 5)
    assert field.replace("_", "-") not in plan(ChainSettings(semantics="llamacpp", penalty_last_n=0,
                                                             **{field: value})).order


def test_llamacpp_selector_is_greedy_only_at_temperature_zero_without_a_range():
    assert plan(ChainSettings(semantics="llamacpp")).selector == "multinomial"  # the default temperature 0.8
    assert plan(ChainSettings(semantics="llamacpp", temperature=0.0)).selector == "greedy"
    # t = 0 with a range runs T over [0, r]: a draw (the dynamic temperature test above works its law)
    assert plan(ChainSettings(semantics="llamacpp", temperature=0.0, dynatemp_range=0.5)).selector == "multinomial"


def test_llamacpp_top_p_zero_and_mirostat_notes():
    p = plan(ChainSettings(semantics="llamacpp", **{**NEUTRAL, "top_p": 0.0}))
    assert "top_p <= 0: llama.cpp keeps the most likely token (as top-k 1)" in p.notes and p.settings.top_k == 1
    m = plan(ChainSettings(semantics="llamacpp", mirostat_tau=4.0, top_k=10, repetition_penalty=1.3))
    assert ("repetition-penalty, top-k, top-p, min-p: ignored by llama.cpp when mirostat is on (its chain is logit "
            "bias, temperature, mirostat)") in m.notes
    assert not any(n.startswith("penalties count") for n in m.notes), "mirostat dropped the penalty: no window"
    kept = plan(ChainSettings(semantics="llamacpp", repetition_penalty=1.3))
    assert "penalties count prompt and output, the last 64 tokens" in kept.notes


def test_llamacpp_export_of_dynamic_temperature_writes_its_centre():
    """--dynatemp-range needs --temp, its centre, although dynatemp replaces the temperature stage; no other stage's
    flag (XTC's, DRY's off-values) is written with it."""
    flags = export(SampleSettings(temperature=0.7, dynatemp_range=0.5, max_new_tokens=4), "llamacpp", 100).arguments
    assert flags == ["--temp", "0.7", "--top-k", "0", "--top-p", "1", "--min-p", "0", "--dynatemp-range", "0.5",
                     "--dynatemp-exp", "1", "--samplers", "temperature", "--seed", "0", "-n", "4"]


def test_llamacpp_export_of_constraints_word_for_word(tmp_path):
    """--json-schema takes the schema on one line (compact JSON); a Lark grammar or a regex is named unsupported."""
    schema, lark = tmp_path / "s.json", tmp_path / "g.lark"
    schema.write_text('{"type": "object", "required": ["a"]}', encoding="utf-8")
    lark.write_text('start: "a"+\n', encoding="utf-8")
    flags = export(ChainSettings(json_schema=str(schema)), "llamacpp", 10).arguments
    assert flags[-2:] == ["--json-schema", '{"type":"object","required":["a"]}']
    assert export(ChainSettings(regex="a+"), "llamacpp", 10).unsupported == [
        "--regex 'a+': a regex (llama.cpp has none)"]
    assert [u.partition(": ")[2] for u in export(ChainSettings(grammar=str(lark)), "llamacpp", 10).unsupported] == [
        "a Lark grammar (llama.cpp reads GBNF)"]


def test_hf_export_of_ignore_eos_bans_the_end_for_every_token():
    out = export(SampleSettings(temperature=0.0, ignore_eos=True, max_new_tokens=5), "hf", 100)
    assert out.arguments["min_new_tokens"] == out.arguments["max_new_tokens"] == 5
    assert out.notes == ["ignore_eos: transformers has no such flag; min_new_tokens = max_new_tokens bans EOS"]


def test_vllm_export_writes_every_request_field():
    """SamplingParams keyword by keyword: the seven sampling fields (off-values where decodelab is off), min_tokens,
    logit_bias with -inf as -100, the allowed ids once each and sorted, the bans, the run settings; the stop string
    kept in the text (decodelab's default), and what vLLM reads differently noted."""
    s = SampleSettings(temperature=0.7, top_p=0.9, logit_bias=(("3", 1.5), ("5", -math.inf)),
                       allow=("5", "2", "2", "3", "1"), ban=("4",), seed=3, max_new_tokens=6, stop=("END",),
                       stop_id=(9,), ignore_eos=True, presence_penalty=0.5, min_new_tokens=2)
    out = export(s, "vllm", 100)
    assert out.arguments == {
        "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.5, "min_tokens": 2,
        "temperature": 0.7, "top_k": 0, "top_p": 0.9, "min_p": 0.0, "logit_bias": {3: 1.5, 5: -100.0},
        "allowed_token_ids": [1, 2, 3, 5], "bad_words": ["4"], "seed": 3, "max_tokens": 6, "stop": ["END"],
        "include_stop_str_in_output": True, "stop_token_ids": [9], "ignore_eos": True}
    assert out.unsupported == []
    assert out.notes[1:] == ["vLLM's presence and frequency penalties count generated tokens only; decodelab "
                             "counted the prompt too",
                             "logit_bias -inf written as -100 (the OpenAI-compatible range is [-100, 100])"]
    assert out.notes[0].startswith("order differs: decodelab runs presence-penalty before ban, vLLM the other way")
    trimmed = export(SampleSettings(semantics="vllm", temperature=0.7, stop=("x",)), "vllm", 100)
    assert trimmed.arguments["include_stop_str_in_output"] is False and trimmed.notes == []
    plain = export(ChainSettings(temperature=0.7, top_k=5), "vllm", 100)  # no run settings: no seed, no max_tokens
    assert plain.arguments == {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                               "temperature": 0.7, "top_k": 5, "top_p": 1.0, "min_p": 0.0}


def test_hf_plan_document():
    """transformers samples with top_k 50 unless told, ignores a penalty window, has softcap only as a model
    property, logs the processed scores and keeps a stop string in the text."""
    p = plan(ChainSettings(semantics="hf", temperature=0.7, repetition_penalty=1.2, penalty_last_n=4, softcap=30.0))
    assert p.describe() == {
        "engine": "hf", "chain": ["softcap", "repetition-penalty", "temperature", "top-k"], "selector": "hf-multinomial",
        "logprobs": "processed", "counting": {}, "trim_stop": False,
        "notes": ["top_k=50: transformers' default when sampling",
                  "penalty_last_n: transformers' penalties count the whole sequence; window ignored",
                  "softcap: in transformers a model property (final_logit_softcapping), not a processor",
                  "transformers has no softcap: kept at decodelab's position"]}
    assert p.settings.penalty_last_n is None
    assert plan(ChainSettings(semantics="hf", repetition_penalty=1.2)).notes == [
        "no temperature: transformers decodes greedily unless do_sample=True (give -t T > 0)"]
    assert plan(ChainSettings(semantics="hf", temperature=1e-9)).selector == "hf-multinomial"  # any T > 0 samples


def test_hf_penalty_ignores_the_window():
    """Repetition 2, window 1, z = (1, 1), history (0, 1): transformers penalizes both tokens, z = (0.5, 0.5)."""
    s = ChainSettings(semantics="hf", repetition_penalty=2.0, penalty_last_n=1, temperature=1.0, top_k=0)
    assert chain_probs(s, [1.0, 1.0], [0, 1]) == pytest.approx([0.5, 0.5], abs=1e-6)


def test_hf_runs_the_users_chain():
    """p = (0.1, 0.2, 0.3, 0.4), T = 0.5, top-p 0.8 with --chain top-p,temperature: top-p keeps 0.4, 0.3, 0.2 first,
    then p^2 renormalized (transformers' own order keeps two tokens: the test of engine orders above)."""
    s = ChainSettings(semantics="hf", temperature=0.5, top_p=0.8, top_k=0, chain=("top-p", "temperature"))
    assert dist_stages(s, given_logits(dist=P4), []).probs() == pytest.approx(
        [0, 0.04 / 0.29, 0.09 / 0.29, 0.16 / 0.29], abs=1e-5)
    assert "order from --chain, not transformers'" in plan(s).notes


def test_llamacpp_plan_document():
    """llama.cpp reports the raw softmax (n_probs), counts penalties over prompt and output in the last 64 tokens
    and leaves a reverse prompt out of the text, so its reading exported to vLLM trims the stop string."""
    p = plan(ChainSettings(semantics="llamacpp", repetition_penalty=1.1, temperature=0.0))
    d = p.describe()
    assert (d["engine"], d["selector"], d["logprobs"], d["trim_stop"]) == ("llamacpp", "greedy", "raw", True)
    assert d["counting"] == {name: {"scope": "all", "last_n": 64} for name in
                             ("repetition-penalty", "frequency-penalty", "presence-penalty")}
    out = export(SampleSettings(semantics="llamacpp", temperature=0.7, stop=("x",)), "vllm", 100)
    assert out.arguments["include_stop_str_in_output"] is False


def test_the_plans_draw_is_the_seeded_exponential_race():
    """decodelab's selector draws argmax_i z_i - log E_i with E ~ Exp(1) from the run's seeded generator: the same
    seed gives the same tokens (recomputed here from make_generator), whatever else used torch's global stream."""
    z = torch.zeros(1, 1000)
    picks = []
    for _ in range(2):
        selector = plan(ChainSettings(temperature=1.0)).make_selector(5, "cpu")
        torch.rand(3)  # the global stream moves between the two runs
        picks.append([int(selector.from_logits(z)[0]) for _ in range(4)])
    gen = make_generator(5, "cpu")
    race = [int((z - torch.empty(1, 1000).exponential_(1.0, generator=gen).log()).argmax(-1)[0]) for _ in range(4)]
    assert picks[0] == picks[1] == race


def test_transformers_has_no_constraint_stage_noted_once():
    """The constraint's placement has its own note; it is not also listed among the stages transformers lacks."""
    notes = plan(ChainSettings(semantics="hf", temperature=0.7, regex="a+")).notes
    assert [n for n in notes if "constraint" in n] == [
        "constraint: transformers has no grammar stage (a prefix_allowed_tokens_fn or a logits processor runs where it "
        "is placed); kept at decodelab's position, first after allow"]


def test_hf_export_writes_the_generate_call():
    """A -inf sequence bias is a bad word, the others stay sequence biases (a logit bias is a one-token sequence
    bias); stop strings need the tokenizer; a seed is a manual_seed note, and decodelab's own race a second one.
    Under --semantics hf the draw is transformers' own: only the seed note."""
    s = SampleSettings(temperature=0.7, repetition_penalty=1.2, sequence_bias=(("3 4", 1.0), ("5", -math.inf)),
                       logit_bias=(("6", -2.0),), allow=("1", "2"), seed=3, max_new_tokens=6, stop=("END",))
    out = export(s, "hf", 100)
    assert out.arguments == {
        "do_sample": True, "repetition_penalty": 1.2, "temperature": 0.7, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
        "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "sequence_bias": [[[6], -2.0], [[3, 4], 1.0]],
        "bad_words_ids": [[5]], "max_new_tokens": 6, "stop_strings": ["END"]}
    assert out.unsupported == ["allow: transformers takes a prefix_allowed_tokens_fn callable, not a list"]
    assert out.notes[1:] == [
        "stop_strings needs generate(..., tokenizer=tokenizer); the stop string stays in the text",
        "call torch.manual_seed(3) right before generate; with --semantics hf decodelab then draws the same tokens",
        "decodelab's draw (exponential race) follows the same law as torch.multinomial but not the same stream: use "
        "--semantics hf for the same tokens"]
    own = export(SampleSettings(semantics="hf", temperature=0.7, seed=3, max_new_tokens=6), "hf", 100)
    assert own.notes == ["call torch.manual_seed(3) right before generate; with --semantics hf decodelab then draws "
                         "the same tokens"] and own.unsupported == []
    assert export(SampleSettings(temperature=0.0, seed=3), "hf", 100).notes == []  # greedy: no seed to set


def test_decodelabs_own_plan_runs_the_users_chain():
    """Without --semantics, --chain top-p,temperature on p = (0.1, 0.2, 0.3, 0.4), T = 0.5, top-p 0.8: top-p keeps
    0.4, 0.3, 0.2, then p^2 renormalized; the default order (temperature first) keeps 0.16 / 0.30, 0.09 / 0.30."""
    fields = dict(temperature=0.5, top_p=0.8)
    chained = dist_stages(ChainSettings(**fields, chain=("top-p", "temperature")), given_logits(dist=P4), [])
    assert chained.probs() == pytest.approx([0, 0.04 / 0.29, 0.09 / 0.29, 0.16 / 0.29], abs=1e-5)
    default = dist_stages(ChainSettings(**fields), given_logits(dist=P4), [])
    assert default.probs() == pytest.approx([0, 0, 0.09 / 0.25, 0.16 / 0.25], abs=1e-5)
    assert plan(ChainSettings(**fields)).describe()["engine"] == "decodelab"
    assert plan(ChainSettings(**fields)).describe()["selector"] == "multinomial"


def test_hf_export_of_vllms_output_only_counting():
    out = export(SampleSettings(semantics="vllm", temperature=0.7, presence_penalty=0.5), "hf", 100)
    assert out.unsupported == ["presence-penalty: transformers has no such stage",
                               "penalty window / output-only counting: transformers counts the whole sequence"]


def test_exports_write_the_constraint_once_and_whole(tmp_path):
    """The constraint is one argument: vLLM's structured_outputs (a keyword SamplingParams takes; the registry's
    "structured_outputs.regex" names a field of it, no keyword of its own), llama-cli's --json-schema with the
    schema's text (it parses the value as JSON at once: a path written before it stopped the command)."""
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "string"}', encoding="utf-8")
    for s in (ChainSettings(regex="a+"), ChainSettings(json_schema=str(schema)), ChainSettings(choice="yes,no")):
        assert [k for k in export(s, "vllm", 10).arguments if k.startswith("structured")] == ["structured_outputs"]
    flags = export(ChainSettings(json_schema=str(schema)), "llamacpp", 10).arguments
    assert flags.count("--json-schema") == 1 and flags[-2:] == ["--json-schema", '{"type":"string"}']
    flags = export(ChainSettings(choice="yes,no"), "llamacpp", 10).arguments
    assert flags.count("--grammar") == 1 and flags[-2:] == ["--grammar", 'root ::= "yes" | "no"']


def test_export_notes_the_first_order_difference_except_for_llamacpp():
    """vLLM runs min-p before top-k (decodelab the other way): noted at the first place the orders part. llama.cpp
    is given decodelab's order in --samplers, so nothing to note."""
    assert export(ChainSettings(temperature=0.7, top_k=5, min_p=0.1), "vllm", 10).notes == [
        "order differs: decodelab runs top-k before min-p, vLLM the other way round (results differ when both "
        "change logits)"]
    line = export(ChainSettings(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.2,
                                logit_bias=(("1", 1.0),)), "llamacpp", 10)
    assert line.notes == ["llama.cpp draws with its own RNG (std::mt19937): the same law, not the same tokens"]
    assert export(ChainSettings(temperature=0.7, dry_multiplier=0.5), "hf", 10).unsupported == [
        "dry: transformers has no such stage"]
    with pytest.raises(ConfigError) as err:
        export(ChainSettings(), "tgi", 10)
    assert str(err.value) == "--export 'tgi': allowed: hf, vllm, llamacpp"


def test_greedy_exports_leave_the_warpers_out_or_off():
    """Greedy: transformers' do_sample False ignores the warpers (none written); vLLM's temperature 0 with top-p,
    top-k and min-p at their off-values."""
    s = SampleSettings(temperature=0.0, repetition_penalty=1.3, top_p=0.9)
    assert export(s, "hf", 10).arguments == {"do_sample": False, "repetition_penalty": 1.3, "max_new_tokens": 64}
    assert export(s, "vllm", 10).arguments == {
        "repetition_penalty": 1.3, "frequency_penalty": 0.0, "presence_penalty": 0.0, "top_p": 1.0, "top_k": 0,
        "min_p": 0.0, "temperature": 0.0, "seed": 0, "max_tokens": 64}


def test_unknown_semantics_message_lists_the_engines():
    with pytest.raises(ConfigError) as err:
        plan(ChainSettings(semantics="ollama"))
    assert str(err.value) == "--semantics 'ollama': allowed: hf, vllm, llamacpp"


def test_vllm_export_follows_trim_stop_when_given():
    """--trim-stop overrides the plan's default (decodelab keeps a stop string, vLLM's reading trims it)."""
    trimmed = export(SampleSettings(temperature=0.7, stop=("x",), trim_stop=True), "vllm", 100)
    assert trimmed.arguments["include_stop_str_in_output"] is False
    kept = export(SampleSettings(semantics="vllm", temperature=0.7, stop=("x",), trim_stop=False), "vllm", 100)
    assert kept.arguments["include_stop_str_in_output"] is True


def test_vllm_export_of_a_grammar_names_the_backends(tmp_path):
    gbnf = tmp_path / "g.gbnf"
    gbnf.write_text('root ::= "a"+\n', encoding="utf-8")
    out = export(ChainSettings(grammar=str(gbnf)), "vllm", 10)
    assert out.arguments["structured_outputs"] == {"grammar": 'root ::= "a"+\n'}
    assert out.notes == ["structured_outputs grammar: vLLM's xgrammar backend reads GBNF/EBNF, its guidance backend "
                         "Lark; decodelab read it with llguidance"]
    assert export(ChainSettings(regex="a+"), "vllm", 10).notes == []
