"""The runtime seam: every method's model calls go through it, positions come from the policy's `seen` count, the
static cache equals the full one, and a traced token costs one device-to-host transfer."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from conftest import ARCHS, random_model

from decodelab.core import kv
from decodelab.core.methods.beam import BeamSearch, BeamSettings, ModelStepper
from decodelab.core.methods.sample import Sampler, decode_tokens
from decodelab.core.engine.stopping import StopRules
from decodelab.core.methods.probs import next_token_stages
from decodelab.core.errors import ConfigError
from decodelab.core.kv import CacheSpec, parse_cache_spec, require
from decodelab.core.kv.full import FullPolicy
from decodelab.core.sampling.chain import build_chain
from decodelab.core.methods.score import Scorer, ScoreSettings
from decodelab.core.engine.runtime import Runtime
from decodelab.core.sampling.select import Greedy, make_generator, make_selector
from decodelab.core.methods.speculative.proposers import ModelProposer, NGramProposer
from decodelab.core.methods.speculative.run import Speculator

PROMPT = [5, 17, 42, 9, 77, 3, 17, 42]
GREEDY = {"temperature": 0}


# --- policies for tests ----------------------------------------------------------------------------------------


class RecordingPolicy(FullPolicy):
    """The full cache, recording every forward the runtime announces: (seen before it, tokens fed, positions)."""

    name = "recording"
    log: list = []

    def positions(self, n):
        out = super().positions(n)
        RecordingPolicy.log.append((self.seen, n, out[0].tolist()))
        return out


class OffsetPolicy(FullPolicy):
    """A toy that has 'seen' OFFSET tokens it never stored: stored = seen - OFFSET for the whole run. A method that
    took positions from what the cache stores (instead of `seen`) runs every token OFFSET positions early."""

    name = "offset"
    OFFSET = 6

    def __init__(self, info, capacity=None, needs=frozenset()):
        super().__init__(info, capacity, needs)
        self.seen = self.OFFSET

    @property
    def stored(self):
        held = super().stored
        assert held == self.seen - self.OFFSET
        return held


@pytest.fixture
def policies(monkeypatch):
    kv.parse_cache_spec("full")  # load the registry before adding to it
    monkeypatch.setitem(kv.POLICIES, "recording", RecordingPolicy)
    monkeypatch.setitem(kv.POLICIES, "offset", OffsetPolicy)
    RecordingPolicy.log = []


def count_forwards(model) -> list:
    """Position ids of every forward the model runs (a pre-hook sees the call whatever called it)."""
    seen = []
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs.get("position_ids")),
                                    with_kwargs=True)
    return seen


def recompute_greedy(model, prompt, n, offset=0):
    """Greedy decoding without any cache: a full forward over the sequence at positions offset.. each step."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            pos = torch.arange(offset, offset + len(seq))[None]
            logits = model(torch.tensor([seq]), position_ids=pos).logits[0, -1]
            seq.append(int(logits.argmax()))
    return seq[len(prompt):]


# --- every model call goes through the runtime ------------------------------------------------------------------


def test_every_method_calls_the_model_only_through_the_runtime(policies):
    target = random_model("llama", seed=0, scale=20.0)
    draft = random_model("llama", seed=1, scale=20.0)
    calls = count_forwards(target) + count_forwards(draft)
    t_calls, d_calls = count_forwards(target), count_forwards(draft)
    spec = CacheSpec("recording")
    chain = build_chain(GREEDY)
    rules = StopRules(6)
    list(decode_tokens(target, PROMPT, chain, Greedy(), rules, cache=spec))
    list(Sampler(target, PROMPT, chain, Greedy(), rules, str, None, cache=spec))
    next_token_stages(target, PROMPT, chain, str, cache=spec)
    BeamSearch(ModelStepper(target, spec), PROMPT, build_chain({}), BeamSettings(beams=3, max_new_tokens=4)).run()
    sp = Speculator(target, ModelProposer(draft, chain, Greedy(), cache=spec), PROMPT, chain, rules, 3, cache=spec)
    list(sp)
    list(Scorer(target, PROMPT, chain, str, ScoreSettings(feed=3), cache=spec))
    del calls
    total = len(t_calls) + len(d_calls)
    assert total > 20
    # one announced forward per model call, and the model ran at exactly the positions the policy gave
    assert len(RecordingPolicy.log) == total
    announced = sorted(tuple(p) for _, _, p in RecordingPolicy.log)
    ran = sorted(tuple(p[0].tolist()) for p in t_calls + d_calls)
    assert announced == ran
    for seen, n, positions in RecordingPolicy.log:
        assert positions == list(range(seen, seen + n))


