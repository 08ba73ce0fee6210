"""compare (coupled variants, rows, pairs), why this token, many samples, forcing and resuming."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from conftest import random_model
from decodelab.core.analysis import compare as cmp
from decodelab.core.methods.branch import Forced, load_trace, mark_forced, parse_force, skip_draws
from decodelab.core.methods.sample import Sampler
from decodelab.core.engine.stopping import StopRules
from decodelab.core.errors import ConfigError
from decodelab.core.methods.many import sample_many
from decodelab.core.sampling.chain import build_chain
from decodelab.core.sampling.distribution import softmax
from decodelab.core.engine.runtime import Runtime
from decodelab.core.sampling.select import make_selector
from decodelab.core.trace.stats import pack, unpack
from decodelab.core.trace.why import decide

V = 256
PROMPT = "5 17 42 9 100 3"


@pytest.fixture(scope="module")
def llama():
    return random_model("llama", seed=3, scale=4.0)


class Ids:
    """A LoadedModel stand-in whose "text" is space-separated token ids."""

    def __init__(self, model):
        self.model, self.name, self.device, self.dtype = model, "random-llama", torch.device("cpu"), torch.float32
        self.eos_ids, self.context_length, self.vocab_size = [], 256, V
        self.tokenizer = None  # token texts are ids: no constraint can be bound

    def encode(self, text: str, chat: bool = False) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))

    def token_text(self, token_id: int) -> str:
        return str(token_id)

    def token_id(self, text: str) -> int:
        return int(text)


def lm_for(model):
    return Ids(model)


def compare(model, variants, seeds=(0,), prompts=(PROMPT,), n=12):
    vs = [cmp.parse_variant(v, i) for i, v in enumerate(variants)]
    run = cmp.Comparison(lm_for(model), vs, [cmp.Prompt(str(i), p) for i, p in enumerate(prompts)], list(seeds),
                         base={"max_new_tokens": n, "ignore_eos": True})
    return run.run()


def rows_by(run, variant):
    return [r for r in run.rows if r.variant == variant]


def pair(run, a, b, seed=0):
    return next(p for p in run.pairs if p.a == a and p.b == b and p.seed == seed)


# --- why this token: hand-built chains where the deciding stage is known -----------------------------------------


def decide_from_logits(names, stage_logits, chosen: int, race):
    """The deciding stage of a hand-built chain through a traced step's own path: the stage logits [V] each (raw
    first) packed as one step (trace.stats.pack), unpacked, decided (trace.why.decide); ``race`` None: greedy."""
    stages = [(name, z.reshape(1, -1)) for name, z in zip(names, stage_logits)]
    host = pack(torch.tensor([chosen]), stages[0][1], stages[-1][1], stages, 0, race).tolist()
    n = unpack(host, 0, stages[0][1].shape[-1], len(stages))
    return decide(names, chosen, n.winners, n.ranks, n.removed, race is None)


def test_why_top_p_removed_the_raw_pick():
    z = torch.tensor([0.5, 0.3, 0.2]).log()
    race = torch.tensor([1.0, 1.0, 0.01])  # the draw picks token 2 from the raw distribution
    top_p = build_chain({"top-p": 0.7}).processors[0](None, z[None])[0]  # keeps {0, 1}
    d = decide_from_logits(["raw", "top-p"], [z, top_p], 0, race)
    assert (d.decided_by, d.why) == ("top-p", "top-p removed the raw pick (same draws)")


def test_why_temperature_lifted_it_from_rank_3():
    z = torch.tensor([3.0, 2.0, 1.0])
    race = torch.tensor([1.0, 1.0, 0.3])  # T=1: 3, 2, 2.2 -> token 0; T=5: 0.6, 0.4, 1.4 -> token 2
    d = decide_from_logits(["raw", "temperature"], [z, z / 5], 2, race)
    assert (d.decided_by, d.why) == ("temperature", "temperature lifted it from rank 3")


def test_why_bias_brought_it_in_and_a_later_filter_did_not_decide():
    z = torch.tensor([2.0, 1.0, 0.0, -1.0])
    biased = z + torch.tensor([0.0, 0.0, 5.0, 0.0])
    top_k = torch.tensor([-math.inf, -math.inf, 5.0, -math.inf])
    d = decide_from_logits(["raw", "bias", "top-k"], [z, biased, top_k], 2, None)  # greedy
    assert (d.decided_by, d.why) == ("bias", "bias brought it in from rank 3")


def test_why_the_model_decided_when_no_stage_changed_the_pick():
    z = torch.tensor([0.1, 2.0, 1.0])
    d = decide_from_logits(["raw", "temperature", "top-k"], [z, z / 0.5, torch.tensor([-math.inf, 4.0, 2.0])], 1,
                           None)
    assert d.decided_by == "model"


# mutation run of core/trace/why.py (2026-12-01): a stage after the first deciding, the greedy wording, a forced
# token, a step with no stages recorded


def test_why_a_later_stage_removed_the_argmax_after_the_one_before_it():
    """Greedy: the raw argmax is 0, the bias makes it 1, the ban removes 1 and 0 wins again: the ban decided (it
    removed the winner of the stage before it, not of the raw distribution), in greedy's words."""
    z = torch.tensor([2.0, 1.0, 0.5])
    biased = z + torch.tensor([0.0, 3.0, 0.0])
    banned = biased.clone()
    banned[1] = -math.inf
    d = decide_from_logits(["raw", "bias", "ban"], [z, biased, banned], 0, None)
    assert (d.decided_by, d.why) == ("ban", "ban removed the argmax after bias")


def test_why_a_token_the_selector_did_not_pick_is_forced_and_no_stages_say_so():
    z = torch.tensor([2.0, 1.0, 0.5])
    assert tuple(decide_from_logits(["raw", "temperature"], [z, z / 2], 2, None)) == \
        ("forced", "not the selector's pick")
    assert tuple(decide(["raw"], 3, [], [], [], True)) == ("model", "no stage recorded")


def test_why_in_a_traced_run_names_the_bias_exactly_where_it_changed_the_argmax(llama):
    prompt = [5, 17, 42]
    rules = StopRules(8, ignore_eos=True)
    plain = [s.token_id for s in Sampler(llama, prompt, build_chain({"temperature": 0}), make_selector("greedy", 0, "cpu"),
                                         rules, str, None, top=0)]
    chain = build_chain({"bias": {7: 1e4}, "temperature": 0})
    steps = list(Sampler(llama, prompt, chain, make_selector("greedy", 0, "cpu"), rules, str, None, top=0))
    assert all(s.token_id == 7 for s in steps)
    # step 0 shares the prompt: the bias decided unless the model's own argmax was already 7
    assert steps[0].decided_by == ("model" if plain[0] == 7 else "bias")
    assert all(s.decided_by in ("bias", "model") for s in steps)
    sampled = list(Sampler(llama, prompt, build_chain({"temperature": 0.7, "top-k": 3}),
                           make_selector("multinomial", 1, "cpu"), rules, str, None, top=0))
    assert all(s.decided_by in ("model", "temperature", "top-k") and s.why for s in sampled)


# --- metrics on hand-made token lists --------------------------------------------------------------------------------


def test_metrics_on_hand_made_lists():
    assert cmp.distinct_n([1, 2, 1, 2, 3], 1) == 3 / 5
    assert cmp.distinct_n([1, 2, 1, 2, 3], 2) == 3 / 4  # (1,2) twice, (2,1), (2,3)
    assert cmp.distinct_n([4], 2) is None
    assert cmp.repetition_rate([1, 2, 3, 4, 1, 2, 3, 4, 1]) == pytest.approx(1 - 4 / 6)  # 6 4-grams, 4 distinct
    assert cmp.repetition_rate([1, 2, 3, 4, 5, 6]) == 0.0
    assert cmp.repetition_rate([9] * 10) == pytest.approx(1 - 1 / 7)
    assert cmp.first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert cmp.first_divergence([1, 2], [1, 2, 4]) == 2
    assert cmp.first_divergence([1, 2], [1, 2]) is None


