"""`speculate --predict`: acceptance predicted from one teacher-forced forward of target and draft.

Oracles: greedy, the renewal walk over the 0/1 alphas of the greedy output replays the run exactly for every gamma
(rounds, acceptance rate, per-depth acceptance); sampled, every judged draft of a run is accepted with probability
exactly alpha_i given its prefix, so over many rounds the accepted count equals the summed alphas within
sqrt(sum alpha (1 - alpha)) (a z-test, with a negative control: alphas of the wrong temperature fail it); the walk
against the iid formula when every alpha is equal; and the planned acceptance of plain continuations against the
measured acceptance of independent speculative runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from decodelab.core.engine.stopping import StopRules
from decodelab.core.methods.speculative.predict import conditional, iid_tokens, plan_gamma, teacher_forced
from decodelab.core.methods.speculative.proposers import ModelProposer
from decodelab.core.methods.speculative.rule import expected_tokens, predicted_speedup
from decodelab.core.methods.speculative.run import Speculator
from decodelab.core.methods.sample import decode_tokens
from decodelab.core.sampling.chain import build_chain
from decodelab.core.sampling.select import Greedy, Multinomial, make_generator

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = all((ROOT / "presets" / "models" / m / "model.safetensors").exists() for m in ("tiny", "tiny-draft"))
needs_bundled = pytest.mark.skipif(not BUNDLED, reason="the bundled tiny / tiny-draft weights are not trained yet")
PROMPT_TEXT = "Once upon a time, there was a little"


@pytest.fixture(scope="module")
def pair():
    from decodelab.core.engine.models import load_model

    return load_model("tiny", device="cpu"), load_model("tiny-draft", device="cpu")


def test_walk_equals_the_iid_formula_when_every_alpha_is_equal():
    """Away from the end of the text (a long one), a constant alpha gives (1 - a^(g+1)) / (1 - a) per round."""
    for a in (0.0, 0.3, 0.8, 1.0):
        for g in (1, 3, 5):
            plan = plan_gamma([a] * 4000, g, cost_ratio=0.1)
            assert plan.tokens_per_round == pytest.approx(expected_tokens(a, g), rel=2e-3)
            assert plan.iid_tokens_per_round == pytest.approx(expected_tokens(a, g), abs=1e-12)
            assert plan.acceptance_rate == pytest.approx(a, abs=1e-9)
            depths = [a] * g if a > 0 else [0.0] + [None] * (g - 1)  # a = 0: depth 1 is never reached
            assert plan.per_position_acceptance == pytest.approx(depths, abs=1e-9)
            assert plan.iid_predicted_speedup == pytest.approx(predicted_speedup(a, 0.1, g), abs=1e-12)
            assert plan.predicted_speedup == pytest.approx(predicted_speedup(a, 0.1, g), rel=3e-3)


def test_walk_by_hand():
    """alphas [1, 0, 1, 1] (greedy-like), gamma 2, N = 4: round 0 at t=0 drafts 2, accepts 1 (t=1 rejected),
    emits 2; round 1 at t=2 may draft min(2, 4-2-1) = 1, accepts it, emits 2 (draft + bonus). 2 rounds, 3 drafted,
    3 judged, 2 accepted; depth 0 judged 2 accepted 2, depth 1 judged 1 accepted 0."""
    plan = plan_gamma([1.0, 0.0, 1.0, 1.0], 2, cost_ratio=0.5)
    assert (plan.rounds, plan.drafted, plan.judged, plan.accepted) == (2, 3, 3, 2)
    assert plan.per_position_acceptance == [1.0, 0.0]
    assert plan.tokens_per_round == 2.0 and plan.predicted_speedup == pytest.approx(4 / (2 + 0.5 * 3))
    # a fractional alpha splits the walk: [0.5] * 3, gamma 1: rho = 1, then t=1 always (1 token or 2)
    plan = plan_gamma([0.5, 0.5, 0.5], 1)
    # t=0: g=1, rejected (0.5) -> t=1; accepted (0.5) -> t=2. t=1 (0.5): g=1 -> t=2 (0.25) or t=3 (0.25).
    # t=2 (0.75): g = min(1, 0) = 0 -> t=3. rounds = 1 + 0.5 + 0.75; drafted = 1 + 0.5
    assert plan.rounds == pytest.approx(2.25) and plan.drafted == pytest.approx(1.5)
    assert plan.accepted == pytest.approx(0.75) and plan.acceptance_rate == pytest.approx(0.5)
    assert iid_tokens(1.0, 3) == 4.0


@needs_bundled
@pytest.mark.parametrize("gamma", [1, 2, 4, 7])
def test_greedy_prediction_replays_the_run_for_every_gamma(pair, gamma):
    tiny, draft = pair
    chain = build_chain({"temperature": 0})
    prompt = tiny.encode(PROMPT_TEXT)
    sp = Speculator(tiny.model, ModelProposer(draft.model, chain, Greedy()), prompt, chain,
                    StopRules(48, ignore_eos=True, context_length=tiny.context_length), gamma, token_text=str)
    rounds = list(sp)
    rows = teacher_forced(tiny.model, draft.model, chain, prompt, sp.new_ids, greedy=True)
    assert set(rows.alpha.tolist()) <= {0.0, 1.0}
    plan = plan_gamma(rows.alpha.tolist(), gamma)
    s = sp.summary(None)
    assert 0 < s.acceptance_rate < 1  # rejections happen: the walk is not trivial
    assert (plan.rounds, plan.drafted, plan.judged, plan.accepted) == (sp.stats.rounds, sp.stats.drafted,
                                                                      sp.stats.judged, sp.stats.accepted)
    assert plan.acceptance_rate == s.acceptance_rate
    assert plan.per_position_acceptance == s.per_position_acceptance
    c = conditional(rows.alpha.tolist(), rounds, len(prompt))
    assert c.accepted == c.expected_accepted and c.std == 0 and c.z is None


def spec_run(tiny, draft, chain, prompt, seed, n, gamma=4):
    gen = make_generator(seed, "cpu")
    sp = Speculator(tiny.model, ModelProposer(draft.model, chain, Multinomial(gen)), prompt, chain,
                    StopRules(n, ignore_eos=True, context_length=tiny.context_length), gamma, gen, token_text=str)
    return sp, list(sp)


@needs_bundled
def test_sampled_acceptance_equals_summed_alpha_within_its_sampling_error(pair):
    """12 runs x 64 tokens of the bundled pair at temperature 1 (about 350 judged drafts): |z| < 4; the negative
    control (alphas computed at temperature 0.4 while the run used 1.0) gives |z| > 4."""
    tiny, draft = pair
    prompt = tiny.encode(PROMPT_TEXT)
    chain, wrong = build_chain({"temperature": 1.0}), build_chain({"temperature": 0.4})
    totals = {"right": [0, 0.0, 0.0], "wrong": [0, 0.0, 0.0]}
    judged = 0
    for seed in range(12):
        sp, rounds = spec_run(tiny, draft, chain, prompt, seed, 64)
        for name, ch in (("right", chain), ("wrong", wrong)):
            rows = teacher_forced(tiny.model, draft.model, ch, prompt, sp.new_ids, greedy=False)
            c = conditional(rows.alpha.tolist(), rounds, len(prompt))
            totals[name][0] += c.accepted
            totals[name][1] += c.expected_accepted
            totals[name][2] += c.std ** 2
        judged += c.judged
    assert judged > 300
    z = {k: (acc - exp) / math.sqrt(var) for k, (acc, exp, var) in totals.items()}
    assert abs(z["right"]) < 4, z
    assert abs(z["wrong"]) > 4, z


@needs_bundled
def test_planned_acceptance_of_plain_continuations_matches_independent_runs(pair):
    """Planning without a run: the walk's acceptance rate over 10 plain target continuations against the measured
    acceptance of 10 speculative runs with other seeds: the two means within 4 standard errors (per-run spread)."""
    tiny, draft = pair
    prompt = tiny.encode(PROMPT_TEXT)
    chain = build_chain({"temperature": 1.0})
    planned, measured = [], []
    for seed in range(10):
        chain.reset(len(prompt))
        text = [o.token_id for o in decode_tokens(tiny.model, prompt, chain, Multinomial(make_generator(seed, "cpu")),
                                                  StopRules(64, ignore_eos=True, context_length=tiny.context_length))]
        rows = teacher_forced(tiny.model, draft.model, chain, prompt, text, greedy=False)
        planned.append(plan_gamma(rows.alpha.tolist(), 4).acceptance_rate)
        sp, _ = spec_run(tiny, draft, chain, prompt, 1000 + seed, 64)
        measured.append(sp.summary(None).acceptance_rate)
    p, m = torch.tensor(planned, dtype=torch.float64), torch.tensor(measured, dtype=torch.float64)
    se = math.sqrt(p.var() / len(p) + m.var() / len(m))
    assert abs(p.mean() - m.mean()) < 4 * se, (p.mean(), m.mean(), se)


@needs_bundled
def test_cli_predict_json_and_predict_only(cli):
    code, out, err = cli("speculate", PROMPT_TEXT, "-n", "16", "-t", "0", "--predict", "--gamma", "3",
                         "--speedup-rounds", "1", "-f", "json")
    assert code == 0, err
    doc = json.loads(out)
    pred = doc["prediction"]
    assert pred["source"] == "run" and pred["tokens"] == len(doc["token_ids"]) and pred["verification"] == "greedy"
    plan = next(p for p in pred["plans"] if p["gamma"] == 3)
    assert plan["acceptance_rate"] == doc["summary"]["acceptance_rate"]  # greedy: the walk replays the run
    assert pred["conditional"]["accepted"] == pred["conditional"]["expected_accepted"]
    code, out, err = cli("speculate", PROMPT_TEXT, "-n", "8", "-t", "0.8", "--predict-only", "--sweep-gamma", "2,5",
                         "-f", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert "steps" not in doc and doc["prediction"]["source"] == "plain"
    assert [p["gamma"] for p in doc["prediction"]["plans"]] == [2, 5] and doc["prediction"]["cost_ratio"] > 0
    code, out, err = cli("speculate", PROMPT_TEXT, "--predict-only", "--predict-text", " she", "-f", "json")
    assert code == 0, err and json.loads(out)["prediction"]["source"] == "text"
    code, out, err = cli("speculate", PROMPT_TEXT, "--draft", "ngram", "--predict")
    assert code == 2 and "--predict" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
