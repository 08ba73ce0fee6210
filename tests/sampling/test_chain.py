"""The chain (core/sampling/chain.py): build_chain's stages in the default order and its --chain errors, the ids it
hands its stages, accept and reset, run_recorded, the states of stateful stages, and the emptiness check with its two
messages (an overflow, a chain that removed every candidate)."""

from __future__ import annotations

import pytest
import torch

from decodelab.core.errors import ChainError
from decodelab.core.sampling.chain import build_chain, check_not_empty

from conftest import NEG


# --- exact edges: the cases mutation testing (tests/mutation/run.sh) showed no other test pinned down -------------


def test_emptiness_is_checked_per_row():
    """A batch where one row still has candidates and another has none is an error; NaN anywhere is too."""
    rows = torch.tensor([[0.0, NEG, 1.0], [NEG, NEG, NEG]])
    with pytest.raises(ChainError, match=r"the chain \[top-k, top-p\] removed every candidate token"):
        check_not_empty(rows, ["top-k", "top-p"])
    check_not_empty(torch.tensor([[0.0, NEG, NEG], [NEG, 2.0, NEG]]), ["x"])  # every row has one: fine
    with pytest.raises(ChainError):
        check_not_empty(torch.tensor([[0.0, 1.0, 2.0], [0.0, float("nan"), 1.0]]), ["x"])


def test_the_checked_chain_passes_the_ids_to_its_stages():
    """Chain.__call__ with a stage that reads the sequence: repetition penalty 2 on tokens 0 and 1."""
    chain = build_chain({"repetition-penalty": 2.0})
    out = chain(torch.tensor([[0, 1]]), torch.tensor([[2.0, -2.0, 1.0]]))
    assert out.tolist() == [[1.0, -4.0, 1.0]]


def test_chain_hands_accept_the_token_and_run_recorded_the_ids():
    from decodelab.core.sampling.chain import Chain
    from decodelab.core.sampling.penalties import RepetitionPenalty
    from decodelab.core.sampling.scaling import Temperature

    class Counting:
        name = "counting"

        def __init__(self):
            self.seen = []

        def __call__(self, ids, logits):
            return logits

        def accept(self, token):
            self.seen.append(token.tolist())

        def reset(self, prompt_len):
            self.prompt_len = prompt_len

    stage = Counting()
    chain = Chain([Temperature(1.0), stage])
    chain.reset(7)
    chain.accept(torch.tensor([3]))
    chain.accept(torch.tensor([4]))
    assert stage.seen == [[3], [4]] and stage.prompt_len == 7
    out, stages = Chain([RepetitionPenalty(2.0)]).run_recorded(torch.tensor([[1]]), torch.tensor([[1.0, 4.0]]))
    assert out.tolist() == [[1.0, 2.0]] and [n for n, _ in stages] == ["raw", "repetition-penalty"]


def test_build_chain_maps_every_stage_name_to_its_processor_in_the_default_order():
    """Every stage of this module by name, with its value, in DEFAULT_ORDER; a stage of samplers.py gets its value
    and the context (min-new-tokens bans the context's end ids)."""
    from decodelab.core.sampling import biases, filters, penalties, scaling
    from decodelab.core.sampling.biases import MinNewTokens
    from decodelab.core.sampling.registry import StageContext

    settings = {"typical-p": 0.9, "min-p": 0.05, "top-p": 0.8, "top-k": 7, "temperature": 0.5, "bias": {1: 2.0},
                "no-repeat-ngram": 3, "repetition-penalty": 1.3, "softcap": 30.0}
    chain = build_chain(settings)
    want = [(scaling.SoftCap, "cap", 30.0), (penalties.RepetitionPenalty, "penalty", 1.3), (penalties.NoRepeatNGram, "n", 3),
            (biases.LogitBias, "bias", {1: 2.0}), (scaling.Temperature, "temperature", 0.5), (filters.TopK, "k", 7),
            (filters.TopP, "p", 0.8), (filters.MinP, "min_p", 0.05), (filters.TypicalP, "mass", 0.9)]
    assert [(type(p), getattr(p, field)) for p, (_, field, _) in zip(chain.processors, want)] == [
        (cls, value) for cls, _, value in want]
    (stage,) = build_chain({"min-new-tokens": 2}, context=StageContext(end_ids=(5,))).processors
    assert isinstance(stage, MinNewTokens) and (stage.n, stage.end_ids) == (2, (5,))


