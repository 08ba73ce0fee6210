"""check-sampler: the statistics against closed forms and their false-alarm rate, then negative controls: a fake
vLLM whose sampler has a known defect is caught and named, the exact one passes (fixed seeds: deterministic)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from decodelab.core.analysis import sampler_check as sc
from decodelab.core.engine.models import load_model
from decodelab.core.methods.sample import SampleSettings
from decodelab.core.methods.served import connect

PROMPT = "Once upon a time"


def draws_of(law: torch.Tensor, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.multinomial(law.double(), n, replacement=True, generator=g).tolist()


def counts_of(draws: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(draws), minlength=vocab)


# ---------------------------------------------------------------------------------------------------------------
# the statistics


def test_p_value_matches_the_closed_forms_of_one_and_two_degrees_of_freedom():
    for x in (0.0, 0.3, 1.0, 4.0, 11.5):
        assert sc.p_value(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-12)  # chi2_2 is Exp(1/2)
        assert sc.p_value(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-10, abs=1e-15)
    assert sc.p_value(3.0, 0) == 1.0 and sc.p_value(math.inf, 5) == 0.0


def test_chi_square_by_hand_with_the_pooling_rule():
    # N = 100: expected 50, 30, 12, 4, 3, 1 -> the last three (E < 5) pool into one cell of E = 8
    probs = torch.tensor([0.5, 0.3, 0.12, 0.04, 0.03, 0.01, 0.0], dtype=torch.float64)
    counts = torch.tensor([45, 35, 10, 5, 4, 1, 0])
    x = sc.chi_square(counts, probs)
    by_hand = (45 - 50) ** 2 / 50 + (35 - 30) ** 2 / 30 + (10 - 12) ** 2 / 12 + (10 - 8) ** 2 / 8
    assert x.statistic == pytest.approx(by_hand) and x.dof == 3 and x.cells == 4 and x.pooled_tokens == 3
    assert x.p_value == pytest.approx(float(torch.special.gammaincc(torch.tensor(1.5, dtype=torch.float64),
                                                                    torch.tensor(by_hand / 2, dtype=torch.float64))))


def test_a_pooled_cell_below_five_joins_the_smallest_own_cell():
    probs = torch.tensor([0.6, 0.37, 0.02, 0.01], dtype=torch.float64)  # N = 100: pooled E = 3 < 5
    counts = torch.tensor([58, 38, 3, 1])
    x = sc.chi_square(counts, probs)
    assert x.cells == 2 and x.dof == 1
    assert x.statistic == pytest.approx((58 - 60) ** 2 / 60 + (42 - 40) ** 2 / 40)


def test_a_draw_the_law_forbids_fails_outright_and_kl_is_infinite():
    probs = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    counts = torch.tensor([50, 49, 1])
    x = sc.chi_square(counts, probs)
    assert x.p_value == 0.0 and x.forbidden_draws == 1 and math.isinf(x.statistic)
    assert math.isinf(sc.empirical_kl(counts, probs)) and sc.log_likelihood(counts, probs) == -math.inf


def test_empirical_kl_and_log_likelihood_by_hand():
    probs = torch.tensor([0.25, 0.75], dtype=torch.float64)
    counts = torch.tensor([1, 3])
    assert sc.empirical_kl(counts, probs) == pytest.approx(0.0, abs=1e-15)
    counts = torch.tensor([2, 2])
    assert sc.empirical_kl(counts, probs) == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75))
    assert sc.log_likelihood(counts, probs) == pytest.approx(2 * math.log(0.25) + 2 * math.log(0.75))


def _law(seed: int, vocab: int = 200, temperature: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * 2 / temperature, -1)


def test_the_false_alarm_rate_is_the_stated_alpha():
    """300 replications of 500 exact draws (fixed seeds): the share rejected at alpha = 0.05 lies within the
    binomial(300, 0.05) 99.9% range [4, 28]; a chi-square that ignored pooling or miscounted dof would not."""
    law = _law(0)
    rejected = sum(sc.chi_square(counts_of(draws_of(law, 500, seed), 200), law).p_value < 0.05
                   for seed in range(300))
    assert 4 <= rejected <= 28, rejected


def test_the_test_has_power_against_temperature_applied_twice():
    """Negative control: draws from softmax(z / T^2) with T = 0.8 are rejected against softmax(z / T) in nearly
    every replication."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(200, generator=g, dtype=torch.float64) * 2
    exact, twice = torch.softmax(z / 0.8, -1), torch.softmax(z / 0.64, -1)
    rejected = sum(sc.chi_square(counts_of(draws_of(twice, 500, seed), 200), exact).p_value < 0.01
                   for seed in range(50))
    assert rejected >= 48