def test_parsing_variants_seeds_jobs_and_prompts(tmp_path):
    v = cmp.parse_variant("cold: temperature=0.3,chain=temperature,top-p,top_p=0.9,cache=static")
    assert v.name == "cold" and dict(v.values) == {"temperature": "0.3", "chain": "temperature,top-p",
                                                     "top_p": "0.9", "cache": "static"}
    assert cmp.settings_for(v, {"cache": "full"}, 0).cache == "static"
    assert cmp.parse_variant("top_k=5", 2).name == "v3"
    spaced = cmp.parse_variant("s: choice= yes, no, temperature= 0.5 ,logit_bias= the=-5,stop= end")
    assert dict(spaced.values) == {"choice": " yes, no", "temperature": "0.5", "logit_bias": " the=-5",
                                   "stop": " end"}, "a text value keeps its spaces, as the option does"
    assert cmp.settings_for(spaced, {}, 0).temperature == 0.5
    b = cmp.parse_variant("b: method=beam,beams=3")
    assert b.method == "beam" and cmp.settings_for(b, {}, 0).beams == 3
    for bad, says in [("x: temprature=1", "known key"), ("x: seed=3", "--seeds"), ("x: beams=2", "beam"),
                      ("x: method=foo", "allowed"), ("x: top_p=1.5", "--top-p")]:
        with pytest.raises(ConfigError, match=says):
            cmp.settings_for(cmp.parse_variant(bad), {}, 0)
    assert cmp.parse_seeds("0-3,7") == [0, 1, 2, 3, 7]
    with pytest.raises(ConfigError, match="--seeds"):
        cmp.parse_seeds("3-1")
    assert cmp.parse_seeds([5, 1, 5]) == [1, 5] and cmp.parse_seeds(7) == [7]
    assert cmp.parse_seeds(f"{2**64 - 2}-{2**64 - 1}") == [2**64 - 2, 2**64 - 1]
    for bad, says in [("²", "expected seeds"), ("0-1,³", "expected seeds"), ("-1", "expected seeds"),
                      (f"0-{2**64}", "expected seeds"), ("0-100000000000", "100000000001 seeds; at most 4096"),
                      ([1, "x"], "'x': expected int"), ([True], "expected an integer"), (1.5, "expected seeds")]:
        with pytest.raises(ConfigError, match=re.escape(says)):
            cmp.parse_seeds(bad)
    # counted from the merged ranges, none listed: overlaps count once, a huge count costs nothing
    assert cmp.seed_count([(0, 9), (5, 14), (20, 20)]) == 16 and cmp.seed_count([(0, 10**18)]) == 10**18 + 1
    assert len(cmp.parse_seeds("0-4095")) == 4096 and len(cmp.parse_seeds("0-3000,1000-4095")) == 4096
    job = tmp_path / "job.toml"
    job.write_text('seeds = "0-1"\n[defaults]\nmax_new_tokens = 5\n[[variant]]\nname = "g"\ntemperature = 0.0\n'
                   '[[variant]]\nname = "n"\npreset = "nucleus"\n')
    variants, extras = cmp.load_job(job)
    assert [x.name for x in variants] == ["g", "n"] and extras["seeds"] == "0-1"
    assert cmp.settings_for(variants[1], {}, 4).top_p == 0.95 and cmp.settings_for(variants[1], {}, 4).seed == 4
    jl = tmp_path / "job.jsonl"
    jl.write_text('{"name": "a", "temperature": 0.5}\n{"name": "b", "method": "beam", "beams": 2}\n')
    assert [x.method for x in cmp.load_job(jl)[0]] == ["sample", "beam"]
    pf = tmp_path / "p.jsonl"
    pf.write_text('{"id": "q1", "prompt": "hello"}\n{"text": "bye"}\n')
    assert [(p.id, p.text) for p in cmp.read_prompts(pf)] == [("q1", "hello"), ("2", "bye")]


# --- rows ----------------------------------------------------------------------------------------------------------


def test_greedy_row_equals_generate(llama):
    run = compare(llama, ["g: temperature=0"], n=10)
    ids = torch.tensor([[int(t) for t in PROMPT.split()]])
    ref = llama.generate(ids, do_sample=False, max_new_tokens=10, min_new_tokens=10, pad_token_id=0)[0, 6:].tolist()
    row = run.rows[0]
    assert row.token_ids == ref
    assert row.length == 10 and row.stop_reason == "length" and row.mean_logprob == 0.0  # a point mass
    assert row.raw_perplexity > 1 and row.mean_kept == 1 and set(row.decided_by) == {"model"}


def test_same_seed_same_rows_and_beam_and_speculative_rows(llama):
    variants = ["s: temperature=0.9,top_p=0.95", "b: method=beam,beams=2", "n: method=speculate,draft=ngram,gamma=2"]
    one, two = compare(llama, variants, seeds=(0, 1)), compare(llama, variants, seeds=(0, 1))
    strip = lambda r: {k: v for k, v in r.to_dict().items() if k != "tokens_per_s"}  # noqa: E731
    assert [strip(r) for r in one.rows] == [strip(r) for r in two.rows]
    assert [p.to_dict() for p in one.pairs] == [p.to_dict() for p in two.pairs]
    s0, s1 = rows_by(one, "s")
    assert s0.token_ids != s1.token_ids  # the seed matters
    beam = rows_by(one, "b")[0]
    assert beam.mean_logprob < 0 and beam.mean_entropy > 0 and beam.mean_kept == V
    assert pair(one, "s", "b").deciding_stage in ("method", None)


# --- coupling ------------------------------------------------------------------------------------------------------


def test_a_setting_that_keeps_the_distribution_keeps_every_token(llama):
    run = compare(llama, ["a: temperature=0.9", f"b: temperature=0.9,top_k={V}", "c: temperature=0.9,top_p=1.0"],
                  seeds=range(4), n=16)
    for seed in range(4):
        assert pair(run, "a", "b", seed).first_divergence is None
        assert pair(run, "a", "c", seed).first_divergence is None


def test_a_filter_changes_the_token_only_where_it_removes_the_pick(llama):
    """Under the race coupling, top-k changes step t's token only if the unfiltered pick is outside the top k."""
    seeds = range(8)
    run = compare(llama, ["a: temperature=1.2", "k: temperature=1.2,top_k=3", "t: temperature=0.6"], seeds=seeds,
                  n=16)
    diverged = 0
    for seed in seeds:
        ra, rk = rows_by(run, "a")[seed], rows_by(run, "k")[seed]
        p = pair(run, "a", "k", seed)
        d = p.first_divergence
        if d is None:
            continue
        diverged += 1
        assert p.deciding_stage == "top-k"
        prefix = [int(t) for t in PROMPT.split()] + ra.token_ids[:d]
        z = Runtime.create(llama).prefill(torch.tensor([prefix]))
        rank = int((z[0] > z[0, ra.token_ids[d]]).sum()) + 1
        assert rank > 3, "top-k changed a token it kept: the draws are not shared"
        assert rk.token_ids[d] in z[0].topk(3).indices.tolist()
    assert diverged >= 3
    stages = {pair(run, "a", "t", seed).deciding_stage for seed in seeds}
    assert stages - {None} == {"temperature"}


def test_no_repeat_ngram_parts_only_where_it_bans(llama):
    run = compare(llama, ["a: temperature=0", "b: temperature=0,no_repeat_ngram=2"], n=40)
    ra, rb = run.rows
    p = run.pairs[0]
    assert p.first_divergence is not None  # the random model's greedy output loops, so the ban must bite
    d = p.first_divergence
    if True:
        seq = [int(t) for t in PROMPT.split()] + ra.token_ids[: d + 1]
        grams = list(zip(seq[:-1], seq[1:]))
        assert grams[-1] in grams[:-1], "the rows parted at a step where no bigram was banned"
        assert p.deciding_stage == "no-repeat-ngram"


# --- many samples ---------------------------------------------------------------------------------------------------


def test_many_samples_follow_the_processed_distribution(llama):
    prompt = [5, 17, 42]
    chain = build_chain({"temperature": 1.5, "top-k": 6})
    z = Runtime.create(llama).prefill(torch.tensor([prompt]))
    probs = softmax(chain.apply(torch.tensor([prompt]), z))[0].double()
    n = 1200
    rows, summary = sample_many(llama, prompt, chain, "multinomial", 0, n, StopRules(1, ignore_eos=True))
    assert summary.batched and summary.num_samples == n
    counts = torch.zeros(V, dtype=torch.float64)
    for r in rows:
        counts[r.token_ids[0]] += 1
    kept = probs > 0
    assert int(kept.sum()) == 6 and counts[~kept].sum() == 0
    expected = probs[kept] * n
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2 < 20.52  # p = 0.001, 5 degrees of freedom
    assert sum(f.count for f in summary.first_tokens) == n
    assert summary.first_tokens[0].count == max(f.count for f in summary.first_tokens)


def test_batched_row_i_is_the_single_run_with_seed_plus_i(llama):
    prompt = [5, 17, 42]
    chain = build_chain({"temperature": 1.0, "top-p": 0.9})
    rules = StopRules(6, ignore_eos=True)
    rows, summary = sample_many(llama, prompt, chain, "multinomial", 10, 4, rules)
    seq, _ = sample_many(llama, prompt, chain, "multinomial", 10, 4, rules, batched=False)
    assert not _.batched
    for i, r in enumerate(rows):
        single = [s.token_id for s in Sampler(llama, prompt, chain, make_selector("multinomial", 10 + i, "cpu"), rules, str,
                                              None, top=0)]
        assert r.token_ids == single == seq[i].token_ids
        assert r.sum_logprob == pytest.approx(seq[i].sum_logprob, abs=1e-4)
    assert summary.distinct_outputs == len({tuple(r.token_ids) for r in rows})


# --- forcing and resuming ------------------------------------------------------------------------------------------


def run_ids(model, prompt, chain, selector, n, force=None):
    sel = Forced(selector, force) if force else selector
    steps = list(Sampler(model, prompt, chain, sel, StopRules(n, ignore_eos=True), str, None, top=0))
    if force:
        mark_forced(steps, force)
    return steps


