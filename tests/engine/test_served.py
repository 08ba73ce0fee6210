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

from fake_server import (  # noqa: E402,F401
    RECORDING,
    completion_answer,
    duplicate_sampled,
    fake_vllm,
    load_recording,
    models_answer,
    prompt_answer,
    table_engine,
)

from decodelab.core.engine.backend import Capabilities  # noqa: E402
from decodelab.core.engine.http.client import ServedEngine  # noqa: E402
from decodelab.core.engine.http.llamacpp import LlamacppAdapter  # noqa: E402
from decodelab.core.engine.http.sglang import SglangAdapter  # noqa: E402
from decodelab.core.engine.http.transport import EngineError, Transport, base_url  # noqa: E402
from decodelab.core.engine.http.vllm import VllmAdapter  # noqa: E402
from decodelab.core.engine.http.wire import PROCESSED, RAW, Labels, SamplingSettings  # noqa: E402
from decodelab.core.sampling.export import llamacpp_server_neutral  # noqa: E402

# what a request built above the engine hands llama.cpp's adapter (the sampling registry's neutral body)
NEUTRAL = {"llamacpp": llamacpp_server_neutral()}

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
    s = SamplingSettings(max_tokens=1, temperature=0.0, seed=None, logprobs=2, logit_bias={4: -1.0}, neutral=NEUTRAL)
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


# --------------------------------------------------------------------------------------------------------------
# mutation run of core/engine/served.py (2026-12-02): the helpers by hand, the adapters' bodies field by field, the
# client against a table transport (no socket), the transport's failures against loopback servers


def test_server_message_reads_each_servers_error_shape():
    from decodelab.core.engine.http.transport import _server_message

    assert _server_message(b'{"error": {"message": "bad  \\n  thing", "code": 400}}') == "bad thing"  # OpenAI
    assert _server_message(b'{"message": "sglang says no"}') == "sglang says no"  # SGLang: no "error" key
    assert _server_message(b'{"error": "a plain string"}') == "a plain string"
    assert _server_message(b'{"error": {"code": 5}}') == '{"error": {"code": 5}}'  # no message: the body
    assert _server_message(b'{"error": {"message": ""}}') == '{"error": {"message": ""}}'
    assert _server_message(b"[1, 2]") == "[1, 2]"  # JSON, not an object
    assert _server_message(b"not json\n at all") == "not json at all"
    assert _server_message(b"") == "(empty body)" and _server_message(b" \n ") == "(empty body)"
    assert _server_message(b"\xff oops") == "\ufffd oops"  # undecodable bytes replaced, not an exception


def test_one_line_joins_whitespace_and_cuts_at_the_limit():
    from decodelab.core.engine.http.transport import _one_line

    assert _one_line("  a\n\tb  c ") == "a b c"
    assert _one_line("x" * 300) == "x" * 300
    assert _one_line("x" * 301) == "x" * 297 + "..." and len(_one_line("y" * 1000)) == 300
    assert _one_line("abcdef", limit=5) == "ab..." and _one_line("abcde", limit=5) == "abcde"


def test_reason_names_each_network_failure():
    import socket

    from decodelab.core.engine.http.transport import _reason

    assert _reason(ConnectionRefusedError(111, "Connection refused")) == "connection refused (is the server running?)"
    assert _reason(TimeoutError()) == "no answer in time (timeout)"
    assert _reason(socket.gaierror(-2, "Name or service not known")) == "host not found (Name or service not known)"
    assert _reason(OSError(13, "Permission denied")) == "Permission denied"
    assert _reason(OSError("no strerror")) == "no strerror" and _reason("a text reason") == "a text reason"


def test_finite_turns_the_engines_stand_in_back_into_minus_inf():
    from decodelab.core.engine.http.wire import read_value

    assert read_value(-9999.0, -9999.0) == -math.inf and read_value(-1e5, -9999.0) == -math.inf
    assert read_value(-9998.5, -9999.0) == -9998.5 and read_value(-1e9, None) == -1e9
    assert type(read_value(3, None)) is float and read_value(3, None) == 3.0


def test_sorted_top_rank_and_order_by_hand():
    from decodelab.core.engine.http.wire import Alternative, order_defect, rank_in_top, sorted_top

    top = sorted_top({3: -1.0, 1: -1.0, 2: -0.5, 4: -3.0}, 3)
    assert top == (Alternative(2, -0.5), Alternative(1, -1.0), Alternative(3, -1.0))  # a tie by id
    assert sorted_top({3: -1.0}, 0) == ()
    assert rank_in_top(3, -1.0, top) == 3 and rank_in_top(2, -0.5, top) == 1  # ties count against
    assert rank_in_top(4, -3.0, top) is None and rank_in_top(2, None, top) is None
    broken = "top logprobs not sorted (the engine's top-N order is broken)"
    values = {1: -2.0, 2: -0.5, 3: -1.0}
    assert order_defect([1, 2, 3], values, expected_first=1) is None  # the chosen token first, then sorted
    assert order_defect([1, 2, 3], values, expected_first=None) == broken
    assert order_defect([1, 3, 2], values, expected_first=1) == broken
    assert order_defect([2, 3], {2: -1.0, 3: -1.0}, expected_first=None) is None  # a tie is in order


def test_tail_mass_by_hand():
    from decodelab.core.engine.http.wire import Alternative, Position

    p = Position(1, 5, math.log(0.5), 1, (Alternative(5, math.log(0.5)), Alternative(6, math.log(0.25))))
    assert p.tail_mass() == pytest.approx(0.25, abs=1e-15)
    assert Position(1, 5, 0.0, 1, (Alternative(5, 0.0), Alternative(6, 0.0))).tail_mass() == 0.0  # logits: clipped
    assert Position(0, 5, None, None, ()).tail_mass() is None


def test_loads_remembers_repeated_keys_at_every_depth():
    from decodelab.core.engine.http.transport import loads, repeated_keys

    data = loads('{"a": 1, "b": {"x": 1, "x": 2, "x": 2, "y": 0}, "a": 3}')
    assert data == {"a": 3, "b": {"x": 2, "y": 0}}
    assert repeated_keys(data) == {"a": [1, 3]} and repeated_keys(data["b"]) == {"x": [1, 2, 2]}
    assert repeated_keys(loads('{"a": 1}')) == {} and repeated_keys([1]) == {} and repeated_keys({"a": 1}) == {}
    assert loads(b'[{"k": 1, "k": 1}]')[0].repeated == {"k": [1, 1]}


def test_base_url_keeps_the_path_and_drops_query_and_v1():
    assert base_url(" http://127.0.0.1:8000 ") == "http://127.0.0.1:8000"
    assert base_url("https://h:1/serve/v1") == "https://h:1/serve"
    assert base_url("http://h:1/v1x/") == "http://h:1/v1x" and base_url("http://h:1/a/v1?x=1#f") == "http://h:1/a"
    with pytest.raises(EngineError) as err:
        base_url("ftp://h/x")
    assert str(err.value) == "--engine ftp://h/x: not an http(s) URL (for example http://127.0.0.1:8000)"


