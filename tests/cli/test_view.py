"""`decodelab view` and the page builder (cli/view/html.py, cli/view/branch.py), without a browser: the page holds
the document exactly, loads nothing from outside, refuses what is not a trace in one line, and the branch command
it offers reruns the run (the browser tests in test_view_browser.py click through the drawn page)."""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass

import pytest

from decodelab.cli.view.branch import option_words, sample_command
from decodelab.cli.view.html import VIEWS, page, page_meta, write_page
from decodelab.core.errors import ConfigError

SAMPLE = ["sample", "Once upon a time", "-n", "6", "-t", "0.9", "--top-p", "0.95", "--repetition-penalty", "1.1",
          "--logit-bias", " the=-inf", "--logit-bias", "12=1.5", "--stop", "zzz", "--seed", "7", "--top", "3"]


def run_json(cli, *args) -> dict:
    code, out, err = cli(*args, *(() if "json" in args else ("-f", "json")))
    assert code == 0, err
    return json.loads(out)


def embedded(html: str, element: str) -> dict:
    found = re.search(rf'<script type="application/json" id="{element}">(.*?)</script>', html, re.S)
    assert found, element
    return json.loads(found.group(1))


@pytest.fixture(scope="module")
def sample_doc():
    from decodelab.cli.main import main
    import contextlib

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(SAMPLE + ["-f", "json"]) == 0
    return json.loads(out.getvalue())


def test_the_page_holds_the_document_exactly(sample_doc):
    html = page(sample_doc)
    assert embedded(html, "trace") == sample_doc, "every number the page shows is read from this copy"
    meta = embedded(html, "page")
    assert meta["kind"] == "decodelab" and meta["view"] == "tokens"
    assert [s[0] for s in meta["shades"]] == [0.5, 0.1, 0.01, 0.0], "the terminal's shading classes"


def test_no_text_in_a_trace_can_end_the_script_element(sample_doc):
    doc = json.loads(json.dumps(sample_doc))
    doc["steps"][0]["token"] = "</script><script>alert(1)</script><!--"
    html = page(doc)
    assert html.count("</script>") == 3, "the two JSON elements and the page's own script"
    assert embedded(html, "trace")["steps"][0]["token"] == doc["steps"][0]["token"]


def test_the_page_loads_nothing_from_outside(sample_doc):
    html = page(sample_doc)
    assert "default-src 'none'" in html, "the Content-Security-Policy refuses any resource outside the file"
    assert not re.search(r"https?://|\bsrc\s*=|\bhref\s*=|@import|url\(", html), "no link to anything outside"


def test_every_command_has_a_view():
    from decodelab.cli.main import app

    names = {c.name or c.callback.__name__ for c in app.registered_commands}
    assert names - {"view"} == set(VIEWS), "a new command needs a view in cli/view/html.py (generic will do)"


def test_view_writes_the_page_next_to_the_trace(cli, tmp_path, sample_doc):
    trace = tmp_path / "run.json"
    trace.write_text(json.dumps(sample_doc), encoding="utf-8")
    code, out, err = cli("view", trace)
    assert code == 0, err
    assert embedded((tmp_path / "run.html").read_text(encoding="utf-8"), "trace") == sample_doc
    code, _, err = cli("view", trace, "-o", tmp_path / "other.html")
    assert code == 0 and (tmp_path / "other.html").exists() and "wrote" in err


def test_view_builds_a_page_without_importing_torch(tmp_path, sample_doc):
    """A page is drawn from the JSON alone: no model, no torch (a fresh interpreter)."""
    import subprocess
    import sys

    trace = tmp_path / "run.json"
    trace.write_text(json.dumps(sample_doc), encoding="utf-8")
    code = ("import sys\nfrom decodelab.cli.main import main\nrc = main(['view', %r])\n"
            "print([m for m in ('torch', 'transformers', 'numpy') if m in sys.modules], rc)") % str(trace)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "[] 0", proc.stderr
    assert (tmp_path / "run.html").exists()


@pytest.mark.parametrize("args", [["sample", "Once upon", "-n", "3", "-t", "0.8"], ["beam", "Once upon", "-n", "2", "-b", "2"],
                                  ["score", "Once upon a time"]])
def test_save_html_writes_the_page_of_the_document_json_prints(cli, tmp_path, args):
    """--save-html is the trace page of the very document -f json prints in the same run (the output path)."""
    html = tmp_path / "p.html"
    code, out, err = cli(*args, "-f", "json", "--save-html", html)
    assert code == 0, err
    assert embedded(html.read_text(encoding="utf-8"), "trace") == json.loads(out)
    assert embedded(html.read_text(encoding="utf-8"), "page")["view"] == VIEWS[args[0]]


def test_view_reads_stdin(cli, tmp_path, monkeypatch, sample_doc):
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(sample_doc)))
    monkeypatch.chdir(tmp_path)
    code, _, err = cli("view", "-")
    assert code == 0, err
    assert embedded((tmp_path / "trace.html").read_text(encoding="utf-8"), "trace") == sample_doc


