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
    (["sample", "Once", "-m", "someorg/nosuch"], "--model someorg/nosuch: not a bundled name (tiny, tiny-draft), a "
     "local folder, or a model in the local Hugging Face cache (decodelab never downloads)"),
    (["sample", "Once", "-m", "./no-such-folder"], "--model ./no-such-folder: no model folder there"),
    (["speculate", "Once", "--draft", "tiny-drft"], "--draft tiny-drft: not a bundled name (tiny, tiny-draft)"),
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

    for spec in ("someorg/nosuch", str(tmp_path / "absent")):
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
