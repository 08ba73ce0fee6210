"""`bench` reports its warm-up apart, per configuration (issue 34, item 1): the models' own first calls before any
run (``model_warmup_s``), then every run's first, untimed call timed on its own (its row's ``decodelab_warmup_s`` /
``transformers_warmup_s``), all of it in the summary's ``warmup_s``, none of it in a rate. Pinned with instrumented
slow first calls; the negative control skips the warm-up and sees the first round pay."""

from __future__ import annotations

import time

import pytest
from conftest import random_model

from decodelab.core.analysis import bench as bm
from decodelab.core.analysis.bench import bench_document, warm_summary

PROMPT = [5, 17, 42, 5, 17]
FIRST_CALL_S = 0.3  # an instrumented first call's cost


@pytest.fixture()
def model():
    return random_model("llama", seed=21, scale=4.0, num_hidden_layers=1)


def slow_first(cost: float, out=(1, 2)):
    """A run whose first call costs ``cost`` seconds more than its later ones (which cost nothing)."""
    calls = []

    def fn():
        if not calls:
            time.sleep(cost)
        calls.append(1)
        return list(out)
    return fn


def slow_first_forward(model):
    def hook(module, args, kwargs):
        if not getattr(module, "_slow_done", False):
            module._slow_done = True
            time.sleep(FIRST_CALL_S)

    model.register_forward_pre_hook(hook, with_kwargs=True)


def bench_with(model, runs: dict) -> bm.Bench:
    b = bm.Bench(model, PROMPT, 2, ("greedy",))
    b.runs = runs
    return b


def test_each_runs_first_call_is_its_rows_warm_up_and_in_no_rate(model):
    slow_first_forward(model)
    b = bench_with(model, {"ours greedy trace": slow_first(FIRST_CALL_S), "generate greedy": slow_first(0.0),
                           "ours greedy": slow_first(2 * FIRST_CALL_S)})
    b.time(2)
    assert b.model_warmup_s >= FIRST_CALL_S  # the model's own first forward, before any run
    assert b.warmups["ours greedy trace"] >= FIRST_CALL_S and b.warmups["ours greedy"] >= 2 * FIRST_CALL_S
    assert b.warmups["generate greedy"] < FIRST_CALL_S
    assert b.warmup_s == b.model_warmup_s + sum(b.warmups.values())
    assert all(t < FIRST_CALL_S for times in b.times.values() for t in times)  # the rounds are warm
    rows = {r.setting: r.to_dict() for r in b.rows()}
    assert rows["greedy, trace on"]["decodelab_warmup_s"] == b.warmups["ours greedy trace"]
    assert rows["greedy, trace off"]["decodelab_warmup_s"] == b.warmups["ours greedy"]
    assert rows["greedy, trace on"]["transformers_warmup_s"] == rows["greedy, trace off"]["transformers_warmup_s"] \
        == b.warmups["generate greedy"]


def test_the_summary_carries_the_warm_up_and_a_best_row_its_chosen_runs(model):
    b = bm.Bench(model, PROMPT, 4, ("prompt-lookup",), gammas=(1, 2))
    b.times = {"ours ngram g=1": [0.5], "lookup g=1": [4.0], "ours ngram g=2": [1.0], "lookup g=2": [2.0]}
    b.warmups = {"ours ngram g=1": 1.5, "lookup g=1": 2.5, "ours ngram g=2": 3.5, "lookup g=2": 4.5}
    b.model_warmup_s, b.warmup_s = 0.25, 12.25
    best = b.rows()[-1]
    assert (best.note, best.decodelab_warmup_s, best.transformers_warmup_s) == \
        ("ours ngram g=1 vs lookup g=2", 1.5, 4.5)
    lm = type("LM", (), {"name": "m", "device": "cpu", "dtype": "torch.float32"})()
    doc = bench_document(lm, {}, ("prompt-lookup",), "x", PROMPT, b.rows(), "end", warm_summary(b))
    assert (doc["summary"]["warmup_s"], doc["summary"]["model_warmup_s"]) == (12.25, 0.25)


def test_rows_worked_from_given_times_have_no_warm_up():
    b = bm.Bench(random_model("llama", seed=22, num_hidden_layers=1), PROMPT, 2, ("greedy",))
    b.times = {"ours greedy trace": [1.0], "generate greedy": [1.0], "ours greedy": [1.0]}
    assert all(r.decodelab_warmup_s is None and r.transformers_warmup_s is None for r in b.rows())


def test_without_the_warm_up_the_first_round_pays(model, monkeypatch):
    """The negative control: with the untimed first calls skipped, the slow first call lands in round 1's time."""
    b = bench_with(model, {"ours greedy trace": slow_first(FIRST_CALL_S), "generate greedy": slow_first(0.0),
                           "ours greedy": slow_first(0.0)})
    monkeypatch.setattr(bm.Bench, "warm", lambda self: {name: [1, 2] for name in self.runs})
    b.time(2)
    assert b.times["ours greedy trace"][0] >= FIRST_CALL_S > b.times["ours greedy trace"][1]
    assert b.warmups == {}