def test_prometheus_sum_adds_a_counter_over_its_label_sets():
    from decodelab.core.engine.http.transport import prometheus_sum

    text = ("# HELP vllm:prefix_cache_hits_total hits\n"
            "# TYPE vllm:prefix_cache_hits_total counter\n"
            'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 12.0\n'
            'vllm:prefix_cache_hits_total{engine="1",model_name="tiny"} 3.0\n'
            'vllm:prefix_cache_hits_total_created{engine="0"} 1.7e9\n'
            "vllm:prefix_cache_hits_totalx 100\n"
            "vllm:prefix_cache_hits_total 5\n"
            'vllm:prefix_cache_hits_total{engine="2"} NaNx\n'
            'vllm:prefix_cache_queries_total{engine="0"} 40\n')
    assert prometheus_sum(text, "vllm:prefix_cache_hits_total") == 20.0
    assert prometheus_sum(text, "vllm:prefix_cache_queries_total") == 40.0
    assert prometheus_sum("", "vllm:prefix_cache_hits_total") == 0.0


def test_check_ids_messages():
    from decodelab.core.engine.http.client import _check_ids

    t = Transport("http://127.0.0.1:9")
    assert _check_ids(t, (0, 2.0, 7), minimum=3) == [0, 2, 7]
    with pytest.raises(EngineError) as err:
        _check_ids(t, [4], minimum=2)
    assert str(err.value) == "--engine http://127.0.0.1:9: 1 token ids given; at least 2 needed"
    with pytest.raises(EngineError) as err:
        _check_ids(t, [4, -1], minimum=2)
    assert str(err.value) == "--engine http://127.0.0.1:9: token ids must be >= 0"


def test_vllm_check_refuses_at_the_bounds_only():
    a = VllmAdapter()
    assert a.check(SamplingSettings(temperature=0.005)) == ("temperature 0.005: vLLM raises 0 < t < 0.01 to 0.01; "
                                                            "use 0 (greedy) or at least 0.01")
    assert a.check(SamplingSettings(temperature=0.0)) is None and a.check(SamplingSettings(temperature=0.01)) is None
    assert a.check(SamplingSettings(logit_bias={3: 100.0, 4: -100.0})) is None
    assert a.check(SamplingSettings(logit_bias={3: 1.0, 8: -100.5, 9: 200.0})) == \
        "logit bias of token 8: vLLM clamps biases to [-100, 100]"


def test_vllm_cached_tokens_only_where_the_server_writes_them():
    assert VllmAdapter.cached_tokens({"usage": {"prompt_tokens_details": {"cached_tokens": 16}}}) == 16
    assert VllmAdapter.cached_tokens({"usage": {"prompt_tokens_details": None}}) is None
    assert VllmAdapter.cached_tokens({"usage": None}) is None and VllmAdapter.cached_tokens({}) is None
    assert VllmAdapter.cached_tokens({"usage": {"prompt_tokens_details": {"cached_tokens": "16"}}}) is None
    assert VllmAdapter.cached_tokens([]) is None


def test_sglang_bodies_field_by_field():
    """Every field SGLang's GenerateReqInput / SamplingParams is sent (sglang/srt/sampling/sampling_params.py)."""
    a = SglangAdapter()
    s = SamplingSettings(max_tokens=7, temperature=0.7, top_p=0.9, top_k=4, min_p=0.05, repetition_penalty=1.2,
                         presence_penalty=0.3, frequency_penalty=0.4, seed=11, min_tokens=2, ignore_eos=True,
                         logprobs=3, logit_bias={4: 1.5, 9: -2.0}, stop_token_ids=(2, 3), stop=("\n\n",))
    assert a.generate_body("m", (1, 2), s) == {
        "input_ids": [1, 2], "return_logprob": True, "logprob_start_len": -1, "top_logprobs_num": 3,
        "return_text_in_logprobs": False,
        "sampling_params": {"max_new_tokens": 7, "min_new_tokens": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 4,
                            "min_p": 0.05, "repetition_penalty": 1.2, "presence_penalty": 0.3,
                            "frequency_penalty": 0.4, "sampling_seed": 11, "ignore_eos": True,
                            "logit_bias": {"4": 1.5, "9": -2.0}, "stop_token_ids": [2, 3], "stop": ["\n\n"],
                            "skip_special_tokens": False, "n": 1}}
    # scoring: one token at the neutral settings (temperature 1, no filter: SGLang's top_k off is -1), from position 0
    assert a.score_body("m", [1, 2, 3], 2) == {
        "input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
        "return_text_in_logprobs": False,
        "sampling_params": {"max_new_tokens": 1, "min_new_tokens": 0, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                            "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                            "frequency_penalty": 0.0, "sampling_seed": None, "ignore_eos": False, "logit_bias": {},
                            "stop_token_ids": [], "stop": [], "skip_special_tokens": False, "n": 1}}
    assert a.check(SamplingSettings()) is None
    assert a.check(SamplingSettings(allowed_token_ids=(1,))) == a.check(SamplingSettings(bad_words=("x",))) == \
        "allowed_token_ids / bad_words: SGLang's /generate has no such field"
    assert (a.kind, a.path, a.tokenize_path, a.metrics_path, a.masked, a.prompt_values) == \
        ("sglang", "/generate", None, None, None, RAW)
    assert SglangAdapter.cached_tokens({"usage": {"prompt_tokens_details": {"cached_tokens": 3}}}) is None
    assert SglangAdapter(max_top_n=7).capabilities == Capabilities(
        score=True, generate=True, seeded=True, prompt_ranks=False, full_logits=False, max_top_n=7, replay=True)
    assert SglangAdapter().capabilities.max_top_n is None


