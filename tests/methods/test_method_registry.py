"""The method registry (core/methods/registry.py) and the run contract it builds (core/engine/run.py): every
registered method builds a run that keeps the declared :class:`Run` protocol (new_ids, text(), summary(),
document()) and reports an :class:`Outcome`; the JSON document a command prints is the run's own, built in core."""

from __future__ import annotations

import json

import pytest

from decodelab.core.engine.run import Origin, Run, drain
from decodelab.core.errors import ConfigError
from decodelab.core.methods import registry
from decodelab.core.methods.batch.run import Entry
from decodelab.cli.view.render import clean
from conftest import ROOT
from fake_server import fake_vllm  # noqa: F401 (the fixture)

TINY = ROOT / "presets" / "models" / "tiny"
PROMPT = "Once upon a time"
SHARED = ["command", "model", "device", "dtype", "config", "chain", "prompt"]  # docs/CLI.md, JSON shape


@pytest.fixture(scope="module")
def lm():
    if not (TINY / "model.safetensors").is_file():
        pytest.skip("the bundled tiny model's weights are not installed")
    from decodelab.core.engine.models import load_model

    return load_model("tiny", device="cpu")


def build(lm, name: str):
    """Each method's run on the prompt, as its command builds it (batch: two requests of the prompt file kind)."""
    method = registry.METHODS[name]
    settings = registry.settings_for(name, options={"max_new_tokens": 3, "ignore_eos": True} if name not in (
        "score", "probs") else {}, sets=["draft=ngram"] if name == "speculate" else None)
    if name == "batch":
        return method.build(lm, settings, [Entry("a", PROMPT, settings), Entry("b", "The cat", settings)])
    return method.build(lm, settings, PROMPT, lm.encode(PROMPT))


def test_each_method_is_registered_with_its_settings_and_whether_it_continues():
    from decodelab.core.methods import registry
    assert list(registry.METHODS) == ["sample", "probs", "score", "beam", "speculate", "stream", "batch"]
    assert list(registry.CONTINUING) == ["sample", "beam", "speculate"]
    assert registry.METHODS["probs"].validate is registry.METHODS["sample"].validate
    s = registry.settings_for("sample", options={"temperature": 0.5}, sets=["top_k=7"])
    assert type(s) is registry.METHODS["sample"].settings and s.temperature == 0.5 and s.top_k == 7
    with pytest.raises(ConfigError):
        registry.settings_for("beam", options={"beams": 0})
    # the preset, then explicit options over it
    assert registry.settings_for("sample", preset="greedy").temperature == 0.0
    assert registry.settings_for("sample", preset="greedy", options={"temperature": 0.3}).temperature == 0.3


@pytest.mark.parametrize("name", list(registry.METHODS))
def test_every_registered_method_builds_a_run_that_keeps_the_declared_contract(lm, name):
    run = build(lm, name)
    assert isinstance(run, Run)  # the protocol's members are all there
    for member in ("new_ids", "summary", "document"):  # each the method's own, not the protocol's declaration
        assert getattr(type(run), member) is not getattr(Run, member), f"{name}: {member} is not its own"
    steps = drain(run)
    assert steps and run.stop_reason in ("length", "end")
    document = run.document()
    assert document["command"] == name and list(document)[:5] == SHARED[:5]
    if name != "batch":  # batch serves many prompts: its requests carry them
        assert list(document)[:7] == SHARED and document["prompt"] == {"text": PROMPT, "token_ids": lm.encode(PROMPT)}
    assert isinstance(run.text(), str) and run.summary() is not None
    assert document.get("text", run.text()) == run.text()
    outcome = method_report(name, run)
    assert isinstance(outcome, registry.Outcome) and outcome.token_ids == list(document.get("token_ids", []))


def method_report(name, run):
    return registry.METHODS[name].report(run)


def test_a_run_without_its_own_document_says_so_and_a_stranger_is_no_run():
    class Bare(Run):
        def __iter__(self):
            yield from ()

        @property
        def new_ids(self):
            return [1]

        def summary(self):
            return {}

    with pytest.raises(NotImplementedError, match="Bare has no document"):
        Bare().document()
    assert Bare().text() == ""  # no decode: no text
    stranger = type("Stranger", (), {"__iter__": lambda self: iter(()), "new_ids": []})()
    assert not isinstance(stranger, Run)


