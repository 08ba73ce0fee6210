"""The constraint options on the command line: derived from the registry onto every command that runs a chain, one
line naming the option (exit 2) before the model loads, each engine's reading under --semantics and --export, and
the commands' JSON under a constraint."""

from __future__ import annotations

import json

import pytest

from decodelab.core.sampling.export import export
from decodelab.core.sampling.registry import BY_NAME, DEFAULT_ORDER
from decodelab.core.sampling.semantics import active_stages, plan
from decodelab.core.sampling.settings import ChainSettings

from test_bad_input import one_line_error

OPTIONS = ("--regex", "--json-schema", "--grammar", "--choice")
COMMANDS = ("sample", "probs", "beam", "speculate", "score", "compare", "batch", "stream")


def test_the_registry_entry():
    stage = BY_NAME["constraint"]
    assert DEFAULT_ORDER[:2] == ("allow", "constraint")  # first after allow, as vLLM's bitmask
    assert [p.option for p in stage.params] == list(OPTIONS)
    assert {"tokenizer", "end_ids", "prompt_len", "ids"} <= stage.needs and "state" not in stage.needs
    assert stage.engines["vllm"] < BY_NAME["allow"].engines["vllm"]  # vLLM: the bitmask before allowed_token_ids
    assert stage.engines["llamacpp"] < BY_NAME["bias"].engines["llamacpp"]
    assert "hf" not in stage.engines
    for field in ("regex", "json_schema", "grammar", "choice"):  # any of the four switches it on
        assert "constraint" in active_stages(ChainSettings(**{field: "x"}))


@pytest.mark.parametrize("command", COMMANDS)
def test_every_chain_command_takes_the_constraint_options(cli, command):
    code, out, _ = cli(command, "--help")
    assert code == 0
    for option in OPTIONS:
        assert option in out, (command, option)


@pytest.mark.parametrize("command", ["sample", "probs", "beam", "speculate", "score", "stream"])
@pytest.mark.parametrize("args, needle", [
    (["--regex", "(a"], "--regex '(a': invalid regex"),
    (["--regex", "a", "--choice", "b,c"], "--regex and --choice: one constraint per run"),
    (["--regex", r"[^\s\S]"], "matches no text"),
    (["--regex", ""], "matches only the empty text"),
    (["--json-schema", "/nonexistent/s.json"], "--json-schema /nonexistent/s.json: no such file"),
    (["--choice", "a,,b"], "--choice 'a,,b': a label is empty"),
    (["--set", "choice=a,a"], "the label 'a' is given twice"),
])
def test_bad_constraints_fail_before_the_model_loads(cli, command, args, needle):
    err = one_line_error(cli, command, "Hi", "-m", "/nonexistent/model", *args)
    assert needle in err


def test_bad_grammar_and_schema_files(cli, tmp_path):
    grammar = tmp_path / "g.lark"
    grammar.write_text("start: foo\n", encoding="utf-8")
    assert f"--grammar {grammar}: at 1(8): unknown name" in one_line_error(
        cli, "sample", "Hi", "-m", "/nonexistent/model", "--grammar", grammar)
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "integer", "minimum": 5, "maximum": 3}', encoding="utf-8")
    assert "Unsatisfiable schema" in one_line_error(cli, "sample", "Hi", "-m", "/nonexistent/model",
                                                    "--json-schema", schema)
    schema.write_text('{"type": ', encoding="utf-8")
    assert "not valid JSON" in one_line_error(cli, "beam", "Hi", "-m", "/nonexistent/model", "--json-schema", schema)


