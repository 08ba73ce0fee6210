"""quantize-kv's analysis (core/analysis/quantize_kv.py) function by function, on hand-made tensors and a small
random model: the byte formulas, the projection, the outlier view, the reconstruction, the spec overrides and the
checks, against values worked by hand or recomputed from scratch (the command end to end: tests/cli/
test_quantize_kv_cli.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace as NS

import pytest
import torch

from conftest import random_model

from decodelab.core.analysis import quantize_kv as qkv
from decodelab.core.engine.forward import model_info
from decodelab.core.engine.models import LoadedModel
from decodelab.core.errors import ConfigError
from decodelab.core.kv import parse_cache_spec
from decodelab.core.kv.quant import QuantPolicy

# mutation run of core/analysis/quantize_kv.py (2026-12-02)


def small_lm(arch: str = "llama", **overrides) -> LoadedModel:
    """A 2-layer random model (llama: 4 heads, 2 KV heads, head_dim 16, context 256) without a tokenizer."""
    return LoadedModel("small", random_model(arch, seed=1, scale=4.0, **overrides), None, torch.device("cpu"),
                       torch.float32)


def policy_of(lm: LoadedModel, text: str) -> QuantPolicy:
    return QuantPolicy(model_info(lm.model), **parse_cache_spec(text).options)


def test_dtype_bytes():
    assert [qkv.dtype_bytes(d) for d in (torch.float64, torch.float32, torch.bfloat16, torch.int8)] == [8, 4, 2, 1]


def test_per_token_formula_by_hand():
    """3 layers x 2 KV heads x head_dim 8, keys and values: 96 values a token; float32 4 bytes each; 6 query heads
    would hold 3x as many without grouped-query attention."""
    info = NS(num_layers=3, kv_heads=2, head_dim=8, dtype=torch.float32)
    assert qkv.per_token_formula(info, 6) == {
        "formula": "2 x layers x kv_heads x head_dim x bytes", "layers": 3, "heads": 6, "kv_heads": 2,
        "head_dim": 8, "cache_dtype": "float32", "bytes_per_token": 384, "fp16_bytes_per_token": 192,
        "bytes_per_token_without_gqa": 1152, "gqa_saving": 3.0}
    half = qkv.per_token_formula(NS(num_layers=1, kv_heads=4, head_dim=2, dtype=torch.float16), 6)
    # 16 values: 32 bytes; 6 / 4 heads: 16 x 6 // 4 = 24 values, 48 bytes (the division after the product)
    assert (half["bytes_per_token"], half["bytes_per_token_without_gqa"], half["gqa_saving"]) == (32, 48, 1.5)
    assert half["cache_dtype"] == "float16"
    assert isinstance(half["bytes_per_token_without_gqa"], int)  # a byte count, not 48.0 in the JSON


def test_available_memory_reads_the_system_and_survives_its_refusal(monkeypatch):
    import os

    expected = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    got = qkv.available_memory(torch.device("cpu"))
    assert isinstance(got, int) and abs(got - expected) < 2**30  # free memory moves between the two reads

    def refuse(name):
        raise ValueError(name)

    monkeypatch.setattr(os, "sysconf", refuse)
    assert qkv.available_memory(torch.device("cpu")) is None


def test_projection_by_hand():
    """int8 per token on the small model (2 layers, 2 KV heads, head_dim 16): each head and token stores 16 one-byte
    codes and one float16 scale, 18 bytes, for keys and values; 10 tokens in 3 rows: 3 x 10 x 2 x 2 x 2 x 18 =
    4320 bytes, against 3840 values of the full cache (15360 bytes in float32, 7680 in float16)."""
    policy = policy_of(small_lm(), "int8")
    p = qkv.projection(policy, 10, 3, 5000)
    assert p == {"tokens": 10, "batch": 3, "kv_bytes": 4320, "baseline_kv_bytes": 15360, "fp16_kv_bytes": 7680,
                 "bytes_ratio": 4320 / 7680, "fp16_model_bytes_ratio": 4320 / 7680, "fits": True,
                 "baseline_fits": False}
    edge = qkv.projection(policy, 10, 3, 4320)
    assert edge["fits"] is True and edge["baseline_fits"] is False  # exactly the free bytes still fit
    unknown = qkv.projection(policy, 10, 3, None)
    assert unknown["fits"] is None and unknown["baseline_fits"] is None
    assert qkv.projection(policy, 10, 3, 15360)["baseline_fits"] is True
    # an exact window of 4 tokens (residual 4): 6 quantized tokens (18 bytes) + 4 exact ones (16 values of 4 bytes
    # as stored, of 2 in a float16 model) per head, keys and values, 2 layers x 2 heads, one row
    windowed = policy_of(small_lm(), "quant:bits=8,axis=token,residual=4")
    p = qkv.projection(windowed, 10, 1, None)
    assert p["kv_bytes"] == 8 * (6 * 18 + 4 * 64) and p["fp16_kv_bytes"] == 2560
    assert p["fp16_model_bytes_ratio"] == 8 * (6 * 18 + 4 * 32) / 2560
    assert qkv.fp16_model_bytes(windowed, 10) == 8 * (6 * 18 + 4 * 32)
    assert qkv.fp16_model_bytes(windowed, 10, 2) == 2 * 8 * (6 * 18 + 4 * 32)


def test_relative_change():
    assert qkv.relative_change(3.0, 2.0) == 0.5
    assert math.isnan(qkv.relative_change(3.0, 0.0)) and math.isnan(qkv.relative_change(3.0, None))


# --- the outlier view ---------------------------------------------------------------------------------------------


X = [[1.0, -2.0, 0.5, 8.0],
     [-3.0, 1.0, 0.5, -1.0],
     [2.0, 2.0, -0.5, 2.0]]


def test_outlier_view_by_hand():
    """3 tokens x 4 channels. |x| per channel: max (3, 2, 0.5, 8), median (2, 2, 0.5, 2), max / median (1.5, 1, 1,
    4); channel 3 sets a per-tensor scale, 4x the typical channel max (the lower median of 0.5, 2, 3, 8: 2).
    Symmetric 8 bits: step = max|x| / 127 over the tensor (8), each channel (3, 2, 0.5, 8: mean 3.375), each token
    (8, 3, 2: mean 13 / 3) or each group of 2 channels in a token (2, 8, 3, 1, 2, 2: mean 3); float16 steps are
    rounded up, so within 1e-3."""
    x = torch.tensor(X)
    v = qkv.outlier_view(x, ["a", "b", "c", "d"], 8, 2, 2)
    assert (v["channels"], v["tokens"]) == (4, 3)
    assert v["scale_setter"] == {"channel": "d", "max": 8.0, "times_typical_channel_max": 4.0}
    assert v["top_channels"] == [{"channel": "d", "max": 8.0, "median": 2.0, "max_over_median": 4.0},
                                 {"channel": "a", "max": 3.0, "median": 2.0, "max_over_median": 1.5}]
    assert v["max_over_median"] == {"median": 1.0, "max": 4.0}
    steps = {axis: v["layouts"][axis]["mean_step"] for axis in ("tensor", "channel", "token", "group")}
    assert steps == pytest.approx({"tensor": 8 / 127, "channel": 3.375 / 127, "token": 13 / 3 / 127,
                                   "group": 3 / 127}, rel=1e-3)
    assert v["bits_lost_per_tensor_vs_channel"] == pytest.approx(math.log2(8 / 3.375), abs=2e-3)
    # the relative error, recomputed: the step 8 / 127 rounded up to a float16, each value rounded to its nearest
    # multiple
    step = torch.tensor(8 / 127, dtype=torch.float16)
    if step.float() < 8 / 127:
        step = torch.nextafter(step, torch.tensor(math.inf, dtype=torch.float16))
    step = step.float()
    err = ((x / step).round() * step - x).norm() / x.norm()
    assert v["layouts"]["tensor"]["rel_error"] == pytest.approx(err.item(), rel=1e-5)
    for axis in ("channel", "token", "group"):
        assert 0 < v["layouts"][axis]["rel_error"] < v["layouts"]["tensor"]["rel_error"]


def test_outlier_view_bits_groups_and_no_top():
    x = torch.tensor(X)
    four = qkv.outlier_view(x, list("abcd"), 4, 2, 4)
    assert four["layouts"]["tensor"]["mean_step"] == pytest.approx(8 / 7, rel=1e-3)  # 4 bits: 2^3 - 1 levels a side
    assert [c["channel"] for c in four["top_channels"]] == ["d", "a", "b", "c"]  # all four, by max
    fp8 = qkv.outlier_view(x, list("abcd"), "fp8", 2, 1)
    eight = qkv.outlier_view(x, list("abcd"), 8, 2, 1)
    assert fp8["layouts"] == eight["layouts"]  # fp8 is viewed at 8 bits
    odd = qkv.outlier_view(x, list("abcd"), 8, 3, 1)  # 3 does not divide 4 channels: one group per token
    assert odd["layouts"]["group"] == odd["layouts"]["token"]
    # the same tensor / 16 (norm, medians and maxes below 1): every ratio and relative error the same, every step
    # / 16 (a power of 2: the float16 rounding scales exactly)
    small = qkv.outlier_view(x / 16, list("abcd"), 8, 2, 1)
    assert small["scale_setter"]["times_typical_channel_max"] == 4.0
    assert small["max_over_median"] == {"median": 1.0, "max": 4.0}
    for axis, layout in eight["layouts"].items():
        assert small["layouts"][axis]["rel_error"] == pytest.approx(layout["rel_error"], rel=1e-6)
        assert small["layouts"][axis]["mean_step"] == pytest.approx(layout["mean_step"] / 16, rel=1e-6)
    none = qkv.outlier_view(x, list("abcd"), 8, 2, 0)
    assert none["top_channels"] == [] and none["scale_setter"]["channel"] == "a"


def test_kv_outliers_name_head_and_dim():
    """Keys [2 heads, 3 tokens, 2 dims] become 3 tokens x 4 channels h0.d0, h0.d1, h1.d0, h1.d1; the largest key
    sits at head 1, dim 0; the largest value at head 0, dim 1."""
    keys = torch.ones(2, 3, 2)
    keys[1, 2, 0] = 9.0
    values = torch.ones(2, 3, 2)
    values[0, 1, 1] = -7.0
    out = qkv.kv_outliers([(keys, values), (values, keys)], 8, 2, 1)
    assert [(o["layer"], o["kind"]) for o in out] == [(0, "keys"), (0, "values"), (1, "keys"), (1, "values")]
    assert [o["scale_setter"]["channel"] for o in out] == ["h1.d0", "h0.d1", "h0.d1", "h1.d0"]
    assert [o["scale_setter"]["max"] for o in out] == [9.0, 7.0, 7.0, 9.0]
    assert all(o["channels"] == 4 and o["tokens"] == 3 for o in out)


# --- reconstruction -----------------------------------------------------------------------------------------------


def padded(rows) -> torch.Tensor:
    """[heads, tokens, 2] -> [heads, tokens, 16] (the small model's head_dim), the other 14 channels 0."""
    return torch.nn.functional.pad(torch.tensor(rows), (0, 14))


def test_reconstruction_by_hand():
    """int8 per token (symmetric): each head's token row keeps max|x| exactly and rounds the rest to its step
    max|x| / 127. Keys [2 heads, 2 tokens, 2 dims (+ 14 zeros)]: head 0 is exact (values on the grid), head 1 has
    0.3 in a row of max 127 (step 1: 0.3 -> 0, error 0.3). Values: all exact. A residual window of 2 keeps every
    token exact."""
    keys = padded([[[127.0, 1.0], [-127.0, 2.0]], [[127.0, 0.3], [1.0, 0.0]]])
    values = padded([[[4.0, 2.0], [1.0, 1.0]], [[0.0, 0.0], [0.0, 0.0]]])
    rows = qkv.reconstruction([(keys, values), (values, keys)], policy_of(small_lm(), "int8"))
    assert [(r["layer"], r["head"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    head1 = math.sqrt(127**2 + 0.3**2 + 1.0)
    assert rows[0]["key_rel_error"] == 0 and rows[0]["key_max_error"] == 0
    assert rows[1]["key_rel_error"] == pytest.approx(0.3 / head1, rel=1e-4)
    assert rows[1]["key_max_error"] == pytest.approx(0.3, rel=1e-4)
    assert rows[1]["value_rel_error"] == 0 and rows[1]["value_max_error"] == 0  # an all-zero head: 0, not 0 / 0
    assert rows[3]["value_rel_error"] == pytest.approx(0.3 / head1, rel=1e-4) and rows[3]["key_rel_error"] == 0
    assert rows[3]["value_max_error"] == pytest.approx(0.3, rel=1e-4)
    exact = qkv.reconstruction([(keys, values)], policy_of(small_lm(), "quant:bits=8,axis=token,residual=2"))
    assert all(r["key_max_error"] == 0 and r["value_max_error"] == 0 for r in exact)


def test_reconstruction_puts_keys_and_values_through_their_own_layouts():
    """kivi (2 bits, blocks and groups of 4, no window): keys per channel over a block of 4 tokens, values per
    token over groups of 4 channels. Four equal tokens [1, 100, 0, ..]: every key channel is constant over the
    block (exact), while a value group [1, 100, 0, 0] at 2 bits (steps of 100 / 3) loses the 1."""
    keys = padded([[[1.0, 100.0]] * 4, [[0.37, 37.0]] * 4])
    rows = qkv.reconstruction([(keys, keys)], policy_of(small_lm(), "quant:bits=2,axis=kivi,residual=0,group=4"))
    assert all(r["key_max_error"] < 1e-3 for r in rows)
    assert all(r["value_max_error"] > 0.3 for r in rows)


# --- specs and checks ---------------------------------------------------------------------------------------------


def test_kv_spec_lays_the_overrides_over_the_cache():
    def spec(**kw):
        return str(qkv.kv_spec(qkv.QuantizeKVSettings(**kw)))

    assert spec() == "quant:axis=kivi,bits=4,residual=32,residual_dtype=16,symmetric=false"
    assert spec(cache="int4-kivi", bits="2", residual=4) == "quant:axis=kivi,bits=2,residual=4,residual_dtype=16,symmetric=false"
    assert spec(cache="int4-kivi", symmetric=True, group_size=8) == \
        "quant:axis=kivi,bits=4,group=8,residual=32,residual_dtype=16,symmetric=true"
    # a new axis drops the old axis's defaults (kivi's residual 32) but keeps the bits
    assert spec(cache="int4-kivi", axis="token") == "quant:axis=token,bits=4,residual=0,symmetric=false"
    assert spec(cache="int4-kivi", axis="kivi") == \
        "quant:axis=kivi,bits=4,residual=32,residual_dtype=16,symmetric=false"
    # axis=token takes no group, given or left by the cache
    assert spec(cache="quant:axis=group,group=8", axis="token") == \
        "quant:axis=token,bits=8,residual=0,symmetric=true"
    assert spec(cache="int8", group_size=8) == "quant:axis=token,bits=8,residual=0,symmetric=true"
    assert spec(cache="int8", bits="fp8") == "quant:axis=token,bits=fp8,residual=0,symmetric=true"
    assert spec(cache="tova:size=3") == "tova:compress=decode,size=3"
    with pytest.raises(ConfigError) as err:
        spec(cache="h2o:size=4", group_size=8)
    assert str(err.value) == ("--group-size: sets a quant cache; --cache h2o:size=4 is a score-based press (give its "
                              "own keys in the spec)")
    with pytest.raises(ConfigError) as err:
        spec(cache="tova:size=3", symmetric=False)
    assert str(err.value).startswith("--symmetric: sets a quant cache; --cache tova:size=3 is a score-based press")
    with pytest.raises(ConfigError) as err:
        spec(cache="full")
    assert str(err.value) == ("--cache full: quantize-kv measures a quant policy (quant:..., int8, int4-kivi, "
                              "int2-kivi, int4, fp8) or a score-based press (h2o, knorm, snapkv, pyramidkv, tova, "
                              "keydiff, expected-attention: memory and fidelity)")


def test_is_press():
    assert qkv.is_press(parse_cache_spec("snapkv:ratio=0.5")) and qkv.is_press(parse_cache_spec("h2o:size=4"))
    assert not qkv.is_press(parse_cache_spec("int8")) and not qkv.is_press(parse_cache_spec("window:size=4"))


def test_validate_quantize_kv_bounds_and_messages():
    def check(**kw):
        return qkv.validate_quantize_kv(qkv.QuantizeKVSettings(**kw))

    assert str(check()) == "quant:axis=kivi,bits=4,residual=32,residual_dtype=16,symmetric=false"
    for ok in (dict(limit=2, feed=1, context=1, group_size=1, prefill=1, batch=1, top=0, residual=0),
               dict(limit=None), dict(bits="fp8", cache="int8"), dict(axis="tensor"),
               dict(cache="snapkv:ratio=0.5", prefill=4), dict(policies="int8", probe=True)):
        check(**ok)
    for bad, message in [
        (dict(limit=0), "--limit 0: must be an integer >= 1"),
        (dict(limit=1), "--limit 1: must be >= 2 (the first token is context)"),
        (dict(feed=0), "--feed 0: must be an integer >= 1"),
        (dict(context=0), "--context 0: must be an integer >= 1"),
        (dict(group_size=0), "--group-size 0: must be an integer >= 1"),
        (dict(prefill=0), "--prefill 0: must be an integer >= 1"),
        (dict(batch=0), "--batch 0: must be an integer >= 1"),
        (dict(top=-1), "--top -1: must be >= 0"),
        (dict(residual=-1), "--residual -1: must be an integer >= 0"),
        (dict(axis="row"), "--axis row: allowed: tensor, token, channel, group, kivi"),
        (dict(bits="3"), "--bits 3: allowed: 2, 4, 8, fp8"),
        (dict(cache="snapkv:ratio=0.5"), "--cache snapkv:kernel=5,pool=max,ratio=0.5,window=32: it compresses "
         "once, after the prompt, and the measured text has no prompt; give --prefill N (the first N tokens are its "
         "prompt)"),
        (dict(policies="int8,snapkv:ratio=0.5"), "--cache snapkv:kernel=5,pool=max,ratio=0.5,window=32: it "
         "compresses once, after the prompt, and the measured text has no prompt; give --prefill N (the first N tokens are "
         "its prompt)"),
        (dict(probe=True), "--probe: ranks the retrieval of --policies; give --policies (or use stream --probe)"),
    ]:
        with pytest.raises(ConfigError) as err:
            check(**bad)
        assert str(err.value) == message, bad


def test_grid_specs_and_cells():
    specs = [str(s) for s in qkv.grid_specs()]
    assert len(specs) == 15 and specs[0] == "quant:axis=tensor,bits=8,residual=0,symmetric=true"
    assert specs[-1] == "quant:axis=kivi,bits=2,residual=0,symmetric=false"
    assert [s.split(",")[0] for s in specs[:5]] == [f"quant:axis={a}" for a in qkv.GRID_AXES]
    assert [str(s) for s in qkv.grid_specs((4,), ("token", "group"), group=8, residual=2)] == [
        "quant:axis=token,bits=4,residual=2,symmetric=false",
        "quant:axis=group,bits=4,group=8,residual=2,symmetric=false"]
    assert qkv.grid_cells(qkv.QuantizeKVSettings()) == []
    cells = qkv.grid_cells(qkv.QuantizeKVSettings(grid=True, group_size=8, residual=2))
    assert [str(c) for c in cells] == [str(s) for s in qkv.grid_specs(group=8, residual=2)]
    assert str(cells[1]) == "quant:axis=token,bits=8,residual=2,symmetric=true"


def test_grid_kivi_cells_keep_the_same_window_as_the_others():
    """With --residual R, the grid's kivi cell keeps its last R keys exact like every other layout
    (kivi_keys=window: KIVI's own T mod R rule would compare windows, not layouts, and refuses an R that is no
    multiple of the group); with no window the two rules agree and the spec stays as it was."""
    kivi = [str(s) for s in qkv.grid_specs((4,), ("kivi",), residual=5)]
    assert kivi == ["quant:axis=kivi,bits=4,kivi_keys=window,residual=5,symmetric=false"]
    assert "kivi_keys" not in str(qkv.grid_specs((4,), ("kivi",))[0])


def test_ranking_cells_put_full_first_once():
    assert qkv.ranking_cells(qkv.QuantizeKVSettings()) == {}
    cells = qkv.ranking_cells(qkv.QuantizeKVSettings(policies="int8,full,h2o:size=4"))
    assert list(cells) == ["full", "int8", "h2o:size=4"]
    assert [str(s) for s in cells.values()] == ["full", "quant:axis=token,bits=8,residual=0,symmetric=true",
                                                "h2o:compress=decode,size=4"]


# --- the model's side -----------------------------------------------------------------------------------------------


def test_sliding_and_decoder_layers():
    assert not qkv.sliding(small_lm())
    assert qkv.sliding(small_lm("gemma2"))  # sliding_window 16
    assert qkv.sliding(small_lm(sliding_window=16, layer_types=None))  # a window and no layer types
    assert qkv.sliding(small_lm(layer_types=["sliding_attention", "full_attention"], sliding_window=None))
    lm = small_lm()
    assert qkv.decoder_layers(lm.model) is lm.model.model.layers
    lm.model.config.num_hidden_layers = 3  # no list of 3 layers
    with pytest.raises(ConfigError, match="^--activations: cannot find this model's decoder layers$"):
        qkv.decoder_layers(lm.model)


def test_capture_kv_and_activations_against_a_plain_forward():
    lm = small_lm()
    ids = [5, 9, 14, 3, 7]
    with torch.no_grad():
        out = lm.model(torch.tensor([ids]), use_cache=True)
    kv = qkv.capture_kv(lm, ids)
    assert len(kv) == 2
    for (keys, values), layer in zip(kv, out.past_key_values.layers):
        torch.testing.assert_close(keys, layer.keys[0].float())
        torch.testing.assert_close(values, layer.values[0].float())
    x = qkv.capture_activations(lm, ids, 0)  # layer 0's input: the token embeddings
    torch.testing.assert_close(x, lm.model.model.embed_tokens(torch.tensor(ids)).detach())
    with pytest.raises(ConfigError, match=r"^--activations 2: the model has decoder layers 0\.\.1$"):
        qkv.capture_activations(lm, ids, 2)
    with pytest.raises(ConfigError, match=r"^--activations -1: "):
        qkv.capture_activations(lm, ids, -1)
    assert not lm.model.model.layers[0]._forward_pre_hooks  # the hook is removed


# --- fidelity, held bytes, the report -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def toy_lm(toy_model_dir):
    """The saved toy Llama (2 layers, 2 KV heads, head_dim 16, context 64) with the bundled tokenizer."""
    from decodelab.core.engine.models import load_model

    return load_model(str(toy_model_dir), device="cpu", dtype="float32")


IDS = [5, 9, 14, 3, 7, 11, 2, 8, 13, 4]


def test_held_bytes_and_fidelity_bytes_by_hand(toy_lm):
    """10 tokens, 2 layers x 2 KV heads x head_dim 16: full float32 keys and values 10 x 2 x 2 x 2 x 16 x 4 = 5120
    bytes (2560 in float16); int8 per token stores 16 codes + a 2-byte scale per head and token: 10 x 144 =
    1440."""
    assert qkv.held_bytes(toy_lm, IDS, parse_cache_spec("full")) == 5120
    assert qkv.held_bytes(toy_lm, IDS, parse_cache_spec("int8"), feed=3, prefill=4) == 1440
    f = qkv.fidelity(toy_lm, IDS, parse_cache_spec("int8"), 1)
    assert (f.cache, f.tokens, f.kv_bytes, f.stop_reason) == ("quant:axis=token,bits=8,residual=0,symmetric=true",
                                                             9, 1440, "end")
    assert f.bytes_ratio == 1440 / 2560 and f.fp16_model_bytes_ratio == 1440 / 2560 and f.steps == []
    assert 0 <= f.kl_mean < 0.05 and f.perplexity > 1 and f.baseline_perplexity > 1
    # an exact window of 4 tokens, stored in float32, counted at 2 bytes in a float16 model: per head, keys and
    # values, 6 x 18 + 4 x 64 bytes as held, 6 x 18 + 4 x 32 in float16
    w = qkv.fidelity(toy_lm, IDS, parse_cache_spec("quant:bits=8,axis=token,residual=4"), 2, keep_steps=True)
    assert w.kv_bytes == 8 * (6 * 18 + 4 * 64) and w.bytes_ratio == w.kv_bytes / 2560
    assert w.fp16_model_bytes_ratio == 8 * (6 * 18 + 4 * 32) / 2560
    assert len(w.steps) == 9
    # a press: its bytes as held, the same figure for a float16 model
    press = parse_cache_spec("tova:size=3")
    t = qkv.fidelity(toy_lm, IDS, press, 1)
    assert t.kv_bytes == qkv.held_bytes(toy_lm, IDS, press, 1) < 5120
    assert t.fp16_model_bytes_ratio == t.bytes_ratio == t.kv_bytes / 2560


def test_fidelity_matches_score_and_an_interrupted_run_counts_what_it_held(toy_lm):
    from decodelab.core.methods.score import Scorer, ScoreSettings
    from decodelab.core.sampling.chain import build_chain

    spec = parse_cache_spec("quant:bits=4,axis=group,group=8")
    f = qkv.fidelity(toy_lm, IDS, spec, 2)
    scorer = Scorer(toy_lm.model, IDS, build_chain({}), toy_lm.token_text, ScoreSettings(feed=2), cache=spec,
                    reference=toy_lm.model, reference_cache=parse_cache_spec("full"), reference_name="full")
    for _ in scorer:
        pass
    s = scorer.summary()
    assert (f.kl_mean, f.top1_agreement, f.perplexity, f.baseline_perplexity) == (
        s.kl_mean, s.top1_agreement, s.perplexity, s.reference_perplexity)

    def cut_after_two(run):
        for i, _ in enumerate(run):
            if i == 1:
                run.interrupt()
                return

    cut = qkv.fidelity(toy_lm, IDS, parse_cache_spec("int8"), 1, drive=cut_after_two)
    assert cut.stop_reason == "interrupted" and cut.tokens == 2
    assert cut.kv_bytes == 3 * 144 and cut.bytes_ratio == 144 / 256  # the 3 tokens held


def test_fidelity_row_and_report_summary():
    f = qkv.Fidelity("int8", 9, 0.01, 0.9, 12.0, 10.0, 1440, 0.5625, 0.5)
    assert f.row() == {"cache": "int8", "tokens": 9, "kv_bytes": 1440, "bytes_ratio": 0.5625,
                       "fp16_model_bytes_ratio": 0.5, "kl_mean": 0.01, "top1_agreement": 0.9, "perplexity": 12.0,
                       "baseline_perplexity": 10.0, "perplexity_change": pytest.approx(0.2)}
    report = qkv.QuantizeKVReport("int8", "k", "v", {"baseline_kv_bytes": 5760, "fp16_kv_bytes": 2880}, [], f, [], [])
    assert report.summary() == {
        "cache": "int8", "tokens": 9, "kv_bytes": 1440, "baseline_kv_bytes": 5760, "fp16_kv_bytes": 2880,
        "bytes_ratio": 0.5625, "fp16_model_bytes_ratio": 0.5, "baseline_bytes_ratio": 0.25, "kl_mean": 0.01,
        "top1_agreement": 0.9, "perplexity": 12.0, "baseline_perplexity": 10.0,
        "perplexity_change": pytest.approx(0.2), "stop_reason": "end"}
    assert (report.feed, report.grid, report.ranking, report.probe, report.activations) == (1, [], [], None, None)


def test_run_quantize_kv_by_hand(toy_lm):
    told = []
    settings = qkv.QuantizeKVSettings(cache="int8", context=100, batch=3, activations=1, top=2)
    r = qkv.run_quantize_kv(toy_lm, IDS, settings, parse_cache_spec("int8"), progress=told.append)
    assert told == ["full-precision keys and values", "fidelity of quant:axis=token,bits=8,residual=0,symmetric=true",
                    "activations of layer 1"]
    assert (r.cache, r.keys, r.values, r.feed, r.stop_reason) == (
        "quant:axis=token,bits=8,residual=0,symmetric=true", "8-bit per token", "8-bit per token", 1, "end")
    m = r.memory
    assert (m["layers"], m["heads"], m["kv_heads"], m["head_dim"], m["bytes_per_token"]) == (2, 4, 2, 16, 512)
    assert (m["tokens"], m["kv_bytes"], m["baseline_kv_bytes"], m["fp16_kv_bytes"]) == (10, 1440, 5120, 2560)
    assert m["available_bytes"] is None or m["available_bytes"] > 0
    # the model's context (64 tokens, one row) and --context 100 x --batch 3: 144 bytes a token and row
    assert [(p["at"], p["tokens"], p["batch"], p["kv_bytes"]) for p in r.projections] == [
        ("context_length", 64, 1, 64 * 144), ("context", 100, 3, 300 * 144)]
    assert len(r.reconstruction) == 4 and len(r.outliers) == 4  # 2 layers x 2 heads; 2 layers x keys, values
    assert all(len(o["top_channels"]) == 2 for o in r.outliers)
    assert r.activations["layer"] == 1 and r.activations["where"] == "input of the decoder layer"
    assert r.activations["channels"] == 64 and r.activations["tokens"] == 10
    assert r.activations["scale_setter"]["channel"].startswith("c") and len(r.activations["top_channels"]) == 2
    assert len(r.fidelity.steps) == 9  # kept for the command's steps
    plain = qkv.run_quantize_kv(toy_lm, IDS, qkv.QuantizeKVSettings(cache="int8"), parse_cache_spec("int8"))
    assert [p["at"] for p in plain.projections] == ["context_length"] and plain.activations is None


def test_run_quantize_kv_of_a_press_and_its_refusals(toy_lm):
    told = []
    press = parse_cache_spec("tova:size=3")
    r = qkv.run_quantize_kv(toy_lm, IDS, qkv.QuantizeKVSettings(cache="tova:size=3"), press, progress=told.append)
    assert told == ["fidelity of tova:compress=decode,size=3"]
    assert (r.keys, r.values, r.projections, r.reconstruction, r.outliers) == (
        "score-based eviction", "score-based eviction", [], [], [])
    with pytest.raises(ConfigError) as err:
        qkv.run_quantize_kv(toy_lm, IDS, qkv.QuantizeKVSettings(cache="tova:size=3", activations=0), press)
    assert str(err.value) == ("--activations: the outlier view is of a quant cache's scales; --cache "
                              "tova:compress=decode,size=3 is a press")
    with pytest.raises(ConfigError) as err:
        qkv.run_quantize_kv(toy_lm, IDS[:1], qkv.QuantizeKVSettings(cache="int8"), parse_cache_spec("int8"))
    assert str(err.value) == "--text-file: 1 token(s); quantize-kv needs at least 2"
    for layer in (2, -1):
        with pytest.raises(ConfigError) as err:
            qkv.run_quantize_kv(toy_lm, IDS, qkv.QuantizeKVSettings(cache="int8", activations=layer),
                                parse_cache_spec("int8"))
        assert str(err.value) == f"--activations {layer}: the model has decoder layers 0..1"


def test_projection_baseline_in_the_models_dtype():
    """A bfloat16 model's full cache holds 2 bytes a value: 3 rows x 10 tokens x 128 values x 2 = 7680 bytes."""
    lm = small_lm()
    lm.model.to(torch.bfloat16)
    p = qkv.projection(policy_of(lm, "int8"), 10, 3, None)
    assert p["baseline_kv_bytes"] == 7680 == p["fp16_kv_bytes"]


def test_fidelity_feeds_the_prompt_a_press_compresses(toy_lm):
    """snapkv compresses once, after the prompt: --prefill 4 makes the first 4 tokens that prompt, as score does."""
    from decodelab.core.methods.score import Scorer, ScoreSettings
    from decodelab.core.sampling.chain import build_chain

    spec = parse_cache_spec("snapkv:ratio=0.5,window=2")
    f = qkv.fidelity(toy_lm, IDS, spec, 1, prefill=4)
    scorer = Scorer(toy_lm.model, IDS, build_chain({}), toy_lm.token_text, ScoreSettings(feed=1, prefill=4),
                    cache=spec, reference=toy_lm.model, reference_cache=parse_cache_spec("full"))
    for _ in scorer:
        pass
    assert f.kl_mean == scorer.summary().kl_mean > 0
    assert f.kv_bytes == qkv.held_bytes(toy_lm, IDS, spec, 1, 4)


# mutation run of core/analysis/quantize_kv.py (2026-12-02, second round: validate_quantize_kv, kv_spec, is_press,
# dtype_bytes, fp16_model_bytes, reconstruction, held_bytes, run_quantize_kv, run by the lead)


def test_an_activation_layer_is_checked_once_and_before_anything_runs(toy_lm):
    """--activations is refused before the fidelity run (nothing told), and layer 0 is a layer."""
    assert len(qkv.activation_layers(toy_lm.model, 0)) == 2 and len(qkv.activation_layers(toy_lm.model, 1)) == 2
    for layer in (2, -1):
        told = []
        with pytest.raises(ConfigError, match=f"^--activations {layer}: the model has decoder layers 0..1$"):
            qkv.run_quantize_kv(toy_lm, IDS, qkv.QuantizeKVSettings(cache="int8", activations=layer),
                                parse_cache_spec("int8"), progress=told.append)
        assert told == []
    r = qkv.run_quantize_kv(toy_lm, IDS, qkv.QuantizeKVSettings(cache="int8", activations=0), parse_cache_spec("int8"))
    assert r.activations["layer"] == 0


def test_run_quantize_kv_hands_its_feed_prefill_and_drive_to_the_fidelity_run(toy_lm):
    """The main fidelity run is the one fidelity() gives with the same feed and prefill, iterated by ``drive``; the
    report keeps the feed."""
    spec = parse_cache_spec("quant:bits=2,axis=token,residual=0")  # no exact window: every token read is quantized
    driven = []

    def drive(run):
        driven.append(run)
        return qkv.drain(run)
    settings = qkv.QuantizeKVSettings(cache="quant:bits=2,axis=token,residual=0", feed=3, prefill=4)
    r = qkv.run_quantize_kv(toy_lm, IDS, settings, spec, drive=drive)
    alone = qkv.fidelity(toy_lm, IDS, spec, 3, keep_steps=True, prefill=4)
    assert len(driven) == 1 and r.feed == 3
    assert r.fidelity.kl_mean == alone.kl_mean and r.fidelity.kv_bytes == alone.kv_bytes
    assert [s.kl for s in r.fidelity.steps] == [s.kl for s in alone.steps]
    one = qkv.fidelity(toy_lm, IDS, spec, 1, keep_steps=True)
    assert [s.kl for s in one.steps] != [s.kl for s in alone.steps]  # the feed and prefill change what is read


def test_run_quantize_kv_reads_the_free_memory_of_its_device(toy_lm, monkeypatch):
    seen = []
    monkeypatch.setattr(qkv, "available_memory", lambda device: seen.append(device) or 10_000)
    r = qkv.run_quantize_kv(toy_lm, IDS, qkv.QuantizeKVSettings(cache="int8"), parse_cache_spec("int8"))
    assert seen == [toy_lm.device] and r.memory["available_bytes"] == 10_000
    # the model's context, 64 tokens x 144 bytes = 9216 bytes, fits in 10,000; the full cache (64 x 512) does not
    assert (r.projections[0]["fits"], r.projections[0]["baseline_fits"]) == (True, False)


def test_the_attention_heads_come_from_the_text_config_then_n_head_then_the_kv_heads(toy_lm, monkeypatch):
    """A multimodal config's text part names the heads; a config without num_attention_heads names them n_head; one
    with neither counts the KV heads (no grouped-query saving)."""
    from types import SimpleNamespace

    def heads_with(config) -> int:
        monkeypatch.setattr(LoadedModel, "config", property(lambda self: config))
        return qkv.run_quantize_kv(toy_lm, IDS, qkv.QuantizeKVSettings(cache="int8"),
                                   parse_cache_spec("int8")).memory["heads"]
    text = SimpleNamespace(num_attention_heads=8)
    assert heads_with(SimpleNamespace(get_text_config=lambda: text, num_attention_heads=99)) == 8
    assert heads_with(SimpleNamespace(n_head=6)) == 6
    assert heads_with(SimpleNamespace()) == 2


def test_an_axis_given_again_keeps_the_specs_other_keys():
    """--axis equal to the spec's own axis changes nothing: the spec's group and residual stay (only a different
    axis resets them to that axis' defaults)."""
    same = qkv.kv_spec(qkv.QuantizeKVSettings(cache="quant:bits=4,axis=kivi,group=8,residual=3", axis="kivi"))
    assert (same.options["group"], same.options["residual"]) == (8, 3)
    other = qkv.kv_spec(qkv.QuantizeKVSettings(cache="quant:bits=4,axis=kivi,group=8,residual=3", axis="channel"))
    assert other.options["bits"] == 4 and "residual=3" not in str(other) and "group=8" not in str(other)


def test_two_tokens_are_enough_and_an_interrupted_run_says_so(toy_lm):
    r = qkv.run_quantize_kv(toy_lm, IDS[:2], qkv.QuantizeKVSettings(cache="int8"), parse_cache_spec("int8"))
    assert r.memory["tokens"] == 2 and len(r.fidelity.steps) == 1

    def interrupted(run):
        for i, _ in enumerate(run):
            if i == 2:
                run.interrupt()
                break
    r = qkv.run_quantize_kv(toy_lm, IDS, qkv.QuantizeKVSettings(cache="int8"), parse_cache_spec("int8"),
                            drive=interrupted)
    assert r.stop_reason == "interrupted" == r.fidelity.stop_reason


def test_the_bits_each_accepted_by_name():
    for bits in ("2", "4", "8", "fp8"):
        qkv.validate_quantize_kv(qkv.QuantizeKVSettings(cache="int8", bits=bits))


def test_held_bytes_of_a_press_follow_its_prefill(toy_lm):
    """snapkv compresses once, after the prompt: with --prefill 4 the prompt is 4 tokens, halved at ratio 0.5;
    without it the prompt is the first block, one token, which halving cannot shrink: the cache holds more."""
    press = parse_cache_spec("snapkv:ratio=0.5,window=1")
    with_prefill = qkv.held_bytes(toy_lm, IDS, press, 1, 4)
    without = qkv.held_bytes(toy_lm, IDS, press, 1, None)
    assert with_prefill < without
