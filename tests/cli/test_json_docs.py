"""The JSON reference (docs/json.md) against real output, both ways: every field a command prints is documented
there, and every documented field (not marked `?`) is printed."""

from __future__ import annotations

import json
import re

import pytest
from conftest import ROOT

JSON_DOCS = ROOT / "docs" / "json.md"


def documented() -> dict[str, dict[tuple[str, str], bool]]:
    """command -> {(object path, field): required}, from docs/json.md: the rows before the first `## `command``
    heading are the shared top level, added to every command but models."""
    text = JSON_DOCS.read_text(encoding="utf-8")
    tables: dict[str, dict] = {}
    current = "shared"
    for line in text.splitlines():
        heading = re.match(r"## `([\w-]+)`", line)
        if heading:
            current = heading.group(1)
            continue
        row = re.match(r"\| ([\w\[\].]+) \| `([\w*]+)(\??)` \|", line)
        if row:
            tables.setdefault(current, {})[(row.group(1), row.group(2))] = not row.group(3)
    shared = tables.pop("shared")
    return {cmd: ({**shared, **rows} if cmd != "models" else rows) for cmd, rows in tables.items()}


def fields(obj, path: str = "top", wild: frozenset = frozenset()) -> set[tuple[str, str]]:
    """(object path, key) for every key of every object in the document; lists of objects as `name[]`."""
    out = set()
    if path in wild:
        return out
    for key, value in obj.items():
        out.add((path, key))
        child = key if path == "top" else f"{path}.{key}"
        if isinstance(value, dict):
            out |= fields(value, child, wild)
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for item in value:
                out |= fields(item, child + "[]", wild)
    return out


