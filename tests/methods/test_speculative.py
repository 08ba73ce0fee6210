"""Speculative decoding: the verification rule on hand vectors, exactness (greedy token for token, sampling in
distribution), cache rollback, the n-gram proposer, and the `speculate` command."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from decodelab.core.engine.models import check_same_vocabulary
from decodelab.core.methods.speculative import rule as _rule, timing as _timing
from decodelab.core.engine.stopping import StopRules
from decodelab.core.methods.sample import decode_tokens
from decodelab.core.engine.forward import forward
from decodelab.core.engine.runtime import Runtime
from decodelab.core.sampling.chain import build_chain
from decodelab.core.sampling.distribution import softmax
from decodelab.core.sampling.select import Greedy, Multinomial, make_generator
from decodelab.core.errors import ConfigError
from decodelab.core.methods.speculative.proposers import ModelProposer, NGramProposer, Sequence
from decodelab.core.methods.speculative.run import Speculator
from decodelab.core.methods.speculative.rule import acceptance_probability, expected_tokens, point_masses, predicted_speedup, residual_distribution, verify_greedy, verify_sampled

from conftest import BUNDLED_TOKENIZER, host_reads, random_model

ROOT = Path(__file__).resolve().parents[2]
BUNDLED_WEIGHTS = ROOT / "presets" / "models" / "tiny" / "model.safetensors"
DRAFT_WEIGHTS = ROOT / "presets" / "models" / "tiny-draft" / "model.safetensors"
PROMPT = [3, 17, 42, 9, 100, 17, 42]


@pytest.fixture(scope="module")
def target():
    return random_model("llama", seed=0, vocab_size=256, scale=20.0)


@pytest.fixture(scope="module")
def unrelated_draft():
    return random_model("qwen2", seed=5, vocab_size=256, scale=20.0)


def perturbed_copy(model, noise: float, seed: int = 0):
    """The same architecture and weights plus Gaussian noise: a draft that agrees often but not always."""
    clone = random_model("llama", seed=0, vocab_size=model.config.vocab_size, scale=1.0)
    clone.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in clone.parameters():
            param.add_(noise * param.std() * torch.randn(param.shape, generator=gen))
    return clone.eval()


def run_spec(target, proposer, prompt, chain, rules, gamma, generator=None):
    sp = Speculator(target, proposer, prompt, chain, rules, gamma, generator, record=False)
    for _ in sp:
        if len(sp.new_ids) < rules.max_new_tokens and sp.stop_reason == "length":  # not the last round
            assert sp.runtime.seen == sp.seq.length - 1  # all but the token the next round feeds
    return sp


def reference(target, prompt, chain, rules, selector=None):
    return [o.token_id for o in decode_tokens(target, prompt, chain, selector or Greedy(), rules)]


# --- the rule on vectors checkable by hand ------------------------------------------------------------------------


def test_accept_probability_and_residual_on_hand_vectors():
    p = torch.tensor([0.4, 0.35, 0.25])
    q = torch.tensor([0.2, 0.2, 0.6])
    # x = 2: q over-proposes it, accepted with p/q = 0.25/0.6 = 5/12; x = 0: p > q, always accepted
    assert float(acceptance_probability(p[2], q[2])) == pytest.approx(5 / 12)
    assert float(acceptance_probability(p[0], q[0])) == 1.0
    # max(0, p - q) = [0.2, 0.15, 0] -> normalised [4/7, 3/7, 0]
    assert residual_distribution(p, q).tolist() == pytest.approx([4 / 7, 3 / 7, 0.0])
    # a point-mass proposer (q = one-hot on x = 1): accept with p(1); residual = p without x, renormalised
    one_hot = torch.tensor([0.0, 1.0, 0.0])
    assert float(acceptance_probability(p[1], one_hot[1])) == pytest.approx(0.35)
    assert residual_distribution(p, one_hot).tolist() == pytest.approx([0.4 / 0.65, 0.0, 0.25 / 0.65])
    # p == q: nothing in excess; the rule never rejects there, the fallback is p itself
    assert residual_distribution(p, p).tolist() == pytest.approx(p.tolist())


def test_verify_sampled_hand_block():
    p = torch.tensor([[[0.4, 0.35, 0.25], [0.1, 0.1, 0.8]]])  # [1, g+1 = 2, V = 3]
    q = torch.tensor([[[0.2, 0.2, 0.6]]])
    drafts = torch.tensor([[2]])
    ones = torch.ones(1, 3)
    accepted = verify_sampled(p, q, drafts, torch.tensor([[0.4]]), ones)  # 0.4 < 5/12: accepted
    assert int(accepted.accepted) == 1
    assert accepted.final_probs[0].tolist() == pytest.approx([0.1, 0.1, 0.8])  # bonus: p at position 2
    assert int(accepted.token) == 2  # equal races: the argmax of the bonus distribution
    rejected = verify_sampled(p, q, drafts, torch.tensor([[0.5]]), ones)  # 0.5 > 5/12: rejected
    assert int(rejected.accepted) == 0
    assert rejected.final_probs[0].tolist() == pytest.approx([4 / 7, 3 / 7, 0.0])
    # the correction's law over many exponential races: 4/7, 3/7 and never the rejected token
    n = 200_000
    gen = torch.Generator().manual_seed(0)
    race = torch.empty(n, 3).exponential_(1.0, generator=gen)
    out = verify_sampled(p.expand(n, -1, -1), q.expand(n, -1, -1), drafts.expand(n, -1),
                         torch.full((n, 1), 0.5), race)
    freq = torch.bincount(out.token, minlength=3).double() / n
    assert freq.tolist() == pytest.approx([4 / 7, 3 / 7, 0.0], abs=0.005)


def test_verify_greedy_hand_block():
    best = [1, 0, 2]  # the target's argmax after s, s + x1, s + x1 x2
    assert verify_greedy(best, [1, 0]) == (2, 2)  # both accepted, bonus = argmax at the end
    assert verify_greedy(best, [1, 2]) == (1, 0)  # x2 rejected, correction = the target's argmax there
    assert verify_greedy(best, [0, 0]) == (0, 1)
    assert verify_greedy([4], []) == (0, 4)  # nothing drafted: a plain target step


def test_predicted_speedup_formula():
    # (1 - 0.8^5) / ((1 - 0.8)(4 * 0.1 + 1)) = 0.67232 / 0.28
    assert predicted_speedup(0.8, 0.1, 4) == pytest.approx(0.67232 / 0.28)
    assert predicted_speedup(1.0, 0.1, 4) == pytest.approx(5 / 1.4)  # the a -> 1 limit (g + 1) / (g c + 1)
    assert predicted_speedup(0.999999, 0.1, 4) == pytest.approx(5 / 1.4, rel=1e-4)
    assert predicted_speedup(0.0, 0.25, 2) == pytest.approx(1 / 1.5)
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


# --- the distribution of speculative sampling ---------------------------------------------------------------------


def chi2_threshold(df: int, z: float = 4.753) -> float:
    """Upper chi-square quantile by Wilson-Hilferty; z = 4.753 is the 1e-6 tail of the normal."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def chi2_and_tv(counts: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    n = counts.sum()
    expected = exact * n
    stat = float(((counts - expected) ** 2 / expected).sum())
    tv = 0.5 * float((counts / n - exact).abs().sum())
    return stat, tv


