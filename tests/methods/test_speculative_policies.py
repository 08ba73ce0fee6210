"""Verification policies replayed offline: each enumerated one-step law against a simulation of the policy written
from its description (chi-square, with a negative control), the exact ones equal to p, every lossy one distorting
the bundled pair's p, and the truncating ones (adaptive, confidence) changing only the speedup."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from decodelab.core.methods.speculative import policies as pol
from decodelab.core.methods.speculative.predict import plan_gamma, teacher_forced
from decodelab.core.sampling.chain import build_chain

from test_speculative import chi2_threshold

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = all((ROOT / "presets" / "models" / m / "model.safetensors").exists() for m in ("tiny", "tiny-draft"))


def random_rows(n: int, v: int, seed: int, zeros: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """p, q [n, v]; with ``zeros`` some tokens have p = 0 (a filter removed them) or q = 0."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(n, v, generator=gen) ** 3
    q = torch.rand(n, v, generator=gen) ** 3
    if zeros:
        p[:, 0] = 0.0
        q[:, 1] = 0.0
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def simulate(policy: str, p: torch.Tensor, q: torch.Tensor, runs: int, gen: torch.Generator, g: float = 0.0,
             rate: float = 0.7) -> torch.Tensor:
    """The first emitted token of ``runs`` rounds at one position, drawn step by step as the policy says:
    x ~ q (argmax q for greedy-draft), verdict, fallback. Returns counts [V]."""
    v = p.shape[0]
    counts = torch.zeros(v)
    residual = (p - q).clamp_min(0)
    residual = residual / residual.sum() if residual.sum() > 0 else p
    h = -(p * p.clamp_min(1e-30).log()).sum()
    thr = min(0.09, 0.3 * math.exp(-float(h)))
    for _ in range(runs):
        x = int(q.argmax()) if policy == "greedy-draft" else int(torch.multinomial(q, 1, generator=gen))
        u = float(torch.rand(1, generator=gen))
        native = u < min(1.0, float(p[x] / q[x]))
        if policy in ("exact", "greedy-draft"):
            y = x if native else int(torch.multinomial(residual, 1, generator=gen))
        elif policy == "typical":
            y = x if float(p[x]) > thr else int(p.argmax())
        elif policy == "synthetic":
            y = x if u < rate else int(torch.multinomial(p, 1, generator=gen))
        elif policy == "fly":  # deferred when the next native decisions (chance g) accept
            defer = float(torch.rand(1, generator=gen)) < g
            y = x if native or defer else int(torch.multinomial(residual, 1, generator=gen))
        counts[y] += 1
    return counts


def chi2(counts: torch.Tensor, law: torch.Tensor) -> tuple[float, int]:
    runs = counts.sum()
    keep = law * runs >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    exp = torch.cat([law[keep], law[~keep].sum().view(1)]) * runs
    m = exp > 0
    if float(obs[~m].sum()) > 0:
        return math.inf, int(m.sum()) - 1  # a token the law gives 0 was drawn: it does not follow the law
    return float(((obs[m] - exp[m]) ** 2 / exp[m]).sum()), int(m.sum()) - 1


LAWS = {
    "exact": lambda p, q: pol.exact_law(p, q)[0],
    "typical": lambda p, q: pol.typical_law(p, q)[0],
    "synthetic": lambda p, q: pol.synthetic_law(p, q, 0.7)[0],
    "greedy-draft": lambda p, q: pol.greedy_draft_law(p, q)[0],
}


@pytest.mark.parametrize("policy", [*LAWS, "fly"])
def test_enumerated_law_matches_a_simulation_of_the_policy(policy):
    p, q = random_rows(3, 6, seed=1)
    gen = torch.Generator().manual_seed(7)
    if policy == "fly":  # alphas of the next positions 0.9: window 1 on a 2-row text, the gate open (tau 0)
        p2 = torch.cat([p[:1], p[:1]])
        q2 = torch.cat([q[:1], p[:1] * 0.9 + q[:1] * 0.1])
        law, _ = pol.fly_law(p2, q2, window=1, tau=0.0)
        alpha_next = float(torch.minimum(p2[1], q2[1]).sum())
        rows = [(p2[0], q2[0], law[0], alpha_next)]
    else:
        law = LAWS[policy](p, q)
        rows = [(p[i], q[i], law[i], 0.0) for i in range(3)]
    for pi, qi, li, g in rows:
        assert float(li.sum()) == pytest.approx(1.0, abs=1e-6)
        counts = simulate(policy, pi, qi, 4000, gen, g=g)
        stat, df = chi2(counts, li)
        assert stat < chi2_threshold(df), (policy, stat, df)
        if policy != "exact":  # negative control: the lossy draws do not follow p
            stat, df = chi2(counts, pi)
            assert stat > chi2_threshold(df), (policy, stat, df)


