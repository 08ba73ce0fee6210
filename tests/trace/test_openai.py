"""`-f openai`: a decodelab trace as the OpenAI completions logprobs object, against the format and against a real
engine's answer (vLLM 0.32.0 serving the bundled tiny model, recorded in tests/engine/recordings/)."""

from __future__ import annotations

import json
import math

import pytest
from conftest import ROOT

from decodelab.core.errors import ConfigError
from decodelab.core.trace.format import DECODELAB, OPENAI, check_version, parse_trace, trace_kind
from decodelab.core.trace.openai import (ID_KEYS, PROCESSED, RAW, check_openai, is_openai, to_completion,
                                         to_logprobs)

RECORDING = ROOT / "tests" / "engine" / "recordings" / "vllm-0.32.0.json"
COMMANDS = {"sample", "score", "stream", "probs", "beam"}


def recorded(mode: str, index: int) -> tuple[dict, dict]:
    """(request body, parsed response) of one recorded /v1/completions call."""
    call = json.loads(RECORDING.read_text(encoding="utf-8"))["modes"][mode][index]
    assert call["path"] == "/v1/completions"
    return call["body"], json.loads(call["response"])


def run_json(cli, *args) -> dict:
    code, out, err = cli(*args, "-f", "json")
    assert code == 0, err
    return json.loads(out)


def prompt_text(ids: list[int]) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ROOT / "presets" / "models" / "tiny")
    text = tok.decode(ids)
    assert tok(text, add_special_tokens=False)["input_ids"] == ids, "the recorded prompt must round-trip as text"
    return text


