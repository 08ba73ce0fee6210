"""The client against a real vLLM server on the bundled tiny model, checked against the model run locally by
transformers (float32). Needs the vLLM venv (.ci/vllm-venv.sh) and $DECODELAB_VLLM_PYTHON pointing at its python:

    DECODELAB_VLLM_PYTHON=~/.cache/decodelab/vllm-0.32.0/bin/python pytest -m vllm tests/engine/test_vllm_real.py

It starts the server twice (--logprobs-mode raw_logprobs, then processed_logprobs), about 90-200 s each on 2 cores.
The client is checked directly (ServedEngine), then the decodelab commands with --engine (score, greedy sample,
sample under 15 settings, check-logprobs) against the model run here.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from record_vllm import EOS, GREEDY, SAMPLING, snippets  # noqa: E402
from vllm_server import SERVED_NAME, TINY, vllm_server  # noqa: E402

from decodelab.core.engine.http.client import ServedEngine  # noqa: E402
from decodelab.core.engine.http.transport import EngineError  # noqa: E402
from decodelab.core.engine.http.wire import PROCESSED, RAW, SamplingSettings  # noqa: E402

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


# --------------------------------------------------------------------------------------------------------------
# the decodelab commands with --engine against the live server, checked against the model run here

CLI_SETTINGS = [  # (name, sampling options): each alone, then combined; >= 10 as the issue asks
    ("t1.0", ["-t", "1.0"]),
    ("t0.7", ["-t", "0.7"]),
    ("t1.3", ["-t", "1.3"]),
    ("top_p0.9", ["-t", "1.0", "--top-p", "0.9"]),
    ("top_k3", ["-t", "1.0", "--top-k", "3"]),
    ("top_k5_t0.8", ["-t", "0.8", "--top-k", "5"]),
    ("min_p0.1", ["-t", "1.0", "--min-p", "0.1"]),
    ("rep1.3", ["-t", "1.0", "--repetition-penalty", "1.3"]),
    ("presence0.5", ["-t", "1.0", "--presence-penalty", "0.5"]),
    ("frequency0.7", ["-t", "1.0", "--frequency-penalty", "0.7"]),
    ("t0.8_p0.95_k20", ["-t", "0.8", "--top-p", "0.95", "--top-k", "20"]),
    ("t0.9_minp0.05_rep1.1", ["-t", "0.9", "--min-p", "0.05", "--repetition-penalty", "1.1"]),
    ("bias", ["-t", "1.0", "--logit-bias", "284=5", "--logit-bias", "525=-5"]),
    ("greedy_rep1.5", ["-t", "0", "--repetition-penalty", "1.5"]),
    ("min_new_tokens4", ["-t", "1.0", "--min-new-tokens", "4"]),
]
CLI_PROMPT = "And God said, Let there be light"
CLI_TEXT = "God blessed Noah and his sons, and said unto them, Be fruitful, and multiply."


def cli_json(cli, *args) -> dict:
    code, out, err = cli(*args, "-f", "json")
    assert code == 0, err
    return json.loads(out)


def test_cli_score_equals_local_score(served, cli):
    mode, engine = served
    doc = cli_json(cli, "score", CLI_TEXT, "--engine", engine.url)
    local = cli_json(cli, "score", CLI_TEXT, "--dtype", "float32")
    assert doc["engine"]["logprobs_mode"] == mode
    assert [s["token_id"] for s in doc["steps"]] == [s["token_id"] for s in local["steps"]]
    for a, b in zip(doc["steps"], local["steps"]):
        assert a["raw_logprob"] == pytest.approx(b["raw_logprob"], abs=TOL) and a["raw_rank"] == b["raw_rank"]
    assert doc["summary"]["perplexity"] == pytest.approx(local["summary"]["perplexity"], rel=TOL)


def test_cli_greedy_sample_equals_local_token_for_token(served, cli):
    _, engine = served
    args = ["sample", CLI_PROMPT, "-n", "24", "-t", "0", "--ignore-eos"]
    assert cli_json(cli, *args, "--engine", engine.url)["token_ids"] == \
        cli_json(cli, *args, "--dtype", "float32")["token_ids"]


@pytest.mark.parametrize("name, options", CLI_SETTINGS, ids=[n for n, _ in CLI_SETTINGS])
def test_cli_sample_logprobs_equal_semantics_vllm_locally(served, cli, name, options):
    """`sample --engine`'s raw and processed numbers against decodelab's own chain read with --semantics vllm,
    teacher-forced on the engine's tokens (the same settings resolved by the same options)."""
    import torch

    from decodelab.core.engine.models import load_model
    from decodelab.core.methods.sample import SampleSettings
    from decodelab.core.sampling.replay import along as chain_along, forced_logits
    from decodelab.core.sampling.chain import make_chain
    from decodelab.core.settings import coerce

    mode, engine = served
    extra = [] if name == "min_new_tokens4" else ["--ignore-eos"]
    doc = cli_json(cli, "sample", CLI_PROMPT, "-n", "8", "--seed", "7", *options, *extra, "--engine", engine.url)
    lm = load_model("tiny", device="cpu", dtype="float32")
    config = {k: coerce(SampleSettings, k, v) if isinstance(v, dict) else v for k, v in doc["config"].items()
              if k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                       "frequency_penalty", "min_new_tokens", "seed") and v is not None}
    bias = tuple((t, b) for t, b in (doc["config"]["logit_bias"] or {}).items())
    settings = SampleSettings(**config, logit_bias=bias, semantics="vllm")
    prompt, out = doc["prompt"]["token_ids"], doc["token_ids"]
    logits = forced_logits(lm.model, prompt, out)
    raw = torch.log_softmax(logits.double(), -1)
    greedy = settings.temperature == 0
    stages = chain_along(make_chain(lm, settings), prompt, out, logits, record=True)
    for i, s in enumerate(doc["steps"]):
        assert s["raw_logprob"] == pytest.approx(float(raw[i, s["token_id"]]), abs=TOL)
        if mode == "processed_logprobs":
            z = [v for n, v in stages[i] if not (greedy and n == "temperature")][-1]
            processed = torch.log_softmax(z.double(), -1)
            assert s["logprob"] == pytest.approx(float(processed[s["token_id"]]), abs=TOL)
            for a in s["alternatives"]:
                assert a["prob"] == pytest.approx(math.exp(float(processed[a["token_id"]])), abs=TOL)