def test_the_document_head_is_the_shared_top_level_in_its_order():
    class Model:
        name, device, dtype = "m", "cpu", "torch.bfloat16"

    origin = Origin.of("sample", Model(), {"a": 1}, ["top-k"], "hi", [5, 6])
    assert origin.head(selector="greedy") == {
        "command": "sample", "model": "m", "device": "cpu", "dtype": "bfloat16", "config": {"a": 1},
        "chain": ["top-k"], "prompt": {"text": "hi", "token_ids": [5, 6]}, "selector": "greedy"}


def test_each_continuing_method_reports_what_compare_sets_side_by_side(lm):
    """sample: its traced steps; beam: the best hypothesis; speculate: its ids (both scored teacher-forced by
    compare, steps None)."""
    for name in registry.CONTINUING:
        run = build(lm, name)
        drain(run)
        out = registry.METHODS[name].report(run)
        assert (out.steps is not None) == (name == "sample")
        assert len(out.token_ids) == 3 and out.stop_reason == "length" and out.tokens_per_s > 0
        if name == "beam":
            assert out.token_ids == run.hypotheses[0].token_ids
        if name == "sample":
            assert [s.token_id for s in out.steps] == out.token_ids


TIMING = {"tokens_per_s", "decode_tokens_per_s", "prefill_s", "seconds", "loop_s", "trace_s", "warmup_s", "compile_s"}


def without_timing(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k not in TIMING}


@pytest.mark.parametrize("args, name, options", [
    (["sample", PROMPT, "-n", "4", "-t", "0.8", "--top-k", "20", "--seed", "3"], "sample",
     {"max_new_tokens": 4, "temperature": 0.8, "top_k": 20, "seed": 3}),
    (["beam", PROMPT, "-n", "3", "-b", "2"], "beam", {"max_new_tokens": 3, "beams": 2}),
    (["score", PROMPT], "score", {}),
    (["probs", PROMPT, "--top-k", "5"], "probs", {"top_k": 5}),
])
def test_the_json_a_command_prints_is_its_runs_document_built_in_core(cli, lm, args, name, options):
    code, out, err = cli(*args, "-f", "json", "--threads", "1")
    assert code == 0, err
    printed = json.loads(out)
    method = registry.METHODS[name]
    run = method.build(lm, registry.settings_for(name, options=options), PROMPT, lm.encode(PROMPT))
    drain(run)
    made = clean(run.document())
    printed.pop("machine", None)  # the CLI's note on an oversubscribed machine (cli/machine.py), not the run's
    for document in (printed, made):
        document.pop("format_version", None), document.pop("versions", None)
        if isinstance(document.get("summary"), dict):
            document["summary"] = without_timing(document["summary"])
    assert list(printed) == list(made) and printed == made


THINK = "Q?<think>"
TAGS = "<think>,</think>"


def comparable(document: dict, drop: tuple[str, ...] = ()) -> dict:
    """A document as -f json prints it, its timings, versions and the CLI's machine note aside."""
    document = clean(document)
    for key in ("format_version", "versions", "machine", *drop):
        document.pop(key, None)
    if isinstance(document.get("summary"), dict):
        document["summary"] = without_timing(document["summary"])
    for step in document.get("steps") or []:  # speculate's rounds time their draft and target forwards
        for key in [k for k in step if isinstance(step, dict) and k.endswith("_ms")]:
            step.pop(key)
    return document