def assert_completions_format(resp: dict) -> None:
    """The OpenAI `Completion` object (openai-python types/completion.py, completion_choice.py): id, object
    "text_completion", created int, model, choices [{index, text, finish_reason stop|length|content_filter,
    logprobs {tokens: [str], token_logprobs: [float], top_logprobs: [{str: float}], text_offset: [int]}}], usage."""
    assert isinstance(resp["id"], str) and resp["object"] == "text_completion" and isinstance(resp["created"], int)
    assert isinstance(resp["model"], str)
    for i, choice in enumerate(resp["choices"]):
        assert choice["index"] == i and isinstance(choice["text"], str)
        assert choice["finish_reason"] in ("stop", "length", "content_filter")
        lp = choice["logprobs"]
        assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        assert len({len(v) for v in lp.values()}) == 1, "the four lists run in step"
        assert all(isinstance(t, str) for t in lp["tokens"])
        assert all(isinstance(v, float) and v <= 0 for v in lp["token_logprobs"])
        assert all(isinstance(o, int) for o in lp["text_offset"])
        for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            assert all(isinstance(k, str) and isinstance(v, float) for k, v in top.items())
            assert next(iter(top)) == token and top[token] == value, "the returned token first, with its value"
    usage = resp["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    json.dumps(resp, allow_nan=False)  # no NaN or infinity: the format is plain JSON


def test_a_sample_trace_is_an_openai_completion(cli):
    doc = run_json(cli, "sample", "Once upon a time", "-n", "6", "-t", "0.8", "--top-p", "0.9", "--top", "4")
    resp = to_completion(doc)
    assert_completions_format(resp)
    lp = resp["choices"][0]["logprobs"]
    steps = doc["steps"]
    assert lp["tokens"] == [s["token"] for s in steps]
    assert lp["token_logprobs"] == [s["raw_logprob"] for s in steps], "raw by default, the trace's own numbers"
    assert lp["text_offset"] == [sum(len(s["token"]) for s in steps[:i]) for i in range(len(steps))]
    for top, s in zip(lp["top_logprobs"], steps):
        assert 4 <= len(top) <= 5, "N alternatives, plus the returned token when it is not among them"
        expected = {a["token"]: math.log(a["raw_prob"]) for a in s["alternatives"]}
        for token, value in list(top.items())[1:]:
            assert value == pytest.approx(expected[token], abs=1e-12)
        values = list(top.values())[1:]
        assert values == sorted(values, reverse=True), "after the returned token, most likely first"
    assert resp["choices"][0]["text"] == doc["text"]
    assert resp["usage"] == {"prompt_tokens": len(doc["prompt"]["token_ids"]), "completion_tokens": 6,
                             "total_tokens": len(doc["prompt"]["token_ids"]) + 6}
    assert resp["decodelab"] == {"command": "sample", "logprobs": "raw"}


def test_processed_logprobs_leave_out_what_the_chain_removed(cli):
    doc = run_json(cli, "sample", "Once upon a time", "-n", "4", "-t", "0.8", "--top-k", "2", "--top", "5")
    lp = to_logprobs(doc, PROCESSED)
    assert lp["token_logprobs"] == [s["logprob"] for s in doc["steps"]]
    for top, s in zip(lp["top_logprobs"], doc["steps"]):
        kept = {a["token"] for a in s["alternatives"] if a["prob"] > 0}
        assert set(top) == kept | {s["token"]} and len(top) <= 2, "top-k 2 keeps two; removed ones have no log"


def test_a_score_trace_lists_the_scored_tokens(cli):
    doc = run_json(cli, "score", "Once upon a time there was")
    resp = to_completion(doc)
    assert_completions_format(resp)
    lp = resp["choices"][0]["logprobs"]
    assert lp["tokens"] == [s["token"] for s in doc["steps"]]
    assert lp["token_logprobs"] == [s["raw_logprob"] for s in doc["steps"]]
    assert lp["top_logprobs"] == [{s["token"]: s["raw_logprob"]} for s in doc["steps"]], "score keeps no others"
    assert resp["choices"][0]["text"] == "".join(lp["tokens"]) and resp["usage"]["completion_tokens"] == 0


def test_greedy_equals_vllm_raw_logprobs_of_the_same_model(cli):
    """The oracle: vLLM's own answer for greedy decoding of the tiny model (raw logprobs, ids as keys) and the
    converted decodelab trace of the same request agree token for token, offset for offset, key for key."""
    body, resp = recorded("raw_logprobs", 6)
    assert body["temperature"] == 0.0 and body["logprobs"] == 5 and body["return_tokens_as_token_ids"]
    doc = run_json(cli, "sample", prompt_text(body["prompt"]), "-t", "0", "-n", str(body["max_tokens"]),
                   "--ignore-eos", "--top", "5")
    mine, theirs = to_completion(doc, RAW, ID_KEYS), resp
    _same_logprobs(mine["choices"][0]["logprobs"], theirs["choices"][0]["logprobs"])
    assert mine["choices"][0]["finish_reason"] == theirs["choices"][0]["finish_reason"] == "length"
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert mine["usage"][key] == theirs["usage"][key]


def test_processed_equals_vllm_processed_logprobs_on_the_same_tokens(cli):
    """vLLM's processed logprobs (temperature 0.8, top-k 5, logprobs 8) of the tokens it drew, against decodelab's
    processed trace of the same tokens (forced: decodelab's seed draws others): the same numbers, and the
    candidates top-k removed (vLLM: -9999.0) left out."""
    body, resp = recorded("processed_logprobs", 14)
    assert (body["temperature"], body["top_k"], body["logprobs"]) == (0.8, 5, 8)
    theirs = resp["choices"][0]["logprobs"]
    forced = [w for i, t in enumerate(theirs["tokens"]) for w in ("--force", f"{i}={t.split(':')[1]}")]
    doc = run_json(cli, "sample", prompt_text(body["prompt"]), "-t", "0.8", "--top-k", "5", "-n",
                   str(body["max_tokens"]), "--ignore-eos", "--top", "8", *forced)
    kept = {**theirs, "top_logprobs": [{k: v for k, v in top.items() if v > -9999.0}
                                       for top in theirs["top_logprobs"]]}
    _same_logprobs(to_logprobs(doc, PROCESSED, ID_KEYS), kept)


def _same_logprobs(mine: dict, theirs: dict) -> None:
    assert mine["tokens"] == theirs["tokens"]
    assert mine["text_offset"] == theirs["text_offset"], "vLLM counts offsets over the returned token strings"
    assert mine["token_logprobs"] == pytest.approx(theirs["token_logprobs"], abs=2e-5)  # float32 on two engines
    for a, b in zip(mine["top_logprobs"], theirs["top_logprobs"]):
        assert list(a) == list(b), "the same candidates in the same order: the returned token, then by rank"
        assert list(a.values()) == pytest.approx(list(b.values()), abs=2e-5)


def test_documents_without_per_token_logprobs_are_refused_in_one_line(cli):
    many = run_json(cli, "sample", "Once upon", "-n", "2", "-N", "2")
    with pytest.raises(ConfigError, match="sample -N"):
        to_logprobs(many)
    probs = run_json(cli, "probs", "Once upon", "--top", "2")
    with pytest.raises(ConfigError, match="-f openai: a probs document"):
        to_logprobs(probs)
    with pytest.raises(ConfigError, match="allowed: raw, processed"):
        to_logprobs({"command": "sample", "steps": []}, "softmax")


def test_an_engine_response_is_openai_and_a_trace_is_decodelab():
    _, resp = recorded("raw_logprobs", 28)  # echo: the first prompt token has null
    assert is_openai(resp) and is_openai(resp["choices"][0]["logprobs"])
    assert resp["choices"][0]["logprobs"]["token_logprobs"][0] is None
    assert trace_kind(resp, "f", COMMANDS) == OPENAI
    assert trace_kind({"command": "sample", "steps": []}, "f", COMMANDS) == DECODELAB
    assert not is_openai({"choices": [{"text": "no logprobs"}]}) and not is_openai({"tokens": "a"})


@pytest.mark.parametrize("doc, message", [
    ({"command": "ls"}, "command 'ls' is not a decodelab command"),
    ({"command": "sample", "format_version": 2}, "format_version 2 is newer than this decodelab reads"),
    ({"command": "sample", "format_version": "1"}, "not a version number"),
    ({"choices": []}, "not a decodelab trace"),
    ([1, 2], "not a decodelab trace"),
])
def test_what_is_not_a_trace_is_one_line(doc, message):
    with pytest.raises(ConfigError, match=message):
        trace_kind(doc, "TRACE x.json", COMMANDS)


def test_a_document_without_a_version_is_version_1():
    check_version({"command": "sample"}, "x")
    check_version({"command": "sample", "format_version": 1}, "x")


# --- mutation run of core/trace/openai.py and format.py (2026-12-01): the cases its survivors asked for ----------


def test_a_processed_score_trace_writes_the_chains_logprobs_and_null_for_a_removed_token(cli):
    """`score -t 0.5 --top-k 1`: the processed log-probability differs from the raw one wherever the token is kept
    (temperature) and is null where top-k removed the scored token; its top is then null, not {token: null}."""
    doc = run_json(cli, "score", "Once upon a time there was", "-t", "0.5", "--top-k", "1")
    steps = doc["steps"]
    assert any(s["logprob"] is None for s in steps) and any(s["logprob"] is not None for s in steps)
    assert all(s["logprob"] != s["raw_logprob"] for s in steps), "the case must tell the two distributions apart"
    lp = to_logprobs(doc, PROCESSED, ID_KEYS)
    assert lp["tokens"] == [f"token_id:{s['token_id']}" for s in steps]
    assert lp["token_logprobs"] == [s["logprob"] for s in steps]
    assert lp["top_logprobs"] == [None if s["logprob"] is None else {f"token_id:{s['token_id']}": s["logprob"]}
                                  for s in steps]
    assert to_logprobs(doc, RAW)["token_logprobs"] == [s["raw_logprob"] for s in steps]


def test_a_generating_stream_trace_is_written_and_a_scoring_one_refused(cli):
    doc = run_json(cli, "stream", "Once upon a time", "-n", "3", "--top", "2")
    assert doc["mode"] == "generate"
    lp = to_logprobs(doc)
    assert lp["tokens"] == [s["token"] for s in doc["steps"]]
    assert lp["token_logprobs"] == [s["raw_logprob"] for s in doc["steps"]]
    with pytest.raises(ConfigError) as refused:
        to_logprobs({**doc, "mode": "score"})
    assert str(refused.value) == ("-f openai: a stream score document has no per-token log-probabilities to write; "
                                  "`sample`, `score` and `stream` (generating) have")
    with pytest.raises(ConfigError) as refused:
        to_logprobs({"command": "sample", "samples": [], "steps": None})
    assert str(refused.value).startswith("-f openai: a sample -N (no per-token steps) document has no ")
    with pytest.raises(ConfigError, match=r"^token_keys 'names': allowed: text, ids$"):
        to_logprobs(doc, RAW, "names")


def _step(token: str, token_id: int, logprob: float) -> dict:
    return {"token": token, "token_id": token_id, "logprob": logprob, "raw_logprob": logprob, "alternatives": []}


def test_a_completions_text_is_the_documents_text_and_its_finish_reason_the_stop_reason():
    """The response's text is the trace's text, not the tokens' pieces joined (a byte-level piece, "\ufffd", is
    not the text's character); an EOS stop finishes "stop"; a trace without a text has an empty one."""
    doc = {"command": "sample", "model": "m", "text": "é", "prompt": {"token_ids": [1, 2]},
           "steps": [_step("\ufffd", 7, -0.5), _step("\ufffd", 8, -0.25)], "summary": {"stop_reason": "eos"}}
    resp = to_completion(doc)
    assert resp["id"] == "decodelab-sample" and resp["created"] == 0
    choice = resp["choices"][0]
    assert choice["text"] == "é" and choice["finish_reason"] == "stop"
    assert resp["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    no_text = {k: v for k, v in doc.items() if k != "text"}
    assert to_completion(no_text)["choices"][0]["text"] == ""
    assert to_completion({**doc, "summary": {"stop_reason": "length"}})["choices"][0]["finish_reason"] == "length"


def test_a_logprobs_object_whose_lists_do_not_run_in_step_is_one_line():
    good = {"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0], "top_logprobs": None, "text_offset": [0, 1]}
    check_openai(good, "TRACE x")  # top_logprobs null: allowed
    check_openai({"choices": [{"logprobs": good}]}, "TRACE x")
    with pytest.raises(ConfigError, match=r"^TRACE x: logprobs.text_offset has 1 entries for 2 tokens; the lists "):
        check_openai({**good, "text_offset": [0]}, "TRACE x")
    with pytest.raises(ConfigError, match=r"^TRACE x: logprobs.top_logprobs has 'none' entries for 2 tokens"):
        check_openai({**good, "top_logprobs": "none"}, "TRACE x")
    with pytest.raises(ConfigError, match=r"^TRACE x: choices\[1\]: logprobs.token_logprobs has 1 entries"):
        check_openai({"choices": [{"logprobs": good}, {"logprobs": {**good, "token_logprobs": [-1.0]}}]}, "TRACE x")


def test_what_is_not_a_trace_says_what_it_is_and_what_is_allowed():
    assert not is_openai([1, 2]) and not is_openai("text")
    with pytest.raises(ConfigError) as refused:
        trace_kind({"command": "ls"}, "TRACE x.json", COMMANDS)
    assert str(refused.value) == "TRACE x.json: command 'ls' is not a decodelab command (beam, probs, sample, " \
                                 "score, stream)"
    with pytest.raises(ConfigError, match=r"^TRACE x.json: format_version 2 is newer"):
        trace_kind({"command": "sample", "format_version": 2}, "TRACE x.json", COMMANDS)
    with pytest.raises(ConfigError, match=r"OpenAI completions response .*: list$"):
        trace_kind([1, 2], "TRACE x.json", COMMANDS)
    with pytest.raises(ConfigError, match=r"OpenAI completions response .*: an object without `command` or "
                                          r"`choices`$"):
        trace_kind({"hello": 1}, "TRACE x.json", COMMANDS)


def test_a_trace_file_that_is_not_one_json_document_is_one_line():
    assert parse_trace("TRACE x", '{"command": "sample"}') == {"command": "sample"}
    hint = "; give one document, a trace written with `-f json` or an OpenAI completions response"
    for text, what in [("not json", "not JSON (Expecting value at line 1)"),
                       ('{"command": "sample"}\n{"type": "summary"}\n', "several JSON values (JSON lines?)"),
                       ("[" * 65 + "]" * 65, "nested deeper than 64 levels; decodelab reads flatter documents")]:
        with pytest.raises(ConfigError) as refused:
            parse_trace("TRACE x", text)
        assert str(refused.value) == f"TRACE x: {what}" + ("" if what.startswith("nested") else hint)


# --- the order of top_logprobs (issue 40: ordered by the processed probability in raw mode, no test failed) -------

def test_top_logprobs_follow_the_distribution_they_are_taken_from():
    """Each step's top_logprobs: the returned token, then the alternatives by the chosen distribution's probability,
    highest first. The two distributions here rank the alternatives in opposite orders (a temperature and a
    penalty can do that), so writing raw values in the processed order (or the reverse) fails."""
    lg = math.log
    step = {"token": "x", "token_id": 5, "prob": 0.5, "logprob": lg(0.5), "raw_prob": 0.25, "raw_logprob": lg(0.25),
            "alternatives": [{"token": "a", "token_id": 1, "prob": 0.3, "raw_prob": 0.1},
                             {"token": "b", "token_id": 2, "prob": 0.15, "raw_prob": 0.4},
                             {"token": "c", "token_id": 3, "prob": 0.05, "raw_prob": 0.2}]}
    doc = {"command": "sample", "steps": [step], "text": "x"}
    raw = to_logprobs(doc, RAW)["top_logprobs"][0]
    assert list(raw) == ["x", "b", "c", "a"] and list(raw.values()) == [lg(0.25), lg(0.4), lg(0.2), lg(0.1)]
    processed = to_logprobs(doc, PROCESSED)["top_logprobs"][0]
    assert list(processed) == ["x", "a", "b", "c"]
    assert list(processed.values()) == [lg(0.5), lg(0.3), lg(0.15), lg(0.05)]


def test_check_logprobs_reads_decodelabs_own_openai_answer(cli, tmp_path):
    """Issue 40: `check-logprobs` refused `sample -f openai`'s output (the prompt's ids unknown) unless wrapped in a
    request. The answer carries the ids as vLLM's return_token_ids does, and its raw log-probabilities are found
    raw, every token within the tolerance."""
    code, out, err = cli("sample", "Once upon", "-n", "4", "-t", "0.8", "--seed", "1", "-f", "openai", "--threads", "1")
    assert code == 0, err
    answer = json.loads(out)
    doc = run_json(cli, "sample", "Once upon", "-n", "4", "-t", "0.8", "--seed", "1", "--threads", "1")
    assert answer["choices"][0]["prompt_token_ids"] == doc["prompt"]["token_ids"]
    assert answer["choices"][0]["token_ids"] == doc["token_ids"]
    path = tmp_path / "answer.json"
    path.write_text(out, encoding="utf-8")
    code, out, err = cli("check-logprobs", str(path), "-f", "json", "--threads", "1")
    assert code == 0, err
    report = json.loads(out)
    assert report["answers"][0]["prompt_token_ids"] == doc["prompt"]["token_ids"]
    assert [r["token_id"] for r in report["tokens"]] == doc["token_ids"]
    assert [r["label"] for r in report["tokens"]] == ["raw"] * 4 and report["summary"]["labels"]["raw"] == 4
