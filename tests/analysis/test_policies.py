"""The policy ranking (stream --compare-policies --policies, quantize-kv --policies): every number of a row equals
the single run a user would type for that policy, and rows are ordered as documented."""

from __future__ import annotations

import json
import math
import re

import pytest
from conftest import ROOT

from decodelab.core.analysis.policies import PolicyRow, ranked
from decodelab.core.errors import ConfigError
from decodelab.core.kv import parse_policy_list, split_policy_list
from decodelab.core.methods.score import blocks

TEXT = str(ROOT / "presets" / "models" / "validation.txt")
POLICIES = "h2o:size=8,snapkv:ratio=0.5,window=4,window:size=8"


def run(cli, *args):
    code, out, err = cli(*args, "-f", "json")
    assert code == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def compared(toy_model_dir):
    from decodelab.cli.main import main  # module-scoped: run once through the entry point, outside capsys
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["stream", "--text-file", TEXT, "--limit", "24", "--compare-policies", "--policies", POLICIES,
                     "--prefill", "10", "--chunk", "8", "--probe", "--probe-depths", "0.5", "-m", str(toy_model_dir),
                     "-f", "json"])
    assert code == 0
    return json.loads(buf.getvalue())


def test_ranking_rows_equal_single_runs(cli, toy_model_dir, compared):
    rows = {r["label"]: r for r in compared["ranking"]}
    assert list(rows) and set(rows) == {"full", "h2o:size=8", "snapkv:ratio=0.5,window=4", "window:size=8"}
    for label in ("h2o:size=8", "snapkv:ratio=0.5,window=4", "window:size=8"):
        row = rows[label]
        score = run(cli, "score", "--text-file", TEXT, "--limit", "24", "--cache", label, "--against-cache", "full",
                    "--feed", "1", "--prefill", "10", "-m", toy_model_dir)["summary"]
        assert row["kl_mean"] == score["kl_mean"] and row["top1_agreement"] == score["top1_agreement"]
        assert row["perplexity"] == pytest.approx(score["perplexity"], rel=1e-12)
        assert row["top1_flips"] == round((1 - score["top1_agreement"]) * score["tokens"])
        single = run(cli, "stream", "--text-file", TEXT, "--limit", "24", "--cache", label, "--prefill", "10",
                     "--chunk", "8", "-m", toy_model_dir)["summary"]
        assert row["kv_bytes_peak"] == single["kv_bytes_peak"]
        assert row["bytes_ratio"] == single["kv_bytes_peak"] / rows["full"]["kv_bytes_peak"]
        probe = run(cli, "stream", "--text-file", TEXT, "--limit", "24", "--cache", label, "--probe",
                    "--probe-depths", "0.5", "-m", toy_model_dir)["summary"]
        assert row["probe_logprob"] == probe["mean_logprob"] and row["needle_kept"] == probe["needle_kept"]
        assert row["probe_accuracy"] == probe["accuracy"]
    assert rows["full"]["kl_mean"] == 0 and rows["full"]["top1_flips"] == 0 and rows["full"]["bytes_ratio"] == 1


def test_ranking_order_and_the_policies_entries(compared):
    ranking = compared["ranking"]
    assert [r["rank"] for r in ranking] == list(range(1, len(ranking) + 1))
    keys = [(-(r["probe_accuracy"] or 0), r["kl_mean"], r["kv_bytes_peak"]) for r in ranking]
    assert keys == sorted(keys)
    by_label = {r["label"]: r["rank"] for r in ranking}
    assert {p["label"]: p["rank"] for p in compared["policies"]} == by_label
    assert compared["probe"]["policies"][0]["policy"] == "full"


def test_ranked_by_hand():
    def row(label, kl, size, acc=None):
        return PolicyRow(label, label, 10, size, 1.0, 1.0, kl, 1.0, 0, acc)
    out = ranked([row("a", 0.2, 5), row("b", 0.1, 9), row("c", 0.1, 3), row("d", 0.5, 1, acc=1.0)])
    assert [r.label for r in out] == ["d", "c", "b", "a"] and [r.rank for r in out] == [1, 2, 3, 4]


