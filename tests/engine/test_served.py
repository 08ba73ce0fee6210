"""decodelab's client for served engines against vLLM's recorded answers (tests/engine/fake_server.py): parsing,
labels, what vLLM's processed logprobs are, and every failure as one line."""

from __future__ import annotations

import json
import math
import sys
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_server import RECORDING, duplicate_sampled, fake_vllm, load_recording  # noqa: E402,F401

from decodelab.core.engine.served import (  # noqa: E402
    PROCESSED,
    RAW,
    EngineError,
    LlamacppAdapter,
    SamplingSettings,
    ServedEngine,
    SglangAdapter,
    Transport,
    VllmAdapter,
    base_url,
)

pytestmark = pytest.mark.skipif(not RECORDING.exists(), reason="no vLLM recording")
MODES = ("raw_logprobs", "processed_logprobs")
GENERATION_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "seed", "max_tokens", "min_tokens", "ignore_eos", "logprobs",
                     "logit_bias", "stop_token_ids")


def recorded(mode: str, kind: str) -> list[dict]:
    """The recorded request bodies of one kind: "score" (prompt_logprobs), "generate" (logprobs), that succeeded."""
    key = "prompt_logprobs" if kind == "score" else "logprobs"
    return [x["body"] for x in load_recording()["modes"][mode]
            if x["status"] == 200 and x["path"] == "/v1/completions" and key in x["body"]
            and "echo" in x["body"] and not x["body"]["echo"]]


def settings_of(body: dict) -> SamplingSettings:
    """The SamplingSettings that produced a recorded generate body (the client writes every field)."""
    fields = {k: body[k] for k in GENERATION_FIELDS}
    fields["logit_bias"] = {int(t): b for t, b in fields["logit_bias"].items()}
    fields["stop_token_ids"] = tuple(fields["stop_token_ids"])
    return SamplingSettings(**fields)


def engine(server, mode="raw_logprobs", **kw) -> ServedEngine:
    return ServedEngine(server.url, logprobs_mode=mode, **kw)


def one_line(err: pytest.ExceptionInfo, url: str) -> str:
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"--engine {base_url(url)}: "), text
    return text


# --------------------------------------------------------------------------------------------------------------
# parsing and labels


def test_discovers_the_model_and_the_server_kind(fake_vllm):
    e = engine(fake_vllm())
    assert e.model == "tiny" and e.adapter.kind == "vllm"
    assert e.capabilities.score and e.capabilities.generate and not e.capabilities.full_logits


@pytest.mark.parametrize("mode", MODES)
def test_score_positions_ranks_and_top_n(fake_vllm, mode):
    e = engine(fake_vllm(mode), mode)
    for body in recorded(mode, "score"):
        s = e.score(body["prompt"], top_n=body["prompt_logprobs"])
        assert s.labels.values == RAW, "prompt logprobs are raw in every --logprobs-mode"
        assert [p.token_id for p in s.positions] == body["prompt"]
        assert s.positions[0].logprob is None and s.positions[0].rank is None
        for p in s.positions[1:]:
            values = [a.logprob for a in p.top]
            assert len(p.top) == 5 and values == sorted(values, reverse=True)
            assert p.logprob <= 0 and p.rank >= 1 and not p.defects
            assert 0.0 <= p.tail_mass() <= 1.0
            if p.rank <= 5:  # a token ranked within the top N is listed there with the same value
                assert any(a.token_id == p.token_id and a.logprob == p.logprob for a in p.top)
            else:
                assert p.logprob <= values[-1]


def test_prompt_logprobs_identical_under_both_modes(fake_vllm):
    raw, processed = engine(fake_vllm(MODES[0])), engine(fake_vllm(MODES[1]), MODES[1])
    for body in recorded(MODES[1], "score"):
        a, b = raw.score(body["prompt"], 5), processed.score(body["prompt"], 5)
        assert a.positions == b.positions


def test_greedy_takes_the_top_token_and_modes_agree(fake_vllm):
    raw, processed = engine(fake_vllm(MODES[0])), engine(fake_vllm(MODES[1]), MODES[1])
    greedy = [b for b in recorded(MODES[0], "generate") if b["temperature"] == 0 and b["repetition_penalty"] == 1]
    assert len(greedy) == 3
    for body in greedy:
        a = raw.generate(body["prompt"], settings_of(body))
        b = processed.generate(body["prompt"], settings_of(body))
        assert a.token_ids == b.token_ids and len(a.token_ids) == body["max_tokens"]
        assert a.labels.values == RAW and b.labels.values == PROCESSED
        for step in a.steps:
            assert step.rank == 1 and step.top[0].token_id == step.token_id
        # a greedy row is processed without temperature or filters: with no penalty, processed == raw
        assert [s.logprob for s in a.steps] == pytest.approx([s.logprob for s in b.steps], abs=1e-6)