def test_force_changes_that_step_and_nothing_before_and_keeps_later_draws(llama):
    prompt = [5, 17, 42]
    chain = build_chain({"temperature": 1.0, "top-k": 20})
    base = [s.token_id for s in run_ids(llama, prompt, chain, make_selector("multinomial", 4, "cpu"), 10)]
    z_ids = prompt + base[:4]
    z = Runtime.create(llama).prefill(torch.tensor([z_ids]))
    alt = next(t for t in z[0].topk(5).indices.tolist() if t != base[4])
    steps = run_ids(llama, prompt, chain, make_selector("multinomial", 4, "cpu"), 10, force={4: alt})
    forced = [s.token_id for s in steps]
    assert forced[:4] == base[:4] and forced[4] == alt
    assert steps[4].decided_by == "forced" and steps[3].decided_by != "forced"
    # the later steps used the same draws: continuing from the forced prefix with the draws of steps 5.. agrees
    sel = make_selector("multinomial", 4, "cpu")
    skip_draws(sel, 5, V, "cpu")
    tail = [s.token_id for s in Sampler(llama, prompt + forced[:5], chain, sel, StopRules(5, ignore_eos=True), str,
                                        None, top=0)]
    assert tail == forced[5:]
    with pytest.raises(ConfigError, match="removed that token"):
        far = z[0].argsort()[0].item()  # the least likely token: outside top-20
        run_ids(llama, prompt, chain, make_selector("multinomial", 4, "cpu"), 10, force={4: far} if False else {0: far})
    assert parse_force(["3=42", "0=7"]) == {3: 42, 0: 7}
    with pytest.raises(ConfigError, match="--force"):
        parse_force(["x=1"])


def test_resume_continues_with_the_same_draws(llama, tmp_path):
    prompt = [5, 17, 42]
    chain = build_chain({"temperature": 0.8})
    whole = [s.token_id for s in run_ids(llama, prompt, chain, make_selector("multinomial", 2, "cpu"), 14)]
    doc = {"command": "sample", "config": {"temperature": 0.8, "seed": 2}, "prompt": {"token_ids": prompt},
           "token_ids": whole[:8], "summary": {"stop_reason": "length"}}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(doc))
    point = load_trace(path)
    assert point.context_ids == prompt + whole[:8] and point.config["seed"] == 2
    sel = make_selector("multinomial", point.config["seed"], "cpu")
    skip_draws(sel, len(point.generated_ids), V, "cpu")
    rest = [s.token_id for s in run_ids(llama, point.context_ids, chain, sel, 6)]
    assert whole[8:] == rest
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="--resume"):
        load_trace(tmp_path / "bad.json")


# --- bench: the pairing is checked (same token count, same greedy search), not timed -------------------------------


def test_bench_pairs_the_same_work(llama):
    from decodelab.core.analysis.bench import Bench, parse_settings

    draft = random_model("llama", seed=9, scale=4.0, num_hidden_layers=1)
    bench = Bench(llama, [5, 17, 42, 5, 17], 6, draft=draft, gammas=(2,))
    bench.time(1)
    rows = {r.setting: r for r in bench.rows()}
    assert "greedy, trace on" in rows and "speculative draft: best vs best" in rows
    assert all(r.tokens == 6 and r.rounds == 1 and r.ratio > 0 for r in rows.values())
    with pytest.raises(ConfigError, match="--settings"):
        parse_settings("greedy,warp")


def test_branched_run_resumes_and_forces_with_step_numbers_of_the_original(llama):
    from decodelab.core.methods.branch import Branched

    prompt = [5, 17, 42]
    chain = build_chain({"temperature": 0.9, "top-k": 30})
    whole = run_ids(llama, prompt, chain, make_selector("multinomial", 6, "cpu"), 12)
    ids = [s.token_id for s in whole]
    sampler = Sampler(llama, prompt + ids[:5], chain, make_selector("multinomial", 6, "cpu"), StopRules(7, ignore_eos=True),
                      str, None, top=0)
    run = Branched(sampler, resumed=ids[:5])
    steps = list(run)
    assert [s.index for s in steps] == list(range(5, 12)) and run.all_ids == ids
    assert [s.decided_by for s in steps] == [s.decided_by for s in whole[5:]]
    with pytest.raises(ConfigError, match="part of the resumed trace"):
        Branched(Sampler(llama, prompt + ids[:5], chain, make_selector("multinomial", 6, "cpu"), StopRules(3), str, None),
                 force={2: 7}, resumed=ids[:5])


# --- the commands -------------------------------------------------------------------------------------------------


