"""The command line through its real entry point: JSON parsed and asserted, every error a single line + exit 2."""

from __future__ import annotations

import csv
import io
import json
import math
import shutil

import pytest


def run_json(cli, *args):
    code, out, err = cli(*args, "-f", "json")
    assert code == 0, err
    return json.loads(out)


def test_sample_json_shape_and_numbers(cli, toy_model_dir):
    doc = run_json(cli, "sample", "Once upon a time", "-m", toy_model_dir, "-n", "6", "-t", "0.8", "--top-p", "0.9",
                   "--top", "3", "--ignore-eos")
    for key in ("command", "model", "device", "dtype", "config", "chain", "prompt", "steps", "text", "token_ids",
                "summary"):
        assert key in doc
    assert doc["command"] == "sample" and doc["chain"] == ["temperature", "top-p"]
    assert doc["config"]["top_p"] == 0.9 and doc["config"]["temperature"] == 0.8
    assert len(doc["steps"]) == 6 == len(doc["token_ids"]) == doc["summary"]["new_tokens"]
    assert doc["prompt"]["token_ids"] and doc["prompt"]["text"] == "Once upon a time"
    for i, step in enumerate(doc["steps"]):
        assert step["index"] == i and step["position"] == len(doc["prompt"]["token_ids"]) + i
        assert step["token_id"] == doc["token_ids"][i]
        assert math.isclose(step["prob"], math.exp(step["logprob"]), rel_tol=1e-5)
        assert math.isclose(step["raw_prob"], math.exp(step["raw_logprob"]), rel_tol=1e-5)
        assert len(step["alternatives"]) == 3
        assert [s["name"] for s in step["stages"]] == ["temperature", "top-p"]
        assert step["kept"] == step["stages"][-1]["kept"]
    summary = doc["summary"]
    assert summary["stop_reason"] == "length"
    mean = sum(s["logprob"] for s in doc["steps"]) / 6
    assert summary["mean_logprob"] == pytest.approx(mean)
    raw_ppl = math.exp(-sum(s["raw_logprob"] for s in doc["steps"]) / 6)
    assert summary["raw_perplexity"] == pytest.approx(raw_ppl)


def test_sample_is_reproducible_by_seed(cli, toy_model_dir):
    args = ("sample", "The machine", "-m", toy_model_dir, "-n", "8", "--ignore-eos")
    a = run_json(cli, *args, "--seed", "3")
    b = run_json(cli, *args, "--seed", "3")
    c = run_json(cli, *args, "--seed", "4")
    assert a["token_ids"] == b["token_ids"]
    assert a["token_ids"] != c["token_ids"]


def test_greedy_preset_is_a_point_mass(cli, toy_model_dir):
    doc = run_json(cli, "sample", "Hello", "-m", toy_model_dir, "-n", "4", "-p", "greedy", "--ignore-eos")
    assert doc["selector"] == "greedy"
    assert all(s["prob"] == 1.0 and s["raw_rank"] == 1 and s["kept"] == 1 for s in doc["steps"])


def test_jsonl_streams_steps_then_a_summary(cli, toy_model_dir):
    code, out, _ = cli("sample", "Hello", "-m", toy_model_dir, "-n", "5", "-f", "jsonl", "--ignore-eos")
    assert code == 0
    lines = [json.loads(line) for line in out.splitlines()]
    assert [x["type"] for x in lines] == ["step"] * 5 + ["summary"]
    assert lines[-1]["token_ids"] == [x["token_id"] for x in lines[:-1]]
    assert lines[-1]["new_tokens"] == 5


def test_markdown_and_csv(cli, toy_model_dir):
    code, out, _ = cli("sample", "Hello", "-m", toy_model_dir, "-n", "3", "-f", "csv", "--ignore-eos")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert code == 0 and len(rows) == 3 and {"token", "prob", "raw_prob", "raw_rank"} <= set(rows[0])
    code, out, _ = cli("sample", "Hello", "-m", toy_model_dir, "-n", "3", "-f", "markdown", "--ignore-eos")
    assert code == 0 and out.splitlines()[0].replace(" ", "").startswith("|index|position|") and len(out.splitlines()) == 5


