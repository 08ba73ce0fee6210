"""`stream` core: scoring a long text under a policy, the attention-sink profile, the per-step cache state."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from decodelab.core.kv import KVPolicy, parse_cache_spec
from decodelab.core.kv.recompute import RecomputePolicy
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


# mutation run of core/methods/stream.py (2026-12-02): what only the CLI tests reached, and the numbers by hand

from decodelab.core.engine.models import LoadedModel  # noqa: E402
from decodelab.core.errors import ConfigError  # noqa: E402
from decodelab.core.methods import stream as stream_core  # noqa: E402


class IdText:
    """A tokenizer for a model without one: token i reads '<i>'."""

    def decode(self, ids, **kwargs) -> str:
        return "".join(f"<{i}>" for i in ids)


def hand_lm(arch: str = "llama", eos: int = 255, **overrides) -> LoadedModel:
    model = random_model(arch, seed=3, scale=4.0, **overrides)
    return LoadedModel("hand", model, IdText(), torch.device("cpu"), torch.float32, [eos])


def refused(settings: StreamSettings) -> str:
    with pytest.raises(ConfigError) as info:
        stream_core.validate_stream(settings)
    return str(info.value)


def test_stream_defaults_are_the_documented_ones():
    """docs/commands.md's stream table."""
    s = StreamSettings()
    assert (s.cache, s.max_new_tokens, s.limit, s.chunk, s.feed, s.window, s.sinks) == (
        "sinks:sinks=4,recent=252", 600, None, 256, 1, 256, 4)
    assert (s.compare_policies, s.attention, s.policies, s.prefill, s.probe, s.probe_keys, s.probe_depths) == (
        False, False, None, None, False, (), "0.1,0.5,0.9")
    stream_core.validate_stream(s)


def test_validate_stream_names_each_option_at_its_edge():
    ok = [dict(chunk=1, feed=1, window=1, sinks=0), dict(prefill=1), dict(limit=2), dict(sinks=255),
          dict(policies="h2o:size=4", compare_policies=True), dict(max_new_tokens=1),
          dict(policies="snapkv:ratio=0.5", compare_policies=True, prefill=3)]
    for kwargs in ok:
        stream_core.validate_stream(StreamSettings(**kwargs))
    assert refused(StreamSettings(chunk=0)) == "--chunk 0: must be an integer >= 1"
    assert refused(StreamSettings(feed=0)) == "--feed 0: must be an integer >= 1"
    assert refused(StreamSettings(window=0, sinks=0)) == "--window 0: must be an integer >= 1"
    assert refused(StreamSettings(prefill=0)) == "--prefill 0: must be an integer >= 1"
    assert refused(StreamSettings(limit=1)) == "--limit 1: must be an integer >= 2"
    assert refused(StreamSettings(sinks=-1)) == "--sinks -1: must be >= 0 and below --window (256)"
    assert refused(StreamSettings(window=8, sinks=8)) == "--sinks 8: must be >= 0 and below --window (8)"
    assert refused(StreamSettings(policies="h2o:size=4")) == (
        "--policies: ranks policies with --compare-policies; add it (or give one --cache)")
    assert refused(StreamSettings(policies="h2o:size=4,snapkv:ratio=0.5", compare_policies=True)) == (
        "--policies snapkv:kernel=5,pool=max,ratio=0.5,window=32: it compresses once, after the prompt, and a scored text has no prompt; give "
        "--prefill N (the first N tokens are its prompt)")
    assert refused(StreamSettings(max_new_tokens=2**24 + 1)) == (
        "--max-new-tokens 16777217: stream runs past the context, so the run holds every token; at most 16777216")
    stream_core.validate_stream(StreamSettings(max_new_tokens=2**24))
    assert refused(StreamSettings(top=-1)).startswith("--top -1")  # the sample checks come first
    assert "--probe-keys" in refused(StreamSettings(probe_keys=(" ",)))
    assert "--probe-depths" in refused(StreamSettings(probe_depths="0.5,2"))


