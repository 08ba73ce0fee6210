"""A KV policy's optional abilities are declared on the protocol (``KVPolicy``) with what a policy without the
ability does, and read from there: no caller in core/ or cli/ probes a policy for one (``getattr``/``hasattr``), and
none branches on a policy's name where an ability says it."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from conftest import random_model

from decodelab.core.engine.forward import model_info
from decodelab.core.engine.runtime import Runtime
from decodelab.core.kv import POLICIES, KVPolicy, parse_cache_spec, policy_capabilities
from decodelab.core.kv.full import FullPolicy
from decodelab.core.kv.kept import kept_map
from decodelab.core.methods.stream import cache_state

ROOT = Path(__file__).resolve().parents[2]

# every optional ability and what a policy without it answers
ABILITIES = ("check_options", "capabilities_for", "rewrite", "wants_attentions", "observe_attentions",
             "one_token_a_forward", "slot_ranges", "kept_positions", "spec_text", "evicted", "last_evicted")


def test_every_optional_ability_is_declared_with_what_a_policy_without_it_does():
    assert all(name in vars(KVPolicy) for name in ABILITIES)
    model = random_model("llama")
    p = FullPolicy(model_info(model))
    assert not any(name in vars(FullPolicy) for name in ABILITIES)  # full has none of them: the defaults answer
    ids = torch.tensor([[5, 17, 42]])
    assert p.rewrite(ids, "last") is None and p.wants_attentions(3) is False and p.one_token_a_forward() is False
    assert p.observe_attentions(()) is None
    assert p.slot_ranges() == [] and p.kept_positions() is None and p.spec_text() == "full"
    assert (p.evicted, p.last_evicted) == (0, (0, 0))
    values = {"size": 3}
    assert FullPolicy.check_options(values) is values and FullPolicy.capabilities_for({}) == FullPolicy.capabilities
    rt = Runtime(model, p)
    rt.feed(ids)
    assert rt.calls == 1 and p.slot_ranges() == [[0, 3, 0]]  # one forward: no rewrite, no split, no attentions
    assert kept_map(p, 3) is None
    assert cache_state(p) == {"cache_tokens": 3, "kv_bytes": p.nbytes(), "evicted": [], "slots": [[0, 3, 0]]}


def test_a_policy_that_overrides_an_ability_is_asked_through_the_protocol():
    """Each built-in policy that has an ability defines it on its class (or a base), and the callers get its answer:
    recompute's slot map, quant's narrowed capabilities, a press's kept positions and spec text."""
    model = random_model("llama")
    rec = Runtime.create(model, parse_cache_spec("recompute:size=4"))
    rec.feed(torch.arange(9).view(1, -1))
    assert rec.policy.slot_ranges() == [[6, 9, 0]] and rec.policy.rewrite(torch.tensor([[1]]), "last") is not None
    assert policy_capabilities(parse_cache_spec("quant:bits=8,axis=channel")) < POLICIES["quant"].capabilities
    press = Runtime.create(model, parse_cache_spec("snapkv:size=4,window=2"))
    press.feed(torch.arange(9).view(1, -1))
    kept = kept_map(press.policy, 9)
    assert kept is not None and kept.policy == press.policy.spec_text() != "snapkv" and kept.evicted > 0


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            yield node, ast.unparse(node.args[0]), node.args[1].value


def test_no_caller_probes_a_policy_for_an_ability_or_branches_on_its_name():
    declared = {name for name in vars(KVPolicy) if not name.startswith("__")}
    probes, names = [], []
    for path in [*(ROOT / "core").rglob("*.py"), *(ROOT / "cli").rglob("*.py")]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        where = path.relative_to(ROOT)
        probes += [f"{where}:{node.lineno} {node.func.id}({obj}, {attr!r})" for node, obj, attr in _calls(tree)
                   if attr in declared and ("policy" in obj.lower() or obj == "cls")]
        if where.parts[:2] == ("core", "kv"):
            continue
        for node in ast.walk(tree):  # policy.name == "recompute" outside the policies: an ability asked by name
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "name" \
                    and "policy" in ast.unparse(node.left.value).lower():
                names.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    assert not probes, probes
    assert not names, names


def test_the_probe_scan_finds_a_probe():
    """A negative control for the scan above: it finds what it looks for."""
    tree = ast.parse('getattr(self.policy, "rewrite", None)\nhasattr(cls, "check_options")\ngetattr(layer, "keys")')
    assert [(obj, attr) for _, obj, attr in _calls(tree)] == [("self.policy", "rewrite"), ("cls", "check_options"),
                                                                ("layer", "keys")]