@pytest.mark.parametrize("args, name, options", [
    (["sample", THINK, "-n", "8", "-t", "0", "--think-tags", TAGS, "--thinking-budget", "1"], "sample",
     {"max_new_tokens": 8, "temperature": 0.0, "think_tags": TAGS, "thinking_budget": 1}),
    (["score", THINK + "hmm</think> yes", "--think-tags", TAGS], "score", {"think_tags": TAGS}),
    (["beam", THINK, "-n", "8", "-b", "2", "--think-tags", TAGS], "beam",
     {"max_new_tokens": 8, "beams": 2, "think_tags": TAGS}),
    (["stream", THINK, "-n", "6", "--think-tags", TAGS], "stream", {"max_new_tokens": 6, "think_tags": TAGS}),
    (["speculate", THINK, "-n", "8", "-t", "0", "--draft", "ngram", "--think-tags", TAGS, "--thinking-budget", "2",
      "--speedup-rounds", "1"], "speculate",
     {"max_new_tokens": 8, "temperature": 0.0, "draft": "ngram", "think_tags": TAGS, "thinking_budget": 2,
      "speedup_rounds": 1}),
])
def test_the_reasoning_split_is_part_of_the_runs_document_built_in_core(cli, lm, args, name, options):
    """With thinking markers the split (core/trace/reasoning.py) is the run's: a script's document has it too."""
    code, out, err = cli(*args, "-f", "json", "--threads", "1")
    assert code == 0, err
    printed = json.loads(out)
    text = args[1]
    run = registry.METHODS[name].build(lm, registry.settings_for(name, options=options), text, lm.encode(text))
    drain(run)
    drop = ("summary",) if name == "speculate" else ()  # its summary holds the CLI's timing rounds
    made, printed = comparable(run.document(), drop), comparable(printed, drop)
    assert made["reasoning"]["tags"] == ["<think>", "</think>"] and made["reasoning"]["parts"]
    assert list(printed) == list(made) and printed == made


def test_check_logprobs_report_has_the_split_built_in_core(cli, lm, tmp_path):
    from decodelab.core.analysis.check_logprobs import check, read_answers

    code, out, err = cli("sample", THINK, "--think-tags", TAGS, "--thinking-budget", "2", "-t", "0", "-n", "9",
                         "--threads", "1", "-f", "openai")
    assert code == 0, err
    answer = tmp_path / "answer.jsonl"
    answer.write_text(json.dumps({"request": {"prompt": THINK, "temperature": 0}, "response": json.loads(out)}))
    code, out, err = cli("check-logprobs", str(answer), "--think-tags", TAGS, "--threads", "1", "-f", "json")
    assert code == 0, err
    settings = registry.settings_for("sample", options={"think_tags": TAGS})
    report = check(lm, read_answers(answer, lm, {}), 1e-3, markers_from=settings)
    made = comparable(report.document(lm, {"file": str(answer)}))
    assert made["reasoning"][0]["parts"] and comparable(json.loads(out)) == made


def test_speculates_predict_and_width_audit_are_part_of_the_runs_document_built_in_core(cli, lm):
    """--predict and --audit-width (core/methods/speculative/analyses.py): asked of a run built in core, its
    document carries them as the command's JSON does (the prediction's plans and policies aside: they read the
    timing rounds' cost ratio, which only the command measures)."""
    from decodelab.core.engine.models import load_model
    from decodelab.core.methods.speculative.analyses import analyse

    code, out, err = cli("speculate", "Once upon", "-n", "6", "-t", "0", "--draft", "tiny-draft", "--predict",
                         "--audit-width", "--speedup-rounds", "1", "-f", "json", "--threads", "1")
    assert code == 0, err
    printed = json.loads(out)
    draft = load_model("tiny-draft", device="cpu")
    settings = registry.settings_for("speculate", options={"max_new_tokens": 6, "temperature": 0.0,
                                                           "draft": "tiny-draft", "speedup_rounds": 1})
    run = registry.METHODS["speculate"].build(lm, settings, "Once upon", lm.encode("Once upon"), draft=draft)
    drain(run)
    prediction, audit = analyse(run, lm, draft, run.chain, predict=True, width=True)
    made = clean(run.document())
    assert made["token_ids"] == printed["token_ids"] and made["width_audit"] == printed["width_audit"] == clean(
        audit.to_dict())
    timed = ("plans", "policies", "policies_gamma", "cost_ratio")
    assert {k: v for k, v in made["prediction"].items() if k not in timed} == {
        k: v for k, v in printed["prediction"].items() if k not in timed} and made["prediction"]["alpha"]
    assert made["prediction"] == clean(prediction.to_dict())
    run.analyses = {}
    analyse(run, lm, draft, run.chain)  # nothing asked: nothing in the document
    assert "prediction" not in run.document() and "width_audit" not in run.document()


