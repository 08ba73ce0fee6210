"""The summary's acceptance figures recomputed from the traced rounds of runs whose drafts are rejected part-way
through rounds (issue 37, item 5): a draft after a round's first rejection is never judged, so it counts neither as
judged (acceptance rate = accepted / judged) nor as reached at its position (per-position acceptance)."""

from __future__ import annotations

import pytest

from decodelab.core.engine.stopping import StopRules
from decodelab.core.methods.speculative import timing as _timing
from decodelab.core.methods.speculative.proposers import ModelProposer
from decodelab.core.methods.speculative.rule import expected_tokens, predicted_speedup
from decodelab.core.methods.speculative.run import Speculator
from decodelab.core.sampling.chain import build_chain
from decodelab.core.sampling.select import Greedy, Multinomial, make_generator

from conftest import random_model
from test_speculative import PROMPT, perturbed_copy


@pytest.fixture(scope="module")
def target():
    return random_model("llama", seed=0, vocab_size=256, scale=20.0)


def recount(rounds, gamma: int) -> dict:
    """The figures from the rounds alone: round r with g_r drafts and k_r accepted judges min(k_r + 1, g_r) drafts,
    at positions 0 .. min(k_r, g_r - 1); it accepts at positions 0 .. k_r - 1."""
    judged = accepted = 0
    reached_at, accepted_at = [0] * gamma, [0] * gamma
    for r in rounds:
        g, k = r.drafted, r.accepted
        assert [t.accepted for t in r.proposed] == [i < k for i in range(g)]
        assert [t.reached for t in r.proposed] == [i <= k for i in range(g)]
        judged += min(k + 1, g)
        accepted += k
        for i in range(min(k + 1, g)):
            reached_at[i] += 1
        for i in range(k):
            accepted_at[i] += 1
    drafted = sum(r.drafted for r in rounds)
    return {"judged": judged, "accepted": accepted, "drafted": drafted, "rate": accepted / judged,
            "per_position": [a / s if s else None for a, s in zip(accepted_at, reached_at)]}


def partial_rejections(rounds) -> int:
    """Rounds with drafts never judged: a rejection before the last draft."""
    return sum(1 for r in rounds if r.accepted + 1 < r.drafted)


@pytest.mark.parametrize("sampled", [False, True])
def test_summary_acceptance_is_recomputed_from_rounds_rejected_part_way(target, sampled):
    """Fails for 'every drafted token counted as judged' (the rate would be accepted / drafted) and for 'every draft
    position counted as reached' (a position after an early rejection would count as judged there)."""
    gamma = 4
    draft = perturbed_copy(target, 0.3 if sampled else 0.1, seed=2)
    chain = build_chain({"temperature": 0.9} if sampled else {"temperature": 0})
    gen = make_generator(11, "cpu") if sampled else None
    proposer = ModelProposer(draft, chain, Multinomial(gen) if sampled else Greedy())
    sp = Speculator(target, proposer, PROMPT, chain, StopRules(60, ignore_eos=True, context_length=256), gamma, gen,
                    token_text=str)
    rounds = list(sp)
    assert partial_rejections(rounds) >= 3, [(r.accepted, r.drafted) for r in rounds]
    want = recount(rounds, gamma)
    assert 0 < want["accepted"] < want["judged"] < want["drafted"]  # the two counts differ on this run
    s = sp.summary(_timing.BaselineTiming(len(sp.new_ids), 1.0))
    assert s.acceptance_rate == pytest.approx(want["rate"], abs=1e-12)
    assert s.per_position_acceptance == pytest.approx(want["per_position"], abs=1e-12)
    assert s.drafted_accepted_fraction == pytest.approx(sum(r.accepted for r in rounds)
                                                        / sum(r.drafted for r in rounds), abs=1e-12)
    assert s.expected_tokens_per_round == pytest.approx(expected_tokens(want["rate"], gamma), abs=1e-12)
    assert s.predicted_speedup == pytest.approx(predicted_speedup(want["rate"], s.cost_ratio, gamma), abs=1e-12)
    # the per-position rates differ from what 'every position reached' gives on this run
    reached_all = [sum(1 for r in rounds if r.drafted > i) for i in range(gamma)]
    wrong = [sum(1 for r in rounds if r.accepted > i) / n if n else None for i, n in enumerate(reached_all)]
    assert wrong != pytest.approx(want["per_position"])