RUNS = {
    "sample": [["sample", "Once upon", "-n", "4", "-t", "0.7", "--top-p", "0.9", "--top", "3"],
               ["sample", "Once upon", "-n", "3", "-t", "0.9", "-N", "3"],
               ["sample", "Once upon", "-n", "4", "-t", "0.9", "--regex", "[a-z ]+"],  # summary.constraint
               ["sample", "Once upon a time", "-n", "3", "--cache", "h2o:size=3"],  # kv_kept
               ["sample", "Q?<think>", "-n", "8", "-t", "0", "--think-tags", "<think>,</think>",
                "--thinking-budget", "1"],  # reasoning
               ["sample", "Once upon", "-n", "30", "-t", "0", "--regex", "(a b )+", "--repetition-stop",
                "max_pattern_size=4,min_count=3"]],  # loop
    "probs": [["probs", "Once upon", "-t", "0.7", "--top-k", "5"]],
    "beam": [["beam", "Once upon", "-n", "3", "-b", "2", "--sweep-length-penalty", "0,1"],
             ["beam", "Q?<think>", "-n", "8", "-b", "2", "--think-tags", "<think>,</think>"]],  # reasoning
    "speculate": [["speculate", "Once upon", "-n", "8", "-t", "0", "--draft", "ngram", "--sweep-gamma", "1,2"],
                  ["speculate", "Once upon", "-n", "8", "-t", "0", "--draft", "{model}"],  # all accepted: bonus
                  ["speculate", "Once upon", "-n", "8", "-t", "0.9", "--draft", "tiny-draft"],  # rejections
                  ["speculate", "Once upon", "-n", "6", "-t", "0.9", "--draft", "{model}", "--predict",
                   "--speedup-rounds", "1", "--audit-width"],  # prediction, width audit
                  ["speculate", "Q?<think>", "-n", "8", "-t", "0", "--draft", "ngram", "--think-tags",
                   "<think>,</think>", "--thinking-budget", "2"]],  # reasoning
    "score": [["score", "Once upon a time there was", "--against-cache", "full", "--chunk", "2"],
              ["score", "Once upon a time"], ["score", "Answer yes or no:", "--choice", " yes, no"],
              ["score", "Once upon a time there was", "--cache", "tova:size=3", "--feed", "1"],  # kv_kept
              ["score", "Answer yes or no:", "--choice", " yes, no", "--think-tags", "<think>,</think>",
               "--empty-think"],  # summary.thinking
              ["score", "Q?<think>hmm</think> yes", "--think-tags", "<think>,</think>"]],  # reasoning
    "compare": [["compare", "Once upon", "-V", "g: temperature=0", "-V", "h: temperature=0.9,top_k=5",
                 "-V", "b: method=beam,beams=2", "-n", "3"],
                ["compare", "Q?<think>", "--think-tags", "<think>,</think>", "-V", "a: temperature=0,thinking_budget=1",
                 "-V", "b: temperature=0", "-n", "7"]],  # reasoning
    "bench": [["bench", "--settings", "greedy", "-n", "2", "--rounds", "1"]],
    "stream": [["stream", "Once upon", "-n", "4", "--cache", "sinks:sinks=1,recent=2", "--top", "2", "-t", "0.7"],
               ["stream", "Q?<think>", "-n", "6", "--think-tags", "<think>,</think>"],  # reasoning
               ["stream", "--text-file", "{text}", "--limit", "40", "--chunk", "16", "--cache", "window:size=8"],
               ["stream", "--text-file", "{text}", "--limit", "40", "--compare-policies", "--window", "8", "--sinks",
                "2", "--chunk", "16"],
               ["stream", "Once upon a time there was a", "--attention", "--sinks", "1"],
               ["stream", "Once upon", "-n", "3", "--cache", "knorm:size=2,compress=decode"],  # kv_kept
               ["stream", "--text-file", "{text}", "--limit", "16", "--probe", "--probe-depths", "0.5", "--cache",
                "h2o:size=8"],
               ["stream", "--text-file", "{text}", "--limit", "16", "--compare-policies", "--policies",
                "h2o:size=8,snapkv:ratio=0.5,window=4", "--prefill", "8", "--probe", "--probe-depths", "0.5",
                "--chunk", "8"]],
    "check-sampler": [["check-sampler", "Once upon", "-t", "0.8", "--top-k", "5", "-N", "12", "--prefixes", "2"]],
    "audit-numerics": [["audit-numerics", "Once upon", "--greedy", "2", "--conditions", "dtype:bf16,decode,attn:flash"]],
    "models": [["models"]],
    "quantize-kv": [["quantize-kv", "Once upon a time there was", "--limit", "6", "--activations", "0", "--grid"],
                    ["quantize-kv", "Once upon a time there was", "--limit", "6", "--cache", "tova:size=3",
                     "--policies", "int8,h2o:size=3", "--probe"]],
}
TEXT = ROOT / "presets" / "models" / "validation.txt"


@pytest.mark.parametrize("command", list(RUNS))
def test_json_docs_document_every_json_field_both_ways(cli, toy_model_dir, command):
    docs = documented()
    assert command in docs, f"docs/json.md has no table for {command}"
    table = docs[command]
    wild = frozenset(p for p, f in table if f == "*")  # objects whose keys vary: not descended into
    printed = set()
    for args in RUNS[command]:
        args = [a.replace("{model}", str(toy_model_dir)).replace("{text}", str(TEXT)) for a in args]
        extra = [] if command == "models" else ["-m", toy_model_dir]
        code, out, err = cli(*args, *extra, "-f", "json")
        assert code == 0, err
        printed |= fields(json.loads(out), wild=wild)
    listed = {(p, f) for p, f in table if f != "*"}
    undocumented = printed - listed - {(p, f) for p, f in printed if p in wild}
    assert not undocumented, f"{command} prints fields docs/json.md does not list: {sorted(undocumented)}"
    missing = {(p, f) for (p, f), required in table.items() if required and f != "*"} - printed
    assert not missing, f"docs/json.md lists {command} fields it does not print: {sorted(missing)}"
