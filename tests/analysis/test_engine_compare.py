"""The top-N-truncated KL of compare --engine: its bounds hold the exact KL, are exact without a tail, and the
upper one is attained (so it is the tightest these facts allow)."""

from __future__ import annotations

import math

import pytest
import torch

from decodelab.core.analysis.engine_compare import tail_bound, truncated_kl


def kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return float((p.exp() * (p - q)).sum())


def top(logp: torch.Tensor, n: int) -> list[tuple[int, float]]:
    t = logp.topk(n)
    return list(zip(t.indices.tolist(), t.values.tolist()))


@pytest.mark.parametrize("vocab, n, scale", [(20, 3, 1.0), (50, 5, 3.0), (1000, 20, 3.0), (4096, 20, 5.0)])
def test_bounds_hold_the_exact_kl(vocab, n, scale):
    gen = torch.Generator().manual_seed(vocab + n)
    for _ in range(100):
        p = torch.log_softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * scale, -1)
        q = torch.log_softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * scale, -1)
        lower, upper, tail = truncated_kl(top(p, n), q)
        exact = kl(p, q)
        assert lower - 1e-9 <= exact <= upper + 1e-9
        assert tail == pytest.approx(1 - float(p.exp().topk(n).values.sum()), abs=1e-12)


def test_no_tail_no_gap():
    p = torch.log_softmax(torch.tensor([2.0, 1.0, 0.0, -1.0], dtype=torch.float64), -1)
    q = torch.log_softmax(torch.tensor([0.0, 1.0, 2.0, 0.5], dtype=torch.float64), -1)
    lower, upper, tail = truncated_kl(top(p, 4), q)
    assert lower == pytest.approx(kl(p, q), abs=1e-12) and upper == pytest.approx(kl(p, q), abs=1e-12)


def test_lower_bound_is_the_kl_with_the_tail_as_one_bucket():
    p = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.1], dtype=torch.float64)
    q = torch.tensor([0.3, 0.3, 0.2, 0.1, 0.1], dtype=torch.float64)
    lower, _, tail = truncated_kl([(0, math.log(0.5)), (1, math.log(0.2))], q.log())
    by_hand = 0.5 * math.log(0.5 / 0.3) + 0.2 * math.log(0.2 / 0.3) + 0.3 * math.log(0.3 / 0.4)
    assert tail == pytest.approx(0.3) and lower == pytest.approx(by_hand, abs=1e-12)


def test_upper_bound_is_attained():
    """P puts the cap on the unlisted tokens Q likes least, the rest on the next: the bound is its exact KL."""
    q = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.05, 0.03, 0.02], dtype=torch.float64)
    # listed: tokens 0, 1 with p 0.4, 0.2 (cap c = 0.2); tail 0.4 = 0.2 on token 6, 0.2 on token 5
    p = torch.tensor([0.4, 0.2, 0.0, 0.0, 0.0, 0.2, 0.2], dtype=torch.float64)
    exact = float(sum(pi * math.log(pi / qi) for pi, qi in zip(p.tolist(), q.tolist()) if pi > 0))
    lower, upper, tail = truncated_kl([(0, math.log(0.4)), (1, math.log(0.2))], q.log())
    assert upper == pytest.approx(exact, abs=1e-12) and lower <= exact


def test_tail_bound_by_hand():
    q = torch.tensor([0.5, 0.1, 0.2], dtype=torch.float64)
    # tail 0.25 under cap 0.1: 0.1 on q = 0.1, 0.1 on q = 0.2, 0.05 on q = 0.5
    expected = 0.1 * math.log(0.1 / 0.1) + 0.1 * math.log(0.1 / 0.2) + 0.05 * math.log(0.05 / 0.5)
    assert tail_bound(0.25, 0.1, q) == pytest.approx(expected, abs=1e-12)


def test_a_listed_token_the_local_model_removes_makes_the_kl_infinite():
    q = torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64).log()
    lower, upper, _ = truncated_kl([(0, math.log(0.6)), (1, math.log(0.4))], q)
    assert lower == math.inf and upper == math.inf


# mutation run of core/analysis/engine_compare.py (2026-12-02): the bounds at their edges