def test_probe_depths_parse_and_refuse():
    depths = stream_core.probe_depths
    assert depths(StreamSettings(probe_depths=" 0.25, 0.5,,1")) == (0.25, 0.5, 1.0)
    assert depths(StreamSettings(probe_depths="0")) == (0.0,)
    for bad in ("x", "", ",", "1.5", "-0.1", "0.5,a"):
        with pytest.raises(ConfigError) as info:
            depths(StreamSettings(probe_depths=bad))
        assert str(info.value) == f"--probe-depths {bad}: must be fractions in [0, 1], e.g. 0.1,0.5,0.9", bad


def test_policy_set_by_hand():
    assert stream_core.policy_set(StreamSettings(window=10, sinks=3)) == {
        "full": "full", "window keep": "window:size=10,positions=keep",
        "window rerotate": "window:size=10,positions=rerotate",
        "sinks keep": "sinks:sinks=3,recent=7,positions=keep",
        "sinks rerotate": "sinks:sinks=3,recent=7,positions=rerotate", "recompute": "recompute:size=11"}
    # the full cache is the reference however it is typed ("full:" names it too), never listed twice
    given = stream_core.policy_set(StreamSettings(policies="h2o:size=4,full:,window:size=5", compare_policies=True))
    assert given == {"full": "full", "h2o:size=4": str(parse_cache_spec("h2o:size=4")),
                     "window:size=5": str(parse_cache_spec("window:size=5"))}
    assert list(given) == ["full", "h2o:size=4", "window:size=5"]


def test_score_settings_carry_the_chain_and_the_span_options():
    s = StreamSettings(temperature=0.7, top_k=5, limit=30, chunk=7, feed=3, prefill=4, top=9)
    out = stream_core.score_settings(s)
    assert (out.temperature, out.top_k, out.limit, out.chunk, out.feed, out.prefill, out.top) == (
        0.7, 5, 30, 7, 3, 4, 0)
    assert stream_core.score_settings(s, feed=11).feed == 11


def test_compare_policies_feed_the_exact_policies_a_chunk_at_a_time():
    ids = list(range(1, 30))
    runs = dict(compare_policies(random_model("llama"), ids, build_chain({}), str,
                                 StreamSettings(window=8, sinks=2, chunk=6, feed=2)))
    assert {label: run.scorer.s.feed for label, run in runs.items()} == {
        "full": 6, "window keep": 2, "window rerotate": 2, "sinks keep": 2, "sinks rerotate": 2, "recompute": 6}
    assert all(run.against_full for run in runs.values())
    assert runs["full"].scorer.reference is None and runs["window keep"].scorer.reference is not None
    gpt2 = random_model("gpt2")
    out = dict(compare_policies(gpt2, ids, build_chain({}), str, StreamSettings(window=8, sinks=2), model_info(gpt2)))
    assert list(out) == ["full", "window keep", "window rerotate", "sinks keep", "sinks rerotate", "recompute"]
    assert [isinstance(run, str) for run in out.values()] == [False, False, True, False, True, False]  # on after one
    big_feed = dict(compare_policies(random_model("llama"), ids, build_chain({}), str,
                                     StreamSettings(window=8, sinks=2, chunk=3, feed=5)))
    assert big_feed["full"].scorer.s.feed == 5 and big_feed["recompute"].scorer.s.feed == 5


def test_compare_policies_feed_a_policy_a_chunk_at_a_time_where_it_declares_feed_invariance():
    """With --policies the labels are as typed: a feed-invariant policy (KVPolicy.feed_invariant) is fed ``chunk``
    tokens a forward whatever its label, any other ``feed``; its numbers are still the full cache's exactly."""
    ids = list(range(1, 30))
    runs = dict(compare_policies(random_model("llama", seed=2), ids, build_chain({}), str,
                                 StreamSettings(chunk=6, feed=2, compare_policies=True,
                                                policies="recompute:size=40,paged,window:size=8")))
    assert {label: run.scorer.s.feed for label, run in runs.items()} == {
        "full": 6, "recompute:size=40": 6, "paged": 6, "window:size=8": 2}
    for label in ("full", "recompute:size=40", "paged"):
        list(runs[label])
    full = [r.logprob for r in runs["full"].scorer.steps]
    for label in ("recompute:size=40", "paged"):  # the whole text fits: each equals the full cache
        assert [r.logprob for r in runs[label].scorer.steps] == pytest.approx(full, abs=1e-4), label
        assert runs[label].summary().top1_agreement == 1.0


