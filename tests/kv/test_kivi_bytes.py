"""KIVI's stored bytes on the bundled model against a count from its layout, and the thresholds docs/kv-policies.md
states (the key-block sawtooth: 32 to 63 exact keys, the last 32 exact values)."""

from __future__ import annotations

import pytest
import torch

from decodelab.core.engine.models import load_model
from decodelab.core.engine.runtime import Runtime
from decodelab.core.kv import parse_cache_spec

LAYERS, KV_HEADS, DIM = 12, 2, 32  # tiny
FP16_TOKEN = 2 * LAYERS * KV_HEADS * DIM * 2


@pytest.fixture(scope="module")
def policies():
    model = load_model("tiny", device="cpu", dtype="float32").model
    out = {}
    for spec in ("int4-kivi", "int2-kivi", "quant:bits=4,axis=kivi,residual=32,residual_dtype=16,symmetric=true"):
        rt = Runtime.create(model, parse_cache_spec(spec))
        with torch.no_grad():
            rt.feed(torch.tensor([[1, 2, 3]]))
        out[spec] = rt.policy
    return out


def counted(t: int, bits: int, zero: bool) -> int:
    """Bytes from KIVI's layout, counted by hand: keys per channel over blocks of 32 tokens (a block leaves the
    32-token window only whole), values per token in one group of 32 channels; each group of 32 values stores
    32 x bits / 8 bytes of codes, a float16 scale and (asymmetric) a float16 zero; every exact token 32 float16s."""
    keys_q = max(t - 32, 0) // 32 * 32
    values_q = max(t - 32, 0)
    per_group = 32 * bits // 8 + 2 + (2 if zero else 0)  # 32 values: codes + scale (+ zero)
    quantized = (keys_q + values_q) * per_group  # one group of 32 values per quantized token, keys and values alike
    exact = (2 * t - keys_q - values_q) * DIM * 2
    return LAYERS * KV_HEADS * (quantized + exact)


@pytest.mark.parametrize("spec,bits,zero", [("int4-kivi", 4, True), ("int2-kivi", 2, True),
                                            ("quant:bits=4,axis=kivi,residual=32,residual_dtype=16,symmetric=true",
                                             4, False)])
def test_kivi_bytes_are_the_layouts_count(policies, spec, bits, zero):
    """bytes_at(T) (itself checked against the stored tensors in test_quant_kv.py) equals the hand count at every
    length from 1 to 1200. Bug caught: a scale, zero or window token not counted, or a key window kept whole."""
    policy = policies[spec]
    for t in range(1, 1201):
        assert policy.bytes_at(t, exact_dtype=torch.float16) == counted(t, bits, zero), t


@pytest.mark.parametrize("spec,goal,aligned,anywhere", [
    ("int4-kivi", 0.35, 608, 864),
    ("int2-kivi", 0.25, 416, 608),
    ("quant:bits=4,axis=kivi,residual=32,residual_dtype=16,symmetric=true", 0.35, 352, 480),
])
def test_kivi_goal_thresholds_the_docs_state(policies, spec, goal, aligned, anywhere):
    """The first block boundary (T = 32k) from which the ratio to the float16 full cache is <= the goal, and the
    first T from which every length is (checked up to 4096); and the issue's 480 stored tokens."""
    policy = policies[spec]
    ratio = {t: policy.bytes_at(t, exact_dtype=torch.float16) / (FP16_TOKEN * t) for t in range(1, 4097)}
    assert min(t for t in range(32, 4097, 32) if all(ratio[u] <= goal for u in range(t, 4097, 32))) == aligned
    assert min(t for t in ratio if all(ratio[u] <= goal for u in range(t, 4097))) == anywhere
    assert (ratio[480] <= goal) == (spec != "int4-kivi")