# --- positions come from `seen` ------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_positions_come_from_seen_not_stored_in_sample_speculate_and_score(policies, arch):
    model = random_model(arch, seed=2, scale=3.0)
    if arch == "gpt2":
        with torch.no_grad():  # position embeddings strong enough that an offset changes the greedy text
            model.transformer.wpe.weight.mul_(30)
    off = OffsetPolicy.OFFSET
    expected = recompute_greedy(model, PROMPT, 10, offset=off)
    # GPT-2's absolute positions notice a shift; RoPE is relative, so Llama checks a mixed-up position instead
    assert expected != recompute_greedy(model, PROMPT, 10) or arch == "llama"
    chain, rules, spec = build_chain(GREEDY), StopRules(10), CacheSpec("offset")
    assert [d.token_id for d in decode_tokens(model, PROMPT, chain, Greedy(), rules, cache=spec)] == expected
    for proposer in (NGramProposer(2), ModelProposer(random_model(arch, seed=3, scale=3.0), chain, Greedy(),
                                                     cache=spec)):
        sp = Speculator(model, proposer, PROMPT, chain, rules, 3, cache=spec, record=False)
        list(sp)
        assert sp.new_ids == expected, proposer.name
    # score: the same per-token log-probabilities as one forward without cache at the offset positions
    seq = PROMPT + expected
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([seq]), position_ids=torch.arange(off, off + len(seq))[None])
                                .logits[0].float(), dim=-1)
    rows = list(Scorer(model, seq, build_chain({}), str, ScoreSettings(feed=4), cache=spec))
    for row in rows:
        assert row.raw_logprob == pytest.approx(float(ref[row.position - 1, row.token_id]), abs=1e-4)


# --- static equals full ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_static_equals_full_for_sample_beam_and_speculate(arch):
    model = random_model(arch, seed=4, scale=8.0)
    chain = build_chain({"temperature": 0.8, "top-k": 20})
    runs = {}
    for name in ("full", "static"):
        spec = parse_cache_spec(name)
        sampler = Sampler(model, PROMPT, chain, make_selector("multinomial", 3, "cpu"), StopRules(12), str, None, top=3,
                          cache=spec)
        steps = list(sampler)
        search = BeamSearch(ModelStepper(model, spec), PROMPT, build_chain({}),
                            BeamSettings(beams=3, max_new_tokens=8, early_stopping="never"))
        search.run()
        greedy = build_chain(GREEDY)
        sp = Speculator(model, ModelProposer(random_model(arch, seed=5, scale=8.0), greedy, Greedy(), cache=spec),
                        PROMPT, greedy, StopRules(12), 3, cache=spec, record=False)
        if arch == "gemma2" and name == "static":
            # its sliding layers (window 16) wrap inside the 25 preallocated positions: no exact rollback
            with pytest.raises(ConfigError, match="sliding layers .* cannot be rolled back"):
                list(sp)
        else:
            list(sp)
        runs[name] = (steps, [(h.token_ids, h.score) for h in search.hypotheses], sp.new_ids)
    (s_full, b_full, p_full), (s_static, b_static, p_static) = runs["full"], runs["static"]
    assert [s.token_id for s in s_full] == [s.token_id for s in s_static]
    for a, b in zip(s_full, s_static):
        assert a.raw_logprob == pytest.approx(b.raw_logprob, abs=1e-5)
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
    assert [t for t, _ in b_full] == [t for t, _ in b_static]
    assert [s for _, s in b_full] == pytest.approx([s for _, s in b_static], abs=1e-5)
    assert p_full == p_static or arch == "gemma2"