def test_quantize_kv_takes_a_press_and_ranks_policies_as_score_measures_them(cli, toy_model_dir):
    doc = run(cli, "quantize-kv", "Once upon a time there was a little", "--limit", "8", "--cache",
              "tova:size=4", "--policies", "int8,h2o:size=4", "-m", toy_model_dir)
    score = run(cli, "score", "Once upon a time there was a little", "--limit", "8", "--cache", "tova:size=4",
                "--against-cache", "full", "--feed", "1", "-m", toy_model_dir)["summary"]
    assert doc["summary"]["kl_mean"] == score["kl_mean"] and doc["reconstruction"] == [] and doc["projections"] == []
    rows = {r["label"]: r for r in doc["ranking"]}
    assert set(rows) == {"full", "int8", "h2o:size=4"}
    h2o = run(cli, "score", "Once upon a time there was a little", "--limit", "8", "--cache", "h2o:size=4",
              "--against-cache", "full", "--feed", "1", "-m", toy_model_dir)["summary"]
    assert rows["h2o:size=4"]["kl_mean"] == h2o["kl_mean"] and rows["full"]["kl_mean"] == 0


def test_blocks_put_the_prompt_first():
    assert blocks(6, 1) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert blocks(6, 1, prefill=3) == [(0, 3), (3, 4), (4, 5)]
    assert blocks(6, 2, prefill=9) == [(0, 5)]  # the prompt is clipped to the text's fed tokens
    assert blocks(7, 5) == [(0, 5), (5, 6)]


def test_policy_lists_split_where_a_policy_begins():
    assert split_policy_list("snapkv:ratio=0.5,window=8,h2o:size=64,full,int8,window:size=8,positions=keep") == [
        "snapkv:ratio=0.5,window=8", "h2o:size=64", "full", "int8", "window:size=8,positions=keep"]
    assert split_policy_list("tova:size=3;knorm:ratio=0.5,compress=decode") == ["tova:size=3",
                                                                                  "knorm:ratio=0.5,compress=decode"]
    assert str(parse_policy_list("h2o:size=4")["h2o:size=4"]) == "h2o:compress=decode,size=4"
    with pytest.raises(ConfigError, match=re.escape("named twice")):
        parse_policy_list("h2o:size=4,h2o:size=4,compress=decode")


@pytest.mark.parametrize("args,words", [
    (["stream", "--text-file", TEXT, "--policies", "h2o:size=4"], "--policies"),
    (["stream", "--text-file", TEXT, "--compare-policies", "--policies", "snapkv:ratio=0.5"], "--prefill N"),
    (["stream", "--text-file", TEXT, "--compare-policies", "--policies", "h2o:size=4,nope"], "unknown policy 'nope'"),
    (["stream", "Once", "--probe"], "--probe: needs --text-file"),
    (["stream", "--text-file", TEXT, "--probe", "--probe-depths", "0.5,2"], "--probe-depths"),
    (["quantize-kv", "--cache", "snapkv:ratio=0.5"], "--prefill N"),
    (["quantize-kv", "--cache", "h2o:size=4", "--bits", "4"], "--bits"),
    (["quantize-kv", "--cache", "h2o:size=4", "--activations", "0"], "--activations"),
    (["quantize-kv", "--probe"], "--probe"),
])
def test_bad_input_is_one_line(cli, args, words):
    code, out, err = cli(*args)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err


# mutation run of core/analysis/policies.py (2026-12-02, second round): the rows built from hand-made summaries, the
# ranking's three keys each deciding once


def test_a_policy_row_carries_the_summary_the_bytes_ratio_and_the_probe():
    from types import SimpleNamespace

    from decodelab.core.analysis.policies import fidelity_row, policy_row
    summary = SimpleNamespace(policy="window:size=8", tokens=50, kv_bytes_peak=300, perplexity=12.5, kl_mean=0.25,
                              top1_agreement=0.9, top1_flips=5)
    probe = SimpleNamespace(accuracy=0.5, mean_logprob=-2.0, needle_kept=0.25)
    row = policy_row("w", summary, 1200, probe)
    assert (row.label, row.spec, row.tokens, row.kv_bytes_peak, row.bytes_ratio, row.perplexity) == \
        ("w", "window:size=8", 50, 300, 0.25, 12.5)
    assert (row.kl_mean, row.top1_agreement, row.top1_flips) == (0.25, 0.9, 5)
    assert (row.probe_accuracy, row.probe_logprob, row.needle_kept, row.rank) == (0.5, -2.0, 0.25, 0)
    bare = policy_row("w", summary, 0)
    assert math.isnan(bare.bytes_ratio) and (bare.probe_accuracy, bare.probe_logprob, bare.needle_kept) == \
        (None, None, None)
    steps = [SimpleNamespace(agree=a) for a in (True, False, False)]  # 2 flips, 1 agreement
    fidelity = SimpleNamespace(cache="quant:bits=4", tokens=3, kv_bytes=100, perplexity=9.0, kl_mean=0.5,
                               top1_agreement=0.5, steps=steps)
    row = fidelity_row("q", fidelity, 400, probe)
    assert (row.label, row.spec, row.tokens, row.kv_bytes_peak, row.bytes_ratio, row.perplexity) == \
        ("q", "quant:bits=4", 3, 100, 0.25, 9.0)
    assert (row.kl_mean, row.top1_agreement, row.top1_flips) == (0.5, 0.5, 2)
    assert (row.probe_accuracy, row.probe_logprob, row.needle_kept) == (0.5, -2.0, 0.25)
    fidelity.steps = []
    bare = fidelity_row("q", fidelity, 0)
    assert bare.top1_flips is None and math.isnan(bare.bytes_ratio) and bare.needle_kept is None