def test_the_one_unlisted_token_the_local_model_removes_makes_the_kl_infinite():
    q = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64).log()  # the tail 0.2 can only sit on token 2
    lower, upper, tail = truncated_kl([(0, math.log(0.5)), (1, math.log(0.3))], q)
    assert (lower, upper) == (math.inf, math.inf) and tail == pytest.approx(0.2)


def test_a_listed_token_at_zero_adds_nothing_and_caps_nothing():
    """A listed token at -inf (p = 0) adds 0 log 0 = 0 to the head, and bounds no unlisted token (the cap is the
    least positive listed p): the tail 0.5 sits as one cap of 0.5 on an unlisted token of q 0.25."""
    q = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64).log()
    lower, upper, tail = truncated_kl([(0, math.log(0.5)), (1, -math.inf)], q)
    head = 0.5 * math.log(0.5 / 0.25)
    assert tail == 0.5 and lower == pytest.approx(head + 0.5 * math.log(0.5 / 0.5), abs=1e-12)
    assert upper == pytest.approx(head + 0.5 * math.log(0.5 / 0.25), abs=1e-12)


def test_every_listed_token_at_zero():
    """Nothing listed has mass: the tail is 1 and caps itself; on three unlisted tokens of q 0.25 the bound puts it
    all on one of them."""
    q = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64).log()
    lower, upper, tail = truncated_kl([(0, -math.inf)], q)
    assert tail == 1.0 and lower == pytest.approx(math.log(1 / 0.75), abs=1e-12)
    assert upper == pytest.approx(math.log(1 / 0.25), abs=1e-12)


def test_a_tail_that_is_a_whole_number_of_caps_leaves_no_rest():
    # listed 0.5 and 0.25: the tail 0.25 is one cap of 0.25, on one of the two unlisted tokens (q 0.25): no rest
    q = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64).log()
    lower, upper, tail = truncated_kl([(0, math.log(0.5)), (1, math.log(0.25))], q)
    assert tail == 0.25 and upper == pytest.approx(0.5 * math.log(2), abs=1e-12)


# --------------------------------------------------------------------------------------------------------------
# mutation run of core/analysis/engine_compare.py (2026-12-02): the comparison against a table transport
# (tests/engine/fake_server.py), its figures recomputed from the model's own forward


@pytest.fixture(scope="module")
def lm():
    from decodelab.core.engine.models import load_model

    return load_model("tiny", device="cpu", dtype="float32")


def table_connection(lm, answers: dict, mode="processed_logprobs", max_top_n=20):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
    from fake_server import table_engine

    from decodelab.core.methods.served import Connection

    e, _ = table_engine(answers, logprobs_mode=mode, max_top_n=max_top_n)
    return Connection(e, lm, mode, "probe", True)


def test_variants_the_engine_cannot_run_are_refused_before_it_is_contacted(lm):
    from decodelab.core.analysis.compare import Prompt, Variant
    from decodelab.core.analysis.engine_compare import EngineComparison
    from decodelab.core.errors import ConfigError

    prompts = [Prompt("p", "Once upon a time")]
    for variant, message in [
            (Variant("b", "beam"), "variant b: method=beam: compare --engine runs sample variants only (the engine's "
                                   "beam search and speculation are its own)"),
            (Variant("s", values=(("semantics", "hf"),)), "variant s: semantics: the local side is read as vLLM "
                                                          "reads it"),
            (Variant("c", values=(("cache", "window:size=8"),)),
             "variant c: cache=window:size=8: needs a KV-cache policy (the server keeps its own cache), which a "
             "served engine cannot give; run it without --engine"),
            (Variant("d", values=(("dry_multiplier", 0.8),)), "--dry-multiplier: vLLM has no such stage (a served "
                                                              "engine has no equivalent); drop it or run without "
                                                              "--engine")]:
        with pytest.raises(ConfigError) as err:
            EngineComparison(lm, None, [Variant("ok"), variant], prompts, [0])
        assert str(err.value) == message
    c = EngineComparison(lm, None, [Variant("v", values=(("semantics", "vllm"), ("cache", "full"))), Variant("w")],
                         prompts * 3, [0, 5], base={"top": 7, "temperature": 0.5}, top_n=4)
    assert c.total == 12 and c.top_n == 4 and set(c.settings) == {("v", 0), ("v", 5), ("w", 0), ("w", 5)}
    s = c.settings["w", 5]
    assert (s.semantics, s.top, s.seed, s.temperature) == ("vllm", 0, 5, 0.5)  # --top is the engine's, not local
    c.conn = table_connection(lm, {}, max_top_n=7)
    assert EngineComparison(lm, c.conn, [Variant("w")], prompts, [0]).top_n == 7
    c.conn = table_connection(lm, {}, max_top_n=None)
    assert EngineComparison(lm, c.conn, [Variant("w")], prompts, [0]).top_n == 20