def test_sglang_answers_read_by_hand():
    a, t = SglangAdapter(), Transport("http://127.0.0.1:9")
    score = a.score_body("m", [1, 2, 3], 2)
    answer = {"meta_info": {"input_token_logprobs": [[None, 1, None], [-1.5, 2, None], [-0.25, 3, None]],
                            "input_top_logprobs": [None, [[-0.5, 7, None], [-1.5, 2, None], [None, 8, None]],
                                                   [[-0.25, 3, None], [-2.0, 4, None]]]}}
    p0, p1, p2 = a.read_score(t, score, answer)
    assert (p0.index, p0.token_id, p0.logprob, p0.rank, p0.top) == (0, 1, None, None, ())
    assert (p1.index, p1.token_id, p1.logprob, p1.rank) == (1, 2, -1.5, 2)
    assert [(x.token_id, x.logprob) for x in p1.top] == [(7, -0.5), (2, -1.5)]  # an entry without a value dropped
    assert (p2.index, p2.rank, [x.token_id for x in p2.top]) == (2, 1, [3, 4])
    # a list answer (a batch of one) is read as its first element; no top logprobs at all: nothing listed
    listed = [{"meta_info": {"input_token_logprobs": [[None, 1, None], [-1.5, 2, None], [-0.25, 3, None]]}}]
    assert [p.top for p in a.read_score(t, score, listed)] == [(), (), ()]
    for bad, message in [({"meta_info": {"input_token_logprobs": [[None, 1, None]]}},
                          "the answer has no input_token_logprobs for every prompt token"),
                         ({"meta_info": {}}, "the answer has no input_token_logprobs for every prompt token"),
                         ([], "the answer has no meta_info"), ({"meta_info": [1]}, "the answer has no meta_info"),
                         ("text", "the answer has no meta_info")]:
        with pytest.raises(EngineError) as err:
            a.read_score(t, score, bad)
        assert str(err.value) == f"--engine http://127.0.0.1:9: {message}"
    gen = a.generate_body("m", [1], SamplingSettings(logprobs=1))
    ids, steps, finish = a.read_generation(t, gen, {"meta_info": {"finish_reason": "stop",
                                                                  "output_token_logprobs": [[-0.1, 7, None]]}})
    assert ids == (7,) and finish == "stop" and steps[0].top == () and steps[0].rank is None
    ids, steps, finish = a.read_generation(t, gen, {"meta_info": {"output_token_logprobs": [[-0.1, 7, None]],
                                                                  "output_top_logprobs": [[[-0.1, 7, None],
                                                                                           [-2.0, 8, None]]]}})
    assert finish is None and [x.token_id for x in steps[0].top] == [7]  # top_n 1 of the two listed
    with pytest.raises(EngineError) as err:
        a.read_generation(t, gen, {"meta_info": {"output_token_logprobs": None}})
    assert str(err.value).endswith(": the answer has no output_token_logprobs (was return_logprob sent?)")


def test_llamacpp_bodies_field_by_field():
    """Every field llama.cpp's /completion is sent (tools/server/server-task.cpp params_from_json_cmpl): the
    samplers that are not vLLM's switched off, the sampler order written out."""
    a = LlamacppAdapter()
    s = SamplingSettings(max_tokens=7, temperature=0.7, top_p=0.9, top_k=4, min_p=0.05, repetition_penalty=1.2,
                         presence_penalty=0.3, frequency_penalty=0.4, seed=11, ignore_eos=True, logprobs=3,
                         logit_bias={4: 1.5}, stop=("\n\n",), neutral=NEUTRAL)
    assert a.generate_body("m", (1, 2), s) == {
        "prompt": [1, 2], "n_predict": 7, "temperature": 0.7, "top_k": 4, "top_p": 0.9, "min_p": 0.05,
        "typical_p": 1.0, "repeat_penalty": 1.2, "repeat_last_n": -1, "presence_penalty": 0.3,
        "frequency_penalty": 0.4, "dry_multiplier": 0.0, "xtc_probability": 0.0, "top_n_sigma": -1.0, "mirostat": 0,
        "dynatemp_range": 0.0, "min_keep": 0, "seed": 11, "ignore_eos": True, "n_probs": 3,
        "post_sampling_probs": False, "logit_bias": [[4, 1.5]],
        "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"], "return_tokens": True,
        "stop": ["\n\n"], "cache_prompt": False, "stream": False}
    assert a.tokenize_body("m", "hi", False) == {"content": "hi", "add_special": False}
    assert (a.kind, a.path, a.tokenize_path, a.metrics_path, a.masked, a.prompt_values) == \
        ("llamacpp", "/completion", "/tokenize", None, -3.0e38, RAW)
    assert LlamacppAdapter.cached_tokens({"usage": {"prompt_tokens_details": {"cached_tokens": 3}}}) is None
    assert a.check(s) is None
    assert a.check(SamplingSettings(stop_token_ids=(2,))) == "stop_token_ids: llama.cpp's server has no such field"
    assert a.check(SamplingSettings(allowed_token_ids=(1,))) == a.check(SamplingSettings(bad_words=("x",))) == \
        "allowed_token_ids / bad_words: llama.cpp's server has no such field"
    assert LlamacppAdapter(max_top_n=7).capabilities == Capabilities(
        score=False, generate=True, seeded=True, prompt_ranks=False, full_logits=False, max_top_n=7, replay=False)
    assert LlamacppAdapter().values == RAW and LlamacppAdapter().capabilities.max_top_n is None
    with pytest.raises(EngineError) as err:
        a.score_body("m", [1, 2], 2)
    assert str(err.value) == "llama.cpp's server returns no prompt logprobs: it cannot score a sequence"
    with pytest.raises(EngineError) as err:
        a.read_score(Transport("http://127.0.0.1:9"), {}, {})
    assert str(err.value) == "--engine http://127.0.0.1:9: llama.cpp's server returns no prompt logprobs"


def test_llamacpp_answers_read_by_hand():
    t = Transport("http://127.0.0.1:9")
    raw, post = LlamacppAdapter(), LlamacppAdapter("processed_logprobs")
    body = raw.generate_body("m", [1], SamplingSettings(logprobs=2))
    answer = {"stop_type": "word", "completion_probabilities": [
        {"id": 5, "logprob": -1.0, "top_logprobs": [{"id": 6, "logprob": -0.5}, {"id": 5, "logprob": -1.0},
                                                    {"id": 7, "logprob": -2.0}]},
        {"id": 8, "logprob": -3.0e38}]}
    ids, steps, finish = raw.read_generation(t, body, answer)
    assert ids == (5, 8) and finish == "stop"
    assert (steps[0].index, steps[0].rank, [x.token_id for x in steps[0].top]) == (0, 2, [6, 5])
    assert (steps[1].index, steps[1].logprob, steps[1].top, steps[1].rank) == (1, -math.inf, (), None)
    assert raw.read_generation(t, body, {"stop_type": "eos", "completion_probabilities": []})[2] == "stop"
    assert raw.read_generation(t, body, {"stop_type": "none", "completion_probabilities": []})[2] == "none"
    assert raw.read_generation(t, body, {"completion_probabilities": []})[2] is None
    pbody = post.generate_body("m", [1], SamplingSettings(logprobs=2))
    _, steps, _ = post.read_generation(t, pbody, {"completion_probabilities": [
        {"id": 5, "prob": 0.0, "top_probs": [{"id": 6, "prob": 1.0}, {"id": 5, "prob": 0.0}]}]})
    assert steps[0].logprob == -math.inf
    assert [(x.token_id, x.logprob) for x in steps[0].top] == [(6, 0.0), (5, -math.inf)]
    for bad in ({"completion_probabilities": None}, ["x"]):
        with pytest.raises(EngineError) as err:
            raw.read_generation(t, body, bad)
        assert str(err.value).endswith(": the answer has no completion_probabilities (was n_probs sent?)")


