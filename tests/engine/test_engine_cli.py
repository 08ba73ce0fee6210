"""`--engine URL` on sample, score, compare, batch and check-logprobs, through the real entry point, against the fake
server replaying what a real vLLM 0.32 answered these very commands (tests/engine/engine_cases.py, recorded by
record_vllm.py). The oracle is the bundled model run here: the engine's numbers must be the local model's."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_cases import PROMPT, TEXT, args_for  # noqa: E402
from fake_server import RECORDING, fake_vllm, load_recording  # noqa: E402,F401

pytestmark = pytest.mark.skipif(not RECORDING.exists() or "cli" not in load_recording(),
                                reason="no recording of the decodelab commands (run tests/engine/record_vllm.py)")
MODES = ("raw_logprobs", "processed_logprobs")
TOL = 1e-4


def run(cli, server, name: str, tmp_path: Path, *extra: str):
    code, out, err = cli(*args_for(name, server.url, tmp_path), *extra)
    return code, out, err


def run_json(cli, server, name: str, tmp_path: Path) -> dict:
    code, out, err = run(cli, server, name, tmp_path)
    assert code == 0, err
    return json.loads(out)


def one_line_error(code: int, err: str) -> str:
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def tiny():
    from decodelab.core.engine.models import load_model

    return load_model("tiny", device="cpu", dtype="float32")


def local_raw(tiny, prompt_ids: list[int], out_ids: list[int]):
    import torch

    from decodelab.core.sampling.replay import forced_logits

    return torch.log_softmax(forced_logits(tiny.model, prompt_ids, out_ids).double(), dim=-1)


def local_processed(tiny, settings, prompt_ids: list[int], out_ids: list[int]):
    """decodelab's own chain read as vLLM reads it (--semantics vllm), teacher-forced on the engine's tokens."""
    import torch

    from decodelab.core.sampling.replay import along as chain_along, forced_logits
    from decodelab.core.sampling.chain import make_chain

    logits = forced_logits(tiny.model, prompt_ids, out_ids)
    greedy = settings.temperature == 0
    rows = chain_along(make_chain(tiny, settings), prompt_ids, out_ids, logits, record=True)
    return [torch.log_softmax([z for name, z in stages if not (greedy and name == "temperature")][-1].double(), -1)
            for stages in rows]


# --------------------------------------------------------------------------------------------------------------
# the numbers are the model's


@pytest.mark.parametrize("mode", MODES)
def test_the_probe_finds_the_servers_logprobs_mode(cli, fake_vllm, tmp_path, mode):
    doc = run_json(cli, fake_vllm(mode), "sample_greedy", tmp_path)
    engine = doc["engine"]
    assert engine["logprobs_mode"] == mode and engine["mode_found_by"] == "probe"
    assert engine["tokenizer_checked"] and engine["kind"] == "vllm" and doc["device"] is None


@pytest.mark.parametrize("mode", MODES)
def test_score_through_the_engine_equals_local_score(cli, fake_vllm, tmp_path, mode):
    doc = run_json(cli, fake_vllm(mode), "score", tmp_path)
    code, out, err = cli("score", TEXT, "-f", "json")
    local = json.loads(out)
    assert [s["token_id"] for s in doc["steps"]] == [s["token_id"] for s in local["steps"]]
    for a, b in zip(doc["steps"], local["steps"]):
        assert a["raw_logprob"] == pytest.approx(b["raw_logprob"], abs=TOL)
        assert a["raw_rank"] == b["raw_rank"]
        assert len(a["alternatives"]) == 10 and 0.0 <= a["tail_mass"] <= 1.0
    assert doc["summary"]["perplexity"] == pytest.approx(local["summary"]["perplexity"], rel=1e-4)
    assert doc["summary"]["values"] == "raw" and doc["summary"]["truncated"] is True


def test_score_top_n_limit_and_chunks(cli, fake_vllm, tmp_path):
    doc = run_json(cli, fake_vllm(), "score_top3_limit", tmp_path)
    assert len(doc["steps"]) == 11 and all(len(s["alternatives"]) == 3 for s in doc["steps"])
    assert [(c["start"], c["end"]) for c in doc["summary"]["chunks"]] == [(1, 5), (5, 9), (9, 12)]
    for s in doc["steps"]:
        listed = [a["raw_logprob"] for a in s["alternatives"]]
        assert listed == sorted(listed, reverse=True)
        assert s["tail_mass"] == pytest.approx(1 - sum(math.exp(v) for v in listed), abs=1e-9)


@pytest.mark.parametrize("mode", MODES)
def test_greedy_sample_equals_local_token_for_token(cli, fake_vllm, tmp_path, mode):
    doc = run_json(cli, fake_vllm(mode), "sample_greedy", tmp_path)
    code, out, err = cli("sample", PROMPT, "-n", "8", "-t", "0", "--ignore-eos", "-f", "json")
    assert doc["token_ids"] == json.loads(out)["token_ids"] and len(doc["token_ids"]) == 8
    for s in doc["steps"]:
        assert s["raw_rank"] == 1
        assert (s["logprob"] is None) == (mode == "raw_logprobs")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["sample_t07_k5", "sample_p09_rep"])
def test_sampled_logprobs_equal_semantics_vllm_locally(cli, fake_vllm, tmp_path, tiny, mode, case):
    """raw values (the generation's in raw mode, the replay's in processed mode) equal the local log softmax;
    processed ones equal decodelab's chain under --semantics vllm on the same tokens."""
    from decodelab.core.methods.sample import SampleSettings

    doc = run_json(cli, fake_vllm(mode), case, tmp_path)
    prompt, out = doc["prompt"]["token_ids"], doc["token_ids"]
    config = {k: v for k, v in doc["config"].items() if k in ("temperature", "top_k", "top_p", "repetition_penalty")}
    settings = SampleSettings(**config, semantics="vllm")
    raw = local_raw(tiny, prompt, out)
    processed = local_processed(tiny, settings, prompt, out)
    assert doc["summary"]["raw_from"] == ("generation" if mode == "raw_logprobs" else "replay")
    for i, s in enumerate(doc["steps"]):
        assert s["raw_logprob"] == pytest.approx(float(raw[i, s["token_id"]]), abs=TOL)
        if mode == "processed_logprobs":
            assert s["logprob"] == pytest.approx(float(processed[i][s["token_id"]]), abs=TOL)
            for a in s["alternatives"]:
                expected = math.exp(float(processed[i][a["token_id"]]))
                assert a["prob"] == pytest.approx(expected, abs=TOL)
        else:
            assert s["logprob"] is None and s["prob"] is None
            for a in s["alternatives"]:
                assert a["raw_prob"] == pytest.approx(math.exp(float(raw[i, a["token_id"]])), abs=TOL)


