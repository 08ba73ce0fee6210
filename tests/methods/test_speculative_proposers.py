"""The suffix proposer and chained proposers: their drafts by hand, and exactness under the same verification
(greedy output with any proposer equals plain greedy; sampled, the first two tokens follow the target's law)."""

from __future__ import annotations

import json

import pytest
import torch

from decodelab.core.engine.stopping import StopRules
from decodelab.core.errors import ConfigError
from decodelab.core.methods.speculative.chained import ChainedProposer, make_proposer, members, model_member
from decodelab.core.methods.speculative.proposers import ModelProposer, NGramProposer
from decodelab.core.methods.speculative.run import Speculator
from decodelab.core.methods.speculative.suffix import SuffixProposer
from decodelab.core.sampling.chain import build_chain
from decodelab.core.sampling.select import Greedy

from conftest import random_model
from test_speculative import PROMPT, perturbed_copy, reference, run_spec


@pytest.fixture(scope="module")
def target():
    return random_model("llama", seed=0, vocab_size=256, scale=20.0)


def test_suffix_lookup_by_hand():
    s = SuffixProposer(depth=3, min_share=0.3)
    # "1 2 3" was followed by 4 twice and by 9 once; the longest match of the end "... 1 2 3" is 3 tokens
    tokens = [1, 2, 3, 4, 1, 2, 3, 9, 5, 1, 2, 3, 4, 7, 1, 2, 3]
    assert s.lookup(tokens, 1) == [4]
    # then "2 3 4" -> 1 (once) and 7 (once): tie, the one seen last (7)
    assert s.lookup(tokens, 2) == [4, 7]
    # a context whose best continuation is below the share stops the draft: [8] followed by 5 different tokens
    s = SuffixProposer(depth=2, min_share=0.3)
    assert s.lookup([8, 1, 8, 2, 8, 3, 8, 4, 8, 5, 8], 3) == []
    assert SuffixProposer().lookup([1, 2, 3], 4) == []  # nothing repeats: no proposal


def test_members_and_model_member():
    assert members("ngram,tiny-draft") == ["ngram", "tiny-draft"]
    assert model_member("ngram,suffix") is None and model_member("suffix,my/folder") == "my/folder"
    for bad in ("ngram,,suffix", "a,b", "ngram,ngram", ""):
        with pytest.raises(ConfigError, match="--draft"):
            members(bad)


def test_chain_first_that_proposes_wins_and_names_the_source(target):
    chain = build_chain({"temperature": 0})
    draft = perturbed_copy(target, 0.1)
    prop = ChainedProposer([NGramProposer(2), ModelProposer(draft, chain, Greedy(), "draft")])
    sp = Speculator(target, prop, PROMPT, chain, StopRules(40, context_length=256), 3, token_text=str)
    rounds = list(sp)
    sources = {r.source for r in rounds}
    assert sources - {""} == {"ngram-2", "draft"}, sources  # both members drafted some rounds
    for r in rounds:  # the n-gram drafts when its lookup finds a match, else the model
        if r.drafted == 0:  # the last token of -n: nothing asked, nothing drafted
            assert r.source == "" and r.final.kind == "plain"
            continue
        seen = sp.seq.tokens[: r.position]
        fresh = NGramProposer(2)
        fresh.start(None)
        assert (r.source == "ngram-2") == bool(fresh.lookup(seen, 1))
        assert r.to_dict()["source"] == r.source  # absent only from a round that drafted nothing
    assert sp.new_ids == reference(target, PROMPT, chain, StopRules(40, context_length=256))


@pytest.mark.parametrize("spec", ["suffix", "ngram,suffix", "suffix,draft", "ngram,draft", "draft,ngram"])
@pytest.mark.parametrize("chain_name", ["greedy", "penalty"])
def test_greedy_with_any_proposer_equals_plain_greedy(target, spec, chain_name):
    settings = {"greedy": {"temperature": 0}, "penalty": {"repetition-penalty": 1.3, "temperature": 0}}[chain_name]
    chain = build_chain(settings)
    rules = StopRules(36, context_length=256)
    ref = reference(target, PROMPT, chain, rules)

    class Loaded:  # what make_proposer reads of a loaded draft model
        model, name, context_length = perturbed_copy(target, 0.1), "draft", None

    for gamma in (1, 4):
        prop = make_proposer(spec, Loaded if "draft" in spec else None, chain, True, None, 3)
        sp = run_spec(target, prop, PROMPT, chain, rules, gamma)
        assert sp.new_ids == ref, (spec, gamma)


def test_sampled_chain_follows_the_target_law():
    """The first two tokens of 600 seeded runs of 4 tokens with an n-gram,draft chain (the n-gram's point masses and
    the draft's q in the same run) against the exact two-token law (the statistical test of test_speculative)."""
    from decodelab.core.engine.forward import forward
    from decodelab.core.sampling.distribution import softmax
    from decodelab.core.sampling.select import Multinomial, make_generator
    from test_speculative import assert_follows

    V, runs, prompt = 16, 600, [3, 7, 3, 9]  # 9 unseen before: the model drafts round 0; later, often the n-gram
    tgt = random_model("llama", seed=3, vocab_size=V, scale=3.0)
    drf = random_model("llama", seed=4, vocab_size=V, scale=3.0)
    chain = build_chain({"temperature": 1.5, "top-k": 5})
    with torch.inference_mode():
        p1 = softmax(chain(torch.tensor([prompt]), forward(tgt, torch.tensor([prompt]))[:, -1]))[0]
        exact = torch.zeros(V, V, dtype=torch.float64)
        for x1 in torch.nonzero(p1).flatten().tolist():
            ids = torch.tensor([prompt + [x1]])
            exact[x1] = p1[x1].double() * softmax(chain(ids, forward(tgt, ids)[:, -1]))[0].double()
    counts = torch.zeros(V, V, dtype=torch.float64)
    sources = set()
    for seed in range(runs):
        gen = make_generator(seed, "cpu")
        prop = ChainedProposer([NGramProposer(2), ModelProposer(drf, chain, Multinomial(gen), "draft")])
        sp = Speculator(tgt, prop, prompt, chain, StopRules(4), 2, gen, token_text=str)
        sources |= {r.source for r in sp}
        counts[sp.new_ids[0], sp.new_ids[1]] += 1
    assert sources - {""} == {"ngram-2", "draft"}
    assert_follows(exact, counts, runs)


def test_cli_suffix_and_chain(cli, toy_model_dir):
    code, out, err = cli("speculate", "a b c a b c a b", "-n", "8", "-t", "0", "--draft", "suffix", "--sweep-gamma",
                         "1,2", "-m", toy_model_dir, "-f", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert {s.get("source", "") for s in doc["steps"]} <= {"suffix-8", ""} and [r["gamma"] for r in doc["sweep"]] == [1, 2]
    code, out, err = cli("speculate", "a b c a b c a b", "-n", "8", "-t", "0", "--draft", "ngram,ngram",
                         "-m", toy_model_dir)
    assert code == 2 and "--draft" in err and "Traceback" not in err
