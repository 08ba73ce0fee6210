"""core/methods/served.py without a server: the connection's checks, the rows and summaries of sample and score
--engine, the batch baseline and the local recomputation, against a table transport (tests/engine/fake_server.py)
and values worked by hand (the CLI runs against recorded vLLM answers are in tests/engine/test_engine_cli.py)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from fake_server import completion_answer, models_answer, prompt_answer, table_engine  # noqa: E402

from decodelab.core.engine.http.transport import EngineError  # noqa: E402
from decodelab.core.engine.http.wire import PROCESSED, RAW, SamplingSettings  # noqa: E402
from decodelab.core.errors import ConfigError  # noqa: E402
from decodelab.core.methods import served as m  # noqa: E402
from decodelab.core.methods.sample import SampleSettings  # noqa: E402
from decodelab.core.sampling.export import neutral_request  # noqa: E402

URL = "http://127.0.0.1:9"


@pytest.fixture(scope="module")
def lm():
    from decodelab.core.engine.models import load_model

    return load_model("tiny", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def local():
    from decodelab.core.engine.models import load_tokenizer

    return load_tokenizer("tiny")  # vocabulary 4096, end id 0


def connection(local, answers: dict, mode="raw_logprobs", owned_by="vllm", max_top_n=20) -> m.Connection:
    e, _ = table_engine({"/v1/models": models_answer("tiny", owned_by=owned_by), **answers}, logprobs_mode=mode,
                        max_top_n=max_top_n)
    return m.Connection(e, local, mode, "probe", True)


# --------------------------------------------------------------------------------------------------------------
# mutation run of core/methods/served.py (2026-12-02)


def test_finish_to_stop_and_probability():
    assert m.finish_to_stop("stop", [5, 0], [0]) == "eos" and m.finish_to_stop("stop", (5, 0), (2, 0)) == "eos"
    assert m.finish_to_stop("stop", [0, 5], [0]) == "stop" and m.finish_to_stop("stop", [], [0]) == "stop"
    assert m.finish_to_stop("stop", [0, 0, 5], [0]) == "stop"  # the last token, not the second
    assert m.finish_to_stop("length", [5, 0], [0]) == "length" and m.finish_to_stop(None, [5], [0]) == "length"
    assert m.finish_to_stop("abort", [5], [0]) == "abort" and m.finish_to_stop("", [5], [0]) == "length"
    assert m.probability(None) is None and m.probability(0.0) == 1.0
    assert m.probability(math.log(0.25)) == pytest.approx(0.25, abs=1e-15) and m.probability(-math.inf) == 0.0


def test_needs_by_option_in_order():
    s = SampleSettings(temperature=0.0, cache=None)
    assert list(m.sample_needs(s).items()) == [("generate", "sample --engine")]
    s = SampleSettings(temperature=0.7, cache="window:size=8")
    assert list(m.sample_needs(s, kept_ids=True).items()) == [
        ("generate", "sample --engine"), ("seeded", "--seed"), ("kv_policies", "--cache window:size=8"),
        ("full_logits", "--kept-ids")]
    assert m.sample_needs(SampleSettings(temperature=1.0, cache="full")) == {"generate": "sample --engine",
                                                                             "seeded": "--seed"}
    s = SimpleNamespace(against=None, against_cache=None, cache=None, feed=None)
    assert m.score_needs(s, []) == {"score": "score --engine"}
    assert list(m.score_needs(s, ["top-p", "min-p"]).items()) == [
        ("score", "score --engine"), ("full_logits", "the chain (top-p, min-p: its processed log-probability)")]
    assert m.score_needs(SimpleNamespace(against="tiny", against_cache=None, cache="full", feed=None), ["top-p"]) == {
        "score": "score --engine", "full_logits": "--against/--against-cache (KL against a reference)"}
    assert m.score_needs(SimpleNamespace(against=None, against_cache="full", cache=None, feed=None), [])[
        "full_logits"] == "--against/--against-cache (KL against a reference)"
    assert list(m.score_needs(SimpleNamespace(against="tiny", against_cache=None, cache="window:size=8", feed=None),
                              [], kept=True).items()) == [
        ("score", "score --engine"), ("full_logits", "--kept-ids/--renormalize"), ("kv_policies", "--cache/--feed")]
    assert m.score_needs(SimpleNamespace(against=None, against_cache=None, cache=None, feed=4), []) == {
        "score": "score --engine", "kv_policies": "--cache/--feed"}


def test_the_connection_describes_itself_and_refuses_logits(local):
    conn = connection(local, {}, mode="raw_logits")
    assert (conn.values, conn.kind, conn.backend()) == ("raw_logits", "vllm", f"the vllm server at {URL}")
    assert conn.describe() == {"url": URL, "kind": "vllm", "served_model": "tiny", "logprobs_mode": "raw_logits",
                               "mode_found_by": "probe", "tokenizer_checked": True,
                               "capabilities": conn.engine.capabilities.to_dict()}
    with pytest.raises(ConfigError) as err:
        m.require_logprobs(conn, "sample")
    assert str(err.value) == (f"sample --engine {URL}: the server runs --logprobs-mode raw_logits (logits, not "
                              "log-probabilities); restart it with raw_logprobs or processed_logprobs")
    m.require_logprobs(connection(local, {}), "sample")
    m.require_logprobs(connection(local, {}, mode="processed_logprobs"), "sample")
    with pytest.raises(ConfigError) as err:
        m.refuse_on_engine(connection(local, {}, owned_by="llamacpp"), {"generate": "g", "score": "score --engine"})
    assert str(err.value).startswith("score --engine: needs scoring a given sequence (prompt logprobs), which the "
                                     f"llamacpp server at {URL} cannot give")


def test_check_vocabulary_reads_every_listed_id(local):
    from decodelab.core.engine.http.wire import Alternative, Position

    conn = connection(local, {})
    m.check_vocabulary(conn, [Position(0, 0, -1.0, 1, (Alternative(4095, -2.0),))])
    for token_id, listed in [(4096, 3), (3, 4096), (-1, 3), (3, -1)]:
        with pytest.raises(EngineError) as err:
            listing = (Alternative(3, -1.0), Alternative(listed, -2.0))
            m.check_vocabulary(conn, [Position(0, 5, -1.0, 1, ()), Position(1, token_id, -1.0, 1, listing)])
        bad = token_id if token_id != 3 else listed
        assert str(err.value) == (f"--engine {URL}: the server answered token id {bad}, outside --model tiny's "
                                  "vocabulary of 4096: the served model's vocabulary differs; point -m at the served "
                                  "model's folder")


def test_request_of_and_for(local):
    # token texts resolved by the local tokenizer: " the" is the one token 261, "the" encodes as [1057]
    settings = SampleSettings(temperature=0.7, top_k=5, max_new_tokens=4, seed=3, logit_bias=((" the", 2.0),),
                              allow=("the",))
    request, notes = m.request_of(local, settings, 2)
    assert (request.logprobs, request.max_tokens, request.temperature, request.top_k, request.seed) == (2, 4, 0.7, 5, 3)
    assert request.logit_bias == {261: 2.0} and request.allowed_token_ids == (1057,) and notes == []
    with pytest.raises(ConfigError) as err:
        m.request_of(local, settings, 0)
    assert str(err.value) == "--top 0: a served engine lists at least 1 alternative (each token's logprob)"
    conn = connection(local, {})
    assert m.request_for(conn, settings, 20)[0].logprobs == 20
    with pytest.raises(ConfigError) as err:
        m.request_for(conn, settings, 21)
    assert str(err.value) == "--top 21: the server lists 1..20 alternatives (vLLM's --max-logprobs)"
    assert m.request_for(connection(local, {}, max_top_n=None), settings, 500)[0].logprobs == 500  # no limit


def sample_answers(replay_fails: bool = False):
    """Two generated tokens 7, 8 after the prompt [4, 5], listed with their top 2; the replay of [4, 5, 7, 8] lists
    7 at -0.6 (rank 1) beside 3, and 8 at -2.1 (rank 3) outside its top 2 (3, 9)."""
    generation = completion_answer([7, 8], [-0.5, -2.0], [{7: -0.5, 3: -1.0}, {8: -2.0, 3: -0.25}])
    replay = prompt_answer([None, {5: (-1.0, 1)}, {7: (-0.6, 1), 3: (-1.1, 2)},
                            {8: (-2.1, 3), 3: (-0.3, 1), 9: (-1.0, 2)}])

    def answer(body):
        if "prompt_logprobs" not in body:
            return generation
        if replay_fails:
            raise EngineError(f"--engine {URL}: POST /v1/completions: HTTP 500: injected")
        assert body["prompt"] == [4, 5, 7, 8] and body["prompt_logprobs"] == 2
        return replay

    return {"/v1/completions": answer}


def alternatives(step) -> list[tuple]:
    return [(a.token_id, a.prob, a.raw_prob) for a in step.alternatives]


def test_sample_rows_in_raw_mode(local):
    e = math.exp
    run = m.ServedSample(connection(local, sample_answers()), [4, 5], SamplingSettings(max_tokens=2, logprobs=2),
                         notes=("a note",))
    assert run.notes == ["a note"] and run.new_ids == []
    s0, s1 = list(run)
    assert run.new_ids == [7, 8] and run.error is None and run.replayed.token_ids == (4, 5, 7, 8)
    assert (s0.index, s0.position, s0.token_id, s0.token, s0.prob, s0.logprob) == (0, 2, 7, local.token_text(7),
                                                                                    None, None)
    assert (s0.raw_prob, s0.raw_logprob, s0.raw_rank, s0.values, s0.defects) == (e(-0.5), -0.5, 1, RAW, [])
    assert alternatives(s0) == [(7, None, e(-0.5)), (3, None, e(-1.0))]
    assert [a.token for a in s0.alternatives] == [local.token_text(7), local.token_text(3)]
    assert s0.tail_mass == pytest.approx(1 - e(-0.5) - e(-1.0), abs=1e-12)
    assert (s1.index, s1.position, s1.raw_logprob, s1.raw_rank) == (1, 3, -2.0, 3)  # the replay's rank
    assert alternatives(s1) == [(3, None, e(-0.25)), (8, None, e(-2.0))]
    summary = run.summary()
    assert (summary.new_tokens, summary.mean_logprob, summary.stop_reason, summary.finish_reason, summary.values,
            summary.raw_from, summary.top_n, summary.truncated) == (2, None, "length", "length", RAW, "generation",
                                                                    2, True)
    assert summary.raw_perplexity == pytest.approx(e(1.25), rel=1e-12)
    assert summary.seconds == run.generated.seconds and summary.tokens_per_s == pytest.approx(2 / summary.seconds)


def test_sample_rows_in_processed_mode(local):
    e = math.exp
    run = m.ServedSample(connection(local, sample_answers(), mode="processed_logprobs"), [4, 5],
                         SamplingSettings(max_tokens=2, logprobs=2))
    s0, s1 = list(run)
    assert (s0.prob, s0.logprob, s0.raw_prob, s0.raw_logprob, s0.raw_rank, s0.values) == (
        e(-0.5), -0.5, e(-0.6), -0.6, 1, PROCESSED)
    assert alternatives(s0) == [(7, e(-0.5), e(-0.6)), (3, e(-1.0), e(-1.1))]
    assert (s1.prob, s1.logprob, s1.raw_logprob, s1.raw_rank) == (e(-2.0), -2.0, -2.1, 3)
    assert alternatives(s1) == [(3, e(-0.25), e(-0.3)), (8, e(-2.0), None)]  # 8 is not in the replay's top 2
    summary = run.summary()
    assert (summary.mean_logprob, summary.values, summary.raw_from) == (-1.25, PROCESSED, "replay")
    assert summary.raw_perplexity == pytest.approx(e(1.35), rel=1e-12)


def test_a_failed_replay_keeps_the_generation(local):
    e = math.exp
    for mode in ("processed_logprobs", "raw_logprobs"):
        run = m.ServedSample(connection(local, sample_answers(replay_fails=True), mode=mode), [4, 5],
                             SamplingSettings(max_tokens=2, logprobs=2))
        s0, s1 = list(run)
        assert str(run.error) == f"--engine {URL}: POST /v1/completions: HTTP 500: injected" and run.replayed is None
        assert (s0.raw_rank, s1.raw_rank) == (1, 2)  # the generation's own ranks in its top 2
        summary = run.summary()
        if mode == "processed_logprobs":
            assert (s0.raw_logprob, s0.raw_prob, alternatives(s0)) == (None, None, [(7, e(-0.5), None),
                                                                                    (3, e(-1.0), None)])
            assert (summary.raw_from, summary.raw_perplexity, summary.mean_logprob) == (None, None, -1.25)
        else:
            assert (s0.raw_logprob, summary.raw_from) == (-0.5, "generation")


def test_sample_without_a_replay_or_tokens(local):
    generation = {"stop_type": "eos", "completion_probabilities": [
        {"id": 7, "logprob": -0.5, "top_logprobs": [{"id": 7, "logprob": -0.5}]},
        {"id": 0, "logprob": -0.25, "top_logprobs": [{"id": 0, "logprob": -0.25}]}]}
    conn = connection(local, {"/completion": generation}, owned_by="llamacpp")
    run = m.ServedSample(conn, [4, 5], neutral_request(max_tokens=2, logprobs=1))
    assert [s.raw_logprob for s in run] == [-0.5, -0.25] and run.replayed is None and run.error is None
    assert [path for _, path, _ in conn.engine.transport.sent] == ["/v1/models", "/completion"]  # no replay sent
    assert run.stop_reason == "eos" and run.summary().stop_reason == "eos" and run.summary().finish_reason == "stop"
    empty = completion_answer([], [], [], finish="stop")
    conn = connection(local, {"/v1/completions": empty})
    run = m.ServedSample(conn, [4, 5], SamplingSettings(max_tokens=2, logprobs=1))
    before = run.summary()  # nothing run yet: no generation, no time
    assert (before.new_tokens, before.values, before.finish_reason, before.raw_from, before.stop_reason) == (
        0, RAW, None, None, "length")
    assert math.isnan(before.seconds) and math.isnan(before.tokens_per_s)
    assert list(run) == [] and run.stop_reason == "stop"
    assert [path for _, path, _ in conn.engine.transport.sent] == ["/v1/models", "/v1/completions"]
    summary = run.summary()
    assert (summary.new_tokens, summary.mean_logprob, summary.raw_perplexity, summary.raw_from) == (0, None, None, None)
    assert summary.tokens_per_s == 0.0


def test_score_rows_and_summary_by_hand(local):
    answer = prompt_answer([None, {5: (-1.0, 2), 3: (-0.5, 1)}, {6: (-2.0, 1)}, {7: (-3.0, 4), 1: (-0.1, 1)}])
    conn = connection(local, {"/v1/completions": answer})
    run = m.ServedScore(conn, [4, 5, 6, 7], top_n=2, chunk=2)
    before = run.summary()  # nothing scored yet
    assert (before.tokens, before.chunks, before.stop_reason, before.values) == (0, [], "end", RAW)
    assert math.isnan(before.perplexity) and math.isnan(before.mean_nll) and math.isnan(before.tokens_per_s)
    rows = list(run)
    assert conn.engine.transport.sent[-1][2]["prompt_logprobs"] == 2
    assert [(r.position, r.token_id, r.token, r.raw_logprob, r.raw_rank) for r in rows] == [
        (1, 5, local.token_text(5), -1.0, 2), (2, 6, local.token_text(6), -2.0, 1),
        (3, 7, local.token_text(7), -3.0, 4)]
    assert [(a.token_id, a.token, a.raw_logprob) for a in rows[0].alternatives] == [
        (3, local.token_text(3), -0.5), (5, local.token_text(5), -1.0)]
    assert rows[0].tail_mass == pytest.approx(1 - math.exp(-0.5) - math.exp(-1.0), abs=1e-12)
    assert rows[1].defects == [] and rows[0].to_dict()["alternatives"][0] == {"token_id": 3,
                                                                              "token": local.token_text(3),
                                                                              "raw_logprob": -0.5}
    summary = run.summary()
    assert (summary.tokens, summary.mean_nll, summary.stop_reason, summary.values, summary.top_n) == (
        3, 2.0, "end", RAW, 2)
    assert summary.perplexity == pytest.approx(math.exp(2.0), rel=1e-12)
    assert [(c.start, c.end) for c in summary.chunks] == [(1, 3), (3, 4)]  # chunks of 2 scored positions
    assert [c.perplexity for c in summary.chunks] == pytest.approx([math.exp(1.5), math.exp(3.0)], rel=1e-12)
    assert summary.seconds == run.seconds > 0 and summary.tokens_per_s == pytest.approx(3 / run.seconds)
    whole = m.ServedScore(connection(local, {"/v1/completions": answer}), [4, 5, 6, 7], top_n=2)
    list(whole)
    assert [(c.start, c.end) for c in whole.summary().chunks] == [(1, 4)]
    with pytest.raises(ConfigError) as err:
        m.ServedScore(conn, [4], top_n=2)
    assert str(err.value) == "TEXT: 1 token(s); scoring needs at least 2 (the first is context)"
    bad = prompt_answer([None, {5: (-1.0, 2), 4096: (-0.5, 1)}])
    with pytest.raises(EngineError, match="the server answered token id 4096"):
        list(m.ServedScore(connection(local, {"/v1/completions": bad}), [4, 5], top_n=2))


def test_engine_baseline_counts_by_hand(local):
    from decodelab.core.methods.batch.run import Entry

    answers = {(4, 5): completion_answer([1, 2], [-0.5, -0.5], [{1: -0.5}, {2: -0.5}],
                                         usage={"prompt_tokens_details": {"cached_tokens": 2}}),
               (6,): completion_answer([3], [-0.5], [{3: -0.5}], finish="stop",
                                       usage={"prompt_tokens_details": {"cached_tokens": 0}})}

    def answer(body):
        if tuple(body["prompt"]) not in answers:
            raise EngineError(f"--engine {URL}: POST /v1/completions: HTTP 500: request c failed")
        assert body["logprobs"] == 1 and body["temperature"] == 0.0
        return answers[tuple(body["prompt"])]

    metrics = iter(['vllm:prefix_cache_hits_total{engine="0"} 10\nvllm:prefix_cache_queries_total{engine="0"} 20\n',
                    'vllm:prefix_cache_hits_total{engine="0"} 14\nvllm:prefix_cache_queries_total{engine="0"} 25\n'])
    conn = connection(local, {"/v1/completions": answer, "/metrics": lambda body: next(metrics)})
    settings = SampleSettings(temperature=0.0, max_new_tokens=2)
    entries = [Entry("a", "x", settings), Entry("b", "y", settings), Entry("c", "z", settings)]
    reference = [SimpleNamespace(id="a", new_ids=[1, 2]), SimpleNamespace(id="b", new_ids=[9])]
    base = m.engine_baseline(conn, entries, [[4, 5], [6], [7, 8, 9]], reference)
    assert (base.name, base.same_tokens, base.reason) == ("engine", 1, f"--engine {URL}: POST /v1/completions: "
                                                                       "HTTP 500: request c failed")
    assert base.details == {"prompt_tokens": 6, "tokens": 3, "requests_done": 2, "prefix_hit_tokens": 4,
                            "prefix_query_tokens": 5, "prefix_hit_rate": 0.8, "cached_tokens": 2}
    assert [{k: r[k] for k in ("id", "token_ids", "finish_reason", "cached_tokens")} for r in base.requests] == [
        {"id": "a", "token_ids": [1, 2], "finish_reason": "length", "cached_tokens": 2},
        {"id": "b", "token_ids": [3], "finish_reason": "stop", "cached_tokens": 0}]
    assert all(r["seconds"] > 0 for r in base.requests) and base.seconds > 0
    assert base.tokens_per_s == pytest.approx(3 / base.seconds)


def test_engine_baseline_without_counters(local):
    from decodelab.core.methods.batch.run import Entry

    def answer(body):  # SGLang: no metrics, no cached tokens; one request answers no token
        ids = [] if body["input_ids"] == [6] else [1]
        return {"meta_info": {"output_token_logprobs": [[-0.5, i, None] for i in ids], "finish_reason": "length"}}

    conn = connection(local, {"/generate": answer}, owned_by="sglang", mode="processed_logprobs")
    settings = SampleSettings(temperature=0.0, max_new_tokens=1)
    base = m.engine_baseline(conn, [Entry("a", "x", settings), Entry("b", "y", settings)], [[4, 5], [6]],
                             [SimpleNamespace(id="a", new_ids=[1]), SimpleNamespace(id="b", new_ids=[])])
    assert base.details == {"prompt_tokens": 3, "tokens": 1, "requests_done": 2}
    assert (base.same_tokens, base.reason) == (2, None) and base.requests[1]["cached_tokens"] is None
    empty = m.engine_baseline(conn, [Entry("b", "y", settings)], [[6]], [])
    assert (empty.tokens_per_s, empty.same_tokens, empty.details["tokens"]) == (None, 0, 0)
    metrics = iter(["vllm:prefix_cache_queries_total 0\n", "vllm:prefix_cache_queries_total 0\n"])
    conn = connection(local, {"/v1/completions": completion_answer([1], [-0.5], [{1: -0.5}]),
                              "/metrics": lambda body: next(metrics)})
    base = m.engine_baseline(conn, [Entry("a", "x", settings)], [[4]], [])
    assert (base.details["prefix_hit_rate"], base.details["prefix_query_tokens"]) == (0.0, 0)


def serving(local, monkeypatch, owned_by="vllm", server_ids=None, gen_top=None):
    """connect() against a table transport: the server tokenises PROBE_TEXT as server_ids (default: as the local
    tokenizer does); a vLLM probe generates token 7 with gen_top listed, replayed raw at 7: -0.5, 8: -1.5."""
    local_ids = list(local.tokenizer.encode(m.PROBE_TEXT, add_special_tokens=True))
    server_ids = local_ids if server_ids is None else server_ids
    gen_top = gen_top or {7: -0.5, 8: -1.5}

    def completions(body):
        if "prompt_logprobs" in body:
            return prompt_answer([None] + [{t: (-1.0, 1)} for t in body["prompt"][1:-1]] + [{7: (-0.5, 1),
                                                                                              8: (-1.5, 2)}])
        return completion_answer([7], [gen_top[7]], [gen_top])

    answers = {"/v1/models": models_answer("tiny", owned_by=owned_by), "/tokenize": {"tokens": server_ids},
               "/v1/completions": completions}
    made = []

    def engine(url, model=None, timeout=60.0):
        e, t = table_engine(answers, model=model)
        made.append((url, model, timeout, t))
        return e

    monkeypatch.setattr(m, "ServedEngine", engine)
    return made, local_ids


def test_connect_checks_the_tokenizer_and_probes_the_mode(local, monkeypatch):
    made, local_ids = serving(local, monkeypatch)
    conn = m.connect("http://127.0.0.1:9", local, {"generate": "sample --engine"}, model="tiny", timeout=7.0)
    (url, model, timeout, t), = made
    assert (url, model, timeout) == ("http://127.0.0.1:9", "tiny", 7.0)
    assert (conn.logprobs_mode, conn.mode_found_by, conn.tokenizer_checked, conn.local) == (
        "raw_logprobs", "probe", True, local)
    assert t.sent[1] == ("POST", "/tokenize", {"model": "tiny", "prompt": m.PROBE_TEXT, "add_special_tokens": True})
    assert t.sent[2][2]["prompt"] == local_ids[:8] and t.sent[3][2]["prompt"] == local_ids[:8] + [7]
    made, _ = serving(local, monkeypatch, gen_top={7: 1.0, 8: -1.0})  # gap 2 = the raw gap / 0.5, not normalised
    assert m.connect("http://127.0.0.1:9", local, {}).logprobs_mode == "processed_logits"
    assert made[0][1:3] == (None, 60.0)


def test_connect_refuses_another_tokenizer(local, monkeypatch):
    local_ids = list(local.tokenizer.encode(m.PROBE_TEXT, add_special_tokens=True))
    n = len(local_ids)
    for server_ids, first in [([9] + local_ids, 0), (local_ids[:3] + [1] + local_ids[4:], 3),
                              (local_ids + [5], n)]:
        made, _ = serving(local, monkeypatch, server_ids=server_ids)
        with pytest.raises(EngineError) as err:
            m.connect("http://127.0.0.1:9", local, {})
        assert str(err.value) == (
            f"--engine {URL}: the served model's tokenizer differs from --model tiny's (the probe text is "
            f"{len(server_ids)} tokens there, {n} here; first difference at token {first}: "
            f"{server_ids[first:first + 3]} vs {local_ids[first:first + 3]}); point -m at the served model's folder")
        assert [path for _, path, _ in made[0][3].sent] == ["/v1/models", "/tokenize"]


def test_connect_to_servers_without_a_probe(local, monkeypatch):
    made, _ = serving(local, monkeypatch, owned_by="sglang")
    conn = m.connect("http://127.0.0.1:9", local, {"generate": "sample --engine"})
    assert (conn.logprobs_mode, conn.mode_found_by, conn.tokenizer_checked) == ("processed_logprobs",
                                                                                "adapter default", False)
    assert [path for _, path, _ in made[0][3].sent] == ["/v1/models"]
    made, local_ids = serving(local, monkeypatch, owned_by="llamacpp")
    conn = m.connect("http://127.0.0.1:9", local, {"generate": "sample --engine"})
    assert (conn.logprobs_mode, conn.mode_found_by, conn.tokenizer_checked) == ("raw_logprobs", "adapter default",
                                                                                True)
    assert made[0][3].sent[1] == ("POST", "/tokenize", {"content": m.PROBE_TEXT, "add_special": True})
    made, _ = serving(local, monkeypatch, owned_by="llamacpp")
    with pytest.raises(ConfigError) as err:
        m.connect("http://127.0.0.1:9", local, {"generate": "g", "score": "score --engine"})
    assert str(err.value).startswith("score --engine: needs scoring a given sequence (prompt logprobs), which the "
                                     f"llamacpp server at {URL} cannot give")
    assert [path for _, path, _ in made[0][3].sent] == ["/v1/models"]


def fake_clock(monkeypatch, start: float = 100.0, step: float = 1.0):
    """time.perf_counter as a counter: start, start + step, ... (step 0: a clock that never moves)."""
    import itertools

    ticks = itertools.count()
    monkeypatch.setattr(m.time, "perf_counter", lambda: start + step * next(ticks))


def test_rows_carry_the_engines_defects_and_the_time(local, monkeypatch):
    from decodelab.core.engine.http.transport import loads

    # the generated token 7 listed twice in its step's top logprobs; the scored position 1 listed out of order
    text = json.dumps(completion_answer([7], [-0.5], [{7: -0.5, 3: -1.0}]))
    generation = loads(text.replace('"token_id:7": -0.5,', '"token_id:7": -0.5, "token_id:7": -0.5,'))
    conn = connection(local, {"/v1/completions": lambda body: generation if "logprobs" in body else prompt_answer(
        [None, {7: (-0.6, 1)}])})
    (row,) = list(m.ServedSample(conn, [4], SamplingSettings(max_tokens=1, logprobs=2)))
    assert row.defects == ["step 0: token 7 listed 2 times in top logprobs"]
    as_dict = row.to_dict()
    assert as_dict.pop("tail_mass") == pytest.approx(1 - math.exp(-0.5) - math.exp(-1.0), abs=1e-12)
    assert as_dict == {"index": 0, "position": 1, "token_id": 7, "token": local.token_text(7), "prob": None,
                             "logprob": None, "raw_prob": math.exp(-0.5), "raw_logprob": -0.5, "raw_rank": 1,
                             "alternatives": [{"token_id": 7, "token": local.token_text(7), "prob": None,
                                               "raw_prob": math.exp(-0.5)},
                                              {"token_id": 3, "token": local.token_text(3), "prob": None,
                                               "raw_prob": math.exp(-1.0)}],
                             "values": RAW, "defects": ["step 0: token 7 listed 2 times in top logprobs"]}
    answer = prompt_answer([None, {5: (-1.0, 2), 1: (-2.0, 3), 3: (-0.5, 1)}])  # 1 listed before 3
    fake_clock(monkeypatch, start=10.0, step=2.5)
    run = m.ServedScore(connection(local, {"/v1/completions": answer}), [4, 5], top_n=3)
    (row,) = list(run)
    assert row.defects == ["position 1: top logprobs not sorted (the engine's top-N order is broken)"]
    assert run.seconds == 2.5 and run.summary().tokens_per_s == 0.4 and run.summary().seconds == 2.5


def test_engine_baseline_times_and_partial_cached_counts(local, monkeypatch):
    from decodelab.core.methods.batch.run import Entry

    answers = {(4,): completion_answer([1], [-0.5], [{1: -0.5}], usage={"prompt_tokens_details": {"cached_tokens": 1}}),
               (5,): completion_answer([2, 3], [-0.5, -0.5], [{2: -0.5}, {3: -0.5}])}
    conn = connection(local, {"/v1/completions": lambda body: answers[tuple(body["prompt"])],
                              "/metrics": "vllm:prefix_cache_hits_total 0\n"})
    settings = SampleSettings(temperature=0.0, max_new_tokens=2)
    entries = [Entry("a", "x", settings), Entry("b", "y", settings)]
    # the clock: 100 when sent, 101 and 102 around each of the two requests, 105 when the last is in
    fake_clock(monkeypatch, start=100.0, step=1.0)
    base = m.engine_baseline(conn, entries, [[4], [5]], [])
    assert base.seconds == 5.0 and base.tokens_per_s == 3 / 5.0
    assert [r["seconds"] for r in base.requests] == [1.0, 1.0] and [r["cached_tokens"] for r in base.requests] == [1,
                                                                                                                   None]
    assert "cached_tokens" not in base.details  # one request did not say: no total
    fake_clock(monkeypatch, step=0.0)  # a clock that never moves: no rate rather than a division by zero
    base = m.engine_baseline(conn, entries, [[4], [5]], [])
    assert (base.seconds, base.tokens_per_s) == (0.0, None)


class WithBos:
    """The tiny tokenizer as one that starts an encoding with a BOS (id 1) when asked for special tokens."""

    def __init__(self, inner):
        self.inner = inner

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + list(self.inner.encode(text, add_special_tokens=False))


def test_special_tokens_where_each_side_wants_them(local, monkeypatch):
    from dataclasses import replace

    bos = replace(local, tokenizer=WithBos(local.tokenizer))
    # texts in the request (here --allow) are encoded without special tokens: "the" is [1057], never [1, 1057]
    request, _ = m.request_of(bos, SampleSettings(allow=("the",)), 2)
    assert request.allowed_token_ids == (1057,)
    # the tokenizer check compares both sides with special tokens, and the probe starts with the server's BOS
    made, bos_ids = serving(bos, monkeypatch)
    assert bos_ids[0] == 1 and m.connect(URL, bos, {}).tokenizer_checked
    sent = made[0][3].sent
    assert sent[1][2]["add_special_tokens"] is True and sent[2][2]["prompt"] == bos_ids[:8]


def test_a_clock_that_never_moves_gives_no_rate(local, monkeypatch):
    fake_clock(monkeypatch, step=0.0)
    run = m.ServedScore(connection(local, {"/v1/completions": prompt_answer([None, {5: (-1.0, 1)}])}), [4, 5], 1)
    list(run)
    assert run.seconds == 0.0 and math.isnan(run.summary().tokens_per_s)
    run = m.ServedSample(connection(local, sample_answers()), [4, 5], SamplingSettings(max_tokens=2, logprobs=2))
    list(run)
    assert run.summary().seconds == 0.0 and math.isnan(run.summary().tokens_per_s)