def test_seeded_sampling_gives_the_same_tokens_in_both_modes(fake_vllm):
    raw, processed = engine(fake_vllm(MODES[0])), engine(fake_vllm(MODES[1]), MODES[1])
    seeded = [b for b in recorded(MODES[0], "generate") if b["seed"] is not None]
    assert len(seeded) >= 12
    for body in seeded:
        assert raw.generate(body["prompt"], settings_of(body)).token_ids == \
            processed.generate(body["prompt"], settings_of(body)).token_ids


def test_processed_logprobs_are_raw_over_temperature_renormalised_over_the_kept_set(fake_vllm):
    """Where vLLM's processed top N lists a removed token (-inf), the whole kept set is listed: each kept token's
    processed logprob is raw / T minus the log-sum-exp of raw / T over the kept set (no penalty, no bias)."""
    raw, processed = engine(fake_vllm(MODES[0])), engine(fake_vllm(MODES[1]), MODES[1])
    checked = 0
    for body in recorded(MODES[1], "generate"):
        s = settings_of(body)
        if s.temperature == 0 or s.logit_bias or (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) \
                != (1.0, 0.0, 0.0):
            continue
        a, b = raw.generate(body["prompt"], s), processed.generate(body["prompt"], s)
        for ra, pr in zip(a.steps, b.steps):
            kept = [alt for alt in pr.top if alt.logprob > -math.inf]
            if len(kept) == len(pr.top):
                continue  # the kept set may reach past the listed N: nothing exact to check
            raw_of = {alt.token_id: alt.logprob for alt in ra.top}
            if not all(alt.token_id in raw_of for alt in kept):
                continue
            lse = math.log(math.fsum(math.exp(raw_of[alt.token_id] / s.temperature) for alt in kept))
            for alt in kept:
                assert alt.logprob == pytest.approx(raw_of[alt.token_id] / s.temperature - lse, abs=1e-5)
            assert math.fsum(math.exp(alt.logprob) for alt in kept) == pytest.approx(1.0, abs=1e-5)
            checked += 1
    assert checked >= 8


def test_generation_request_writes_every_sampling_field(fake_vllm):
    e = engine(fake_vllm())
    body = recorded(MODES[0], "generate")[3]
    g = e.generate(body["prompt"], settings_of(body))
    for key in GENERATION_FIELDS + ("return_tokens_as_token_ids", "add_special_tokens"):
        assert key in g.request
    assert g.request["return_tokens_as_token_ids"] is True and g.request["add_special_tokens"] is False
    assert g.labels.describe() == "raw values from vllm, exact for the listed tokens, top-5 truncated"


def test_a_duplicated_sampled_token_is_flagged(fake_vllm):
    e = engine(fake_vllm(fault="duplicate"))
    body = recorded(MODES[0], "generate")[3]
    g = e.generate(body["prompt"], settings_of(body))
    assert len(g.defects) == 1 and "listed 2 times in top logprobs" in g.defects[0]
    assert g.steps[0].defects and not g.steps[1].defects


def test_duplicate_injection_repeats_a_json_key():
    text = '{"choices": [{"logprobs": {"tokens": ["token_id:7"], "token_logprobs": [-0.5], ' \
           '"top_logprobs": [{"token_id:7": -0.5, "token_id:3": -1.0}]}}]}'
    assert duplicate_sampled(text).count('"token_id:7": -0.5') == 2


# --------------------------------------------------------------------------------------------------------------
# every failure is one line naming --engine URL


def test_connection_refused(fake_vllm):
    server = fake_vllm(fault="refused")
    with pytest.raises(EngineError) as err:
        engine(server).model
    assert "connection refused" in one_line(err, server.url)


def test_timeout(fake_vllm):
    server = fake_vllm(fault="timeout")
    with pytest.raises(EngineError) as err:
        engine(server, timeout=0.3).models()
    assert "no answer within 0.3 s (timeout)" in one_line(err, server.url)


def test_http_error_carries_the_servers_message(fake_vllm):
    server = fake_vllm()
    with pytest.raises(EngineError) as err:
        engine(server).generate([5, 6, 7], SamplingSettings(max_tokens=8, ignore_eos=True, temperature=2.5))
    assert "HTTP 400: temperature must be in [0, 2], got 2.5." in one_line(err, server.url)


