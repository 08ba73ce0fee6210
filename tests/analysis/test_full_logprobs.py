"""check-logprobs --full: the engine's distribution against the local one on a fake vLLM serving the same model
(agreement), the same model with its numbers shifted (drift caught), a perturbed model (KL and flips); the TV
bounds by hand; the reasoning-split and speculative-decoding defects."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from decodelab.core.analysis import full_logprobs as fl
from decodelab.core.analysis.check_logprobs import Ids, parse_answer
from decodelab.core.engine.models import load_model
from decodelab.core.methods.served import connect

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", device="cpu", dtype="float32")


@pytest.fixture
def serve(tiny):
    from fake_server import SamplingServer

    started = []

    def start(lm=None, **kw):
        server = SamplingServer(lm or tiny, **kw).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def test_tv_bounds_by_hand():
    local = torch.log(torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64))
    exact = fl.tv_bounds([(0, math.log(0.4)), (1, math.log(0.4)), (2, math.log(0.2))], local)
    assert exact == pytest.approx((0.1, 0.1))  # nothing unlisted: exact
    lo, hi = fl.tv_bounds([(0, math.log(0.4)), (1, math.log(0.4))], local)  # tail P 0.2, tail Q 0.2
    assert lo == pytest.approx(0.5 * (0.1 + 0.1 + 0.0)) and hi == pytest.approx(0.5 * (0.2 + 0.4))
    assert lo <= 0.1 <= hi  # the true TV (P's tail all on token 2) lies between


def test_the_same_model_served_agrees(tiny, serve):
    conn = connect(serve().url, tiny, {"score": "check-logprobs --full"})
    report = fl.full_check(conn.engine, tiny, tiny.encode(PROMPT), 6, 8)
    s = report.summary
    assert s["positions"] == len(tiny.encode(PROMPT)) + 6 - 1 and s["truncated"] is True
    # the lower bounds vanish; the upper ones stay loose with most of the mass unlisted (top 8 of 4096)
    assert abs(s["kl_lower_mean"]) < 1e-5 and s["max_abs_delta_logprob"] < 1e-4 and s["tv_lower_mean"] < 1e-5
    assert s["topk_overlap_mean"] == 1.0 and abs(s["lse_drift_max"]) < 1e-5 and s["argmax_flips"] == []
    assert all(r.tv_lower <= 1e-5 for r in report.positions)


def test_an_unnormalised_engine_drifts(tiny, serve):
    conn = connect(serve(logprob_shift=0.05).url, tiny, {"score": "check-logprobs --full"})
    s = fl.full_check(conn.engine, tiny, tiny.encode(PROMPT), 4, 8).summary
    assert s["lse_drift_min"] == pytest.approx(0.05, abs=1e-4) and s["lse_drift_max"] == pytest.approx(0.05, abs=1e-4)
    assert s["max_abs_delta_logprob"] == pytest.approx(0.05, abs=1e-4)


def test_another_model_shows_kl_and_flips(tiny, serve):
    other = copy.copy(tiny)
    other.model = copy.deepcopy(tiny.model)
    with torch.no_grad():
        for p in other.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    conn = connect(serve(other).url, tiny, {"score": "check-logprobs --full"})
    s = fl.full_check(conn.engine, tiny, tiny.encode(PROMPT), 8, 8).summary
    assert s["kl_lower_mean"] > 1e-3 and s["topk_overlap_mean"] < 1.0 and s["argmax_flips"]
    flip = s["argmax_flips"][0]
    assert flip["engine"] != flip["local"] and flip["local_margin"] > 0


def test_speculative_decoding_that_changes_logprobs_is_a_defect(tiny, serve):
    base = connect(serve().url, tiny, {"generate": "x"}).engine
    same = connect(serve().url, tiny, {"generate": "x"}).engine
    moved = connect(serve(logprob_shift=0.01).url, tiny, {"generate": "x"}).engine
    ok = fl.speculative_drift(base, same, tiny.encode(PROMPT), 6, 5, 1e-4)
    assert ok["same_tokens"] and ok["defect"] is None and ok["max_abs_delta_logprob"] == 0
    bad = fl.speculative_drift(base, moved, tiny.encode(PROMPT), 6, 5, 1e-4)
    assert bad["same_tokens"] and bad["max_abs_delta_logprob"] == pytest.approx(0.01, abs=1e-5)
    assert "logprobs change with speculative decoding on" in bad["defect"]


def _chat(content_tokens: list[str], answer: str, reasoning: str | None) -> dict:
    message = {"role": "assistant", "content": answer, **({"reasoning_content": reasoning} if reasoning else {})}
    return {"choices": [{"message": message, "logprobs": {"content": [
        {"token": t, "logprob": -1.0, "top_logprobs": []} for t in content_tokens]}}]}


def test_logprobs_that_cover_the_reasoning_are_a_defect(tiny):
    ids = Ids(tiny)

    def encode(text, special):
        return list(tiny.tokenizer.encode(text, add_special_tokens=special))

    split = _chat(["Yes", "."], "Yes.", "Let me think about it first")
    assert parse_answer(split, None, ids, "ok", encode, {})[0].defects == []
    spanning = _chat(["Let", " me", " think", " about", " it", " first", "Yes", "."], "Yes.",
                     "Let me think about it first")
    [answer] = parse_answer(spanning, None, ids, "bad", encode, {})
    assert any("covers the reasoning" in d for d in answer.defects)


def test_cli_check_logprobs_full(cli, tiny, serve):
    server = serve()
    code, out, err = cli("check-logprobs", "--full", "--engine", server.url, "--prompt", PROMPT, "-n", "4",
                         "--full-top", "6", "-f", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["full"] is True and doc["summary"]["truncated"] is True and len(doc["positions"]) > 4
    assert doc["summary"]["argmax_flips"] == [] and doc["summary"]["defects"] == []
    code, out, err = cli("check-logprobs", "--full", "--prompt", PROMPT)
    assert code == 2 and "--engine" in err and "Traceback" not in err


def test_cli_check_logprobs_full_prints_the_document_built_in_core(cli, tiny, serve):
    """--full (and --spec-engine): the JSON is core's FullReport.document, the drift and its defect included."""
    from decodelab.cli.view.render import clean

    server, other = serve(), serve(logprob_shift=0.05)
    code, out, err = cli("check-logprobs", "--full", "--engine", server.url, "--prompt", PROMPT, "-n", "4",
                         "--full-top", "6", "--spec-engine", other.url, "-f", "json", "--threads", "1")
    assert code == 0, err
    printed = json.loads(out)
    conn = connect(server.url, tiny, {"score": "check-logprobs --full"})
    ids = tiny.encode(PROMPT)
    report = fl.full_check(conn.engine, tiny, ids, 4, 6)
    report.speculative = fl.speculative_drift(conn.engine, connect(other.url, tiny, {}).engine, ids, 4, 6, 1e-3)
    made = clean(report.document(tiny, {"engine": conn.describe()}, PROMPT, ids))
    for document in (printed, made):
        for key in ("format_version", "versions", "machine"):
            document.pop(key, None)
    assert made["summary"]["defects"] == [made["speculative"]["defect"]] and made["summary"]["defects"][0]
    assert list(printed) == list(made) and printed == made


def test_the_whole_vocabulary_gives_exact_figures(tiny, serve):
    """With every token listed (a vLLM run with --max-logprobs -1), nothing is truncated: the KL bounds meet."""
    from decodelab.core.engine.http.client import ServedEngine

    engine = ServedEngine(serve().url, max_top_n=tiny.vocab_size)
    report = fl.full_check(engine, tiny, tiny.encode(PROMPT), 2, tiny.vocab_size)
    assert report.summary["truncated"] is False
    for r in report.positions:
        assert not r.truncated and r.kl_lower == pytest.approx(r.kl_upper, abs=1e-12) and abs(r.kl_upper) < 1e-6
        assert r.tv_lower == pytest.approx(r.tv_upper, abs=1e-9) and r.topk_overlap == 1.0
