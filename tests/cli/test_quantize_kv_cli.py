"""`decodelab quantize-kv` and `--cache quant:...` on the other commands, through the real entry point."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

TEXT = "The quick brown fox jumps over the lazy dog. " * 4
TINY = {"layers": 12, "kv_heads": 2, "heads": 4, "head_dim": 32}  # presets/models/tiny/config.json


def run_json(cli, *args):
    code, out, err = cli("quantize-kv", *args, "-f", "json")
    assert code == 0, err
    return json.loads(out)


def test_json_summary_memory_and_steps(cli):
    doc = run_json(cli, TEXT, "--cache", "int8", "--limit", "20")
    s, m = doc["summary"], doc["memory"]
    assert doc["command"] == "quantize-kv" and doc["config"]["cache"] == "int8"
    T = len(doc["prompt"]["token_ids"])
    assert T == 20 and len(doc["steps"]) == T - 1 and {"kl", "agree"} <= set(doc["steps"][0])
    elements = 2 * TINY["layers"] * TINY["kv_heads"] * TINY["head_dim"]  # per token, keys and values
    assert m["bytes_per_token"] == elements * 4  # float32 on CPU
    assert m["fp16_bytes_per_token"] == elements * 2
    assert m["bytes_per_token_without_gqa"] == elements * 4 * TINY["heads"] // TINY["kv_heads"]
    # int8 per token, symmetric: per head and token 32 one-byte codes + one float16 scale
    assert s["kv_bytes"] == T * 2 * TINY["layers"] * TINY["kv_heads"] * (TINY["head_dim"] + 2)
    assert s["baseline_kv_bytes"] == T * elements * 4 and s["fp16_kv_bytes"] == T * elements * 2
    assert s["bytes_ratio"] == pytest.approx(s["kv_bytes"] / s["fp16_kv_bytes"])
    assert 0 <= s["kl_mean"] < 0.01 and s["top1_agreement"] >= 0.9
    assert s["perplexity"] > 1 and s["baseline_perplexity"] > 1
    assert len(doc["reconstruction"]) == TINY["layers"] * TINY["kv_heads"]
    assert len(doc["outliers"]) == 2 * TINY["layers"]
    assert s["fp16_model_bytes_ratio"] == s["bytes_ratio"]  # int8 per token keeps no exact window


def test_kivi_bytes_as_stored_and_as_a_float16_model_would_store_them(cli):
    """int4-kivi on 40 tokens (residual 32, group 32): keys leave the tail in blocks of 32 only while more than 32
    remain, so all 40 key tokens and 32 value tokens stay exact, stored in the bundled model's float32; the
    float16-model figure counts those at 2 bytes. Per layer and KV head (head_dim 32): keys 40 x 32 exact; values
    8 x (16 code bytes + a float16 scale and zero) quantized and 32 x 32 exact."""
    doc = run_json(cli, TEXT, "--cache", "quant:bits=4,axis=kivi,residual=32,residual_dtype=model,kivi_keys=window",
                   "--limit", "40")
    s = doc["summary"]
    rows = TINY["layers"] * TINY["kv_heads"]
    quantized = 8 * (32 // 2 + 2 * 2)
    assert s["kv_bytes"] == rows * (40 * 32 * 4 + quantized + 32 * 32 * 4)
    assert s["fp16_model_bytes_ratio"] * s["fp16_kv_bytes"] == pytest.approx(rows * (40 * 32 * 2 + quantized +
                                                                                    32 * 32 * 2))
    assert s["bytes_ratio"] > 1 > s["fp16_model_bytes_ratio"]  # 40 tokens: the exact window is most of the cache


def test_kivi_bytes_under_kivis_key_chunks(cli):
    """The same 40 tokens under KIVI's own key rule (the default): the first 32 keys leave as one chunk (a block of
    32 tokens: 16 code bytes a channel plus a float16 scale and zero per channel), 8 keys stay exact; values as
    above (8 quantized, 32 exact), in float32."""
    doc = run_json(cli, TEXT, "--cache", "quant:bits=4,axis=kivi,residual=32,residual_dtype=model", "--limit", "40")
    rows = TINY["layers"] * TINY["kv_heads"]
    keys = 32 * 32 // 2 + 32 * 2 * 2 + 8 * 32 * 4
    values = 8 * (32 // 2 + 2 * 2) + 32 * 32 * 4
    assert doc["summary"]["kv_bytes"] == rows * (keys + values)


def test_baseline_perplexity_is_scores(cli):
    """The fidelity figures come from `score`: the same text under --cache int8 against the full cache."""
    doc = run_json(cli, TEXT, "--cache", "int8", "--limit", "16")
    code, out, err = cli("score", TEXT, "--limit", "16", "--feed", "1", "--cache", "int8", "--against-cache", "full",
                         "-f", "json")
    assert code == 0, err
    ref = json.loads(out)["summary"]
    assert doc["summary"]["perplexity"] == pytest.approx(ref["perplexity"], rel=1e-6)
    assert doc["summary"]["baseline_perplexity"] == pytest.approx(ref["reference_perplexity"], rel=1e-6)
    assert doc["summary"]["kl_mean"] == pytest.approx(ref["kl_mean"], rel=1e-5, abs=1e-9)


def test_overrides_projection_and_activations(cli):
    doc = run_json(cli, TEXT, "--cache", "quant:bits=4,axis=kivi,residual=32,residual_dtype=16,kivi_keys=window",
                   "--bits", "2", "--residual", "4", "--limit", "12", "--context", "4096", "--batch", "8",
                   "--activations", "3")
    assert doc["summary"]["cache"] == \
        "quant:axis=kivi,bits=2,kivi_keys=window,residual=4,residual_dtype=16,symmetric=false"
    at = {p["at"]: p for p in doc["projections"]}
    assert at["context_length"]["tokens"] == 512
    assert at["context"]["tokens"] == 4096 and at["context"]["batch"] == 8
    elements = 2 * TINY["layers"] * TINY["kv_heads"] * TINY["head_dim"]
    assert at["context"]["fp16_kv_bytes"] == 4096 * 8 * elements * 2
    assert at["context"]["bytes_ratio"] < 0.2
    act = doc["activations"]
    assert act["layer"] == 3 and act["channels"] == 128  # hidden size
    assert act["layouts"]["channel"]["rel_error"] <= act["layouts"]["tensor"]["rel_error"]


def test_grid(cli):
    doc = run_json(cli, TEXT, "--limit", "4", "--grid")
    rows = {(r["cache"].split("bits=")[1].split(",")[0], r["cache"].split("axis=")[1].split(",")[0]): r
            for r in doc["grid"]}
    assert len(rows) == 15
    assert rows[("2", "token")]["kv_bytes"] < rows[("4", "token")]["kv_bytes"] < rows[("8", "token")]["kv_bytes"]


def test_other_formats(cli):
    code, out, _ = cli("quantize-kv", TEXT, "--limit", "8", "-f", "markdown")
    assert code == 0 and "### memory" in out and "### reconstruction per layer and head" in out
    code, out, _ = cli("quantize-kv", TEXT, "--limit", "8", "-f", "csv")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert code == 0 and len(rows) == TINY["layers"] * TINY["kv_heads"] and "key_rel_error" in rows[0]
    code, out, _ = cli("quantize-kv", TEXT, "--limit", "8", "-f", "jsonl")
    lines = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and lines[-1]["type"] == "summary" and len(lines) == 8
    code, out, _ = cli("quantize-kv", TEXT, "--limit", "8")
    assert code == 0 and "memory after 8 tokens" in out and "grouped-query attention" in out


@pytest.mark.parametrize("args,words", [
    (("--bits", "3"), "--bits 3"),
    (("--cache", "full"), "--cache full"),
    (("--activations", "99"), "--activations 99"),
    (("--axis", "group", "--group-size", "5"), "must divide the model's head_dim"),
    (("--limit", "1"), "--limit 1"),
])
def test_bad_input_is_one_line(cli, args, words):
    code, out, err = cli("quantize-kv", TEXT, *args)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_other_commands_take_a_quantized_cache(cli):
    code, out, err = cli("sample", "Once upon a time", "--cache", "int4-kivi", "-n", "6", "-t", "0", "-f", "json")
    assert code == 0, err
    assert len(json.loads(out)["token_ids"]) == 6
    code, out, err = cli("beam", "Once upon a time", "--cache", "int8", "--beams", "2", "-n", "4", "-f", "json")
    assert code == 0, err
    code, out, err = cli("speculate", "a b c a b c", "--cache", "int4-kivi", "--draft", "ngram", "-n", "4")
    assert code == 2 and "roll back" in err
    code, out, err = cli("speculate", "a b c a b c", "--cache", "int8", "--draft", "ngram", "-n", "4", "-t", "0",
                         "-f", "json")
    assert code == 0, err


def test_turbo_bytes_and_the_attention_score_bias_of_its_key_codes(cli):
    """turbo on the bundled model: real bytes by hand (per token and KV head, head_dim 32 = 4 bytes a bit-plane;
    keys prod at 2 bits: 1 MSE plane + the sign plane + two float16 norms = 12 bytes; values: 2 MSE planes + one
    norm = 10; against 2 x 64 float16 bytes), no outlier view of scales, and the per-head score bias: the QJL
    residual takes most of the MSE code's shrinkage of inner products away (the MSE keys are the control)."""
    text = (Path(__file__).resolve().parents[2] / "presets" / "models" / "validation.txt").read_text()
    docs = {keys: run_json(cli, text, "--cache", f"turbo:bits=2,keys={keys}", "--limit", "96")
            for keys in ("prod", "mse")}
    assert docs["prod"]["summary"]["bytes_ratio"] == pytest.approx((12 + 10) / 128)
    assert docs["mse"]["summary"]["bytes_ratio"] == pytest.approx((10 + 10) / 128)
    assert docs["prod"]["outliers"] == []
    bias = {k: sum(r["score_bias"] for r in d["reconstruction"]) / len(d["reconstruction"]) for k, d in docs.items()}
    assert bias["mse"] < 0 and abs(bias["prod"]) < abs(bias["mse"]) / 2, bias