def draw(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return Multinomial(gen)(probs)


def first_two_tokens(P1, P2, P3, Q1, Q2, n: int, seed: int) -> torch.Tensor:
    """n independent runs of speculative sampling (gamma 2, then gamma 1 if the first round emitted only one
    token), vectorised over rows; returns the first two emitted tokens [n, 2].

    Target p(x1) = P1, p(x2 | x1) = P2[x1], p(x3 | x1 x2) = P3[x1, x2]; draft q likewise from Q1, Q2."""
    gen = torch.Generator().manual_seed(seed)
    V = P1.shape[0]
    x1 = draw(Q1.expand(n, -1), gen)
    x2 = draw(Q2[x1], gen)
    p = torch.stack([P1.expand(n, -1), P2[x1], P3[x1, x2]], dim=1)
    q = torch.stack([Q1.expand(n, -1), Q2[x1]], dim=1)
    one = _rule.verify_sampled(p, q, torch.stack([x1, x2], 1), torch.rand(n, 2, generator=gen),
                              torch.empty(n, V).exponential_(1.0, generator=gen))
    # rows that emitted a single token (a rejection at the first draft) run a second round from y
    y = one.token
    z1 = draw(Q2[y], gen)
    two = _rule.verify_sampled(torch.stack([P2[y], P3[y, z1]], 1), Q2[y].unsqueeze(1), z1.unsqueeze(1),
                              torch.rand(n, 1, generator=gen), torch.empty(n, V).exponential_(1.0, generator=gen))
    second_round_first = torch.where(two.accepted == 1, z1, two.token)
    k = one.accepted
    t1 = torch.where(k == 0, y, x1)
    t2 = torch.where(k == 0, second_round_first, torch.where(k == 1, y, x2))
    return torch.stack([t1, t2], 1)


def random_tables(V: int, seed: int, point_mass_draft: bool):
    gen = torch.Generator().manual_seed(seed)
    P1 = torch.softmax(torch.randn(V, generator=gen), -1)
    P2 = torch.softmax(torch.randn(V, V, generator=gen), -1)
    P3 = torch.softmax(torch.randn(V, V, V, generator=gen), -1)
    if point_mass_draft:  # a deterministic proposer (the n-gram case): always the same guess per prefix
        Q1 = torch.nn.functional.one_hot(torch.tensor(3), V).float()
        Q2 = torch.nn.functional.one_hot(torch.randint(0, V, (V,), generator=gen), V).float()
    else:
        Q1 = torch.softmax(1.5 * torch.randn(V, generator=gen), -1)
        Q2 = torch.softmax(1.5 * torch.randn(V, V, generator=gen), -1)
    return P1, P2, P3, Q1, Q2


def joint_counts(tokens: torch.Tensor, V: int) -> torch.Tensor:
    return torch.bincount(tokens[:, 0] * V + tokens[:, 1], minlength=V * V).double()


@pytest.mark.parametrize("point_mass_draft", [False, True], ids=["draft-distribution", "point-mass"])
def test_first_two_tokens_follow_the_target_distribution(point_mass_draft, monkeypatch):
    V, n = 8, 200_000
    P1, P2, P3, Q1, Q2 = random_tables(V, seed=1, point_mass_draft=point_mass_draft)
    exact = (P1[:, None] * P2).flatten().double()  # p(x1) p(x2 | x1), enumerated
    threshold = chi2_threshold(V * V - 1)
    stat, tv = chi2_and_tv(joint_counts(first_two_tokens(P1, P2, P3, Q1, Q2, n, seed=2), V), exact)
    assert stat < threshold, (stat, threshold, tv)
    assert tv < 0.02
    # the bound has teeth: resampling from p instead of norm(max(0, p - q)) after a rejection is caught
    monkeypatch.setattr(_rule, "residual_distribution", lambda p, q: p)
    wrong, wrong_tv = chi2_and_tv(joint_counts(first_two_tokens(P1, P2, P3, Q1, Q2, n, seed=2), V), exact)
    assert wrong > 10 * threshold, (wrong, threshold)
    assert wrong_tv > 0.03


def end_to_end_counts(target, draft, chain, prompt: list[int], runs: int, vocab: int):
    """The exact law of the first two tokens under the target's chain (enumerated) and the counts of the real loop
    (models, caches, chain) over ``runs`` seeds."""
    with torch.inference_mode():
        p1 = softmax(chain(torch.tensor([prompt]), forward(target, torch.tensor([prompt]))[:, -1]))[0]
        exact = torch.zeros(vocab, vocab, dtype=torch.float64)
        for x1 in torch.nonzero(p1).flatten().tolist():
            ids = torch.tensor([prompt + [x1]])
            p2 = softmax(chain(ids, forward(target, ids)[:, -1]))[0]
            exact[x1] = p1[x1].double() * p2.double()
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    rules = StopRules(2)
    accepted = 0
    for seed in range(runs):
        gen = make_generator(seed, "cpu")
        sp = run_spec(target, ModelProposer(draft, chain, Multinomial(gen)), prompt, chain, rules, 2, gen)
        counts[sp.new_ids[0], sp.new_ids[1]] += 1
        accepted += sp.stats.accepted
    return exact, counts, accepted


def assert_follows(exact: torch.Tensor, counts: torch.Tensor, runs: int) -> None:
    assert float(counts[exact == 0].sum()) == 0  # never a token the target's chain removed
    keep = exact.flatten() * runs >= 5  # pool the cells too small for the chi-square approximation
    observed = torch.cat([counts.flatten()[keep], counts.flatten()[~keep].sum().view(1)])
    law = torch.cat([exact.flatten()[keep], exact.flatten()[~keep].sum().view(1)])
    law, observed = law[law > 0], observed[law > 0]
    stat, tv = chi2_and_tv(observed, law / law.sum())
    assert stat < chi2_threshold(len(law) - 1), (stat, tv)


def test_end_to_end_sampling_distribution():
    """The real loop (models, caches, chain) over 600 seeds: the first two tokens match the exact law."""
    V, runs = 16, 600
    target = random_model("llama", seed=3, vocab_size=V, scale=3.0)
    draft = random_model("llama", seed=4, vocab_size=V, scale=3.0)
    chain = build_chain({"temperature": 1.5, "top-k": 5})  # the draft's top 5 differs: some q mass has p = 0
    exact, counts, _ = end_to_end_counts(target, draft, chain, [7], runs, V)
    assert_follows(exact, counts, runs)


def constrained_chain(values: dict, text: str):
    """A chain with the constraint first, bound to the bundled tokenizer (4096 tokens, end id 0) by the registry."""
    from transformers import AutoTokenizer

    from decodelab.core.sampling.constraint import constraint_spec
    from decodelab.core.sampling.registry import StageContext
    from decodelab.core.sampling.tokens import Tokens

    tok = AutoTokenizer.from_pretrained(BUNDLED_TOKENIZER)
    context = StageContext(eos_ids=(0,), tokens=Tokens(len(tok), tokenizer=tok))
    return build_chain({"constraint": constraint_spec(regex=text), **values}, context=context)


def test_end_to_end_sampling_distribution_under_a_constraint():
    """Draft and target both constrained (one stage, states looked up by prefix, so a rejected draft needs no
    rollback): the first two tokens follow the constrained target law, and never leave the constraint."""
    from test_constraint import RegexReference, token_bytes

    V, runs, prompt, pattern = 4096, 600, [7, 300, 12], r"[a-z]{1,2}[0-9]?"
    target = random_model("llama", seed=3, vocab_size=V, scale=3.0)
    draft = perturbed_copy(target, 0.5)  # agrees often (drafts accepted: the bonus row after a draft is used)
    chain = constrained_chain({"temperature": 1.5, "top-k": 3}, pattern)  # the draft's top 3 allowed can differ
    chain.reset(len(prompt))
    exact, counts, accepted = end_to_end_counts(target, draft, chain, prompt, runs, V)
    assert accepted > runs // 4, accepted  # the rows after accepted drafts were used
    assert_follows(exact, counts, runs)
    reference, tb = RegexReference(pattern), token_bytes()
    for x1, x2 in torch.nonzero(counts).tolist():
        data = tb[x1] + (b"" if x2 == 0 else tb[x2])
        assert (reference.complete(data) if x2 == 0 else reference.viable(data)), data


def test_greedy_under_a_constraint_equals_plain_greedy(target):
    """The n-gram proposer drafts tokens the constraint forbids (their rows after are empty): still the plain
    constrained greedy output token for token."""
    model = random_model("llama", seed=3, vocab_size=4096, scale=3.0)
    chain = constrained_chain({"temperature": 0}, r"[a-z]+( [a-z]+)*")
    prompt = [7, 300, 12, 7, 300]
    rules = StopRules(20, context_length=256)
    chain.reset(len(prompt))
    ref = reference(model, prompt, chain, rules)
    for proposer in (NGramProposer(2), ModelProposer(random_model("llama", seed=4, vocab_size=4096, scale=3.0),
                                                     chain, Greedy())):
        assert run_spec(model, proposer, prompt, chain, rules, 3).new_ids == ref


# --- exactness of greedy verification ------------------------------------------------------------------------------


CHAINS = {"greedy": {"temperature": 0}, "penalty": {"repetition-penalty": 1.3, "temperature": 0}}


@pytest.mark.parametrize("chain_name", list(CHAINS))
@pytest.mark.parametrize("proposer_kind", ["unrelated-draft", "ngram", "perturbed-draft"])
def test_greedy_equals_plain_greedy(target, unrelated_draft, chain_name, proposer_kind):
    chain = build_chain(CHAINS[chain_name])
    rules = StopRules(32, context_length=256)
    ref = reference(target, PROMPT, chain, rules)
    draft = {"unrelated-draft": unrelated_draft, "perturbed-draft": perturbed_copy(target, 0.05)}.get(proposer_kind)
    for gamma in (1, 4):
        proposer = NGramProposer(3) if draft is None else ModelProposer(draft, chain, Greedy())
        sp = run_spec(target, proposer, PROMPT, chain, rules, gamma)
        assert sp.new_ids == ref, (proposer_kind, gamma)
        assert sp.stop_reason == "length"
        if proposer_kind == "perturbed-draft":
            assert sp.stats.accepted > 0  # the block path was exercised, not just corrections


@pytest.mark.parametrize("stop", ["eos", "context", "length"])
def test_greedy_stops_like_plain_decoding(target, stop):
    chain = build_chain({"temperature": 0})
    free = reference(target, PROMPT, chain, StopRules(24, context_length=256))
    rules = {"eos": StopRules(24, eos_ids=(free[9],), context_length=256),
             "context": StopRules(24, context_length=len(PROMPT) + 11),
             "length": StopRules(7, context_length=256)}[stop]
    ref = reference(target, PROMPT, chain, rules)
    sp = run_spec(target, ModelProposer(perturbed_copy(target, 0.05), chain, Greedy()), PROMPT, chain, rules, 4)
    assert sp.new_ids == ref
    assert sp.stop_reason == stop


@pytest.mark.skipif(not (BUNDLED_WEIGHTS.exists() and DRAFT_WEIGHTS.exists()),
                    reason="the bundled tiny / tiny-draft weights are not trained yet")
def test_greedy_equals_plain_greedy_bundled_pair():
    from decodelab.core.engine.models import load_model

    tiny, draft = load_model("tiny", device="cpu"), load_model("tiny-draft", device="cpu")
    check_same_vocabulary(tiny, draft, "tiny-draft")
    chain = build_chain({"temperature": 0})
    prompt = tiny.encode("Once upon a time, there was a little")
    rules = StopRules(48, context_length=tiny.context_length)
    ref = reference(tiny.model, prompt, chain, rules)
    for gamma in (2, 5):
        sp = run_spec(tiny.model, ModelProposer(draft.model, chain, Greedy()), prompt, chain, rules, gamma)
        assert sp.new_ids == ref
        assert sp.stats.accepted > 0
    ngram = run_spec(tiny.model, NGramProposer(3), prompt, chain, rules, 4)
    assert ngram.new_ids == ref


# --- host transfers: what a GPU run would wait for -----------------------------------------------------------------

# chains without a data-dependent host read of their own (top-p, on a vocabulary larger than its 256-token head,
# reads one bool per application to choose between the head and a full sort: a full sort costs 8-22x a top-k on a
# CPU, so that read stays, and it adds the same to plain and speculative decoding)
SYNC_FREE_CHAINS = [{"temperature": 0}, {"temperature": 0.9, "top-k": 40}, {"temperature": 1.2, "min-p": 0.05}]


@pytest.mark.parametrize("settings", SYNC_FREE_CHAINS)
@pytest.mark.parametrize("ngram", [False, True])
def test_a_round_moves_one_transfer_and_its_trace_one_more(target, settings, ngram):
    """Catches: a verification that reads the accepted count and the token separately, a draft loop that reads each
    drafted token, a trace that reads its numbers one by one. Untraced: 1 read per round (drafts, verdict, token and
    finiteness together); traced: 2 (the round's record in one more)."""
    greedy = settings["temperature"] == 0
    for record in (False, True):
        gen = None if greedy else make_generator(3, "cpu")
        chain = build_chain(settings)
        proposer = NGramProposer(2) if ngram else ModelProposer(perturbed_copy(target, 0.05), chain,
                                                               Greedy() if greedy else Multinomial(gen))
        sp = Speculator(target, proposer, PROMPT * 3, chain, StopRules(20), 4, gen, record=record)
        with host_reads() as reads:
            for _ in sp:
                pass
        assert sp.stats.rounds > 2 and len(sp.new_ids) == 20
        assert sum(reads.values()) == sp.stats.rounds * (2 if record else 1), (record, dict(reads))


@pytest.mark.parametrize("settings", SYNC_FREE_CHAINS)
def test_the_plain_baseline_moves_one_transfer_a_token_like_sample(target, settings):
    """The measured speedup divides by plain decoding: it must pay what `sample` pays, one read per token (the
    token and its finiteness together), not more (a baseline that syncs more would flatter speculation)."""
    from decodelab.core.methods.sample import Sampler

    greedy = settings["temperature"] == 0
    selector = lambda: Greedy() if greedy else Multinomial(make_generator(1, "cpu"))  # noqa: E731
    with host_reads() as reads:
        timed = _timing.time_plain_decoding(target, PROMPT, build_chain(settings), selector(), 16, 256)
    assert timed.tokens == 16 and sum(reads.values()) == 16, dict(reads)
    for record in (False, True):
        run = Sampler(target, PROMPT, build_chain(settings), selector(), StopRules(16, ignore_eos=True),
                      str, str, top=3, record=record)
        with host_reads() as reads:
            for _ in run:
                pass
        assert len(run.new_ids) == 16 and sum(reads.values()) == 16, (record, dict(reads))


def test_identical_draft_accepts_every_proposal(target):
    chain = build_chain({"temperature": 1.5, "top-p": 0.95})
    for seed in range(3):
        gen = make_generator(seed, "cpu")
        sp = run_spec(target, ModelProposer(target, chain, Multinomial(gen)), PROMPT, chain, StopRules(25), 4, gen)
        assert len(sp.new_ids) == 25
        assert sp.stats.drafted > 0 and sp.stats.accepted == sp.stats.drafted
        summary = sp.summary(_timing.BaselineTiming(25, 1.0))
        assert summary.acceptance_rate == 1.0 and summary.per_position_acceptance == [1.0] * 4


def test_same_seed_same_run(target, unrelated_draft):
    chain = build_chain({"temperature": 1.2})
    runs = []
    for _ in range(2):
        gen = make_generator(7, "cpu")
        runs.append(run_spec(target, ModelProposer(unrelated_draft, chain, Multinomial(gen)), PROMPT, chain,
                             StopRules(12), 3, gen).new_ids)
    assert runs[0] == runs[1]


# --- caches ----------------------------------------------------------------------------------------------------------


def fresh_cache(model, ids: list[int]) -> Runtime:
    runtime = Runtime.create(model)
    runtime.prefill(torch.tensor([ids]))
    return runtime


def assert_same_cache(a: Runtime, b: Runtime) -> None:
    assert a.seen == b.seen
    for la, lb in zip(a.policy.model_cache.layers, b.policy.model_cache.layers):
        torch.testing.assert_close(la.keys, lb.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(la.values, lb.values, atol=1e-4, rtol=1e-4)


def test_rollback_leaves_caches_equal_to_a_fresh_prefill(target):
    chain = build_chain({"temperature": 1.0})
    draft = perturbed_copy(target, 0.3, seed=1)
    gen = make_generator(0, "cpu")
    proposer = ModelProposer(draft, chain, Multinomial(gen))
    sp = Speculator(target, proposer, PROMPT, chain, StopRules(30), 4, gen, record=False)
    partial = 0
    for rnd in sp:
        if 0 < rnd.accepted < rnd.drafted:
            partial += 1
        if sp.stop_reason != "length" or len(sp.new_ids) == 30:
            break
        tokens = sp.seq.tokens
        assert sp.runtime.seen == len(tokens) - 1  # everything but the token fed next round
        assert_same_cache(sp.runtime, fresh_cache(target, tokens[:-1]))
        assert proposer.runtime.seen >= len(tokens) - 2  # at most 2 behind: caught up at its next round
        assert_same_cache(proposer.runtime, fresh_cache(draft, tokens[: proposer.runtime.seen]))
    assert partial > 0  # some round accepted a strict, non-empty prefix (a rollback mid-block)


# --- the n-gram proposer ---------------------------------------------------------------------------------------------


def test_ngram_lookup():
    ng = NGramProposer(3)
    ng.start(None)
    assert ng.lookup([1, 2, 3, 4, 1, 2, 3], 4) == [4, 1, 2, 3]
    ng.start(None)
    assert ng.lookup([1, 2, 3, 4, 1, 2, 3], 6) == [4, 1, 2, 3, 4, 1]  # copies on through its own proposal
    ng.start(None)
    assert ng.lookup([5, 6, 7, 9, 6, 7], 2) == [9, 6]  # [9, 6, 7] unseen: falls back to [6, 7]
    ng.start(None)
    assert ng.lookup([1, 2, 8, 1, 2, 9, 1, 2], 1) == [9]  # the most recent occurrence wins
    ng.start(None)
    assert ng.lookup([1, 2, 3], 3) == []
    # incremental: the index grows with the sequence
    ng.start(None)
    seq = [4, 5, 6]
    assert ng.lookup(seq, 2) == []
    seq += [4, 5]
    assert ng.lookup(seq, 2) == [6, 4]


# --- the command -----------------------------------------------------------------------------------------------------


def saved_model(folder: Path, seed: int, extra_vocab: int = 0) -> Path:
    from transformers import AutoTokenizer

    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (BUNDLED_TOKENIZER / name).exists():
            shutil.copy(BUNDLED_TOKENIZER / name, folder / name)
    tok = AutoTokenizer.from_pretrained(folder)
    vocab = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"])
    model = random_model("llama", seed=seed, vocab_size=max(vocab, len(tok)) + extra_vocab, scale=20.0,
                         eos_token_id=tok.eos_token_id, max_position_embeddings=64)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> Path:
    return saved_model(tmp_path_factory.mktemp("draft"), seed=2)


@pytest.fixture(scope="module")
def bad_vocab_dir(tmp_path_factory) -> Path:
    return saved_model(tmp_path_factory.mktemp("badvocab"), seed=3, extra_vocab=8)


def test_cli_json_matches_sample(cli, toy_model_dir, draft_dir):
    code, out, err = cli("speculate", "--model", toy_model_dir, "--draft", draft_dir, "the cat sat", "-n", "8",
                         "-t", "0", "--gamma", "3", "-f", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["command"] == "speculate" and doc["verification"] == "greedy"
    for key in ("model", "device", "dtype", "config", "chain", "prompt", "steps", "text", "token_ids", "summary"):
        assert key in doc
    step = doc["steps"][0]
    assert set(step["proposed"][0]) >= {"token_id", "token", "q", "p", "u", "accept_prob", "accepted"}
    assert {"accepted", "emitted"} <= set(step) and ("correction" in step or "bonus" in step)
    for key in ("acceptance_rate", "mean_accepted", "per_position_acceptance", "tokens_per_target_call",
                "target_calls", "draft_calls", "cost_ratio", "predicted_speedup", "measured_speedup", "stop_reason"):
        assert key in doc["summary"]
    emitted = [t for s in doc["steps"] for t in s["emitted"]["token_ids"]]
    assert emitted == doc["token_ids"]
    code, out, _ = cli("sample", "--model", toy_model_dir, "the cat sat", "-n", "8", "-t", "0", "-f", "json")
    assert code == 0 and json.loads(out)["token_ids"] == doc["token_ids"]


def test_cli_ngram_sweep_json(cli, toy_model_dir):
    code, out, err = cli("speculate", "--model", toy_model_dir, "--draft", "ngram", "a b c a b c a b c a b",
                         "-n", "6", "-t", "0", "--sweep-gamma", "1,2", "-f", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert [row["gamma"] for row in doc["sweep"]] == [1, 2]
    assert doc["best_gamma"] in (1, 2)
    assert doc["summary"]["proposer"] == "ngram-3" and doc["summary"]["draft_calls"] == 0


def test_cli_table_and_jsonl(cli, toy_model_dir, draft_dir):
    code, out, err = cli("speculate", "--model", toy_model_dir, "--draft", draft_dir, "hello", "-n", "5",
                         "--temperature", "1.3", "--seed", "3")
    assert code == 0, err
    assert "summary:" in out and "acceptance_rate" in out
    code, out, err = cli("speculate", "--model", toy_model_dir, "--draft", draft_dir, "hello", "-n", "5",
                         "-f", "jsonl")
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert {line["type"] for line in lines[:-1]} == {"step"} and lines[-1]["type"] == "summary"


@pytest.mark.parametrize("args, needle", [
    (["--draft", "BAD", "--gamma", "2"], "vocabulary"),
    (["--draft", "ngram", "--gamma", "0"], "--gamma 0"),
    (["--draft", "ngram", "--sweep-gamma", "2,0"], "--sweep-gamma"),
    (["--draft", "ngram", "--ngram-size", "0"], "--ngram-size"),
])
def test_cli_bad_input_one_line_exit_2(cli, toy_model_dir, bad_vocab_dir, args, needle):
    args = [str(bad_vocab_dir) if a == "BAD" else a for a in args]
    code, out, err = cli("speculate", "--model", toy_model_dir, "hi", "-n", "3", *args)
    assert code == 2
    assert err.startswith("error: ") and needle in err and err.strip().count("\n") == 0


def test_chain_that_empties_the_decided_row_is_one_clean_error(target):
    from decodelab.core.errors import ChainError

    chain = build_chain({"bias": {t: float("-inf") for t in range(256)}, "temperature": 0})
    sp = Speculator(target, NGramProposer(2), PROMPT, chain, StopRules(4), 2, record=False)
    with pytest.raises(ChainError):
        list(sp)


# --- timing rounds: the measured speedup as a median with its spread (issue 13) --------------------------------


def test_median_spread_on_hand_numbers():
    assert _timing.median_spread([1.5, 0.7, 1.2]) == (1.2, 0.7, 1.5, 3)  # odd: the middle value, not the mean (1.133)
    assert _timing.median_spread([1.0, 3.0, 2.0, 10.0]) == (2.5, 1.0, 10.0, 4)  # even: the mean of the middle two
    assert _timing.median_spread([0.9]) == (0.9, 0.9, 0.9, 1)
    assert _timing.median_spread([]) is None


def test_summary_speedup_is_the_median_of_per_round_ratios(target):
    """Rounds plain 10/12/9 ms per step against speculative 5/10/6 ms per token: ratios 2.0, 1.2, 1.5. The median of
    the ratios is 1.5 (the ratio of the medians would be 10 / 6 = 1.67, the first round's alone 2.0)."""
    chain = build_chain({"temperature": 0})
    sp = run_spec(target, NGramProposer(2), PROMPT, chain, StopRules(10, ignore_eos=True), 3)
    rounds = [_timing.SpeedupRound(0.010, 0.005, 0.001, 0.011), _timing.SpeedupRound(0.012, 0.010, 0.003, 0.013),
              _timing.SpeedupRound(0.009, 0.006, 0.002, 0.010)]
    s = sp.summary(rounds)
    assert (s.measured_speedup, s.measured_speedup_min, s.measured_speedup_max) == pytest.approx((1.5, 1.2, 2.0))
    assert s.speedup_rounds == 3
    assert s.target_step_ms == pytest.approx(10.0) and s.draft_step_ms == pytest.approx(2.0)
    assert s.verify_ms == pytest.approx(11.0) and s.cost_ratio == pytest.approx(0.2)
    assert s.baseline_tokens_per_s == pytest.approx(100.0)
    none = sp.summary([])
    assert none.measured_speedup is None and none.measured_speedup_min is None and none.speedup_rounds == 0
    one = sp.summary(_timing.BaselineTiming(len(sp.new_ids), 0.09))  # one plain run: 9 steps of 10 ms
    assert one.speedup_rounds == 1 and one.measured_speedup == one.measured_speedup_min == one.measured_speedup_max
    assert one.measured_speedup == pytest.approx(0.010 / (sp.watch.timing.loop_s / len(sp.new_ids)))


def test_cli_json_says_how_many_timing_rounds_ran_and_they_alternate(cli, toy_model_dir, monkeypatch):
    from decodelab.core.methods.speculative.run import SpeedupRounds

    order = []
    for name, mark in (("speculative", "S"), ("plain", "P")):
        real = getattr(SpeedupRounds, name)
        monkeypatch.setattr(SpeedupRounds, name, lambda self, *a, real=real, mark=mark: (order.append(mark),
                                                                                           real(self, *a))[1])
    code, out, err = cli("speculate", "a b c a b c a b", "-m", toy_model_dir, "--draft", "ngram", "-n", "6",
                         "--ignore-eos", "-t", "0", "--speedup-rounds", "4", "--sweep-gamma", "2", "-f", "json")
    assert code == 0, err
    doc = json.loads(out)
    # the sweep first (gamma 2: rounds 2 and 4 plain first), so the run shown is the best gamma's; it is gamma 2,
    # whose 4 rounds the sweep measured already: nothing is timed twice
    assert "".join(order) == "SP" + "PS" + "SP" + "PS"
    s = doc["summary"]
    assert doc["config"]["speedup_rounds"] == 4 and s["speedup_rounds"] == 4
    assert s["measured_speedup_min"] <= s["measured_speedup"] <= s["measured_speedup_max"]
    assert [r["speedup_rounds"] for r in doc["sweep"]] == [4]
    code, out, err = cli("speculate", "a b c a b", "-m", toy_model_dir, "--draft", "ngram", "-n", "4", "-t", "0",
                         "--speedup-rounds", "1", "-f", "json")
    s = json.loads(out)["summary"]
    assert code == 0 and s["speedup_rounds"] == 1 and s["measured_speedup"] == s["measured_speedup_max"]


def test_cli_table_states_the_median_spread_and_rounds(cli, toy_model_dir):
    code, out, err = cli("speculate", "a b c a b c", "-m", toy_model_dir, "--draft", "ngram", "-n", "4", "-t", "0",
                         "--speedup-rounds", "2")
    assert code == 0, err
    assert "median of 2 timing rounds, min " in " ".join(out.split())


# --- a round with nothing drafted is a plain target step, not a bonus ---------------------------------------------


def test_final_kind():
    assert _rule.final_kind(0, 0) == "plain"  # nothing drafted: nothing was accepted to earn a bonus
    assert _rule.final_kind(3, 3) == "bonus"
    assert _rule.final_kind(3, 1) == "correction"
    assert _rule.final_kind(1, 0) == "correction"


def test_cli_labels_a_round_without_drafts_plain_in_json_and_csv(cli, toy_model_dir):
    """'Once upon' has no earlier occurrence of its last token: the n-gram proposer drafts nothing in round 0."""
    args = ("speculate", "Once upon", "-m", toy_model_dir, "--draft", "ngram", "-n", "6", "-t", "0",
            "--speedup-rounds", "1")
    code, out, err = cli(*args, "-f", "json")
    assert code == 0, err
    steps = json.loads(out)["steps"]
    empty = [s for s in steps if s["drafted"] == 0]
    assert empty and all("plain" in s and "bonus" not in s and "correction" not in s for s in empty)
    assert all(s["plain"]["kind"] == "plain" for s in empty)
    drafted = [s for s in steps if s["drafted"] > 0]
    assert all(("bonus" in s) == (s["accepted"] == s["drafted"]) and "plain" not in s for s in drafted)
    code, out, err = cli(*args, "-f", "csv")
    rows = list(__import__("csv").DictReader(out.splitlines()))
    assert [r["final_kind"] for r in rows] == [next(k for k in ("plain", "bonus", "correction") if k in s)
                                                for s in steps]


# --- speculative sampling draws from the run's generator ----------------------------------------------------------


def test_speculative_draws_come_from_the_runs_generator():
    """Bug: u (or the residual draw) taken from torch's global generator. The n-gram proposer draws nothing, so
    the first round's u are exactly the first g uniforms of a fresh generator with the run's seed, whatever the
    global seed is; and two runs with the same seed agree after the global RNG is reseeded differently."""
    target = random_model("llama", seed=0, vocab_size=64, scale=4.0)
    prompt = [3, 17, 42, 9, 30, 17, 42]  # "17 42" recurs: the n-gram proposer drafts 9, 30, 17 in round 1
    chain = build_chain({"temperature": 1.0})

    def run(global_seed: int):
        torch.manual_seed(global_seed)
        sp = Speculator(target, NGramProposer(3), prompt, chain, StopRules(12, ignore_eos=True), 3,
                        make_generator(11, "cpu"), token_text=str, detok=None, top=3)
        rounds = list(sp)
        return sp.new_ids, rounds

    ids_a, rounds_a = run(0)
    ids_b, rounds_b = run(12345)
    first = rounds_a[0]
    assert [t.token_id for t in first.proposed] == [9, 30, 17]
    expected_u = torch.rand(3, generator=make_generator(11, "cpu")).tolist()
    judged = [t.u for t in first.proposed if t.reached]
    assert judged == pytest.approx(expected_u[: len(judged)], abs=0)
    assert ids_a == ids_b
    assert [[t.u for t in r.proposed] for r in rounds_a] == [[t.u for t in r.proposed] for r in rounds_b]


# --- exact edges: the cases mutation testing (tests/mutation/run.sh) showed no other test pinned down -------------


def test_point_masses_are_float_distributions():
    q = point_masses(torch.tensor([2, 0]), 3)
    assert q.dtype == torch.float32 and q.tolist() == [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]


def test_residual_is_normalised_per_row():
    """Row 0: max(0, p - q) = (0, 1/2, 0) -> (0, 1, 0). Row 1: p == q leaves no excess: the row falls back to p."""
    from decodelab.core.methods.speculative.rule import residual_distribution

    p = torch.tensor([[0.5, 0.5, 0.0], [0.25, 0.25, 0.5]])
    q = torch.tensor([[1.0, 0.0, 0.0], [0.25, 0.25, 0.5]])
    assert residual_distribution(p, q).tolist() == [[0.0, 1.0, 0.0], [0.25, 0.25, 0.5]]


def test_a_draft_the_target_gives_probability_zero_is_never_accepted():
    """u = 0 and p(x) = 0: the rule accepts iff u < p/q, so 0 < 0 rejects (u <= p/q would accept an impossible
    token). The correction then comes from norm(max(0, p - q)) = the one token p allows."""
    from decodelab.core.methods.speculative.rule import verify_sampled

    p = torch.tensor([[[0.0, 1.0], [0.5, 0.5]]])  # [B=1, g+1=2, V=2]
    q = torch.tensor([[[1.0, 0.0]]])  # the draft proposed token 0 with certainty
    verdict = verify_sampled(p, q, torch.tensor([[0]]), torch.tensor([[0.0]]), torch.ones(1, 2))
    assert verdict.accepted.tolist() == [0] and verdict.token.tolist() == [1]


# --- mutation run of core/methods/speculative/run.py, proposers.py, timing.py (2026-12-02) ------------------------


@pytest.fixture(scope="module")
def toy_lm(toy_model_dir):
    from decodelab.core.engine.models import load_model

    return load_model(str(toy_model_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def draft_lm(draft_dir):
    from decodelab.core.engine.models import load_model

    return load_model(str(draft_dir), device="cpu", dtype="float32")


def test_make_selector_for_greedy_and_sampling():
    """Bug caught: a greedy run's draft sampled (its acceptance rate falls, the tokens stay), or a sampled draft
    drawn from torch's global generator instead of the run's (one seed no longer fixes the run)."""
    from decodelab.core.methods.speculative.proposers import make_selector_for

    assert isinstance(make_selector_for(True, None), Greedy)
    gen = make_generator(3, "cpu")
    sel = make_selector_for(False, gen)
    assert isinstance(sel, Multinomial) and sel.generator is gen


def test_round_to_dict_names_every_field():
    from decodelab.core.methods.speculative.run import FinalToken, Round

    rnd = Round(2, 9, 1, 0, [5], "x", draft_ms=1.5, target_ms=2.5)
    assert rnd.to_dict() == {"index": 2, "position": 9, "drafted": 1, "proposed": [], "accepted": 0,
                             "emitted": {"token_ids": [5], "text": "x"}, "draft_ms": 1.5, "target_ms": 2.5}
    rnd.final = FinalToken("correction", 5, "x", 0.5, 0.25, 0.125, True)
    assert rnd.to_dict()["correction"] == {"kind": "correction", "token_id": 5, "token": "x", "prob": 0.5,
                                           "p": 0.25, "raw_p": 0.125, "emitted": True, "top": []}


def test_noisy_spread_and_straddle_by_hand():
    """Noisy: (max - min) > 0.25 x median, or min < 1 < max (faster in one round, slower in another)."""
    from decodelab.core.methods.speculative.run import noisy

    assert noisy(2.0, 1.5, 2.0) is False  # spread 0.5 = 0.25 x 2 exactly: not more; all above 1
    assert noisy(2.0, 1.2, 2.0) is True  # spread 0.8 > 0.5, all above 1
    assert noisy(1.0, 0.95, 1.05) is True  # spread 0.1, but on both sides of 1
    assert noisy(1.0, 1.0, 1.1) is False  # min exactly 1: not below it
    assert noisy(1.0, 0.9, 1.0) is False  # max exactly 1: not above it
    assert noisy(1.9, 1.8, 2.1) is False  # spread 0.3 < 0.475, all above 1 (and 2 inside is no matter)


def test_best_gamma_skips_unmeasured_and_breaks_ties_to_the_smaller():
    from types import SimpleNamespace as Row

    from decodelab.core.methods.speculative.run import best_gamma

    assert best_gamma([]) is None
    assert best_gamma([Row(measured_speedup=None, gamma=1)]) is None
    assert best_gamma([Row(measured_speedup=float("nan"), gamma=1), Row(measured_speedup=1.5, gamma=2)]) == 2
    assert best_gamma([Row(measured_speedup=None, gamma=1), Row(measured_speedup=0.5, gamma=3)]) == 3
    assert best_gamma([Row(measured_speedup=1.5, gamma=4), Row(measured_speedup=1.5, gamma=2),
                       Row(measured_speedup=1.2, gamma=1)]) == 2


def test_build_speculator_wires_seed_draft_cache_and_chain(toy_lm, draft_lm):
    """build_speculator against a Speculator built by hand from the same parts: the run's generator seeded by
    --seed and shared by the draft's selector, the draft's name and context, --cache on both models, the chain
    given (or one made from the settings, told where the prompt ends: min-new-tokens needs it)."""
    from decodelab.core.engine.stopping import stop_rules
    from decodelab.core.methods.speculative.run import SpeculateSettings, build_speculator
    from decodelab.core.sampling.chain import make_chain

    prompt = [5, 9, 14, 5, 9]
    settings = SpeculateSettings(temperature=1.0, seed=11, cache="static", max_new_tokens=6, ignore_eos=True,
                                 min_new_tokens=2)
    sp = build_speculator(toy_lm, draft_lm, settings, prompt, 3)
    assert sp.generator is not None and not sp.greedy
    assert isinstance(sp.proposer.selector, Multinomial) and sp.proposer.selector.generator is sp.generator
    assert sp.proposer.name == draft_lm.name and sp.proposer.context_length == draft_lm.context_length == 64
    assert sp.spec == settings.cache_spec and sp.proposer.spec == settings.cache_spec
    ids = [r.emitted_ids for r in sp]
    chain = make_chain(toy_lm, settings)
    chain.reset(len(prompt))
    gen = make_generator(11, "cpu")
    by_hand = Speculator(toy_lm.model, ModelProposer(draft_lm.model, chain, Multinomial(gen)), prompt, chain,
                         stop_rules(toy_lm, settings), 3, gen, cache=settings.cache_spec)
    assert ids == [r.emitted_ids for r in by_hand]
    given = make_chain(toy_lm, settings)
    assert build_speculator(toy_lm, None, settings, prompt, 2, chain=given).chain is given
    greedy = build_speculator(toy_lm, draft_lm, dataclasses.replace(settings, temperature=0.0), prompt, 2)
    assert greedy.greedy and isinstance(greedy.proposer.selector, Greedy)


def test_build_speculator_refuses_a_stepwise_stage_naming_the_method(toy_lm):
    from decodelab.core.methods.speculative.run import SpeculateSettings, build_speculator

    settings = SpeculateSettings(temperature=1.0, mirostat_tau=5.0)
    with pytest.raises(ConfigError, match="^--mirostat-tau/--mirostat-eta: speculative decoding scores several"):
        build_speculator(toy_lm, None, settings, [5, 9], 2)


def test_speedup_rounds_time_the_draft_and_chain_given_untraced(toy_lm, draft_lm):
    """Bug caught: the timing rounds' speculative runs built with the n-gram proposer instead of the draft, with a
    chain of their own, or traced (the trace's cost would count as decoding)."""
    from decodelab.core.methods.speculative.run import SpeculateSettings, SpeedupRounds
    from decodelab.core.sampling.chain import make_chain

    settings = SpeculateSettings(temperature=0.0, max_new_tokens=5, ignore_eos=True)
    chain = make_chain(toy_lm, settings)
    run = SpeedupRounds(toy_lm, draft_lm, settings, [5, 9, 14], chain, 2).speculative()
    assert isinstance(run.proposer, ModelProposer) and run.proposer.name == draft_lm.name
    assert run.chain is chain and run.gamma == 2 and len(run.new_ids) == 5
    assert run.rounds and all(r.proposed == [] and r.final is None for r in run.rounds)


def test_summarize_by_hand():
    """4 rounds of gamma 3: 10 drafted, 8 judged, 6 accepted (per position judged 4/3/1, accepted 3/2/1), 10
    tokens, 20 ms drafting, 80 ms verifying; prefill 0.1 s, loop 0.4 s, trace 0.1 s."""
    from decodelab.core.engine.run import Timing
    from decodelab.core.methods.speculative.run import RunStats, summarize

    stats = RunStats(3, rounds=4, drafted=10, judged=8, accepted=6, draft_seconds=0.02, target_seconds=0.08,
                     new_ids=list(range(10)), stop_reason="eos")
    stats.reached_at, stats.accepted_at = [4, 3, 1], [3, 2, 1]
    timing = Timing(prefill_s=0.1, loop_s=0.4, trace_s=0.1)
    s = summarize(stats, "draft", 7, [], timing)
    expected = (1 - 0.75 ** 4) / (1 - 0.75)  # 2.734375
    assert (s.proposer, s.gamma, s.new_tokens, s.rounds, s.target_calls, s.draft_calls) == ("draft", 3, 10, 4, 4, 7)
    assert (s.acceptance_rate, s.drafted_accepted_fraction, s.mean_accepted, s.mean_drafted) == (0.75, 0.6, 1.5, 2.5)
    assert s.per_position_acceptance == pytest.approx([0.75, 2 / 3, 1.0])
    assert s.tokens_per_target_call == 2.5 and s.expected_tokens_per_round == pytest.approx(expected)
    assert s.draft_step_ms == pytest.approx(2.0) and s.verify_ms == pytest.approx(20.0)
    assert s.tokens_per_s == pytest.approx(10 / 0.6) and s.decode_tokens_per_s == pytest.approx(25.0)
    assert s.prefill_s == 0.1 and s.stop_reason == "eos"
    assert (s.target_step_ms, s.cost_ratio, s.verify_cost_ratio, s.predicted_speedup, s.measured_speedup,
            s.measured_speedup_min, s.measured_speedup_max, s.baseline_tokens_per_s,
            s.speculative_tokens_per_s) == (None,) * 9
    assert s.speedup_rounds == 0 and s.speedup_noisy is False
    # two timing rounds: plain 10 / 12 ms a step, speculative 5 / 8 ms a token (speedups 2.0, 1.5), drafting 1 / 3 ms
    # a token, verifying 12 / 16 ms a round; medians (even: the mean of the two) 11, 6.5, 2, 14 ms
    timed = [_timing.SpeedupRound(0.010, 0.005, 0.001, 0.012), _timing.SpeedupRound(0.012, 0.008, 0.003, 0.016)]
    s = summarize(stats, "draft", 7, timed, timing)
    c = 0.002 / 0.011
    assert (s.measured_speedup, s.measured_speedup_min, s.measured_speedup_max) == pytest.approx((1.75, 1.5, 2.0))
    assert s.speedup_rounds == 2 and s.speedup_noisy is True  # spread 0.5 > 0.25 x 1.75
    assert s.target_step_ms == pytest.approx(11.0) and s.draft_step_ms == pytest.approx(2.0)
    assert s.verify_ms == pytest.approx(14.0) and s.cost_ratio == pytest.approx(c)
    assert s.verify_cost_ratio == pytest.approx(14 / 11)
    assert s.predicted_speedup == pytest.approx(expected / (3 * c + 1))
    assert s.baseline_tokens_per_s == pytest.approx(1 / 0.011) and s.speculative_tokens_per_s == pytest.approx(1 / 0.0065)
    # one round: its counts per round are not halved; nothing judged or drafted: rates 0, not 1
    one = RunStats(2, rounds=1, drafted=2, judged=2, accepted=2, draft_seconds=0.004, target_seconds=0.01,
                   new_ids=[1, 2, 3])
    s = summarize(one, "ngram-2", 0, [], Timing())
    assert (s.mean_accepted, s.mean_drafted, s.tokens_per_target_call) == (2.0, 2.0, 3.0)
    assert s.draft_step_ms == pytest.approx(2.0) and s.verify_ms == pytest.approx(10.0)
    none = summarize(RunStats(2), "ngram-2", 0, [], Timing())
    assert (none.acceptance_rate, none.drafted_accepted_fraction, none.draft_step_ms, none.mean_accepted) == (0,) * 4
    assert none.per_position_acceptance == [None, None] and math.isnan(none.tokens_per_s)


def test_summary_of_a_run_never_started_and_of_a_finished_run(target):
    from decodelab.core.methods.speculative.run import Speculator

    chain = build_chain({"temperature": 0})
    idle = Speculator(target, NGramProposer(2), PROMPT, chain, StopRules(4), 2)
    s = idle.summary(None)
    assert s.new_tokens == 0 and s.rounds == 0 and math.isnan(s.tokens_per_s) and s.prefill_s == 0.0
    assert s.draft_calls == 0 and s.proposer == "ngram-2"
    done = run_spec(target, NGramProposer(2), PROMPT, chain, StopRules(4, ignore_eos=True), 2)
    s = done.summary(None)
    assert s.tokens_per_s == pytest.approx(4 / done.watch.timing.total_s)
    assert s.prefill_s == done.watch.timing.prefill_s > 0


def test_build_speculator_traces_with_the_models_text_and_caps_new_tokens(toy_lm):
    from decodelab.core.methods.speculative.run import SpeculateSettings, build_speculator

    settings = SpeculateSettings(temperature=0.0, cache="static", max_new_tokens=8, ignore_eos=True, top=2)
    sp = build_speculator(toy_lm, None, settings, [5, 9, 14, 5, 9], 2, max_new_tokens=3)
    rounds = list(sp)
    assert len(sp.new_ids) == 3 and sp.spec == settings.cache_spec
    for rnd in rounds:
        assert rnd.emitted_text == toy_lm.decode(rnd.emitted_ids)
        assert rnd.final.token == toy_lm.token_text(rnd.final.token_id) and len(rnd.final.top) == 2
    quiet = build_speculator(toy_lm, None, settings, [5, 9, 14, 5, 9], 2, record=False)
    assert all(r.final is None for r in quiet) and len(quiet.new_ids) == 8


def test_warm_up_runs_four_untraced_tokens_of_the_draft_and_chain(toy_lm, draft_lm, monkeypatch):
    import decodelab.core.methods.speculative.run as run_module
    from decodelab.core.sampling.chain import make_chain

    built = []
    real = run_module.build_speculator
    monkeypatch.setattr(run_module, "build_speculator", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    settings = run_module.SpeculateSettings(temperature=0.0, max_new_tokens=10, ignore_eos=True, gamma=2)
    chain = make_chain(toy_lm, settings)
    run_module.warm_up_speculate(toy_lm, draft_lm, settings, [5, 9, 14], chain)
    (sp,) = built
    assert len(sp.new_ids) == 4 and sp.gamma == 2 and sp.chain is chain
    assert isinstance(sp.proposer, ModelProposer) and all(r.final is None for r in sp.rounds)
    run_module.warm_up_speculate(toy_lm, draft_lm, dataclasses.replace(settings, max_new_tokens=3), [5, 9, 14], chain)
    assert len(built[-1].new_ids) == 3


def test_with_gamma():
    from decodelab.core.methods.speculative.run import SpeculateSettings, with_gamma

    assert with_gamma(SpeculateSettings(gamma=4), 7).gamma == 7


def test_plain_baseline_decodes_under_the_context_cache_and_chain(toy_lm, monkeypatch):
    """The toy model's context is 64: from a 60-token prompt plain decoding stops after 4 tokens, whatever the
    number asked; and it runs under --cache with the chain and selector of the settings."""
    import decodelab.core.methods.speculative.run as run_module
    from decodelab.core.sampling.chain import make_chain

    settings = run_module.SpeculateSettings(temperature=0.0, cache="static")
    chain = make_chain(toy_lm, settings)
    assert run_module.plain_baseline(toy_lm, settings, [5] * 60, chain, 10).tokens == 4
    seen = {}
    monkeypatch.setattr(run_module, "time_plain_decoding",
                        lambda *a, **k: seen.update(args=a, kwargs=k) or _timing.BaselineTiming(3, 0.1))
    run_module.plain_baseline(toy_lm, settings, [5, 9], chain, 3)
    model, prompt, used_chain, selector, tokens, context = seen["args"]
    assert (model, prompt, used_chain, tokens, context) == (toy_lm.model, [5, 9], chain, 3, 64)
    assert isinstance(selector, Greedy) and seen["kwargs"] == {"cache": settings.cache_spec}


def test_speedup_rounds_resume_and_stop_when_nothing_is_timed(toy_lm, monkeypatch):
    import decodelab.core.methods.speculative.run as run_module
    from decodelab.core.sampling.chain import make_chain

    settings = run_module.SpeculateSettings(temperature=0.0, max_new_tokens=3, ignore_eos=True, draft="ngram",
                                            speedup_rounds=1)
    chain = make_chain(toy_lm, settings)
    sr = run_module.SpeedupRounds(toy_lm, None, settings, [5, 9, 5, 9], chain, 2)
    assert len(sr.run()) == 1
    sr.settings = dataclasses.replace(settings, speedup_rounds=2)
    assert len(sr.run()) == 2  # resumed: round 2 only, round 1 kept
    monkeypatch.setattr(run_module, "speedup_round", lambda run, baseline: None)
    fresh = run_module.SpeedupRounds(toy_lm, None, settings, [5, 9, 5, 9], chain, 2)
    assert fresh.run() == []


def test_speedup_round_by_hand():
    """5 tokens in 2 rounds (4 drafted: 8 ms, verifying 20 ms, loop 50 ms) against plain decoding of 5 tokens in
    40 ms of loop (4 decode steps of 10 ms): plain 10 ms a step, speculative 10 ms a token, drafting 2 ms a
    token, verifying 10 ms a round."""
    from types import SimpleNamespace as NS

    def run(rounds=2, drafted=4, new_ids=5, watch=True):
        stats = NS(rounds=rounds, drafted=drafted, draft_seconds=0.008, target_seconds=0.02)
        return NS(stats=stats, new_ids=list(range(new_ids)), watch=NS(timing=NS(loop_s=0.05)) if watch else None)

    paired = _timing.speedup_round(run(), _timing.BaselineTiming(5, 0.04))
    assert dataclasses.astuple(paired) == pytest.approx((0.01, 0.01, 0.002, 0.01))
    assert paired.speedup == pytest.approx(1.0)
    assert _timing.speedup_round(run(drafted=0), _timing.BaselineTiming(5, 0.04)).draft_step_s == 0.0
    # one token in one round: still a round to time (50 ms a token, 20 ms a round)
    assert dataclasses.astuple(_timing.speedup_round(run(rounds=1, new_ids=1), _timing.BaselineTiming(5, 0.04))) == \
        pytest.approx((0.01, 0.05, 0.002, 0.02))
    assert _timing.speedup_round(run(), _timing.BaselineTiming(5, 0.0)) is None  # the reference never timed
    assert _timing.speedup_round(run(new_ids=0), _timing.BaselineTiming(5, 0.04)) is None
    assert _timing.speedup_round(run(rounds=0), _timing.BaselineTiming(5, 0.04)) is None
    assert _timing.speedup_round(run(watch=False), _timing.BaselineTiming(5, 0.04)) is None
    assert _timing.BaselineTiming(5, 0.04).step_seconds == pytest.approx(0.01)
    assert _timing.BaselineTiming(1, 0.04).step_seconds == 0.04  # one token: one step, not a division by 0


def test_validate_speculate_bounds_and_messages_word_for_word():
    from decodelab.core.methods.speculative.run import SpeculateSettings, parse_gammas, validate_speculate

    for ok in (dict(gamma=1), dict(gamma=128), dict(ngram_size=1), dict(ngram_size=128), dict(speedup_rounds=1),
               dict(speedup_rounds=100), dict(sweep_gamma=(1, 128)), dict(cache="recompute:size=16")):
        validate_speculate(SpeculateSettings(**ok))
    rounds = "must be an integer in [1, 100] (timing rounds, each a speculative and a plain run of the same output)"
    for bad, message in [
        (dict(cache="window:size=8"), "--cache window:positions=keep,size=8: speculative decoding (a rejected draft "
         "is rolled back) needs the cache to roll back (truncate), which window cannot; policies that can: full, "
         "quant, recompute, static, turbo"),
        (dict(gamma=0), "--gamma 0: must be an integer in [1, 128]"),
        (dict(gamma=129), "--gamma 129: must be an integer in [1, 128]"),
        (dict(ngram_size=0), "--ngram-size 0: must be an integer in [1, 128]"),
        (dict(ngram_size=129), "--ngram-size 129: must be an integer in [1, 128]"),
        (dict(sweep_gamma=(2, 0)), "--sweep-gamma '2,0': a comma-separated list of integers in [1, 128], e.g. "
         "1,2,4,8"),
        (dict(speedup_rounds=0), f"--speedup-rounds 0: {rounds}"),
        (dict(speedup_rounds=101), f"--speedup-rounds 101: {rounds}"),
        (dict(speedup_rounds=2.0), f"--speedup-rounds 2.0: {rounds}"),
    ]:
        with pytest.raises(ConfigError) as err:
            validate_speculate(SpeculateSettings(**bad))
        assert str(err.value) == message
    assert parse_gammas(None) is None
    assert parse_gammas(" 4, 1,,4 ,2") == (4, 1, 2)  # blanks skipped, repeats dropped, order kept
    for text in ("", " , ", "1,x", "129"):
        with pytest.raises(ConfigError, match=r"^--sweep-gamma '.*': a comma-separated list of integers in \[1, 128\]"):
            parse_gammas(text)


def test_ngram_proposer_defaults():
    ng = NGramProposer()
    assert (ng.size, ng.name, ng.forwards) == (3, "ngram-3", 0)  # no draft forwards, even before its start


def test_time_plain_decoding_times_at_least_two_tokens_under_the_cache_given(target, monkeypatch):
    """One token has no decode step to time (the first comes from the prefill): the baseline decodes 2."""
    from decodelab.core.kv import parse_cache_spec

    chain = build_chain({"temperature": 0})
    assert _timing.time_plain_decoding(target, PROMPT, chain, Greedy(), 1, None).tokens == 2
    assert _timing.time_plain_decoding(target, PROMPT, chain, Greedy(), 3, None).tokens == 3
    seen = []
    real = _timing.decode_tokens
    monkeypatch.setattr(_timing, "decode_tokens", lambda *a, **k: seen.append(k["cache"]) or real(*a, **k))
    spec = parse_cache_spec("static")
    _timing.time_plain_decoding(target, PROMPT, chain, Greedy(), 2, None, cache=spec)
    assert seen == [spec]


def test_ngram_lookup_unigram_of_the_first_token_and_no_skipped_size():
    ng = NGramProposer(3)
    ng.start(None)
    assert ng.lookup([7, 8, 7], 2) == [8, 7]  # the unigram (7,) ending at the first token, then copying on
    # [4, 2, 8, 3, 2, 9, 4, 2]: no earlier (9, 4, 2); the bigram (4, 2) was followed by 8, the more recent unigram
    # (2,) by 9: the longest match wins, so 8
    ng.start(None)
    assert ng.lookup([4, 2, 8, 3, 2, 9, 4, 2], 1) == [8]


def test_model_proposer_defaults(target):
    mp = ModelProposer(target, build_chain({"temperature": 0}), Greedy())
    assert (mp.name, mp.context_length, mp.spec, mp.forwards, mp.runtime) == ("draft", None, None, 0, None)


def test_identical_draft_under_a_penalty_accepts_every_proposal(target):
    """A penalty reads the prefix: the draft must write each drafted token into the sequence before it drafts the
    next (uses_ids), or its q at position i+1 is computed after a stale scratch token and an identical draft gets
    rejected."""
    chain = build_chain({"repetition-penalty": 5.0, "temperature": 0})
    sp = run_spec(target, ModelProposer(target, chain, Greedy()), PROMPT, chain, StopRules(30, ignore_eos=True), 4)
    assert sp.stats.drafted == sp.stats.accepted == 24  # 6 rounds of 4 drafts + a bonus token each


def test_a_cache_that_cannot_roll_back_is_refused_by_both_models(target):
    from decodelab.core.kv import parse_cache_spec

    spec = parse_cache_spec("int4-kivi")  # residual 32: no exact truncation
    chain = build_chain({"temperature": 0})
    message = "^--cache quant: this run needs the cache to truncate, which axis=kivi,residual=32 cannot do exactly$"
    with pytest.raises(ConfigError, match=message):
        ModelProposer(target, chain, Greedy(), cache=spec).start(Sequence(PROMPT, 20, "cpu"))
    with pytest.raises(ConfigError, match=message):
        next(iter(Speculator(target, NGramProposer(2), PROMPT, chain, StopRules(4), 2, cache=spec)))
    idle = Speculator(target, ModelProposer(target, chain, Greedy()), PROMPT, chain, StopRules(4), 2)
    assert idle.summary(None).draft_calls == 0  # no draft forward before the start


def target_rows(model, ids: list[int], first: int, count: int) -> torch.Tensor:
    """The target's own logits at positions first .. first + count - 1 of ids, from one plain forward (no cache)."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, first : first + count].float()


def top_k_probs(logits: torch.Tensor, k: int) -> torch.Tensor:
    """softmax over the k largest logits of each row, 0 elsewhere (top-k by hand)."""
    keep = logits.topk(k, dim=-1).indices
    masked = torch.full_like(logits, float("-inf")).scatter(-1, keep, logits.gather(-1, keep))
    return masked.softmax(-1)


def test_traced_greedy_rounds_against_a_plain_forward(target):
    """Every number of a greedy round's trace recomputed from the target's logits of one plain forward over the
    committed tokens and that round's drafts: p under top-k 5, raw p, accept 1 iff the draft is p's argmax, u none,
    q 1 (the n-gram's point mass), the final token's top 3 by raw p with prob 1 for the token emitted, 0 else."""
    chain = build_chain({"top-k": 5})
    texts = {}
    sp = Speculator(target, NGramProposer(2), PROMPT, chain, StopRules(9, ignore_eos=True), 3,
                    token_text=lambda t: texts.setdefault(t, f"<{t}>"), detok=lambda ids: "|".join(map(str, ids)),
                    top=3)
    committed = list(PROMPT)
    rounds = list(sp)
    assert sum(r.drafted for r in rounds) > 0 and any(r.accepted < r.drafted for r in rounds)
    for index, rnd in enumerate(rounds):
        drafts = [t.token_id for t in rnd.proposed]
        g, k, n = len(drafts), rnd.accepted, len(committed)
        assert (rnd.index, rnd.position, rnd.drafted) == (index, n, g)
        raw = target_rows(target, committed + drafts, n - 1, g + 1)
        p, raw_p = top_k_probs(raw, 5), raw.softmax(-1)
        for i, t in enumerate(rnd.proposed):
            assert t.token == f"<{t.token_id}>" and t.q == 1.0 and t.raw_q is None and t.u is None
            assert t.p == pytest.approx(p[i, t.token_id].item(), abs=1e-5)
            assert t.raw_p == pytest.approx(raw_p[i, t.token_id].item(), abs=1e-5)
            assert t.accept_prob == float(p[i].argmax().item() == t.token_id)
            assert (t.accepted, t.reached) == (i < k, i <= k)
        y = rnd.final.token_id
        assert y == p[k].argmax().item() and rnd.emitted_ids == drafts[:k] + [y]
        assert rnd.final.kind == ("bonus" if k == g > 0 else "correction" if g else "plain")
        assert (rnd.final.token, rnd.final.prob, rnd.final.emitted) == (f"<{y}>", 1.0, True)
        assert rnd.final.p == pytest.approx(p[k, y].item(), abs=1e-5)
        assert rnd.final.raw_p == pytest.approx(raw_p[k, y].item(), abs=1e-5)
        top3 = raw_p[k].topk(3).indices.tolist()
        assert [e.token_id for e in rnd.final.top] == top3
        for e in rnd.final.top:
            assert (e.token, e.prob) == (f"<{e.token_id}>", float(e.token_id == y))
            assert e.p == pytest.approx(p[k, e.token_id].item(), abs=1e-5)
            assert e.raw_p == pytest.approx(raw_p[k, e.token_id].item(), abs=1e-5)
        assert rnd.emitted_text == "|".join(map(str, rnd.emitted_ids))
        committed += rnd.emitted_ids
    assert committed[len(PROMPT):] == sp.new_ids and len(sp.new_ids) == 9
    assert rounds[-1].final.emitted  # -n cut exactly at a round's end here: every final token emitted
    for top in (0, 1):  # none listed; only the raw argmax
        sp = Speculator(target, NGramProposer(2), PROMPT, chain, StopRules(4, ignore_eos=True), 3, top=top)
        for rnd in sp:
            raw = target_rows(target, sp.seq.tokens[: rnd.position] + [t.token_id for t in rnd.proposed],
                              rnd.position - 1, rnd.accepted + 1)[-1]
            assert [e.token_id for e in rnd.final.top] == raw.topk(1).indices.tolist()[:top]


def test_traced_sampled_rounds_against_plain_forwards(target):
    """A sampled round's trace against plain forwards of the target and the draft (same chain: temperature 0.8,
    then also top-k 2): q and raw q of each draft, p and raw p, accept min(1, p / q), u below it for each accepted
    draft and not for the first rejected one, none after; the final token drawn from norm(max(0, p - q))
    (correction) or p (bonus), its top entries that distribution's largest of probability > 0 only (under top-k 2,
    at most 2 of the 4 asked)."""
    draft = perturbed_copy(target, 0.5, seed=2)
    for top_k in (None, 2):
        settings = {"temperature": 0.8, "top-k": top_k} if top_k else {"temperature": 0.8}
        chain = build_chain(settings)
        gen = make_generator(5, "cpu")
        sp = Speculator(target, ModelProposer(draft, chain, Multinomial(gen)), PROMPT, chain,
                        StopRules(14, ignore_eos=True), 3, gen, token_text=str, top=4)
        rounds = list(sp)
        kinds = {r.final.kind for r in rounds}
        assert "correction" in kinds and (top_k or "bonus" in kinds)
        committed = list(PROMPT)
        for rnd in rounds:
            check_sampled_round(target, draft, rnd, committed, top_k)
            committed += rnd.emitted_ids


def check_sampled_round(target, draft, rnd, committed: list[int], top_k: int | None) -> None:
    drafts = [t.token_id for t in rnd.proposed]
    g, k, n = len(drafts), rnd.accepted, len(committed)
    raw = target_rows(target, committed + drafts, n - 1, g + 1)
    raw_q = target_rows(draft, committed + drafts, n - 1, g)
    if top_k:
        p, q = top_k_probs(raw / 0.8, top_k), top_k_probs(raw_q / 0.8, top_k)
    else:
        p, q = (raw / 0.8).softmax(-1), (raw_q / 0.8).softmax(-1)
    for i, t in enumerate(rnd.proposed):
        x = t.token_id
        assert t.q == pytest.approx(q[i, x].item(), abs=1e-5)
        assert t.raw_q == pytest.approx(raw_q[i].softmax(-1)[x].item(), abs=1e-5)
        assert t.p == pytest.approx(p[i, x].item(), abs=1e-5)
        assert t.raw_p == pytest.approx(raw[i].softmax(-1)[x].item(), abs=1e-5)
        assert t.accept_prob == pytest.approx(min(1.0, p[i, x].item() / q[i, x].item()), abs=1e-5)
        if i < k:
            assert t.accepted and t.reached and t.u < t.accept_prob
        elif i == k:
            assert not t.accepted and t.reached and t.u >= t.accept_prob
        else:
            assert not t.accepted and not t.reached and t.u is None
    y = rnd.final.token_id
    if rnd.final.kind == "correction":
        final = (p[k] - q[k]).clamp_min(0)
        final = final / final.sum()
    else:
        final = p[k]
    assert rnd.final.prob == pytest.approx(final[y].item(), abs=1e-5) and rnd.final.prob > 0
    assert rnd.final.p == pytest.approx(p[k, y].item(), abs=1e-5)
    assert rnd.final.raw_p == pytest.approx(raw[k].softmax(-1)[y].item(), abs=1e-5)
    expected = [t for t in final.topk(4).indices.tolist() if final[t] > 0]
    assert [e.token_id for e in rnd.final.top] == expected
    assert all(e.token == str(e.token_id) for e in rnd.final.top)
    for e in rnd.final.top:
        assert e.prob == pytest.approx(final[e.token_id].item(), abs=1e-5)
        assert e.p == pytest.approx(p[k, e.token_id].item(), abs=1e-5)
    assert rnd.emitted_text == ""  # no detokenizer given


def test_a_stop_inside_a_round_cuts_its_emitted_tokens_like_plain_decoding(target):
    """An identical draft accepts all 4 drafts of round 0 (5 tokens with the bonus); a stop id at the 3rd token
    ends the run there: the round emits 3 tokens, its final (bonus) token is not emitted, the sequence holds only
    the emitted tokens. A context of prompt + 5 cuts the first round mid-way as plain decoding does."""
    chain = build_chain({"temperature": 0})
    ref = reference(target, PROMPT, chain, StopRules(5, ignore_eos=True))
    stop_at = next(i for i in range(1, 5) if ref[i] not in ref[:i])
    sp = Speculator(target, ModelProposer(target, chain, Greedy()), PROMPT, chain,
                    StopRules(20, ignore_eos=True, stop_ids=(ref[stop_at],)), 4)
    (rnd,) = list(sp)
    assert rnd.accepted == 4 and rnd.emitted_ids == ref[: stop_at + 1] == sp.new_ids
    assert rnd.final.kind == "bonus" and rnd.final.emitted is False and sp.stop_reason == "stop"
    assert sp.seq.tokens == PROMPT + ref[: stop_at + 1]
    rules = StopRules(20, ignore_eos=True, context_length=len(PROMPT) + 5)
    plain = reference(target, PROMPT, chain, rules)
    sp = Speculator(target, ModelProposer(target, chain, Greedy()), PROMPT, chain, rules, 8)
    rounds = list(sp)
    assert sp.new_ids == plain and len(plain) == 5 and sp.stop_reason == "context"
    assert [r.emitted_ids for r in rounds] == [plain]  # one round, cut by the context inside it
    assert rounds[0].drafted == 5  # gamma 8 capped at the room left: 12 - 7 positions
    # the draft model's own context (10) caps the drafts too: 3 in round 0, none after (plain target steps)
    draft = ModelProposer(target, chain, Greedy(), context_length=len(PROMPT) + 3)
    rounds = list(Speculator(target, draft, PROMPT, chain, StopRules(6, ignore_eos=True), 8))
    assert [r.drafted for r in rounds] == [3, 0, 0]


def test_draft_forwards_and_round_times_add_up(target):
    """The draft model runs one forward per drafted token (draft_calls), counted from its start (a proposer reused
    for a second run counts that run only); each round's times are the run's, in ms."""
    chain = build_chain({"temperature": 0})
    proposer = ModelProposer(perturbed_copy(target, 0.3, seed=1), chain, Greedy())
    for _ in range(2):
        sp = Speculator(target, proposer, PROMPT, chain, StopRules(12, ignore_eos=True), 3)
        rounds = list(sp)
        assert proposer.forwards == sp.stats.drafted == sum(r.drafted for r in rounds) > 0
        assert sp.summary(None).draft_calls == sp.stats.drafted
        assert sum(r.draft_ms for r in rounds) == pytest.approx(sp.stats.draft_seconds * 1e3)
        assert sum(r.target_ms for r in rounds) == pytest.approx(sp.stats.target_seconds * 1e3)
        assert all(isinstance(r.draft_ms, float) and r.target_ms > 0 for r in rounds)


def test_drafts_capped_so_a_round_never_overshoots_n(target):
    """-n 8, gamma 4, an identical draft (every draft accepted): round 0 drafts 4 and emits 5; round 1 has room for
    3 more tokens, so it drafts 2 (plus the bonus), not 4."""
    chain = build_chain({"temperature": 0})
    sp = Speculator(target, ModelProposer(target, chain, Greedy()), PROMPT, chain, StopRules(8, ignore_eos=True), 4)
    assert [(r.drafted, len(r.emitted_ids)) for r in sp] == [(4, 5), (2, 3)]


def test_speculator_defaults_gamma_refusal_and_stop_strings(target):
    """Five alternatives listed by default; gamma 0 refused word for word; a stop string read through the
    detokenizer given ends the run at the token that completes it, as plain decoding does."""
    chain = build_chain({"temperature": 0})
    rounds = list(Speculator(target, NGramProposer(2), PROMPT, chain, StopRules(3, ignore_eos=True), 2))
    assert all(len(r.final.top) == 5 for r in rounds)
    with pytest.raises(ConfigError) as err:
        Speculator(target, NGramProposer(2), PROMPT, chain, StopRules(3), 0)
    assert str(err.value) == "--gamma 0: must be an integer >= 1"
    ref = reference(target, PROMPT, chain, StopRules(6, ignore_eos=True))
    mark = ref[3]
    detok = lambda ids: "".join("X" if t == mark else "." for t in ids)  # noqa: E731
    sp = Speculator(target, ModelProposer(target, chain, Greedy()), PROMPT, chain,
                    StopRules(20, stop_strings=("X",), ignore_eos=True), 4, detok=detok)
    list(sp)
    assert sp.new_ids == ref[: ref.index(mark) + 1] and sp.stop_reason == "stop"


def test_a_speculative_run_refuses_a_prompt_that_fills_the_context(toy_lm):
    """mutation run of the speculative loop's start (2026-12-02, second round): the toy's context is 64 tokens, so a
    prompt of 64 leaves no position to generate at: one line when the run starts, not a shape error mid-run."""
    from decodelab.core.methods.speculative.run import SpeculateSettings, build_speculator

    settings = SpeculateSettings(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    run = build_speculator(toy_lm, None, settings, [5, 9, 14, 3] * 16, 2)
    with pytest.raises(ConfigError, match="^PROMPT: the prompt is 64 tokens but the model's context is 64; "
                                          "shorten it$"):
        next(iter(run))
    assert len(next(iter(build_speculator(toy_lm, None, settings, [5, 9, 14, 3] * 15, 2))).emitted_ids) >= 1


@pytest.mark.parametrize("width", [60, 80, 120])
def test_the_alternatives_column_keeps_each_token_with_its_probability(cli, toy_model_dir, draft_dir, monkeypatch,
                                                                       width):
    """Issue 40 item 8: speculate's alternatives column put a token and its probability on different lines at 80 and
    120 columns. Each alternative is token:p with no space inside, so wrapping keeps them together: every item of
    the column, at each width, is one token:p whose p is the JSON's (drawn from: residual or p) for that round."""
    import re

    monkeypatch.setenv("COLUMNS", str(width))
    args = ("speculate", "--model", toy_model_dir, "--draft", draft_dir, "the cat sat", "-n", "6", "-t", "0.9",
            "--seed", "1", "--speedup-rounds", "1")
    code, out, err = cli(*args)
    assert code == 0, err
    doc = json.loads(cli(*args, "-f", "json")[1])
    want = {render_p(e["prob"]) for s in doc["steps"] for e in ((s.get("correction") or s.get("bonus")
                                                                 or s.get("plain") or {}).get("top") or [])}
    panels, rows = [], []  # the rows of each panel (the table splits into panels at narrow widths)
    for line in out.splitlines():
        if line.startswith("┏"):
            rows = []
            panels.append(rows)
        rows.append(line)
    (panel,) = [p for p in panels if any(line.startswith("┃") and "(top)" in line for line in p)]
    items = [x for line in panel if line.startswith("│") for x in line.rstrip("│").split("│")[-1].split()]
    assert items and all(re.fullmatch(r".+:(\d\.\d+(e-\d+)?)", x) for x in items), items
    assert {x.rsplit(":", 1)[1] for x in items} <= want


def render_p(p: float) -> str:
    from decodelab.cli.view.render import fmt_p

    return fmt_p(p)
