"""The noise verdict where two runs that should agree part, as compare, batch and sample -N report it: present
only for such pairs, its margin recomputed by hand, its words against the measured floor."""

from __future__ import annotations

import json

import pytest
import torch

from decodelab.core.analysis import noise
from decodelab.core.engine import numerics as en
from decodelab.core.engine.models import load_model

PROMPT = "Once upon a time there was"


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", device="cpu", dtype="float32")


def margin_by_hand(lm, prefix: list[int], a: int, b: int) -> float:
    z = en.whole(lm.model, prefix).logits[-1].double()
    return float(z[a] - z[b])


def test_compare_gives_a_verdict_where_only_the_cache_differs(cli, tiny):
    code, out, err = cli("compare", PROMPT, "-V", "a: temperature=0", "-V", "b: temperature=0,cache=window:size=4",
                         "-V", "c: temperature=0.9", "-n", "16", "-f", "json", "--threads", "1")
    assert code == 0, err
    doc = json.loads(out)
    pairs = {(p["a"], p["b"]): p for p in doc["pairs"]}
    cache = pairs["a", "b"]
    assert cache["deciding_stage"] == "cache" and cache["noise"] is not None
    v, d = cache["noise"], cache["first_divergence"]
    a_ids = next(r["token_ids"] for r in doc["rows"] if r["variant"] == "a")
    assert v["step"] == d and v["token_a"] == a_ids[d] == cache["a_token"] and v["token_b"] == cache["b_token"]
    assert v["margin"] == pytest.approx(margin_by_hand(tiny, doc["prompt"]["token_ids"] + a_ids[:d], v["token_a"],
                                                       v["token_b"]), abs=1e-4)
    assert v["dtype"] == "float32" and v["words"] == noise.NOT_EXPLAINED and abs(v["margin"]) > v["floor"]
    assert pairs["a", "c"]["deciding_stage"] == "temperature" and pairs["a", "c"]["noise"] is None


def test_sample_n_greedy_reports_a_sample_that_parts(cli, tiny, monkeypatch):
    """A greedy -N whose last sample is made to part at step 2 (a stand-in for a batched row whose logits moved):
    the verdict names it; an honest greedy -N (every sample alike) prints none."""
    code, out, err = cli("sample", PROMPT, "-t", "0", "-N", "3", "-n", "6", "--ignore-eos", "-f", "json",
                         "--threads", "1")
    assert code == 0, err
    assert "noise" not in json.loads(out)
    from decodelab.core.methods import many

    real = many.sample_many

    def parted(*args, **kwargs):
        rows, spread = real(*args, **kwargs)
        rows[-1].token_ids = rows[-1].token_ids[:2] + [rows[-1].token_ids[2] + 1] + rows[-1].token_ids[3:]
        return rows, spread

    monkeypatch.setattr(many, "sample_many", parted)
    code, out, err = cli("sample", PROMPT, "-t", "0", "-N", "3", "-n", "6", "--ignore-eos", "-f", "json",
                         "--threads", "1")
    assert code == 0, err
    doc = json.loads(out)
    [v] = doc["noise"]
    first = doc["samples"][0]["token_ids"]
    assert v["against"] == "sample 2" and v["step"] == 2 and v["token_b"] == first[2] + 1
    assert v["margin"] == pytest.approx(margin_by_hand(tiny, doc["prompt"]["token_ids"] + first[:2], first[2],
                                                       first[2] + 1), abs=1e-4)
    assert v["words"] == noise.verdict_words(v["margin"], v["floor"])


def test_sample_n_asks_the_plan_whether_it_is_greedy(cli):
    """-t 0 with --dynatemp-range under llama.cpp's semantics samples (the plan's selector is multinomial): samples
    that part are the draws', not noise, and get no verdict (a `temperature == 0` check called them a bug)."""
    code, out, err = cli("sample", PROMPT, "-t", "0", "--dynatemp-range", "0.5", "--semantics", "llamacpp", "-N",
                         "3", "-n", "6", "--ignore-eos", "-f", "json", "--threads", "1")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["selector"] == "multinomial" and len({tuple(s["token_ids"]) for s in doc["samples"]}) > 1
    assert "noise" not in doc


def test_batch_reports_a_greedy_request_whose_baseline_parts(cli, tiny, tmp_path, monkeypatch):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"id": f"r{i}", "prompt": p}) for i, p in
                              enumerate(["Once upon a time", "The little dog"])) + "\n")
    args = ("batch", "--prompts-file", path, "-t", "0", "-n", "5", "--ignore-eos", "--baselines", "static", "-f",
            "json", "--threads", "1")
    code, out, err = cli(*args)
    assert code == 0, err
    assert "noise" not in json.loads(out)  # the static baseline agrees
    from decodelab.core.methods.batch import run as batch_run

    real = batch_run.static_baseline

    def parted(*a, **k):
        base = real(*a, **k)
        base.outputs[1] = base.outputs[1][:3] + [base.outputs[1][3] + 1] + base.outputs[1][4:]
        return base

    monkeypatch.setattr(batch_run, "static_baseline", parted)
    code, out, err = cli(*args)
    assert code == 0, err
    doc = json.loads(out)
    [v] = doc["noise"]
    req = doc["requests"][1]
    assert v["request"] == "r1" and v["against"] == "static" and v["step"] == 3
    assert v["margin"] == pytest.approx(margin_by_hand(tiny, req["prompt_token_ids"] + req["token_ids"][:3],
                                                       req["token_ids"][3], req["token_ids"][3] + 1), abs=1e-4)
    assert v["words"] in (noise.WITHIN, noise.NOT_EXPLAINED)


def test_the_verdict_skips_temperature_but_applies_the_other_stages(tiny):
    """A repetition penalty shifts the two logits (it is in the margin); a temperature scales margin and noise alike
    (it is not)."""
    from decodelab.core.methods.sample import SampleSettings
    from decodelab.core.sampling.chain import make_chain

    ids = tiny.encode(PROMPT)
    prompt, generated = ids[:3], ids[3:]
    a, b = generated[1], ids[0]  # b is in the context: the penalty lowers it
    plain = noise.noise_verdict(tiny, prompt, generated, 1, b)
    hot = noise.noise_verdict(tiny, prompt, generated, 1, b, make_chain(tiny, SampleSettings(temperature=0.5)))
    assert hot.margin == pytest.approx(plain.margin, abs=1e-6)
    pen = noise.noise_verdict(tiny, prompt, generated, 1, b, make_chain(tiny, SampleSettings(repetition_penalty=1.5)))
    assert pen.margin != pytest.approx(plain.margin, abs=1e-3)
    assert torch.isfinite(torch.tensor(pen.margin))