def test_out_of_vocabulary_id(fake_vllm):
    server = fake_vllm()
    body = next(x["body"] for x in load_recording()["modes"][MODES[0]] if x["body"] and x["body"].get("prompt") == [5000])
    with pytest.raises(EngineError) as err:
        engine(server).generate([5000], settings_of(body))
    assert "HTTP 400: Token id 5000 is out of vocabulary" in one_line(err, server.url)


def test_an_unrecorded_request_is_a_clear_404(fake_vllm):
    server = fake_vllm()
    with pytest.raises(EngineError) as err:
        engine(server).score([1, 2, 3], top_n=4)
    assert "HTTP 404: fake server: no recorded answer for POST /v1/completions" in one_line(err, server.url)


@pytest.mark.parametrize("kind", ["score", "generate"])
def test_an_answer_without_logprobs(fake_vllm, kind):
    server = fake_vllm(fault="no_logprobs")
    body = recorded(MODES[0], kind)[0]
    with pytest.raises(EngineError) as err:
        if kind == "score":
            engine(server).score(body["prompt"], 5)
        else:
            engine(server).generate(body["prompt"], settings_of(body))
    assert "the answer has no" in one_line(err, server.url)


def test_model_name_mismatch(fake_vllm):
    server = fake_vllm()
    with pytest.raises(EngineError) as err:
        ServedEngine(server.url, model="llama-70b").model
    assert "serves 'tiny', not 'llama-70b' (model name mismatch)" in one_line(err, server.url)


@pytest.mark.parametrize("change, message", [
    (dict(temperature=0.005), "vLLM raises 0 < t < 0.01 to 0.01"),
    (dict(logit_bias={5: 150.0}), "vLLM clamps biases to [-100, 100]"),
    (dict(logprobs=21), "top 21 logprobs asked; the limit is 0..20"),
    (dict(logprobs=0), "generate needs logprobs >= 1"),
])
def test_settings_vllm_would_change_silently_are_refused(fake_vllm, change, message):
    server = fake_vllm()
    with pytest.raises(EngineError) as err:
        engine(server).generate([5, 6], replace(SamplingSettings(), **change))
    assert message in one_line(err, server.url)
    assert [s[1] for s in server.seen] == ["/v1/models"], "refused before any completion request"


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://host/x", "http://"])
def test_a_url_that_is_not_http(url):
    with pytest.raises(EngineError) as err:
        ServedEngine(url)
    assert "\n" not in str(err.value) and "not an http(s) URL" in str(err.value)


def test_base_url_drops_v1():
    assert base_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"


def test_token_text_instead_of_an_id_is_refused():
    adapter, t = VllmAdapter(), Transport("http://127.0.0.1:9")
    answer = {"choices": [{"logprobs": {"tokens": [" the"], "token_logprobs": [-1.0], "top_logprobs": [{" the": -1.0}]}}]}
    with pytest.raises(EngineError, match="is text, not token_id:N"):
        adapter.read_generation(t, {"logprobs": 1}, answer)


# --------------------------------------------------------------------------------------------------------------
# nothing but the URL given is contacted


class _Redirecting(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(302)
        self.send_header("Location", "http://127.0.0.1:9/elsewhere")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_redirect_is_not_followed():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Redirecting)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        with pytest.raises(EngineError) as err:
            ServedEngine(url).models()
        assert "HTTP 302: redirect refused" in one_line(err, url)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_proxy_environment_is_ignored(fake_vllm, monkeypatch):
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    server = fake_vllm()
    assert engine(server).model == "tiny" and server.seen


# --------------------------------------------------------------------------------------------------------------
# SGLang and llama.cpp adapters: request fields and answer shapes (from their sources; no server here)


def test_sglang_body_and_answer():
    a, t = SglangAdapter(), Transport("http://127.0.0.1:9")
    s = SamplingSettings(max_tokens=2, temperature=0.7, top_k=0, seed=3, logprobs=2, logit_bias={4: 1.0})
    body = a.generate_body("m", [1, 2], s)
    assert body["input_ids"] == [1, 2] and body["top_logprobs_num"] == 2 and body["logprob_start_len"] == -1
    sp = body["sampling_params"]
    assert sp["top_k"] == -1 and sp["sampling_seed"] == 3 and sp["max_new_tokens"] == 2 and sp["logit_bias"] == {"4": 1.0}
    answer = {"text": "", "meta_info": {"finish_reason": {"type": "length"},
                                        "output_token_logprobs": [[-0.1, 7, None], [-0.9, 8, None]],
                                        "output_top_logprobs": [[[-0.1, 7, None], [-2.4, 9, None]],
                                                                [[-0.6, 3, None], [-0.9, 8, None]]]}}
    ids, steps, finish = a.read_generation(t, body, answer)
    assert ids == (7, 8) and finish == "length" and steps[1].rank == 2 and steps[0].top[1].token_id == 9
    assert a.values == PROCESSED and SglangAdapter("raw_logprobs").values == RAW
    score = a.score_body("m", [1, 2, 3], 2)
    assert score["logprob_start_len"] == 0 and score["sampling_params"]["temperature"] == 1.0
    scored = a.read_score(t, score, {"meta_info": {"input_token_logprobs": [[None, 1, None], [-1.5, 2, None],
                                                                             [-0.2, 3, None]]}})
    assert [p.logprob for p in scored] == [None, -1.5, -0.2]


