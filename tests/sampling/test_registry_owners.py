"""Engine facts are read from the registry's rows, never restated: a new stage (a fake row, registered with
monkeypatch) gets its llama.cpp sampler name, its llama.cpp server field, its vLLM request field, its stateful
refusal and its pair-valued parsing from its row alone."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from decodelab.core.analysis.check_logprobs import request_fields, settings_of_request
from decodelab.core.analysis.compare import STATEFUL_WHY
from decodelab.core.engine.http.llamacpp import LlamacppAdapter
from decodelab.core.engine.http.wire import SamplingSettings
from decodelab.core.sampling import registry
from decodelab.core.sampling.export import export, llamacpp_server_neutral, neutral_request, served_settings
from decodelab.core.sampling.registry import Off, Param, Stage, sampler_names, stateful
from decodelab.core.settings import PAIRS, as_dict, coerce
from decodelab.core.methods.sample import SampleSettings


def fake_stage(**row) -> Stage:
    return Stage("fake-cut", (Param("fake_cut", float, "A new filter.", **row.pop("param", {})),), **row)


@pytest.fixture
def with_row(monkeypatch):
    def add(stage: Stage) -> Stage:
        monkeypatch.setattr(registry, "STAGES", registry.STAGES + [stage])
        monkeypatch.setitem(registry.BY_NAME, stage.name, stage)
        return stage
    return add


def test_llamacpp_sampler_names_come_from_the_rows(with_row):
    names = sampler_names("llamacpp")
    assert names["top-k"] == "top_k" and names["typical-p"] == "typ_p" and names["dynatemp"] == "temperature"
    assert {names[n] for n in ("repetition-penalty", "frequency-penalty", "presence-penalty")} == {"penalties"}
    assert "fake-cut" not in names
    with_row(fake_stage(engines={"llamacpp": 99}, samplers={"llamacpp": "fake_cut"}))
    assert sampler_names("llamacpp")["fake-cut"] == "fake_cut"


def test_the_export_writes_the_rows_sampler_names_in_the_chains_order():
    flags = export(SampleSettings(temperature=0.7, top_k=5, typical_p=0.9, repetition_penalty=1.1,
                                  chain=("repetition-penalty", "typical-p", "top-k", "temperature")),
                   "llamacpp", 100).arguments
    assert flags[flags.index("--samplers") + 1] == "penalties;typ_p;top_k;temperature"


def test_the_llamacpp_servers_neutral_body_is_the_adapters(with_row):
    """The adapter's body agrees with the registry's (the server's off-values of every stage a request does not
    carry, and llama.cpp's order of those it carries), and a new llama.cpp-only stage is switched off there."""
    neutral = llamacpp_server_neutral()
    request, _ = served_settings(SampleSettings(), 2, 100)  # the request as every served run builds it
    body = LlamacppAdapter().generate_body("m", [1], request)
    assert {k: body[k] for k in neutral} == neutral
    assert neutral["samplers"] == ["penalties", "top_k", "top_p", "min_p", "temperature"]
    with_row(fake_stage(engines={"llamacpp": 99}, param={"export": {"llamacpp-server": "fake_cut"},
                                                          "off": {"llamacpp": Off(0.0, lambda v: v <= 0)}}))
    assert llamacpp_server_neutral()["fake_cut"] == 0.0
    # and reaches the body the adapter sends, with no edit to the adapter
    assert LlamacppAdapter().generate_body("m", [1], neutral_request())["fake_cut"] == 0.0
    carried = fake_stage(engines={"llamacpp": 99, "vllm": 99}, samplers={"llamacpp": "fake_cut"},
                         param={"export": {"llamacpp-server": "fake_cut"}, "off": {"llamacpp": Off(0.0, bool)}})
    carried.name = "fake-carried"
    with_row(carried)
    assert llamacpp_server_neutral()["samplers"][-1] == "fake_cut"  # a stage the request carries: in the order


def test_vllm_request_fields_come_from_the_rows(with_row):
    fields = request_fields()
    assert {k: p.field for k, p in fields.items()} == {
        "repetition_penalty": "repetition_penalty", "frequency_penalty": "frequency_penalty",
        "presence_penalty": "presence_penalty", "min_tokens": "min_new_tokens", "temperature": "temperature",
        "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
        "thinking_token_budget": "thinking_budget"}  # issue 39's row: vLLM's SamplingParams field
    # off as vLLM reads it (the row's off-rule; min_tokens 0 the request's neutral value); a temperature is kept
    s, _ = settings_of_request({"top_k": -1, "top_p": 1.0, "min_tokens": 0, "temperature": 1.0, "min_p": 0.1}, {})
    assert (s.top_k, s.top_p, s.min_new_tokens, s.temperature, s.min_p) == (None, None, None, 1.0, 0.1)
    with_row(fake_stage(param={"export": {"vllm": "fake_cut"}}))
    assert request_fields()["fake_cut"].field == "fake_cut"


def test_stateful_stages_come_from_the_rows(with_row):
    assert stateful(["top-k", "xtc", "mirostat", "temperature"]) == ["xtc", "mirostat"]
    assert STATEFUL_WHY == "xtc draws its own coin from the run's generator and mirostat carries state: not attributed"
    with_row(fake_stage(needs=frozenset({"state"})))
    assert stateful(["top-k", "fake-cut"]) == ["fake-cut"]


@dataclass(frozen=True)
class WithPairs(SampleSettings):
    fake_pairs: PAIRS = ()


def test_a_pair_valued_setting_is_known_by_its_type():
    assert coerce(WithPairs, "fake_pairs", "a=1,b=-inf") == (("a", 1.0), ("b", float("-inf")))
    doc = as_dict(WithPairs(fake_pairs=(("x", 2.0),), logit_bias=(("7", 1.0),)))
    assert doc["fake_pairs"] == {"x": 2.0} and doc["logit_bias"] == {"7": 1.0} and doc["sequence_bias"] == {}


def test_the_llamacpp_adapter_refuses_a_request_without_the_registrys_neutral_body():
    """The engine layer knows no stage: a request built without the registry's body would leave the server's own
    defaults (its --samplers, a DRY it was started with) in force, so it is refused, not sent."""
    adapter = LlamacppAdapter()
    assert adapter.check(neutral_request()) is None
    assert adapter.check(SamplingSettings()) == ("the request does not switch off llama.cpp's own stages (build it "
                                                 "with decodelab.core.sampling.export.served_settings or "
                                                 "neutral_request)")
    body = adapter.generate_body("m", [1], SamplingSettings())
    assert not set(llamacpp_server_neutral()) & set(body)  # the adapter spells none of it itself


def test_a_served_requests_neutral_values_are_the_rows_vllm_off_values():
    """Every field a served request writes defaults to what vLLM reads as "stage off" (each row's ``off["vllm"]``),
    and a vLLM score request switches every stage off the same way (its temperature aside: 0, the prompt's
    logprobs are raw in every mode)."""
    from dataclasses import fields

    from decodelab.core.engine.http.vllm import VllmAdapter
    from decodelab.core.sampling.registry import params, scaling_stage

    neutral, request = SamplingSettings(), {f.name for f in fields(SamplingSettings)}
    body = VllmAdapter().score_body("m", [1], 2)
    scaling = registry.BY_NAME[scaling_stage()].params[0].export["vllm"]
    checked = []
    for p in params():
        name = p.export.get("vllm")
        if name in request and "vllm" in p.off:
            assert getattr(neutral, name) == p.off["vllm"].value, name
            assert name == scaling or p.off["vllm"].test(body[name]), name
            checked.append(name)
    assert sorted(checked) == ["frequency_penalty", "min_p", "presence_penalty", "repetition_penalty", "temperature",
                               "top_k", "top_p"]