def test_models_and_the_served_model_resolved():
    e, _ = table_engine({"/v1/models": {"data": [{"id": "a", "owned_by": "vllm"}, "junk", {"name": "x"}]}})
    assert e.models() == [{"id": "a", "owned_by": "vllm"}] and e.model == "a" and e.url == "http://127.0.0.1:9"
    for answer in ({"data": []}, {"data": None}, [], {"data": {"id": "a"}}):
        e, _ = table_engine({"/v1/models": answer})
        with pytest.raises(EngineError) as err:
            e.models()
        assert str(err.value) == "--engine http://127.0.0.1:9: GET /v1/models lists no model"
    e, _ = table_engine({"/v1/models": models_answer("a", "b")})
    with pytest.raises(EngineError) as err:
        e.model
    assert str(err.value) == "--engine http://127.0.0.1:9: serves 2 models (a, b); name one"
    e, _ = table_engine({"/v1/models": models_answer("a", "b")}, model="b")
    assert e.model == "b" and e.adapter.kind == "vllm"
    e, _ = table_engine({"/v1/models": models_answer("a", "b")}, model="c")
    with pytest.raises(EngineError) as err:
        e.adapter
    assert str(err.value) == "--engine http://127.0.0.1:9: serves 'a', 'b', not 'c' (model name mismatch)"


def test_the_server_kind_from_owned_by_or_given():
    e, _ = table_engine({"/v1/models": models_answer("m", owned_by="vLLM")})
    assert e.adapter.kind == "vllm" and e.logprobs_mode == "raw_logprobs"  # owned_by read case-blind
    e, _ = table_engine({"/v1/models": models_answer("m", owned_by="sglang")}, max_top_n=7)
    assert e.adapter.kind == "sglang" and e.logprobs_mode == "processed_logprobs"  # SGLang's default
    assert e.capabilities.max_top_n == 7
    e, _ = table_engine({"/v1/models": models_answer("m", owned_by="openai")}, kind="llamacpp")
    assert e.adapter.kind == "llamacpp" and e.logprobs_mode == "raw_logprobs" and e.model == "m"
    e, _ = table_engine({"/v1/models": models_answer("m", owned_by="vllm")}, kind="sglang",
                        logprobs_mode="raw_logprobs")
    assert e.adapter.kind == "sglang" and e.adapter.values == RAW
    e, _ = table_engine({"/v1/models": models_answer("m", owned_by="openai")})
    with pytest.raises(EngineError) as err:
        e.model
    assert str(err.value) == ("--engine http://127.0.0.1:9: cannot tell the server kind (owned_by 'openai'); give "
                              "one of vllm, sglang, llamacpp")
    e, _ = table_engine({"/v1/models": {"data": [{"id": "m"}]}})
    with pytest.raises(EngineError, match=r"\(owned_by None\)"):
        e.model
    e, _ = table_engine({"/v1/models": models_answer("m", owned_by="llamacpp")}, logprobs_mode="raw_logits")
    with pytest.raises(EngineError) as err:
        e.model
    assert str(err.value) == ("--engine http://127.0.0.1:9: llama.cpp gives raw_logprobs or processed_logprobs "
                              "(post_sampling_probs), not 'raw_logits'")
    e, _ = table_engine({}, logprobs_mode="processed_logits")
    assert e.labels(3) == Labels("processed_logits", 3, "vllm") and e.labels(4, RAW) == Labels(RAW, 4, "vllm")


def test_score_reads_positions_and_refuses_before_sending():
    answer = prompt_answer([None, {5: (-2.0, 3), 1: (-0.5, 1), 2: (-1.0, 2)}, {6: (-0.25, 1), 9: (-2.5, 2)}])
    e, t = table_engine({"/v1/completions": answer})
    s = e.score([4, 5, 6], top_n=2)
    assert t.sent[-1] == ("POST", "/v1/completions", VllmAdapter().score_body("tiny", [4, 5, 6], 2))
    assert s.model == "tiny" and s.token_ids == (4, 5, 6) and s.labels == Labels(RAW, 2, "vllm")
    p0, p1, p2 = s.positions
    assert (p0.index, p0.token_id, p0.logprob, p0.rank, p0.top) == (0, 4, None, None, ())
    assert (p1.index, p1.token_id, p1.logprob, p1.rank) == (1, 5, -2.0, 3)  # vLLM's rank, outside the top 2
    assert [(a.token_id, a.logprob) for a in p1.top] == [(1, -0.5), (2, -1.0)]
    assert (p2.index, p2.logprob, p2.rank, p2.defects) == (2, -0.25, 1, ())
    assert s.request == t.sent[-1][2] and not s.defects
    e, _ = table_engine({}, logprobs_mode="raw_logits")
    assert e.adapter.prompt_values == "raw_logits"
    for ids, top_n, message in [([4], 2, "1 token ids given; at least 2 needed"),
                                ([4, 5], 21, "top 21 logprobs asked; the limit is 0..20 (vLLM's --max-logprobs, "
                                             "default 20; give max_top_n for a server started with more)"),
                                ([4, 5], -1, "top -1 logprobs asked; the limit is 0..20")]:
        e, t = table_engine({})
        with pytest.raises(EngineError) as err:
            e.score(ids, top_n)
        assert str(err.value).startswith(f"--engine http://127.0.0.1:9: {message}")
        assert all(path == "/v1/models" for _, path, _ in t.sent)
    e, _ = table_engine({"/v1/completions": answer}, max_top_n=30)
    assert len(e.score([4, 5, 6], top_n=0).positions[1].top) == 0  # 0..cap: 0 allowed
    e, _ = table_engine({"/v1/models": models_answer("m", owned_by="llamacpp")})
    with pytest.raises(EngineError) as err:
        e.score([4, 5], 2)
    assert str(err.value) == "--engine http://127.0.0.1:9: llamacpp cannot score a sequence (no prompt logprobs)"


def test_prompt_positions_flag_what_the_engine_got_wrong():
    e, _ = table_engine({"/v1/completions": prompt_answer([None, {5: (-2.0, 3), 1: (-0.5, 1), 2: (-1.0, 2)}])})
    assert e.score([4, 5], 3).positions[1].defects == ()
    unsorted = prompt_answer([None, {5: (-2.0, 3), 2: (-1.0, 2), 1: (-0.5, 1)}])
    e, _ = table_engine({"/v1/completions": unsorted})
    assert e.score([4, 5], 3).positions[1].defects == (
        "position 1: top logprobs not sorted (the engine's top-N order is broken)",)
    text = json.dumps(prompt_answer([None, {5: (-2.0, 3), 1: (-0.5, 1)}])).replace(
        '"1": {"logprob": -0.5, "rank": 1}', '"1": {"logprob": -0.5, "rank": 1}, "1": {"logprob": -0.5, "rank": 1}')
    from decodelab.core.engine.http.transport import loads

    e, _ = table_engine({"/v1/completions": loads(text)})
    assert e.score([4, 5], 3).defects == ("position 1: token 1 listed 2 times",)
    masked = prompt_answer([None, {5: (-9999.0, 7), 1: (-0.5, 1)}])
    e, _ = table_engine({"/v1/completions": masked})
    assert e.score([4, 5], 3).positions[1].logprob == -math.inf
    for answer, message in [
            (prompt_answer([None]), "prompt_logprobs cover 1 positions for 2 prompt tokens"),
            (prompt_answer([None, None]), "prompt_logprobs[1] is null (only the first position has none)"),
            (prompt_answer([None, {1: (-0.5, 1)}]), "prompt_logprobs[1] has no entry for the prompt token 5"),
            ({"choices": [{"prompt_logprobs": None}]},
             "the answer has no prompt_logprobs (choices[0].prompt_logprobs is missing)"),
            ({"choices": []}, "the answer has no choices"), ({"choices": ["x"]}, "the answer has no choices"),
            ({}, "the answer has no choices"), (prompt_answer([None, {5: (-1.0, 1)}], model="other"),
                                                "answered for model 'other', not 'tiny' (model name mismatch)")]:
        e, _ = table_engine({"/v1/completions": answer})
        with pytest.raises(EngineError) as err:
            e.score([4, 5], 3)
        assert str(err.value) == f"--engine http://127.0.0.1:9: {message}"
    # the first position may have an entry; only SGLang's answers are not checked for the model name
    e, _ = table_engine({"/v1/completions": prompt_answer([{4: (-3.0, 9)}, {5: (-1.0, 1)}])})
    assert e.score([4, 5], 3).positions[0].logprob == -3.0