def test_llamacpp_body_and_answer():
    a, t = LlamacppAdapter(), Transport("http://127.0.0.1:9")
    s = SamplingSettings(max_tokens=1, temperature=0.0, seed=None, logprobs=2, logit_bias={4: -1.0})
    body = a.generate_body("m", [1, 2], s)
    assert body["prompt"] == [1, 2] and body["n_predict"] == 1 and body["seed"] == -1
    assert body["logit_bias"] == [[4, -1.0]] and body["post_sampling_probs"] is False and body["cache_prompt"] is False
    assert body["samplers"] == ["penalties", "top_k", "top_p", "min_p", "temperature"]
    answer = {"stop_type": "limit", "completion_probabilities": [
        {"id": 5, "logprob": -0.3, "top_logprobs": [{"id": 5, "logprob": -0.3}, {"id": 6, "logprob": -3.4e38}]}]}
    ids, steps, finish = a.read_generation(t, body, answer)
    assert ids == (5,) and finish == "length" and steps[0].top[1].logprob == -math.inf
    post = LlamacppAdapter("processed_logprobs")
    pbody = post.generate_body("m", [1], s)
    assert pbody["post_sampling_probs"] is True
    ids, steps, _ = post.read_generation(t, pbody, {"stop_type": "eos", "completion_probabilities": [
        {"id": 5, "prob": 0.5, "top_probs": [{"id": 5, "prob": 0.5}, {"id": 6, "prob": 0.5}]}]})
    assert steps[0].logprob == pytest.approx(math.log(0.5))
    assert not a.capabilities.score and "min_tokens" in a.check(replace(s, min_tokens=2))


def test_vllm_modes_and_labels(fake_vllm):
    assert VllmAdapter("processed_logits").values == "processed_logits"
    assert VllmAdapter("raw_logits").prompt_values == "raw_logits" and VllmAdapter().prompt_values == RAW
    server = fake_vllm()
    with pytest.raises(EngineError) as err:
        ServedEngine(server.url, logprobs_mode="final").model
    assert "logprobs mode 'final'; allowed: raw_logprobs" in one_line(err, server.url)


# --------------------------------------------------------------------------------------------------------------
# vLLM facts the recording pins (the shapes check-logprobs reads), straight from the recorded JSON


def recorded_answer(mode: str, match) -> dict:
    x = next(x for x in load_recording()["modes"][mode] if x["body"] and match(x["body"]))
    return json.loads(x["response"])["choices"][0]


def test_text_keyed_top_logprobs_lose_entries_that_decode_alike():
    by_id = recorded_answer(MODES[0], lambda b: b.get("echo") and b.get("return_tokens_as_token_ids"))
    by_text = recorded_answer(MODES[0], lambda b: b.get("echo") and not b.get("return_tokens_as_token_ids"))
    ids = [len(t) if t else 0 for t in by_id["logprobs"]["top_logprobs"]]
    texts = [len(t) if t else 0 for t in by_text["logprobs"]["top_logprobs"]]
    assert by_id["logprobs"]["token_logprobs"][0] is None, "echo: the first prompt position has no logprob"
    assert all(t <= i for t, i in zip(texts, ids)) and sum(texts) < sum(ids)


def test_chat_top_logprobs_start_with_the_sampled_token_and_drop_the_nth_best():
    chat = recorded_answer(MODES[0], lambda b: "messages" in b and b.get("return_tokens_as_token_ids"))
    displaced = 0
    for entry in chat["logprobs"]["content"]:
        listed = entry["top_logprobs"]
        assert len(listed) == 5 and listed[0]["token"] == entry["token"]
        others = [t["logprob"] for t in listed[1:]]
        if any(v > entry["logprob"] for v in others):
            displaced += 1  # the sampled token is not the best, yet it holds the first of the 5 places
    assert displaced >= 1