def test_reuse_rows_are_measured_in_core(cli):
    """--reuse: the JSON's rows are core's measure_reuse (core/analysis/quantize_kv.py) on the same text and
    settings, so a script gets them too; a guard that says "interrupted" keeps the rows so far."""
    from types import SimpleNamespace

    from decodelab.core.analysis.quantize_kv import QuantizeKVSettings, measure_reuse
    from decodelab.core.engine.models import bundled_dir, load_model

    doc = run_json(cli, "--limit", "120", "--prefill", "60", "--policies", "knorm:ratio=0.5", "--reuse", "2",
                   "--threads", "1")
    assert [r["policy"] for r in doc["reuse"]] == ["full", "knorm:ratio=0.5"]
    lm = load_model("tiny", device="cpu")
    ids = lm.encode((bundled_dir("tiny").parent / "validation.txt").read_text(encoding="utf-8"))[:120]
    settings = QuantizeKVSettings(limit=120, prefill=60, policies="knorm:ratio=0.5", reuse=2)
    report = SimpleNamespace(stop_reason="end", reuse=None)
    told = []
    measure_reuse(lm, ids, settings, report, progress=told.append)
    assert json.loads(json.dumps(report.reuse)) == doc["reuse"] and told == ["reuse 1: full",
                                                                           "reuse 2: knorm:ratio=0.5"]
    calls = []
    cut = SimpleNamespace(stop_reason="end", reuse=None)
    measure_reuse(lm, ids, settings, cut, guard=lambda fn: (calls.append(1), fn() if len(calls) == 1 else None)[1])
    assert cut.stop_reason == "interrupted" and [r["policy"] for r in cut.reuse] == ["full"]
    untouched = SimpleNamespace(stop_reason="end", reuse=None)
    measure_reuse(lm, ids, QuantizeKVSettings(policies="knorm:ratio=0.5"), untouched)  # no --reuse: nothing
    assert untouched.reuse is None and untouched.stop_reason == "end"