def test_ranking_keys_accuracy_then_kl_then_bytes_with_missing_values_last():
    from decodelab.core.analysis.policies import PolicyRow, ranked

    def row(label, accuracy, kl, nbytes):
        return PolicyRow(label, label, 10, nbytes, 1.0, 1.0, kl, None, None, probe_accuracy=accuracy)
    rows = [row("no-kl", 1.0, None, 10), row("nan-kl", 1.0, float("nan"), 5), row("kl", 1.0, 0.3, 99),
            row("worse", 0.5, 0.0, 1), row("no-probe", None, 0.0, 1), row("tie-b", 1.0, 0.1, 7),
            row("tie-a", 1.0, 0.1, 7)]
    out = ranked(rows)
    # accuracy 1 first, by KL (a missing or NaN KL as infinite, then bytes), then 0.5; no probe counts as 0
    assert [r.label for r in out] == ["tie-b", "tie-a", "kl", "nan-kl", "no-kl", "worse", "no-probe"]
    assert [r.rank for r in out] == [1, 2, 3, 4, 5, 6, 7]


def test_a_row_without_the_probe_ranks_as_accuracy_zero():
    from decodelab.core.analysis.policies import PolicyRow, ranked
    zero = PolicyRow("zero", "a", 10, 5, 1.0, 1.0, 0.5, None, None, probe_accuracy=0.0)
    unprobed = PolicyRow("unprobed", "b", 10, 5, 1.0, 1.0, 0.1, None, None)
    assert [r.label for r in ranked([zero, unprobed])] == ["unprobed", "zero"]  # a tie on accuracy: KL decides


# --- the ranking past the trained context (issue 40) ----------------------------------------------------------------

def test_the_ranking_basis_is_the_texts_own_tokens_past_the_trained_context():
    from decodelab.core.analysis.policies import KL_VS_FULL, TEXT_PERPLEXITY, PolicyRow, rank_basis, ranked

    assert rank_basis(256, 256) == KL_VS_FULL and rank_basis(257, 256) == TEXT_PERPLEXITY
    assert rank_basis(10_000, None) == KL_VS_FULL
    # hand rows: the full cache collapsed (its perplexity the worst), recompute the best text, window closest to full
    rows = [PolicyRow("full", "full", 300, 100, 1.0, 90.0, 0.0, 1.0, 0),
            PolicyRow("window", "window:size=64", 300, 20, 0.2, 60.0, 0.1, 0.9, 3),
            PolicyRow("recompute", "recompute:size=64", 300, 20, 0.2, 46.0, 0.5, 0.8, 9)]
    assert [r.label for r in ranked([*rows], KL_VS_FULL)] == ["full", "window", "recompute"]
    assert [r.label for r in ranked([*rows], TEXT_PERPLEXITY)] == ["recompute", "window", "full"]


def test_bundled_tiny_past_its_trained_context_ranks_by_the_text(cli):
    """Issue 40's case: on `tiny` past its trained context (256) the full cache's perplexity collapses and ranking by
    KL against it put recompute, the best text, last. Past 256 tokens the ranking says it is by the text's own
    tokens and its order is the policies' perplexity order (worked from the same rows); within 256, by KL."""
    import json

    from conftest import ROOT

    text = ROOT / "presets" / "models" / "validation.txt"
    code, out, err = cli("stream", "--text-file", text, "--limit", "320", "--compare-policies", "--window", "64",
                         "--chunk", "64", "-f", "json", "--threads", "1")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["ranked_by"] == "text_perplexity"
    order = [r["label"] for r in doc["ranking"]]
    assert order == [r["label"] for r in sorted(doc["ranking"], key=lambda r: (r["perplexity"], r["kv_bytes_peak"]))]
    assert order != [r["label"] for r in sorted(doc["ranking"], key=lambda r: (r["kl_mean"], r["kv_bytes_peak"]))], \
        "on this text the two bases disagree, so the test tells them apart"
    code, out, err = cli("stream", "--text-file", text, "--limit", "200", "--compare-policies", "--window", "64",
                         "--chunk", "64", "-f", "json", "--threads", "1")
    assert json.loads(out)["ranked_by"] == "kl_vs_full"