def test_build_chain_counts_the_repetition_penalty_as_the_context_says_and_names_chain_errors():
    """A context that counts repetition over the last 4 tokens builds the windowed penalty with that penalty; one
    that counts all tokens keeps the plain one. --chain errors are one line each."""
    from decodelab.core.errors import ConfigError
    from decodelab.core.sampling.registry import DEFAULT_ORDER
    from decodelab.core.sampling.penalties import RepetitionPenalty
    from decodelab.core.sampling.registry import StageContext
    from decodelab.core.sampling.penalties import WindowedRepetitionPenalty

    context = StageContext(counting={"repetition-penalty": ("all", 4)})
    (stage,) = build_chain({"repetition-penalty": 1.5}, context=context).processors
    assert isinstance(stage, WindowedRepetitionPenalty) and (stage.penalty, stage.last_n) == (1.5, 4)
    (plain,) = build_chain({"repetition-penalty": 1.5}, context=StageContext()).processors
    assert type(plain) is RepetitionPenalty
    settings = {"temperature": 0.5, "top-k": 3}
    for order, message in [
        (["temperature", "top-k", "top-k"], "--chain: a stage is named twice"),
        (["temperature", "nope"], f"--chain: unknown stage 'nope'; allowed: {', '.join(DEFAULT_ORDER)}"),
        (["temperature", "top-k", "top-p"], "--chain names 'top-p' but that stage has no value set; set it or drop it"),
        (["top-k"], "--chain leaves out 'temperature', which is set; add it to --chain or unset it"),
    ]:
        with pytest.raises(ConfigError) as err:
            build_chain(settings, order)
        assert str(err.value) == message
    assert [p.name for p in build_chain(settings, ["top-k", "temperature"]).processors] == ["top-k", "temperature"]


# --- found by the mutation run of 2026-11-30 (tests/mutation/SURVIVORS.md lists what no test can tell apart) ------


def test_the_emptiness_error_tells_an_overflow_from_a_chain_that_removed_everything():
    """NaN (inf - inf) or +inf in a row is an overflow, with its own message; a row of -inf is an emptied chain."""
    from decodelab.core.sampling.chain import empty_chain_error

    overflow = ("the chain [temperature] made a logit overflow to +inf or NaN: a value too extreme for float32 (such "
                "as a --temperature or --repetition-penalty near 0); use a less extreme value")
    with pytest.raises(ChainError) as err:
        check_not_empty(torch.tensor([[0.0, 1.0], [0.0, float("nan")]]), ["temperature"])
    assert str(err.value) == overflow
    assert str(empty_chain_error(["temperature"], torch.tensor([[float("inf"), 0.0]]))) == overflow
    emptied = "the chain [top-k, bias] removed every candidate token; loosen the filters or bans"
    assert str(empty_chain_error(["top-k", "bias"], torch.tensor([[NEG, NEG]]))) == emptied
    assert str(empty_chain_error(["top-k", "bias"])) == emptied


def test_chain_states_are_named_stage_dot_key_in_chain_order():
    """Only stages with a state() report; each value is the stage's own tensor, named "<stage>.<key>"."""
    from decodelab.core.sampling.chain import Chain
    from decodelab.core.sampling.scaling import Temperature

    class Stateful:
        def __init__(self, name, state):
            self.name, self._state = name, state

        def __call__(self, ids, logits):
            return logits

        def state(self):
            return self._state

    mu, coin, t = torch.tensor([3.0]), torch.tensor([1.0]), torch.tensor([0.5])
    chain = Chain([Stateful("mirostat", {"mu": mu}), Temperature(1.0), Stateful("xtc", {"coin": coin, "t": t})])
    names = [name for name, _ in chain.states()]
    assert names == ["mirostat.mu", "xtc.coin", "xtc.t"]
    assert all(value is want for (_, value), want in zip(chain.states(), (mu, coin, t)))
    assert Chain([Temperature(1.0)]).states() == []



# --- mutation run of core/sampling/chain.py, registry.py and tokens.py (2026-12-02) -------------------------------


def test_stepwise_stages_are_refused_with_their_own_options_and_others_pass():
    """XTC (its own coin) and mirostat (mu carried from step to step) cannot score several continuations at once;
    the line names the stage's options (XTC's threshold alone does not switch it on, so only its probability)."""
    from types import SimpleNamespace

    from decodelab.core.errors import ConfigError
    from decodelab.core.sampling.chain import Chain, refuse_stepwise_stages

    def chain(*names):
        return Chain([SimpleNamespace(name=n) for n in names])

    refuse_stepwise_stages(chain("top-k", "temperature", "top-p", "dry"), "beam search")
    tail = "draws its own coin or carries state from step to step; drop it for this command"
    with pytest.raises(ConfigError) as err:
        refuse_stepwise_stages(chain("top-k", "xtc"), "beam search")
    assert str(err.value) == f"--xtc-probability: beam search scores several continuations per step, and xtc {tail}"
    with pytest.raises(ConfigError) as err:
        refuse_stepwise_stages(chain("mirostat"), "speculative decoding")
    assert str(err.value) == (f"--mirostat-tau/--mirostat-eta: speculative decoding scores several continuations "
                              f"per step, and mirostat {tail}")


