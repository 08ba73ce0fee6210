"""Attention in a rotated cache's space (core/kv/attention.py): the query rotated, the output rotated back, turbo's
QJL term folded into a doubled head dim, against the path that rotates every stored token back.

The oracle is the old path itself (``Layout.dequantize``: deq(codes) R^T, turbo's n (y + r_hat) P^T), run on the
same model with the wrapper not installed: the stored codes are the same, so the logits must agree within float32
rounding of the products. Negative controls: the output rotated by R instead of R^T, and turbo without its QJL term,
must not agree. The stored tokens are never rotated back on the new path (the old dequantization is not called).
"""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import random_model

from decodelab.core.engine import runtime as runtime_module
from decodelab.core.engine.runtime import Runtime
from decodelab.core.kv import attention, parse_cache_spec
from decodelab.core.kv.quant import Layout
from decodelab.core.kv.turbo import TurboLayout

SPECS = [
    "quant:bits=4,axis=token,rotate=random",
    "quant:bits=4,axis=kivi,residual=4,kivi_keys=window,rotate=hadamard",  # keys per channel in blocks, values per group: a tail
    "quant:bits=4,axis=kivi,group=4,residual=8,rotate=hadamard",  # KIVI's key chunks: the key tail flushed whole
    "quant:bits=2,axis=kivi,residual=32,residual_dtype=16,rotate_values=random",  # values alone rotate
    "quant:bits=8,axis=token,symmetric=true,rotate_keys=random",  # keys alone rotate
    "turbo:bits=3",  # prod keys: the doubled head dim
    "turbo:bits=2,keys=mse",
    "turbo:bits=4,residual=8",
]


def decode(model, spec: str, ids: torch.Tensor, wrapped: bool = True) -> tuple[torch.Tensor, Runtime]:
    """Logits of a prefill of 8 tokens, then one token a forward; ``wrapped=False``: the runtime does not install
    the wrapper (the cache rotates every stored token back, as before)."""
    if wrapped:
        rt = Runtime.create(model, parse_cache_spec(spec))
    else:
        install = runtime_module.install_for
        runtime_module.install_for = lambda model, space: None
        try:
            rt = Runtime.create(model, parse_cache_spec(spec))
        finally:
            runtime_module.install_for = install
    rows = [rt.prefill(ids[:, :8])[0]]
    rows += [rt.feed(ids[:, t : t + 1])[0] for t in range(8, ids.shape[1] - 1)]
    return torch.stack(rows), rt


def lockstep_windows(model, spec: str, ids: torch.Tensor) -> list[bool]:
    """Both paths of :func:`decode` fed side by side: per forward, whether some layer's stored 16-bit exact window
    differs between them (by one float16 or bfloat16 step of an element, nothing else; a float32 window of a later
    layer differs by the float32 rounding of the layers before it)."""
    wrapped, plain = decode(model, spec, ids[:, :8])[1], decode(model, spec, ids[:, :8], wrapped=False)[1]
    flips = [windows_differ(wrapped, plain)]
    for t in range(8, ids.shape[1] - 1):
        wrapped.feed(ids[:, t : t + 1])
        plain.feed(ids[:, t : t + 1])
        flips.append(windows_differ(wrapped, plain))
    return flips


def windows_differ(a: Runtime, b: Runtime) -> bool:
    differ = False
    for la, lb in zip(a.policy.model_cache.layers, b.policy.model_cache.layers):
        for sa, sb in ((la.k, lb.k), (la.v, lb.v)):
            if sa.tail is None or sa.tail.dtype == torch.float32 or torch.equal(sa.tail, sb.tail):
                continue
            steps = (sa.tail.view(torch.int16).int() - sb.tail.view(torch.int16).int()).abs()
            assert steps.max() == 1 and (sa.tail.sign() == sb.tail.sign()).all()
            differ = True
    return differ


def model_for(arch: str, implementation: str):
    model = random_model(arch, scale=4.0)
    if implementation != "eager":
        model.set_attn_implementation(implementation)
    return model


@pytest.mark.parametrize("arch,implementation", [("llama", "eager"), ("qwen2", "eager"), ("gemma2", "eager"),
                                                 ("gpt2", "eager"), ("llama", "sdpa"), ("qwen2", "sdpa"),
                                                 ("gpt2", "sdpa")])