def test_sample_request_writes_every_sampling_field(cli, fake_vllm, tmp_path):
    doc = run_json(cli, fake_vllm(), "sample_p09_rep", tmp_path)
    request = doc["request"]
    for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty", "seed", "max_tokens", "min_tokens", "ignore_eos", "logprobs", "logit_bias",
                "stop_token_ids", "stop", "allowed_token_ids", "bad_words"):
        assert key in request, key
    assert (request["temperature"], request["top_p"], request["repetition_penalty"]) == (1.0, 0.9, 1.2)
    assert request["top_k"] == 0 and request["seed"] == 4 and request["return_tokens_as_token_ids"] is True


@pytest.mark.parametrize("mode", MODES)
def test_compare_engine_against_local(cli, fake_vllm, tmp_path, mode):
    doc = run_json(cli, fake_vllm(mode), "compare", tmp_path)
    pairs = {p["variant"]: p for p in doc["engine_pairs"]}
    assert pairs["g"]["greedy"] and pairs["g"]["same_tokens"] and pairs["g"]["first_divergence"] is None
    for p in pairs.values():
        assert p["positions"] == 6 and p["top_n"] == 20
        assert abs(p["kl_lower_mean"]) < 1e-6 and p["kl_lower_mean"] <= p["kl_upper_mean"]
        assert p["top1_agreement"] == 1.0 and p["max_abs_delta_raw_logprob"] < TOL
        assert (p["max_abs_delta_logprob"] is None) == (mode == "raw_logprobs")
    assert {r["variant"] for r in doc["rows"]} == {"g@local", "g@engine", "t@local", "t@engine"}