def test_cli_check_logprobs_labels_raw_and_processed_and_flags_a_duplicate(served, cli, tmp_path):
    from fake_server import duplicate_sampled

    from decodelab.core.engine.http.transport import Transport

    mode, engine = served
    doc = cli_json(cli, "check-logprobs", "--engine", engine.url, "--prompt", CLI_PROMPT, "-n", "8", "-t", "0.7",
                   "--top-k", "5", "--seed", "2", "--ignore-eos")
    labels = doc["summary"]["labels"]
    if mode == "raw_logprobs":
        assert labels["raw"] == 8 and doc["summary"]["verdict"].startswith("raw")
    else:
        assert labels["renormalized"] == 8 and doc["summary"]["verdict"].startswith("processed")
    assert doc["summary"]["vs_label"]["max_abs_delta"] < TOL and not doc["summary"]["defects"]
    # a logged answer with the sampled token injected twice into its top logprobs
    body = {"model": engine.model, "prompt": doc["answers"][0]["prompt_token_ids"], "max_tokens": 6,
            "temperature": 0.7, "top_k": 5, "seed": 2, "logprobs": 5, "ignore_eos": True,
            "return_tokens_as_token_ids": True}
    transport = Transport(engine.url, 120)
    import urllib.request

    req = urllib.request.Request(engine.url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    status, raw = transport.exchange(req, "POST /v1/completions")
    assert status == 200
    answer = duplicate_sampled(raw.decode())
    path = tmp_path / "logged.jsonl"
    path.write_text(f'{{"request": {json.dumps(body)}, "response": {answer}}}\n')
    checked = cli_json(cli, "check-logprobs", str(path))
    assert any("listed 2 times in top logprobs" in d for d in checked["summary"]["defects"])
    assert checked["summary"]["labels"]["renormalized" if mode == "processed_logprobs" else "raw"] == 6