def test_cli_compare_json_rows_pairs_and_greedy_row_equals_sample(cli, toy_model_dir):
    code, out, err = cli("compare", "The machine", "-m", toy_model_dir, "-V", "g: temperature=0",
                         "-V", "h: temperature=0.9,top_k=5", "--preset", "nucleus", "--seeds", "0-1", "-n", "6",
                         "--ignore-eos", "-f", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["command"] == "compare" and len(doc["rows"]) == 6 and len(doc["pairs"]) == 6
    assert [r["variant"] for r in doc["rows"][:3]] == ["nucleus", "g", "h"]  # job, presets, then --variant
    row = doc["rows"][1]
    for key in ("variant", "prompt", "seed", "text", "token_ids", "stop_reason", "mean_logprob", "raw_perplexity",
                "distinct_1", "distinct_2", "repetition_rate", "mean_kept", "mean_entropy", "tokens_per_s"):
        assert key in row
    assert {"a", "b", "prompt", "seed", "first_divergence", "deciding_stage"} <= set(doc["pairs"][0])
    code, out, err = cli("sample", "The machine", "-m", toy_model_dir, "-t", "0", "-n", "6", "--ignore-eos",
                         "-f", "json")
    assert code == 0, err
    assert json.loads(out)["token_ids"] == row["token_ids"]


def test_cli_compare_formats_and_bad_input(cli, toy_model_dir, tmp_path):
    code, out, err = cli("compare", "a", "b", "-m", toy_model_dir, "-V", "x: temperature=0", "-V", "y: top_k=3",
                         "-n", "3", "-f", "csv")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[0].startswith("variant,prompt,seed,text") and len(lines) == 5
    code, out, err = cli("compare", "a", "-m", toy_model_dir, "-V", "x: top_p=2", "-f", "json")
    assert code == 2 and "--top-p" in err and "x" in err and len(err.strip().splitlines()) == 1
    code, out, err = cli("compare", "a", "-m", toy_model_dir, "-V", "x: temperature=0", "--seeds", "z", "-f", "json")
    assert code == 2 and "--seeds" in err
    html = tmp_path / "c.html"
    code, out, err = cli("compare", "a", "-m", toy_model_dir, "-V", "x: temperature=0", "-V", "y: temperature=1",
                         "-n", "3", "-f", "jsonl", "--save-html", html)
    assert code == 0, err
    lines = [json.loads(line) for line in out.strip().splitlines()]
    assert [line["type"] for line in lines] == ["row", "row", "pair", "summary"]
    page = json.loads(re.search(r'<script type="application/json" id="trace">(.*?)</script>', html.read_text(),
                                re.S).group(1))  # --save-html: the trace page, holding the run's document
    assert page["command"] == "compare" and [p["first_divergence"] for p in page["pairs"]] == \
        [line["first_divergence"] for line in lines if line["type"] == "pair"]


def test_cli_sample_steps_carry_decided_by(cli, toy_model_dir):
    code, out, err = cli("sample", "The machine", "-m", toy_model_dir, "-t", "0.9", "--top-k", "5", "-n", "5",
                         "--ignore-eos", "-f", "json")
    assert code == 0, err
    steps = json.loads(out)["steps"]
    assert all(s["decided_by"] in ("model", "temperature", "top-k") and s["why"] for s in steps)


def test_cli_sample_many(cli, toy_model_dir):
    code, out, err = cli("sample", "The machine", "-m", toy_model_dir, "-t", "1.0", "-N", "6", "-n", "4",
                         "--ignore-eos", "-f", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert len(doc["samples"]) == 6 and doc["summary"]["num_samples"] == 6
    assert sum(f["count"] for f in doc["summary"]["first_tokens"]) == 6
    code, out, err = cli("sample", "The machine", "-m", toy_model_dir, "-t", "1.0", "--seed", "3", "-n", "4",
                         "--ignore-eos", "-f", "json")
    assert json.loads(out)["token_ids"] == doc["samples"][3]["token_ids"]  # sample i is seed + i
    code, out, err = cli("sample", "x", "-m", toy_model_dir, "-N", "0")
    assert code == 2 and "--num-samples" in err


def test_cli_force_and_resume(cli, toy_model_dir, tmp_path):
    args = ("-m", toy_model_dir, "-t", "0.9", "--seed", "5", "--ignore-eos", "-f", "json")
    code, out, err = cli("sample", "The machine", "-n", "10", *args)
    assert code == 0, err
    whole = json.loads(out)
    code, out, err = cli("sample", "The machine", "-n", "4", *args)
    (tmp_path / "t.json").write_text(out)
    code, out, err = cli("sample", "--resume", tmp_path / "t.json", "-n", "6", *args)
    assert code == 0, err
    resumed = json.loads(out)
    assert resumed["token_ids"] == whole["token_ids"]
    assert [s["index"] for s in resumed["steps"]] == list(range(4, 10))
    alt = next(a["token_id"] for a in whole["steps"][2]["alternatives"] if a["token_id"] != whole["token_ids"][2]
               and a["prob"] > 0)
    code, out, err = cli("sample", "The machine", "-n", "10", "--force", f"2={alt}", *args)
    assert code == 0, err
    forced = json.loads(out)
    assert forced["token_ids"][:2] == whole["token_ids"][:2] and forced["token_ids"][2] == alt
    assert forced["steps"][2]["decided_by"] == "forced"
    code, out, err = cli("sample", "The machine", "--force", "two=3", *args)
    assert code == 2 and "--force" in err


def test_cli_bench_rows(cli, toy_model_dir):
    code, out, err = cli("bench", "-m", toy_model_dir, "--settings", "greedy,sampling,prompt-lookup", "-n", "4",
                         "--rounds", "1", "--gammas", "2", "-f", "json")
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert {"greedy, trace on", "greedy, trace off", "prompt lookup: best vs best"} <= {r["setting"] for r in rows}
    for r in rows:
        assert {"setting", "decodelab_tokens_per_s", "transformers_tokens_per_s", "ratio"} <= set(r)
        assert r["ratio"] > 0
    code, out, err = cli("bench", "-m", toy_model_dir, "--settings", "warp")
    assert code == 2 and "--settings" in err


def test_a_ban_given_as_text_decides_the_divergence_it_causes(cli, tmp_path):
    """The attribution resolves text-valued settings with the model's tokenizer, as the run did: a replay that read
    `ban = [" first"]` as token 0 left the token unexplained ("numerics")."""
    job = tmp_path / "job.toml"
    job.write_text('prompts = ["Once upon a time"]\n[[variant]]\nname = "a"\ntemperature = 0.0\n'
                   '[[variant]]\nname = "b"\ntemperature = 0.0\nban = [" first"]\n')
    code, out, err = cli("compare", "--job", job, "-n", "24", "-f", "json")
    assert code == 0, err
    (pair,) = json.loads(out)["pairs"]
    assert pair["first_divergence"] is not None
    assert pair["deciding_stage"] == "ban", pair



# --- exact edges the mutation run (tests/mutation/run.sh, core/analysis/compare.py, partial) showed no test pinned ---


def summary_row(variant: str, length: int, mean_logprob, raw_perplexity, method: str = "sample") -> cmp.Row:
    return cmp.Row(variant, method, "1", 0, "", [], length, "length", mean_logprob, raw_perplexity, None, None, None,
                   None, None, 10.0)


def test_variant_summary_by_hand():
    """Per variant, over its runs: mean, min and max of each measure, a None or non-finite value left out, None
    where no run has one. a: lengths 3 and 5 (mean 4), mean log-probs -1 and None (only -1), perplexities inf and
    2 (only 2); b: one run."""
    rows = [summary_row("a", 3, -1.0, math.inf), summary_row("b", 7, -0.5, 3.0, method="beam"),
            summary_row("a", 5, None, 2.0)]
    a, b = cmp.variant_summary(rows)
    assert (a["variant"], a["method"], a["runs"], b["variant"], b["method"], b["runs"]) == ("a", "sample", 2, "b",
                                                                                            "beam", 1)
    assert a["measures"]["length"] == {"mean": 4.0, "min": 3, "max": 5}
    assert a["measures"]["mean_logprob"] == {"mean": -1.0, "min": -1.0, "max": -1.0}
    assert a["measures"]["raw_perplexity"] == {"mean": 2.0, "min": 2.0, "max": 2.0}
    assert a["measures"]["distinct_1"] is None and a["measures"]["tokens_per_s"]["mean"] == 10.0
    assert b["measures"]["length"] == {"mean": 7.0, "min": 7, "max": 7}


# mutation run of core/analysis/compare.py (2026-12-02, the whole file): the parsers word for word, the job and
# prompt files at their edges, the replayed race, a scored row field by field, the pair's verdicts without a model


def test_variant_describe_and_a_preset_variant():
    assert cmp.Variant("a").describe() == ""
    assert cmp.Variant("b", "beam", "nucleus", (("beams", 3), ("stop", " x"))).describe() == \
        "method=beam,preset=nucleus,beams=3,stop= x"
    assert cmp.Variant("c", values=(("top_k", "5"),)).describe() == "top_k=5"  # sample, the default, not named
    assert cmp.preset_variant("nucleus") == cmp.Variant("nucleus", "sample", "nucleus", ())


def test_parse_variant_names_colons_dashes_and_spaces():
    assert cmp.parse_variant("top_k=5").name == "v1"  # index 0 by default
    assert cmp.parse_variant("w: cache=window:size=8,positions=keep") == \
        cmp.Variant("w", values=(("cache", "window:size=8,positions=keep"),))  # the first ':' ends the name
    assert cmp.parse_variant("top_k=5,cache=window:size=8", 1) == \
        cmp.Variant("v2", values=(("top_k", "5"), ("cache", "window:size=8")))  # a '=' before it: no name
    assert cmp.parse_variant("x: top-k= 5 ,logit-bias= the=-5").values == (("top_k", "5"), ("logit_bias", " the=-5"))
    assert cmp.parse_variant("x: ban= a, b").values == (("ban", " a, b"),)  # a list of texts keeps its spaces
    with pytest.raises(ConfigError) as e:
        cmp.parse_variant("cold")  # neither a name before ':' nor a setting
    assert str(e.value).startswith("--variant 'cold': 'cold' is not KEY=VALUE with a known key; allowed: allow, ban, "
                                   "beams, cache, chain,")
    assert str(e.value).endswith(", typical_p, xtc_probability, xtc_threshold")
    with pytest.raises(ConfigError) as e:
        cmp.parse_variant(": top_k=5")
    assert str(e.value) == "--variant ': top_k=5': the name before ':' is empty"
    with pytest.raises(ConfigError) as e:
        cmp.parse_variant("x: beams=2")
    assert str(e.value).startswith("--variant x: beams is not a setting of method=sample; allowed: allow, ban, cache,")


def test_parse_seeds_bounds_and_messages_word_for_word():
    top = 2**64 - 1
    assert cmp.parse_seeds("0") == [0] and cmp.parse_seeds("0-0") == [0] and cmp.parse_seeds([0, top]) == [0, top]
    assert cmp.parse_seeds(str(top)) == [top]
    for bad, says in [([1, "x"], f"--seeds 'x': expected int, an integer in ASCII digits 0-9 in [0, {top}]"),
                      ([-1], f"--seeds -1: must be an integer in [0, {top}]"),
                      ([top + 1], f"--seeds {top + 1}: must be an integer in [0, {top}]"),
                      (str(top + 1), f"--seeds '{top + 1}': expected seeds >= 0 as a range or list, e.g. 0-9 or "
                                     "1,3,5 (at most 4096 seeds)"),
                      ("0-4096", "--seeds '0-4096': 4097 seeds; at most 4096 (each runs every variant on every "
                                 "prompt)")]:
        with pytest.raises(ConfigError) as e:
            cmp.parse_seeds(bad)
        assert str(e.value) == says


def test_seed_count_of_merged_ranges():
    assert cmp.seed_count([]) == 0 and cmp.seed_count([(3, 3)]) == 1
    assert cmp.seed_count([(5, 9), (0, 2), (1, 6)]) == 10  # 0-9 once


def test_job_files_word_for_word(tmp_path):
    def refused(name, text):
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(ConfigError) as e:
            cmp.load_job(path)
        return str(e.value).replace(str(path), "JOB")

    missing = tmp_path / "none.toml"
    with pytest.raises(ConfigError) as e:
        cmp.load_job(missing)
    assert str(e.value) == f"--job {missing}: no such file; give a text file"
    no_variants = "--job JOB: no variants; TOML needs [[variant]] tables, JSONL one object a line"
    assert refused("a.toml", "variant = 5\n") == no_variants
    assert refused("b.toml", "variant = []\n") == no_variants
    assert refused("c.jsonl", "[1]\n") == no_variants
    assert refused("d.toml", "defaults = 3\n[[variant]]\nname = 'a'\n") == \
        "--job JOB: [defaults] must be a table of settings"
    assert refused("e.toml", "x = [\n").startswith("--job JOB: invalid TOML: ")
    assert refused("f.jsonl", '{"name": "a"}\n\n{"name": \n').startswith("--job JOB: line 3: not JSON (")
    assert refused("g.toml", 'seeds = "3-1"\n[[variant]]\nname = "a"\n') == \
        "--job JOB: seeds '3-1': expected seeds >= 0 as a range or list, e.g. 0-9 or 1,3,5 (at most 4096 seeds)"
    assert refused("h.toml", "prompts = ['']\n[[variant]]\nname = 'a'\n") == \
        "--job JOB: prompts must be a text or a list of non-empty texts"
    assert refused("i.toml", "[[variant]]\nname = 'a'\nbeams = 2\n").startswith(
        "--job JOB: variant a: beams is not a setting of method=sample; allowed: allow, ban,")
    job = tmp_path / "j.toml"
    job.write_text("prompts = 'hello'\n[defaults]\ntop_k = 5\n[[variants]]\ntemperature = 0.5\n"
                   "[[variants]]\ntop_k = 7\n")
    variants, extras = cmp.load_job(job)
    assert extras == {"prompts": ["hello"]}  # a text is a list of one prompt; no seeds given, none returned
    assert variants == [cmp.Variant("v1", values=(("top_k", 5), ("temperature", 0.5))),
                        cmp.Variant("v2", values=(("top_k", 7),))]  # [[variants]] too; the defaults first
    lines = tmp_path / "k.jsonl"
    lines.write_text('{"top_k": 3}\n\n{"name": "z", "method": "beam"}\n{"temperature": 0}\n')
    assert [(v.name, v.method) for v in cmp.load_job(lines)[0]] == [("v1", "sample"), ("z", "beam"),
                                                                   ("v3", "sample")]


def test_job_prompts_edges():
    assert cmp.job_prompts("w", "hi") == ["hi"] and cmp.job_prompts("w", ["a", "b"]) == ["a", "b"]
    assert len(cmp.job_prompts("w", ["p"] * 100_000)) == 100_000
    for bad in (("a", "b"), [""], [3], 5):
        with pytest.raises(ConfigError) as e:
            cmp.job_prompts("w", bad)
        assert str(e.value) == "w: prompts must be a text or a list of non-empty texts"
    with pytest.raises(ConfigError) as e:
        cmp.job_prompts("w", ["p"] * 100_001)
    assert str(e.value) == "w: 100001 prompts; at most 100000"


def test_prompt_files_edges(tmp_path):
    def prompts(text):
        path = tmp_path / "p.txt"
        path.write_text(text)
        return [(p.id, p.text) for p in cmp.read_prompts(path)]

    def refused(text):
        path = tmp_path / "bad.txt"
        path.write_text(text)
        with pytest.raises(ConfigError) as e:
            cmp.read_prompts(path)
        return str(e.value).replace(str(path), "P")

    assert prompts("first\n\n  \nsecond {x}\n") == [("1", "first"), ("2", "second {x}")]  # blank lines skipped
    assert prompts('  {"prompt": "a", "id": 7}\n{"text": "b"}\n') == [("7", "a"), ("2", "b")]
    assert prompts('{"prompt": "a"} \nplain\n') == [("1", '{"prompt": "a"} '), ("2", "plain")]  # not all JSON
    missing = tmp_path / "none.txt"
    with pytest.raises(ConfigError) as e:
        cmp.read_prompts(missing)
    assert str(e.value) == f"--prompts-file {missing}: no such file; give a text file"
    assert refused("\n  \n") == '--prompts-file P: no prompts (one a line, or JSONL with "prompt")'
    assert refused('{"prompt": "a"}\n{"prompt": \n').startswith("--prompts-file P: line 2: not JSON (")
    for line in ('{"prompt": 5}', '{"prompt": ""}', '{"id": "x"}'):
        assert refused('{"prompt": "a"}\n' + line) == '--prompts-file P: line 2 has no "prompt" text'


def test_show_and_differing_keys():
    assert cmp._show(None) == "off" and cmp._show(0.5) == "0.5" and cmp._show(0) == "0"
    sa = cmp.settings_for(cmp.parse_variant("a: temperature=0.5,top_k=5"), {}, 0)
    sb = cmp.settings_for(cmp.parse_variant("b: temperature=0.7,top_k=5"), {}, 1)
    assert cmp.differing_keys(sa, sb) == ["temperature"]  # the seed is the comparison's axis, not a setting
    sc = cmp.settings_for(cmp.parse_variant("c: temperature=0.7,top_k=6"), {}, 1)
    assert cmp.differing_keys(sa, sc) == ["temperature", "top_k"] and cmp.differing_keys(sb, sb) == []


def test_replay_race_is_the_vector_the_sampler_drew(llama):
    """The selector of a sampling run with seed 4 draws one Exp(1) vector per step; the replay of step 2 is the
    third, exactly, and the sampled token at step 2 is argmax(z - log E) for it."""
    from decodelab.core.sampling.select import Multinomial, make_generator

    sel = Multinomial(make_generator(4, "cpu"))
    for _ in range(3):
        sel.from_logits(torch.zeros(1, V))
    race = cmp.replay_race(4, 2, V, "cpu")
    assert race.shape == (1, V) and race.dtype == torch.float32 and torch.equal(race, sel.last_race)
    assert not torch.equal(race, cmp.replay_race(4, 1, V, "cpu")) and not torch.equal(race, cmp.replay_race(5, 2, V,
                                                                                                            "cpu"))
    prompt = [int(t) for t in PROMPT.split()]
    ids = compare(llama, ["s: temperature=1"], seeds=(4,), n=3).rows[0].token_ids
    z = Runtime.create(llama).prefill(torch.tensor([prompt + ids[:2]]))
    assert int((z.float() - race.log()).argmax(dim=-1)[0]) == ids[2]


def test_a_scored_row_field_by_field(llama):
    """A beam variant's row from given ids, recomputed from one plain forward of the model: raw perplexity from its
    log-softmax, the processed figures under temperature 2 (every token kept), the n-gram measures by hand:
    3 4 3 4 3 4 3 has 2 distinct of 7 tokens, 2 distinct of 6 bigrams, 2 distinct of 4 4-grams (seq-rep-4 1/2)."""
    from decodelab.core.sampling.chain import build_chain as chain_of

    prompt_ids = [int(t) for t in PROMPT.split()]
    v = cmp.parse_variant("b: method=beam,beams=2")
    run = cmp.Comparison(lm_for(llama), [v], [cmp.Prompt("p7", PROMPT)], [5])
    ids = [3, 4, 3, 4, 3, 4, 3]
    row = run.scored_row(v, run.prompts[0], 5, prompt_ids, chain_of({"temperature": 2.0}), ids, "eos", 12.5)
    with torch.no_grad():
        logits = llama(torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1 : -1].double()
    target = torch.tensor(ids)[:, None]
    raw = torch.log_softmax(logits, -1).gather(1, target)[:, 0]
    hot = torch.log_softmax(logits / 2, -1)
    entropy = -(hot.exp() * hot).sum(-1)
    assert (row.variant, row.method, row.prompt, row.seed, row.text, row.token_ids, row.length, row.stop_reason) == \
        ("b", "beam", "p7", 5, "3 4 3 4 3 4 3", ids, 7, "eos")
    assert row.raw_perplexity == pytest.approx(math.exp(-float(raw.mean())), rel=1e-4)
    assert row.mean_logprob == pytest.approx(float(hot.gather(1, target).mean()), abs=1e-4)
    assert row.mean_entropy == pytest.approx(float(entropy.mean()), abs=1e-4) and row.mean_kept == V
    assert (row.distinct_1, row.distinct_2, row.repetition_rate) == (2 / 7, 2 / 6, 0.5)
    assert row.tokens_per_s == 12.5 and row.decided_by == []
    empty = run.scored_row(v, run.prompts[0], 5, prompt_ids, chain_of({"temperature": 2.0}), [], "empty_chain", 0.0)
    assert (empty.length, empty.text, empty.raw_perplexity, empty.mean_logprob, empty.distinct_1) == \
        (0, "", None, None, None)


def test_check_names_word_for_word():
    cmp.check_names([cmp.Variant("a"), cmp.Variant("b")])
    for variants, says in [([cmp.Variant("a"), cmp.Variant("b"), cmp.Variant("a")],
                             "--variant a: the name is used twice; give each variant its own name"),
                            ([], "--variant: nothing to compare; give --variant, --preset or --job")]:
        with pytest.raises(ConfigError) as e:
            cmp.check_names(variants)
        assert str(e.value) == says


def pair_row(variant: str, ids: list[int], reason: str = "length", method: str = "sample") -> cmp.Row:
    return cmp.Row(variant, method, "q", 3, "", ids, len(ids), reason, None, None, None, None, None, None, None, 1.0)


def test_pair_verdicts_that_need_no_replay(llama):
    """The pair's verdict before any attribution: identical rows, a row that ended where the other went on (the
    shorter one named), another method, two beam variants (their differing settings named), a stateful stage."""
    specs = ["s: temperature=0.5", "b: method=beam,beams=2", "c: method=beam,beams=3,length_penalty=0.5",
             "d: method=beam,beams=2", "x: xtc_probability=0.5,xtc_threshold=0.1", "m: mirostat_tau=5"]
    vs = {v.name: v for v in (cmp.parse_variant(s) for s in specs)}
    run = cmp.Comparison(lm_for(llama), list(vs.values()), [cmp.Prompt("q", PROMPT)], [3])
    prompt_ids = [int(t) for t in PROMPT.split()]

    def verdict(a, ra, b, rb):
        p = run.compare_pair(vs[a], vs[b], pair_row(a, ra, "eos", vs[a].method), pair_row(b, rb, "length",
                                                                                          vs[b].method), prompt_ids, 3)
        return p.to_dict()

    def expect(a, b, d, stage, why=None, a_token=None, b_token=None):
        return {"a": a, "b": b, "prompt": "q", "seed": 3, "first_divergence": d, "deciding_stage": stage, "why": why,
                "a_token": a_token, "b_token": b_token}

    assert verdict("s", [1, 2], "x", [1, 2]) == expect("s", "x", None, None)
    assert verdict("s", [1, 2], "x", [1, 2, 3]) == expect("s", "x", 2, "stop", "s stopped (eos)")
    assert verdict("s", [1, 2, 3], "x", [1, 2]) == expect("s", "x", 2, "stop", "x stopped (length)")
    assert verdict("s", [1, 2, 3], "b", [1, 4, 3]) == expect("s", "b", 1, "method", "sample vs beam", 2, 4)
    assert verdict("b", [1, 2], "c", [1, 5]) == expect("b", "c", 1, "method",
                                                       "beam settings differ (beams, length_penalty)", 2, 5)
    assert verdict("b", [7, 2], "d", [6, 2]) == expect("b", "d", 0, "method", "beam with the same settings", 7, 6)
    stateful = "xtc draws its own coin from the run's generator and mirostat carries state: not attributed"
    assert verdict("s", [1, 2], "x", [1, 3]) == expect("s", "x", 1, "stateful", stateful, 2, 3)
    assert verdict("m", [1, 2], "s", [1, 3]) == expect("m", "s", 1, "stateful", stateful, 2, 3)


def teacher_forced_by_hand(model, prompt_ids, ids, temperature):
    """Raw and processed (logits / temperature) log-probabilities of ids, entropies, from one plain forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1 : -1].double()
    target = torch.tensor(ids)[:, None]
    hot = torch.log_softmax(logits / temperature, -1)
    return (torch.log_softmax(logits, -1).gather(1, target)[:, 0], hot.gather(1, target)[:, 0],
            -(hot.exp() * hot).sum(-1))


def test_rows_of_each_method_field_by_field(llama):
    """One prompt, seed 3, 6 tokens: the sample row's figures recomputed from a plain forward (temperature 0.9, every
    token kept), its n-gram measures recounted; the beam row is transformers' beam search; every row carries its
    seed, prompt id, method and a rate. The command's top is overridden: rows need no alternatives."""
    prompt_ids = [int(t) for t in PROMPT.split()]
    vs = [cmp.parse_variant(s) for s in ("s: temperature=0.9", "b: method=beam,beams=2",
                                         "n: method=speculate,draft=ngram,gamma=2,temperature=0")]
    run = cmp.Comparison(lm_for(llama), vs, [cmp.Prompt("p9", PROMPT)], [3],
                         base={"max_new_tokens": 6, "ignore_eos": True, "top": 5})
    assert run.settings["s", 3].top == 0 and run.settings["n", 3].top == 0 and run.total == 3
    s, b, n = run.run().rows
    for row, name, method in ((s, "s", "sample"), (b, "b", "beam"), (n, "n", "speculate")):
        assert (row.variant, row.method, row.prompt, row.seed, row.length, row.stop_reason) == \
            (name, method, "p9", 3, 6, "length")
        assert row.text == " ".join(map(str, row.token_ids)) and isinstance(row.tokens_per_s, float)
    ids = s.token_ids
    raw, hot, entropy = teacher_forced_by_hand(llama, prompt_ids, ids, 0.9)
    assert s.raw_perplexity == pytest.approx(math.exp(-float(raw.mean())), rel=1e-4)
    assert s.mean_logprob == pytest.approx(float(hot.mean()), abs=1e-4)
    assert s.mean_entropy == pytest.approx(float(entropy.mean()), abs=1e-4) and s.mean_kept == V
    grams = lambda k: [tuple(ids[i : i + k]) for i in range(len(ids) - k + 1)]  # noqa: E731
    assert (s.distinct_1, s.distinct_2, s.repetition_rate) == (len(set(ids)) / 6, len(set(grams(2))) / 5,
                                                                1 - len(set(grams(4))) / 3)
    assert len(s.decided_by) == 6 and set(s.decided_by) <= {"model", "temperature"}
    ids_t = torch.tensor([prompt_ids])
    beam = llama.generate(ids_t, attention_mask=torch.ones_like(ids_t), do_sample=False, num_beams=2,
                          length_penalty=1.0, early_stopping=False, max_new_tokens=6, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt_ids):].tolist()
    greedy = llama.generate(ids_t, attention_mask=torch.ones_like(ids_t), do_sample=False, max_new_tokens=6,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt_ids):].tolist()
    assert b.token_ids == beam != greedy == n.token_ids