def test_stream_score_against_full_recomputed_by_hand():
    """KL(full || window) and top-1 flips per token from one full forward and a window runtime fed one token at a
    time; the full cache against itself is KL 0 and no flip."""
    model = random_model("llama", seed=5, scale=4.0)
    ids = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(5)).tolist()
    full = torch.log_softmax(forward(model, torch.tensor([ids]), None, torch.arange(21).unsqueeze(0),
                                     logits_to_keep=0)[0, :-1].float(), -1)
    rt = Runtime.create(model, parse_cache_spec("window:size=4"))
    win = torch.cat([torch.log_softmax(rt.feed(torch.tensor([[t]])), -1) for t in ids[:-1]])
    kl = (full.exp() * (full - win)).sum(-1)
    flips = int((full.argmax(-1) != win.argmax(-1)).sum())
    settings = StreamSettings(chunk=8, feed=1)
    run = StreamScore(model, ids, build_chain({}), str, settings, "window:size=4", against_full=True)
    assert run.total == 20 and run.new_ids == []
    began = time.perf_counter()
    chunks = list(run)
    wall = time.perf_counter() - began
    assert [(c.start, c.end, c.tokens) for c in chunks] == [(1, 9, 8), (9, 17, 8), (17, 21, 4)]
    assert all(c.tokens_per_s > 0 and math.isfinite(c.tokens_per_s) for c in chunks)
    # each span's time is tokens / (tokens/s); they add up to the run's seconds, within the wall time of the loop
    assert sum(c.tokens / c.tokens_per_s for c in chunks) == pytest.approx(run.seconds, rel=1e-6)
    assert 0 < run.seconds <= wall
    summary = run.summary()
    assert summary.policy == "window:positions=keep,size=4" and summary.stop_reason == "end"
    assert math.isclose(summary.kl_mean, float(kl.mean()), rel_tol=1e-4)
    assert summary.top1_flips == flips and math.isclose(summary.top1_agreement, 1 - flips / 20)
    assert summary.max_cache_tokens == 4 and summary.kv_bytes_peak == max(c.kv_bytes for c in chunks) > 0
    assert math.isclose(summary.tokens_per_s, 20 / run.seconds) and run.seconds > 0
    # the span's perplexity: exp of its own mean negative log-probability
    span = -win[8:16].gather(1, torch.tensor(ids[9:17]).view(-1, 1)).mean()
    assert math.isclose(chunks[1].perplexity, math.exp(float(span)), rel_tol=1e-4)
    same = StreamScore(model, ids, build_chain({}), str, settings, "full", against_full=True)
    list(same)
    assert same.scorer.reference is None
    assert (same.summary().kl_mean, same.summary().top1_agreement, same.summary().top1_flips) == (0.0, 1.0, 0)
    alone = StreamScore(model, ids, build_chain({}), str, settings, "window:size=4")
    list(alone)
    assert (alone.summary().kl_mean, alone.summary().top1_agreement, alone.summary().top1_flips) == (None,) * 3


def test_stream_score_before_any_span_and_interrupted():
    model = random_model("llama", seed=5)
    ids = list(range(3, 40))
    run = StreamScore(model, ids, build_chain({}), str, StreamSettings(cache="window:size=6", chunk=5))
    assert str(run.spec) == "window:positions=keep,size=6"  # the settings' cache when none is given
    empty = run.summary()
    assert empty.tokens == 0 and math.isnan(empty.perplexity) and math.isnan(empty.tokens_per_s)
    assert (empty.max_cache_tokens, empty.kv_bytes_peak, empty.chunks, empty.kl_mean) == (0, 0, [], None)
    for chunk in run:
        run.interrupt()  # what the CLI does on Ctrl-C: stop iterating, keep what was scored
        break
    assert run.interrupted and run.scorer.interrupted and run.scorer.stop_reason == "interrupted"
    assert (run.summary().tokens, run.summary().stop_reason) == (5, "interrupted")


