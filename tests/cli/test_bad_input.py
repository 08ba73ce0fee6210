"""Bad input found by fuzzing and by hand: each is one line naming the option (or the file) and what is allowed,
exit status 2, checked before the model loads where the value alone decides."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from decodelab.core.engine.stopping import StopRules

NON_UTF8 = os.fsdecode(b"caf\xe9")


def one_line_error(cli, *args) -> str:
    code, out, err = cli(*args)
    assert code == 2, (code, out, err)
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize("args, needle", [
    (["--seed", str(2**70)], "--seed 1180591620717411303424: must be an integer in [0, 2**64)"),
    (["--seed", "-1"], "--seed -1: must be an integer in [0, 2**64)"),
    (["--set", f"seed={2**64}"], "--seed"),
    (["--stop", ""], "--stop '': an empty stop string matches everywhere"),
    (["--stop", NON_UTF8], "--stop 'caf\\\\udce9': not valid UTF-8"),
    (["--logit-bias", " the=inf"], "+inf cannot force a token"),
    (["--logit-bias", f"{NON_UTF8}=1"], "--logit-bias 'caf\\\\udce9': not valid UTF-8"),
    (["--cache", ""], "--cache '': names no policy; give one of full, "),  # not read as full
    (["--cache", "  "], "--cache '  ': names no policy"),
    (["--allow", NON_UTF8], "--allow 'caf\\\\udce9': not valid UTF-8"),  # found by the fuzz test
    (["--sequence-bias", f"{NON_UTF8}=1"], "--sequence-bias 'caf\\\\udce9': not valid UTF-8"),
    (["--regex", NON_UTF8], "--regex 'caf\\\\udce9': not valid UTF-8"),
])
def test_values_refused_before_the_model_loads(cli, args, needle):
    # a model that does not exist: the value must be refused first
    err = one_line_error(cli, "sample", "Hi", "-m", "/nonexistent/model", *args)
    assert needle in err


@pytest.mark.parametrize("option", ["--cache", "--against-cache"])
def test_an_empty_cache_spec_is_refused_by_score(cli, option):
    assert f"{option} '': names no policy" in one_line_error(cli, "score", "Hi", "-m", "/nonexistent/model", option,
                                                             "")


def test_non_utf8_prompt(cli, toy_model_dir):
    assert "PROMPT 'caf\\\\udce9': not valid UTF-8" in one_line_error(cli, "sample", "-m", toy_model_dir, "--",
                                                                       NON_UTF8)


@pytest.mark.parametrize("content, needle", [
    (b"temperature = 0.5\xff\n", "not UTF-8 text (byte 17)"),
    (b'top_p = "high"\n', "key 'top_p' in the file: --top-p 'high': expected float"),
    (b"temperature = [1, 2]\n", "key 'temperature' in the file"),
])
def test_preset_files(cli, tmp_path, content, needle):
    preset = tmp_path / "mine.toml"
    preset.write_bytes(content)
    err = one_line_error(cli, "sample", "Hi", "-m", "/nonexistent/model", "-p", str(preset))
    assert f"--preset '{preset}'" in err and needle in err


def test_preset_that_is_a_folder(cli, tmp_path):
    assert "nor a .toml file" in one_line_error(cli, "sample", "Hi", "-p", str(tmp_path))


@pytest.mark.parametrize("keep, needle", [
    ((), "has no config.json, so it is not a model folder"),
    (("config.json",), "has no .safetensors weights"),
    (("config.json", "model.safetensors"), "has no tokenizer"),
])
def test_incomplete_model_folders(cli, toy_model_dir, tmp_path, keep, needle):
    folder = tmp_path / "m"
    folder.mkdir()
    for name in keep:
        shutil.copy(toy_model_dir / name, folder / name)
    err = one_line_error(cli, "sample", "Hi", "-m", str(folder))
    assert needle in err and not err.rstrip().endswith(":")


@pytest.mark.parametrize("args, needle", [
    (["--gamma", "10000"], "--gamma 10000: must be an integer in [1, 128]"),
    (["--gamma", "0"], "--gamma 0: must be"),
    (["--ngram-size", str(2**63)], "--ngram-size"),
    (["--sweep-gamma", "1,²"], "--sweep-gamma"),
    (["--sweep-gamma", "1,1000"], "--sweep-gamma"),
    (["--speedup-rounds", "0"], "--speedup-rounds 0: must be an integer in [1, 100]"),
    (["--speedup-rounds", "101"], "--speedup-rounds 101: must be an integer in [1, 100]"),
    (["--set", "speedup_rounds=-3"], "--speedup-rounds -3: must be an integer in [1, 100]"),
])
def test_speculate_bounds(cli, args, needle):
    assert needle in one_line_error(cli, "speculate", "Hi", "-m", "/nonexistent/model", *args)


def test_debug_after_double_dash_is_the_prompt(cli, toy_model_dir):
    code, out, err = cli("sample", "-m", toy_model_dir, "-n", "2", "-f", "json", "--", "--debug")
    assert code == 0, err
    assert json.loads(out)["prompt"]["text"] == "--debug"


def test_huge_max_new_tokens_stops_at_the_context(cli, toy_model_dir):
    """-n 2**62 used to allocate prompt + n positions up front; the run fills the 64-position context instead."""
    code, out, err = cli("sample", "Hi", "-m", toy_model_dir, "-n", str(2**62), "--ignore-eos", "-t", "0",
                         "--top", "0", "-f", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["summary"]["stop_reason"] == "context" and len(doc["token_ids"]) == 64 - 2
    assert StopRules(2**62, context_length=64).capacity(2) == 64
    assert StopRules(5, context_length=64).capacity(2) == 7 and StopRules(5).capacity(2) == 7
    assert StopRules(5, context_length=64).capacity(70) == 70  # a too-long prompt is refused elsewhere


@pytest.mark.parametrize("command", ["sample", "probs", "beam", "speculate"])
def test_no_repeat_ngram_on_a_prompt_shorter_than_n(cli, toy_model_dir, command):
    """"Hi" is 2 tokens: --no-repeat-ngram 3 used to crash in every command."""
    extra = {"speculate": ["--draft", "ngram", "-n", "3"], "probs": []}.get(command, ["-n", "3"])
    code, out, err = cli(command, "Hi", "-m", toy_model_dir, "--no-repeat-ngram", "3", *extra, "-f", "json")
    assert code == 0, err


@pytest.mark.parametrize("args, needle", [
    (["--beams", str(2**63)], "--beams 9223372036854775808: must be an integer in [1, 256]"),
    (["--beams", "10000"], "--beams 10000: must be an integer in [1, 256]"),
    (["--length-penalty", "1e308"], "--length-penalty 1e+308: must be a number in [-10, 10]"),
    (["--length-penalty", "nan"], "--length-penalty nan"),
    (["--sweep-length-penalty", "0,-1e300"], "--sweep-length-penalty '0,-1e300': every penalty must be in"),
])
def test_beam_bounds(cli, args, needle):
    assert needle in one_line_error(cli, "beam", "Hi", "-m", "/nonexistent/model", *args)


@pytest.mark.parametrize("args", [["-t", "1e-45"], ["--logit-bias", "0=1e39"]])
def test_an_overflow_is_not_reported_as_an_empty_chain(cli, toy_model_dir, args):
    """logits / 1e-45 and a bias past float32's 3.4e38 give +inf, whose softmax is NaN: the message says overflow,
    not that the chain removed every candidate."""
    err = one_line_error(cli, "sample", "Hello", "-m", toy_model_dir, "-n", "2", *args, "-f", "json")
    assert "overflow to +inf or NaN" in err and "removed every candidate" not in err
    err = one_line_error(cli, "speculate", "Hello", "-m", toy_model_dir, "-n", "2", "--draft", "ngram", *args)
    assert "overflow to +inf or NaN" in err


@pytest.mark.parametrize("option", ["--save-html", "--save-svg"])
@pytest.mark.parametrize("target, needle", [
    ("missing/out.html", "the folder missing does not exist"),
    (".", "is a folder; give a file name"),
])
def test_save_targets_checked_before_the_model_loads(cli, tmp_path, monkeypatch, option, target, needle):
    monkeypatch.chdir(tmp_path)
    err = one_line_error(cli, "sample", "Hi", "-m", "/nonexistent/model", option, target)
    assert f"{option} {target}: {needle}" in err


@pytest.mark.parametrize("content, needle", [(b"caf\xe9", "not UTF-8 text (byte 3)"), (None, "is a folder"),
                                             ("missing", "no such file")])
def test_prompt_files_checked_before_the_model_loads(cli, tmp_path, content, needle):
    path = tmp_path / "p.txt"
    if content is None:
        path.mkdir()
    elif content != "missing":
        path.write_bytes(content)
    err = one_line_error(cli, "sample", "-m", "/nonexistent/model", "--prompt-file", str(path))
    assert f"--prompt-file {path}: {needle}" in err


def test_threads(cli, toy_model_dir):
    import torch

    from decodelab.cli.options import usable_cpus

    cpus = usable_cpus()
    for bad in ("0", str(cpus + 1), "1024"):
        if bad == "1024" and cpus >= 1024:
            continue
        assert f"--threads {bad}: must be an integer in [1, {cpus}]" in one_line_error(
            cli, "sample", "Hi", "--threads", bad, "-m", "/nonexistent/model")
    before = torch.get_num_threads()
    try:
        code, _, err = cli("probs", "Hi", "-m", toy_model_dir, "--threads", str(min(2, cpus)), "-f", "json")
        assert code == 0, err
        assert torch.get_num_threads() == min(2, cpus)
    finally:
        torch.set_num_threads(before)


def test_device_map_names_the_extra_when_accelerate_is_missing(cli, toy_model_dir):
    import importlib.util

    if importlib.util.find_spec("accelerate") is not None:
        pytest.skip("accelerate is installed")
    err = one_line_error(cli, "sample", "Hi", "-m", toy_model_dir, "--device-map", "auto")
    assert "pip install 'decodelab[multi-device]'" in err


def test_a_model_name_that_is_not_utf8_is_one_line_with_its_bytes_escaped(cli):
    """The message echoes the name back; a strict UTF-8 stderr (a pipe set so, pytest's capture) must not raise."""
    err = one_line_error(cli, "bench", "--model", NON_UTF8)
    assert err.startswith("error: --model caf\\udce9")


@pytest.mark.parametrize("args, option", [
    (["batch", "--prompts-file", "{f}"], "--prompts-file"),
    (["compare", "--prompts-file", "{f}", "-V", "a: temperature=0"], "--prompts-file"),
    (["compare", "Hi", "--job", "{f}"], "--job"),
    (["probs", "--logits-file", "{f}"], "--logits-file"),
    (["sample", "--resume", "{f}"], "--resume"),
    (["stream", "--text-file", "{f}"], "--text-file"),
    (["score", "--text-file", "{f}"], "--text-file"),
    (["quantize-kv", "--text-file", "{f}"], "--text-file"),
])
@pytest.mark.parametrize("content, needle", [(b"ok\ncaf\xe9\n", "not UTF-8 text (byte 6)"), (None, "is a folder"),
                                             ("missing", "no such file")])
def test_every_input_file_is_one_line_when_missing_a_folder_or_not_utf8(cli, toy_model_dir, tmp_path, args, option,
                                                                        content, needle):
    path = tmp_path / "input.txt"
    if content is None:
        path.mkdir()
    elif content != "missing":
        path.write_bytes(content)
    err = one_line_error(cli, *[a.replace("{f}", str(path)) for a in args], "-m", toy_model_dir)
    assert f"{option} {path}: {needle}" in err


def test_an_allocation_that_fails_is_one_line(cli, toy_model_dir, tmp_path):
    """A pool of 2**20 blocks of 4096 tokens is within the sanity bounds but no machine's memory: torch's allocator
    refuses it, and that is one line naming the sizes to shrink, not a traceback."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello\n")
    err = one_line_error(cli, "batch", "--prompts-file", prompts, "-m", toy_model_dir, "--blocks", str(2**20),
                         "--block-size", "4096", "--baselines", "none", "-n", "2")
    assert err.startswith("error: out of memory:") and "--blocks" in err


# --- hostile input: nesting, size, stdin, numbers, sizes ------------------------------------------------------------


def test_a_preset_nested_5000_deep(cli, tmp_path):
    preset = tmp_path / "deep.toml"
    preset.write_text("temperature = " + "[" * 5000 + "]" * 5000 + "\n")
    err = one_line_error(cli, "sample", "Hi", "-m", "/nonexistent/model", "-p", preset)
    assert f"--preset '{preset}': nested deeper than 64 levels" in err


@pytest.mark.parametrize("args, option", [
    (["sample", "--resume", "{f}"], "--resume"),
    (["compare", "Hi", "--job", "{f}"], "--job"),
    (["batch", "--prompts-file", "{f}"], "--prompts-file"),
    (["compare", "--prompts-file", "{f}", "-V", "a: temperature=0"], "--prompts-file"),
])
def test_json_nested_100000_deep(cli, toy_model_dir, tmp_path, args, option):
    path = tmp_path / "deep.jsonl"
    path.write_text("{\"prompt\": " + "[" * 100_000 + "]" * 100_000 + "}\n")
    err = one_line_error(cli, *[a.replace("{f}", str(path)) for a in args], "-m", toy_model_dir)
    assert f"{option} {path}" in err and "nested deeper than 64 levels" in err


def test_a_resume_trace_with_ids_that_are_not_integers(cli, toy_model_dir, tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"prompt": {"text": "Hi", "token_ids": [1, "²"]}, "token_ids": []}))
    assert "--resume" in one_line_error(cli, "sample", "--resume", path, "-m", toy_model_dir)
    path.write_text(json.dumps({"prompt": [], "token_ids": 3}))
    assert "expected a `sample -f json` trace" in one_line_error(cli, "sample", "--resume", path, "-m", toy_model_dir)


def test_an_input_file_that_never_ends(cli):
    """/dev/zero as a prompt file: read up to the 64 MiB bound, then refused (it used to be read forever)."""
    err = one_line_error(cli, "sample", "--prompt-file", "/dev/zero", "-m", "/nonexistent/model")
    assert "--prompt-file /dev/zero: more than 67108864 bytes (64 MiB)" in err


@pytest.mark.parametrize("stdin, needle", [
    (None, "PROMPT -: stdin is closed"),
    ("closed", "PROMPT -: stdin is closed"),
    ("/dev/zero", "PROMPT -: more than 67108864 bytes"),
    (b"caf\xe9", "PROMPT -: not UTF-8 text (byte 3)"),
])
def test_stdin_read_defensively(cli, toy_model_dir, monkeypatch, stdin, needle):
    import io
    import sys

    def make():
        if stdin == "closed":
            stream = io.TextIOWrapper(io.BytesIO(b"Hi"))
            stream.close()
            return stream
        if stdin == "/dev/zero":
            return open("/dev/zero")  # noqa: SIM115 (closed below)
        return io.TextIOWrapper(io.BytesIO(stdin)) if isinstance(stdin, bytes) else None  # None: `<&-`

    for command, name in (("sample", "PROMPT"), ("score", "TEXT")):
        stream = make()
        monkeypatch.setattr(sys, "stdin", stream)
        try:
            assert needle.replace("PROMPT", name) in one_line_error(cli, command, "-", "-m", toy_model_dir)
        finally:
            if stream is not None:
                stream.close()


def test_stdin_piped_is_the_prompt(cli, toy_model_dir, monkeypatch):
    import io
    import sys

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("Hello\r\nthere".encode())))
    code, out, err = cli("sample", "-", "-m", toy_model_dir, "-n", "1", "-f", "json")
    assert code == 0, err
    assert json.loads(out)["prompt"]["text"] == "Hello\nthere"  # universal newlines, as text mode reads them


@pytest.mark.parametrize("args, needle", [
    (["compare", "Hi", "-V", "a: temperature=0", "--seeds", "²"], "--seeds '²': expected seeds >= 0"),
    (["compare", "Hi", "-V", "a: temperature=0", "--seeds", "0-1,³"], "--seeds '0-1,³': expected seeds >= 0"),
    (["compare", "Hi", "-V", "a: temperature=0", "--seeds", "0-100000000000"],
     "--seeds '0-100000000000': 100000000001 seeds; at most 4096"),
    (["compare", "Hi", "-V", "a: temperature=0", "--seeds", "0-4000,2000-5000"], "5001 seeds; at most 4096"),
    (["sample", "Hi", "--top", "١"], "--top '١': expected int, an integer in ASCII digits 0-9"),
    (["sample", "Hi", "-n", "1_0"], "--max-new-tokens '1_0': expected int"),
    (["sample", "Hi", "--seed", "3.0"], "--seed '3.0': expected int"),
    (["sample", "Hi", "--top-p", "٠.٥"], "--top-p '٠.٥': expected float"),
    (["sample", "Hi", "--stop-id", "²"], "--stop-id '²': expected int"),
    (["sample", "Hi", "--set", "top_k=²"], "--top-k '²': expected int"),
    (["sample", "Hi", "--set", "temperature=1_0"], "--temperature '1_0': expected float"),
    (["sample", "Hi", "--cache", "window:size=²"], "size must be an integer >= 1, not '²'"),
    (["sample", "Hi", "--cache", "snapkv:ratio=٠.٥"], "ratio must be a number in (0, 1]"),
    (["sample", "Hi", "--force", "²=3"], "--force '²=3': expected STEP=TOKEN"),
    (["sample", "Hi", "--logit-bias", "1=²"], "BIAS '²' is not a number"),
    (["speculate", "Hi", "--sweep-gamma", "1,²"], "--sweep-gamma '1,²': a comma-separated list of integers"),
    (["beam", "Hi", "--sweep-length-penalty", "0,١"], "--sweep-length-penalty '0,١': '١' is not a number"),
    (["bench", "--gammas", "²"], "--gammas '²': comma-separated integers in [1, 128]"),
    (["sample", "Hi", "--seed", "9" * 50], "50 digits, past every bound"),
])
def test_every_number_is_read_in_ascii_digits_naming_its_option(cli, args, needle):
    assert needle in one_line_error(cli, *args, "-m", "/nonexistent/model")


def test_probs_history_and_given_logits_in_ascii_digits(cli):
    assert "--history '1,²'" in one_line_error(cli, "probs", "--dist", "0.5,0.5", "--history", "1,²")
    assert "--dist '٠.٥'" in one_line_error(cli, "probs", "--dist", "٠.٥,0.5")


@pytest.mark.parametrize("content, needle", [
    ('seeds = ["x"]\n[[variant]]\nname = "a"\ntemperature = 0\n', "seeds 'x': expected int"),
    ('seeds = "0-100000000000"\n[[variant]]\nname = "a"\n', "100000000001 seeds; at most 4096"),
    ('prompts = [1, 2]\n[[variant]]\nname = "a"\n', "prompts must be a text or a list of non-empty texts"),
    ('defaults = 3\n[[variant]]\nname = "a"\n', "[defaults] must be a table"),
])
def test_a_compare_job_with_bad_values(cli, tmp_path, content, needle):
    job = tmp_path / "job.toml"
    job.write_text(content)
    err = one_line_error(cli, "compare", "Hi", "--job", job, "-m", "/nonexistent/model")
    assert f"--job {job}" in err and needle in err


def test_a_preset_with_the_largest_integers(cli, toy_model_dir, tmp_path):
    """seed 2**63-1 is a seed like any other; -n 2**63-1 runs to the context under sample and is refused, before
    anything runs, where no context bounds the run (stream)."""
    preset = tmp_path / "big.toml"
    preset.write_text(f"seed = {2**63 - 1}\nmax_new_tokens = {2**63 - 1}\n")
    code, out, err = cli("sample", "Hi", "-m", toy_model_dir, "-p", preset, "--top", "0", "-f", "json")
    assert code == 0, err
    assert json.loads(out)["summary"]["stop_reason"] in ("context", "eos")
    err = one_line_error(cli, "stream", "Hi", "-m", "/nonexistent/model", "-p", preset)
    assert f"--max-new-tokens {2**63 - 1}: stream runs past the context" in err and "at most 16777216" in err


def test_a_long_text_to_score_without_limit_is_refused_with_the_numbers(cli, toy_model_dir, tmp_path):
    """The whole text in one forward past the 64-position context used to be killed for memory on 1 MB."""
    path = tmp_path / "long.txt"
    path.write_text("the cat sat on the mat and " * 8000)  # 216 KB
    err = one_line_error(cli, "score", "--text-file", path, "-m", toy_model_dir)
    assert "--text-file: " in err and "tokens, more than the context of" in err and "(64); pass --limit 64" in err
    tokens = int(err.split("--text-file: ")[1].split(" ")[0])
    assert f"--limit {tokens} for all of them" in err and "decodelab stream --text-file" in err
    code, out, err = cli("score", "--text-file", path, "-m", toy_model_dir, "--limit", "64", "-f", "json")
    assert code == 0, err
    assert json.loads(out)["summary"]["tokens"] == 63


@pytest.mark.parametrize("value", ["0", "3", "abc", "²", "-80"])
def test_columns_that_no_table_fits(cli, monkeypatch, value):
    monkeypatch.setenv("COLUMNS", value)
    err = one_line_error(cli, "models")
    assert f"COLUMNS={value!r}: the terminal width must be an integer in [20, 10000]" in err


def test_an_out_of_range_stage_value_is_reported_before_torch_is_imported():
    """Bug: `sample x --top-p 1.5` imported torch and transformers (seconds) before saying what was wrong. The same
    value under --semantics is left to the full check (an engine may read it as "off"), and so is a value --set
    replaces."""
    import subprocess
    import sys

    probe = ("import sys; from decodelab.cli.main import main; code = main(sys.argv[1:]); "
             "print(code, 'torch' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", probe, "sample", "x", "--top-p", "1.5"], capture_output=True,
                         text=True)
    assert run.stdout.split() == ["2", "False"], (run.stdout, run.stderr)
    assert run.stderr == "error: --top-p 1.5: must be in (0, 1]\n"
    for args in (["--set", "top_p=0.5"], ["--semantics", "hf", "-t", "1"]):  # --set overrides it; an engine reads it
        run = subprocess.run([sys.executable, "-c", probe, "sample", "x", "--top-p", "1.5", "-m", "/nonexistent",
                              *args], capture_output=True, text=True)
        assert run.stdout.split()[1] == "True", (args, run.stdout, run.stderr)


# --- mutation run of core/inputs.py (2026-12-01): the readers called directly, at their bounds -------------------

from decodelab.core import inputs
from decodelab.core.errors import ConfigError


class EndlessStdin:
    """A stdin that never ends (``< /dev/zero``): read(n) gives n bytes; an unbounded read would never return."""

    closed = False

    def __init__(self):
        self.buffer = self

    def read(self, n=-1):
        assert n is not None and n >= 0, "an unbounded read of an endless stdin"
        return b"a" * n


def _refusal(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as refused:
        fn(*args, **kwargs)
    return str(refused.value)


def test_stdin_is_read_to_its_limit_and_no_further(monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", EndlessStdin())
    assert _refusal(inputs.read_stdin, "PROMPT", limit=8) == \
        "PROMPT -: more than 8 bytes (0 MiB), the most decodelab reads; give a shorter text"
    monkeypatch.setattr("sys.stdin", io.StringIO("é" * 4))  # 8 bytes of UTF-8: exactly the limit
    assert inputs.read_stdin("PROMPT", limit=8) == "é" * 4
    monkeypatch.setattr("sys.stdin", io.StringIO("é" * 5))
    assert _refusal(inputs.read_stdin, "PROMPT", limit=8).startswith("PROMPT -: more than 8 bytes")
    monkeypatch.setattr("sys.stdin", io.StringIO("caf\udce9"))  # an undecodable byte, as Python reads it
    assert _refusal(inputs.read_stdin, "PROMPT") == "PROMPT -: not UTF-8 text (byte 3); give a UTF-8 file"
    class Unreadable(EndlessStdin):
        def read(self, n=-1):
            raise OSError(9, "Bad file descriptor")  # `<&-` seen by a process whose stdin object outlived it

    monkeypatch.setattr("sys.stdin", Unreadable())
    assert _refusal(inputs.read_stdin, "PROMPT") == \
        "PROMPT -: stdin is closed; pipe the text in, or give it as an argument or a file"
    closed = io.StringIO("text")
    closed.close()
    monkeypatch.setattr("sys.stdin", closed)
    assert _refusal(inputs.read_stdin, "--text-file") == \
        "--text-file -: stdin is closed; pipe the text in, or give it as an argument or a file"


def test_toml_and_number_lists_refuse_in_one_exact_line():
    assert _refusal(inputs.parse_toml, "--job j.toml", "a = ").startswith("--job j.toml: invalid TOML: ")
    assert inputs.parse_toml("--job j.toml", "a = [[1]]", max_depth=3) == {"a": [[1]]}
    assert _refusal(inputs.parse_toml, "--job j.toml", "a = [[1]]", max_depth=2) == \
        "--job j.toml: nested deeper than 2 levels; decodelab reads flatter documents"
    assert _refusal(inputs.parse_json, "--resume t.json", '{"a": [[1]]}', max_depth=2) == \
        "--resume t.json: nested deeper than 2 levels; decodelab reads flatter documents"
    assert _refusal(inputs.parse_json, "--resume t.json", b'{"a": "\xe9"}') == \
        "--resume t.json: not JSON (invalid continuation byte)"
    assert inputs.parse_numbers("0.1, 0.2 -inf", "--probs") == [0.1, 0.2, float("-inf")]
    assert _refusal(inputs.parse_numbers, " , ", "--probs") == \
        "--probs: no values; give numbers separated by commas, e.g. 0.1,0.2,0.7"
    assert _refusal(inputs.parse_numbers, "0.1,nan", "--probs") == "--probs 'nan': not a number"