def test_a_row_whose_chain_empties_at_once(llama):
    """Every token biased to -inf: the sample and beam rows end at once (empty_chain), with no figures."""
    bias = ",".join(f"{i}=-inf" for i in range(V))
    vs = [cmp.parse_variant(f"{m}logit_bias={bias}") for m in ("s: ", "b: method=beam,beams=2,")]
    run = cmp.Comparison(lm_for(llama), vs, [cmp.Prompt("p", PROMPT)], [0],
                         base={"max_new_tokens": 4, "ignore_eos": True})
    for row in run.run().rows:
        assert (row.token_ids, row.stop_reason, row.raw_perplexity, row.mean_logprob, row.mean_entropy) == \
            ([], "empty_chain", None, None, None)


def test_a_draft_model_is_loaded_once_per_spec(llama):
    """A speculative variant with a draft model: refused without a loader, word for word; with one, the draft is
    loaded once for every seed and prompt, and greedy speculation with it decodes the greedy output."""
    v = cmp.parse_variant("d: method=speculate,draft=tiny,gamma=2,temperature=0")
    prompts = [cmp.Prompt("p", PROMPT)]
    base = {"max_new_tokens": 5, "ignore_eos": True}
    with pytest.raises(ConfigError) as e:
        cmp.Comparison(lm_for(llama), [v], prompts, [0], base=base).run()
    assert str(e.value) == "variant d: draft=tiny: no draft loader here; use draft=ngram"
    calls = []
    draft = lm_for(random_model("llama", seed=9, scale=4.0, num_hidden_layers=1))
    run = cmp.Comparison(lm_for(llama), [v], prompts, [0, 1], base=base,
                         load_draft=lambda spec: calls.append(spec) or draft).run()
    assert calls == ["tiny"] and run.drafts == {"tiny": draft}
    ids = torch.tensor([[int(t) for t in PROMPT.split()]])
    greedy = llama.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=5,
                            eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert [r.token_ids for r in run.rows] == [greedy, greedy]