def test_spans_by_hand():
    def step(position: int, raw: float, cache: int, kv: int) -> stream_core.StreamStep:
        return stream_core.StreamStep(0, position, 1, "<1>", 0.5, -0.7, 0.5, raw, 1, 0.0, 0.0, 1,
                                      cache_tokens=cache, kv_bytes=kv)

    spans = stream_core.Spans(2)
    assert spans.spans() == [] and spans.max_cache_tokens == spans.max_kv_bytes == 0
    for position, raw, cache, kv in [(5, -1.0, 3, 30), (6, -3.0, 9, 10), (7, -0.5, 4, 40), (8, -1.5, 2, 20),
                                     (9, -2.0, 5, 50)]:
        spans.add(step(position, raw, cache, kv))
    got = spans.spans()
    assert [(c.start, c.end, c.tokens, c.cache_tokens, c.kv_bytes) for c in got] == [
        (5, 7, 2, 9, 10), (7, 9, 2, 2, 20), (9, 10, 1, 5, 50)]
    assert [c.perplexity for c in got] == pytest.approx([math.exp(2.0), math.exp(1.0), math.exp(2.0)])
    assert all(math.isnan(c.tokens_per_s) for c in got)
    assert (spans.max_cache_tokens, spans.max_kv_bytes) == (9, 50) and len(spans.closed) == 2


def test_slot_ranges_and_cache_state_of_hand_policies():
    """The slot map each policy declares (``KVPolicy.slot_ranges``: recompute's own, the protocol's default for
    the rest) and the cache state stream reports from it; the policies are built by hand, without a model."""

    def Policy(name, seen, size=None, **extra):
        base = RecomputePolicy if name == "recompute" and size is not None else KVPolicy

        class Hand(base):
            stored = 3

            def nbytes(self):
                return 96

        p = object.__new__(Hand)  # no model: only the fields slot_ranges and cache_state read
        p.name, p.seen = name, seen
        if size is not None:
            p.size = size
        p.__dict__.update(extra)
        return p

    def slots(policy):
        return policy.slot_ranges()

    assert slots(Policy("recompute", 10, size=4)) == [[7, 10, 0]]
    assert slots(Policy("recompute", 3, size=4)) == [[0, 3, 0]]
    assert slots(Policy("recompute", 4, size=4)) == [[1, 4, 0]]
    assert slots(Policy("recompute", 0, size=4)) == []
    assert slots(Policy("recompute", 5)) == [[0, 5, 0]]  # no size: everything at its own position
    assert slots(Policy("window", 10, size=4)) == [[0, 10, 0]]
    assert slots(Policy("full", 1)) == [[0, 1, 0]] and slots(Policy("full", 0)) == []
    assert slots(Policy("sinks", 9, size=4, slot_ranges=lambda: [[1, 2, 3]])) == [[1, 2, 3]]
    state = stream_core.cache_state
    assert state(Policy("full", 2)) == {"cache_tokens": 3, "kv_bytes": 96, "evicted": [], "slots": [[0, 2, 0]]}
    assert state(Policy("window", 9, last_evicted=(3, 5)))["evicted"] == [3, 5]
    assert state(Policy("window", 9, last_evicted=(4, 4)))["evicted"] == []
    assert state(Policy("window", 9, last_evicted=(4, 5)))["evicted"] == [4, 5]


def greedy_by_hand(model, prompt: list[int], spec: str, n: int):
    """Greedy decoding under ``spec`` with a runtime fed by hand: (ids, raw log-probs, cache states)."""
    rt = Runtime.create(model, parse_cache_spec(spec))
    logits = rt.prefill(torch.tensor([prompt]))
    ids, raws, states = [], [], []
    for _ in range(n):
        logp = torch.log_softmax(logits[0].float(), -1)
        token = int(logp.argmax())
        ids.append(token)
        raws.append(float(logp[token]))
        states.append(cache_state(rt.policy))
        logits = rt.feed(torch.tensor([[token]]))
    return ids, raws, states