@pytest.mark.parametrize("given", [None, " there was a dog"])
def test_speculate_predict_only_is_a_report_built_in_core(cli, lm, given):
    """--predict-only (core/methods/speculative/analyses.py predict_only): the document a script gets is the
    command's, but for what reads the measured cost ratio (timing)."""
    from decodelab.core.engine.models import load_model
    from decodelab.core.methods.speculative.analyses import predict_only
    from decodelab.core.sampling.chain import make_chain

    extra = ["--predict-text", given] if given is not None else []
    code, out, err = cli("speculate", "Once upon", "-n", "6", "-t", "0", "--draft", "tiny-draft", "--predict-only",
                         *extra, "-f", "json", "--threads", "1")
    assert code == 0, err
    settings = registry.settings_for("speculate", options={"max_new_tokens": 6, "temperature": 0.0,
                                                           "draft": "tiny-draft"})
    draft = load_model("tiny-draft", device="cpu")
    report = predict_only(lm, draft, settings, make_chain(lm, settings), "Once upon", lm.encode("Once upon"), given)
    timed = ("plans", "policies", "policies_gamma", "cost_ratio")
    made, printed = comparable(report.document()), comparable(json.loads(out))
    for document in (made, printed):
        document["prediction"] = {k: v for k, v in document["prediction"].items() if k not in timed}
    assert made["prediction"]["source"] == ("text" if given else "plain") and made["token_ids"]
    assert list(printed) == list(made) and printed == made


def test_a_repetition_stops_loop_is_part_of_the_runs_document_built_in_core(cli, lm):
    """The loop that stopped a run and who kept it (core/analysis/loops.py explain), as the command prints it."""
    from decodelab.core.analysis.loops import explain

    args = ["Once upon", "--regex", "(a b )+", "--repetition-stop", "max_pattern_size=4,min_count=3", "-t", "0",
            "-n", "40"]
    code, out, err = cli("sample", *args, "-f", "json", "--threads", "1")
    assert code == 0, err
    settings = registry.settings_for("sample", options={"regex": "(a b )+", "temperature": 0.0, "max_new_tokens": 40,
                                                        "repetition_stop": "max_pattern_size=4,min_count=3"})
    run = registry.METHODS["sample"].build(lm, settings, "Once upon", lm.encode("Once upon"))
    drain(run)
    assert "loop" not in run.document()  # not asked for
    part = explain(run, lm)
    made, printed = comparable(run.document()), comparable(json.loads(out))
    assert part["loop"]["count"] >= 3 and made["loop"] == clean(part["loop"])
    assert list(printed) == list(made) and printed == made


def test_score_choice_after_an_empty_think_block_is_the_document_built_in_core(cli, lm):
    """score --choice --empty-think: what closed the block is in the report's summary (core/methods/choice.py)."""
    from decodelab.core.engine.run import Origin
    from decodelab.core.methods.choice import score_choices
    from decodelab.core.methods.choice_thinking import empty_block
    from decodelab.core.sampling.chain import make_chain
    from decodelab.core.settings import as_dict

    text = "Answer yes or no:"
    code, out, err = cli("score", text, "--choice", " yes, no", "--think-tags", TAGS, "--empty-think", "-f", "json",
                         "--threads", "1")
    assert code == 0, err
    settings = registry.settings_for("score", options={"choice": " yes, no", "think_tags": TAGS})
    chain = make_chain(lm, settings)
    body, ids, thinking = empty_block(lm, settings, text, lm.encode(text))
    report = score_choices(lm, settings, body, ids, chain, settings.cache_spec, thinking)
    made = comparable(report.document(Origin.of("score", lm, as_dict(settings), chain.names, body, ids)))
    printed = comparable(json.loads(out))
    assert made["summary"]["thinking"]["appended"] and list(printed) == list(made) and printed == made


