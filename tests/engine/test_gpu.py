"""CUDA checks (run with `pytest -m gpu` on a machine with a GPU; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_model

from decodelab.core.methods.sample import DecodeState, decode_tokens
from decodelab.core.engine.stopping import StopRules
from decodelab.core.sampling.chain import build_chain
from decodelab.core.sampling.select import Greedy, Multinomial, make_generator

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

PROMPT = [5, 17, 42, 9, 77, 3]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_greedy_equals_generate_on_cuda(arch):
    model = random_model(arch, seed=0, scale=8.0).cuda()
    state = DecodeState()
    ours = [d.token_id for d in decode_tokens(model, PROMPT, build_chain({"temperature": 0}), Greedy(),
                                              StopRules(24), state=state)]
    ref = model.generate(torch.tensor([PROMPT], device="cuda"), do_sample=False, max_new_tokens=24,
                         min_new_tokens=24)
    assert ours == ref[0, len(PROMPT):].tolist()


def test_seeded_sampling_is_reproducible_on_cuda():
    model = random_model("llama", seed=1, scale=2.0).cuda()
    chain = build_chain({"temperature": 1.0, "top-p": 0.9})

    def run():
        selector = Multinomial(make_generator(3, "cuda"))
        return [d.token_id for d in decode_tokens(model, PROMPT, chain, selector, StopRules(16))]

    assert run() == run()
