"""The kept set: the ids that survive each stage (sample and score --kept-ids), and score --renormalize, the
correction RL trainers apply after top-p: a text sampled at top-p 0.8 has a mean importance ratio
p_raw / p_processed below 1 (the mean kept mass); renormalized over the kept set, it is 1."""

from __future__ import annotations

import math

import pytest
import torch

from decodelab.core.engine.models import load_model
from decodelab.core.methods.sample import SampleSettings, build_sampler
from decodelab.core.methods.score import ScoreSettings, build_scorer
from decodelab.core.sampling.chain import make_chain

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", device="cpu", dtype="float32")


def sampled(tiny, n: int = 40, **settings) -> tuple[list[int], list[int]]:
    prompt = tiny.encode(PROMPT)
    run = build_sampler(tiny, SampleSettings(max_new_tokens=n, ignore_eos=True, seed=3, **settings), prompt)
    list(run)
    return prompt, run.new_ids


def scored(tiny, ids: list[int], **settings):
    s = ScoreSettings(renormalize=True, **settings)
    run = build_scorer(tiny, s, ids, make_chain(tiny, s))
    return list(run), run.summary()


def test_the_importance_ratio_moves_to_one_at_top_p_08(tiny):
    prompt, out = sampled(tiny, temperature=1.0, top_p=0.8)
    rows, summary = scored(tiny, prompt + out, top_p=0.8)
    generated = rows[len(prompt) - 1:]
    # before: exp(raw - processed) = the kept mass, by hand from the model's softmax and a sort
    ids, masses = list(prompt), []
    for token in out:
        with torch.no_grad():
            p = torch.softmax(tiny.model(torch.tensor([ids])).logits[0, -1].double(), -1).sort(descending=True)
        keep = (p.values.cumsum(0) - p.values) < 0.8
        masses.append(float(p.values[keep].sum()))
        ids.append(token)
    before = [math.exp(r.raw_logprob - r.logprob) for r in generated]
    after = [math.exp(r.kept_logprob - r.logprob) for r in generated]
    assert before == pytest.approx(masses, abs=1e-5)
    assert sum(before) / len(before) < 0.95
    assert sum(after) / len(after) == pytest.approx(1.0, abs=1e-5)
    assert summary.importance_ratio_kept_mean == pytest.approx(1.0, abs=1e-5)
    assert summary.importance_ratio_mean < summary.importance_ratio_kept_mean


def test_kept_logprob_is_the_raw_logprob_over_the_kept_mass_at_any_temperature(tiny):
    prompt, out = sampled(tiny, n=8, temperature=0.7, top_k=5)
    rows, _ = scored(tiny, prompt + out, temperature=0.7, top_k=5)
    ids = list(prompt + out)
    for r in rows:
        with torch.no_grad():
            z = tiny.model(torch.tensor([ids[: r.position]])).logits[0, -1].double()
        raw = torch.log_softmax(z, -1)
        kept = z.topk(5).indices  # temperature keeps the order: top-k of z / T = top-k of z
        mass = float(raw[kept].exp().sum())
        assert r.kept_mass == pytest.approx(mass, abs=1e-5)
        if r.token_id in kept.tolist():
            assert r.kept_logprob == pytest.approx(float(raw[r.token_id]) - math.log(mass), abs=1e-5)
        else:
            assert r.kept_logprob == -math.inf


def test_sample_kept_ids_per_stage(tiny):
    prompt = tiny.encode(PROMPT)
    run = build_sampler(tiny, SampleSettings(max_new_tokens=4, temperature=0.9, top_k=7, top_p=0.9, seed=1),
                        prompt, kept=True)
    steps = list(run)
    assert [k["index"] for k in run.kept_sets] == [0, 1, 2, 3]
    ids = list(prompt)
    for step, kept in zip(steps, run.kept_sets):
        names = [s["name"] for s in kept["stages"]]
        assert names == ["temperature", "top-k", "top-p"]
        temp, k, p = kept["stages"]
        assert temp["ids"] is None and temp["kept"] == tiny.vocab_size  # temperature removes nothing
        with torch.no_grad():
            z = tiny.model(torch.tensor([ids])).logits[0, -1].double() / 0.9
        assert k["ids"] == sorted(z.topk(7).indices.tolist()) and k["kept"] == 7
        assert set(p["ids"]) <= set(k["ids"]) and p["kept"] == step.kept and step.token_id in p["ids"]
        ids.append(step.token_id)


def test_score_kept_ids(tiny):
    ids = tiny.encode("Once upon a time there was a")
    s = ScoreSettings(top_k=3, kept_ids=True)
    rows = list(build_scorer(tiny, s, ids, make_chain(tiny, s)))
    for r in rows:
        (stage,) = r.kept_sets
        assert stage["name"] == "top-k" and stage["kept"] == 3 and len(stage["ids"]) == 3
        assert (r.token_id in stage["ids"]) == math.isfinite(r.logprob)
