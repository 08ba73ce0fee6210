"""The thinking and loop options through the CLI on the bundled tiny model: bad input is one line and exit 2; a
thinking run's JSON carries the split and the forced markers; a looping run stops with reason repetition and says
who kept the loop (docs/reasoning.md)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.parametrize("args,message", [
    (["--think-tags", "<think>", "--thinking-budget", "3"], "--think-tags '<think>': give two different"),
    (["--thinking-budget", "-1"], "--thinking-budget -1: must be an integer >= 0"),
    (["--thinking-budget", "3"], "--thinking-budget 3: needs thinking markers"),
    (["--repetition-stop", "max_pattern_size=2"], "--repetition-stop 'max_pattern_size=2': needs both"),
    (["--constraint-after-think", "--think-tags", "<think>,</think>"], "--constraint-after-think: give a constraint"),
    (["--regex", "a+", "--constraint-after-think"], "--constraint-after-think: needs thinking markers"),
])
def test_bad_thinking_options_are_one_line_and_exit_2(cli, args, message):
    code, out, err = cli("sample", "Q", "-n", "2", "--threads", "1", *args)
    assert code == 2 and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_score_empty_think_without_choice_is_refused(cli):
    code, _, err = cli("score", "Q: yes", "--empty-think", "--threads", "1")
    assert code == 2 and "--empty-think: applies to --choice" in err


def test_a_thinking_run_reports_its_split_and_the_budgets_forced_tokens(cli):
    code, out, err = cli("sample", "Q: yes or no?<think>", "--think-tags", "<think>,</think>", "--thinking-budget",
                         "3", "--choice", " yes, no", "--constraint-after-think", "-t", "0", "-n", "14", "-f", "json",
                         "--threads", "1")
    assert code == 0, err
    doc = json.loads(out)
    parts = doc["reasoning"]["parts"]
    n_end = parts.count("marker")
    assert parts[:3] == ["reasoning"] * 3 and parts[3:3 + n_end] == ["marker"] * n_end
    forced = [s["state"]["thinking-budget.forced"] for s in doc["steps"]]
    assert forced[3:3 + n_end] == [1.0] * n_end and sum(forced) == n_end
    active = [s["state"]["constraint.active"] for s in doc["steps"]]
    assert active == [0.0] * (3 + n_end) + [1.0] * (len(active) - 3 - n_end)
    assert doc["text"].split("</think>", 1)[1].replace("<|endoftext|>", "") in (" yes", " no")


def test_a_forced_loop_stops_with_reason_repetition_and_names_its_keeper(cli):
    args = ["sample", "Once upon", "--regex", "(a b )+", "--repetition-stop", "max_pattern_size=4,min_count=3",
            "-t", "0", "-n", "40", "--threads", "1"]
    code, out, err = cli(*args, "-f", "json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["summary"]["stop_reason"] == "repetition" and len(doc["token_ids"]) < 40
    loop = doc["loop"]
    assert doc["token_ids"][-loop["period"]:] == loop["pattern"] and loop["count"] >= 3
    assert sum(loop["kept_by"].values()) == len(loop["positions"]) and "constraint" in loop["kept_by"]
    code, out, err = cli(*args)
    assert code == 0 and "loop: period" in out and "kept by" in out


def test_the_markers_come_from_a_chat_template_that_writes_think(cli, tmp_path):
    """A model folder whose chat template opens a think block: --thinking-budget needs no --think-tags (and is not
    refused before the model loads, when the template is not read yet)."""
    import shutil

    from conftest import ROOT

    folder = tmp_path / "thinker"
    shutil.copytree(ROOT / "presets" / "models" / "tiny", folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{{ m['content'].split('</think>')[-1] }}{% endfor %}"
                               "{% if add_generation_prompt %}<think>{% endif %}")  # as R1-style templates write
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    code, out, err = cli("sample", "Q: yes or no?", "--chat", "-m", str(folder), "--thinking-budget", "2", "-t", "0",
                         "-n", "10", "-f", "json", "--threads", "1")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["reasoning"]["tags"] == ["<think>", "</think>"]
    assert doc["reasoning"]["parts"][:2] == ["reasoning", "reasoning"]
    assert "</think>" in doc["text"]


def test_check_logprobs_splits_each_answer_and_averages_the_engines_numbers(cli, tmp_path):
    code, out, err = cli("sample", "Q?<think>", "--think-tags", "<think>,</think>", "--thinking-budget", "2", "-t",
                         "0", "-n", "9", "--threads", "1", "-f", "openai")
    assert code == 0, err
    response = json.loads(out)
    answer = tmp_path / "answer.jsonl"
    answer.write_text(json.dumps({"request": {"prompt": "Q?<think>", "temperature": 0}, "response": response}) + "\n")
    code, out, err = cli("check-logprobs", str(answer), "--think-tags", "<think>,</think>", "--threads", "1", "-f",
                         "json")
    assert code == 0, err
    split = json.loads(out)["reasoning"][0]
    values = response["choices"][0]["logprobs"]["token_logprobs"]
    parts = split["parts"]
    assert parts[:2] == ["reasoning"] * 2 and split["answer_starts_at"] == parts.count("marker") + 2
    for part in ("reasoning", "marker", "answer"):
        mine = [v for v, p in zip(values, parts) if p == part]
        assert split["summary"][part]["tokens"] == len(mine)
        assert split["summary"][part]["mean_logprob"] == pytest.approx(sum(mine) / len(mine), rel=1e-9)