def test_a_comparison_worked_by_hand(lm):
    """The engine answers the greedy variant with 12, 261, 9 (the local greedy run gives 12, 261, 836) and replays
    them with its raw values off the model's by +0.01, -0.03, +0.02; the sampled variant's request fails."""
    from decodelab.core.analysis.compare import Prompt, Variant, distinct_n, repetition_rate
    from decodelab.core.analysis.engine_compare import EngineComparison, EnginePair, truncated_kl
    from decodelab.core.engine.http.transport import EngineError

    prompt_ids = lm.encode("Once upon a time")
    ids, offsets = [12, 261, 9], [0.01, -0.03, 0.02]
    with torch.no_grad():
        logits = lm.model(torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1: -1].double()
    local = torch.log_softmax(logits, -1)
    gen = [-0.1, -0.2, -5.0]  # the engine's processed values

    def entry(i):
        top = local[i].topk(2).indices.tolist()
        values = {t: (float(local[i, t]), 1) for t in top}
        if i == 2:  # the engine lists the local argmax 836 far down: its top 1 is then 9
            values = {836: (float(local[i, 836]) - 10.0, 2)}
        return {**values, ids[i]: (float(local[i, ids[i]]) + offsets[i], 1)}

    def completions(body):
        if body["temperature"] != 0.0:
            raise EngineError("--engine http://127.0.0.1:9: POST /v1/completions: HTTP 500: sampled")
        if "prompt_logprobs" in body:
            assert body["prompt"] == prompt_ids + ids and body["prompt_logprobs"] == 2
            return prompt_answer([None] + [{t: (-1.0, 1)} for t in prompt_ids[1:]] + [entry(i) for i in range(3)])
        return completion_answer(ids, gen, [{t: v} for t, v in zip(ids, gen)])

    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
    from fake_server import completion_answer, prompt_answer

    seen = []
    conn = table_connection(lm, {"/v1/completions": completions})
    c = EngineComparison(lm, None, [Variant("g", values=(("temperature", 0.0),)),
                                    Variant("t", values=(("temperature", 1.0),))],
                         [Prompt("p", "Once upon a time")], [0], base={"max_new_tokens": 3}, top_n=2,
                         on_row=seen.append)
    c.conn = conn
    g, t = c.run().pairs
    assert [r.variant for r in c.rows] == ["g@local", "g@engine", "t@local"] and seen == c.rows
    local_row, engine_row = c.rows[:2]
    assert local_row.token_ids == [12, 261, 836] and local_row.stop_reason == "length"
    with torch.no_grad():  # the local greedy run's own raw log-probabilities, from the model's forward
        greedy = torch.log_softmax(lm.model(torch.tensor([prompt_ids + [12, 261, 836]])).logits[0, 4:7].double(), -1)
    greedy_raw = [float(greedy[i, t]) for i, t in enumerate([12, 261, 836])]
    assert (local_row.method, local_row.prompt, local_row.seed, local_row.text, local_row.length) == (
        "sample", "p", 0, lm.decode([12, 261, 836]), 3)
    assert local_row.raw_perplexity == pytest.approx(math.exp(-sum(greedy_raw) / 3), rel=1e-5)
    # greedy keeps one candidate a step: processed log-probability 0, one kept, no entropy
    assert (local_row.mean_logprob, local_row.mean_kept, local_row.mean_entropy) == (0.0, 1.0, 0.0)
    assert (local_row.distinct_1, local_row.distinct_2) == (1.0, 1.0)
    assert local_row.decided_by == ["model"] * 3 and local_row.tokens_per_s > 0
    assert (engine_row.method, engine_row.prompt, engine_row.seed, engine_row.text, engine_row.token_ids,
            engine_row.length, engine_row.stop_reason) == ("sample", "p", 0, lm.decode(ids), ids, 3, "length")
    assert engine_row.mean_logprob == pytest.approx(sum(gen) / 3, abs=1e-12)
    raw = [float(local[i, ids[i]]) + offsets[i] for i in range(3)]
    assert engine_row.raw_perplexity == pytest.approx(math.exp(-sum(raw) / 3), rel=1e-9)
    assert (engine_row.distinct_1, engine_row.distinct_2, engine_row.repetition_rate) == (
        distinct_n(ids, 1), distinct_n(ids, 2), repetition_rate(ids))
    assert (engine_row.mean_kept, engine_row.mean_entropy) == (None, None) and engine_row.tokens_per_s > 0
    # the pair, teacher-forced on the engine's tokens
    tops = []
    for i in range(3):
        values = {t: v for t, (v, _) in entry(i).items()}
        tops.append(sorted(values.items(), key=lambda kv: (-kv[1], kv[0]))[:2])
    bounds = [truncated_kl(top, local[i]) for i, top in enumerate(tops)]
    assert (g.variant, g.prompt, g.seed, g.greedy, g.same_tokens, g.first_divergence, g.positions, g.top_n) == (
        "g", "p", 0, True, False, 2, 3, 2)
    assert g.kl_lower_mean == pytest.approx(sum(b[0] for b in bounds) / 3, abs=1e-9)
    assert g.kl_upper_mean == pytest.approx(sum(b[1] for b in bounds) / 3, abs=1e-9)
    assert g.kl_upper_max == pytest.approx(max(b[1] for b in bounds), abs=1e-9)
    assert g.tail_mass_mean == pytest.approx(sum(b[2] for b in bounds) / 3, abs=1e-9)
    assert g.top1_agreement == pytest.approx(2 / 3) and tops[2][0][0] == 9
    assert g.max_abs_delta_raw_logprob == pytest.approx(0.03, abs=1e-6)
    assert g.mean_abs_delta_raw_logprob == pytest.approx(0.02, abs=1e-6)
    assert g.max_abs_delta_logprob == pytest.approx(max(abs(a - float(local[i, ids[i]])) for i, a in enumerate(gen)),
                                                    abs=1e-6)  # greedy: the processed values are the raw ones
    assert g.engine_error is None
    assert t == EnginePair("t", "p", 0, False, False, None, 0, 2, None, None, None, None, None, None, None, None,
                           "--engine http://127.0.0.1:9: POST /v1/completions: HTTP 500: sampled")
    assert g.to_dict()["first_divergence"] == 2 and list(t.to_dict()) == [
        "variant", "prompt", "seed", "greedy", "same_tokens", "first_divergence", "positions", "top_n",
        "kl_lower_mean", "kl_upper_mean", "kl_upper_max", "tail_mass_mean", "top1_agreement",
        "max_abs_delta_raw_logprob", "mean_abs_delta_raw_logprob", "max_abs_delta_logprob", "engine_error"]


