"""Ctrl-C in every phase of every command that runs: whole JSON lines, a summary, stop_reason "interrupted" where a
run was cut, and exit status 130. The interrupt is raised from inside the phase (a patched function), exactly where
a SIGINT would surface as KeyboardInterrupt."""

from __future__ import annotations

import json

import pytest


def raise_on_call(monkeypatch, owner, name: str, nth: int) -> None:
    """Make owner.name raise KeyboardInterrupt on its nth call (earlier calls run as usual)."""
    real = getattr(owner, name)
    calls = {"n": 0}

    def patched(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == nth:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, patched)


def lines_of(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines()]  # every line whole: json.loads would fail on a cut one


def run_jsonl(cli, *args):
    code, out, err = cli(*args, "-f", "jsonl")
    assert code == 130, (code, err)
    assert err.strip().endswith("interrupted") and "Traceback" not in err
    return lines_of(out)


def test_sample_loop(cli, toy_model_dir, monkeypatch):
    import decodelab.core.methods.sample as decode

    raise_on_call(monkeypatch, decode, "build_step", 3)
    lines = run_jsonl(cli, "sample", "Hello", "-m", toy_model_dir, "-n", "10", "--ignore-eos")
    assert [x["type"] for x in lines] == ["step", "step", "summary"]
    assert lines[-1]["stop_reason"] == "interrupted" and lines[-1]["new_tokens"] == 2


def test_beam_loop(cli, toy_model_dir, monkeypatch):
    from decodelab.core.methods.beam import BeamSearch

    raise_on_call(monkeypatch, BeamSearch, "_select", 3)
    lines = run_jsonl(cli, "beam", "Hello", "-m", toy_model_dir, "-n", "8", "--beams", "2", "--ignore-eos")
    assert lines[-1]["type"] == "summary" and lines[-1]["stop_reason"] == "interrupted"


def test_beam_sweep(cli, toy_model_dir, monkeypatch):
    import decodelab.core.methods.beam as beam  # the command imports it when it runs

    raise_on_call(monkeypatch, beam, "sweep_length_penalty", 1)
    lines = run_jsonl(cli, "beam", "Hello", "-m", toy_model_dir, "-n", "4", "--beams", "2",
                      "--sweep-length-penalty", "0,1")
    assert lines[-1]["type"] == "summary" and lines[-1]["hypotheses"]  # the search itself finished


def test_speculate_loop(cli, toy_model_dir, monkeypatch):
    from decodelab.core.methods.speculative.run import Speculator

    real, calls = Speculator.build_round, {"n": 0}

    def third_traced_round(self, outcome):
        calls["n"] += self.record  # the warm-up run is untraced
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(self, outcome)

    monkeypatch.setattr(Speculator, "build_round", third_traced_round)
    lines = run_jsonl(cli, "speculate", "a b c a b c a b", "-m", toy_model_dir, "--draft", "ngram", "-n", "20",
                      "--ignore-eos", "-t", "0")
    assert [x["type"] for x in lines] == ["step", "step", "summary"]
    assert lines[-1]["stop_reason"] == "interrupted" and lines[-1]["measured_speedup"] is None


def test_speculate_warm_up(cli, toy_model_dir, monkeypatch):
    import decodelab.core.methods.speculative.run as build  # the command imports it when it runs

    raise_on_call(monkeypatch, build, "warm_up_speculate", 1)
    lines = run_jsonl(cli, "speculate", "Hello", "-m", toy_model_dir, "--draft", "ngram", "-n", "4")
    assert [x["type"] for x in lines] == ["summary"] and lines[0]["stop_reason"] == "interrupted"


def test_speculate_baseline_cut_without_a_sweep(cli, toy_model_dir, monkeypatch):
    """One timing round: plain_baseline's call 1 is the shown run's reference; cutting it leaves the run whole and
    the speedup unmeasured."""
    import decodelab.core.methods.speculative.run as build

    raise_on_call(monkeypatch, build, "plain_baseline", 1)
    lines = run_jsonl(cli, "speculate", "Hello", "-m", toy_model_dir, "--draft", "ngram", "-n", "4",
                      "--ignore-eos", "--speedup-rounds", "1")
    assert lines[-1]["type"] == "summary" and lines[-1]["new_tokens"] == 4
    assert lines[-1]["stop_reason"] == "length"  # the run itself was complete; the reference was cut
    assert lines[-1]["measured_speedup"] is None