def test_check_sampler_and_audit_numerics_documents_are_built_in_core(cli, lm):
    """The two checks' reports (core/analysis/sampler_check.py, numerics.py) give the documents they print."""
    from decodelab.core.analysis.numerics import audit, greedy_text, parse_condition
    from decodelab.core.analysis.sampler_check import check_sampler

    code, out, err = cli("check-sampler", "Once upon", "-t", "0.8", "--top-k", "5", "-N", "12", "--prefixes", "2",
                         "-f", "json", "--threads", "1")
    assert code in (0, 1), err  # 1: the draws failed the test (12 draws are few)
    settings = registry.settings_for("sample", options={"temperature": 0.8, "top_k": 5})
    ids = lm.encode("Once upon")
    made = comparable(check_sampler(lm, settings, ids, 2, 12, 0.01).document(lm, settings, "Once upon", ids))
    assert made["source"] == {"embedded": True} and comparable(json.loads(out)) == made
    code, out, err = cli("audit-numerics", "Once upon", "--greedy", "2", "--conditions", "dtype:bf16,decode",
                         "-f", "json", "--threads", "1")
    assert code == 0, err
    chosen = [parse_condition(c) for c in ("dtype:bf16", "decode")]
    result = audit(lm, greedy_text(lm.model, ids, 2), chosen)
    made = comparable(result.document(lm, chosen, 2, "bf16", "Once upon", ids))
    assert made["config"]["engine_dtype"] is None and comparable(json.loads(out)) == made


def parting(monkeypatch):
    """Greedy samples and a batch's static baseline made to part (as tests/analysis/test_noise_verdicts.py does), so
    that the noise verdicts have something to say."""
    from decodelab.core.methods import many
    from decodelab.core.methods.batch import run as batch_run

    real_many, real_static = many.sample_many, batch_run.static_baseline

    def parted(*args, **kwargs):
        rows, spread = real_many(*args, **kwargs)
        rows[-1].token_ids = rows[-1].token_ids[:2] + [rows[-1].token_ids[2] + 1] + rows[-1].token_ids[3:]
        return rows, spread

    def parted_static(*args, **kwargs):
        base = real_static(*args, **kwargs)
        base.outputs[1] = base.outputs[1][:3] + [base.outputs[1][3] + 1] + base.outputs[1][4:]
        return base

    monkeypatch.setattr(many, "sample_many", parted)
    monkeypatch.setattr(batch_run, "static_baseline", parted_static)