@pytest.mark.parametrize("spec", SPECS)
def test_attention_in_the_space_equals_rotating_every_stored_token_back(arch, implementation, spec):
    """GQA (llama, qwen2), sliding layers and softcapped scores (gemma2, eager), absolute positions (gpt2); the
    layers worked on together and alone; both exact-window dtypes."""
    model = model_for(arch, implementation)
    ids = torch.arange(3, 60).unsqueeze(0)
    new, rt = decode(model, spec, ids)
    assert rt._attention is not None and model.config._attn_implementation == attention.PREFIX + implementation
    old, rt_old = decode(model, spec, ids, wrapped=False)
    assert rt_old._attention is None
    windows = lockstep_windows(model, spec, ids)
    for step, flipped in enumerate(windows):
        # float32 rounding of the products: 2e-5; where a 16-bit exact window holds an element one float16 step
        # apart (a later layer's input differs by float32 rounding, and sits on a float16 rounding boundary), that
        # step's element moves by 2^-11 of itself: the logits within 1e-4 (the negative controls move them > 1e-3)
        torch.testing.assert_close(new[step], old[step], rtol=0, atol=1e-4 if flipped else 2e-5)
    # what is stored is unchanged: the first layer's codes and exact window bit for bit (its keys and values come
    # from the embeddings; a later layer's carry the float32 rounding of the attention before it), every layer's bytes
    a, b = rt.policy.model_cache.layers[0], rt_old.policy.model_cache.layers[0]
    for sa, sb in ((a.k, b.k), (a.v, b.v)):
        assert (sa.q is None) == (sb.q is None) and (sa.tail is None) == (sb.tail is None)
        assert sa.q is None or (torch.equal(sa.q.codes, sb.q.codes) and torch.equal(sa.q.scale, sb.q.scale))
        assert sa.tail is None or torch.equal(sa.tail, sb.tail)
    assert rt.policy.layer_nbytes() == rt_old.policy.layer_nbytes()


def test_the_new_path_never_rotates_a_stored_token_back(monkeypatch):
    """The old path's per-token product (Layout.dequantize with its R^T, turbo's dequantize) is never called while
    decoding through the wrapper; it is called without it (so the spy can see it)."""
    calls = []
    for cls in (Layout, TurboLayout):
        original = cls.dequantize

        def spy(self, *args, original=original, **kwargs):
            calls.append(type(self).__name__)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "dequantize", spy)
    model = random_model("llama", scale=4.0)
    ids = torch.arange(3, 40).unsqueeze(0)
    for spec in ("quant:bits=4,axis=kivi,residual=4,kivi_keys=window,rotate=random", "turbo:bits=3"):
        decode(model, spec, ids)
        assert calls == [], spec
        decode(model, spec, ids, wrapped=False)
        assert calls, spec
        calls.clear()


def test_a_wrong_output_rotation_fails_the_oracle(monkeypatch):
    """Negative control: the output rotated by R where R^T belongs (a random R: Hadamard is its own transpose)."""
    model = random_model("llama", scale=4.0)
    ids = torch.arange(3, 40).unsqueeze(0)
    spec = "quant:bits=4,axis=token,rotate=random"
    old, _ = decode(model, spec, ids, wrapped=False)
    monkeypatch.setattr(Layout, "output_from_space",
                        lambda self, o: o if self.rotation is None else self.rotation.forward(o).to(o.dtype))
    wrong, _ = decode(model, spec, ids)
    assert not torch.allclose(wrong, old, atol=1e-3)


def test_dropping_turbos_qjl_term_fails_the_oracle(monkeypatch):
    """Negative control: the doubled head dim carries the residual's estimate (a query without it differs)."""
    model = random_model("llama", scale=4.0)
    ids = torch.arange(3, 40).unsqueeze(0)
    old, _ = decode(model, "turbo:bits=3", ids, wrapped=False)
    monkeypatch.setattr(TurboLayout, "qjl_scale", property(lambda self: 0.0))
    wrong, _ = decode(model, "turbo:bits=3", ids)
    assert not torch.allclose(wrong, old, atol=1e-3)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_the_models_own_attention_is_set_back_after_the_run(implementation):
    model = model_for("llama", implementation)
    ids = torch.arange(3, 30).unsqueeze(0)
    plain, _ = decode(model, "full", ids)
    assert model.config._attn_implementation == implementation  # a cache without a space installs nothing
    a = Runtime.create(model, parse_cache_spec("turbo:bits=3"))
    b = Runtime.create(model, parse_cache_spec("quant:bits=4,rotate=hadamard"))
    assert model.config._attn_implementation == attention.PREFIX + implementation
    a.feed(ids)
    # the wrapper is transparent to another runtime on the same model: the full cache's logits, bit for bit
    assert torch.equal(decode(model, "full", ids)[0], plain)
    del a
    gc.collect()
    assert model.config._attn_implementation == attention.PREFIX + implementation  # b still holds it
    b.feed(ids)
    del b
    gc.collect()
    assert model.config._attn_implementation == implementation
    assert torch.equal(decode(model, "full", ids)[0], plain)


def test_a_model_whose_attention_cannot_be_wrapped_rotates_back():
    """GPT-2's reordered-and-upcast eager attention runs outside the registry: no wrapper, the old path, the same
    numbers as the wrapped path of the same model without that option."""
    model = random_model("gpt2", scale=4.0, reorder_and_upcast_attn=True)
    ids = torch.arange(3, 30).unsqueeze(0)
    got, rt = decode(model, "quant:bits=4,rotate=random", ids)
    assert rt._attention is None and model.config._attn_implementation == "eager"
    plain = random_model("gpt2", scale=4.0)
    torch.testing.assert_close(got, decode(plain, "quant:bits=4,rotate=random", ids)[0], rtol=0, atol=2e-5)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("prod", [True, False])