def test_generate_reads_steps_times_and_cached_tokens():
    answer = completion_answer([7, 8], [-0.5, -2.0], [{7: -0.5, 3: -1.0}, {3: -0.25, 4: -1.0, 8: -2.0}],
                               finish="stop", usage={"prompt_tokens_details": {"cached_tokens": 2}})
    e, t = table_engine({"/v1/completions": answer})
    settings = SamplingSettings(max_tokens=2, logprobs=2)
    g = e.generate([4, 5], settings)
    assert t.sent[-1] == ("POST", "/v1/completions", VllmAdapter().generate_body("tiny", [4, 5], settings))
    assert (g.model, g.prompt_ids, g.token_ids, g.finish_reason, g.cached_tokens) == ("tiny", (4, 5), (7, 8), "stop", 2)
    assert g.labels == Labels(RAW, 2, "vllm") and g.request == t.sent[-1][2] and 0 <= g.seconds < 60
    s0, s1 = g.steps
    assert (s0.index, s0.token_id, s0.logprob, s0.rank, s0.defects) == (0, 7, -0.5, 1, ())
    assert (s1.index, s1.token_id, s1.logprob, s1.rank) == (1, 8, -2.0, None)  # past the listed top 2
    assert [(a.token_id, a.logprob) for a in s1.top] == [(3, -0.25), (4, -1.0)]
    e, _ = table_engine({"/v1/completions": completion_answer([7], [-0.5], [{7: -0.5}])})
    assert e.generate([4], SamplingSettings(max_tokens=1, logprobs=1)).cached_tokens is None


def test_generation_steps_flag_what_the_engine_got_wrong():
    def steps_of(answer):
        e, _ = table_engine({"/v1/completions": answer})
        return e.generate([4], SamplingSettings(max_tokens=1, logprobs=3)).steps

    (s,) = steps_of(completion_answer([7], [-0.5], [{7: -0.75, 3: -1.0}]))
    assert s.defects == ("step 0: token 7 has logprob -0.5 but -0.75 in top logprobs",)
    (s,) = steps_of(completion_answer([7], [-2.0], [{7: -2.0, 3: -1.0, 4: -0.5}]))  # chosen first, then unsorted
    assert s.defects == ("step 0: top logprobs not sorted (the engine's top-N order is broken)",)
    (s,) = steps_of(completion_answer([7], [-2.0], [{7: -2.0, 4: -0.5, 3: -1.0}]))
    assert s.defects == () and s.rank == 3
    (s,) = steps_of(completion_answer([7], [-9999.0], [{3: -0.5, 7: -9999.0}]))
    assert s.logprob == -math.inf and s.top[-1].logprob == -math.inf and s.defects == ()
    from decodelab.core.engine.http.transport import loads

    text = json.dumps(completion_answer([7], [-0.5], [{7: -0.5, 3: -1.0}]))
    (s,) = steps_of(loads(text.replace('"token_id:3": -1.0', '"token_id:3": -1.0, "token_id:3": -1.5')))
    assert s.defects == ("step 0: token 3 listed 2 times in top logprobs with different values [-1.0, -1.5]",)
    for answer, message in [
            (completion_answer([7], [None], [{7: -0.5}]), "step 0 has no logprob (top_logprobs[0] is null)"),
            (completion_answer([7], [-0.5], [None]), "step 0 has no logprob (top_logprobs[0] is null)"),
            (completion_answer([7], [-0.5], None), "logprobs cover 0 steps for 1 tokens"),
            (completion_answer([7, 8], [-0.5, -1.0], [{7: -0.5}]), "logprobs cover 1 steps for 2 tokens"),
            (completion_answer([7, 8], [-0.5], [{7: -0.5}, {8: -1.0}]), "logprobs cover 2 steps for 2 tokens"),
            ({"choices": [{"logprobs": {"tokens": None}}]},
             "the answer has no logprobs (choices[0].logprobs is null); was logprobs sent?"),
            ({"choices": [{"logprobs": [1]}]},
             "the answer has no logprobs (choices[0].logprobs is null); was logprobs sent?")]:
        with pytest.raises(EngineError) as err:
            steps_of(answer)
        assert str(err.value) == f"--engine http://127.0.0.1:9: {message}"
    disagree = completion_answer([7, 8], [-0.5, -1.0], [{7: -0.5}, {8: -1.0}])
    disagree["choices"][0]["token_ids"] = [7, 9]
    with pytest.raises(EngineError) as err:
        steps_of(disagree)
    assert str(err.value).endswith(": token_ids [7, 9] disagree with the logprobs' tokens [7, 8]")
    del disagree["choices"][0]["token_ids"]  # token_ids absent: the logprobs' tokens are read alone
    assert [s.token_id for s in steps_of(disagree)] == [7, 8]


def test_token_id_reads_only_token_id_n():
    from decodelab.core.engine.http.vllm import _token_id

    t = Transport("http://127.0.0.1:9")
    assert _token_id(t, "token_id:0") == 0 and _token_id(t, "token_id:4095") == 4095
    assert _token_id(t, "token_id:-1") == -1  # read; the client's vocabulary check refuses it later
    for token in ("token_id:", "token_id:1a", "tokenid:5", "Token_id:5", 5, "xtoken_id:5"):
        with pytest.raises(EngineError) as err:
            _token_id(t, token)
        assert str(err.value) == (f"--engine http://127.0.0.1:9: token {token!r} is text, not token_id:N (the server "
                                  "ignored return_tokens_as_token_ids)")


