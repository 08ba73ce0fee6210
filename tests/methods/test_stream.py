"""`stream` core: scoring a long text under a policy, the attention-sink profile, the per-step cache state."""

from __future__ import annotations

import json
import math

import pytest
import torch

from decodelab.core.kv import parse_cache_spec
from decodelab.core.engine.forward import attention_weights, forward, model_info
from decodelab.core.engine.runtime import Runtime
from decodelab.core.sampling.chain import build_chain
from decodelab.core.methods.stream import StreamScore, StreamSettings, cache_state, compare_policies
from decodelab.core.analysis.attention import sink_profile

from conftest import random_model


def scored(model, ids, cache: str, chunk: int, feed: int):
    settings = StreamSettings(cache=cache, chunk=chunk, feed=feed)
    run = StreamScore(model, ids, build_chain({}), str, settings)
    return list(run), run


def test_stream_score_full_equals_one_forward_and_spans_add_up():
    model = random_model("llama", seed=7)
    ids = torch.randint(0, 256, (1, 50), generator=torch.Generator().manual_seed(7))
    logits = forward(model, ids, None, torch.arange(50).unsqueeze(0), logits_to_keep=0)[0]
    nll = float(-torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:].view(-1, 1)).sum())
    chunks, run = scored(model, ids[0].tolist(), "full", chunk=10, feed=3)
    assert [c.tokens for c in chunks] == [10, 10, 10, 10, 9] and chunks[0].start == 1 and chunks[-1].end == 50
    assert [c.start for c in chunks[1:]] == [c.end for c in chunks[:-1]]
    summary = run.summary()
    assert math.isclose(summary.perplexity, math.exp(nll / 49), rel_tol=1e-5)
    assert summary.tokens == 49 and summary.policy == "full" and summary.max_cache_tokens == 49


def test_stream_score_bounded_memory_is_flat_and_matches_the_runtime():
    model = random_model("llama", seed=7)
    ids = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(8)).tolist()
    chunks, run = scored(model, ids, "sinks:sinks=2,recent=8", chunk=10, feed=1)
    assert {c.cache_tokens for c in chunks[1:]} == {10}
    assert len({c.kv_bytes for c in chunks[1:]}) == 1 and run.summary().kv_bytes_peak == chunks[-1].kv_bytes
    # the same numbers as feeding the runtime by hand, one token per forward
    rt = Runtime.create(model, parse_cache_spec("sinks:sinks=2,recent=8"))
    logp = torch.cat([torch.log_softmax(rt.feed(torch.tensor([[t]])), -1) for t in ids[:-1]])
    nll = float(-logp.gather(1, torch.tensor(ids[1:]).view(-1, 1)).sum())
    assert math.isclose(run.summary().perplexity, math.exp(nll / 59), rel_tol=1e-5)


def test_compare_policies_names_each_policy_and_skips_what_gpt2_cannot():
    settings = StreamSettings(window=8, sinks=2, chunk=16, feed=1)
    ids = list(range(1, 30))
    llama = dict(compare_policies(random_model("llama"), ids, build_chain({}), str, settings))
    assert list(llama) == ["full", "window keep", "window rerotate", "sinks keep", "sinks rerotate", "recompute"]
    assert str(llama["sinks rerotate"].spec) == "sinks:positions=rerotate,recent=6,sinks=2"
    gpt2 = random_model("gpt2")
    out = dict(compare_policies(gpt2, ids, build_chain({}), str, settings, model_info(gpt2)))
    assert isinstance(out["window rerotate"], str) and "absolute positions" in out["window rerotate"]
    assert not isinstance(out["window keep"], str)


