"""What a press kept (core/kv/kept.py, cli/view/kept.py): the JSON ids and the table's strips against the policy's
own kept positions, the runtime fed as each command feeds it, and strips worked out by hand."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import random_model

from decodelab.cli.view.kept import cells, kept_rows, mark, strip
from decodelab.core.engine.runtime import Runtime
from decodelab.core.kv import parse_cache_spec
from decodelab.core.kv.kept import kept_map


def fed_runtime(model, spec: str, prompt: list[int], tokens: list[int]) -> Runtime:
    """The prompt in one forward, then each token one a forward: how sample and stream feed a cache (the last
    generated token is never fed)."""
    runtime = Runtime.create(model, parse_cache_spec(spec))
    runtime.feed(torch.tensor([prompt]))
    for t in tokens:
        runtime.feed(torch.tensor([[t]]))
    return runtime


@pytest.mark.parametrize("spec", ["h2o:size=6,recent=2", "snapkv:size=6,window=2", "tova:ratio=0.5",
                                  "pyramidkv:size=6,window=2,beta=2", "knorm:size=5,compress=decode"])
def test_the_kept_map_is_the_policys_kept_positions_and_real_bytes(spec):
    model = random_model("llama", seed=2, num_hidden_layers=3)
    runtime = fed_runtime(model, spec, list(range(3, 15)), [20, 21, 22])
    kept = kept_map(runtime.policy, 12)
    assert [layer.heads for layer in kept.layers] == runtime.policy.kept_positions(0)
    assert [layer.kv_bytes for layer in kept.layers] == runtime.policy.layer_nbytes()
    assert kept.kv_bytes == runtime.policy.nbytes() and kept.seen == 15 and kept.prompt_tokens == 12
    assert [layer.slots for layer in kept.layers] == runtime.policy.slots()
    counts = kept.kept_by()
    for p in range(15):
        assert counts[p] == sum(p in head for layer in runtime.policy.kept_positions(0) for head in layer)
    rows = kept_rows(kept)
    assert [r["positions"] for r in rows] == [" ".join(map(str, h)) for layer in kept.layers for h in layer.heads]


def test_a_policy_that_keeps_by_place_has_no_kept_map():
    model = random_model("llama", seed=2)
    assert kept_map(fed_runtime(model, "window:size=4", [1, 2, 3, 4, 5], []).policy, 5) is None


def test_strips_by_hand():
    # two heads, four prompt tokens: head 0 holds 0, 1, 3; head 1 holds 0, 2, 3
    assert strip([2, 1, 1, 2], heads=2, prompt_tokens=4) == "█▒▒█"
    # eight tokens in four cells of two: cell shares 4/4, 1/4, 0/4, 3/4
    assert cells(8, width=4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert strip([2, 2, 1, 0, 0, 0, 1, 2], heads=2, prompt_tokens=8, width=4) == "█░·▓"
    assert [mark(f) for f in (1.0, 0.7, 0.34, 0.01, 0.0)] == ["█", "▓", "▒", "░", "·"]
    # uneven cells: 10 tokens in 4 cells
    assert cells(10, width=4) == [(0, 2), (2, 5), (5, 7), (7, 10)]


def test_sample_score_and_stream_print_the_kept_map_of_their_runtime(cli, toy_model_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(toy_model_dir)
    code, out, err = cli("sample", "Once upon a time there", "-n", "4", "-t", "0", "--cache", "h2o:size=3",
                         "-m", toy_model_dir, "-f", "json")
    assert code == 0, err
    doc = json.loads(out)
    prompt, new = doc["prompt"]["token_ids"], doc["token_ids"]
    runtime = fed_runtime(model, "h2o:size=3", prompt, new[:-1])
    assert [layer["heads"] for layer in doc["kv_kept"]["layers"]] == runtime.policy.kept_positions(0)
    assert doc["kv_kept"]["kv_bytes"] == runtime.policy.nbytes() and doc["kv_kept"]["prompt_tokens"] == len(prompt)

    code, out, err = cli("score", "Once upon a time there was a", "--cache", "tova:size=3", "--feed", "1",
                         "-m", toy_model_dir, "-f", "json")
    assert code == 0, err
    doc = json.loads(out)
    ids = doc["prompt"]["token_ids"]
    runtime = Runtime.create(model, parse_cache_spec("tova:size=3"))
    for t in ids[:-1]:
        runtime.feed(torch.tensor([[t]]))
    assert [layer["heads"] for layer in doc["kv_kept"]["layers"]] == runtime.policy.kept_positions(0)
    assert doc["kv_kept"]["prompt_tokens"] == len(ids) - 1  # the last token is never fed

    code, out, err = cli("stream", "Once upon a time", "-n", "3", "-t", "0", "--cache", "knorm:size=2,compress=decode",
                         "-m", toy_model_dir)
    assert code == 0, err
    assert "kept by knorm:compress=decode,size=2 after the run" in " ".join(out.split()) and "prompt tokens kept by every" in out


def test_the_kept_table_fits_80_columns(cli):
    code, out, err = cli("stream", "--text-file", "presets/models/validation.txt", "--limit", "120", "--chunk", "60",
                         "--cache", "snapkv:ratio=0.5,window=8", "--prefill", "100")
    assert code == 0, err
    table = [line for line in out.splitlines() if "│" in line and "layer" not in line]
    assert table and max(len(line) for line in table) <= 80


def test_kept_by_counts_only_the_layers_asked_for():
    """kept_by(layers) counts the (layer, head) pairs of those layers only: position 1 is held by both heads of
    layer 0 and by no head of layer 1. Bug caught: the layer selection ignored (every layer counted)."""
    from decodelab.core.kv.kept import KeptLayer, KeptMap

    kept = KeptMap("snapkv:size=2", seen=3, prompt_tokens=3, kv_bytes=0, evicted=0, layers=[
        KeptLayer(0, 2, 0, heads=[[0, 1], [1, 2]]), KeptLayer(1, 2, 0, heads=[[0, 2], [0, 2]])])
    assert kept.kept_by() == [3, 2, 3]
    assert kept.kept_by([0]) == [1, 2, 1]
    assert kept.kept_by([1]) == [2, 0, 2]


def test_the_kept_map_of_a_press_before_its_first_forward_has_empty_layers():
    """An interrupted run can ask for the kept map before the prompt's forward: every layer holds 0 slots and no
    heads. Bug caught: the slot count read from a head that does not exist, or reported as 1."""
    rt = Runtime.create(random_model("llama"), parse_cache_spec("snapkv:size=8,window=2"))
    kept = kept_map(rt.policy, 0)
    assert [(layer.slots, layer.heads) for layer in kept.layers] == [(0, []), (0, [])] and kept.kept_by() == []