def test_generate_refuses_before_sending():
    for settings, message in [(SamplingSettings(logprobs=0), "generate needs logprobs >= 1 (each token's logprob "
                                                             "is read)"),
                              (SamplingSettings(temperature=0.001), "temperature 0.001: vLLM raises")]:
        e, t = table_engine({})
        with pytest.raises(EngineError) as err:
            e.generate([4], settings)
        assert str(err.value).startswith(f"--engine http://127.0.0.1:9: {message}")
        assert [path for _, path, _ in t.sent] == ["/v1/models"]
    e, _ = table_engine({})
    with pytest.raises(EngineError) as err:
        e.generate([], SamplingSettings())
    assert str(err.value) == "--engine http://127.0.0.1:9: 0 token ids given; at least 1 needed"


def test_sglang_answers_are_not_checked_for_the_model_name():
    answer = {"model": "other", "meta_info": {"output_token_logprobs": [[-0.5, 7, None]], "finish_reason": None}}
    e, t = table_engine({"/v1/models": models_answer("m", owned_by="sglang"), "/generate": answer})
    g = e.generate([4], SamplingSettings(max_tokens=1, logprobs=1))
    assert g.token_ids == (7,) and g.cached_tokens is None and t.sent[-1][1] == "/generate"
    assert g.labels == Labels(PROCESSED, 1, "sglang")


def test_tokenize_and_the_prefix_cache_counters():
    e, t = table_engine({"/tokenize": {"tokens": [1, 2, 3], "count": 3}})
    assert e.tokenize("hi") == [1, 2, 3]
    assert t.sent[-1] == ("POST", "/tokenize", {"model": "tiny", "prompt": "hi", "add_special_tokens": True})
    assert e.tokenize("hi", add_special_tokens=False) == [1, 2, 3] and t.sent[-1][2]["add_special_tokens"] is False
    for answer in ({"tokens": None}, {"tokens": [1, "2"]}, [1, 2]):
        e, _ = table_engine({"/tokenize": answer})
        with pytest.raises(EngineError) as err:
            e.tokenize("hi")
        assert str(err.value) == "--engine http://127.0.0.1:9: POST /tokenize: the answer has no token ids"
    e, t = table_engine({"/v1/models": models_answer("m", owned_by="llamacpp"), "/tokenize": {"tokens": [5]}})
    assert e.tokenize("hi", False) == [5] and t.sent[-1] == ("POST", "/tokenize", {"content": "hi",
                                                                                   "add_special": False})
    assert e.prefix_cache_counters() is None
    e, t = table_engine({"/v1/models": models_answer("m", owned_by="sglang")})
    assert e.tokenize("hi") is None and e.prefix_cache_counters() is None
    assert [path for _, path, _ in t.sent] == ["/v1/models"]
    metrics = ('vllm:prefix_cache_hits_total{engine="0"} 6.0\nvllm:prefix_cache_hits_total{engine="1"} 2.0\n'
               'vllm:prefix_cache_queries_total{engine="0"} 10.0\n')
    e, t = table_engine({"/metrics": metrics})
    assert e.prefix_cache_counters() == {"hits": 8.0, "queries": 10.0} and t.sent[-1] == ("GET", "/metrics", None)


def probe_engine(gen_top: dict, replay_top: dict, **kw) -> tuple[ServedEngine, TableTransport]:
    """A vLLM whose probe generation lists gen_top (the sampled token first) and whose replay lists replay_top at
    the generated position; the probe prompt is [4, 5]."""
    token = next(iter(gen_top))

    def answer(body):
        if "prompt_logprobs" in body:
            return prompt_answer([None, {5: (-1.0, 1)}, {token: (replay_top[token], 1), **{
                k: (v, 1) for k, v in replay_top.items()}}])
        return completion_answer([token], [gen_top[token]], [gen_top])

    return table_engine({"/v1/completions": answer}, **kw)


def test_the_logprobs_mode_probe_by_hand():
    ra, rb = -0.5, -1.5  # the replay's raw logprobs of the two kept tokens: raw gap 1, tempered (T = 0.5) gap 2
    pa = -math.log1p(math.exp(-2.0))  # processed: the two renormalised at T = 0.5, p_a + p_b = 1
    cases = {"raw_logprobs": {7: ra, 8: rb}, "raw_logits": {7: 3.0, 8: 2.0},
             "processed_logprobs": {7: pa, 8: pa - 2.0}, "processed_logits": {7: 6.0, 8: 4.0}}
    values = {"raw_logprobs": RAW, "raw_logits": "raw_logits", "processed_logprobs": PROCESSED,
              "processed_logits": "processed_logits"}
    for mode, gen_top in cases.items():
        e, t = probe_engine(gen_top, {7: ra, 8: rb})
        assert e.detect_logprobs_mode([4, 5]) == mode and e.logprobs_mode == mode and e.adapter.values == values[mode]
        gen, replay = t.sent[1][2], t.sent[2][2]
        assert gen == VllmAdapter().generate_body("tiny", [4, 5], SamplingSettings(
            max_tokens=1, temperature=0.5, top_k=2, seed=0, logprobs=2, ignore_eos=True))
        assert replay["prompt"] == [4, 5, 7] and replay["prompt_logprobs"] == 2
    # logits below zero but summing past 1 are logits too; a sum within the tolerance of 1 is logprobs
    e, _ = probe_engine({7: -0.1, 8: -1.1}, {7: ra, 8: rb})
    assert e.detect_logprobs_mode([4, 5]) == "raw_logits"  # e^-0.1 + e^-1.1 = 1.238
    e, _ = probe_engine({7: math.log(0.6), 8: math.log(0.6) - 1.0}, {7: ra, 8: rb})
    assert e.detect_logprobs_mode([4, 5]) == "raw_logprobs"  # 0.6 + 0.221 < 1
    e, _ = probe_engine({7: ra, 8: rb}, {7: ra, 8: rb}, max_top_n=30)
    assert e.detect_logprobs_mode([4, 5]) == "raw_logprobs" and e.capabilities.max_top_n == 30  # the limit kept
    for gen_top, replay_top, message in [
            ({7: -0.5, 8: -1.5}, {7: -1.0, 8: -1.0}, "the probe's two kept tokens are tied or not both listed"),
            ({7: -0.5, 8: -1.5}, {7: -1.0, 8: -1.009}, "the probe's two kept tokens are tied or not both listed"),
            ({7: -0.5, 8: -math.inf}, {7: ra, 8: rb}, "the probe's two kept tokens are tied or not both listed"),
            ({7: -0.5, 9: -1.5}, {7: ra, 8: rb}, "the probe's two kept tokens are tied or not both listed"),
            ({7: -0.5, 8: -3.5}, {7: ra, 8: rb}, "the probe's logprob gap 3.0000 is neither the raw gap 1.0000 nor "
                                                 "the tempered one 2.0000")]:
        e, _ = probe_engine(gen_top, replay_top)
        with pytest.raises(EngineError) as err:
            e.detect_logprobs_mode([4, 5])
        assert str(err.value) == f"--engine http://127.0.0.1:9: cannot tell the server's --logprobs-mode: {message}"
    e, _ = probe_engine({7: -1.0, 8: -1.011}, {7: -1.0, 8: -1.011})  # a gap just past 10 x the tolerance: read
    assert e.detect_logprobs_mode([4, 5], tolerance=1e-3) == "raw_logprobs"


