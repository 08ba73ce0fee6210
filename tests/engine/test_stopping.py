"""Stopping (core/engine/stopping.py): EOS and --ignore-eos, stop strings that span tokens or single bytes, the
constant detokenized window, the capacity of the stop rules, trim_stop; and the one-line errors of the checks made
beside them (an empty or too long prompt, a selected token the chain left no candidate for)."""

from __future__ import annotations

import json

import pytest
import torch

from decodelab.core.errors import ChainError
from decodelab.core.engine.stopping import StopChecker, StopRules
from decodelab.core.sampling.chain import build_chain

from conftest import NEG


# --- --ignore-eos when the model emits EOS --------------------------------------------------------------------


def test_stop_checker_ignores_eos_only_when_asked():
    """Bug: ignore_eos has no effect. The token 0 is EOS: it ends the run, unless EOS is ignored."""
    rules = StopRules(max_new_tokens=3, eos_ids=(0,))
    assert StopChecker(rules).check([0], 5) == "eos"
    ignoring = StopChecker(StopRules(max_new_tokens=3, eos_ids=(0,), ignore_eos=True))
    assert [ignoring.check([0] * i, 4 + i) for i in (1, 2, 3)] == [None, None, "length"]


@pytest.fixture(scope="module")
def toy_eos(toy_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(toy_model_dir).eos_token_id


@pytest.mark.parametrize("command", ["sample", "speculate"])
def test_ignore_eos_through_the_cli(cli, toy_model_dir, toy_eos, command):
    """Bug: --ignore-eos not passed on to the stop rules. A +1e4 bias makes EOS every step's only likely token:
    with --ignore-eos the run makes exactly -n tokens, all EOS; without it, one token and stop_reason eos."""
    extra = ["--draft", "ngram"] if command == "speculate" else []
    args = [command, "Hello", "-m", toy_model_dir, "-n", "4", "-t", "0", "--logit-bias", f"{toy_eos}=1e4",
            *extra, "-f", "json"]
    code, out, err = cli(*args, "--ignore-eos")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["token_ids"] == [toy_eos] * 4 and doc["summary"]["stop_reason"] == "length"
    code, out, err = cli(*args)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["token_ids"] == [toy_eos] and doc["summary"]["stop_reason"] == "eos"


# --- a stop string spanning tokens -----------------------------------------------------------------------------


PIECES = {1: "he", 2: "llo", 3: " w", 4: "or", 5: "ld", 6: "x"}


def detok(ids: list[int]) -> str:
    return "".join(PIECES[i] for i in ids)


def first_stop(tokens: list[int], stops: tuple[str, ...]) -> tuple[int, str] | None:
    """Feed tokens one by one; (how many were emitted, reason) at the first stop."""
    checker = StopChecker(StopRules(max_new_tokens=100, stop_strings=stops), detok)
    for i in range(1, len(tokens) + 1):
        reason = checker.check(tokens[:i], i)
        if reason is not None:
            return i, reason
    return None


def test_stop_string_spanning_two_tokens():
    """Bug: only the newest token's text is searched. "ell" lies across "he" + "llo"; "lo w" across "llo" + " w";
    "hello world" across all five tokens, after some filler that pushes it away from the start."""
    assert first_stop([1, 2, 6], ("ell",)) == (2, "stop")
    assert first_stop([1, 2, 3, 4], ("lo w",)) == (3, "stop")
    filler = [6] * 40
    assert first_stop(filler + [1, 2, 3, 4, 5, 6], ("hello world",)) == (45, "stop")
    assert first_stop([1, 2, 3], ("hex",)) is None


def test_stop_string_made_of_single_byte_tokens():
    """Bug: a search window counted in characters, not in the worst-case tokens. Byte tokens: the two emoji of
    the stop string are 8 tokens (4 bytes each) for 2 characters, all of which must be in the window."""
    stop = "\U0001F600\U0001F600"
    tokens = list(b"ab" * 10) + list(stop.encode()) + list(b"c")
    checker = StopChecker(StopRules(max_new_tokens=100, stop_strings=(stop,)),
                          lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    reasons = [checker.check(tokens[:i], i) for i in range(1, len(tokens) + 1)]
    assert reasons.index("stop") == 20 + 8 - 1  # the stop string's last byte


# --- exact edges: the cases mutation testing (tests/mutation/run.sh) showed no other test pinned down -------------


def test_stop_rules_capacity_prompt_checks_and_the_selected_token_check():
    """Capacity: prompt + -n, never past the context, never below the prompt. The prompt checks and the check of
    the selected token each give their one line."""
    from decodelab.core.errors import ConfigError
    from decodelab.core.engine.stopping import StopRules
    from decodelab.core.engine.tokens import check_prompt
    from decodelab.core.sampling.step import check_selected

    assert StopRules(100).capacity(4) == 104
    assert StopRules(100, context_length=10).capacity(4) == 10 and StopRules(3, context_length=10).capacity(4) == 7
    assert StopRules(100, context_length=10).capacity(12) == 12
    with pytest.raises(ConfigError) as err:
        check_prompt(0, None)
    assert str(err.value) == "PROMPT: the prompt is empty (0 tokens); give some text"
    with pytest.raises(ConfigError) as err:
        check_prompt(5, 5)
    assert str(err.value) == "PROMPT: the prompt is 5 tokens but the model's context is 5; shorten it"
    check_prompt(4, 5)
    check_prompt(4, None)
    chain = build_chain({"temperature": 0.5})
    check_selected(True, chain)
    with pytest.raises(ChainError, match=r"^the chain \[temperature\] made a logit overflow"):
        check_selected(False, chain, torch.tensor([[float("nan"), 0.0]]))
    with pytest.raises(ChainError, match=r"^the chain \[temperature\] removed every candidate token"):
        check_selected(False, chain, torch.tensor([[NEG, NEG]]))


def test_stop_strings_detokenize_a_constant_window_and_need_a_detokenizer():
    """A stop string of 2 characters: each check detokenizes only the last 4 * 2 + 4 = 12 ids, however long the
    output (the cost per token is constant), and a match there is reason "stop". Without a detokenizer stop strings
    are not looked for; an empty stop string is dropped."""
    from decodelab.core.engine.stopping import StopChecker, StopRules

    sizes = []

    def detok(ids):
        sizes.append(len(ids))
        return "".join("ab"[i] for i in ids)

    checker = StopChecker(StopRules(100, stop_strings=("ba", "")), detok)
    assert checker.check([0] * 50, 50) is None and sizes == [12]
    assert checker.check([0] * 50 + [1, 0], 52) == "stop" and sizes == [12, 12]
    assert checker.strings == ("ba",)
    assert StopChecker(StopRules(100, stop_strings=("ba",)), None).check([1, 0], 2) is None


def test_trim_stop_cuts_the_first_occurrence_of_a_stop_string_present_in_the_text():
    """Ids 0 1 3 1 3 read "ab" "EN" "Dx" "EN" "Dx": "END" first occurs at 2, so the text is cut to "ab"; an absent
    stop string ("ZZ") takes no part; a stop id is dropped only when it is the last id; no match leaves the text."""
    from decodelab.core.engine.stopping import StopRules, trim_stop

    rules = StopRules(10, stop_strings=("ZZ", "", "END"), stop_ids=(9,))
    detok = lambda ids: "".join({0: "ab", 1: "EN", 3: "Dx", 9: "<s>"}[i] for i in ids)  # noqa: E731
    assert trim_stop([0, 1, 3, 1, 3], "stop", rules, detok) == ([0, 1, 3, 1, 3], "ab")
    assert trim_stop([0, 3, 9], "stop", rules, detok) == ([0, 3], "abDx")
    assert trim_stop([0, 9, 3], "stop", rules, detok) == ([0, 9, 3], "ab<s>Dx")
    assert trim_stop([0, 3], "stop", rules, detok) == ([0, 3], "abDx")
    assert trim_stop([0, 1, 3], "eos", rules, detok) == ([0, 1, 3], "abENDx")



def test_stop_rules_from_a_model_and_settings():
    """stop_rules reads -n (an explicit count first), the model's EOS ids and context, and the settings' stop
    strings, --ignore-eos and stop ids; settings without stop fields (a command that has none) give none. Only a
    model with no context bounds -n, by MAX_NEW_TOKENS, in one line naming the model; the explicit count is the
    one checked. Bugs caught: a field dropped or read from the wrong place, the bound applied to a model that has
    a context, the settings' -n checked instead of the explicit one."""
    from types import SimpleNamespace

    from decodelab.core.errors import ConfigError
    from decodelab.core.engine.stopping import MAX_NEW_TOKENS, stop_rules

    lm = SimpleNamespace(context_length=64, eos_ids=[2, 3], name="toy")
    settings = SimpleNamespace(max_new_tokens=10, stop=["END"], ignore_eos=True, stop_id=[7])
    assert stop_rules(lm, settings) == StopRules(10, (2, 3), ("END",), True, 64, (7,))
    assert stop_rules(lm, settings, 5) == StopRules(5, (2, 3), ("END",), True, 64, (7,))
    bare = SimpleNamespace(max_new_tokens=4, ignore_eos=False)
    assert stop_rules(lm, bare) == StopRules(4, (2, 3), (), False, 64, ())
    assert stop_rules(lm, bare, 2**30).capacity(3) == 64  # a context bounds the run: no -n limit
    unbounded = SimpleNamespace(context_length=None, eos_ids=[2], name="toy")
    assert stop_rules(unbounded, bare, MAX_NEW_TOKENS).max_new_tokens == MAX_NEW_TOKENS
    with pytest.raises(ConfigError) as err:
        stop_rules(unbounded, bare, MAX_NEW_TOKENS + 1)
    assert str(err.value) == (f"--max-new-tokens {MAX_NEW_TOKENS + 1}: 'toy' states no context length, so the run "
                              f"holds every token; at most {MAX_NEW_TOKENS}")


def test_the_context_stops_a_run_when_the_sequence_fills_it():
    """A context of 8: a sequence of 7 goes on, one of 8 (the context full) stops with reason "context", before
    -n is consulted, and an EOS there is still "eos". Bug caught: the run going one token past the context, the
    reason misnamed."""
    checker = StopChecker(StopRules(max_new_tokens=3, eos_ids=(0,), context_length=8))
    assert checker.check([5], 7) is None
    assert checker.check([5, 5, 5], 8) == "context"
    assert checker.check([5, 0], 8) == "eos"
