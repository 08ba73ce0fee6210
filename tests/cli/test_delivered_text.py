"""The run delivers the text after stop handling: with ``trim_stop`` (or an engine semantics that trims, vLLM's and
llama.cpp's) the stop string or stop id is left out of the text of every method, as `sample --trim-stop` does, and
the ``config`` says what was done."""

from __future__ import annotations

import json

import pytest

COMMANDS = {
    "sample": [],
    "stream": [],
    "speculate": ["--draft", "ngram", "--speedup-rounds", "1"],
}


def run_json(cli, *args) -> dict:
    code, out, err = cli(*args, "--format", "json", "--threads", "1")
    assert code == 0, err
    return json.loads(out)


def generate(cli, model, command: str, *extra) -> dict:
    return run_json(cli, command, "Once upon", "-m", model, "-n", "12", "-t", "0", "--ignore-eos",
                    *COMMANDS[command], *extra)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_stop_string_is_trimmed_from_every_methods_text(cli, toy_model_dir, command):
    free = generate(cli, toy_model_dir, command)
    text = free["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop and stop in text
    want = text[: text.find(stop)]
    kept = generate(cli, toy_model_dir, command, "--stop", stop)
    assert kept["summary"]["stop_reason"] == "stop" and kept["text"].startswith(want + stop)  # the control: untrimmed
    for trim in (["--set", "trim_stop=true"], ["--set", "semantics=vllm"]):  # vLLM trims by default
        doc = generate(cli, toy_model_dir, command, "--stop", stop, *trim)
        assert doc["text"] == want, trim
        assert doc["token_ids"] == kept["token_ids"]  # a stop string may end inside a token: the ids stay
    doc = generate(cli, toy_model_dir, command, "--stop", stop, "--set", "semantics=vllm", "--set", "trim_stop=false")
    assert doc["text"] == kept["text"]  # the setting overrides the engine's default


@pytest.mark.parametrize("command", ["sample", "speculate"])
def test_a_stop_id_is_dropped_from_ids_and_text(cli, toy_model_dir, command):
    free = generate(cli, toy_model_dir, command)
    stop = free["token_ids"][5]
    upto = free["token_ids"].index(stop)
    doc = generate(cli, toy_model_dir, command, "--stop-id", str(stop), "--set", "trim_stop=true")
    assert doc["token_ids"] == free["token_ids"][:upto]
    assert doc["config"]["trim_stop"] is True


def test_sample_n_rows_deliver_as_the_single_runs(cli, toy_model_dir):
    """Each row of `sample -N` is the text `sample --seed seed+i` delivers, trimmed alike."""
    stop = generate(cli, toy_model_dir, "sample", "-t", "0.9", "--seed", "7")["token_ids"][3]
    args = ["-t", "0.9", "--stop-id", str(stop), "--trim-stop", "--seed", "7"]
    rows = generate(cli, toy_model_dir, "sample", *args, "-N", "2", "--cache", "static")["samples"]
    singles = [generate(cli, toy_model_dir, "sample", *args[:-1], str(7 + i)) for i in range(2)]
    assert [(r["token_ids"], r["text"]) for r in rows] == [(s["token_ids"], s["text"]) for s in singles]
    assert stop not in rows[0]["token_ids"] and rows[0]["length"] == len(rows[0]["token_ids"]) + 1


def test_batch_requests_deliver_as_sample_does(cli, toy_model_dir, tmp_path):
    """A request of `batch` whose settings trim (its own trim_stop, or --semantics vllm) delivers the text
    `sample` delivers with the same settings; one that does not keeps the stop text."""
    free = generate(cli, toy_model_dir, "sample")["text"]
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    lines = [{"id": "trim", "prompt": "Once upon", "trim_stop": True}, {"id": "keep", "prompt": "Once upon"},
             {"id": "vllm", "prompt": "Once upon", "semantics": "vllm"}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    doc = run_json(cli, "batch", "--prompts-file", path, "-m", toy_model_dir, "-n", "12", "-t", "0", "--ignore-eos",
                   "--stop", stop, "--baselines", "none")
    texts = {r["id"]: r["text"] for r in doc["requests"]}
    assert texts["trim"] == texts["vllm"] == free[: free.find(stop)]
    assert texts["keep"].startswith(free[: free.find(stop)] + stop)