def test_use_mode_refuses_a_mode_the_kind_lacks():
    e, _ = table_engine({})
    e.use_mode("processed_logprobs")
    assert e.logprobs_mode == "processed_logprobs" and e.adapter.values == PROCESSED
    with pytest.raises(EngineError) as err:
        e.use_mode("final")
    assert str(err.value) == ("--engine http://127.0.0.1:9: logprobs mode 'final'; allowed: raw_logprobs, "
                              "processed_logprobs, raw_logits, processed_logits")
    assert e.logprobs_mode == "processed_logprobs"


class _Answering(BaseHTTPRequestHandler):
    """Answers GET/POST by path: /s<status>/<body> answers that status and body; /echo answers the request's body
    and content type as JSON; /bytes answers bytes that are not UTF-8; /hangup closes the connection without an
    answer."""

    def _answer(self):
        if self.path == "/hangup":
            self.close_connection = True
            return
        if self.path == "/bytes":  # not UTF-8
            status, data = 200, b"\xff ok"
        elif self.path == "/echo":
            sent = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            status, data = 200, json.dumps({"body": json.loads(sent), "type": self.headers["Content-Type"]}).encode()
        else:
            code, _, body = self.path[2:].partition("/")
            status, data = int(code), body.replace("_", " ").encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def answering():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Answering)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield Transport(f"http://127.0.0.1:{httpd.server_address[1]}/v1", timeout=5)
    httpd.shutdown()
    httpd.server_close()


def test_transport_answers_and_failures(answering):
    t = answering
    assert t.timeout == 5 and Transport("http://127.0.0.1:9").timeout == 60.0
    assert t.get("/s200/[1,_2]") == [1, 2] and t.get("/s299/{}") == {}
    assert t.post("/echo", {"x": [1]}) == {"body": {"x": [1]}, "type": "application/json"}
    assert t.get_text("/s200/a_b") == "a b"
    for path, message in [("/s200/hello", "GET /s200/hello: the answer is not JSON (b'hello')"),
                          ("/s300/{}", "GET /s300/{}: HTTP 300: redirect refused (only the URL given is contacted)"),
                          ("/s399/{}", "GET /s399/{}: HTTP 399: redirect refused (only the URL given is contacted)"),
                          ("/s400/bad_input", "GET /s400/bad_input: HTTP 400: bad input"),
                          ("/s404/", "GET /s404/: HTTP 404: (empty body)"),
                          ("/hangup", "GET /hangup: Remote end closed connection without response")]:
        with pytest.raises(EngineError) as err:
            t.get(path)
        assert str(err.value) == f"--engine {t.url}: {message}"
    with pytest.raises(EngineError) as err:
        t.post("/s500/{\"error\":{\"message\":\"boom\"}}", {})
    assert str(err.value).endswith(": HTTP 500: boom") and ": POST /s500/" in str(err.value)
    long = "x" * 100
    with pytest.raises(EngineError) as err:
        t.get(f"/s200/{long}")
    assert str(err.value).endswith(f"the answer is not JSON ({long[:80].encode()!r})")
    for path, message in [("/s300/moved", "GET /s300/moved: HTTP 300: moved"),
                          ("/s503/down", "GET /s503/down: HTTP 503: down")]:
        with pytest.raises(EngineError) as err:
            t.get_text(path)
        assert str(err.value) == f"--engine {t.url}: {message}"


def test_an_error_body_that_cannot_be_read_is_empty():
    import urllib.error

    from decodelab.core.engine.http.transport import _error_body

    class Broken:
        def read(self, *args):
            raise OSError("reset")

        def close(self):
            pass

    class Empty(Broken):
        def read(self, *args):
            return None

    assert _error_body(urllib.error.HTTPError("http://127.0.0.1:9", 500, "x", {}, Broken())) == b""
    assert _error_body(urllib.error.HTTPError("http://127.0.0.1:9", 500, "x", {}, Empty())) == b""


def test_vllm_adapter_modes_and_capabilities():
    for mode, values, prompt in [("raw_logprobs", RAW, RAW), ("processed_logprobs", PROCESSED, RAW),
                                 ("raw_logits", "raw_logits", "raw_logits"),
                                 ("processed_logits", "processed_logits", "raw_logits")]:
        a = VllmAdapter(mode)
        assert (a.values, a.prompt_values) == (values, prompt)
    assert VllmAdapter(max_top_n=7).capabilities == Capabilities(
        score=True, generate=True, seeded=True, prompt_ranks=True, full_logits=False, max_top_n=7, replay=True,
        kv_policies=False)
    assert VllmAdapter().capabilities.max_top_n == 20
    assert VllmAdapter().tokenize_body("m", "hi", False) == {"model": "m", "prompt": "hi", "add_special_tokens": False}


def test_a_text_key_in_top_logprobs_is_one_line():
    from decodelab.core.engine.http.transport import loads

    adapter, t = VllmAdapter(), Transport("http://127.0.0.1:9")
    message = ("--engine http://127.0.0.1:9: token ' the' is text, not token_id:N (the server ignored "
               "return_tokens_as_token_ids)")
    for top in ('{"token_id:7": -0.5, " the": -1.0}', '{"token_id:7": -0.5, " the": -1.0, " the": -1.0}'):
        answer = loads('{"choices": [{"logprobs": {"tokens": ["token_id:7"], "token_logprobs": [-0.5], '
                       f'"top_logprobs": [{top}]}}}}]}}')
        with pytest.raises(EngineError) as err:
            adapter.read_generation(t, {"logprobs": 2}, answer)
        assert str(err.value) == message
    with pytest.raises(EngineError, match="token 'token_id:X5' is text"):
        from decodelab.core.engine.http.vllm import _token_id

        _token_id(t, "token_id:X5")


def test_a_repeated_token_with_the_same_value_is_named_once():
    from decodelab.core.engine.http.transport import loads

    text = json.dumps(completion_answer([7], [-0.5], [{7: -0.5, 3: -1.0}]))
    e, _ = table_engine({"/v1/completions": loads(text.replace('"token_id:3": -1.0',
                                                               '"token_id:3": -1.0, "token_id:3": -1.0'))})
    (s,) = e.generate([4], SamplingSettings(max_tokens=1, logprobs=3)).steps
    assert s.defects == ("step 0: token 3 listed 2 times in top logprobs",)


def test_score_lists_five_alternatives_by_default():
    answer = prompt_answer([None, {5: (-1.0, 1)}])
    e, t = table_engine({"/v1/completions": answer})
    assert e.score([4, 5]).labels.top_n == 5 and t.sent[-1][2]["prompt_logprobs"] == 5