def test_a_failed_replay_a_loop_and_an_empty_answer_in_raw_mode(lm, monkeypatch):
    import sys
    from pathlib import Path

    from decodelab.core.analysis.compare import Prompt, Variant
    from decodelab.core.analysis.engine_compare import EngineComparison
    from decodelab.core.engine.http.transport import EngineError

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
    from fake_server import completion_answer

    def completions(body):
        if "prompt_logprobs" in body:
            raise EngineError("--engine http://127.0.0.1:9: POST /v1/completions: HTTP 500: replay")
        if body["max_tokens"] == 1:
            return completion_answer([], [], [], finish="stop")
        out = [12, 261, 12, 261, 12, 261, 12, 0]  # a loop, ended by the end id 0
        return completion_answer(out, [-0.5] * 8, [{t: -0.5} for t in out], finish="stop")

    import itertools

    from decodelab.core.analysis.compare import distinct_n, repetition_rate

    ticks = itertools.count()  # time.perf_counter as 2 s a call: the request takes 2 s
    monkeypatch.setattr(__import__("time"), "perf_counter", lambda: 2.0 * next(ticks))
    c = EngineComparison(lm, None, [Variant("g", values=(("temperature", 0.0), ("max_new_tokens", 8))),
                                    Variant("e", values=(("temperature", 0.0), ("max_new_tokens", 1)))],
                         [Prompt("p", "Once upon a time")], [3], top_n=2)
    c.conn = table_connection(lm, {"/v1/completions": completions}, mode="raw_logprobs")
    g, e = c.run().pairs
    engine_row = c.rows[1]
    out = [12, 261, 12, 261, 12, 261, 12, 0]
    assert (engine_row.token_ids, engine_row.mean_logprob, engine_row.raw_perplexity) == (out, None, None)
    assert (engine_row.stop_reason, engine_row.tokens_per_s) == ("eos", 4.0)  # 8 tokens in 2 s
    assert (engine_row.distinct_1, engine_row.distinct_2, engine_row.repetition_rate) == (
        distinct_n(out, 1), distinct_n(out, 2), repetition_rate(out))
    # 3 distinct of 8 tokens, 3 of 7 bigrams, 3 of 5 4-grams: seq-rep-4 = 1 - 3/5
    assert (engine_row.distinct_1, engine_row.distinct_2) == (3 / 8, 3 / 7)
    assert engine_row.repetition_rate == pytest.approx(0.4, abs=1e-12)
    local_ids = c.rows[0].token_ids
    assert local_ids[:3] == [12, 261, 836] and len(local_ids) == 8  # the local run parts from the loop at step 2
    assert c.rows[0].repetition_rate == repetition_rate(local_ids) and c.rows[0].tokens_per_s > 0
    assert (c.rows[0].distinct_1, c.rows[0].distinct_2) == (distinct_n(local_ids, 1), distinct_n(local_ids, 2))
    assert len({distinct_n(local_ids, n) for n in (1, 2, 3)}) == 3  # a run where the three differ
    assert (g.same_tokens, g.first_divergence, g.positions, g.kl_lower_mean, g.max_abs_delta_logprob) == (
        False, 2, 0, None, None)
    assert g.engine_error == "--engine http://127.0.0.1:9: POST /v1/completions: HTTP 500: replay"
    assert g.seed == 3 and g.greedy
    empty = c.rows[3]
    assert (empty.variant, empty.token_ids, empty.length, empty.stop_reason, empty.raw_perplexity) == (
        "e@engine", [], 0, "stop", None)
    assert (e.positions, e.engine_error, e.same_tokens, e.first_divergence) == (0, None, False, 0)