def test_exact_law_is_p_and_every_lossy_law_is_not():
    p, q = random_rows(20, 50, seed=3)
    law, alpha = pol.exact_law(p, q)
    assert torch.allclose(law, p, atol=1e-6)
    assert torch.allclose(alpha, torch.minimum(p, q).sum(-1))
    for name in ("typical", "synthetic", "greedy-draft"):
        tv = 0.5 * (LAWS[name](p, q) - p).abs().sum(-1)
        assert float(tv.min()) > 1e-3, name
    fly, _ = pol.fly_law(p, q, window=2, tau=0.0)
    assert float((0.5 * (fly - p).abs().sum(-1)).max()) > 1e-3


def test_fly_gate_closed_is_exact():
    p, q = random_rows(5, 8, seed=4)
    law, accept = pol.fly_law(p, q, window=3, tau=1e9)
    assert torch.allclose(law, p, atol=1e-6) and torch.allclose(accept, torch.minimum(p, q).sum(-1))


def test_truncation_lengths_by_hand():
    # survival 0.9, 0.72, 0.36 against c = 0.5: two slots worth their cost
    assert pol.adaptive_lengths([0.9, 0.8, 0.5, 0.9], 4, 0.5) == 2
    assert pol.adaptive_lengths([0.1], 4, 0.5) == 1  # at least one draft
    q = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.99, 0.01]])
    # t=0: 0.9, 0.54, 0.53 >= 0.5 -> 3; t=1: 0.6, 0.594 -> 2 (text ends); t=2: 0.99 -> 1
    assert pol.confidence_lengths(q, 4, 0.5) == [3, 2, 1]


def test_a_truncating_walk_equals_a_fixed_gamma_when_every_round_is_full():
    alpha = [0.3, 0.9, 0.5, 0.7, 0.8, 0.6, 0.95, 0.4]
    full = plan_gamma(alpha, 3, 0.2)
    same = pol.plan_truncated(alpha, [5] * len(alpha), 3, 0.2)
    assert full == same
    one, g1 = pol.plan_truncated(alpha, [1] * len(alpha), 3, 0.2), plan_gamma(alpha, 1, 0.2)
    fields = ("rounds", "drafted", "judged", "accepted", "tokens_per_round", "predicted_speedup")
    assert [getattr(one, f) for f in fields] == pytest.approx([getattr(g1, f) for f in fields], abs=1e-12)
    assert one.per_position_acceptance[1:] == [None, None]


@pytest.mark.skipif(not BUNDLED, reason="the bundled tiny / tiny-draft weights are not trained yet")
def test_replay_on_the_bundled_pair_exact_zero_lossy_nonzero():
    from decodelab.core.engine.models import load_model

    tiny, draft = load_model("tiny", device="cpu"), load_model("tiny-draft", device="cpu")
    prompt = tiny.encode("Once upon a time, there was a little")
    text = tiny.tokenizer.encode(" girl named Lily. She loved to play outside in the park.", add_special_tokens=False)
    rows = teacher_forced(tiny.model, draft.model, build_chain({"temperature": 1.0}), prompt, text, greedy=False)
    reports = {r.policy: r for r in pol.replay(rows.p, rows.q, 4, 0.25)}
    assert set(reports) == set(pol.POLICIES)
    for name in ("exact", "adaptive", "confidence"):
        assert reports[name].lossless and reports[name].max_tv < 1e-5 and reports[name].outside == 0
        assert reports[name].mean_kl is not None and reports[name].mean_kl < 1e-5
    for name in ("typical", "synthetic", "fly", "greedy-draft"):
        assert not reports[name].lossless and reports[name].mean_tv > 1e-3, name
    assert reports["exact"].plan == plan_gamma(rows.alpha.tolist(), 4, 0.25)
    assert reports["fly"].first_acceptance >= reports["exact"].first_acceptance  # deferral only adds acceptance