@pytest.mark.parametrize("text, message", [
    ("not json", "TRACE .*: not JSON"),
    ('{"command": "sample"}\n{"type": "summary"}\n', "several JSON values \\(JSON lines"),
    ('{"hello": "world"}', "not a decodelab trace .* nor an OpenAI completions response"),
    ('{"command": "rm"}', "command 'rm' is not a decodelab command"),
    ('{"command": "sample", "format_version": 99, "steps": []}', "format_version 99 is newer than this decodelab"),
    ('{"choices": [{"logprobs": {"tokens": ["a", "b"], "token_logprobs": [-1.0]}}]}',
     "choices\\[0\\]: logprobs.token_logprobs has 1 entries for 2 tokens"),
    # nesting past the parser's recursion limit was a RecursionError traceback; past 64 levels, a document no
    # decodelab writes
    ("[" * 100_000 + "]" * 100_000, "TRACE .*: nested deeper than 64 levels"),
    ('{"command": "sample", "steps": ' + "[" * 70 + "]" * 70 + "}", "nested deeper than 64 levels"),
])
def test_what_is_not_a_trace_is_one_line_and_status_2(cli, tmp_path, text, message):
    trace = tmp_path / "t.json"
    trace.write_text(text, encoding="utf-8")
    code, out, err = cli("view", trace, "-o", tmp_path / "t.html")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert re.search(message, err), err
    assert not (tmp_path / "t.html").exists()


def test_view_names_a_missing_trace_and_a_bad_output(cli, tmp_path):
    code, _, err = cli("view", tmp_path / "none.json")
    assert code == 2 and "TRACE" in err and "no such file" in err
    trace = tmp_path / "t.json"
    trace.write_text('{"command": "sample", "steps": []}', encoding="utf-8")
    code, _, err = cli("view", trace, "-o", tmp_path)
    assert code == 2 and "--output" in err and "is a folder" in err


def test_write_page_takes_the_records_a_command_holds(tmp_path):
    @dataclass
    class Step:
        index: int
        token: str
        prob: float

    doc = {"command": "sample", "model": "m", "config": {}, "prompt": {"text": "a", "token_ids": [1]},
           "steps": [Step(0, "b", float("nan"))]}
    path = write_page(doc, tmp_path / "p.html")
    assert embedded(path.read_text(encoding="utf-8"), "trace")["steps"] == [{"index": 0, "token": "b", "prob": None}]
    with pytest.raises(ConfigError, match="--save-html .*: cannot write the file"):
        write_page(doc, tmp_path / "missing" / "p.html")


# --- the branch command -------------------------------------------------------------------------------------


def test_the_branch_command_writes_each_setting_as_its_option(sample_doc):
    argv = sample_command(sample_doc)["argv"]
    text = " ".join(argv)
    for words in ("-t 0.9", "--top-p 0.95", "--repetition-penalty 1.1", "--logit-bias  the=-inf", "--logit-bias 12=1.5",
                  "--stop zzz", "--seed 7", "--top 3", "--max-new-tokens 6", "-m tiny", "--dtype float32"):
        assert words.replace("-t ", "--temperature ") in text, words
    assert argv[2] == "Once upon a time"


def test_option_words():
    assert option_words("trim_stop", False) == ["--set", "trim_stop=false"]
    assert option_words("trim_stop", None) == [] and option_words("trim_stop", True) == ["--trim-stop"]
    assert option_words("ignore_eos", False) == [] and option_words("ignore_eos", True) == ["--ignore-eos"]
    assert option_words("kept_ids", False) == [] and option_words("kept_ids", True) == ["--kept-ids"]  # any flag
    assert option_words("logit_bias", {"5": None, " a": 2.0}) == ["--logit-bias", "5=-inf", "--logit-bias", " a=2.0"]
    assert option_words("chain", ["top-k", "temperature"]) == ["--chain", "top-k,temperature"]
    assert option_words("stop", ["\n\n", "x"]) == ["--stop", "\n\n", "--stop", "x"]
    assert option_words("top_p", 0.1 + 0.2) == ["--top-p", "0.30000000000000004"], "floats exactly"


def force(cmd: dict, *pairs: tuple[int, int]) -> list[str]:
    """The command's words after `decodelab`, with --force words and -f json where options go."""
    argv = list(cmd["argv"][1:])
    at = cmd["force_at"] - 1
    return argv[:at] + [w for s, t in pairs for w in ("--force", f"{s}={t}")] + ["-f", "json"] + argv[at:]