def test_sample_n_and_its_noise_verdicts_are_the_document_built_in_core(cli, lm, monkeypatch):
    """sample -N's report (core/analysis/agreement.py): the samples, their spread and, where greedy samples part,
    the noise verdicts, as the command prints them."""
    from decodelab.core.analysis.agreement import sample_many_report

    parting(monkeypatch)
    code, out, err = cli("sample", PROMPT, "-t", "0", "-N", "3", "-n", "6", "--ignore-eos", "-f", "json",
                         "--threads", "1")
    assert code == 0, err
    settings = registry.settings_for("sample", options={"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True})
    report = sample_many_report(lm, settings, PROMPT, lm.encode(PROMPT), 3)
    made, printed = comparable(report.document()), comparable(json.loads(out))
    assert [v["against"] for v in made["noise"]] == ["sample 2"] and list(printed) == list(made) and printed == made


def test_batchs_noise_verdicts_are_part_of_the_runs_document_built_in_core(cli, lm, monkeypatch, tmp_path):
    """batch: where a greedy request's baseline parts from it, the verdict is the run's (analysis/agreement.py)."""
    from decodelab.core.analysis.agreement import baseline_noise
    from decodelab.core.methods.batch.run import read_prompts

    parting(monkeypatch)
    path = tmp_path / "p.txt"
    path.write_text("Once upon a time\nThe little dog\n")
    code, out, err = cli("batch", "--prompts-file", path, "-t", "0", "-n", "5", "--ignore-eos", "--baselines",
                         "static", "-f", "json", "--threads", "1")
    assert code == 0, err
    settings = registry.settings_for("batch", options={"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True,
                                                       "baselines": ("static",)})
    run = registry.METHODS["batch"].build(lm, settings, read_prompts(path, settings))
    drain(run)
    run.run_baselines(run.report())
    assert "noise" not in run.document()
    verdicts = baseline_noise(run)
    made, printed = clean(run.document()), json.loads(out)
    assert [v["request"] for v in verdicts] == ["1"] and made["noise"] == printed["noise"] == clean(verdicts)
    assert list(made) == [k for k in printed if k not in ("format_version", "versions", "machine")]


def test_the_readmes_python_example_runs_as_written(lm, capsys):
    """README.md's Python block (the registry from a script) runs and prints the run's text and chain."""
    import re

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), flags=re.S)
    example = next(b for b in blocks if "METHODS" in b)
    exec(compile(example, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "['temperature']" in printed and len(printed.splitlines()) >= 1


# --- on a served engine: the document is the run's too (core/methods/served.py, core/analysis/engine_compare.py) ---


def served_run(kind: str, url: str, lm, prompts=None):
    """The run ``kind`` of tests/engine/engine_cases.py, built and driven in core against the server at ``url``."""
    from engine_cases import TEXT

    from decodelab.core.analysis.compare import Prompt, parse_variant
    from decodelab.core.analysis.engine_compare import EngineComparison
    from decodelab.core.engine.models import load_tokenizer
    from decodelab.core.methods import served

    if kind == "compare":
        variants = [parse_variant("g: temperature=0", 0), parse_variant("t: temperature=0.8,top_k=20", 1)]
        run = EngineComparison(lm, None, variants, [Prompt("1", PROMPT)], [0], {"max_new_tokens": 6,
                                                                                 "ignore_eos": True})
        run.conn = served.connect(url, lm, {"generate": "compare --engine", "replay": "compare --engine"})
        return run.run()
    if kind == "batch":
        from decodelab.core.methods.batch.run import read_prompts

        from dataclasses import replace

        settings = replace(registry.settings_for("batch", options={"max_new_tokens": 6, "temperature": 0.0,
                                                                   "ignore_eos": True}), baselines=())  # "none"
        run = registry.METHODS["batch"].build(lm, settings, read_prompts(prompts, settings))
        run.conn = served.connect(url, lm, {"generate": "batch --engine"})
        drain(run)
        served.batch_on_engine(run)
        return run
    local = load_tokenizer("tiny")
    if kind == "score":
        settings = registry.settings_for("score")
        ids = local.encode(TEXT)
        conn = served.connect(url, local, served.score_needs(settings, []))
        run = served.ServedScore(conn, ids, settings.top, settings.chunk, settings=settings, text=TEXT)
    else:
        settings = registry.settings_for("sample", options={"max_new_tokens": 6, "temperature": 0.7, "top_k": 5,
                                                            "seed": 3, "ignore_eos": True})
        conn = served.connect(url, local, served.sample_needs(settings))
        request, notes = served.request_for(conn, settings, settings.top)
        run = served.ServedSample(conn, local.encode(PROMPT), request, notes, settings=settings, prompt_text=PROMPT)
    drain(run)
    return run


# batch --engine's timings, and the server-wide prefix-cache counters read before and after (/metrics: the fake server
# answers the recorded readings in order, so a second client of the same server reads other ones)
SERVED = {"engine_tokens_per_s", "speedup_vs_engine", "engine_prefix_hit_tokens", "engine_prefix_query_tokens",
          "engine_prefix_hit_rate"}


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
@pytest.mark.parametrize("case, kind", [("sample_t07_k5", "sample"), ("score", "score"), ("compare", "compare"),
                                        ("batch", "batch")])
def test_the_json_an_engine_command_prints_is_its_runs_document_built_in_core(cli, lm, fake_vllm, tmp_path, mode,
                                                                               case, kind):
    from engine_cases import args_for

    server = fake_vllm(mode)
    code, out, err = cli(*args_for(case, server.url, tmp_path), "--threads", "1")
    assert code == 0, err
    printed = json.loads(out)
    made = clean(served_run(kind, server.url, lm, tmp_path / "prompts.txt").document())
    printed.pop("machine", None)
    for document in (printed, made):
        document.pop("format_version", None), document.pop("versions", None)
        for part in [document] + [row for key in ("rows", "engine_pairs", "requests", "engine_requests",
                                                  "iterations") for row in document.get(key, [])]:
            if isinstance(part.get("summary"), dict):
                part["summary"] = {k: v for k, v in without_timing(part["summary"]).items() if k not in SERVED}
            for key in TIMING & set(part):
                part.pop(key)
    assert list(printed) == list(made) and printed == made