def test_a_comparison_needs_prompts():
    with pytest.raises(ConfigError) as e:
        cmp.Comparison(None, [cmp.Variant("a")], [], [0])
    assert str(e.value) == "PROMPT: nothing to compare on; give prompts or --prompts-file"


def test_make_variant_keys_and_messages_word_for_word():
    assert cmp.make_variant("j", {"method": " beam ", "top-k": 5, "preset": " nucleus "}, "w") == \
        cmp.Variant("j", "beam", "nucleus", (("top_k", 5),))

    def refused(items):
        with pytest.raises(ConfigError) as e:
            cmp.make_variant("j", items, "w")
        return str(e.value)

    assert refused({"method": "foo"}) == "w: method='foo'; allowed: sample, beam, speculate"
    unknown = refused([("temprature", 1)])
    # issue 40: a typo gets "did you mean" before the whole list (the list itself unchanged)
    head = "w: unknown key 'temprature' (did you mean 'temperature'?); allowed: method, cache, preset and the settings "
    assert unknown.startswith(head + "allow, ban, beams, cache, chain, choice,")
    assert unknown.endswith(", typical_p, xtc_probability, xtc_threshold")
    assert "method" not in unknown[len(head):] and "preset" not in unknown[len(head):]  # listed once, first
    beams = refused({"method": "speculate", "beams": 2})
    assert beams.startswith("w: beams is not a setting of method=speculate; allowed: allow, ban, cache, chain,")
    assert beams.endswith(", typical_p, xtc_probability, xtc_threshold") and "seed" not in beams


def test_parse_seeds_counts_a_list_before_reading_it():
    assert cmp.parse_seeds(list(range(4096))) == list(range(4096))
    with pytest.raises(ConfigError) as e:
        cmp.parse_seeds(list(range(4097)))
    assert str(e.value) == "--seeds: 4097 seeds; at most 4096"


def test_a_looping_sample_row_counts_its_ngrams(llama):
    """Greedy decoding of the random model loops (a token repeated to the end): distinct-1, distinct-2 and seq-rep-4
    then differ from one another, each recounted from the row's tokens (transformers' greedy output)."""
    row = compare(llama, ["g: temperature=0"], n=12).rows[0]
    ids = row.token_ids
    ids_t = torch.tensor([[int(t) for t in PROMPT.split()]])
    assert ids == llama.generate(ids_t, attention_mask=torch.ones_like(ids_t), do_sample=False, max_new_tokens=12,
                                 eos_token_id=None, pad_token_id=0)[0, 6:].tolist()
    grams = lambda k: [tuple(ids[i : i + k]) for i in range(len(ids) - k + 1)]  # noqa: E731
    d1, d2, d3, d4 = (len(set(grams(k))) / len(grams(k)) for k in (1, 2, 3, 4))
    assert len({d1, d2, d3}) == 3, "a prompt whose greedy output repeats"
    assert (row.distinct_1, row.distinct_2, row.repetition_rate) == (d1, d2, 1 - d4)


def test_a_sampled_speculative_row_uses_its_draft(llama):
    """At temperature 1 the proposer's own draws shift the shared generator, so the draft shows in the tokens: the
    row is a speculative run with the loaded draft, not one with the n-gram proposer."""
    from decodelab.core.engine.run import drain
    from decodelab.core.methods.speculative.run import build_speculator

    draft = lm_for(random_model("llama", seed=9, scale=4.0, num_hidden_layers=1))
    v = cmp.parse_variant("d: method=speculate,draft=tiny,gamma=2,temperature=1")
    base = {"max_new_tokens": 8, "ignore_eos": True}
    run = cmp.Comparison(lm_for(llama), [v], [cmp.Prompt("p", PROMPT)], [0], base=base, load_draft=lambda s: draft)
    row = run.run().rows[0]

    def by_hand(proposer):
        spec = build_speculator(lm_for(llama), proposer, run.settings["d", 0], [int(t) for t in PROMPT.split()], 2,
                                record=False)
        drain(spec)
        return list(spec.new_ids)

    assert row.token_ids == by_hand(draft) != by_hand(None)