def test_sink_profile_on_hand_weights():
    """Causal uniform attention gives ratio 1 everywhere; all weight on key 0 gives sink mass 1."""
    T = 8
    uniform = torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1).view(-1, 1)
    sink = torch.zeros(T, T)
    sink[:, 0] = 1.0
    weights = [torch.stack([uniform, sink]).unsqueeze(0)]  # one layer, two heads
    rows = sink_profile(weights, sinks=1, late_from=4)
    assert math.isclose(rows[0].ratio, 1.0, rel_tol=1e-6)
    # query q sees q + 1 keys, so key 0 gets 1 / (q + 1), averaged over q = 4..7
    assert math.isclose(rows[0].sink_mass, sum(1 / (q + 1) for q in range(4, 8)) / 4, rel_tol=1e-6)
    assert rows[1].sink_mass == 1.0 and rows[1].average_mass == 0.0 and rows[1].ratio == float("inf")


def test_attention_weights_restore_the_implementation():
    model = random_model("llama", seed=1)
    model.set_attn_implementation("sdpa")
    weights = attention_weights(model, torch.arange(12).view(1, -1))
    assert len(weights) == 2 and weights[0].shape == (1, 4, 12, 12)
    torch.testing.assert_close(weights[0].sum(-1), torch.ones(1, 4, 12))
    assert model.config._attn_implementation == "sdpa"


def test_cache_state_names_what_the_next_forward_sees():
    model = random_model("llama", seed=1)
    rt = Runtime.create(model, parse_cache_spec("sinks:sinks=2,recent=5"))
    rt.feed(torch.arange(9).view(1, -1))
    state = cache_state(rt.policy)
    assert state["cache_tokens"] == 7 and state["evicted"] == [2, 4]
    assert state["slots"] == [[0, 2, 0], [4, 9, 2]] and state["kv_bytes"] == rt.policy.nbytes()
    rec = Runtime.create(model, parse_cache_spec("recompute:size=4"))
    rec.feed(torch.arange(9).view(1, -1))
    assert cache_state(rec.policy) == {"cache_tokens": 0, "kv_bytes": 0, "evicted": [], "slots": [[6, 9, 0]]}


# --- the command ---------------------------------------------------------------------------------------------------

TEXT = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; and "
        "darkness was upon the face of the deep. ") * 6


def test_cli_generates_past_the_context_with_a_bounded_cache(cli, toy_model_dir):
    code, out, err = cli("stream", "In the beginning", "-m", toy_model_dir, "-n", "80", "--ignore-eos",
                         "--cache", "sinks:sinks=2,recent=10", "-f", "json")
    assert code == 0, err
    doc = json.loads(out)
    steps, summary = doc["steps"], doc["summary"]
    assert len(steps) == 80 and steps[-1]["position"] > 64  # the toy model's context is 64 positions
    assert max(s["cache_tokens"] for s in steps) == 12 == summary["max_cache_tokens"]
    last = steps[-1]
    assert last["slots"] == [[0, 2, 0], [last["position"] - 10, last["position"], 2]]
    assert last["evicted"] == [last["position"] - 11, last["position"] - 10]
    assert summary["policy"] == "sinks:positions=rerotate,recent=10,sinks=2" and summary["stop_reason"] == "length"
    assert {"raw_prob", "alternatives", "kv_bytes"} <= set(last)


def test_a_stream_written_as_it_comes_keeps_no_step(cli, toy_model_dir, monkeypatch):
    """-f jsonl under a bounded cache: no step is kept by the run or its sampler (the kept steps were what grew by
    1.7-2.6 KB a token), and the summary, built as the steps came, is the one the kept steps give."""
    import gc

    import decodelab.core.methods.stream as stream
    from decodelab.core.trace.records import Step

    def steps_alive() -> int:
        gc.collect()
        return sum(issubclass(type(o), Step) for o in gc.get_objects())

    alive = {}
    real = stream.StreamGenerate.summary
    before = steps_alive()  # what earlier tests left

    def summary(self):
        alive["steps"] = steps_alive() - before
        alive["kept"] = len(self.steps) + len(self.sampler.steps)
        return real(self)

    monkeypatch.setattr(stream.StreamGenerate, "summary", summary)
    args = ["stream", "In the beginning", "-m", toy_model_dir, "-n", "90", "--ignore-eos", "--cache",
            "window:size=16", "--chunk", "20", "-t", "0.8", "--seed", "3"]
    code, out, err = cli(*args, "-f", "jsonl")
    assert code == 0, err
    assert alive == {"steps": 1, "kept": 0}  # the newest step alone (the span being summed ends with it)
    lines = [json.loads(x) for x in out.splitlines()]
    streamed = lines[-1]
    code, out, err = cli(*args, "-f", "json")
    assert code == 0, err
    kept = json.loads(out)
    assert alive["kept"] == 90  # -f json keeps them: it prints them
    assert [x["token_id"] for x in lines[:-1]] == kept["token_ids"] == streamed["token_ids"]
    for key in ("tokens", "perplexity", "max_cache_tokens", "kv_bytes_peak", "mean_logprob", "chunks"):
        assert streamed[key] == kept["summary"][key], key
    assert [c["tokens"] for c in streamed["chunks"]] == [20, 20, 20, 20, 10]