def test_static_preallocates_and_counts_real_bytes():
    model = random_model("llama", seed=0)
    sampler = Sampler(model, PROMPT, build_chain(GREEDY), Greedy(), StopRules(5), str, None, cache=CacheSpec("static"))
    list(sampler)
    policy = sampler.runtime.policy
    cfg = model.config
    per_layer = 2 * 1 * cfg.num_key_value_heads * (len(PROMPT) + 5) * (cfg.hidden_size // cfg.num_attention_heads) * 4
    assert policy.layer_nbytes() == [per_layer] * cfg.num_hidden_layers
    assert policy.nbytes() == per_layer * cfg.num_hidden_layers
    assert policy.seen == len(PROMPT) + 4  # the last token is never fed


def test_full_counts_real_bytes_and_seen_vs_stored():
    model = random_model("qwen2", seed=0)
    sampler = Sampler(model, PROMPT, build_chain(GREEDY), Greedy(), StopRules(5), str, None)
    list(sampler)
    policy = sampler.runtime.policy
    cfg = model.config
    n = len(PROMPT) + 4
    per_layer = 2 * cfg.num_key_value_heads * n * (cfg.hidden_size // cfg.num_attention_heads) * 4
    assert policy.layer_nbytes() == [per_layer] * cfg.num_hidden_layers
    assert policy.seen == policy.stored == n


# --- policy specs and capabilities ------------------------------------------------------------------------------


def test_cache_spec_parsing_and_errors():
    assert parse_cache_spec(None) == CacheSpec("full") and str(parse_cache_spec("static")) == "static"
    for text, needle in [("nope", "unknown policy 'nope'"), ("full:x=1", "full takes no 'x'"),
                         ("full:oops", "not key=value")]:
        with pytest.raises(ConfigError, match=needle):
            parse_cache_spec(text)


def test_a_run_that_needs_a_missing_capability_is_refused(monkeypatch):
    class Forgetful(FullPolicy):
        name = "forgetful"
        capabilities = frozenset({"rows"})

    kv.parse_cache_spec("full")
    monkeypatch.setitem(kv.POLICIES, "forgetful", Forgetful)
    spec = parse_cache_spec("forgetful")
    with pytest.raises(ConfigError, match="roll back .* policies that can: ") as info:
        require(spec, {"truncate"}, "speculate")
    assert {"full", "recompute", "static"} <= set(str(info.value).split("can: ")[1].split(", "))  # quant too
    require(spec, {"rows"}, "batch")  # what it has passes


def test_cli_refuses_before_loading_the_model(cli):
    # the model does not exist: the cache errors must come first
    for args, needle in [(["sample", "hi", "--cache", "bogus"], "--cache 'bogus': unknown policy"),
                         (["sample", "hi", "--compile"], "--compile needs the cache to be compiled"),
                         (["beam", "hi", "--cache", "static:x=1"], "static takes no 'x'")]:
        code, _, err = cli(*args, "-m", "/no/such/model")
        assert code == 2 and needle in err, err


def test_cli_cache_static_and_models_listing(cli, toy_model_dir):
    import json

    outs = {}
    for cache in ("full", "static"):
        code, out, err = cli("sample", "Once upon", "-m", toy_model_dir, "-n", "5", "-t", "0", "--cache", cache,
                             "-f", "json")
        assert code == 0, err
        outs[cache] = json.loads(out)
    assert outs["full"]["token_ids"] == outs["static"]["token_ids"]
    assert outs["static"]["config"]["cache"] == "static"
    code, out, _ = cli("models", "-f", "json")
    names = [p["name"] for p in json.loads(out)["cache_policies"]]
    assert {"full", "static"} <= set(names)


# --- one transfer per traced token ----------------------------------------------------------------------------


class TransferCounter:
    """Counts device-to-host reads: item, tolist, __int__, __float__, __bool__, cpu, numpy."""

    NAMES = ("item", "tolist", "__int__", "__float__", "__bool__", "cpu", "numpy", "__index__")

    def __init__(self, monkeypatch):
        self.count = 0
        for name in self.NAMES:
            real = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(real))

    def _wrap(self, real):
        def counted(t, *args, **kwargs):
            self.count += 1
            return real(t, *args, **kwargs)

        return counted


@pytest.mark.parametrize("record", [True, False])
def test_transfer_budget_per_sampled_token(monkeypatch, record):
    model = random_model("llama", seed=0, scale=4.0)
    # penalties and bias read ids; temperature, top-k and min-p filter on the device (top-p's partial sort
    # decides on the host whether 256 candidates hold mass p: one extra read when it is in the chain)
    chain = build_chain({"repetition-penalty": 1.2, "bias": {3: 1.0}, "temperature": 0.9, "top-k": 50,
                         "min-p": 0.01})
    n = 16
    sampler = Sampler(model, PROMPT, chain, make_selector("multinomial", 0, "cpu"), StopRules(n, ignore_eos=True), str, None,
                      top=5, record=record)
    counter = TransferCounter(monkeypatch)
    list(sampler)
    monkeypatch.undo()
    assert len(sampler.new_ids) == n
    # the budget is 2 per traced token and 1 untraced; the trace rides in the token's own transfer
    assert counter.count <= n, counter.count


def test_transfer_budget_per_speculative_round(monkeypatch):
    target = random_model("llama", seed=0, scale=4.0)
    draft = random_model("llama", seed=1, scale=4.0)
    for temperature in (0, 1.0):
        chain = build_chain({"temperature": temperature})
        gen = None if temperature == 0 else make_generator(0, "cpu")
        selector = Greedy() if gen is None else make_selector("multinomial", 0, "cpu")
        if gen is not None:
            from decodelab.core.sampling.select import Multinomial
            selector = Multinomial(gen)
        sp = Speculator(target, ModelProposer(draft, chain, selector), PROMPT, chain, StopRules(24, ignore_eos=True),
                        4, gen, top=5)
        counter = TransferCounter(monkeypatch)
        rounds = list(sp)
        monkeypatch.undo()
        # the budget is 3 per round: the verdict (drafts, accepted, token, finiteness), then the trace
        assert counter.count <= 2 * len(rounds), (temperature, counter.count, len(rounds))


# --- score ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_score_perplexity_equals_one_full_forward_without_cache(arch):
    model = random_model(arch, seed=6, scale=2.0)
    ids = [int(i) for i in torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0))]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    nll = -logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].mean().item()
    for feed in (None, 7, 1):
        scorer = Scorer(model, ids, build_chain({}), str, ScoreSettings(feed=feed, chunk=13))
        list(scorer)
        summary = scorer.summary()
        assert summary.tokens == len(ids) - 1
        assert summary.perplexity == pytest.approx(math.exp(nll), rel=1e-5)
        assert [(c.start, c.end) for c in summary.chunks] == [(1, 14), (14, 27), (27, 40)]


def test_score_processed_logprob_is_the_chains_distribution():
    model = random_model("llama", seed=7, scale=3.0)
    ids = PROMPT + recompute_greedy(model, PROMPT, 10)  # the model's own text: mostly inside its top 8
    chain = build_chain({"repetition-penalty": 1.5, "temperature": 0.7, "top-k": 8})
    rows = list(Scorer(model, ids, chain, str, ScoreSettings(feed=5)))
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    for row in rows:
        i = row.position
        expected = torch.log_softmax(chain(torch.tensor([ids[:i]]), logits[i - 1 : i])[0], dim=-1)[ids[i]]
        assert row.logprob == pytest.approx(float(expected), abs=1e-5) or (
            row.logprob == float("-inf") and float(expected) == float("-inf"))
    assert any(r.logprob == float("-inf") for r in rows) and any(r.logprob > -1e9 for r in rows)


