"""The quantized cache's decode path against recomputing from scratch.

The reference keeps every key and value exact and, at every forward, quantizes the stored tokens anew from them:
of T stored tokens, the ones beyond the last R (the residual window) in whole blocks of G (one-token blocks for
per-token layouts; with R = 0 and one-token blocks, all T), each block quantized on its own with the layout's scales
(`quantize`), dequantized, then the exact rest, then the forward's own tokens. Attention over exactly that is what
the cache promises, so the logits must be equal bit for bit. The cache instead quantizes each block once, when it
leaves the tail, and appends (layers worked on together: new tokens written into a shared workspace, leaving tokens
and tails taken from it), so these tests catch a wrong incremental path: a block flushed a forward early or late, a
tail that loses or repeats a token, a token count that is not a multiple of the group, the new tokens written into
another layer's or row's room, the key layout (per channel) swapped with the value layout (per token).
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_model

from decodelab.core.engine.forward import forward
from decodelab.core.engine.runtime import Runtime
from decodelab.core.kv import parse_cache_spec
from decodelab.core.kv.quantize import dequantize, fp8_supported, quantize


def layouts_of(options: dict, group: int) -> dict[str, tuple[str, int, bool]]:
    """(axis, G, chunks) of keys and values from the spec's options (G as the policy resolved it: the default 32, or
    the head dim where 32 does not divide it), as the docs describe kivi: keys per channel in blocks of G tokens
    (the group given, else 32 whatever the head dim), values per token in groups of G channels; ``chunks``: KIVI's
    own key rule (kivi_keys=chunks, the default)."""
    axis = options["axis"]
    if axis == "kivi":
        return {"key": ("channel", options.get("group", 32), options.get("kivi_keys", "chunks") == "chunks"),
                "value": ("group", group, False)}
    return {"key": (axis, group, False), "value": (axis, group, False)}


def from_scratch(x: torch.Tensor, axis: str, group: int, bits, symmetric: bool) -> torch.Tensor:
    """x [B, H, n, D] quantized and dequantized with one scale per token (token), per G channels of a token
    (group), per channel of each block of G tokens (channel), per row of each block of G tokens (tensor)."""
    scale_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float16
    def qd(t, ax, g=None):
        return dequantize(quantize(t, bits, ax, g, symmetric, scale_dtype), x.dtype)
    if axis == "token":
        return qd(x, "token")
    if axis == "group":
        return qd(x, "group", group)
    blocks = x.split(group, dim=2)
    if axis == "channel":
        return torch.cat([qd(b, "channel") for b in blocks], 2)
    return torch.cat([torch.cat([qd(b[r : r + 1], "tensor") for r in range(b.shape[0])]) for b in blocks], 2)


def quantized_count(stored: int, residual: int, block: int, chunks: bool = False) -> int:
    """Stored tokens that are quantized: those beyond the last R, in whole blocks. KIVI's keys (``chunks``,
    Algorithm 1 of Liu et al. 2024: the full-precision key residual is quantized and emptied each time it holds R
    tokens; the prefill quantizes the first T - T mod R): all but the last ``stored mod R``."""
    if chunks and residual:
        return stored - stored % residual
    if residual == 0 and block == 1:
        return stored
    return max((stored - residual) // block * block, 0)


def recompute_cache(model, options: dict, group: int):
    """A transformers DynamicCache holding exact states; what each layer's attention sees is rebuilt from scratch."""
    from transformers import DynamicCache

    layouts = layouts_of(options, group)

    class RecomputeFromScratch(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
            stored = keys.shape[2] - key_states.shape[2]
            return seen(keys, stored, layouts["key"]), seen(values, stored, layouts["value"])

    def seen(x, stored, layout):
        axis, group, chunks = layout
        block = group if axis in ("channel", "tensor") else 1
        n = quantized_count(stored, options["residual"], block, chunks)
        if n == 0:
            return x
        return torch.cat([from_scratch(x[:, :, :n], axis, group, options["bits"], options["symmetric"]),
                          x[:, :, n:]], 2)

    return RecomputeFromScratch(config=model.config)


def decode_both(model, spec: str, ids: torch.Tensor, chunks: list[int]):
    """Feed ``ids`` [B, T] in ``chunks`` through the quantized cache and through the reference; logits of every
    forward, side by side, and the runtime."""
    policy_spec = parse_cache_spec(spec)
    rt = Runtime.create(model, policy_spec)
    ref = recompute_cache(model, policy_spec.options, rt.policy.group)
    got, want, start = [], [], 0
    for n in chunks:
        piece = ids[:, start : start + n]
        got.append(rt.feed(piece, keep="all"))
        positions = torch.arange(start, start + n).unsqueeze(0).expand(ids.shape[0], -1)
        want.append(forward(model, piece, ref, positions, logits_to_keep=0))
        start += n
    return got, want, rt


SPECS = [
    "int8",
    "quant:bits=4,axis=kivi,group=8,residual=5,kivi_keys=window",  # kivi: keys per channel (blocks of 8), values per token
    "quant:bits=2,axis=kivi,group=8,residual=5,kivi_keys=window",
    "quant:bits=4,axis=kivi,group=8,residual=5,symmetric=true,kivi_keys=window",
    "quant:bits=4,axis=kivi,group=16,residual=0",  # blocks flush the forward they fill, no window
    "quant:bits=4,axis=kivi,group=4,residual=8",  # KIVI's key chunks: 8 keys flushed at once, in blocks of 4
    "quant:bits=2,axis=kivi,group=8,residual=8",
    "quant:bits=4,axis=kivi,group=8,residual=16,symmetric=true",
    "quant:bits=4,axis=channel,group=4,residual=3",
    "quant:bits=4,axis=tensor,group=4,residual=3",
    "quant:bits=8,axis=group,group=8,residual=3,symmetric=false",
    "quant:bits=2,axis=token,symmetric=true",
    "quant:bits=4,axis=group,group=8",
] + (["fp8"] if fp8_supported() else [])

# a prefill that is no multiple of any group, a chunk, then one token a forward past several block boundaries
CHUNKS = [11, 3] + [1] * 26


@pytest.mark.parametrize("spec", SPECS)
def test_decode_equals_recomputing_from_scratch(spec):
    """Two rows of different text (a row or a layer given another's room would change the logits)."""
    model = random_model("llama", scale=4.0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 250, (2, sum(CHUNKS)), generator=g)
    got, want, rt = decode_both(model, spec, ids, CHUNKS)
    assert rt.policy.model_cache.together is not None  # the layers-together path is the one under test
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), (spec, i)
    first = rt.policy.model_cache.layers[0]
    assert first.k.quantized > 0 and first.v.quantized > 0  # the test reached the quantized part