def test_build_shares_the_selectors_generator_and_resolves_texts_with_the_tokenizers_functions():
    """``build``: XTC's coin comes from the selector's own generator (one seed, one stream), and --ban, --logit-bias
    and --dry-breaker texts go through the functions handed in (encode, token_id, token_text)."""
    from conftest import build
    from decodelab.core.sampling.settings import ChainSettings

    texts = ["a", "b:", ":", "c", "::"]
    encoded = {"ab": [0, 1], ":": [2]}
    s = ChainSettings(temperature=1.0, xtc_probability=0.5, ban=("ab",), logit_bias=(("c", 2.0),),
                      dry_multiplier=0.8, dry_breaker=(":",))
    _, chain, selector = build(s, 5, 0, "cpu", encode=lambda t: encoded[t], token_id=texts.index,
                               token_text=texts.__getitem__)
    stage = {p.name: p for p in chain.processors}
    assert stage["xtc"].generator is selector.generator
    assert stage["ban"].sequences == ((0, 1),)
    assert stage["bias"].bias == {3: 2.0}
    assert stage["dry"].breakers == ((2,), (1,), (4,))


def test_make_chain_seeds_xtcs_coin_from_the_settings_and_hands_the_end_and_stop_ids_on():
    """``make_chain``: without a generator, one seeded by --seed (XTC's first coin equals a fresh generator's of that
    seed, not of seed 0); a generator handed in is the one XTC uses; min-new-tokens bans the model's end ids and the
    --stop-id ids."""
    from types import SimpleNamespace

    from decodelab.core.methods.sample import SampleSettings
    from decodelab.core.sampling.chain import make_chain
    from decodelab.core.sampling.select import make_generator

    tok = SimpleNamespace(encode=lambda text, add_special_tokens=True: [1])
    lm = SimpleNamespace(vocab_size=8, tokenizer=tok, token_id=lambda t: 1, token_text=lambda i: "t", device="cpu",
                         eos_ids=(6,))
    s = SampleSettings(temperature=1.0, xtc_probability=0.5, min_new_tokens=2, stop_id=(5,), seed=7)
    stage = {p.name: p for p in make_chain(lm, s).processors}
    coin = torch.rand(4, generator=stage["xtc"].generator)
    assert torch.equal(coin, torch.rand(4, generator=make_generator(7, "cpu")))
    assert not torch.equal(coin, torch.rand(4, generator=make_generator(0, "cpu")))
    assert set(stage["min-new-tokens"].end_ids) == {5, 6}
    mine = make_generator(3, "cpu")
    assert {p.name: p for p in make_chain(lm, s, mine).processors}["xtc"].generator is mine
    from decodelab.core.sampling.settings import ChainSettings  # no seed field: seed 0

    plain = {p.name: p for p in make_chain(lm, ChainSettings(temperature=1.0, xtc_probability=0.5)).processors}
    assert torch.equal(torch.rand(4, generator=plain["xtc"].generator), torch.rand(4, generator=make_generator(0, "cpu")))


def test_chain_for_hands_the_constraint_its_tokens():
    """The constraint stage reads the tokenizer and the logits width from the tokens chain_for is given."""
    from transformers import AutoTokenizer

    from decodelab.core.sampling.chain import chain_for
    from decodelab.core.sampling.settings import ChainSettings
    from decodelab.core.sampling.tokens import Tokens

    from conftest import BUNDLED_TOKENIZER

    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_TOKENIZER)
    tokens = Tokens(len(tokenizer), lambda t: tokenizer.encode(t, add_special_tokens=False), None, None, tokenizer)
    _, chain = chain_for(ChainSettings(regex="ab"), tokens, eos_ids=(0,))
    (stage,) = chain.processors
    assert stage.name == "constraint" and stage.vocabulary.size == len(tokenizer)


def test_range_checks_of_the_logit_bias_and_dynatemp_word_for_word():
    import math

    from decodelab.core.errors import ConfigError
    from decodelab.core.sampling.chain import validate_chain_ranges
    from decodelab.core.sampling.settings import ChainSettings

    def refusal(engine=None, **kw):
        with pytest.raises(ConfigError) as err:
            validate_chain_ranges(ChainSettings(**kw), engine)
        return str(err.value)

    assert refusal(logit_bias=(("5", math.nan),)) == "--logit-bias 5=nan: the bias must be a number or -inf"
    assert refusal(logit_bias=(("5", math.inf),)) == (
        "--logit-bias 5=inf: +inf cannot force a token (every other candidate would be NaN); use a large finite bias "
        "such as 100, or ban the others with -inf")
    validate_chain_ranges(ChainSettings(logit_bias=(("5", -math.inf),)))
    assert refusal(dynatemp_range=0.5, temperature=0.0) == (
        "--dynatemp-range 0.5: needs a temperature > 0 (-t 0 is greedy); the range is around -t")
    validate_chain_ranges(ChainSettings(dynatemp_range=0.5, temperature=0.0), "llamacpp")  # T over [0, 0.5]
    validate_chain_ranges(ChainSettings(dynatemp_range=0.5, temperature=1.0))
    # the texts are checked in stage order, and the logit bias (a stage before --ban) only after them all
    bad = "\udcff"
    assert refusal(logit_bias=((bad, 1.0),), ban=(bad,)).startswith("--ban ")
    assert refusal(logit_bias=((bad, 1.0),)).startswith("--logit-bias ")