def test_stream_generate_past_a_rope_context_by_hand():
    lm = hand_lm(max_position_embeddings=16)
    prompt = [5, 6, 7, 8]
    settings = StreamSettings(cache="sinks:sinks=1,recent=5", max_new_tokens=20, temperature=0, ignore_eos=True,
                              chunk=8, top=3)
    ids, raws, states = greedy_by_hand(lm.model, prompt, settings.cache, 20)
    run = stream_core.StreamGenerate(lm, prompt, build_chain({}), settings)
    steps = list(run)
    assert [s.token_id for s in steps] == ids == run.new_ids and run.selector.name == "greedy"
    assert [s.position for s in steps] == list(range(4, 24)) and steps[0].token == f"<{ids[0]}>"
    assert [s.raw_logprob for s in steps] == pytest.approx(raws, abs=1e-5)
    assert [{k: getattr(s, k) for k in states[0]} for s in steps] == states
    assert run.steps == steps and all(len(s.alternatives) == 3 for s in steps)
    assert states[-1]["cache_tokens"] == 6 and states[-1]["evicted"]
    summary = run.summary()
    assert (summary.policy, summary.tokens, summary.stop_reason) == ("sinks:positions=rerotate,recent=5,sinks=1",
                                                                    20, "length")
    assert math.isclose(summary.perplexity, math.exp(-sum(raws) / 20), rel_tol=1e-5)
    assert summary.max_cache_tokens == 6 and summary.kv_bytes_peak == max(s["kv_bytes"] for s in states)
    assert summary.mean_logprob == pytest.approx(sum(raws) / 20, abs=1e-5)  # no stage: processed = raw
    assert summary.tokens_per_s > 0
    assert [(c.start, c.end, c.tokens) for c in summary.chunks] == [(4, 12, 8), (12, 20, 8), (20, 24, 4)]
    assert summary.chunks[-1].perplexity == pytest.approx(math.exp(-sum(raws[16:]) / 4), rel=1e-5)
    run.stop_reason = "interrupted"
    assert run.sampler.stop_reason == "interrupted" == run.summary().stop_reason


def test_stream_generate_keeps_no_step_when_told_and_stops_as_told():
    lm = hand_lm(max_position_embeddings=16)
    prompt = [5, 6, 7, 8]
    ids, _, _ = greedy_by_hand(lm.model, prompt, "window:size=6", 12)
    settings = StreamSettings(cache="window:size=6", max_new_tokens=12, temperature=0, ignore_eos=True, chunk=5)
    run = stream_core.StreamGenerate(lm, prompt, build_chain({}), settings, keep_steps=False)
    assert [s.token_id for s in run] == ids and run.steps == [] and run.sampler.steps == []
    assert run.summary().tokens == 12 and [c.tokens for c in run.summary().chunks] == [5, 5, 2]
    # the model's end of text ends it unless ignored; a stop string ends it too
    eos = hand_lm(eos=ids[2], max_position_embeddings=16)
    eos.model = lm.model
    ended = stream_core.StreamGenerate(eos, prompt, build_chain({}), StreamSettings(
        cache="window:size=6", max_new_tokens=12, temperature=0))
    assert [s.token_id for s in ended] == ids[:3] and ended.stop_reason == "eos"
    ignored = stream_core.StreamGenerate(eos, prompt, build_chain({}), StreamSettings(
        cache="window:size=6", max_new_tokens=12, temperature=0, ignore_eos=True))
    assert [s.token_id for s in ignored] == ids and ignored.stop_reason == "length"
    stopped = stream_core.StreamGenerate(lm, prompt, build_chain({}), StreamSettings(
        cache="window:size=6", max_new_tokens=12, temperature=0, stop=(f"<{ids[1]}>",), ignore_eos=True))
    assert len(list(stopped)) == ids.index(ids[1]) + 1 and stopped.stop_reason == "stop"