def test_score_against_the_same_cache_is_kl_zero_and_against_static_too():
    model = random_model("qwen2", seed=8, scale=3.0)
    ids = PROMPT * 3
    for ref in ("full", "static"):
        scorer = Scorer(model, ids, build_chain({}), str, ScoreSettings(feed=6), reference=model,
                        reference_cache=parse_cache_spec(ref), reference_name=ref)
        list(scorer)
        s = scorer.summary()
        assert s.kl_mean == pytest.approx(0.0, abs=1e-6) and s.top1_agreement == 1.0
        assert s.reference_perplexity == pytest.approx(s.perplexity, rel=1e-5)


def test_score_against_another_model_reports_kl_and_disagreement():
    a, b = random_model("llama", seed=9, scale=3.0), random_model("llama", seed=10, scale=3.0)
    ids = PROMPT * 3
    scorer = Scorer(a, ids, build_chain({}), str, ScoreSettings(top=3), reference=b, reference_name="b")
    rows = list(scorer)
    s = scorer.summary()
    with torch.no_grad():
        la = torch.log_softmax(a(torch.tensor([ids])).logits[0].double(), -1)
        lb = torch.log_softmax(b(torch.tensor([ids])).logits[0].double(), -1)
    kl = (lb.exp() * (lb - la)).sum(-1)[:-1]
    assert [r.kl for r in rows] == pytest.approx(kl.tolist(), abs=1e-4)
    assert s.kl_mean > 0.01 and 0 <= s.top1_agreement < 1
    diffs = [abs(d["difference"]) for d in s.most_different]
    assert len(diffs) == 3 and diffs == sorted(diffs, reverse=True)
    assert diffs[0] == pytest.approx(max(abs(r.raw_logprob - r.reference_logprob) for r in rows))