def test_the_probe_at_its_bounds():
    """Each comparison of the probe at equality, with values exact in binary (tolerance 0.125, T = 0.5)."""
    # the replay gap exactly 10 x the tolerance is read (only a smaller one is a tie)
    e, _ = probe_engine({7: -0.5, 8: -1.75}, {7: -0.5, 8: -1.75})
    assert e.detect_logprobs_mode([4, 5], tolerance=0.125) == "raw_logprobs"
    # a generation gap exactly the tolerance off the raw gap (1.375 vs 1.25), or off the tempered one (2.625 vs 2.5)
    for gen_top in ({7: -0.5, 8: -1.875}, {7: -0.5, 8: -3.125}):
        e, _ = probe_engine(gen_top, {7: -0.5, 8: -1.75})
        with pytest.raises(EngineError, match="is neither the raw gap 1.2500 nor the tempered one 2.5000"):
            e.detect_logprobs_mode([4, 5], tolerance=0.125)
    # two values whose probabilities sum to exactly 1 + the tolerance are log-probabilities, not logits
    gen_top = {7: 0.0, 8: math.log(0.125)}
    e, _ = probe_engine(gen_top, {7: -0.5, 8: math.log(0.125) - 0.5})
    assert e.detect_logprobs_mode([4, 5], tolerance=0.125) == "raw_logprobs"
    # two log-probabilities that hold almost all the mass (0.7 + 0.2995, within 1e-3 of 1) are not logits either
    gen_top = {7: math.log(0.7), 8: math.log(0.2995)}
    e, _ = probe_engine(gen_top, gen_top)
    assert e.detect_logprobs_mode([4, 5]) == "raw_logprobs"
    # tempered, with log(sum exp) exactly the tolerance (0.125; the second value adds nothing at this precision):
    # not renormalised, so logits
    e, _ = probe_engine({7: 0.125, 8: -40.0}, {7: -0.5, 8: -20.5625})
    assert e.detect_logprobs_mode([4, 5], tolerance=0.125) == "processed_logits"


def test_prometheus_sum_reads_the_value_field_whatever_the_blanks():
    """The exposition format separates a sample's fields by blanks or tabs and may end a line with a timestamp; a
    label value may hold a blank. The value is the field after the label set."""
    from decodelab.core.engine.http.transport import prometheus_sum

    text = ('vllm:prefix_cache_hits_total{engine="0"}\t4\n'
            'vllm:prefix_cache_hits_total{engine="1"} 2 1700000000000\n'
            'vllm:prefix_cache_hits_total{model_name="my model"}   3\n'
            'vllm:prefix_cache_hits_total\t5\n'
            "vllm:prefix_cache_hits_total{broken 7\n"
            "vllm:prefix_cache_hits_total{}\n"
            'vllm:prefix_cache_hits_total{engine="2"} 1e1\n'
            'vllm:prefix_cache_hits_total{model_name="a}b"} 6\n')  # the label set ends at its last brace
    assert prometheus_sum(text, "vllm:prefix_cache_hits_total") == 30.0


def test_get_text_failures_name_the_request(answering):
    from fake_server import refused_url

    assert answering.get_text("/bytes") == "\ufffd ok"  # undecodable bytes replaced
    url = refused_url()
    with pytest.raises(EngineError) as err:
        Transport(url).get_text("/metrics")
    assert str(err.value) == f"--engine {url}: GET /metrics: connection refused (is the server running?)"


def test_answers_without_choices_or_meta_are_one_line():
    t = Transport("http://127.0.0.1:9")
    for answer in ({"choices": []}, [1], "text"):
        with pytest.raises(EngineError) as err:
            VllmAdapter().read_generation(t, {"logprobs": 1}, answer)
        assert str(err.value) == "--engine http://127.0.0.1:9: the answer has no choices"
        e, _ = table_engine({"/v1/completions": answer})
        with pytest.raises(EngineError) as err:
            e.generate([4], SamplingSettings(max_tokens=1, logprobs=1))
        assert str(err.value) == "--engine http://127.0.0.1:9: the answer has no choices"
    for answer in ({}, ["x"]):
        with pytest.raises(EngineError) as err:
            SglangAdapter().read_generation(t, {"top_logprobs_num": 1}, answer)
        assert str(err.value) == "--engine http://127.0.0.1:9: the answer has no meta_info"


def test_long_disagreeing_token_ids_name_the_first_eight():
    ids = list(range(10, 19))
    answer = completion_answer(ids, [-0.5] * 9, [{i: -0.5} for i in ids])
    answer["choices"][0]["token_ids"] = ids[:8] + [99]
    e, _ = table_engine({"/v1/completions": answer})
    with pytest.raises(EngineError) as err:
        e.generate([4], SamplingSettings(max_tokens=9, logprobs=1))
    assert str(err.value).endswith(f": token_ids {ids[:8]} disagree with the logprobs' tokens {ids[:8]}")


def test_a_generation_for_another_model_is_refused():
    e, _ = table_engine({"/v1/completions": completion_answer([7], [-0.5], [{7: -0.5}], model="other")})
    with pytest.raises(EngineError) as err:
        e.generate([4], SamplingSettings(max_tokens=1, logprobs=1))
    assert str(err.value) == "--engine http://127.0.0.1:9: answered for model 'other', not 'tiny' (model name mismatch)"


def test_adapter_details_at_their_edges():
    assert base_url("http://h:1/boX/") == "http://h:1/boX"  # only slashes are dropped from the end
    assert SglangAdapter()._sampling(SamplingSettings(top_k=1))["top_k"] == 1  # only 0 means off
    assert LlamacppAdapter().check(SamplingSettings(min_tokens=2)) == "min_tokens: llama.cpp's server has no such field"
    t, a = Transport("http://127.0.0.1:9"), SglangAdapter()
    top = [[-0.5, 7, None], [-1.0, 8, None], [-1.5, 9, None]]
    scored = a.read_score(t, {"input_ids": [1, 7], "top_logprobs_num": 2},
                          {"meta_info": {"input_token_logprobs": [[None, 1, None], [-0.5, 7, None]],
                                         "input_top_logprobs": [None, top]}})
    assert [x.token_id for x in scored[1].top] == [7, 8]  # the top 2 of the three listed
    _, steps, _ = a.read_generation(t, {"top_logprobs_num": 2}, {"meta_info": {
        "output_token_logprobs": [[-0.5, 7, None], [-1.0, 8, None]], "output_top_logprobs": [top, top]}})
    assert [(s.index, len(s.top)) for s in steps] == [(0, 2), (1, 2)]


def test_each_adapter_refuses_a_mode_it_lacks():
    for adapter, mode, message in [
            (VllmAdapter, "final", "logprobs mode 'final'; allowed: raw_logprobs, processed_logprobs, raw_logits, "
                                   "processed_logits"),
            (SglangAdapter, "raw_logits", "SGLang logprobs are raw_logprobs (SGLANG_RETURN_ORIGINAL_LOGPROB=1) or "
                                          "processed_logprobs, not 'raw_logits'"),
            (LlamacppAdapter, "raw_logits", "llama.cpp gives raw_logprobs or processed_logprobs "
                                            "(post_sampling_probs), not 'raw_logits'")]:
        with pytest.raises(EngineError) as err:
            adapter(mode)
        assert str(err.value) == message