def test_table_and_saved_html_svg(cli, toy_model_dir, tmp_path):
    html, svg = tmp_path / "t.html", tmp_path / "t.svg"
    code, out, _ = cli("sample", "Hello", "-m", toy_model_dir, "-n", "3", "--save-html", html, "--save-svg", svg,
                       "--ignore-eos")
    assert code == 0 and "raw" in out and "kept" in out and "summary:" in out
    assert "<html" in html.read_text().lower() and "<svg" in svg.read_text()


def test_stop_string_and_eos(cli, toy_model_dir):
    doc = run_json(cli, "sample", "Hello", "-m", toy_model_dir, "-n", "12", "-t", "0", "--ignore-eos")
    stop_at = doc["steps"][2]["token"]
    if stop_at.strip():
        short = run_json(cli, "sample", "Hello", "-m", toy_model_dir, "-n", "12", "-t", "0", "--stop", stop_at,
                         "--ignore-eos")
        assert short["summary"]["stop_reason"] == "stop" and len(short["token_ids"]) <= 3
    biased = run_json(cli, "sample", "Hello", "-m", toy_model_dir, "-n", "12", "-t", "0", "--logit-bias",
                      "0=100")  # id 0 is <|endoftext|>, the model's EOS
    assert biased["token_ids"] == [0] and biased["summary"]["stop_reason"] == "eos"


def test_logit_bias_by_text_and_ban(cli, toy_model_dir):
    free = run_json(cli, "sample", "Hello", "-m", toy_model_dir, "-n", "1", "-t", "0")
    first = free["token_ids"][0]
    banned = run_json(cli, "sample", "Hello", "-m", toy_model_dir, "-n", "1", "-t", "0", "--logit-bias",
                      f"{first}=-inf")
    assert banned["token_ids"][0] != first
    forced = run_json(cli, "sample", "Hello", "-m", toy_model_dir, "-n", "1", "-t", "0", "--logit-bias", " the=50")
    assert forced["steps"][0]["token"] == " the"


def test_probs_json(cli, toy_model_dir):
    doc = run_json(cli, "probs", "Once upon a time", "-m", toy_model_dir, "-t", "0.5", "--top-p", "0.8",
                   "--softcap", "5", "--top", "6")
    names = [s["name"] for s in doc["stages"]]
    assert names == ["raw", "softcap", "temperature", "top-p"]
    raw, cap, temp, topp = doc["stages"]
    assert raw["kept"] == cap["kept"] == temp["kept"] > topp["kept"] >= 1
    assert all(abs(t["logit"]) < 5 for t in cap["top"])  # soft-capping squeezes every logit into (-5, 5)
    assert temp["entropy"] < cap["entropy"]
    assert [t["token_id"] for t in temp["top"]] == [t["token_id"] for t in cap["top"]]
    assert topp["mass_removed"] > 0
    assert len(raw["top"]) == 6
    for tok in doc["tokens"]:
        assert set(tok["probs"]) == set(names)


def test_probs_table(cli, toy_model_dir):
    code, out, _ = cli("probs", "Hello", "-m", toy_model_dir, "--top-k", "3")
    assert code == 0 and "removed" in out and "stages" in out


def test_models_json(cli):
    code, out, _ = cli("models", "-f", "json")
    doc = json.loads(out)
    assert code == 0
    assert [m["name"] for m in doc["models"]] == ["tiny", "tiny-draft", "tiny-recall"]
    names = {p["name"] for p in doc["presets"]}
    assert {"greedy", "nucleus", "creative", "softcap"} <= names


def test_preset_and_set_overrides(cli, toy_model_dir):
    doc = run_json(cli, "sample", "Hello", "-m", toy_model_dir, "-n", "2", "-p", "nucleus", "--set", "top_p=0.5",
                   "--set", "max-new-tokens=3", "--ignore-eos")
    assert doc["config"]["top_p"] == 0.5 and doc["config"]["temperature"] == 0.8
    assert len(doc["token_ids"]) == 3  # --set is applied last: it wins over the explicit -n
    doc = run_json(cli, "sample", "Hello", "-m", toy_model_dir, "-p", "nucleus", "-t", "0.3", "-n", "2",
                   "--ignore-eos")
    assert doc["config"]["temperature"] == 0.3 and len(doc["token_ids"]) == 2  # explicit options beat the preset