def test_a_batch_request_with_a_bad_constraint_names_its_line(cli, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b", "regex": "(a"}\n', encoding="utf-8")
    err = one_line_error(cli, "batch", "--prompts-file", prompts, "-m", "/nonexistent/model")
    assert "line 2" in err and "--regex '(a'" in err


def test_a_distribution_by_hand_has_no_tokenizer_for_a_constraint(cli):
    assert "--regex 'a': needs a model's tokenizer" in one_line_error(cli, "probs", "--dist", "0.5,0.5",
                                                                      "--regex", "a")


def test_each_engine_reads_the_constraint():
    s = ChainSettings(regex="[a-z]+", temperature=0.7, top_k=5)
    notes = {engine: " ".join(plan(ChainSettings(**{**s.__dict__, "semantics": engine})).notes)
             for engine in ("hf", "vllm", "llamacpp")}
    assert "transformers has no grammar stage" in notes["hf"]
    assert "bitmask" in notes["vllm"] and "mixture" in notes["llamacpp"]
    for engine in ("hf", "vllm", "llamacpp"):
        assert plan(ChainSettings(**{**s.__dict__, "semantics": engine})).order[0] == "constraint"
    mirostat = plan(ChainSettings(regex="a+", mirostat_tau=5.0, semantics="llamacpp"))
    assert mirostat.order[0] == "constraint"  # llama.cpp's grammar is not part of the chain mirostat replaces


def test_export_writes_the_constraint_where_the_engine_has_one(tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "integer"}', encoding="utf-8")
    gbnf, lark = tmp_path / "g.gbnf", tmp_path / "g.lark"
    gbnf.write_text('root ::= "a"+\n', encoding="utf-8")
    lark.write_text('start: "a"+\n', encoding="utf-8")
    vllm = export(ChainSettings(choice='yes,no "x"'), "vllm", 10)
    assert vllm.arguments["structured_outputs"] == {"choice": ["yes", 'no "x"']}
    assert export(ChainSettings(json_schema=str(schema)), "vllm", 10).arguments["structured_outputs"] == {
        "json": {"type": "integer"}}
    assert export(ChainSettings(regex="a+"), "vllm", 10).arguments["structured_outputs"] == {"regex": "a+"}
    choice = export(ChainSettings(choice='yes,no "x"'), "llamacpp", 10).arguments
    assert choice[-2:] == ["--grammar", 'root ::= "yes" | "no \\"x\\""']
    assert export(ChainSettings(grammar=str(gbnf)), "llamacpp", 10).arguments[-2:] == ["--grammar-file", str(gbnf)]
    assert any("a Lark grammar" in u for u in export(ChainSettings(grammar=str(lark)), "llamacpp", 10).unsupported)
    assert any("a regex" in u for u in export(ChainSettings(regex="a+"), "llamacpp", 10).unsupported)
    assert any(u.startswith("constraint:") for u in export(ChainSettings(regex="a+"), "hf", 10).unsupported)


def run_json(cli, *args) -> dict:
    code, out, err = cli(*args, "-f", "json")
    assert code == 0, err
    return json.loads(out)


def test_commands_run_under_a_constraint(cli, toy_model_dir):
    """Each method's output under the constraint: only allowed text, the stage named in the chain."""
    m = ["-m", toy_model_dir]
    doc = run_json(cli, "sample", "Hi", "-n", "5", "-t", "1.5", "--regex", "[0-9]+", *m)
    assert doc["chain"][0] == "constraint" and doc["text"].strip("<|endoftext|>").isdigit()
    assert {"constraint.allowed", "constraint.log_mass_kept"} <= set(doc["steps"][0]["state"])
    assert doc["summary"]["constraint"]["steps"] == len(doc["steps"])
    many = run_json(cli, "sample", "Hi", "-n", "4", "-t", "1.5", "-N", "4", "--regex", "[0-9]+", *m)  # batched rows
    assert all(s["text"].replace("<|endoftext|>", "").isdigit() for s in many["samples"])
    beam = run_json(cli, "beam", "Hi", "-n", "4", "-b", "2", "--choice", "yes,no", *m)
    assert all(h["text"].replace("<|endoftext|>", "") in ("yes", "no", "y", "n", "ye", "")
               for h in beam["hypotheses"])
    spec = run_json(cli, "speculate", "Hi", "-n", "5", "-t", "0", "--draft", "ngram", "--regex", "[0-9]+",
                    "--speedup-rounds", "1", *m)
    assert spec["text"].replace("<|endoftext|>", "").isdigit()
    probs = run_json(cli, "probs", "Hi", "--choice", "yes,no", *m)
    assert [s["name"] for s in probs["stages"]] == ["raw", "constraint"]
    assert {t["token"] for t in probs["stages"][1]["top"]} <= {"y", "ye", "yes", "n", "no"}
