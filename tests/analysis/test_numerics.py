"""audit-numerics: the conditions' forwards against the whole-text forward, the layer comparison on a model with a
difference planted in one layer, fp32 against itself exactly zero, bf16 nonzero but within its measured noise, and
the noise verdict."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from decodelab.core.analysis import noise
from decodelab.core.analysis import numerics as nm
from decodelab.core.engine import numerics as en
from decodelab.core.engine.models import load_model
from decodelab.core.errors import ConfigError

TEXT = "Once upon a time there was a little girl who lived in a village near the forest."


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def ids(tiny):
    return tiny.encode(TEXT)


@pytest.fixture(scope="module")
def reference(tiny, ids):
    return en.whole(tiny.model, ids)


def test_the_conditions_compute_the_same_logits_as_one_forward(tiny, ids, reference):
    """Oracle for the condition forwards: decode, chunks and padded batches give the whole-text logits up to fp32
    rounding (wrong positions under left padding, or a cache fed twice, would be off by whole nats)."""
    for forced in (en.chunked(tiny.model, ids, 1), en.chunked(tiny.model, ids, 5),
                   en.batched(tiny.model, ids, nm.other_rows(ids, 2, tiny.vocab_size), "left"),
                   en.batched(tiny.model, ids, nm.other_rows(ids, 2, tiny.vocab_size), "right")):
        assert forced.logits.shape == reference.logits.shape and forced.hidden.shape == reference.hidden.shape
        assert torch.allclose(forced.logits, reference.logits, atol=1e-4)
        assert torch.allclose(forced.hidden, reference.hidden, atol=1e-4, rtol=1e-4)


def test_fp32_against_fp32_is_exactly_zero(tiny, ids):
    audit = nm.audit(tiny, ids, [nm.parse_condition("dtype:fp32")])
    c = audit.conditions[0]
    assert c.max_abs_delta_logprob == 0 and c.kl_max == 0 and c.tv_max == 0 and c.outside_band == 0
    assert c.flips == [] and c.first_divergence is None and c.first_layer_beyond_noise is None
    assert all(la.relative_error == 0 for la in c.layers) and c.within_noise and nm.WITHIN in c.verdict


def test_bf16_against_fp32_is_nonzero_but_within_its_noise(tiny, ids):
    audit = nm.audit(tiny, ids, [nm.parse_condition("dtype:bf16")])
    c = audit.conditions[0]
    assert c.max_abs_delta_logprob > 1e-4 and c.kl_mean > 0
    assert all(la.relative_error > 0 for la in c.layers[1:])
    assert c.first_layer_beyond_noise is None and c.within_noise and c.verdict.startswith(nm.WITHIN)
    assert audit.floors[0]["dtype"] == "bfloat16" and audit.floors[0]["eps"] == 2 ** -7


def test_bf16_is_beyond_the_fp32_floor(tiny, ids, reference):
    """Negative control of the floor: the same bf16 numbers held against the fp32 floor are beyond noise at once
    (so "within noise" above is the bf16 floor's doing, not a floor that passes everything)."""
    bf16 = en.whole(en.copy_as(tiny.model, dtype=torch.bfloat16), ids)
    floor = noise.measure_floor(tiny.model, ids, reference, torch.float32)
    c = nm.compare_forced("bf16 vs fp32 floor", "dtype", ids, reference, bf16, floor, torch.bfloat16)
    assert not c.within_noise and c.first_layer_beyond_noise in ("embeddings", "layer 0")


@pytest.mark.parametrize("layer", [3, 8])
def test_a_difference_planted_in_one_layer_is_named(tiny, ids, reference, layer):
    """One decoder layer's MLP output projection scaled by 1.001: every layer before it is within the fp32 floor,
    it and the ones after are beyond, and the first beyond is named."""
    planted = copy.deepcopy(tiny.model)
    with torch.no_grad():
        en.layers_of(planted)[layer].mlp.down_proj.weight.mul_(1.001)
    forced = en.whole(planted, ids)
    floor = noise.measure_floor(tiny.model, ids, reference, torch.float32)
    c = nm.compare_forced("planted", "model", ids, reference, forced, floor, torch.float32)
    assert c.first_layer_beyond_noise == f"layer {layer}"
    assert all(not la.beyond_noise for la in c.layers[: layer + 1])
    assert c.layers[layer + 1].beyond_noise and not c.within_noise
    assert nm.NOT_EXPLAINED in c.verdict and f"layer {layer}" in c.verdict


def test_figures_by_hand_on_a_flip():
    """Two hand-made logit tables: KL, TV, the ratio band, the flip and its margins."""
    text = [0, 1, 2]
    ref = en.Forced(torch.tensor([[2.0, 1.0, 0.0, 0.0], [0.0, 3.0, 2.9, 0.0], [0.0, 0.0, 1.0, 0.0]]),
                    torch.ones(2, 3, 2))
    cond = en.Forced(torch.tensor([[2.0, 1.0, 0.0, 0.0], [0.0, 2.9, 3.0, 0.0], [0.0, 0.0, 1.0, 0.0]]),
                     torch.ones(2, 3, 2))
    floor = noise.Floor("float32", 1e-7, [1e-6, 1e-6], 1e-5)
    c = nm.compare_forced("hand", "test", text, ref, cond, floor, torch.float32)
    p = torch.log_softmax(ref.logits[1].double(), -1)
    q = torch.log_softmax(cond.logits[1].double(), -1)
    assert c.positions == 2 and c.first_divergence == 1 and len(c.flips) == 1
    flip = c.flips[0]
    assert (flip.reference_token, flip.condition_token) == (1, 2)
    assert flip.reference_margin == pytest.approx(0.1) and flip.condition_margin == pytest.approx(0.1)
    assert c.kl_max == pytest.approx(float((p.exp() * (p - q)).sum()))
    assert c.tv_max == pytest.approx(0.5 * float((p.exp() - q.exp()).abs().sum()))
    assert c.max_abs_delta_logprob == pytest.approx(abs(float(q[2] - p[2])))
    assert float((q[2] - p[2]).exp()) == pytest.approx(1.1052, abs=1e-4)  # e^0.1: outside [0.9, 1.1]
    assert c.outside_band == pytest.approx(0.5)  # one of the two positions
    assert c.first_layer_beyond_noise is None


def test_the_noise_verdict_words(tiny, ids):
    assert noise.verdict_words(0.01, 0.02) == "within numeric noise"
    assert noise.verdict_words(-0.01, 0.02) == "within numeric noise"
    assert noise.verdict_words(0.5, 0.02) == "not explained by numerics"


def test_the_noise_verdict_on_fp32_and_bf16(tiny, ids):
    """The same prefix, token a and its nearest competitor b (a margin of about 0.008 nats on the bundled model):
    not explained by fp32's measured floor, within bf16's; the margin is z_a - z_b there, by hand."""
    prompt, generated = ids[:6], ids[6:10]
    a = generated[2]
    z = en.whole(tiny.model, prompt + generated[:2]).logits[-1].double()
    gaps = (z - z[a]).abs()
    gaps[a] = float("inf")
    b = int(gaps.argmin())
    fp32 = noise.noise_verdict(tiny, prompt, generated, 2, b)
    assert fp32.margin == pytest.approx(float(z[a] - z[b]), abs=1e-5) and fp32.step == 2
    assert fp32.dtype == "float32" and abs(fp32.margin) > fp32.floor and fp32.words == noise.NOT_EXPLAINED
    bf16 = noise.noise_verdict(load_model("tiny", device="cpu", dtype="bfloat16"), prompt, generated, 2, b)
    assert bf16.dtype == "bfloat16" and bf16.floor > 100 * fp32.floor and bf16.words == noise.WITHIN


def test_divergence_verdicts_only_where_the_runs_part(tiny, ids):
    prompt, ref = ids[:5], ids[5:12]
    other = ref[:3] + [ref[3] + 1] + ref[4:]
    out = noise.divergence_verdicts(tiny, prompt, ref, [("same", list(ref)), ("other", other),
                                                        ("shorter", ref[:4])])
    assert [v["against"] for v in out] == ["other"] and out[0]["step"] == 3
    assert out[0]["token_a"] == ref[3] and out[0]["token_b"] == ref[3] + 1
    assert out[0]["words"] in (noise.WITHIN, noise.NOT_EXPLAINED)


@pytest.mark.parametrize("text, words", [("dtype:int8", "dtype:int8"), ("batch:0:left", "[1, 64]"),
                                          ("batch:2:middle", "not a condition"), ("chunks:0", "not a condition"),
                                          ("attn:magic", "not a condition")])
def test_bad_conditions_are_one_line(text, words):
    with pytest.raises(ConfigError, match="allowed") as e:
        nm.parse_condition(text)
    assert words in str(e.value)


def test_unavailable_conditions_are_listed_with_why(tiny, ids):
    audit = nm.audit(tiny, ids[:6], [nm.parse_condition("attn:flash")] +
                     ([nm.parse_condition("device:cuda")] if not torch.cuda.is_available() else []))
    assert all(c.skipped and c.verdict.startswith("skipped") for c in audit.conditions)


def test_cli_audit_numerics_json(cli):
    code, out, err = cli("audit-numerics", "Once upon a time", "--greedy", "3", "--conditions",
                         "dtype:fp32,dtype:bf16,decode,batch:2:left,attn:flash", "-f", "json", "--threads", "1")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["command"] == "audit-numerics" and len(doc["text_token_ids"]) == len(doc["prompt"]["token_ids"]) + 3
    by = {c["condition"]: c for c in doc["conditions"]}
    assert by["dtype:fp32"]["max_abs_delta_logprob"] == 0 and by["dtype:bf16"]["within_noise"] is True
    assert by["attn:flash"]["skipped"] and doc["summary"]["skipped"] == ["attn:flash"]


def test_cli_audit_numerics_table_and_bad_input(cli):
    code, out, err = cli("audit-numerics", "Once upon a time", "--conditions", "decode", "--threads", "1")
    assert code == 0, err
    assert "within" in out and "noise floor:" in out
    code, out, err = cli("audit-numerics", "Once upon a time", "--conditions", "dtype:int4")
    assert code == 2 and "--conditions 'dtype:int4'" in err and "Traceback" not in err


def test_an_engine_is_one_more_condition(tiny, ids):
    """The fake vLLM serving the same fp32 model: its prompt logprobs agree with the reference to fp32 rounding,
    its KL is a top-N bound, no hidden states."""
    from fake_server import SamplingServer

    from decodelab.core.methods.served import connect

    server = SamplingServer(tiny).start()
    try:
        conn = connect(server.url, tiny, {"score": "audit-numerics"})
        audit = nm.audit(tiny, ids, [], conn.engine, "fp32", 5)
    finally:
        server.stop()
    c = audit.conditions[0]
    assert c.kind == "engine" and c.truncated and c.layers == [] and c.positions == len(ids) - 1
    assert c.max_abs_delta_logprob < 1e-4 and c.within_noise and c.flips == []
    assert 0 <= c.kl_mean <= c.kl_upper_mean
