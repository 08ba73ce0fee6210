"""The one output path: every format written whole, and write faults as one line (a full disk, a closed stdout), a
reader that leaves quietly (141), a second Ctrl-C during the summary as a quiet 130."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from decodelab.cli.view import output, render

DECODELAB = [sys.executable, "-m", "decodelab.cli.main"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run_shell(script: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=timeout, env=ENV)


def cmd(*args: str) -> str:
    return " ".join([sys.executable, "-m", "decodelab.cli.main", *args])


def test_every_format_goes_through_one_emit(capsys):
    out = output.Output(document={"command": "x", "n": 1}, jsonl=[{"type": "summary", "n": 1}],
                        tables=[("first", [{"a": 1}]), (None, [{"b": 2}])], csv=[{"c": 3}])
    output.emit(out, "json")
    assert json.loads(capsys.readouterr().out) == {"command": "x", "n": 1, "format_version": 1,
                                                   "versions": output.versions()}
    output.emit(out, "jsonl")
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == [{"type": "summary", "n": 1}]
    output.emit(out, "markdown")
    md = capsys.readouterr().out
    assert md.startswith("### first\n\n| ") and "| b |" in md.replace("|   b |", "| b |") or "b" in md.split("\n\n")[-1]
    output.emit(out, "csv")
    assert capsys.readouterr().out == "c\n3\n"  # the csv table, not the first markdown one


def test_summary_record_merges_parts_in_order():
    line = output.summary_record("sample", "tiny", {"text": "a", "x": float("nan")}, {"x": 2})
    assert line == {"type": "summary", "command": "sample", "model": "tiny", "text": "a", "x": 2,
                    "versions": output.versions()}
    assert set(output.versions()) == {"decodelab", "torch", "transformers"} and output.versions()["torch"]


def test_a_failed_write_to_a_file_cuts_it_back_to_the_last_whole_record(tmp_path, monkeypatch):
    path = tmp_path / "out.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        monkeypatch.setattr(sys, "stdout", f)
        render.write_record('{"a": 1}\n')
        real, calls = os.write, {"n": 0}

        def half_then_full(fd, data):  # the disk fills halfway through the second record
            calls["n"] += 1
            if calls["n"] == 1:
                return real(fd, bytes(data[:4]))
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "write", half_then_full)
        with pytest.raises(render.OutputError, match="No space left on device"):
            render.write_record('{"b": 2}\n')
    assert path.read_text(encoding="utf-8") == '{"a": 1}\n'


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("fmt", ["json", "jsonl", "table", "csv"])
def test_a_full_device_is_one_line_and_exit_1(fmt):
    r = run_shell(cmd("models", "-f", fmt) + " > /dev/full")
    assert r.returncode == 1, r
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: writing the output") and "Traceback" not in r.stderr


def test_a_closed_stdout_is_one_line_and_exit_1():
    r = run_shell(cmd("models", "-f", "json") + " >&-")
    assert r.returncode == 1, r
    assert r.stderr.startswith("error: stdout is closed") and r.stderr.count("\n") == 1


def test_a_reader_that_leaves_ends_the_run_quietly(toy_model_dir):
    r = run_shell("set -o pipefail; " + cmd("sample", "Once", "-m", str(toy_model_dir), "-n", "40", "--ignore-eos",
                                            "-f", "jsonl") + " | head -1; echo \"status=${PIPESTATUS[0]}\"")
    first, status = r.stdout.splitlines()
    assert json.loads(first)["type"] == "step"
    assert status == "status=141" and r.stderr == "", r.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash's ulimit")
def test_a_disk_that_fills_during_jsonl_keeps_every_whole_line(toy_model_dir, tmp_path):
    out = tmp_path / "steps.jsonl"  # ulimit -f 8: 8 KiB, then writes fail with EFBIG (Python ignores SIGXFSZ)
    r = run_shell(f"ulimit -f 8; " + cmd("sample", "Once", "-m", str(toy_model_dir), "-n", "200", "--ignore-eos",
                                          "-f", "jsonl") + f" > {out}")
    assert r.returncode == 1, r
    assert r.stderr.startswith("error: writing the output") and "Traceback" not in r.stderr
    text = out.read_text(encoding="utf-8")
    assert text.endswith("\n") and 0 < len(text) <= 8192
    assert all(json.loads(line)["type"] == "step" for line in text.splitlines())


def test_a_second_ctrl_c_while_the_summary_is_written_is_a_quiet_130(cli, toy_model_dir, monkeypatch):
    import decodelab.cli.view.render as r

    real, calls = r.write_record, {"n": 0}

    def interrupt_at_summary(text):
        calls["n"] += 1
        if '"summary"' in text:
            raise KeyboardInterrupt  # as if Ctrl-C came while the summary was being written
        real(text)

    monkeypatch.setattr(r, "write_record", interrupt_at_summary)
    code, out, err = cli("sample", "Hello", "-m", toy_model_dir, "-n", "3", "--ignore-eos", "-f", "jsonl")
    assert code == 130 and err.strip().endswith("interrupted") and "Traceback" not in err
    assert all(json.loads(line)["type"] == "step" for line in out.splitlines())


def test_f_openai_is_the_completions_shape_of_the_same_run(cli, toy_model_dir):
    """`-f openai` writes the run's trace as an OpenAI completions response: the same tokens and raw logprobs the
    JSON document holds; commands without such a trace refuse it in one line."""
    args = ("sample", "Once upon", "-m", toy_model_dir, "-n", "4", "-t", "0.8", "--ignore-eos")
    code, out, err = cli(*args, "-f", "openai")
    assert code == 0, err
    logprobs = json.loads(out)["choices"][0]["logprobs"]
    code, out, err = cli(*args, "-f", "json")
    steps = json.loads(out)["steps"]
    assert logprobs["tokens"] == [s["token"] for s in steps]
    assert logprobs["token_logprobs"] == [s["raw_logprob"] for s in steps]
    code, out, err = cli("beam", "Once upon", "-m", toy_model_dir, "-n", "2", "-f", "openai")
    assert code == 2 and err.startswith("error: --format openai: beam") and out == ""


def test_before_stop_holds_back_what_a_stop_string_could_still_claim():
    from decodelab.cli.loop import before_stop

    assert before_stop("Once upon a time", ("upon",)) == "Once "  # a complete stop string: up to its first one
    assert before_stop("Once up", ("upon",)) == "Once "  # "up" may become "upon": held back
    assert before_stop("Once u", ("xyz", "upon")) == "Once "
    assert before_stop("Once upo", ("on", "upon")) == "Once "  # the longest tail that begins a stop string
    assert before_stop("Once", ("upon",)) == "Once"  # no tail begins one
    assert before_stop("Once", ("", "Once")) == ""
    assert before_stop("abc", ()) == "abc"
    assert before_stop("a stop. b stop", ("stop", "b")) == "a "  # the earliest of several


def test_f_text_never_prints_a_stop_string_that_is_trimmed_later(cli, toy_model_dir, monkeypatch):
    """`-f text --trim-stop` streams the continuation: a stop string that spans two tokens must not reach stdout
    before the run sees it whole (the old loop printed each token's text at once, then could not take it back)."""
    import decodelab.cli.view.render as r

    base = ("sample", "Once upon", "-m", toy_model_dir, "-n", "12", "-t", "0", "--ignore-eos")
    code, out, err = cli(*base, "-f", "json")
    assert code == 0, err
    doc = json.loads(out)
    ends, at = [], 0
    for s in doc["steps"]:
        at += len(s["token"])
        ends.append(at)
    text = doc["text"]
    stop = next(text[e - 1:e + 1] for e in ends[2:-1]  # two characters across a token boundary, first seen there
                if len(text[e - 1:e + 1]) == 2 and text.find(text[e - 1:e + 1]) == e - 1)
    writes: list[str] = []
    real = r.write_record
    monkeypatch.setattr(r, "write_record", lambda chunk: (writes.append(chunk), real(chunk)))
    code, out, err = cli(*base, "--stop", stop, "--trim-stop", "-f", "text")
    assert code == 0, err
    assert out == text[: text.find(stop)] + "\n" and "".join(writes) == out
    assert stop not in out