def test_stream_generate_stops_at_an_absolute_context_and_draws_from_the_seed():
    lm = hand_lm("gpt2", n_positions=12)
    settings = StreamSettings(cache="window:size=6", max_new_tokens=30, temperature=0, ignore_eos=True)
    run = stream_core.StreamGenerate(lm, [5, 6, 7, 8], build_chain({}), settings)
    assert len(list(run)) == 8 and run.stop_reason == "context"
    rope = hand_lm(max_position_embeddings=16)

    def drawn(seed: int) -> list[int]:
        s = StreamSettings(cache="window:size=6", max_new_tokens=8, temperature=1.0, seed=seed, ignore_eos=True)
        run = stream_core.StreamGenerate(rope, [5, 6, 7, 8], build_chain({}), s)
        assert run.selector.name == "multinomial"
        return [step.token_id for step in run]

    assert drawn(4) == drawn(4) != drawn(5)


def test_stream_generate_preallocates_the_prompt_and_its_new_tokens():
    """--cache static holds exactly the prompt and -n new tokens: the run is the full cache's greedy run."""
    lm = hand_lm(max_position_embeddings=16)
    ids, _, _ = greedy_by_hand(lm.model, [5, 6, 7, 8], "full", 6)
    settings = StreamSettings(cache="static", max_new_tokens=6, temperature=0, ignore_eos=True)
    run = stream_core.StreamGenerate(lm, [5, 6, 7, 8], build_chain({}), settings)
    assert [s.token_id for s in run] == ids and run.runtime.policy.capacity == 10


def test_stream_records_as_dicts():
    chunk = stream_core.StreamChunk(1, 9, 8, 2.5, 4, 1024, 100.0)
    assert chunk.to_dict() == {"start": 1, "end": 9, "tokens": 8, "perplexity": 2.5, "cache_tokens": 4,
                               "kv_bytes": 1024, "tokens_per_s": 100.0}
    summary = stream_core.StreamSummary("full", 8, 2.5, 4, 1024, 100.0, "end", [chunk])
    assert summary.to_dict()["chunks"] == [chunk.to_dict()] and summary.to_dict()["stop_reason"] == "end"
    assert summary.to_dict()["kl_mean"] is None


def test_stream_generate_takes_the_stop_ids_and_the_compile_setting_it_inherits(monkeypatch):
    """stream's settings inherit stop_id and compile from sample's (reachable by --set or a preset): a stop id ends
    the run as a stop string does, and compile compiles the decode step (seen here by the call, not run)."""
    from decodelab.core.engine.runtime import Runtime
    lm = hand_lm(max_position_embeddings=16)
    prompt = [5, 6, 7, 8]
    ids, _, _ = greedy_by_hand(lm.model, prompt, "window:size=6", 12)
    stopped = stream_core.StreamGenerate(lm, prompt, build_chain({}), StreamSettings(
        cache="window:size=6", max_new_tokens=12, temperature=0, ignore_eos=True, stop_id=(ids[2],)))
    assert [s.token_id for s in stopped] == ids[: ids.index(ids[2]) + 1] and stopped.stop_reason == "stop"
    compiled = []
    monkeypatch.setattr(Runtime, "compile_decode", lambda self: compiled.append(self))
    run = stream_core.StreamGenerate(lm, prompt, build_chain({}), StreamSettings(
        cache="static", max_new_tokens=3, temperature=0, ignore_eos=True, compile=True))
    assert compiled == [run.runtime]


def test_the_policies_plot_gives_each_policy_its_own_mark():
    """Issue 40: the --policies plot reused letters with new meanings (8 marks, one of them "*", which also means a
    shared point). Every policy of a long list gets a mark of its own, never "*"."""
    from decodelab.cli.view.stream_view import MARKS

    assert "*" not in MARKS and len(set(MARKS)) == len(MARKS) >= 40
    assert MARKS.startswith("FwWskR")  # the first policies keep the marks they had