def test_the_branch_command_reruns_the_run_and_branches_at_the_step(cli, sample_doc):
    """The oracle for every setting written: forcing a step to the trace's own token reruns the trace exactly (a
    setting written wrong changes some number); forcing another kept token changes that step and no earlier one."""
    cmd = sample_command(sample_doc)
    rerun = run_json(cli, *force(cmd, (2, sample_doc["steps"][2]["token_id"])))
    assert rerun["token_ids"] == sample_doc["token_ids"] and rerun["config"] == sample_doc["config"]
    assert [s["raw_logprob"] for s in rerun["steps"]] == [s["raw_logprob"] for s in sample_doc["steps"]]
    alt = next(a for a in sample_doc["steps"][2]["alternatives"] if a["prob"] > 0 and
               a["token_id"] != sample_doc["steps"][2]["token_id"])
    branched = run_json(cli, *force(cmd, (2, alt["token_id"])))
    assert branched["token_ids"][:2] == sample_doc["token_ids"][:2]
    assert branched["steps"][2]["token_id"] == alt["token_id"] and branched["steps"][2]["decided_by"] == "forced"
    assert branched["steps"][2]["raw_prob"] == pytest.approx(alt["raw_prob"], rel=1e-6)


def test_a_stream_trace_branches_through_sample_with_its_cache(cli):
    doc = run_json(cli, "stream", "Once upon", "-n", "5", "--cache", "sinks:sinks=1,recent=3", "-t", "0.7",
                   "--top", "2")
    meta = page_meta(doc)
    assert meta["view"] == "stream" and "--cache" in meta["branch"]["argv"]
    rerun = run_json(cli, *force(meta["branch"], (1, doc["steps"][1]["token_id"])))
    assert rerun["token_ids"] == doc["token_ids"]
    assert [s["raw_logprob"] for s in rerun["steps"]] == [s["raw_logprob"] for s in doc["steps"]]


@pytest.mark.parametrize("command", [("score", "Once upon a time there"), ("stream", "Once upon", "-n", "4"),
                                     ("sample", "Once upon", "-n", "4", "--kept-ids")])
def test_every_branch_command_a_page_offers_runs(cli, command):
    """The command a page offers reads back through `sample` whatever the trace's config holds (a true/false
    setting such as score's kept_ids was written as `--kept-ids False`, which sample refused)."""
    cmd = page_meta(run_json(cli, *command))["branch"]
    assert cmd is not None
    rerun = run_json(cli, *force(cmd))
    assert rerun["command"] == "sample"


def test_a_prompt_that_reads_as_an_option_goes_after_the_double_dash(cli):
    code, out, err = cli("sample", "-n", "2", "-t", "0.5", "-f", "json", "--", "-x marks")
    assert code == 0, err
    doc = json.loads(out)
    cmd = sample_command(doc)
    assert cmd["argv"][-2:] == ["--", "-x marks"] and cmd["argv"][cmd["prompt_at"]] == "-x marks"
    rerun = run_json(cli, *force(cmd, (1, doc["token_ids"][1])))
    assert rerun["token_ids"] == doc["token_ids"] and rerun["prompt"] == doc["prompt"]


def test_views_without_a_run_to_rerun_have_no_branch_command(cli):
    assert page_meta(run_json(cli, "beam", "Once upon", "-n", "2", "-b", "2"))["branch"] is None
    assert page_meta(run_json(cli, "sample", "Once upon", "-n", "2", "-N", "2"))["branch"] is None
    openai = {"choices": [{"index": 0, "text": "a", "logprobs": {"tokens": ["a"], "token_logprobs": [-1.0],
                                                                  "top_logprobs": [{"a": -1.0}], "text_offset": [0]}}]}
    assert page_meta(openai) == {"kind": "openai", "view": "openai", "shades": page_meta(openai)["shades"],
                                 "branch": None}


def test_the_page_knows_which_steps_are_one_hot_as_the_terminal_decides_it(cli):
    """Issue 40: the page shows greedy's raw distribution, labelled raw, where the processed one is one-hot; which
    steps those are is the terminal's decision (steps_view.one_hot), handed to the page (page.one_hot): every step of
    a greedy run, every step of top-k 1, none of a sampled run; the page holds the labelled section."""
    from types import SimpleNamespace

    from decodelab.cli.view.steps_view import one_hot

    def as_step(s):
        return SimpleNamespace(prob=s["prob"], alternatives=[SimpleNamespace(**a) for a in s["alternatives"]])

    args = ("sample", "Once upon", "-n", "4", "--top", "3", "--threads", "1")
    for extra, expect in ((("-t", "0"), "all"), (("-t", "0.9", "--top-k", "1", "--seed", "1"), "all"),
                          (("-t", "0.9", "--seed", "1"), "none")):
        doc = run_json(cli, *args, *extra)
        meta = page_meta(doc)
        assert meta["one_hot"] == [s["index"] for s in doc["steps"] if one_hot(as_step(s))]
        assert meta["one_hot"] == ([s["index"] for s in doc["steps"]] if expect == "all" else [])
        html = page(doc)
        assert embedded(html, "page")["one_hot"] == meta["one_hot"]
        assert "raw distribution where the processed one is one-hot" in html  # page.js draws it for those steps