def test_a_beam_row_is_the_best_hypothesis_with_its_own_reason(llama):
    """With token 103 as the end of text, beam search over 2 beams finishes its best hypothesis at the end id while
    the other runs to the length: the row is the best one, as transformers' beam search finds it, ended by eos."""
    lm = lm_for(llama)
    lm.eos_ids = [103]
    v = cmp.parse_variant("b: method=beam,beams=2")
    row = cmp.Comparison(lm, [v], [cmp.Prompt("p", PROMPT)], [0], base={"max_new_tokens": 6}).run().rows[0]
    ids = torch.tensor([[int(t) for t in PROMPT.split()]])
    out = llama.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=2, length_penalty=1.0,
                         early_stopping=False, max_new_tokens=6, eos_token_id=103, pad_token_id=0)[0, 6:].tolist()
    assert out[: out.index(103) + 1] == row.token_ids and len(row.token_ids) < 6
    assert (row.stop_reason, row.length) == ("eos", len(row.token_ids))


def test_teacher_forced_replays_the_chain_from_the_prompts_end_whatever_it_did_before(llama):
    """vLLM's frequency penalty counts generated tokens only: the processed log-prob of out[i] is
    log softmax(z_i - 1.5 * count(out[:i]))[out[i]], by hand from one plain forward. The chain is told where the
    prompt ends by the replay itself: a chain left at another prompt length (here 0, as after scoring a history, so
    the prompt's tokens would be counted too) and a chain never reset give the same numbers."""
    from decodelab.core.methods.sample import SampleSettings
    from decodelab.core.sampling.chain import make_chain

    lm = lm_for(llama)
    prompt_ids, out = [5, 17, 42, 9, 17], [17, 42, 17, 3]
    settings = SampleSettings(frequency_penalty=1.5, semantics="vllm")
    with torch.no_grad():
        z = llama(torch.tensor([prompt_ids + out])).logits[0, len(prompt_ids) - 1 : -1].double()
    counts = torch.zeros(len(out), V, dtype=torch.float64)
    for i in range(len(out)):
        for t in out[:i]:
            counts[i, t] += 1
    want = torch.log_softmax(z - 1.5 * counts, -1).gather(1, torch.tensor(out)[:, None])[:, 0].tolist()
    elsewhere = make_chain(lm, settings)
    elsewhere.reset(0)
    for chain in (elsewhere, make_chain(lm, settings)):
        got = cmp.teacher_forced(llama, prompt_ids, out, chain)
        assert got.logprob == pytest.approx(want, abs=1e-4)
        assert got.kept == [V] * len(out)


def test_teacher_forced_statistics_under_a_filter_by_hand(llama):
    """top-k 3 at temperature 0.8: per generated token the raw log-prob (the model's own), the processed log-prob
    (log softmax of z / 0.8 over the 3 kept, -inf for a token outside them), kept = 3 and the entropy of the
    renormalized top 3, from one plain forward in float64."""
    from decodelab.core.methods.sample import SampleSettings
    from decodelab.core.sampling.chain import make_chain

    prompt_ids, out = [5, 17, 42, 9], [17, 42, 100, 3]
    with torch.no_grad():
        z = llama(torch.tensor([prompt_ids + out])).logits[0, len(prompt_ids) - 1 : -1].double()
    hot = z / 0.8
    top = hot.topk(3, dim=-1).indices
    kept = torch.full_like(hot, float("-inf")).scatter(1, top, hot.gather(1, top))
    logp = torch.log_softmax(kept, -1)
    t = torch.tensor(out)[:, None]
    got = cmp.teacher_forced(llama, prompt_ids, out, make_chain(lm_for(llama), SampleSettings(temperature=0.8,
                                                                                              top_k=3)))
    assert got.raw_logprob == pytest.approx(torch.log_softmax(z, -1).gather(1, t)[:, 0].tolist(), abs=1e-4)
    assert got.logprob == pytest.approx(logp.gather(1, t)[:, 0].tolist(), abs=1e-4)
    assert got.kept == [3] * 4
    h = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)
    assert got.entropy == pytest.approx(h.tolist(), abs=1e-4)


def test_one_statistics_path_sample_score_and_compare_agree_on_the_same_tokens(llama):
    """The tokens a sampling run drew (temperature 0.9, top-k 20), scored teacher-forced by `score` and by compare's
    rows: every per-step number each reports is the sampling trace's own (ranks exactly; the rest up to the float32
    difference between a cached decode and one forward)."""
    from decodelab.core.engine.run import drain
    from decodelab.core.methods.sample import SampleSettings, build_sampler
    from decodelab.core.methods.score import Scorer, ScoreSettings
    from decodelab.core.sampling.chain import make_chain

    lm = lm_for(llama)
    prompt_ids = [5, 17, 42, 9, 100, 3]
    settings = SampleSettings(temperature=0.9, top_k=20, seed=3, max_new_tokens=6, ignore_eos=True, top=0)
    sampler = build_sampler(lm, settings, prompt_ids)
    drain(sampler)
    steps, out = sampler.steps, sampler.new_ids
    assert len(steps) == 6
    rows = [r for r in Scorer(llama, prompt_ids + out, make_chain(lm, settings), str, ScoreSettings())
            if r.position >= len(prompt_ids)]
    assert [r.token_id for r in rows] == out
    assert [r.raw_rank for r in rows] == [s.raw_rank for s in steps]
    for key in ("raw_logprob", "raw_entropy", "logprob"):
        assert [getattr(r, key) for r in rows] == pytest.approx([getattr(s, key) for s in steps], abs=1e-4), key
    tf = cmp.teacher_forced(llama, prompt_ids, out, make_chain(lm, settings))
    assert tf.kept == [s.kept for s in steps] == [20] * 6
    assert tf.raw_logprob == pytest.approx([s.raw_logprob for s in steps], abs=1e-4)
    assert tf.logprob == pytest.approx([s.logprob for s in steps], abs=1e-4)
    assert tf.entropy == pytest.approx([s.entropy for s in steps], abs=1e-4)


def test_variants_run_warm_in_a_rotated_order_and_are_reported_in_their_own(monkeypatch):
    """Issue 34: the model is warmed before the first row (warmup_s); from one (prompt, seed) to the next the
    variants' run order rotates, so none always pays for running first; rows keep the variants' order."""
    model = random_model("llama", seed=21)
    vs = [cmp.parse_variant(v, i) for i, v in enumerate(["a: temperature=0", "b: temperature=0.7",
                                                          "c: top_p=0.9"])]
    ran, seen = [], []
    run = cmp.Comparison(lm_for(model), vs, [cmp.Prompt("p", PROMPT)], [0, 1, 2],
                         base={"max_new_tokens": 2, "ignore_eos": True}, on_row=lambda r: seen.append(r.variant))
    real = run.run_one

    def run_one(v, settings, prompt, prompt_ids, seed):
        ran.append(v.name)
        return real(v, settings, prompt, prompt_ids, seed)

    monkeypatch.setattr(run, "run_one", run_one)
    run.run()
    assert run.warmup_s > 0
    assert ran == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert seen == [r.variant for r in run.rows] == ["a", "b", "c"] * 3


def test_compare_csv_has_a_column_per_setting_the_variants_set(cli, toy_model_dir):
    """Issue 40: the CSV had the variant's name and no settings. One column per setting any variant sets, holding the
    row's resolved value (empty where that variant's settings have none), after the row's own columns."""
    import csv
    import io

    code, out, err = cli("compare", "Hello", "-m", toy_model_dir, "-V", "a: temperature=0",
                         "-V", "b: temperature=0.9,top_k=5", "-V", "c: method=beam,beams=2", "-n", "3", "-f", "csv")
    assert code == 0, err
    rows = list(csv.DictReader(io.StringIO(out)))
    assert list(rows[0])[:4] == ["variant", "prompt", "seed", "text"]
    assert list(rows[0])[-4:] == ["temperature", "top_k", "method", "beams"]
    by = {r["variant"]: r for r in rows}
    assert (by["a"]["temperature"], by["a"]["top_k"], by["a"]["method"]) == ("0.0", "", "sample")
    assert (by["b"]["temperature"], by["b"]["top_k"]) == ("0.9", "5")
    assert (by["c"]["method"], by["c"]["beams"]) == ("beam", "2")