@pytest.mark.parametrize("spec", ["int4-kivi", "quant:bits=4,axis=kivi,group=8,residual=5,symmetric=true,kivi_keys=window"])
def test_decode_in_bfloat16_equals_recomputing_from_scratch(spec):
    """bfloat16 model: the codes dequantized in float32 and rounded once to bfloat16, as from scratch."""
    model = random_model("llama", scale=4.0).to(torch.bfloat16)
    ids = torch.arange(3, 3 + 45).unsqueeze(0)
    got, want, _ = decode_both(model, spec, ids, [33] + [1] * 12)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), (spec, i)


def test_the_reference_is_not_vacuous():
    """The reference with another residual gives other logits: it really depends on which tokens are quantized."""
    model = random_model("llama", scale=4.0)
    ids = torch.arange(3, 33).unsqueeze(0)
    got, _, _ = decode_both(model, "quant:bits=4,axis=kivi,group=8,residual=5,kivi_keys=window", ids, [11] + [1] * 19)
    _, other, _ = decode_both(model, "quant:bits=4,axis=kivi,group=8,residual=6,kivi_keys=window", ids, [11] + [1] * 19)
    assert not all(torch.equal(a, b) for a, b in zip(got, other))


def test_the_reference_tells_kivis_key_chunks_from_the_sliding_key_window():
    """The chunked reference and the sliding-window one give other logits for the same R and G: which rule the
    cache follows is pinned (a cache that kept the old window would fail the chunked specs above)."""
    model = random_model("llama", scale=4.0)
    ids = torch.arange(3, 33).unsqueeze(0)
    got, want, _ = decode_both(model, "quant:bits=4,axis=kivi,group=4,residual=8", ids, [11] + [1] * 19)
    _, window, _ = decode_both(model, "quant:bits=4,axis=kivi,group=4,residual=8,kivi_keys=window", ids,
                               [11] + [1] * 19)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not all(torch.equal(a, b) for a, b in zip(got, window))


# --- the mutation run of core/kv/quant.py (2026-12-01): a model of one layer ----------------------------------------


@pytest.mark.parametrize("spec", ["quant:bits=4,axis=kivi,group=8,residual=5,kivi_keys=window", "quant:bits=4,axis=tensor,group=4,residual=3",
                                  "quant:bits=4,axis=kivi,group=4,residual=8"])
def test_decode_of_a_one_layer_model_equals_recomputing_from_scratch(spec):
    """One layer: the layers-together path works on one stream per kind (a first stream looked up as the second
    of the list would not exist); logits bit for bit as from scratch, past several blocks."""
    model = random_model("llama", scale=4.0, num_hidden_layers=1)
    ids = torch.arange(3, 3 + 20).unsqueeze(0)
    got, want, rt = decode_both(model, spec, ids, [7] + [1] * 13)
    assert rt.policy.model_cache.together is not None and len(rt.policy.model_cache.layers) == 1
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), (spec, i)
    assert rt.policy.model_cache.layers[0].k.quantized > 0
