"""A chain that leaves no candidate mid-run (issue 13 item 1): every command that streams JSONL still ends its stream
with the summary line, stop_reason "empty_chain", after the steps produced; the error goes to stderr as one line and
the exit status is 2 (bad settings, as when the chain empties at the first step). Table, JSON, markdown and CSV print
what was produced too, like a Ctrl-C."""

from __future__ import annotations

import json

import pytest

# top-k 1 keeps only the best token, then a 1-gram ban removes it as soon as it was already generated: the chain
# empties at the first repeated greedy pick (the toy model repeats within a few tokens)
EMPTIES = ["-t", "0.5", "--top-k", "1", "--no-repeat-ngram", "1", "--chain", "temperature,top-k,no-repeat-ngram"]
MESSAGE = "removed every candidate token"


def lines_of(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines()]


def run_jsonl(cli, *args) -> list[dict]:
    code, out, err = cli(*args, "-f", "jsonl")
    assert code == 2, (code, err)
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    lines = lines_of(out)
    assert lines[-1]["type"] == "summary" and sum(x["type"] == "summary" for x in lines) == 1
    return lines


@pytest.mark.parametrize("command, extra", [("sample", []), ("stream", []),
                                             ("speculate", ["--draft", "ngram", "--speedup-rounds", "1"])])
def test_a_run_whose_chain_empties_ends_its_stream_with_the_summary(cli, toy_model_dir, command, extra):
    lines = run_jsonl(cli, command, "Once upon", "-m", toy_model_dir, "-n", "30", *EMPTIES, *extra)
    summary = lines[-1]
    steps = [x for x in lines if x["type"] == "step"]
    assert summary["stop_reason"] == "empty_chain"
    assert steps and 0 < len(summary["token_ids"]) < 30  # steps came before the chain emptied
    emitted = [t for s in steps for t in (s["emitted"]["token_ids"] if command == "speculate" else [s["token_id"]])]
    assert emitted == summary["token_ids"]


def test_every_format_prints_what_was_produced_then_the_error(cli, toy_model_dir):
    code, out, err = cli("sample", "Once upon", "-m", toy_model_dir, "-n", "30", *EMPTIES, "-f", "json")
    assert code == 2 and MESSAGE in err and err.count("\n") == 1
    doc = json.loads(out)
    assert doc["summary"]["stop_reason"] == "empty_chain" and len(doc["steps"]) == len(doc["token_ids"]) > 0


def test_beam_whose_chain_empties_mid_search(cli, toy_model_dir, monkeypatch):
    """A beam chain (penalties and biases on log-probabilities) hardly empties from the command line: the error is
    raised where the search raises it, at its third step."""
    import decodelab.core.methods.beam as beam
    from decodelab.core.sampling.chain import empty_chain_error

    real, calls = beam.BeamSearch._to_host, {"n": 0}

    def third(self, *args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise empty_chain_error(self.chain.names)
        return real(self, *args)

    monkeypatch.setattr(beam.BeamSearch, "_to_host", third)
    lines = run_jsonl(cli, "beam", "Once upon", "-m", toy_model_dir, "-n", "8", "--beams", "2", "--ignore-eos",
                      "--sweep-length-penalty", "0,1")
    assert [x["type"] for x in lines] == ["step", "step", "summary"]
    assert lines[-1]["stop_reason"] == "empty_chain" and "sweep" not in lines[-1]  # later phases skipped


def test_compare_keeps_the_other_rows(cli, toy_model_dir):
    lines = run_jsonl(cli, "compare", "Once upon", "-m", toy_model_dir, "-n", "30", "-V", "g: temperature=0",
                      "-V", "e: temperature=0.5,top_k=1,no_repeat_ngram=1,chain=temperature,top-k,no-repeat-ngram")
    rows = {x["variant"]: x for x in lines if x["type"] == "row"}
    assert rows["g"]["stop_reason"] != "empty_chain" and rows["g"]["length"] == 30
    assert rows["e"]["stop_reason"] == "empty_chain" and 0 < rows["e"]["length"] < 30
    pair = next(x for x in lines if x["type"] == "pair")
    assert pair["deciding_stage"] == "stop"


def test_batch_serves_the_other_requests(cli, toy_model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Once upon", "id": "bad", "temperature": 0.5, "top_k": 1,
                                   "no_repeat_ngram": 1, "chain": "temperature,top-k,no-repeat-ngram"}) + "\n"
                       + json.dumps({"prompt": "A dog", "id": "good"}) + "\n")
    code, out, err = cli("batch", "--prompts-file", prompts, "-m", toy_model_dir, "-n", "30", "--ignore-eos",
                         "-f", "jsonl")
    assert code == 2 and "request bad" in err and err.count("\n") == 1, err
    lines = lines_of(out)
    assert lines[-1]["type"] == "summary"
    requests = {x["id"]: x for x in lines if x["type"] == "request"}
    assert requests["bad"]["stop_reason"] == "empty_chain" and 0 < len(requests["bad"]["token_ids"]) < 30
    assert requests["good"]["stop_reason"] == "length" and len(requests["good"]["token_ids"]) == 30