@pytest.mark.parametrize("mode", MODES)
def test_batch_against_the_engines_batching(cli, fake_vllm, tmp_path, mode):
    doc = run_json(cli, fake_vllm(mode), "batch", tmp_path)
    summary = doc["summary"]
    assert summary["engine_same_tokens"] == 4 and summary["engine_requests_done"] == 4
    assert summary["engine_tokens"] == summary["tokens"] == 24 and summary["engine_tokens_per_s"] > 0
    assert summary["engine_prefix_query_tokens"] == summary["engine_prompt_tokens"] == summary["prompt_tokens"]
    assert 0 <= summary["engine_prefix_hit_tokens"] <= summary["engine_prefix_query_tokens"]
    local = {r["id"]: r["token_ids"] for r in doc["requests"]}
    assert {r["id"]: r["token_ids"] for r in doc["engine_requests"]} == local


@pytest.mark.parametrize("mode", MODES)
def test_check_logprobs_live_labels_the_servers_numbers(cli, fake_vllm, tmp_path, mode):
    doc = run_json(cli, fake_vllm(mode), "check_live", tmp_path)
    summary = doc["summary"]
    assert summary["tokens"] == 6 and summary["vs_label"]["max_abs_delta"] < TOL
    if mode == "raw_logprobs":
        assert summary["labels"]["raw"] == 6 and summary["verdict"].startswith("raw")
    else:  # temperature 0.7 and top-k 5: renormalized over the five kept tokens
        assert summary["labels"]["renormalized"] == 6 and summary["verdict"].startswith("processed")
        assert all(0 < t["kept_mass"] <= 1 for t in doc["tokens"])
        assert summary["vs_raw"]["outside_band"] > 0


# --------------------------------------------------------------------------------------------------------------
# every failure: one line, exit 2; what came back is kept


def test_unreachable_server(cli, fake_vllm, tmp_path):
    code, out, err = run(cli, fake_vllm(fault="refused"), "sample_greedy", tmp_path)
    assert "connection refused (is the server running?)" in one_line_error(code, err)


def test_timeout(cli, fake_vllm, tmp_path):
    code, out, err = run(cli, fake_vllm(fault="timeout"), "score", tmp_path, "--engine-timeout", "0.3")
    assert "no answer within 0.3 s (timeout)" in one_line_error(code, err)


def test_a_response_missing_logprobs(cli, fake_vllm, tmp_path):
    code, out, err = run(cli, fake_vllm(fault="no_logprobs"), "sample_greedy", tmp_path)
    assert "the answer has no logprobs" in one_line_error(code, err)


def test_a_different_tokenizer(cli, fake_vllm, tmp_path):
    code, out, err = run(cli, fake_vllm(fault="tokenizer"), "score", tmp_path)
    line = one_line_error(code, err)
    assert "the served model's tokenizer differs from --model tiny's" in line and "first difference at token 0" in line


def test_a_different_vocabulary(cli, fake_vllm, tmp_path):
    code, out, err = run(cli, fake_vllm(fault="vocabulary"), "sample_greedy", tmp_path)
    assert "token id 5000, outside --model tiny's vocabulary of 4096" in one_line_error(code, err)