@pytest.mark.parametrize("nth, sweep_rows", [(1, 0), (2, 1)])
def test_speculate_baseline_cut_in_the_sweep(cli, toy_model_dir, monkeypatch, nth, sweep_rows):
    """With --sweep-gamma 1,2 and one round each the sweep runs first: plain_baseline's call 1 is gamma 1's
    reference, call 2 gamma 2's. A cut keeps the rows measured; the shown run had not started (interrupted, no
    tokens) and its speedup is the best measured gamma's, or none."""
    import decodelab.core.methods.speculative.run as build

    raise_on_call(monkeypatch, build, "plain_baseline", nth)
    lines = run_jsonl(cli, "speculate", "Hello", "-m", toy_model_dir, "--draft", "ngram", "-n", "4",
                      "--ignore-eos", "--sweep-gamma", "1,2", "--speedup-rounds", "1")
    assert lines[-1]["type"] == "summary" and lines[-1]["new_tokens"] == 0
    assert lines[-1]["stop_reason"] == "interrupted"
    assert sum(x["type"] == "sweep" for x in lines) == sweep_rows
    assert (lines[-1]["measured_speedup"] is None) == (sweep_rows == 0)


# SpeedupRounds.plain / .speculative calls without a sweep: the shown run is round 1's speculative half, so plain
# call 1 is round 1's reference, calls 2-3 rounds 2 (plain first) and 3 (plain second); speculative calls 1-2 the
# speculative halves of rounds 2 and 3.
@pytest.mark.parametrize("method, nth, main_rounds", [
    ("plain", 1, 0),  # round 1's reference cut: no speedup at all
    ("plain", 2, 1),  # round 2 (plain first) cut: round 1 kept
    ("plain", 3, 2),  # round 3 (plain second) cut
    ("speculative", 1, 1),  # round 2's speculative half cut after its plain half
    ("speculative", 2, 2),
])
def test_speculate_timing_rounds(cli, toy_model_dir, monkeypatch, method, nth, main_rounds):
    from decodelab.core.methods.speculative.run import SpeedupRounds

    raise_on_call(monkeypatch, SpeedupRounds, method, nth)
    lines = run_jsonl(cli, "speculate", "Hello", "-m", toy_model_dir, "--draft", "ngram", "-n", "4",
                      "--ignore-eos", "--speedup-rounds", "3")
    summary = lines[-1]
    assert summary["type"] == "summary" and summary["new_tokens"] == 4
    assert summary["stop_reason"] == "length"  # the shown run was complete; its timing was cut
    assert summary["speedup_rounds"] == main_rounds
    assert (summary["measured_speedup"] is None) == (main_rounds == 0)


# With --sweep-gamma 1,2 the sweep runs first (then the best gamma's run is shown): gamma 1's rounds are
# speculative 1 + plain 1, plain 2 + speculative 2, speculative 3 + plain 3; gamma 2's 4-6 alike.
@pytest.mark.parametrize("method, nth, sweep_rounds", [
    ("plain", 1, []),  # gamma 1 cut in its first round: no row for it, gamma 2 never runs
    ("plain", 2, [1]),  # gamma 1 cut in round 2: its row keeps round 1
    ("speculative", 3, [2]),
    ("plain", 4, [3]),  # gamma 2 cut in its first round: no row for it
    ("plain", 5, [3, 1]),
])
def test_speculate_sweep_rounds(cli, toy_model_dir, monkeypatch, method, nth, sweep_rounds):
    """A Ctrl-C in the sweep keeps its whole rounds; the shown run had not started, so it is reported as interrupted
    with no tokens, and its speedup is the sweep's own figure for the best gamma measured (if any)."""
    from decodelab.core.methods.speculative.run import SpeedupRounds

    raise_on_call(monkeypatch, SpeedupRounds, method, nth)
    lines = run_jsonl(cli, "speculate", "Hello", "-m", toy_model_dir, "--draft", "ngram", "-n", "4",
                      "--ignore-eos", "--sweep-gamma", "1,2", "--speedup-rounds", "3")
    summary = lines[-1]
    assert summary["type"] == "summary" and summary["stop_reason"] == "interrupted" and summary["new_tokens"] == 0
    assert [x["speedup_rounds"] for x in lines if x["type"] == "sweep"] == sweep_rounds
    assert ("best_gamma" in summary) == bool(sweep_rounds)


