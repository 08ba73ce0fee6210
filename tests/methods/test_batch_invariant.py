"""Batch-invariant mode (issue 34, item 4): a request's tokens and log-probabilities, bit for bit, do not depend on
the requests it shares a batch with. The oracle is the request run alone (a batch of one, same chunk size). The
negative control shows that without the mode this CPU's batched forwards do move a request's bits (float32 GEMMs
and attention over shapes its neighbours set); where a CPU shows no such dependence at all, it is skipped, saying so.
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_model

from decodelab.core.engine.stopping import StopRules
from decodelab.core.errors import ConfigError
from decodelab.core.methods.batch.scheduler import Request, Scheduler
from decodelab.core.sampling.chain import build_chain
from decodelab.core.sampling.select import make_selector

NEW = 10
CASES = [("llama", 1), ("qwen2", 1), ("gpt2", 2)]  # gemma2: paged attention refuses sliding layers


def prompts(seed: int = 0) -> tuple[list[int], list[list[int]]]:
    """The target (37 tokens) and neighbours of other lengths; the first shares the target's first 32 tokens (a
    prefix another request would compute for it under prefix caching)."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(5, 250, (37,), generator=g).tolist()
    others = [target[:32] + [7, 8, 9]] + [torch.randint(5, 250, (n,), generator=g).tolist() for n in (3, 60, 17, 5, 44)]
    return target, others


def request(key: str, prompt: list[int], sampled: bool) -> Request:
    chain = build_chain({"temperature": 0.9, "top_k": 40} if sampled else {})
    selector = make_selector("multinomial" if sampled else "greedy", 11, "cpu")
    return Request(key, prompt, chain, selector, StopRules(NEW, ignore_eos=True))


def bits(result) -> list[tuple[int, float, float]]:
    return [(s.token_id, s.logprob, s.raw_logprob) for s in result.steps]


def alone(model, target, sampled: bool, chunk: int):
    return Scheduler(model, [request("t", target, sampled)], max_batch=1, max_tokens_per_iteration=chunk).run()[0]


def shared(model, target, others, sampled: bool, chunk: int, invariant: bool):
    requests = [request(f"o{i}", p, sampled) for i, p in enumerate(others)]
    requests.insert(len(requests) // 2, request("t", target, sampled))  # mid-queue: it joins beside running rows
    results = Scheduler(model, requests, max_batch=4, max_tokens_per_iteration=chunk, invariant=invariant).run()
    return next(r for r in results if r.id == "t")


SETUPS = [(sampled, chunk, k) for sampled in (False, True) for chunk in (512, 16) for k in (1, 3, 6)]


@pytest.mark.parametrize("arch, seed", CASES)
def test_invariant_mode_gives_a_request_the_bits_it_has_alone(arch, seed):
    model = random_model(arch, seed=seed, scale=4.0)
    target, others = prompts()
    for sampled, chunk, k in SETUPS:
        result = shared(model, target, others[:k], sampled, chunk, invariant=True)
        assert bits(result) == bits(alone(model, target, sampled, chunk)), (sampled, chunk, k)
        assert result.prefix_hit_tokens == 0 and result.preemptions == 0


def test_without_it_this_cpu_moves_a_requests_bits():
    """The negative control: the same requests batched as usual differ from the lone run in at least one bit."""
    moved = []
    for arch, seed in CASES:
        model = random_model(arch, seed=seed, scale=4.0)
        target, others = prompts()
        for sampled, chunk, k in SETUPS:
            if bits(shared(model, target, others[:k], sampled, chunk, invariant=False)) != \
                    bits(alone(model, target, sampled, chunk)):
                moved.append((arch, sampled, chunk, k))
    if not moved:
        pytest.skip("this CPU shows no batch dependence at all: the invariant mode's test cannot fail here")
    assert moved


def test_each_row_is_its_own_forward_at_its_own_chunk():
    """Invariant: as many forwards as scheduled rows, each one row wide, and a prefill chunk of at most the per-row
    cap whatever the neighbours took; the iteration's rows and tokens are recorded as usual."""
    model = random_model("llama", seed=1)
    target, others = prompts()
    shapes = []
    model.model.embed_tokens.register_forward_hook(lambda m, i, o: shapes.append(tuple(i[0].shape)))
    sched = Scheduler(model, [request("t", target, False), request("o", others[2], False)], max_batch=2,
                      max_tokens_per_iteration=16, invariant=True)
    records = list(sched)
    assert all(rows == 1 for rows, _ in shapes) and all(n <= 16 for _, n in shapes)
    assert len(shapes) == sum(r.rows for r in records)
    assert sum(n for _, n in shapes) == sum(r.tokens for r in records)
    assert records[0].rows == 2 and records[0].tokens == 32  # both first chunks in full: no shared budget


def test_invariant_mode_refuses_static_batching_and_prefix_caching():
    model = random_model("llama", seed=1)
    target, _ = prompts()
    for extra in ({"static": True}, {"prefix_caching": True}):
        with pytest.raises(ConfigError) as e:
            Scheduler(model, [request("t", target, False)], invariant=True, **extra)
        assert str(e.value).startswith("batch-invariant mode: not with static batching or prefix caching")


# --- through the command --------------------------------------------------------------------------------------


def test_cli_invariant_requests_carry_their_lone_runs_bits_and_the_cost_is_measured(cli, toy_model_dir, tmp_path):
    """`batch --batch-invariant`: each request's steps equal those of the same request in a prompts file of its own
    (bit for bit: JSON floats round-trip exactly); `--baselines batched` reports the ordinary mode beside it."""
    import json

    prompts = ["Once upon a time there was a", "Hello", "The cat sat on the mat and then it went to", "In the"]
    both = tmp_path / "all.txt"
    both.write_text("\n".join(prompts) + "\n")
    common = ["-m", toy_model_dir, "-n", "5", "-t", "0.9", "--seed", "4", "--max-tokens-per-iteration", "4",
              "--threads", "1", "-f", "json"]
    code, out, err = cli("batch", "--prompts-file", both, "--batch-invariant", "--baselines", "batched", *common)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["config"]["batch_invariant"] is True
    summary = doc["summary"]
    assert summary["batched_tokens_per_s"] > 0 and summary["speedup_vs_batched"] > 0
    assert summary["batched_warmup_s"] >= 0 and 0 <= summary["batched_same_tokens"] <= len(prompts)
    steps = lambda r: [(s["token_id"], s["logprob"], s["raw_logprob"]) for s in r["steps"]]  # noqa: E731
    for i, prompt in enumerate(prompts):
        one = tmp_path / f"p{i}.txt"
        one.write_text(prompt + "\n")
        code, out, err = cli("batch", "--prompts-file", one, "--baselines", "none", *common)
        assert code == 0, err
        assert steps(doc["requests"][i]) == steps(json.loads(out)["requests"][0]), prompt


def test_cli_the_batched_baseline_needs_the_invariant_mode(cli, toy_model_dir, tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("Hello\n")
    code, out, err = cli("batch", "--prompts-file", path, "-m", toy_model_dir, "--baselines", "batched")
    assert code == 2 and out == ""
    assert err == ("error: --baselines batched: the ordinary batched mode is the run itself without "
                   "--batch-invariant; give --batch-invariant to time one against the other\n")