def test_score_cli_json_and_errors(cli, toy_model_dir, tmp_path):
    import json

    path = tmp_path / "t.txt"
    path.write_text("Once upon a time there was a compiler.")
    code, out, err = cli("score", "--text-file", path, "-m", toy_model_dir, "--against-cache", "full", "--chunk",
                         "4", "-f", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["command"] == "score" and doc["summary"]["kl_mean"] == 0 and doc["summary"]["top1_agreement"] == 1
    assert len(doc["steps"]) == doc["summary"]["tokens"] == len(doc["prompt"]["token_ids"]) - 1
    assert [c["start"] for c in doc["summary"]["chunks"]][:2] == [1, 5]
    code, out, _ = cli("score", "--text-file", path, "-m", toy_model_dir, "--limit", "5", "-f", "jsonl")
    lines = [json.loads(x) for x in out.splitlines()]
    assert [x["type"] for x in lines] == ["step"] * 4 + ["summary"]
    for args, needle in [(["score", "hi", "--limit", "0"], "--limit 0"),
                         (["score", "hi", "--against-cache", "nope"], "--against-cache 'nope'"),
                         (["score"], "TEXT: missing")]:
        code, _, err = cli(*args, "-m", toy_model_dir)
        assert code == 2 and needle in err, err


@pytest.mark.slow
def test_compiled_static_decode_equals_eager():
    """--compile: the compiled one-token step over the static cache gives the eager tokens and logits."""
    model = random_model("llama", seed=11, scale=8.0)
    chain = build_chain({"temperature": 0.9})
    eager = list(Sampler(model, PROMPT, chain, make_selector("multinomial", 1, "cpu"), StopRules(10), str, None))
    runtime = Runtime.create(model, CacheSpec("static"), capacity=len(PROMPT) + 10)
    runtime.compile_decode()
    compiled = list(Sampler(model, PROMPT, chain, make_selector("multinomial", 1, "cpu"), StopRules(10), str, None,
                            runtime=runtime))
    assert [s.token_id for s in compiled] == [s.token_id for s in eager]
    assert [s.raw_logprob for s in compiled] == pytest.approx([s.raw_logprob for s in eager], abs=1e-4)
    assert runtime.compile_s is not None and runtime.compile_s > 0


# --- exact edges the mutation run (tests/mutation/run.sh, core/kv/static.py) showed no test pinned --------------


def test_static_rollback_to_the_same_length_and_rows_growing_to_the_kv_heads():
    """A static cache rolled back to the length it has seen is unchanged; past it is one line with both lengths.
    Reordering from the prompt's one row to two rows (as many as the random Llama's 2 KV heads, so the row count
    and the head count agree) replaces the layers' tensors; a later reorder of two rows is in place (the
    preallocated tensors keep their addresses) and equals index_select. Bugs caught: a rollback to the same length
    refused, the row test reading the head axis."""
    model = random_model("llama")
    rt = Runtime.create(model, parse_cache_spec("static"), capacity=16)
    rt.feed(torch.tensor([[1, 2, 3, 4, 5]]))
    rt.policy.truncate(5)
    assert rt.policy.seen == 5
    with pytest.raises(ValueError) as err:
        rt.policy.truncate(6)
    assert str(err.value) == "cannot truncate a cache that has seen 5 tokens to 6"
    layer = rt.policy.model_cache.layers[0]
    assert layer.keys.shape[:2] == (1, 2)
    rt.reorder(torch.tensor([0, 0]))
    assert layer.keys.shape[:2] == (2, 2)
    before, address = layer.keys.clone(), layer.keys.data_ptr()
    rt.feed(torch.tensor([[6], [7]]))
    after = layer.keys.clone()
    rt.reorder(torch.tensor([1, 0]))
    assert layer.keys.data_ptr() == address and torch.equal(layer.keys, after.index_select(0, torch.tensor([1, 0])))
    assert torch.equal(before[:, :, :5], after[:, :, :5])


def test_static_fills_exactly_its_preallocated_positions():
    """capacity 8: a prompt of 6 and two single tokens fill it; the ninth position is one line with the count and
    the capacity; a command that cannot say its length up front is refused. Bugs caught: the bound one too
    small (the last slot refused) or too large (a write past the preallocation), the count misstated."""
    from decodelab.core.kv import make_policy
    from decodelab.core.engine.forward import model_info

    model = random_model("llama")
    rt = Runtime.create(model, parse_cache_spec("static"), capacity=8)
    rt.feed(torch.tensor([[1, 2, 3, 4, 5, 6]]))
    rt.feed(torch.tensor([[7]]))
    rt.feed(torch.tensor([[8]]))
    assert rt.policy.seen == 8
    with pytest.raises(ConfigError) as err:
        rt.feed(torch.tensor([[9]]))
    assert str(err.value) == "--cache static: 9 positions exceed the preallocated 8"
    with pytest.raises(ConfigError) as err:
        make_policy(parse_cache_spec("static"), model_info(model))
    assert str(err.value) == "--cache static: this command does not know its length up front; use --cache full"


def test_full_rollback_to_the_same_length_changes_nothing_and_past_it_is_refused():
    """Bug caught: a rollback to the length already seen refused (speculation that accepts every draft token rolls
    back by 0), the refusal's line lost."""
    rt = Runtime.create(random_model("llama"), parse_cache_spec("full"))
    rt.feed(torch.tensor([[1, 2, 3]]))
    rt.policy.truncate(3)
    assert rt.policy.seen == 3 and rt.policy.model_cache.get_seq_length() == 3
    with pytest.raises(ValueError) as err:
        rt.policy.truncate(4)
    assert str(err.value) == "cannot truncate a cache that has seen 3 tokens to 4"


# mutation run of core/engine/runtime.py (2026-12-02): the runtime's own bookkeeping, each path of feed against the
# model called directly, on policies made here


def full_runtime(model, cls=FullPolicy, **needs):
    from decodelab.core.engine.forward import model_info

    return Runtime(model, cls(model_info(model), None, frozenset(needs)))


def direct_logits(model, ids, start=0):
    """The model's float32 logits [B, T, V] over ``ids`` at positions start.., without a cache."""
    with torch.no_grad():
        pos = torch.arange(start, start + ids.shape[1])[None].expand(ids.shape[0], -1)
        return model(input_ids=ids, position_ids=pos).logits.float()


def test_a_new_runtime_has_fed_nothing_on_its_policys_device():
    model = random_model("llama")
    rt = Runtime.create(model)
    assert (rt.calls, rt.fed, rt.seen, rt._compiled) == (0, 0, 0, None)
    assert rt.device == torch.device("cpu") and rt.policy.name == "full" and rt.model is model
    assert rt.policy.capacity is None and rt.policy.needs == frozenset()
    rt = Runtime.create(model, parse_cache_spec("static"), capacity=9, needs=frozenset({"truncate"}))
    assert rt.policy.name == "static" and rt.policy.capacity == 9 and rt.policy.needs == {"truncate"}


def test_feed_keeps_the_last_or_all_logits_and_counts_what_it_fed():
    model = random_model("llama")
    ids = torch.tensor([[5, 17, 42, 9], [3, 3, 7, 1]])
    rt = full_runtime(model)
    last = rt.feed(ids[:, :3])
    want = direct_logits(model, ids)
    assert last.shape == (2, 256) and torch.allclose(last, want[:, 2], atol=1e-5)
    assert (rt.calls, rt.fed, rt.seen) == (1, 3, 3)
    every = rt.feed(ids[:, 3:], keep="all")
    assert every.shape == (2, 1, 256) and torch.allclose(every[:, 0], want[:, 3], atol=1e-5)
    assert (rt.calls, rt.fed, rt.seen) == (2, 4, 4)
    rt2 = full_runtime(model)
    assert torch.allclose(rt2.feed(ids, keep="all"), want, atol=1e-5)


class OneAtATime(FullPolicy):
    name = "one-at-a-time"

    def one_token_a_forward(self):
        return True


def test_a_policy_that_takes_one_token_a_forward_is_fed_token_by_token():
    model = random_model("llama")
    ids = torch.tensor([[5, 17, 42, 9]])
    want = direct_logits(model, ids)
    rt = full_runtime(model, OneAtATime)
    every = rt.feed(ids, keep="all")
    assert every.shape == (1, 4, 256) and torch.allclose(every, want, atol=1e-5)
    assert (rt.calls, rt.fed, rt.seen) == (4, 4, 4)
    rt = full_runtime(model, OneAtATime)
    assert torch.allclose(rt.feed(ids), want[:, -1], atol=1e-5) and rt.calls == 4
    assert rt.feed(ids[:, :1]).shape == (1, 256) and rt.calls == 5

    class Even(FullPolicy):
        def one_token_a_forward(self):
            return False

    rt = full_runtime(model, Even)
    rt.feed(ids)
    assert rt.calls == 1


class Attending(FullPolicy):
    name = "attending"
    events: list = []

    def wants_attentions(self, n):
        return n > 1

    def observe_attentions(self, attentions):
        Attending.events.append(("observe", len(attentions), tuple(attentions[0].shape), self.seen))

    def after_forward(self, n):
        Attending.events.append(("after", n))
        super().after_forward(n)


def test_a_policy_that_wants_attentions_sees_them_before_the_count():
    model = random_model("llama")
    ids = torch.tensor([[5, 17, 42, 9, 1]])
    want = direct_logits(model, ids)
    Attending.events = []
    rt = full_runtime(model, Attending)
    assert torch.allclose(rt.feed(ids[:, :4]), want[:, 3], atol=1e-5)
    assert Attending.events == [("observe", 2, (1, 4, 4, 4), 0), ("after", 4)]
    every = rt.feed(ids[:, 4:], keep="all")  # one token: no attentions wanted
    assert torch.allclose(every[:, 0], want[:, 4], atol=1e-5) and Attending.events[2:] == [("after", 1)]
    assert (rt.calls, rt.fed) == (2, 5)
    rt = full_runtime(model, Attending)
    assert torch.allclose(rt.feed(ids, keep="all"), want, atol=1e-5)


class Rewriting(FullPolicy):
    """Feeds every wanted token's last W ids from position 0, without a cache (recompute's shape of rewrite)."""

    name = "rewriting"
    W = 2

    def __init__(self, info, capacity=None, needs=frozenset()):
        super().__init__(info, capacity, needs)
        self.history = torch.zeros(1, 0, dtype=torch.long)
        self.rewrites = []

    def rewrite(self, ids, keep):
        self.rewrites.append(keep)
        self.history = torch.cat([self.history.expand(ids.shape[0], -1), ids], dim=1)
        ends = range(self.history.shape[1] - ids.shape[1] + 1, self.history.shape[1] + 1)
        if keep == "last":
            ends = [self.history.shape[1]]
        for end in ends:  # one window a forward (k = 1): m = W ids
            yield self.history[:, end - self.W : end][:, None], torch.arange(self.W)[None]


def test_a_rewriting_policy_runs_each_window_without_a_cache():
    model = random_model("llama")
    ids = torch.tensor([[5, 17, 42], [8, 9, 10]])
    rt = full_runtime(model, Rewriting)
    last = rt.feed(ids)
    assert last.shape == (2, 256) and torch.allclose(last, direct_logits(model, ids[:, 1:])[:, -1], atol=1e-5)
    assert (rt.calls, rt.fed, rt.seen, rt.policy.rewrites) == (1, 3, 3, ["last"])
    more = torch.tensor([[1, 2], [3, 4]])
    every = rt.feed(more, keep="all")
    assert every.shape == (2, 2, 256) and (rt.calls, rt.fed, rt.seen) == (3, 5, 5)
    assert torch.allclose(every[:, 0], direct_logits(model, torch.tensor([[42, 1], [10, 3]]))[:, -1], atol=1e-5)
    assert torch.allclose(every[:, 1], direct_logits(model, more)[:, -1], atol=1e-5)


def test_a_rewrite_of_several_windows_a_forward_keeps_their_order():
    model = random_model("llama")

    class Two(FullPolicy):
        def rewrite(self, ids, keep):
            yield torch.stack([ids[:, :2], ids[:, 1:3]], dim=1), torch.arange(2)[None]

    rt = full_runtime(model, Two)
    ids = torch.tensor([[5, 17, 42]])
    every = rt.feed(ids, keep="all")
    assert every.shape == (1, 2, 256) and rt.calls == 1 and rt.fed == 3
    assert torch.allclose(every[:, 0], direct_logits(model, ids[:, :2])[:, -1], atol=1e-5)
    assert torch.allclose(every[:, 1], direct_logits(model, ids[:, 1:])[:, -1], atol=1e-5)
    assert torch.allclose(full_runtime(model, Two).feed(ids), every[:, 1])


def test_prefill_in_chunks_or_holding_the_last_token():
    model = random_model("llama")
    ids = torch.tensor([[5, 17, 42, 9, 77, 3, 17]])
    want = direct_logits(model, ids)
    rt = full_runtime(model)
    assert torch.allclose(rt.prefill(ids, chunk=3), want[:, -1], atol=1e-5)
    assert (rt.calls, rt.fed, rt.seen) == (3, 7, 7)
    rt = full_runtime(model)
    assert rt.prefill(ids, hold_last=True, chunk=4) is None and (rt.calls, rt.seen) == (2, 6)
    assert torch.allclose(rt.feed(ids[:, 6:]), want[:, -1], atol=1e-5)
    rt = full_runtime(model)
    assert torch.allclose(rt.prefill(ids), want[:, -1], atol=1e-5) and rt.calls == 1
    rt = full_runtime(model)
    assert rt.prefill(ids, hold_last=True) is None and (rt.calls, rt.seen) == (1, 6)
    rt = full_runtime(model)
    assert rt.prefill(ids[:, :1], hold_last=True) is None and (rt.calls, rt.seen) == (0, 0)


def test_truncate_and_rollback_keep_fed_in_step():
    model = random_model("llama")
    ids = torch.tensor([[5, 17, 42, 9, 77, 3]])
    rt = full_runtime(model, truncate=True)
    rt.prefill(ids)
    rt.truncate(4)
    assert (rt.fed, rt.seen) == (4, 4)
    rt.rollback(0)
    assert (rt.fed, rt.seen) == (4, 4)
    rt.rollback(1)
    assert (rt.fed, rt.seen) == (3, 3)
    assert torch.allclose(rt.feed(ids[:, 3:]), direct_logits(model, ids)[:, -1], atol=1e-5)
    assert rt.fed == 6


def test_reorder_is_the_policys():
    rows = []

    class Recording(FullPolicy):
        def reorder(self, r):
            rows.append(r)

    rt = full_runtime(random_model("llama"), Recording)
    order = torch.tensor([1, 0])
    rt.reorder(order)
    assert rows == [order]


def test_the_compiled_step_is_made_once_per_model_and_used_for_one_token_decodes():
    model = random_model("llama")
    made = []

    def step(ids, positions, cache):
        made.append((ids.tolist(), positions.tolist(), cache))
        return torch.full((ids.shape[0], 1, 256), 2.0)

    model._decodelab_compiled_step = step  # what an earlier compile_decode left on the model
    rt = runtime_for_model(model, compile=True)
    assert rt.compile_s is None
    out = rt.feed(torch.tensor([[5, 17]]))  # two tokens: the eager forward
    assert made == [] and out.shape == (1, 256)
    out = rt.feed(torch.tensor([[9]]))
    assert made == [([[9]], [[2]], rt.policy.model_cache)] and torch.equal(out, torch.full((1, 256), 2.0))
    assert rt.compile_s is not None and rt.compile_s >= 0 and (rt.calls, rt.fed) == (2, 3)
    timed = rt.compile_s
    rt.feed(torch.tensor([[4]]))
    assert rt.compile_s == timed and len(made) == 2
    rt.feed(torch.tensor([[4]]), keep="all")  # all logits: the eager forward
    assert len(made) == 2 and rt.seen == 5
    assert runtime_for_model(model)._compiled is None


def runtime_for_model(model, compile=False):
    from decodelab.core.engine.runtime import runtime_for
    from decodelab.core.engine.models import LoadedModel

    lm = LoadedModel("x", model, None, torch.device("cpu"), torch.float32)
    return runtime_for(lm, parse_cache_spec("full"), 16, {"truncate"}, compile=compile)


def test_runtime_for_builds_the_policy_with_its_capacity_and_needs():
    rt = runtime_for_model(random_model("llama"))
    assert rt.policy.name == "full" and rt.policy.capacity == 16 and rt.policy.needs == frozenset({"truncate"})
    assert isinstance(rt.policy.needs, frozenset)


def test_a_platform_that_cannot_compile_is_one_line_at_the_first_decode_step():
    model = random_model("llama")

    def broken(ids, positions, cache):
        raise RuntimeError("  InductorError: no C++ compiler\nmore")

    model._decodelab_compiled_step = broken
    rt = runtime_for_model(model, compile=True)
    with pytest.raises(ConfigError) as err:
        rt.feed(torch.tensor([[5]]))
    assert str(err.value) == ("--compile: torch.compile cannot compile here (InductorError: no C++ compiler); run "
                              "without --compile")
    assert isinstance(err.value.__cause__, RuntimeError)

    def silent(ids, positions, cache):
        raise RuntimeError()

    model._decodelab_compiled_step = silent
    with pytest.raises(ConfigError, match=r"cannot compile here \(RuntimeError\)"):
        runtime_for_model(model, compile=True).feed(torch.tensor([[5]]))


def test_compile_decode_compiles_the_eager_one_token_forward(monkeypatch):
    """torch.compile is replaced by the identity: the step it was handed equals the eager forward, and it is kept on
    the model for the next run."""
    compiled = []

    def identity(fn, dynamic=None, fullgraph=None):
        compiled.append((dynamic, fullgraph))
        return fn

    monkeypatch.setattr(torch, "compile", identity)
    model = random_model("llama")
    rt = runtime_for_model(model, compile=True)
    assert compiled == [(False, False)] and callable(model._decodelab_compiled_step)
    ids = torch.tensor([[5, 17, 42]])
    rt.feed(ids[:, :2])
    assert torch.allclose(rt.feed(ids[:, 2:]), direct_logits(model, ids)[:, -1], atol=1e-5)
    assert not torch.is_inference(rt.policy.model_cache.layers[0].keys)
    runtime_for_model(model, compile=True)
    assert len(compiled) == 1


# the first run's survivors (runtime.py, 2026-12-02)


class Shifted(FullPolicy):
    """Positions 3 ahead of what the cache holds: a forward that let the model infer positions from its cache would
    run 3 positions early."""

    name = "shifted"

    def positions(self, n):
        return super().positions(n) + 3


def test_the_compiled_step_runs_at_the_policys_positions(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic=None, fullgraph=None: fn)
    model = random_model("llama")
    rt = full_runtime(model, Shifted)
    rt.compile_decode()
    ids = torch.tensor([[5, 17, 42]])
    rt.feed(ids[:, :2])
    out = rt.feed(ids[:, 2:])
    assert out.shape == (1, 256) and torch.allclose(out, direct_logits(model, ids, start=3)[:, -1], atol=1e-5)


def test_a_rewrite_runs_at_the_positions_it_gives():
    model = random_model("gpt2")  # absolute positions: under RoPE a window shifted as a whole attends the same

    class Late(FullPolicy):
        def rewrite(self, ids, keep):
            yield ids[:, None], torch.arange(7, 7 + ids.shape[1])[None]

    out = full_runtime(model, Late).feed(torch.tensor([[5, 17, 42]]))
    assert out.shape == (1, 256)
    assert torch.allclose(out, direct_logits(model, torch.tensor([[5, 17, 42]]), start=7)[:, -1], atol=1e-5)


def test_the_first_compiled_call_is_timed_on_the_clock(monkeypatch):
    from decodelab.core.engine import runtime as rt_module

    model = random_model("llama")
    model._decodelab_compiled_step = lambda ids, positions, cache: torch.zeros(ids.shape[0], 1, 256)
    rt = runtime_for_model(model, compile=True)
    ticks = iter([100.0, 102.5])
    monkeypatch.setattr(rt_module.time, "perf_counter", lambda: next(ticks))
    rt.feed(torch.tensor([[5]]))
    assert rt.compile_s == 2.5


def test_runtime_for_compiles_only_when_asked_and_keeps_the_spec():
    from decodelab.core.engine.models import LoadedModel
    from decodelab.core.engine.runtime import runtime_for

    lm = LoadedModel("x", random_model("llama"), None, torch.device("cpu"), torch.float32)
    rt = runtime_for(lm, parse_cache_spec("static"), 16)
    assert rt._compiled is None and rt.policy.name == "static" and rt.policy.needs == frozenset()


class Masking(FullPolicy):
    """Hides the first token from every later one (a 2-D mask over seen + n keys), and wants attentions when asked:
    a policy that lays its rows out itself (paged) hands the model a mask the same way."""

    name = "masking"
    attending = False

    def attention_mask(self, n):
        mask = torch.ones(1, self.seen + n, dtype=torch.long)
        mask[0, 0] = 0
        return mask

    def wants_attentions(self, n):
        return self.attending

    def observe_attentions(self, attentions):
        self.observed = len(attentions)


def masked_direct(model, ids):
    mask = torch.ones(1, ids.shape[1], dtype=torch.long)
    mask[0, 0] = 0
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits.float()


def test_the_policys_mask_reaches_the_model_with_or_without_attentions():
    model = random_model("llama")
    ids = torch.tensor([[5, 17, 42, 9]])
    want = masked_direct(model, ids)
    assert not torch.allclose(want[:, -1], direct_logits(model, ids)[:, -1], atol=1e-3)
    for attending in (False, True):
        rt = full_runtime(model, Masking)
        rt.policy.attending = attending
        rt.feed(ids[:, :2])
        assert torch.allclose(rt.feed(ids[:, 2:]), want[:, -1], atol=1e-5)
        assert getattr(rt.policy, "observed", None) == (2 if attending else None)


def test_attending_forwards_run_at_the_policys_positions():
    model = random_model("gpt2")  # absolute positions

    class ShiftedAttending(Attending):
        def positions(self, n):
            return super().positions(n) + 3

    Attending.events = []
    ids = torch.tensor([[5, 17, 42, 9]])
    out = full_runtime(model, ShiftedAttending).feed(ids)
    assert torch.allclose(out, direct_logits(model, ids, start=3)[:, -1], atol=1e-5)


def test_two_tokens_for_a_one_token_a_forward_policy_are_two_forwards():
    rt = full_runtime(random_model("llama"), OneAtATime)
    rt.feed(torch.tensor([[5, 17]]))
    assert rt.calls == 2


def test_an_eager_cache_holds_inference_tensors_and_an_empty_prefill_returns_none():
    rt = full_runtime(random_model("llama"))
    rt.feed(torch.tensor([[5, 17]]))
    assert torch.is_inference(rt.policy.model_cache.layers[0].keys)
    assert full_runtime(random_model("llama")).prefill(torch.zeros(1, 0, dtype=torch.long)) is None


def test_under_compile_the_eager_prefill_leaves_no_inference_tensors_in_the_cache():
    """The compiled step updates the static cache in place, which torch refuses on inference tensors: the eager
    forwards of a compiled run (the prefill) run under no_grad, not inference_mode."""
    from decodelab.core.engine.models import LoadedModel
    from decodelab.core.engine.runtime import runtime_for

    model = random_model("llama")
    model._decodelab_compiled_step = lambda ids, positions, cache: torch.zeros(ids.shape[0], 1, 256)
    lm = LoadedModel("x", model, None, torch.device("cpu"), torch.float32)
    rt = runtime_for(lm, parse_cache_spec("full"), 16, compile=True)
    rt.feed(torch.tensor([[5, 17]]))
    assert not torch.is_inference(rt.policy.model_cache.layers[0].keys)