def test_cli_scores_through_score_and_reports_spans(cli, toy_model_dir, tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    code, out, err = cli("stream", "--text-file", path, "-m", toy_model_dir, "--limit", "100", "--chunk", "20",
                         "--cache", "window:size=16", "-f", "json")
    assert code == 0, err
    doc = json.loads(out)
    chunks = doc["steps"]
    assert [c["tokens"] for c in chunks] == [20] * 4 + [19] and {c["cache_tokens"] for c in chunks} == {16}
    code, out, _ = cli("score", "--text-file", path, "-m", toy_model_dir, "--limit", "100", "--feed", "1",
                       "--cache", "window:size=16", "-f", "json")
    assert abs(json.loads(out)["summary"]["perplexity"] - doc["summary"]["perplexity"]) < 1e-6 * doc["summary"][
        "perplexity"]


def test_cli_compare_policies_and_plot(cli, toy_model_dir, tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    args = ["stream", "--text-file", path, "-m", toy_model_dir, "--limit", "90", "--compare-policies",
            "--window", "12", "--sinks", "2", "--chunk", "30"]
    code, out, err = cli(*args, "-f", "json")
    assert code == 0, err
    rows = {p["label"]: p for p in json.loads(out)["policies"]}
    assert list(rows) == ["full", "window keep", "window rerotate", "sinks keep", "sinks rerotate", "recompute"]
    assert rows["full"]["summary"]["max_cache_tokens"] == 89
    assert rows["sinks rerotate"]["summary"]["max_cache_tokens"] == 12
    assert rows["recompute"]["summary"]["kv_bytes_peak"] == 0
    # no sinks in a window: moving every key by the same shift changes no distance (exact up to float error)
    keep, moved = rows["window keep"]["summary"]["perplexity"], rows["window rerotate"]["summary"]["perplexity"]
    assert abs(keep - moved) < 1e-4 * keep
    code, out, err = cli(*args)
    assert code == 0, err
    assert "perplexity per span over position" in out and "R recompute" in out


def test_cli_attention_table_per_layer_and_head(cli, toy_model_dir):
    code, out, err = cli("stream", TEXT, "-m", toy_model_dir, "--attention", "--sinks", "1", "-f", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert len(doc["attention"]) == 2 * 4  # the toy Llama: 2 layers x 4 heads
    assert doc["summary"]["tokens"] == 64 and doc["summary"]["late_from"] == 32
    assert all(r["ratio"] > 0 for r in doc["attention"])


@pytest.mark.parametrize("args,needle", [
    (["--compare-policies"], "--compare-policies: needs --text-file"),
    (["--window", "4", "--sinks", "4"], "--sinks"),
    (["--cache", "sinks:recent=0"], "recent must be an integer >= 1"),
    (["--feed", "0"], "--feed"),
])
def test_cli_bad_input_is_one_line(cli, toy_model_dir, args, needle):
    code, out, err = cli("stream", "hello", "-m", toy_model_dir, *args)
    assert code == 2 and needle in err and err.count("\n") == 1
