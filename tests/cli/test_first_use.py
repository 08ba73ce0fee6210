"""First use: help that comes at once, flags shown as flags, tables readable at 80 columns, shading that carries
meaning without 256 colours."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from rich.cells import cell_len

COMMANDS = ["sample", "probs", "beam", "speculate", "score", "stream", "quantize-kv", "compare", "bench", "batch",
            "models", "view", "check-logprobs", "warm"]


def help_in_fresh_python(*args: str) -> tuple[str, list[str]]:
    """The help text and the heavy modules loaded while printing it, in a fresh interpreter."""
    code = ("import sys\nfrom decodelab.cli.main import main\nrc = main(%r)\n"
            "print('LOADED', [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules])\n") % (list(args),)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"COLUMNS": "100", "PATH": "", "NO_COLOR": "1"})
    assert proc.returncode == 0, proc.stderr
    head, _, loaded = proc.stdout.rpartition("LOADED ")
    return head, eval(loaded)


@pytest.mark.parametrize("args", [["--help"], ["sample", "--help"], ["quantize-kv", "--help"], ["view", "--help"]])
def test_help_does_not_import_torch(args):
    text, loaded = help_in_fresh_python(*args)
    assert "Usage" in text
    assert loaded == []


def test_every_command_help_names_no_bool_metavar(cli):
    for command in COMMANDS:
        code, out, err = cli(command, "--help")
        assert code == 0, err
        assert "<bool>" not in out, command
        assert "--help" in out
    code, out, _ = cli("sample", "--help")
    assert "<int>" in out  # value options keep their type


def cut_numbers(text: str) -> list[str]:
    """Lines where an ellipsis touches a digit or a number's sign, point or exponent: a number cut short."""
    return [line for line in text.splitlines() if re.search(r"[0-9.eE+\-]…|…[0-9.]", line)]


TABLE_RUNS = {
    "sample": ["sample", "Hello", "-n", "6", "--top", "5", "-t", "0.7", "--top-p", "0.9", "--ignore-eos"],
    "probs": ["probs", "Once upon a", "--top", "10"],
    "beam": ["beam", "Once upon a", "-n", "4", "--beams", "3"],
    "speculate": ["speculate", "a b c a b c a b", "-n", "8", "--draft", "ngram", "--ignore-eos"],
    "score": ["score", "Once upon a time there was a girl"],
    "stream": ["stream", "Once upon a", "-n", "8", "--cache", "window:size=16", "--ignore-eos"],
    "quantize-kv": ["quantize-kv", "The quick brown fox jumps over the lazy dog. " * 3, "--limit", "8"],
    "compare": ["compare", "Once upon a", "-V", "a: temperature=0", "-V", "b: temperature=1.2", "-n", "6"],
    "batch": None,  # needs a prompts file: built in the test
    "bench": ["bench", "--settings", "greedy", "-n", "3", "--rounds", "1"],
}


@pytest.mark.parametrize("command", sorted(TABLE_RUNS))
def test_tables_at_80_columns_cut_no_number(cli, toy_model_dir, tmp_path, monkeypatch, command):
    monkeypatch.setenv("COLUMNS", "80")
    args = TABLE_RUNS[command]
    if args is None:
        prompts = tmp_path / "prompts.txt"
        prompts.write_text("Once upon a time\nThe cat\nHello there\n")
        args = ["batch", "--prompts-file", str(prompts), "-n", "4"]
    code, out, err = cli(*args, "-m", toy_model_dir)
    assert code == 0, err
    assert out.strip()
    assert cut_numbers(out) == []
    assert max(cell_len(line) for line in out.splitlines()) <= 80


def test_models_listing_at_80_columns_keeps_names_and_counts(cli, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = cli("models")
    assert code == 0, err
    assert "tiny-draft" in out and "…" not in out
    assert re.search(r"\b2,739,328\b", out) and re.search(r"\b1,606,400\b", out)  # the two bundled models' sizes
    assert max(cell_len(line) for line in out.splitlines()) <= 80