# ---------------------------------------------------------------------------------------------------------------
# the laws and the check, on the bundled model


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", device="cpu", dtype="float32")


SETTINGS = dict(temperature=0.7, top_k=40, top_p=0.9, semantics="vllm")


def test_the_exact_law_is_vllm_s_sampler_written_by_hand(tiny):
    """The law decodelab's chain gives (vLLM's reading) equals the fake engine's hand-written vLLM sampler: the
    oracle both the engine checks and the negative controls rest on."""
    from fake_server import sampler_law

    settings = SampleSettings(**SETTINGS, min_p=0.02)
    prefixes = sc.prefixes_of(tiny, tiny.encode(PROMPT), 3)
    exact, _ = sc.laws(tiny, settings, prefixes)
    for prefix, law in zip(prefixes, exact.probs):
        raw = torch.log_softmax(sc.raw_logits(tiny, prefix)[0].double(), -1)
        body = {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.02}
        hand = sampler_law(raw, body)
        assert torch.equal(law > 0, hand > 0)
        assert torch.allclose(law, hand, atol=1e-6)


def test_each_defect_law_is_the_hand_written_defect(tiny):
    from fake_server import sampler_law

    settings = SampleSettings(**SETTINGS)
    prefixes = sc.prefixes_of(tiny, tiny.encode(PROMPT), 2)
    _, defects = sc.laws(tiny, settings, prefixes)
    by_name = {d.name: d for d in defects}
    body = {"temperature": 0.7, "top_k": 40, "top_p": 0.9}
    for name, defect in (("temperature applied twice", "temperature_twice"),
                         ("temperature ignored", "temperature_ignored"), ("truncation ignored", "truncation_ignored"),
                         ("truncation before temperature", "truncation_before_temperature"),
                         ("greedy cut-off", "greedy")):
        for prefix, law in zip(prefixes, by_name[name].probs):
            raw = torch.log_softmax(sc.raw_logits(tiny, prefix)[0].double(), -1)
            assert torch.allclose(law, sampler_law(raw, body, defect), atol=1e-6), name


def test_temperature_twice_at_t_1_is_listed_as_indistinguishable(tiny):
    settings = SampleSettings(temperature=1.0, top_k=40, semantics="vllm")
    prefixes = sc.prefixes_of(tiny, tiny.encode(PROMPT), 1)
    exact, defects = sc.laws(tiny, settings, prefixes)
    draws = [draws_of(exact.probs[0], 300, 0)]
    result = sc.check_draws(tiny, draws, exact, defects, prefixes, 0.01, "test", "seeded")
    fit = {f.name: f for f in result.laws}
    assert not fit["temperature applied twice"].distinguishable
    assert any("temperature applied twice" in n and "no number of draws" in n for n in result.notes)


def test_the_embedded_runtime_passes(tiny):
    settings = SampleSettings(**SETTINGS, seed=3)
    result = sc.check_sampler(tiny, settings, tiny.encode(PROMPT), 2, 150, 0.01)
    assert result.passed and result.named is None, result.verdict
    assert result.p_value >= 0.01 and result.dof == sum(p.dof for p in result.prefixes)
    assert result.chi_square == pytest.approx(sum(p.chi_square for p in result.prefixes))


# ---------------------------------------------------------------------------------------------------------------
# negative controls: the fake engine's sampler, exact and with each defect


@pytest.fixture
def sampling_engine(tiny):
    from fake_server import SamplingServer

    started = []

    def start(defect=None):
        server = SamplingServer(tiny, defect).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def _check(tiny, server, how="n", draws=600, prefixes=2, seed=0, **settings):
    conn = connect(server.url, tiny, {"generate": "check-sampler"})
    s = SampleSettings(**{**SETTINGS, **settings}, seed=seed)
    return sc.check_sampler(tiny, s, tiny.encode(PROMPT), prefixes, draws, 0.01, conn, how)


def test_the_exact_engine_passes_with_seeded_requests_and_with_n(tiny, sampling_engine):
    server = sampling_engine()
    for how in ("seeded", "n"):
        result = _check(tiny, server, how=how, draws=400)
        assert result.passed, (how, result.verdict)
        assert result.source == server.url and result.how == how


@pytest.mark.parametrize("defect, name", [("temperature_twice", "temperature applied twice"),
                                          ("temperature_ignored", "temperature ignored"),
                                          ("truncation_ignored", "truncation ignored"),
                                          ("greedy", "greedy cut-off")])