def test_a_prompts_own_settings_give_the_tokens_of_a_comparison_with_those_settings(llama, tmp_path):
    """Issue 40: `batch` honours a JSONL line's settings and `compare` refused them on the same file. Now a line's
    settings, read as batch reads them, override every variant's for that prompt only: each of its rows has the tokens
    of a comparison of that prompt whose variants set them (oracle: that comparison), and a pair's deciding stage is
    worked from what the rows ran with; the other prompt's rows are the plain comparison's."""
    pf = tmp_path / "p.jsonl"
    pf.write_text(json.dumps({"id": "own", "prompt": PROMPT, "temperature": 0.5, "top_k": 7}) + "\n"
                  + json.dumps({"id": "plain", "prompt": PROMPT}) + "\n")
    prompts = cmp.read_prompts(pf)
    assert [(p.id, p.settings) for p in prompts] == [("own", {"temperature": 0.5, "top_k": 7}), ("plain", {})]
    variants = ["a: temperature=1.3", "b: top_p=0.9,temperature=1.3", "c: method=speculate,draft=ngram"]
    own_variants = ["a: temperature=0.5,top_k=7", "b: top_p=0.9,temperature=0.5,top_k=7",
                    "c: method=speculate,draft=ngram,temperature=0.5,top_k=7"]
    base = {"max_new_tokens": 12, "ignore_eos": True}
    run = cmp.Comparison(Ids(llama), [cmp.parse_variant(v, i) for i, v in enumerate(variants)], prompts, [0, 1],
                         base=base).run()
    alone = compare(llama, own_variants, seeds=(0, 1))
    plain = compare(llama, variants, seeds=(0, 1))
    for seed in (0, 1):
        for name in "abc":
            row = next(r for r in run.rows if (r.variant, r.prompt, r.seed) == (name, "own", seed))
            assert row.token_ids == next(r for r in alone.rows if (r.variant, r.seed) == (name, seed)).token_ids
            row = next(r for r in run.rows if (r.variant, r.prompt, r.seed) == (name, "plain", seed))
            assert row.token_ids == next(r for r in plain.rows if (r.variant, r.seed) == (name, seed)).token_ids
        for a, b in (("a", "b"), ("a", "c"), ("b", "c")):
            got = next(p for p in run.pairs if (p.a, p.b, p.prompt, p.seed) == (a, b, "own", seed))
            want = pair(alone, a, b, seed)
            assert (got.first_divergence, got.deciding_stage, got.why) == (want.first_divergence,
                                                                            want.deciding_stage, want.why)
    # the prompt's settings changed the outcome (the test could fail): some row differs from the plain prompt's
    assert any(r.token_ids != q.token_ids for r in run.rows for q in run.rows
               if (r.prompt, q.prompt) == ("own", "plain") and (r.variant, r.seed) == (q.variant, q.seed))
    assert run.settings_of("b", "own", 1).top_k == 7 and run.settings_of("b", "own", 1).seed == 1
    assert run.settings_of("b", "plain", 1).top_k is None
    doc = run.document()
    assert doc["prompts"] == [{"id": "own", "text": PROMPT, "settings": {"temperature": 0.5, "top_k": 7}},
                              {"id": "plain", "text": PROMPT}]


def test_a_prompts_own_settings_that_cannot_be_compared_are_refused(llama, tmp_path):
    """What cannot be compared is refused in one line: a seed (the comparison's axis), a key some variant's method
    lacks (beam has no stop strings), a value the method refuses (beam takes no temperature), and what batch refuses too (the shared cache)."""
    def refused(line, variants=("a: temperature=0.5",)):
        pf = tmp_path / "p.jsonl"
        pf.write_text(json.dumps({"prompt": PROMPT}) + "\n" + json.dumps({"prompt": PROMPT, **line}) + "\n")
        with pytest.raises(ConfigError) as e:
            cmp.Comparison(Ids(llama), [cmp.parse_variant(v, i) for i, v in enumerate(variants)],
                           cmp.read_prompts(pf), [0])
        return str(e.value).replace(str(pf), "P")

    assert refused({"seed": 3}) == ("--prompts-file P: line 2 sets 'seed': the seeds are the comparison's axis, the "
                                    "same for every prompt and variant (--seeds); remove it from the line")
    assert refused({"stop": "x"}, ("a: temperature=0.5", "b: method=beam,beams=2")) == (
        "--prompts-file: prompt 2 sets 'stop', which variant b (method=beam) does not have; a prompt's own settings "
        "must apply to every variant")
    assert refused({"top_p": 1.5}).startswith("--prompts-file: prompt 2, variant a: ")
    assert refused({"temperature": 0.5}, ("a: temperature=1", "b: method=beam,beams=2")).startswith(
        "--prompts-file: prompt 2, variant b: --temperature 0.5: not used by beam search")
    assert refused({"cache": "window:size=8"}).startswith("--prompts-file P: line 2: 'cache' is not a per-request")
    assert refused({"temprature": 0.5}).startswith("--prompts-file P: line 2: ")
    dup = tmp_path / "dup.jsonl"  # rows name their prompt by its id: one id for two prompts, one with settings
    dup.write_text('{"id": "a", "prompt": "1 2"}\n{"id": "a", "prompt": "3 4", "temperature": 0.5}\n')
    with pytest.raises(ConfigError, match="^--prompts-file: prompt id 'a' is used twice and one has its own settings"):
        cmp.Comparison(Ids(llama), [cmp.parse_variant("v: temperature=1")], cmp.read_prompts(dup), [0])


def test_compare_honours_a_prompts_file_lines_own_settings(cli, toy_model_dir, tmp_path):
    """The command: the JSON names the prompt's own settings, the table says they ran over the variants', the CSV's
    setting columns hold what each row ran with; prompt, text and id are read as before; a seed is one line, exit 2."""
    import csv
    import io

    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "x", "prompt": "Hello"}\n{"prompt": "Once", "temperature": 0.7}\n')
    args = ("compare", "--prompts-file", path, "-m", toy_model_dir, "-V", "a: temperature=0", "-V",
            "b: temperature=1.2", "-n", "3", "--threads", "1")
    code, out, err = cli(*args, "-f", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["prompts"] == [{"id": "x", "text": "Hello"}, {"id": "2", "text": "Once", "settings": {"temperature": 0.7}}]
    code, out, err = cli(*args, "-f", "csv")
    rows = {(r["variant"], r["prompt"]): r["temperature"] for r in csv.DictReader(io.StringIO(out))}
    assert rows == {("a", "x"): "0.0", ("b", "x"): "1.2", ("a", "2"): "0.7", ("b", "2"): "0.7"}
    code, out, err = cli(*args)
    assert code == 0 and "prompt 2 sets its own temperature=0.7: every variant ran with these here" in " ".join(
        out.split())
    path.write_text('{"id": "x", "prompt": "Hello"}\n{"text": "Once"}\n')
    assert [(p.id, p.text) for p in cmp.read_prompts(path)] == [("x", "Hello"), ("2", "Once")]
    path.write_text('{"id": "x", "prompt": "Hello"}\n{"prompt": "Once", "seed": 7}\n')
    code, out, err = cli("compare", "--prompts-file", path, "-m", "/nonexistent/model", "-V", "a: temperature=0")
    assert code == 2 and err.count("\n") == 1
    assert f"--prompts-file {path}: line 2 sets 'seed': the seeds are the comparison's axis" in err


def test_compare_csv_holds_each_rows_texts_against_the_first_variant(cli, toy_model_dir):
    """Issue 40: compare's CSV had no pair texts. Each row carries its pair with the first variant (vs, the step where
    they part, the two tokens there as text, each output's text from there on), checked against the rows' own ids
    and the tokenizer; the first variant's rows and an identical pair leave them empty."""
    import csv
    import io

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_model_dir)
    args = ("compare", "Once upon", "-m", toy_model_dir, "-V", "g: temperature=0", "-V", "h: temperature=1.5",
            "-V", "same: temperature=0", "--seeds", "3", "-n", "6", "--ignore-eos", "--threads", "1")
    doc = json.loads(cli(*args, "-f", "json")[1])
    code, out, err = cli(*args, "-f", "csv")
    assert code == 0, err
    rows = {r["variant"]: r for r in csv.DictReader(io.StringIO(out))}
    ids = {r["variant"]: r["token_ids"] for r in doc["rows"]}
    a, b = ids["g"], ids["h"]
    d = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)  # temperature 1.5 parts from greedy on this seed
    text = lambda i: tok.convert_tokens_to_string([tok.convert_ids_to_tokens(i)])  # noqa: E731
    h = rows["h"]
    assert (h["vs"], h["first_divergence"], h["token_text"], h["vs_token_text"]) == ("g", str(d), text(b[d]), text(a[d]))
    assert (h["after"], h["vs_after"]) == (tok.decode(b[d:]), tok.decode(a[d:]))
    assert rows["same"]["vs"] == "g" and all(rows["same"][k] == "" for k in ("first_divergence", "token_text", "after"))
    assert all(rows["g"][k] == "" for k in ("vs", "first_divergence", "token_text", "vs_token_text", "after", "vs_after"))
    assert list(rows["g"])[-1] == "temperature"  # the settings columns stay last


def test_a_pair_shows_its_differing_tokens_as_text_at_the_divergence_and_after(cli, toy_model_dir):
    """Issue 40: compare said at which step two variants part, not which tokens. Each pair carries the two tokens
    there as text and each output's text from there on, worked here from the rows' own ids and the tokenizer; the
    table shows the texts."""
    import json

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy_model_dir)
    args = ("compare", "Once upon", "-m", toy_model_dir, "-V", "g: temperature=0", "-V", "h: temperature=1.5",
            "--seeds", "3", "-n", "6", "--ignore-eos")
    doc = json.loads(cli(*args, "-f", "json")[1])
    rows = {r["variant"]: r for r in doc["rows"]}
    (pair,) = doc["pairs"]
    d = pair["first_divergence"]
    assert d is not None, "temperature 1.5 must part from greedy within 6 tokens on this seed"
    a, b = rows["g"]["token_ids"], rows["h"]["token_ids"]
    assert a[:d] == b[:d] and a[d] != b[d]
    assert pair["a_token_text"] == tok.convert_tokens_to_string([tok.convert_ids_to_tokens(a[d])])
    assert pair["b_token_text"] == tok.convert_tokens_to_string([tok.convert_ids_to_tokens(b[d])])
    assert pair["a_after"] == tok.decode(a[d:]) and pair["b_after"] == tok.decode(b[d:])
    code, out, err = cli(*args)  # the table: the texts from the divergence on, quoted
    assert code == 0 and repr(pair["a_after"])[:10] in out.replace("\n", "")
