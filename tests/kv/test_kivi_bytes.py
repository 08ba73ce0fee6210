"""KIVI's stored bytes on the bundled model against a count from its layout, and the thresholds docs/kv-policies.md
states (KIVI's own key rule, Algorithm 1 of Liu et al. 2024: T mod 32 exact keys, the last 32 exact values; and the
sliding key window kept as ``kivi_keys=window``: 32 to 63 exact keys)."""

from __future__ import annotations

import pytest
import torch

from decodelab.core.engine.models import load_model
from decodelab.core.engine.runtime import Runtime
from decodelab.core.kv import parse_cache_spec

LAYERS, KV_HEADS, DIM = 12, 2, 32  # tiny
FP16_TOKEN = 2 * LAYERS * KV_HEADS * DIM * 2
WINDOW = "quant:bits=4,axis=kivi,residual=32,residual_dtype=16,kivi_keys=window"  # the sliding key window


@pytest.fixture(scope="module")
def policies():
    model = load_model("tiny", device="cpu", dtype="float32").model
    out = {}
    for spec in ("int4-kivi", "int2-kivi", "quant:bits=4,axis=kivi,residual=32,residual_dtype=16,symmetric=true",
                 WINDOW):
        rt = Runtime.create(model, parse_cache_spec(spec))
        with torch.no_grad():
            rt.feed(torch.tensor([[1, 2, 3]]))
        out[spec] = rt.policy
    return out


def counted(t: int, bits: int, zero: bool, chunks: bool = True) -> int:
    """Bytes from KIVI's layout, counted by hand: keys per channel over blocks of 32 tokens, values per token in one
    group of 32 channels; each group of 32 values stores 32 x bits / 8 bytes of codes, a float16 scale and
    (asymmetric) a float16 zero; every exact token 32 float16s. Keys (KIVI's Algorithm 1, ``chunks``): the
    full-precision key residual is quantized and emptied whenever it holds R = 32 tokens (the prefill quantizes the
    first T - T mod R), so T - T mod 32 keys are quantized; with the sliding key window instead, a block of 32 leaves
    the last 32 keys only whole. Values: all but the last 32 quantized."""
    keys_q = t - t % 32 if chunks else max(t - 32, 0) // 32 * 32
    values_q = max(t - 32, 0)
    per_group = 32 * bits // 8 + 2 + (2 if zero else 0)  # 32 values: codes + scale (+ zero)
    quantized = (keys_q + values_q) * per_group  # one group of 32 values per quantized token, keys and values alike
    exact = (2 * t - keys_q - values_q) * DIM * 2
    return LAYERS * KV_HEADS * (quantized + exact)


@pytest.mark.parametrize("spec,bits,zero,chunks", [("int4-kivi", 4, True, True), ("int2-kivi", 2, True, True),
                                                   ("quant:bits=4,axis=kivi,residual=32,residual_dtype=16,"
                                                    "symmetric=true", 4, False, True),
                                                   (WINDOW, 4, True, False)])
def test_kivi_bytes_are_the_layouts_count(policies, spec, bits, zero, chunks):
    """bytes_at(T) (itself checked against the stored tensors in test_quant_kv.py) equals the hand count at every
    length from 1 to 1200. Bug caught: a scale, zero or window token not counted, or a key window kept whole."""
    policy = policies[spec]
    for t in range(1, 1201):
        assert policy.bytes_at(t, exact_dtype=torch.float16) == counted(t, bits, zero, chunks), t


@pytest.mark.parametrize("spec", ["int4-kivi", WINDOW])
def test_kivi_stored_bytes_are_the_count_on_the_bundled_model(policies, spec):
    """The bytes the bundled model's cache really stores (its tensors, one token a forward after a 3-token prefill,
    the exact window in float16) equal the hand count at T = 3..100, past three chunks of 32 keys."""
    model = load_model("tiny", device="cpu", dtype="float32").model
    rt = Runtime.create(model, parse_cache_spec(spec))
    chunks = spec == "int4-kivi"
    with torch.no_grad():
        rt.feed(torch.tensor([[1, 2, 3]]))
        for t in range(3, 101):
            assert rt.policy.nbytes() == counted(t, 4, True, chunks), t
            rt.feed(torch.tensor([[4 + t % 90]]))


@pytest.mark.parametrize("spec,goal,aligned,anywhere", [
    ("int4-kivi", 0.35, 320, 576),
    ("int2-kivi", 0.25, 224, 384),
    ("quant:bits=4,axis=kivi,residual=32,residual_dtype=16,symmetric=true", 0.35, 192, 320),
    (WINDOW, 0.35, 608, 864),
])
def test_kivi_goal_thresholds_the_docs_state(policies, spec, goal, aligned, anywhere):
    """The first block boundary (T = 32k) from which the ratio to the float16 full cache is <= the goal, and the
    first T from which every length is (checked up to 4096); and the issue's 480 stored tokens."""
    policy = policies[spec]
    ratio = {t: policy.bytes_at(t, exact_dtype=torch.float16) / (FP16_TOKEN * t) for t in range(1, 4097)}
    assert min(t for t in range(32, 4097, 32) if all(ratio[u] <= goal for u in range(t, 4097, 32))) == aligned
    assert min(t for t in ratio if all(ratio[u] <= goal for u in range(t, 4097))) == anywhere
    assert (ratio[480] <= goal) == (spec != WINDOW)