def test_score_loop(cli, toy_model_dir, monkeypatch):
    from decodelab.core.methods.score import Scorer

    raise_on_call(monkeypatch, Scorer, "_block", 2)
    code, out, err = cli("score", "one two three four five six seven eight nine ten", "-m", toy_model_dir,
                         "--feed", "3", "-f", "jsonl")
    assert code == 130, err
    lines = lines_of(out)
    assert lines[-1]["type"] == "summary" and lines[-1]["stop_reason"] == "interrupted"


def test_an_interrupt_while_loading_is_a_clean_130(cli, toy_model_dir, monkeypatch):
    import decodelab.cli.pipeline as pipeline

    raise_on_call(monkeypatch, pipeline, "load_model", 1)
    code, out, err = cli("probs", "Hello", "-m", toy_model_dir, "-f", "json")
    assert code == 130 and out == "" and err == "interrupted\n"


def cut_iteration(monkeypatch, cls, after: int) -> None:
    """cls's iterator raises KeyboardInterrupt once it has yielded ``after`` items, as a SIGINT between them would."""
    real = cls.__iter__

    def cut(self):
        for k, item in enumerate(real(self)):
            if k == after:
                raise KeyboardInterrupt
            yield item

    monkeypatch.setattr(cls, "__iter__", cut)


def test_batch_loop(cli, toy_model_dir, tmp_path, monkeypatch):
    from decodelab.core.methods.batch.scheduler import Scheduler

    prompts = tmp_path / "p.txt"
    prompts.write_text("one two\nthree four five\nsix\n")
    raise_on_call(monkeypatch, Scheduler, "_forward", 5)  # the warm-up's 2 forwards, the run's 2, then a cut
    lines = run_jsonl(cli, "batch", "--prompts-file", prompts, "-m", toy_model_dir, "-n", "6", "--ignore-eos",
                      "--max-batch", "2")
    kinds = [x["type"] for x in lines]
    assert kinds == ["iteration", "iteration", "request", "request", "request", "summary"]
    summary, requests = lines[-1], lines[2:5]
    assert summary["stop_reason"] == "interrupted" and summary["iterations"] == 2
    assert "static_tokens_per_s" not in summary  # the baselines did not run
    assert [r["stop_reason"] for r in requests] == ["interrupted"] * 3  # two cut running, one never admitted
    assert [len(r["token_ids"]) for r in requests] == [2, 2, 0]  # prefill + a token, then one more; the third waits
    assert summary["tokens"] == 4


def test_batch_baseline(cli, toy_model_dir, tmp_path, monkeypatch):
    import decodelab.core.methods.batch.run as batch

    prompts = tmp_path / "p.txt"
    prompts.write_text("one two\nthree four five\n")
    raise_on_call(monkeypatch, batch, "static_baseline", 1)
    lines = run_jsonl(cli, "batch", "--prompts-file", prompts, "-m", toy_model_dir, "-n", "3", "--ignore-eos",
                      "--baselines", "static")
    summary = lines[-1]
    assert summary["type"] == "summary" and summary["stop_reason"] == "end" and summary["tokens"] == 6
    assert "static_tokens_per_s" not in summary


def test_compare_rows(cli, toy_model_dir, monkeypatch):
    from decodelab.core.analysis.compare import Comparison

    raise_on_call(monkeypatch, Comparison, "run_one", 3)
    code, out, err = cli("compare", "Hello", "-m", toy_model_dir, "-V", "a: temperature=0", "-V",
                         "b: temperature=1", "--seeds", "0-1", "-n", "3", "-f", "jsonl")
    assert code == 130 and err.strip().endswith("interrupted") and "Traceback" not in err
    lines = lines_of(out)
    assert [x["type"] for x in lines if x["type"] == "row"] == ["row", "row"]  # the two rows before the cut
    assert lines[-1]["type"] == "summary"


def test_stream_score(cli, toy_model_dir, tmp_path, monkeypatch):
    from decodelab.core.methods.stream import StreamScore

    text = tmp_path / "t.txt"
    text.write_text("one two three four five six seven eight nine ten eleven")
    cut_iteration(monkeypatch, StreamScore, 1)
    code, out, err = cli("stream", "--text-file", text, "-m", toy_model_dir, "--chunk", "4", "--cache",
                         "window:size=8", "-f", "jsonl")
    assert code == 130, err
    lines = lines_of(out)
    assert [x["type"] for x in lines] == ["step", "summary"] and lines[-1]["stop_reason"] == "interrupted"


