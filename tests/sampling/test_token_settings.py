"""Token resolution (core/sampling/tokens.py): settings that name tokens (--ban, --allow, --sequence-bias,
--dry-breaker) become token ids, through a tokenizer's functions or, with no model, as ids typed on the command line.

Written for the mutation run of core/sampling/chain.py, registry.py and tokens.py (2026-12-02): each case is worked by
hand on a five-token vocabulary, so its numbers reach the lines a plausible edit would change (the last id in range
and the first past it, a list with two bad ids, a breaker inside several tokens' texts)."""

from __future__ import annotations

import pytest

from decodelab.core.errors import ConfigError
from decodelab.core.sampling.semantics import DEFAULT_DRY_BREAKERS
from decodelab.core.sampling.tokens import dry_breakers, token_sequence

TEXTS = ["a", "b:", ":", "c", "::"]  # token i's text in a five-token vocabulary
ENCODE = {":": [2], "a": [0], "ab": [0, 1]}


def encode(text: str) -> list[int]:
    return list(ENCODE.get(text, []))


def refusal(call) -> str:
    with pytest.raises(ConfigError) as err:
        call()
    return str(err.value)


def test_ids_typed_without_a_model_are_read_with_commas_or_spaces_and_bounded_by_the_vocabulary():
    """With no tokenizer a sequence is ids, comma- or space-separated; [0, vocab) is allowed, both ends checked."""
    assert token_sequence("3,4", "--ban", 5, None) == (3, 4)
    assert token_sequence(" 0 4 ", "--ban", 5, None) == (0, 4)  # the first and last ids of the vocabulary
    assert token_sequence("1, 2", "--ban", 5, None) == (1, 2)
    assert refusal(lambda: token_sequence("5", "--ban", 5, None)) == "--ban '5': token id 5 out of range [0, 5)"
    # the first id out of range is the one named
    assert refusal(lambda: token_sequence("2 6 7", "--allow", 5, None)) == (
        "--allow '2 6 7': token id 6 out of range [0, 5)")
    assert refusal(lambda: token_sequence("-1", "--ban", 5, None)) == "--ban '-1': token id -1 out of range [0, 5)"


def test_ids_typed_without_a_model_refuse_text_an_empty_list_and_a_number_past_every_bound():
    assert refusal(lambda: token_sequence("3 x", "--ban", 5, None)) == (
        "--ban '3 x': without a model give token ids, e.g. '3' or '3 4'")
    assert refusal(lambda: token_sequence(" , ", "--sequence-bias", 5, None)) == (
        "--sequence-bias ' , ': give at least one token id")
    long = "9" * 41  # past inputs.MAX_DIGITS: parse_int's refusal names the option it was handed
    assert refusal(lambda: token_sequence(long, "--ban", 5, None)).startswith("--ban 999999999999...: 41 digits")


def test_texts_with_a_tokenizer_are_its_tokens_and_a_text_of_no_tokens_is_refused():
    assert token_sequence("ab", "--ban", 5, encode) == (0, 1)
    assert refusal(lambda: token_sequence("zz", "--ban", 5, encode)) == "--ban 'zz': encodes to no tokens"


def test_dry_breakers_add_every_token_whose_text_contains_the_breaker():
    """':' encodes to token 2, and tokens 1 ('b:') and 4 ('::') contain it: llama.cpp's whole-token overlaps. The
    breaker's own encoding comes first; duplicates (token 2 again) are dropped."""
    got = dry_breakers((":",), 5, encode, TEXTS.__getitem__)
    assert got == ((2,), (1,), (4,))
    assert dry_breakers((":",), 5, encode) == ((2,),)  # no token_text: the encoding alone
    assert dry_breakers(("3",), 5) == ((3,),)  # no tokenizer: ids


def test_dry_breakers_default_to_llamacpps_with_a_tokenizer_and_to_none_without():
    seen = []

    def recording(text):
        seen.append(text)
        return [0]

    assert dry_breakers((), 5, recording) == ((0,),)
    assert tuple(seen) == DEFAULT_DRY_BREAKERS
    assert dry_breakers((), 5) == ()


def test_a_dry_breaker_is_refused_under_its_own_option():
    assert refusal(lambda: dry_breakers(("x y",), 5)) == (
        "--dry-breaker 'x y': without a model give token ids, e.g. '3' or '3 4'")


# --- the 99 mutants of the first run stopped at the time limit: their only callers were CLI tests -------------------


