"""The ``batch`` run around the scheduler (core/methods/batch/run.py): the settings' bounds, the prompts file read
line by line, each request built with its own chain, selector and stop rules, the report's summary worked by hand,
the baselines and the warm-up. Fast unit tests on the bundled tiny model; the command line is in test_batch.py.

Written for the mutation run of core/methods/batch/run.py (2026-12-02, helper mbeam)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from conftest import ROOT

from decodelab.core.errors import ConfigError
from decodelab.core.methods.batch import run as run_module
from decodelab.core.methods.batch.run import (
    Baseline,
    BatchReport,
    BatchRun,
    BatchSettings,
    Entry,
    build_requests,
    read_prompts,
    run_batch,
    static_baseline,
    transformers_baseline,
    validate_batch,
    warm_up,
)
from decodelab.core.methods.batch.scheduler import Iteration, Result
from decodelab.core.methods.sample import validate_sample
from decodelab.core.sampling.chain import make_chain
from decodelab.core.sampling.select import Greedy, Multinomial, make_generator
from decodelab.core.engine.stopping import StopRules, stop_rules

TINY = ROOT / "presets" / "models" / "tiny"
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def lm():
    if not (TINY / "model.safetensors").is_file():
        pytest.skip("the bundled tiny model's weights are not installed")
    from decodelab.core.engine.models import load_model

    return load_model("tiny", device="cpu")


def prompts_file(tmp_path, text: str):
    path = tmp_path / "prompts.txt"
    path.write_text(text, encoding="utf-8")
    return path


def refusal(path, text: str) -> str:
    with pytest.raises(ConfigError) as err:
        read_prompts(prompts_file(path, text), BatchSettings())
    return str(err.value)


# --- the settings ------------------------------------------------------------------------------------------------


def test_batch_settings_bounds_each_edge_allowed_and_past_it_refused():
    """[1, most] for --max-batch (4096), --max-tokens-per-iteration (2^20), --block-size (4096) and --blocks (2^20):
    both edges run, one past either is refused naming the option and the range; --blocks None (the default) is
    allowed; a baseline outside static/transformers is refused, as is a bad sample setting (validate_sample's)."""
    most = {"max_batch": 4096, "max_tokens_per_iteration": 1 << 20, "block_size": 4096, "blocks": 1 << 20}
    validate_batch(BatchSettings(blocks=None, baselines=()))
    validate_batch(BatchSettings(baselines=("static", "transformers")))
    for key, top in most.items():
        option = "--" + key.replace("_", "-")
        for ok in (1, top):
            validate_batch(BatchSettings(**{key: ok}))
        for bad in (0, top + 1):
            with pytest.raises(ConfigError) as err:
                validate_batch(BatchSettings(**{key: bad}))
            assert str(err.value) == f"{option} {bad}: must be an integer in [1, {top}]"
    with pytest.raises(ConfigError) as err:
        validate_batch(BatchSettings(baselines=("static", "vllm")))
    assert str(err.value) == "--baselines 'vllm': allowed: static, transformers, batched (comma-separated), or none"
    with pytest.raises(ConfigError) as err:
        validate_batch(BatchSettings(max_new_tokens=0))
    assert str(err.value) == "--max-new-tokens 0: must be >= 1"


# --- the prompts file ----------------------------------------------------------------------------------------------


def test_plain_prompt_lines_keep_their_text_and_number_from_0(tmp_path):
    """Blank and space-only lines are skipped, the others kept as written (spaces too) with the command's own
    settings; a file where one line is not an object is read as plain lines, JSON text and all."""
    base = BatchSettings(max_new_tokens=3)
    entries = read_prompts(prompts_file(tmp_path, "Once upon a time\n\n   \n the machine \n"), base)
    assert [(e.id, e.prompt) for e in entries] == [("0", "Once upon a time"), ("1", " the machine ")]
    assert all(e.settings is base for e in entries)
    mixed = read_prompts(prompts_file(tmp_path, '{"prompt": "a"}\nb\n'), base)
    assert [(e.id, e.prompt) for e in mixed] == [("0", '{"prompt": "a"}'), ("1", "b")]


def test_jsonl_lines_give_ids_and_per_request_settings(tmp_path):
    """Objects (indented ones too): "id" as given (a number turned into text), else the request's index; every other
    key (dashes or underscores, values as TOML or --set give them) overrides the command's settings for that
    request only."""
    base = BatchSettings(max_new_tokens=9, top_k=5, max_batch=3)
    lines = ['{"prompt": "a", "id": 7, "temperature": 0.5}', "",
             '  {"prompt": "b", "max-new-tokens": "3", "stop": ["x", "yz"]}',
             '{"prompt": "c", "seed": 4, "top_k": 7}']
    entries = read_prompts(prompts_file(tmp_path, "\n".join(lines)), base)
    assert [(e.id, e.prompt) for e in entries] == [("7", "a"), ("1", "b"), ("2", "c")]
    a, b, c = (e.settings for e in entries)
    assert (a.temperature, a.max_new_tokens, a.top_k, a.max_batch) == (0.5, 9, 5, 3)
    assert (b.temperature, b.max_new_tokens, b.stop, b.top_k) == (None, 3, ("x", "yz"), 5)
    assert (c.seed, c.top_k, c.max_new_tokens) == (4, 7, 9)
    assert base.max_new_tokens == 9 and base.top_k == 5


def test_prompts_file_refusals_name_the_file_and_the_line(tmp_path):
    path = tmp_path / "prompts.txt"
    where = f"--prompts-file {path}"
    assert refusal(tmp_path, "") == f"{where}: no prompts in it"
    assert refusal(tmp_path, "\n  \n\n") == f"{where}: no prompts in it"
    needs = 'needs a non-empty "prompt" string'
    # line numbers count the blank lines too
    assert refusal(tmp_path, '{"prompt": "a"}\n\n{"text": "b"}\n') == f"{where} line 3: {needs}"
    assert refusal(tmp_path, '{"prompt": "   "}\n') == f"{where} line 1: {needs}"
    assert refusal(tmp_path, '{"prompt": 5}\n') == f"{where} line 1: {needs}"
    assert refusal(tmp_path, '{"prompt": "a"}\n{"prompt": "b",\n').startswith(f"{where} line 2: not JSON")
    unknown = refusal(tmp_path, '{"prompt": "a"}\n{"prompt": "b", "colour": 1}\n')
    assert unknown.startswith(f"{where} line 2: unknown setting 'colour'; allowed: ")
    assert refusal(tmp_path, '{"prompt": "a", "temperature": "hot"}\n').startswith(f"{where} line 1: --temperature")
    for key in ("cache", "compile", "top"):
        value = {"cache": '"full"', "compile": "false", "top": "3"}[key]
        assert refusal(tmp_path, '{"prompt": "a", "%s": %s}\n' % (key, value)) == (
            f"{where} line 1: {key!r} is not a per-request setting (allowed: the chain's, seed, max_new_tokens, stop, "
            "ignore_eos)")
    # a setting each key allows but the request's whole settings refuse: validate_sample's line after the file's
    with pytest.raises(ConfigError) as own:
        validate_sample(BatchSettings(top_p=2.0))
    assert refusal(tmp_path, '{"prompt": "a"}\n{"prompt": "b", "top_p": 2}\n') == f"{where} line 2: {own.value}"
    # an explicit id equal to another request's index
    assert refusal(tmp_path, '{"prompt": "a"}\n{"prompt": "b", "id": "0"}\n') == \
        f"{where}: request ids must be unique"
    with pytest.raises(ConfigError) as err:
        read_prompts(tmp_path / "missing.txt", BatchSettings())
    assert str(err.value) == f"--prompts-file {tmp_path / 'missing.txt'}: no such file; give a text file"


# --- requests, report, baselines ----------------------------------------------------------------------------------


def test_each_request_gets_its_own_chain_selector_and_stop_rules(lm):
    """Greedy for temperature 0, else a generator seeded by the request's seed (the same draws as a fresh one); the
    prompt encoded by the model's tokenizer; stop rules as the model and settings give them; the chain told where the
    prompt ends (min-new-tokens counts from there); the model's detokenizer and the prompt text."""
    greedy = BatchSettings(temperature=0.0, max_new_tokens=4, min_new_tokens=2)
    sampled = BatchSettings(temperature=0.8, seed=11, max_new_tokens=6, stop=("x",))
    entries = [Entry("g", "Once upon a time", greedy), Entry("s", "The machine", sampled)]
    reqs = build_requests(lm, entries)
    assert [r.id for r in reqs] == ["g", "s"] and [r.prompt for r in reqs] == ["Once upon a time", "The machine"]
    assert [r.prompt_ids for r in reqs] == [lm.encode("Once upon a time"), lm.encode("The machine")]
    assert isinstance(reqs[0].selector, Greedy) and isinstance(reqs[1].selector, Multinomial)
    fresh = make_generator(11, "cpu")
    assert torch.equal(torch.rand(5, generator=reqs[1].selector.generator), torch.rand(5, generator=fresh))
    assert reqs[0].rules == stop_rules(lm, greedy) and reqs[1].rules == stop_rules(lm, sampled)
    assert reqs[1].rules.stop_strings == ("x",) and reqs[0].rules.max_new_tokens == 4
    assert reqs[0].chain.names == make_chain(lm, greedy).names == ["min-new-tokens", "temperature"]
    assert reqs[0].chain.processors[0].prompt_len == len(lm.encode("Once upon a time"))
    assert all(r.detok == lm.decode for r in reqs)
    assert reqs[0].chain is not reqs[1].chain


def _result(rid, prompt_len, new, hits):
    return Result(rid, None, [1] * prompt_len, [], [2] * new, "length", [], hits, prompt_len + new, 0, 0, new - 1)


def _iteration(index, rows, prefill, preempted):
    return Iteration(index, rows, rows, [], [], 0, 1, 0, 0, preempted, rows, prefill, rows - prefill, 0.1)


def test_the_summary_by_hand():
    """Prompts of 4 and 6 tokens (4 found cached), 3 + 2 new tokens in 2 s, three iterations of 2, 2 and 1 rows out
    of 4, 10 prompt tokens computed, one preemption: 2.5 tokens/s, hit rate 0.4, slots 5 / 12. A baseline that ran
    at 1.25 tokens/s is a speedup of 2; one that did not run says why and adds its details under its name."""
    settings = BatchSettings(max_batch=4, block_size=4)
    results = [_result("a", 4, 3, 0), _result("b", 6, 2, 4)]
    iterations = [_iteration(0, 2, 10, []), _iteration(1, 2, 0, ["b"]), _iteration(2, 1, 0, [])]
    baselines = [Baseline("static", 1.25, 4.0, 2),
                 Baseline("transformers", None, None, reason="ValueError: no", details={"hits": 3})]
    report = BatchReport(settings, results, iterations, 2.0, 5, 8, baselines)
    assert report.tokens == 5
    assert report.summary() == {
        "requests": 2, "tokens": 5, "iterations": 3, "seconds": 2.0, "tokens_per_s": 2.5, "prompt_tokens": 10,
        "prefill_tokens_computed": 10, "prefix_hit_tokens": 4, "prefix_hit_rate": 0.4, "preemptions": 1,
        "peak_blocks": 5, "blocks": 8, "block_size": 4, "max_batch": 4, "slot_utilisation": 5 / 12,
        "stop_reason": "end", "warmup_s": 0.0,
        "static_tokens_per_s": 1.25, "speedup_vs_static": 2.0, "static_same_tokens": 2,
        "transformers_tokens_per_s": None, "speedup_vs_transformers": None, "transformers_same_tokens": None,
        "transformers_skipped": "ValueError: no", "transformers_hits": 3}


def test_the_summary_of_an_empty_or_instant_run():
    """No time: no rate and no speedup; no iterations and no prompt tokens: utilisation and hit rate 0."""
    report = BatchReport(BatchSettings(), [_result("a", 3, 2, 0)], [], 0.0, 0, 1, [Baseline("static", 4.0, 1.0, 1)],
                         stop_reason="interrupted")
    s = report.summary()
    assert (s["tokens_per_s"], s["speedup_vs_static"], s["slot_utilisation"], s["stop_reason"]) == \
        (None, None, 0.0, "interrupted")
    assert "static_skipped" not in s
    empty = BatchReport(BatchSettings(), [], [], 1.0, 0, 1).summary()
    assert (empty["prefix_hit_rate"], empty["tokens_per_s"], empty["prompt_tokens"]) == (0.0, 0.0, 0)
    assert "speedup_vs_static" not in empty


def test_run_batch_equals_each_request_alone_and_hands_over_every_iteration(lm):
    """Two greedy requests in one pool of 1-token blocks (the smallest run), the second's tokens what it gets alone;
    every iteration record goes to on_iteration as it ends, in order, and the report holds the same ones; the static
    baseline (its own pool, though --blocks is too small for a whole batch) gives the same tokens."""
    settings = BatchSettings(max_new_tokens=3, max_batch=2, block_size=1, blocks=12, baselines=("static",), **GREEDY)
    entries = [Entry("a", "Once upon a time", settings), Entry("b", "The machine", settings)]
    seen = []
    report = run_batch(lm, settings, entries, on_iteration=seen.append)
    assert seen == report.iterations and [i.index for i in seen] == list(range(len(seen)))
    alone = run_batch(lm, settings, entries[1:])
    assert report.results[1].new_ids == alone.results[0].new_ids and len(alone.results[0].new_ids) == 3
    assert (report.num_blocks, report.stop_reason, report.settings) == (12, "end", settings)
    assert report.peak_blocks == max(i.blocks_used for i in report.iterations) > 0
    assert report.seconds == pytest.approx(sum(i.seconds for i in report.iterations))
    [static] = report.baselines
    assert (static.name, static.same_tokens, static.reason) == ("static", 2, None)
    assert static.tokens_per_s == pytest.approx(6 / static.seconds)
    assert run_batch(lm, settings, entries, on_iteration=None).results[0].new_ids == report.results[0].new_ids


def test_static_baseline_counts_the_requests_whose_tokens_match(lm):
    settings = BatchSettings(max_new_tokens=2, max_batch=2, block_size=4, **GREEDY)
    entries = [Entry("a", "Once upon a time", settings), Entry("b", "The machine", settings)]
    reference = run_batch(lm, replace(settings, baselines=()), entries).results
    reference[0].new_ids = [t + 1 for t in reference[0].new_ids]
    base = static_baseline(lm, settings, entries, reference)
    assert (base.name, base.same_tokens) == ("static", 1)
    assert base.tokens_per_s == pytest.approx(4 / base.seconds) and base.seconds > 0


def test_transformers_baseline_reports_its_figures_or_why_it_did_not_run(lm, monkeypatch):
    """The same work (each prompt and its output length) with the run's batch, token budget and block size; the
    tokens matched per request; an exception of any kind is the baseline's reason (its type and first line)."""
    settings = BatchSettings(max_batch=3, max_tokens_per_iteration=40, block_size=8)
    reference = [_result("a", 4, 3, 0), _result("b", 2, 2, 0), _result("c", 3, 1, 0)]
    calls = []

    def fake(model, work, max_batch, tokens, page):
        calls.append((model, work, max_batch, tokens, page))
        return [[2, 2, 2], [2, 5], [2]], 2.0

    monkeypatch.setattr(run_module, "continuous_batching_generate", fake)
    base = transformers_baseline(lm, settings, reference)
    assert calls == [(lm.model, [([1] * 4, 3), ([1] * 2, 2), ([1] * 3, 1)], 3, 40, 8)]
    assert (base.name, base.tokens_per_s, base.seconds, base.same_tokens, base.reason) == \
        ("transformers", 3.0, 2.0, 2, None)
    for exc, reason in [(ValueError("no paged attention\nsecond line"), "ValueError: no paged attention"),
                        (RuntimeError("  \n"), "RuntimeError: ")]:
        def broken(*args, exc=exc):
            raise exc

        monkeypatch.setattr(run_module, "continuous_batching_generate", broken)
        base = transformers_baseline(lm, settings, reference)
        assert (base.name, base.tokens_per_s, base.seconds, base.same_tokens, base.reason) == \
            ("transformers", None, None, None, reason)


def test_baselines_run_in_the_order_asked(lm, monkeypatch):
    monkeypatch.setattr(run_module, "continuous_batching_generate", lambda *a: (_ for _ in ()).throw(KeyError("x")))
    settings = BatchSettings(max_new_tokens=2, block_size=4, baselines=("transformers", "static"), **GREEDY)
    report = run_batch(lm, settings, [Entry("a", "Once upon a time", settings)])
    assert [b.name for b in report.baselines] == ["transformers", "static"]
    assert report.baselines[0].reason == "KeyError: 'x'" and report.baselines[1].same_tokens == 1


def test_an_interrupted_or_ended_batch_run_says_so(lm):
    settings = BatchSettings(max_new_tokens=5, max_batch=1, block_size=4, baselines=(), **GREEDY)
    entries = [Entry("a", "Once upon a time", settings), Entry("b", "The machine", settings)]
    run = BatchRun(lm, settings, entries)
    assert run.stop_reason == "end" and run.report().stop_reason == "end"
    next(iter(run))
    run.interrupt()
    report = run.report()
    assert report.stop_reason == "interrupted" and run.interrupted
    assert [r.stop_reason for r in report.results] == ["interrupted", "interrupted"]
    ended = BatchRun(lm, settings, entries)
    next(iter(ended))
    ended.end("budget")
    assert ended.report().stop_reason == "budget"
    assert [r.stop_reason for r in ended.report().results] == ["budget", "budget"]


def test_the_warm_up_is_two_untimed_greedy_rows_of_two_tokens(lm, monkeypatch):
    """Prompts of 3 and 4 zeros, 2 tokens each, EOS ignored, no stage, greedy; two rows of the run's block size."""
    built = []

    class Recorder:
        def __init__(self, model, requests, **kwargs):
            built.append((model, requests, kwargs))

        def run(self):
            built.append("ran")

    monkeypatch.setattr(run_module, "Scheduler", Recorder)
    warm_up(lm, BatchSettings(block_size=8))
    (model, requests, kwargs), ran = built
    assert model is lm.model and ran == "ran" and kwargs == {"max_batch": 2, "block_size": 8}
    assert [(r.id, r.prompt_ids) for r in requests] == [("warm0", [0, 0, 0]), ("warm1", [0, 0, 0, 0])]
    assert all(r.rules == StopRules(2, ignore_eos=True) and r.chain.names == [] for r in requests)
    assert all(isinstance(r.selector, Greedy) for r in requests)


def test_a_prompts_file_of_json_lines_reads_like_the_docs_say(tmp_path):
    """The module's own example: one object a line with prompt, id and sample settings."""
    rows = [{"id": "q1", "prompt": "hello", "temperature": 0.7, "top_p": 0.9, "seed": 3, "max_new_tokens": 5,
             "stop": ["."]}]
    [entry] = read_prompts(prompts_file(tmp_path, "\n".join(json.dumps(r) for r in rows)), BatchSettings())
    s = entry.settings
    assert (entry.id, entry.prompt, s.temperature, s.top_p, s.seed, s.max_new_tokens, s.stop) == \
        ("q1", "hello", 0.7, 0.9, 3, 5, (".",))


def test_chat_prompts_go_through_the_template_in_the_run_and_its_static_baseline(lm, monkeypatch):
    """With chat on, every request's prompt is the template's rendering (here a plain "User: ... Assistant:"), in the
    run and in its static baseline: the baseline's tokens match the run's, which differ from the plain prompts'."""
    monkeypatch.setattr(lm.tokenizer, "chat_template",
                        "{% for m in messages %}User: {{ m['content'] }}\nAssistant:{% endfor %}")
    settings = BatchSettings(max_new_tokens=4, max_batch=2, block_size=4, **GREEDY)
    entries = [Entry("a", "Once upon a time", settings), Entry("b", "The machine", settings)]
    templated = [lm.encode(e.prompt, chat=True) for e in entries]
    assert templated[0] == lm.tokenizer("User: Once upon a time\nAssistant:", add_special_tokens=False)["input_ids"]
    assert [r.prompt_ids for r in build_requests(lm, entries, chat=True)] == templated
    chat = run_batch(lm, settings, entries, chat=True)
    assert [r.prompt_ids for r in chat.results] == templated
    plain = run_batch(lm, replace(settings, baselines=()), entries)
    assert all(a.new_ids != b.new_ids for a, b in zip(chat.results, plain.results))
    assert chat.baselines[0].same_tokens == 2


def test_scheduler_for_passes_the_pool_and_batch_settings(lm):
    """Rows, token budget, block size and pool size as set; iteration-level with prefix caching, or static (no token
    budget, no prefix caching)."""
    settings = BatchSettings(max_batch=3, max_tokens_per_iteration=7, block_size=5, blocks=20)
    reqs = build_requests(lm, [Entry("a", "Once upon a time", settings)])
    level = run_module.scheduler_for(lm, settings, reqs, static=False)
    assert (level.max_batch, level.budget, level.policy.block, level.policy.num_blocks) == (3, 7, 5, 20)
    assert (level.static, level.prefix_caching) == (False, True)
    static = run_module.scheduler_for(lm, settings, reqs, static=True)
    assert (static.max_batch, static.budget, static.policy.block, static.policy.num_blocks) == (3, float("inf"), 5, 20)
    assert (static.static, static.prefix_caching) == (True, False)


def test_the_run_is_iteration_level_and_its_static_baseline_static_with_its_own_pool(lm, monkeypatch):
    """The run shares a cached prefix (the same prompt twice: the second request finds the first's full blocks), as
    static batching never does; the static baseline's scheduler is static and sizes its own pool (blocks None), though
    --blocks is set."""
    built = []

    class Recording(run_module.Scheduler):
        def __init__(self, model, requests, **kwargs):
            built.append(kwargs)
            super().__init__(model, requests, **kwargs)

    monkeypatch.setattr(run_module, "Scheduler", Recording)
    settings = BatchSettings(max_new_tokens=2, max_batch=2, block_size=2, blocks=40, **GREEDY)
    entries = [Entry("a", "Once upon a time", settings), Entry("b", "Once upon a time", settings)]
    report = run_batch(lm, settings, entries)
    assert report.summary()["prefix_hit_tokens"] > 0 and report.results[1].prefix_hit_tokens > 0
    warm, run, static = built
    assert (run["static"], run["num_blocks"]) == (False, 40)
    assert (static["static"], static["num_blocks"]) == (True, None)
    assert report.baselines[0].same_tokens == 2