def test_a_failed_replay_keeps_the_generated_tokens(cli, fake_vllm, tmp_path):
    code, out, err = run(cli, fake_vllm("processed_logprobs", fault="replay_error"), "sample_greedy", tmp_path)
    assert "HTTP 500: fake server: injected failure" in one_line_error(code, err)
    doc = json.loads(out)  # printed before the error: the generation's tokens and processed values
    assert len(doc["token_ids"]) == 8 and all(s["logprob"] is not None and s["raw_logprob"] is None
                                              for s in doc["steps"])
    assert doc["summary"]["raw_from"] is None


@pytest.mark.parametrize("extra, message", [
    (["--cache", "window:size=8"], "--cache window:size=8: needs a KV-cache policy"),
    (["--kept-ids"], "--kept-ids: needs the full next-token distribution"),
    (["--dry-multiplier", "0.8"], "--dry-multiplier: vLLM has no such stage (a served engine has no equivalent)"),
    (["--penalty-last-n", "8", "--repetition-penalty", "1.2"], "--penalty-last-n: vLLM's penalties count"),
])
def test_what_the_engine_cannot_do_is_refused_before_anything_runs(cli, fake_vllm, tmp_path, extra, message):
    server = fake_vllm()
    code, out, err = run(cli, server, "sample_greedy", tmp_path, *extra)
    assert message in one_line_error(code, err) and out == ""
    assert all(path != "/v1/completions" for _, path, _ in server.seen), "refused before any generation"


@pytest.mark.parametrize("extra, message", [
    (["-N", "2"], "--num-samples: not on a served engine"),
    (["--force", "1=5"], "--force: not on a served engine"),
    (["--engine-model", "llama-70b"], "serves 'tiny', not 'llama-70b' (model name mismatch)"),
])
def test_sample_options_without_an_engine_equivalent(cli, fake_vllm, tmp_path, extra, message):
    code, out, err = run(cli, fake_vllm(), "sample_greedy", tmp_path, *extra)
    assert message in one_line_error(code, err)


def test_score_refuses_what_needs_the_full_distribution(cli, fake_vllm, tmp_path):
    for extra, message in ((["--top-p", "0.9"], "the chain (top-p: its processed log-probability)"),
                           (["--against-cache", "full"], "--against/--against-cache (KL against a reference)"),
                           (["--renormalize"], "--kept-ids/--renormalize")):
        server = fake_vllm()
        code, out, err = run(cli, server, "score", tmp_path, *extra)
        assert message in one_line_error(code, err)
        assert [path for _, path, _ in server.seen] == ["/v1/models"]


def test_an_engine_url_is_checked_before_anything(cli):
    code, out, err = cli("score", TEXT, "--engine", "127.0.0.1:8000")
    assert "not an http(s) URL" in one_line_error(code, err)
    code, out, err = cli("score", TEXT, "--engine-model", "tiny")
    assert "--engine-model: only with --engine URL" in one_line_error(code, err)


def test_compare_refuses_a_method_the_engine_runs_its_own_way(cli, fake_vllm, tmp_path):
    server = fake_vllm()
    code, out, err = cli("compare", PROMPT, "-V", "b: method=beam,beams=2", "-n", "4", "--engine", server.url)
    assert "method=beam: compare --engine runs sample variants only" in one_line_error(code, err)


# --------------------------------------------------------------------------------------------------------------
# every field printed is documented


@pytest.mark.parametrize("command, name", [("sample", "sample_t07_k5"), ("score", "score"), ("compare", "compare"),
                                           ("batch", "batch"), ("check-logprobs", "check_live")])
def test_engine_json_fields_are_documented(cli, fake_vllm, tmp_path, command, name):
    from test_json_docs import documented, fields

    table = documented()[command]
    wild = frozenset(p for p, f in table if f == "*")
    doc = run_json(cli, fake_vllm("processed_logprobs"), name, tmp_path)
    printed = fields(doc, wild=wild)
    missing = sorted(f"{p}.{f}" for p, f in printed if (p, f) not in table)
    assert not missing, f"printed but not in docs/json.md ({command}): {missing}"