def test_preset_file(cli, toy_model_dir, tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('temperature = 0.0\nlogit_bias = {"0" = -1e9}\n')
    doc = run_json(cli, "sample", "Hi", "-m", toy_model_dir, "-n", "2", "-p", path)
    assert doc["selector"] == "greedy" and doc["config"]["logit_bias"] == {"0": -1e9}


@pytest.mark.parametrize("args,needle", [
    (["sample", "hi", "--top-p", "1.5"], "--top-p 1.5: must be in (0, 1]"),
    (["sample", "hi", "--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
    (["sample", "hi", "-t", "-1"], "--temperature -1.0: must be >= 0"),
    (["sample", "hi", "--top-k", "0"], "--top-k 0"),
    (["sample", "hi", "-p", "nope"], "--preset 'nope'"),
    (["sample", "hi", "--set", "warmth=3"], "unknown setting 'warmth'; allowed:"),
    (["sample", "hi", "--set", "top_p"], "expected KEY=VALUE"),
    (["sample", "hi", "--chain", "top-p,temperature", "-t", "0.5"], "--chain names 'top-p'"),
    (["sample", "hi", "--chain", ","], "--chain ',': names no stage"),
    (["sample", "hi", "-m", "/no/such/folder"], "--model /no/such/folder"),
    (["sample", "hi", "-m", "no-such-org/no-such-model"], "never downloads"),
    (["sample", "--top-p", "x", "hi"], "--top-p"),
    (["sample", "hi", "--device", "tpu"], "--device 'tpu'"),
    (["sample", "hi", "--logit-bias", "oops"], "expected TOKEN=BIAS"),
    (["sample"], "PROMPT: missing"),
])
def test_bad_input_is_one_line_and_exit_2(cli, args, needle):
    code, out, err = cli(*args)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and needle in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("args,needle", [
    (["sample", ""], "the prompt is empty"),
    (["sample", "word " * 80], "context is 64"),
    (["sample", "hi", "--logit-bias", "Hello world=2"], "tokens for"),
    (["sample", "hi", "--logit-bias", "99999=1"], "out of range"),
    (["sample", "hi", "--chat"], "no chat template"),
    (["sample", "hi", "-t", "0.5", "--logit-bias", "0=-inf", "--top-k", "1",
      "--chain", "temperature,top-k,bias"], "removed every candidate"),
])
def test_model_dependent_errors(cli, toy_model_dir, args, needle):
    code, _, err = cli(*args, "-m", toy_model_dir, "-n", "3")
    if needle == "removed every candidate":
        # top-k 1 keeps one token; banning exactly that token afterwards empties the chain (may not be token 0)
        code0, out0, _ = cli("probs", "hi", "-m", toy_model_dir, "--top-k", "1", "-f", "json")
        top = json.loads(out0)["stages"][-1]["top"][0]["token_id"]
        args = [a if a != "0=-inf" else f"{top}=-inf" for a in args]
        code, _, err = cli(*args, "-m", toy_model_dir, "-n", "3")
    assert code == 2 and err.count("\n") == 1 and needle in err, err


def test_debug_shows_the_traceback(cli):
    with pytest.raises(Exception):
        cli("sample", "hi", "--top-p", "2", "--debug")


def test_prompt_from_stdin_and_file(cli, toy_model_dir, tmp_path, monkeypatch):
    path = tmp_path / "p.txt"
    path.write_text("Once upon a time")
    a = run_json(cli, "sample", "--prompt-file", path, "-m", toy_model_dir, "-n", "2", "-t", "0")
    monkeypatch.setattr("sys.stdin", io.StringIO("Once upon a time"))
    b = run_json(cli, "sample", "-", "-m", toy_model_dir, "-n", "2", "-t", "0")
    assert a["prompt"]["token_ids"] == b["prompt"]["token_ids"] and a["token_ids"] == b["token_ids"]


def test_interrupted_jsonl_keeps_whole_lines_and_a_summary(cli, toy_model_dir, monkeypatch):
    import decodelab.core.methods.sample as decode

    real = decode.build_step
    calls = {"n": 0}

    def interrupt_on_third(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(decode, "build_step", interrupt_on_third)
    code, out, _ = cli("sample", "Hello", "-m", toy_model_dir, "-n", "10", "-f", "jsonl", "--ignore-eos")
    lines = [json.loads(line) for line in out.splitlines()]
    assert code == 130  # interrupted: the summary is printed, and the status says the run was cut short
    assert [x["type"] for x in lines] == ["step", "step", "summary"]
    assert lines[-1]["stop_reason"] == "interrupted" and lines[-1]["new_tokens"] == 2


def test_json_traces_in_blocks_and_gives_the_numbers_jsonl_streams(cli, toy_model_dir):
    """`-f json` traces its steps in blocks, `-f jsonl` one at a time: the same steps, number for number."""
    args = ("sample", "Hello", "-m", toy_model_dir, "-n", "12", "--ignore-eos", "-t", "0.9", "--top-p", "0.8",
            "--top-k", "30", "--seed", "4")
    doc = run_json(cli, *args)
    code, out, err = cli(*args, "-f", "jsonl")
    assert code == 0, err
    streamed = [{k: v for k, v in x.items() if k != "type"} for x in map(json.loads, out.splitlines())
                if x["type"] == "step"]
    assert len(doc["steps"]) == 12 and doc["steps"] == streamed


def test_interrupted_json_keeps_the_steps_of_its_pending_block(cli, toy_model_dir, monkeypatch):
    """Ctrl-C in the forward after the 5th token of a `-f json` run (its steps still pending in a block): the
    document holds all five steps, traced, and says the run was interrupted."""
    from decodelab.core.engine.runtime import Runtime

    real, fed = Runtime.feed, {"n": 0}

    def interrupt_after_five(self, ids, keep="last"):
        if ids.shape[1] == 1:
            fed["n"] += 1
            if fed["n"] == 5:
                raise KeyboardInterrupt
        return real(self, ids, keep)

    monkeypatch.setattr(Runtime, "feed", interrupt_after_five)
    code, out, _ = cli("sample", "Hello", "-m", toy_model_dir, "-n", "10", "-f", "json", "--ignore-eos")
    doc = json.loads(out)
    assert code == 130 and doc["summary"]["stop_reason"] == "interrupted"
    assert len(doc["steps"]) == 5 == doc["summary"]["new_tokens"] and doc["token_ids"] == [
        s["token_id"] for s in doc["steps"]]
    assert all(0 < s["prob"] <= 1 for s in doc["steps"])


def test_model_id_from_the_local_hf_cache(cli, toy_model_dir, tmp_path, monkeypatch):
    """A model already in the Hugging Face cache layout loads by id, offline."""
    snapshot = tmp_path / "hub" / "models--someorg--toy" / "snapshots" / ("0" * 40)
    shutil.copytree(toy_model_dir, snapshot)
    (tmp_path / "hub" / "models--someorg--toy" / "refs").mkdir()
    (tmp_path / "hub" / "models--someorg--toy" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("transformers.utils.hub.HF_HUB_CACHE", str(tmp_path / "hub"), raising=False)
    direct = run_json(cli, "sample", "Hi", "-m", toy_model_dir, "-n", "3", "-t", "0")
    cached = run_json(cli, "sample", "Hi", "-m", "someorg/toy", "-n", "3", "-t", "0")
    assert cached["model"] == "someorg/toy" and cached["token_ids"] == direct["token_ids"]


def test_pickle_weights_are_refused(cli, toy_model_dir, tmp_path):
    """safetensors only: a folder whose weights are a pickle (.bin) does not load."""
    import torch
    from safetensors.torch import load_file

    folder = tmp_path / "pickled"
    shutil.copytree(toy_model_dir, folder)
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    code, _, err = cli("sample", "Hi", "-m", folder, "-n", "2")
    assert code == 2 and "safetensors" in err and err.count("\n") == 1