@pytest.mark.parametrize("dim", [16, 20, 64])
def test_turbos_table_decoding_equals_the_planes_decoded_one_coordinate_at_a_time(bits, prod, dim):
    """The nibble and sign tables against from_planes + a centroid per coordinate (a head dim that is not a multiple
    of 8 included: the last byte's padding dropped)."""
    from decodelab.core.kv.quantize import unpack
    from decodelab.core.kv.turbo import from_planes

    layout = TurboLayout(bits, prod, torch.float16, dim)
    q = layout.quantize(torch.randn(2, 3, 7, dim, generator=torch.Generator().manual_seed(bits)))
    width = -(-dim // 8)
    norm = q.scale.float()
    want = layout.centroids[from_planes(q.codes[..., : layout.mse_bits * width], layout.mse_bits, dim).long()] * norm
    if prod:
        signs = unpack(q.codes[..., layout.mse_bits * width :], 1, dim, torch.float32) * 2 - 1
        want = torch.cat([want, signs * norm * q.zero.float()], -1)
    assert torch.equal(layout.dequantize_in_space(q, torch.float32), want)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("spec", ["quant:bits=4,axis=kivi,residual=4,kivi_keys=window,rotate=random", "turbo:bits=3"])
def test_in_bfloat16_the_two_paths_differ_by_rounding_well_below_what_quantization_costs(implementation, spec):
    """bfloat16: the query, the output and the new tokens are rotated in float32 and rounded once, the stored tokens
    read without a product; the paths then differ by bfloat16 rounding of the logits, less than half of what the
    quantization itself moves them from the full cache."""
    model = model_for("llama", implementation).to(torch.bfloat16)
    ids = torch.arange(3, 60).unsqueeze(0)
    full, _ = decode(model, "full", ids)
    new, rt = decode(model, spec, ids)
    assert rt._attention is not None
    old, _ = decode(model, spec, ids, wrapped=False)
    assert (new - old).abs().max() < 0.5 * (old - full).abs().max()


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_the_nibble_index_of_every_byte(bits):
    """Every byte value in every plane (the one- and two-plane shortcut on the bytes included) against the index
    written out bit by bit: plane j's low nibble in bits [4 j, 4 j + 4) of the low index, its high nibble likewise."""
    from decodelab.core.kv.turbo import nibble_index

    width = 3
    planes = torch.randint(0, 256, (5, 7, bits * width), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    planes[0, :, :] = torch.arange(7 * bits * width).reshape(7, -1) * 37 % 256
    got = nibble_index(planes, bits, width)
    p = planes.long()
    want_low = sum(((p[..., j * width : (j + 1) * width] & 15) << (4 * j)) for j in range(bits))
    want_high = sum(((p[..., j * width : (j + 1) * width] >> 4) << (4 * j)) for j in range(bits))
    assert got.dtype == torch.int32
    assert torch.equal(got.long(), torch.stack([want_low, want_high], -1))


@pytest.mark.parametrize("spec", ["quant:bits=4,axis=kivi,residual=4,kivi_keys=window,rotate=random", "turbo:bits=3"])
def test_two_rows_reordered_attend_alike_on_both_paths(spec):
    """Rows of a batch (each its own rooms in the workspace) and a reorder between forwards (beam search): the
    rotated-space path against the rotate-back path."""
    model = random_model("llama", scale=4.0)
    ids = torch.stack([torch.arange(3, 40), torch.arange(50, 87)])

    def run(wrapped: bool) -> torch.Tensor:
        if wrapped:
            rt = Runtime.create(model, parse_cache_spec(spec))
        else:
            install = runtime_module.install_for
            runtime_module.install_for = lambda model, space: None
            try:
                rt = Runtime.create(model, parse_cache_spec(spec))
            finally:
                runtime_module.install_for = install
        assert (rt._attention is not None) == wrapped
        rows = [rt.prefill(ids[:, :8])]
        for t in range(8, ids.shape[1]):
            if t == 20:
                rt.reorder(torch.tensor([1, 0]))
            rows.append(rt.feed(ids[:, t : t + 1]))
        return torch.stack(rows)

    torch.testing.assert_close(run(True), run(False), rtol=0, atol=2e-5)



@pytest.mark.parametrize("bits", [1, 2])
def test_the_byte_table_decodes_every_pair_of_plane_bytes_as_from_planes_does(bits):
    """Every byte value of every plane (all 65,536 pairs for two planes), decoded by one row of the byte table per
    byte position, against from_planes and a centroid per coordinate."""
    import torch.nn.functional as F

    from decodelab.core.kv.turbo import byte_index, byte_table, from_planes, lloyd_max

    centroids = lloyd_max(32, bits).float()
    values = torch.arange(2 ** (8 * bits))
    planes = torch.stack([(values >> (8 * j)) & 255 for j in range(bits)], -1).to(torch.uint8)  # [N, bits], width 1
    got = F.embedding(byte_index(planes, bits, 1), byte_table(centroids, bits)).flatten(-2)
    assert torch.equal(got, centroids[from_planes(planes, bits, 8).long()])