def test_bench_keeps_whole_rounds(cli, toy_model_dir, monkeypatch):
    from decodelab.core.analysis.bench import Bench

    real = Bench.time

    def half_round(self, rounds, on_round=None):
        last = list(self.runs)[-1]
        fn, calls = self.runs[last], {"n": 0}

        def counted():
            calls["n"] += 1
            if calls["n"] == 3:  # the check, round 0, then half of round 1
                raise KeyboardInterrupt
            return fn()

        self.runs[last] = counted
        return real(self, rounds, on_round)

    monkeypatch.setattr(Bench, "time", half_round)
    code, out, err = cli("bench", "-m", toy_model_dir, "--settings", "greedy", "-n", "2", "--rounds", "3",
                         "-f", "json")
    assert code == 130, err
    doc = json.loads(out)
    assert doc["stop_reason"] == "interrupted" and doc["rows"]
    assert {r["rounds"] for r in doc["rows"]} == {1}  # round 1 was cut half-way: only round 0 is kept


def test_quantize_kv_grid(cli, toy_model_dir, monkeypatch):
    import decodelab.core.analysis.quantize_kv as qkv

    raise_on_call(monkeypatch, qkv, "fidelity", 3)  # the main fidelity, grid cell 1, then cut in cell 2
    code, out, err = cli("quantize-kv", "The quick brown fox jumps over the lazy dog. " * 2, "-m", toy_model_dir,
                         "--grid", "-f", "json")
    assert code == 130, err
    doc = json.loads(out)
    assert doc["summary"]["stop_reason"] == "interrupted" and len(doc["grid"]) == 1


@pytest.mark.parametrize("fmt", ["json", "jsonl"])
def test_quantize_kv_main_pass_keeps_what_it_scored(cli, toy_model_dir, monkeypatch, fmt):
    """A Ctrl-C in the main fidelity run (it used to print nothing): the tokens scored so far are reported, the
    grid is not started, and the status says the run was cut short."""
    from decodelab.core.methods.score import Scorer

    raise_on_call(monkeypatch, Scorer, "_block", 4)  # --feed 1: a block a token; the 4th is cut
    code, out, err = cli("quantize-kv", "The quick brown fox jumps over the lazy dog. " * 2, "-m", toy_model_dir,
                         "--grid", "--feed", "1", "-f", fmt)
    assert code == 130, err
    summary = lines_of(out)[-1] if fmt == "jsonl" else json.loads(out)["summary"]
    assert summary["stop_reason"] == "interrupted" and summary["tokens"] == 3
    assert summary["kl_mean"] is not None and summary["kv_bytes"] > 0
    if fmt == "json":
        doc = json.loads(out)
        assert len(doc["steps"]) == 3 and doc["grid"] == []
    else:
        assert [x["type"] for x in lines_of(out)] == ["step"] * 3 + ["summary"]


def test_quantize_kv_interrupted_before_any_token(cli, toy_model_dir, monkeypatch):
    from decodelab.core.methods.score import Scorer

    raise_on_call(monkeypatch, Scorer, "_block", 1)
    code, out, err = cli("quantize-kv", "The quick brown fox", "-m", toy_model_dir, "--feed", "1", "-f", "json")
    assert code == 130, err
    summary = json.loads(out)["summary"]
    assert summary["stop_reason"] == "interrupted" and summary["tokens"] == 0


def test_compare_json_says_it_was_cut(cli, toy_model_dir, monkeypatch):
    """Issue 40: a Ctrl-C'd `compare -f json` printed its rows with nothing saying the comparison was cut. The
    summary says interrupted, the rows planned (2 variants x 2 seeds) and run (2, before the third call was cut); a
    whole run says end."""
    import json

    from decodelab.core.analysis.compare import Comparison

    args = ("compare", "Hello", "-m", toy_model_dir, "-V", "a: temperature=0", "-V", "b: temperature=1", "--seeds",
            "0-1", "-n", "3", "-f", "json")
    whole = json.loads(cli(*args)[1])["summary"]
    assert (whole["stop_reason"], whole["rows_planned"], whole["rows_run"]) == ("end", 4, 4)
    raise_on_call(monkeypatch, Comparison, "run_one", 3)
    code, out, err = cli(*args)
    assert code == 130 and err.strip().endswith("interrupted")
    doc = json.loads(out)
    assert len(doc["rows"]) == 2
    assert (doc["summary"]["stop_reason"], doc["summary"]["rows_planned"], doc["summary"]["rows_run"]) == \
        ("interrupted", 4, 2)
