"""The new samplers through the CLI (`--format json`): llama.cpp's sampler test vectors as one-line `probs --dist`
commands, `--semantics hf` sampling equal to `generate(do_sample=True)`, `--export hf` fed to `generate`, stop ids,
trim-stop, the trace of stateful stages, and one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

from test_semantics import LLAMACPP_VECTORS, NEUTRAL


def run_json(cli, *args):
    code, out, err = cli(*args, "--format", "json")
    assert code == 0, err
    return json.loads(out)


def flags(fields: dict) -> list[str]:
    out = []
    for key, value in fields.items():
        option = "--" + key.replace("_", "-")
        for v in value if isinstance(value, tuple) else (value,):
            out += [option, str(v)]
    return out


@pytest.mark.parametrize("dist,history,fields,expected", LLAMACPP_VECTORS[::3],  # every third: the CLI path
                         ids=[f"{i}" for i in range(0, len(LLAMACPP_VECTORS), 3)])
def test_llamacpp_vectors_as_one_line_commands(cli, dist, history, fields, expected):
    args = ["probs", "--dist", dist, "--semantics", "llamacpp"] + flags({**NEUTRAL, **fields})
    if history:
        args += ["--history", ",".join(map(str, history))]
    doc = run_json(cli, *args)
    assert doc["model"] is None and doc["probs"] == pytest.approx(expected, abs=1e-5)
    assert doc["semantics"]["engine"] == "llamacpp"


def test_dry_vector_and_stage_trace(cli):
    doc = run_json(cli, "probs", "--dist", "0.25,0.25,0.25,0.25", "--history", "0,1,2,0,1", "--semantics",
                   "llamacpp", "--top-k", "0", "--top-p", "1", "--min-p", "0", "-t", "1", "--dry-multiplier", "1",
                   "--dry-base", "1.1", "--dry-allowed-length", "2", "--dry-penalty-last-n", "5")
    assert doc["chain"] == ["dry"] and doc["given"]["history"] == [0, 1, 2, 0, 1]
    assert doc["probs"] == pytest.approx([0.296923, 0.296923, 0.109232, 0.296923], abs=1e-5)
    assert [s["name"] for s in doc["stages"]] == ["raw", "dry"] and doc["stages"][1]["kept"] == 4


def test_probs_logits_file_and_xtc_coin(cli, tmp_path):
    path = tmp_path / "z.txt"
    path.write_text("0.4 0.3\n0.2 0.1\n")
    doc = run_json(cli, "probs", "--logits-file", path, "--xtc-probability", "1", "--xtc-threshold", "0.2")
    assert doc["chain"] == ["xtc"] and 0 <= doc["state"]["xtc.coin"] < 1
    z = torch.tensor([0.4, 0.3, 0.2, 0.1])
    p = torch.softmax(z, 0)
    reach = int((p >= 0.2).sum())
    assert sum(x > 0 for x in doc["probs"]) == 4 - (reach - 1)  # the reach - 1 most likely went


@pytest.mark.parametrize("args,message", [
    (["probs", "--dist", "0.5,x"], "--dist 'x'"),
    (["probs", "hello", "--dist", "0.5,0.5"], "PROMPT: not used with --dist"),
    (["probs", "--dist", "0.5,0.5", "--history", "0,9"], "--history 9"),
    (["probs", "--dist", "0.5,0.5", "--xtc-probability", "0.5", "--xtc-threshold", "3"], "--xtc-threshold 3.0"),
    (["probs", "--dist", "0.5,0.5", "--semantics", "tgi"], "--semantics 'tgi'"),
    (["probs", "--dist", "0.5,0.5", "--ban", "two words"], "--ban 'two words'"),
    (["probs", "--dist", "0.5,0.5", "--export", "tgi"], "--export 'tgi'"),
    (["sample", "hi", "--mirostat-eta", "0"], "--mirostat-eta 0.0"),
])
def test_bad_input_is_one_line(cli, args, message):
    code, out, err = cli(*args)
    assert code == 2 and message in err and err.count("\n") == 1


def test_sample_semantics_hf_equals_generate_do_sample(cli, toy_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_model_dir)
    model = AutoModelForCausalLM.from_pretrained(toy_model_dir).eval()
    outputs = []
    for seed in (0, 5):
        doc = run_json(cli, "sample", "Once upon a time", "-m", toy_model_dir, "-n", "8", "--semantics", "hf",
                       "-t", "1.5", "--top-p", "0.98", "--seed", str(seed), "--ignore-eos")
        assert doc["selector"] == "hf-multinomial" and doc["chain"] == ["temperature", "top-k", "top-p"]
        ids = torch.tensor([doc["prompt"]["token_ids"]])
        torch.manual_seed(seed)
        ref = model.generate(ids, do_sample=True, temperature=1.5, top_p=0.98, max_new_tokens=8, min_new_tokens=8,
                             pad_token_id=tok.eos_token_id)
        assert doc["token_ids"] == ref[0, ids.shape[1]:].tolist()
        outputs.append(doc["token_ids"])
    assert outputs[0] != outputs[1]  # really drawn: the seeds give different texts


def test_export_hf_reproduces_greedy_sample(cli, capsys, toy_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(toy_model_dir).eval()
    args = ["Once upon a time", "-m", toy_model_dir, "-n", "10", "-t", "0", "--repetition-penalty", "1.4",
            "--no-repeat-ngram", "2", "--logit-bias", "5=-inf", "--ignore-eos"]
    doc = run_json(cli, "sample", *args)
    code, out, err = cli("sample", *args, "--export", "hf")
    assert code == 0
    kwargs = json.loads(out)
    assert kwargs["bad_words_ids"] == [[5]] and kwargs["min_new_tokens"] == 10
    ids = torch.tensor([doc["prompt"]["token_ids"]])
    ref = model.generate(ids, pad_token_id=0, **kwargs)
    assert doc["token_ids"] == ref[0, ids.shape[1]:].tolist()


def test_export_lists_what_has_no_equivalent(cli):
    code, out, err = cli("probs", "--dist", "0.5,0.5", "-t", "0.7", "--dry-multiplier", "0.8", "--export", "vllm")
    assert code == 0 and json.loads(out)["temperature"] == 0.7 and "# no equivalent: dry" in err
    doc = run_json(cli, "probs", "--dist", "0.5,0.5", "--top-k", "1", "--export", "llamacpp")
    assert doc["command"].startswith("llama-cli --temp 1 --top-k 1")


def test_stop_id_trim_stop_and_mirostat_trace(cli, toy_model_dir):
    base = ["sample", "Once upon a time", "-m", toy_model_dir, "-n", "6", "-t", "0", "--ignore-eos"]
    free = run_json(cli, *base)["token_ids"]
    stop = free[2]
    doc = run_json(cli, *base, "--stop-id", str(stop))
    assert doc["token_ids"] == free[: free.index(stop) + 1] and doc["summary"]["stop_reason"] == "stop"
    trimmed = run_json(cli, *base, "--stop-id", str(stop), "--trim-stop")
    assert trimmed["token_ids"] == free[: free.index(stop)]
    doc = run_json(cli, "sample", "Once upon a time", "-m", toy_model_dir, "-n", "4", "--mirostat-tau", "2",
                   "--ignore-eos")
    assert doc["chain"] == ["mirostat"] and doc["steps"][0]["state"] == {"mirostat.mu": 4.0}
    code, _, err = cli("speculate", "Once", "-m", toy_model_dir, "--draft", "ngram", "--mirostat-tau", "2")
    assert code == 2 and "--mirostat-tau/--mirostat-eta" in err


@pytest.mark.parametrize("command,args", [
    ("sample", ["sample", "Once upon", "-n", "3", "--semantics", "llamacpp", "--mirostat-tau", "3",
                "--dynatemp-range", "0.2", "--penalty-last-n", "4", "--presence-penalty", "0.5"]),
    ("probs", ["probs", "--dist", "0.1,0.2,0.7", "--history", "1", "--semantics", "vllm", "--presence-penalty",
               "0.5", "--xtc-probability", "1"]),
])
def test_json_docs_document_the_new_json_fields(cli, toy_model_dir, command, args):
    """What --semantics and the no-model path add to the JSON is in docs/json.md's tables (test_json_docs's check,
    on runs that print the optional fields)."""
    from test_json_docs import documented, fields

    table = documented()[command]
    wild = frozenset(p for p, f in table if f == "*")
    extra = ["-m", toy_model_dir] if command == "sample" else []
    printed = fields(run_json(cli, *args, *extra), wild=wild)
    listed = {(p, f) for p, f in table if f != "*"}
    assert not printed - listed - {(p, f) for p, f in printed if p in wild}
    assert {("top", "semantics"), ("semantics", "notes")} <= printed
