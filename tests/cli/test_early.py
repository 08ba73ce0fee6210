"""Mistakes found before torch loads (issue 40: a wrong -m or --draft name, or an empty prompt, cost 10-12 s of
imports before their one line): the same message and exit status 2, and torch never imported."""

from __future__ import annotations

import subprocess
import sys

import pytest


def in_fresh_python(*args: str) -> tuple[int, str, list[str]]:
    """(exit status, stderr, the heavy modules loaded) of a command run in a fresh interpreter."""
    code = ("import sys\nfrom decodelab.cli.main import main\nrc = main(%r)\n"
            "print('LOADED', [m for m in ('torch', 'transformers') if m in sys.modules])\nsys.exit(rc)\n") % (list(args),)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"COLUMNS": "100", "PATH": "", "NO_COLOR": "1", "HF_HOME": "/nonexistent-hf-home"})
    return proc.returncode, proc.stderr, eval(proc.stdout.rpartition("LOADED ")[2])


CASES = [
    (["sample", "Once", "-m", "someorg/nosuch"], "--model someorg/nosuch: not a bundled name (tiny, tiny-draft, tiny-recall), a "
     "local folder, or a model in the local Hugging Face cache (decodelab never downloads)"),
    (["sample", "Once", "-m", "gpt2"], "--model gpt2: not a bundled name"),
    (["speculate", "Once", "--draft", "tiny-drft"], "--draft tiny-drft: not a bundled name (tiny, tiny-draft, tiny-recall)"),
    (["score", "Once upon", "--against", "nosuch"], "--against nosuch: not a bundled name"),
    (["sample", ""], "PROMPT: the prompt is empty (0 tokens); give some text"),
    (["beam", "", "-m", "tiny-draft"], "PROMPT: the prompt is empty (0 tokens); give some text"),
]


@pytest.mark.parametrize("args,message", CASES)
def test_a_wrong_model_name_or_empty_prompt_fails_before_torch(args, message):
    code, err, loaded = in_fresh_python(*args, "--threads", "1")
    assert code == 2 and err.startswith("error: " + message) and err.count("\n") == 1, err
    assert loaded == [], "found before torch and transformers are imported"


def test_the_early_messages_are_the_loaders_own(cli, tmp_path):
    """The early check and the loader give the same line (one owner: core/engine/locate.py): the loader's, reached
    by calling it directly."""
    from decodelab.core.engine.models import load_model
    from decodelab.core.errors import ModelLoadError

    for spec in ("someorg/nosuch", "tiny-drft"):
        with pytest.raises(ModelLoadError) as loaded:
            load_model(spec)
        code, out, err = cli("sample", "Once", "-m", spec, "--threads", "1")
        assert code == 2 and err == f"error: {loaded.value}\n"


def test_what_is_not_a_model_name_is_left_alone(cli, toy_model_dir):
    """'ngram' is a proposer, an empty prompt under --chat is wrapped by the template, and a model that is not
    bundled may add a BOS token to an empty prompt: none is refused early."""
    code, out, err = cli("speculate", "Once upon", "--draft", "ngram", "-n", "2", "-f", "json", "--threads", "1")
    assert code == 0, err
    from decodelab.cli.early import check_empty_prompt
    from types import SimpleNamespace as S

    check_empty_prompt(S(prompt="", model="tiny", chat=True, prompt_file=None))
    check_empty_prompt(S(prompt="", model=str(toy_model_dir), chat=False, prompt_file=None))
    check_empty_prompt(S(prompt=" ", model="tiny", chat=False, prompt_file=None))


def test_the_bundled_tokenizers_add_no_token_to_an_empty_prompt():
    """Why the early check may refuse an empty prompt for a bundled model: it is 0 tokens there."""
    from transformers import AutoTokenizer

    from decodelab.core.engine.locate import BUNDLED, bundled_dir

    for name in BUNDLED:
        assert AutoTokenizer.from_pretrained(bundled_dir(name))("")["input_ids"] == []


def test_a_piped_prompt_loses_one_trailing_newline(cli, toy_model_dir, monkeypatch):
    """`echo TEXT | decodelab sample -`: the prompt is TEXT, not TEXT plus echo's newline; a second newline, typed,
    stays (issue 40: the newline became a prompt token)."""
    import io
    import json

    def prompt_of(stdin: str | None, arg: str = "-") -> dict:
        if stdin is not None:
            monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
        code, out, err = cli("probs", arg, "-m", toy_model_dir, "-f", "json", "--threads", "1")
        assert code == 0, err
        return json.loads(out)["prompt"]

    typed = prompt_of(None, "Once upon")
    assert prompt_of("Once upon\n") == typed
    assert prompt_of("Once upon") == typed
    assert prompt_of("Once upon\n\n") == prompt_of(None, "Once upon\n")


def test_a_high_temperature_gets_a_note_naming_threads(cli, toy_model_dir):
    """`-t 4` means 4 threads to a llama-cli user: a temperature above 2 gets one note after the output; 2 and below,
    none; an error stays one line."""
    code, out, err = cli("sample", "Once", "-m", toy_model_dir, "-n", "2", "-t", "4", "-f", "json", "--threads", "1")
    notes = [line for line in err.splitlines() if "did you mean --threads" in line]  # (a busy machine adds its own)
    assert code == 0 and notes == ["note: temperature 4 samples nearly uniformly (did you mean --threads 4? -t is "
                                   "--temperature here)"], err
    code, out, err = cli("sample", "Once", "-m", toy_model_dir, "-n", "2", "-t", "2", "-f", "json", "--threads", "1")
    assert code == 0 and "did you mean" not in err
    code, out, err = cli("sample", "Once", "-m", toy_model_dir, "-t", "4", "--top-p", "2", "--threads", "1")
    assert code == 2 and err.count("\n") == 1


@pytest.mark.parametrize("args,hint", [
    (["sample", "hi", "--set", "temprature=1"], "unknown setting 'temprature' (did you mean 'temperature'?); allowed:"),
    (["sample", "hi", "--set", "top-kk=3"], "(did you mean 'top_k'?)"),
    (["compare", "hi", "-V", "a: top_pp=0.5"], "is not KEY=VALUE with a known key (did you mean 'top_p'?); allowed:"),
    (["sample", "hi", "--set", "warmth=3"], "unknown setting 'warmth'; allowed:"),  # nothing close: no guess
])
def test_a_mistyped_setting_gets_did_you_mean(cli, args, hint):
    code, out, err = cli(*args, "--threads", "1")
    assert code == 2 and hint in err and err.count("\n") == 1, err


def test_a_path_is_left_to_the_loader_so_a_bad_value_is_reported_first(cli):
    """A folder path is checked when the model loads: a bad value is then the one line, as before (the bad-input
    tests rely on it, with a folder that does not exist)."""
    code, out, err = cli("sample", "Hi", "-m", "/nonexistent/model", "--seed", "-1", "--threads", "1")
    assert code == 2 and "--seed -1" in err and err.count("\n") == 1
