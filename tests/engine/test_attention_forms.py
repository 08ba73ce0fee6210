"""Greedy == generate with the attention implementation a GPU loads by default (sdpa), not only the eager one the
other tests build (issue 34, item 4: on CUDA the same weights parted after 44 tokens). Same model object on both
sides, so the same attention implementation; the runtime's mask form must give the same argmaxes."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, small_config

from decodelab.core.engine.stopping import StopRules
from decodelab.core.methods.sample import decode_tokens
from decodelab.core.sampling.chain import build_chain
from decodelab.core.sampling.select import Greedy

PROMPT = [5, 17, 42, 9, 77, 3, 17, 42, 8, 1]


def sdpa_model(arch: str, dtype):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(4)
    impl = None if arch == "gemma2" else "sdpa"  # gemma2 (soft-capping) has no sdpa path: its default
    model = AutoModelForCausalLM.from_config(small_config(arch, 256), attn_implementation=impl)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_generate_under_sdpa(arch, dtype):
    model = sdpa_model(arch, dtype)
    assert arch == "gemma2" or model.config._attn_implementation == "sdpa"
    n = 32
    ours = [d.token_id for d in decode_tokens(model, PROMPT, build_chain({"temperature": 0}), Greedy(),
                                              StopRules(n, ignore_eos=True))]
    ids = torch.tensor([PROMPT])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                         eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    at = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    assert ours == ref, f"first divergence at {at}"