def test_a_defective_engine_is_caught_and_named(tiny, sampling_engine, defect, name):
    result = _check(tiny, sampling_engine(defect))
    assert not result.passed and result.p_value < 0.01
    assert result.named == name, result.verdict
    assert f"match '{name}'" in result.verdict


def test_truncation_before_temperature_is_caught_and_named_where_it_matters(tiny, sampling_engine):
    # a loose top-p at a low temperature: on the T = 1 distribution it keeps many more tokens
    result = _check(tiny, sampling_engine("truncation_before_temperature"), draws=1500, prefixes=3,
                    temperature=0.5, top_k=0, top_p=0.8)
    assert not result.passed
    assert result.named == "truncation before temperature", result.verdict


def test_the_exact_engine_passes_at_several_seeds_and_the_defect_fails_at_each(tiny, sampling_engine):
    """The false-alarm side and the power side on the same settings and seeds."""
    exact, twice = sampling_engine(), sampling_engine("temperature_twice")
    passed = [_check(tiny, exact, seed=s * 10_000, draws=300).passed for s in range(4)]
    caught = [_check(tiny, twice, seed=s * 10_000, draws=300).named for s in range(4)]
    assert passed == [True] * 4
    assert caught == ["temperature applied twice"] * 4


# ---------------------------------------------------------------------------------------------------------------
# the command


def test_cli_check_sampler_on_an_engine_json_and_exit_status(cli, tiny, sampling_engine):
    ok = sampling_engine()
    code, out, err = cli("check-sampler", PROMPT, "--engine", ok.url, "-t", "0.7", "--top-k", "40", "--top-p", "0.9",
                         "-N", "300", "--prefixes", "2", "--how", "n", "-f", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["command"] == "check-sampler" and doc["summary"]["passed"] is True
    assert doc["config"]["semantics"] == "vllm" and doc["source"]["engine"]["url"] == ok.url
    assert len(doc["prefixes"]) == 2 and doc["prefixes"][1]["prefix_token_ids"][:-1] == doc["prompt"]["token_ids"]
    bad = sampling_engine("temperature_twice")
    code, out, err = cli("check-sampler", PROMPT, "--engine", bad.url, "-t", "0.7", "--top-k", "40", "--top-p", "0.9",
                         "-N", "300", "--prefixes", "2", "--how", "n", "-f", "json")
    assert code == 1, err
    assert json.loads(out)["summary"]["named"] == "temperature applied twice"


def test_cli_check_sampler_embedded_table(cli):
    code, out, err = cli("check-sampler", PROMPT, "-t", "0.8", "--top-k", "20", "-N", "60", "--prefixes", "1")
    assert code == 0, err
    assert "verdict: passed" in out.replace("\n", " ")


@pytest.mark.parametrize("args, words", [
    (["-t", "0"], "--temperature 0"),
    (["-t", "0.7", "--alpha", "1.5"], "--alpha 1.5"),
    (["-t", "0.7", "--how", "n"], "--how n: only with --engine"),
    (["-t", "0.7", "--how", "x"], "--how 'x'"),
    (["-t", "0.7", "-N", "0"], "-N 0"),
])
def test_cli_check_sampler_bad_input_is_one_line_and_status_2(cli, args, words):
    code, out, err = cli("check-sampler", PROMPT, *args)
    assert code == 2 and words in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------------------------
# greedy or not is the plan's decision (issue 36): check-sampler asks it, never temperature == 0


def test_a_plan_that_samples_at_temperature_0_is_checked_not_refused(tiny):
    # llama.cpp's dynamic temperature samples at -t 0 (its plan's selector is multinomial): a law to check
    settings = SampleSettings(temperature=0.0, dynatemp_range=0.5, semantics="llamacpp", seed=3)
    sc.require_sampled(settings)
    result = sc.check_sampler(tiny, settings, tiny.encode(PROMPT), 1, 150, 0.01)
    assert result.passed, result.verdict


@pytest.mark.parametrize("settings", [SampleSettings(temperature=0.0),
                                      SampleSettings(temperature=0.0, semantics="vllm")])
def test_a_greedy_plan_is_refused_in_core(settings):
    with pytest.raises(sc.ConfigError, match="greedy"):
        sc.require_sampled(settings)


def test_cli_checks_the_llamacpp_dynatemp_plan_at_temperature_0(cli):
    code, out, err = cli("check-sampler", PROMPT, "-t", "0", "--dynatemp-range", "0.5", "--semantics", "llamacpp",
                         "-N", "60", "--prefixes", "1")
    assert code == 0, err
    assert "verdict: passed" in out.replace("\n", " ")