def test_a_request_timed_at_zero_has_no_rate(lm, monkeypatch):
    import sys
    from pathlib import Path

    from decodelab.core.analysis.compare import Prompt, Variant
    from decodelab.core.analysis.engine_compare import EngineComparison

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
    from fake_server import completion_answer

    monkeypatch.setattr(__import__("time"), "perf_counter", lambda: 5.0)  # a clock that never moves
    c = EngineComparison(lm, None, [Variant("g", values=(("temperature", 0.0), ("max_new_tokens", 1)))],
                         [Prompt("p", "Once upon a time")], [0], top_n=2)
    answer = completion_answer([12], [-0.5], [{12: -0.5}])  # the replay gets null, "no choices": it fails
    c.conn = table_connection(lm, {"/v1/completions": lambda body: None if "prompt_logprobs" in body else answer},
                              mode="raw_logprobs")
    c.run()
    assert c.rows[1].variant == "g@engine" and math.isnan(c.rows[1].tokens_per_s)


def test_a_local_run_that_draws_nothing(lm):
    """--allow the and --ban the: the chain is empty at the first step, so the local row has no token and no
    figure (and no perplexity of nothing)."""
    from decodelab.core.analysis.compare import Prompt, Variant
    from decodelab.core.analysis.engine_compare import EngineComparison

    v = Variant("g", values=(("temperature", 0.0), ("max_new_tokens", 2), ("allow", ("the",)), ("ban", ("the",))))
    c = EngineComparison(lm, None, [v], [Prompt("p", "Once upon a time")], [0])
    row = c.local_row(v, c.settings["g", 0], c.prompts[0], lm.encode("Once upon a time"), 0)
    assert (row.token_ids, row.length, row.stop_reason, row.raw_perplexity, row.mean_logprob) == (
        [], 0, "empty_chain", None, None)
