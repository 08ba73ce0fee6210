"""The client against a real vLLM server on the bundled tiny model, checked against the model run locally by
transformers (float32). Needs the vLLM venv (.ci/vllm-venv.sh) and $DECODELAB_VLLM_PYTHON pointing at its python:

    DECODELAB_VLLM_PYTHON=~/.cache/decodelab/vllm-0.32.0/bin/python pytest -m vllm tests/engine/test_vllm_real.py

It starts the server twice (--logprobs-mode raw_logprobs, then processed_logprobs), about 90 s each on 2 cores.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from record_vllm import EOS, GREEDY, SAMPLING, snippets  # noqa: E402
from vllm_server import SERVED_NAME, TINY, vllm_server  # noqa: E402

from decodelab.core.engine.served import PROCESSED, RAW, EngineError, SamplingSettings, ServedEngine  # noqa: E402

PYTHON = os.environ.get("DECODELAB_VLLM_PYTHON")
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not PYTHON or not Path(PYTHON).exists(),
                                 reason="set DECODELAB_VLLM_PYTHON to the vLLM venv's python (.ci/vllm-venv.sh)")]
TOL = 1e-4


@pytest.fixture(scope="module")
def local():
    """The tiny model in float32 and a function: token ids -> per-position logits (float64 for the reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()

    def logits(ids: list[int]):
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].double()

    return logits


@pytest.fixture(scope="module", params=["raw_logprobs", "processed_logprobs"])
def served(request):
    with vllm_server(request.param, Path(PYTHON)) as url:
        yield request.param, ServedEngine(url, model=SERVED_NAME, logprobs_mode=request.param, timeout=120)


def vllm_processed(z, s: SamplingSettings, prompt: list[int], output: list[int]):
    """vLLM's processed logprobs for one step (v1/sample/sampler.py): min_tokens mask and logit bias, then
    repetition (prompt + output), frequency and presence (output) penalties; greedy rows stop there; random rows
    then get temperature, min-p (against the top probability), top-k (ties at the k-th kept), top-p (ascending
    cumulative mass <= 1 - p removed, the top token always kept)."""
    import torch

    z = z.clone()
    if len(output) < s.min_tokens and not s.ignore_eos:
        z[list({EOS, *s.stop_token_ids})] = -math.inf
    for token, bias in s.logit_bias.items():
        z[token] += bias
    seen = torch.zeros_like(z, dtype=torch.bool)
    seen[prompt + output] = True
    z = torch.where(seen, torch.where(z > 0, z / s.repetition_penalty, z * s.repetition_penalty), z)
    counts = torch.zeros_like(z)
    for token in output:
        counts[token] += 1
    z = z - s.frequency_penalty * counts - s.presence_penalty * (counts > 0)
    if s.temperature < 1e-5:
        return torch.log_softmax(z, -1)
    z = z / s.temperature
    if s.min_p > 0:
        p = torch.softmax(z, -1)
        z = z.masked_fill(p < s.min_p * p.max(), -math.inf)
    if s.top_k > 0:
        z = z.masked_fill(z < torch.topk(z, s.top_k).values[-1], -math.inf)
    if s.top_p < 1:
        ordered, order = z.sort()
        drop = torch.softmax(ordered, -1).cumsum(-1) <= 1 - s.top_p
        drop[-1] = False
        z[order[drop]] = -math.inf
    return torch.log_softmax(z, -1)


def test_models(served):
    _, engine = served
    assert engine.model == SERVED_NAME and engine.adapter.kind == "vllm"


def test_score_equals_local_log_softmax(served, local):
    import torch

    _, engine = served
    for ids in snippets():
        scored = engine.score(ids, top_n=5)
        assert scored.labels.values == RAW and scored.positions[0].logprob is None
        ref = torch.log_softmax(local(ids), -1)
        for p in scored.positions[1:]:
            row = ref[p.index - 1]
            assert p.logprob == pytest.approx(row[p.token_id].item(), abs=TOL)
            assert p.rank == int((row >= row[p.token_id]).sum())
            for alt in p.top:
                assert alt.logprob == pytest.approx(row[alt.token_id].item(), abs=TOL)


def test_greedy_equals_local_argmax(served, local):
    _, engine = served
    for prompt in (ids[:12] for ids in snippets()[:3]):
        g = engine.generate(prompt, GREEDY)
        seq = list(prompt)
        for _ in range(GREEDY.max_tokens):
            seq.append(int(local(seq)[-1].argmax()))
        assert list(g.token_ids) == seq[len(prompt):]


@pytest.mark.parametrize("name, settings", SAMPLING, ids=[n for n, _ in SAMPLING])
def test_sampled_logprobs_equal_the_local_recomputation(served, local, name, settings):
    """Each step's value for the sampled token and its top-N: raw = local log softmax; processed = local
    log softmax after vLLM's processors (vllm_processed)."""
    import torch

    mode, engine = served
    prompt = snippets()[0][:12]
    g = engine.generate(prompt, settings)
    assert g.labels.values == (RAW if mode == "raw_logprobs" else PROCESSED) and not g.defects
    logits = local(prompt + list(g.token_ids))
    for i, step in enumerate(g.steps):
        z = logits[len(prompt) + i - 1]
        ref = torch.log_softmax(z, -1) if mode == "raw_logprobs" else \
            vllm_processed(z, settings, prompt, list(g.token_ids[:i]))
        assert ref[step.token_id].item() > -math.inf, "vLLM drew a token its own processors remove"
        assert step.logprob == pytest.approx(ref[step.token_id].item(), abs=TOL)
        for alt in step.top:
            expected = ref[alt.token_id].item()
            assert (alt.logprob == expected == -math.inf) or alt.logprob == pytest.approx(expected, abs=TOL)


def test_seeded_sampling_repeats(served):
    _, engine = served
    name, settings = SAMPLING[0]
    prompt = snippets()[0][:12]
    assert engine.generate(prompt, settings).token_ids == engine.generate(prompt, settings).token_ids


def test_server_errors_are_one_line(served):
    _, engine = served
    with pytest.raises(EngineError) as err:
        engine.generate([5, 6], SamplingSettings(temperature=2.5))
    assert "\n" not in str(err.value) and "HTTP 400: temperature must be in [0, 2]" in str(err.value)