def recording_tokenizer():
    """encode(text) -> [1 if special tokens are added else 0] + code points: which flag it got shows in the ids."""
    from types import SimpleNamespace

    return SimpleNamespace(encode=lambda text, add_special_tokens=True: [int(add_special_tokens)] + [ord(c) for c in text])


def test_tokens_of_a_model_encode_without_special_tokens_and_keep_the_models_functions():
    from types import SimpleNamespace

    from decodelab.core.sampling.tokens import Tokens

    tok = recording_tokenizer()
    lm = SimpleNamespace(vocab_size=300, tokenizer=tok, token_id=lambda text: 7, token_text=lambda i: "t")
    t = Tokens.of(lm)
    assert t.encode("ab") == [0, 97, 98]  # add_special_tokens=False
    assert t.vocab == 300 and t.token_id is lm.token_id and t.token_text is lm.token_text and t.tokenizer is tok
    assert not t.checking


def test_placeholder_tokens_make_every_text_token_zero_in_an_unbounded_vocabulary():
    from decodelab.core.sampling.tokens import Tokens

    t = Tokens.placeholder()
    assert t.vocab == 2**31 and t.encode("any text") == [0] and t.token_id("x") == 0
    assert t.token_text is None and t.tokenizer is None and t.checking is True


def test_resolve_reads_logit_bias_by_id_or_text_and_adds_repeats():
    from decodelab.core.sampling.settings import ChainSettings
    from decodelab.core.sampling.tokens import Tokens, resolve

    ids = {"x": 3, "y": 4}

    def token_id(text):
        if text not in ids:
            raise ConfigError(f"{text!r} is not one token")
        return ids[text]

    tokens = Tokens(5, encode, token_id, TEXTS.__getitem__)
    s = ChainSettings(logit_bias=(("x", 1.5), ("3", 0.5), ("1", -2.0)), ban=("ab",), allow=("a", ":"),
                      sequence_bias=(("ab", 0.25),), dry_multiplier=0.8, dry_breaker=(":",), regex="a+")
    got = resolve(s, tokens)
    assert got["bias"] == {3: 2.0, 1: -2.0}
    assert got["ban"] == ((0, 1),) and got["allow"] == (0, 2) and got["sequence-bias"] == (((0, 1), 0.25),)
    assert got["dry-breakers"] == ((2,), (1,), (4,))
    assert (got["constraint"].option, got["constraint"].value) == ("--regex", "a+")
    assert "dry-breakers" not in resolve(ChainSettings(), tokens)
    assert resolve(ChainSettings(), tokens)["constraint"] is None
    assert refusal(lambda: resolve(ChainSettings(logit_bias=(("z", 1.0),)), tokens)) == (
        "--logit-bias z=1.0: 'z' is not one token")
    assert refusal(lambda: resolve(ChainSettings(logit_bias=(("5", 1.0),)), tokens)) == (
        "--logit-bias 5=1.0: token id out of range [0, 5)")
    assert refusal(lambda: resolve(ChainSettings(logit_bias=(("x", 1.0),)), Tokens(5))) == (
        "--logit-bias x=1.0: without a model TOKEN must be a token id")
    assert resolve(ChainSettings(logit_bias=(("4", 1.0), ("0", 1.0))), Tokens(5))["bias"] == {4: 1.0, 0: 1.0}


def test_each_token_setting_is_refused_under_its_own_option_and_each_constraint_option_reaches_the_spec(tmp_path):
    from decodelab.core.sampling.settings import ChainSettings
    from decodelab.core.sampling.tokens import Tokens, resolve

    ids_only = Tokens(5)
    hint = "without a model give token ids, e.g. '3' or '3 4'"
    assert refusal(lambda: resolve(ChainSettings(allow=("x",)), ids_only)) == f"--allow 'x': {hint}"
    assert refusal(lambda: resolve(ChainSettings(sequence_bias=(("x", 1.0),)), ids_only)) == (
        f"--sequence-bias 'x': {hint}")
    assert refusal(lambda: resolve(ChainSettings(ban=("x",)), ids_only)) == f"--ban 'x': {hint}"
    long = "9" * 41
    assert refusal(lambda: resolve(ChainSettings(logit_bias=((long, 1.0),)), ids_only)).startswith(
        f"--logit-bias {long}=1.0: TOKEN 999999999999...: 41 digits")
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "a"\n')
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "integer"}')
    for settings, option in [(ChainSettings(choice="yes,no"), "--choice"),
                             (ChainSettings(grammar=str(grammar)), "--grammar"),
                             (ChainSettings(json_schema=str(schema)), "--json-schema")]:
        assert resolve(settings, ids_only)["constraint"].option == option
