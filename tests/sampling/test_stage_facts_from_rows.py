"""Every stage fact a site needs is read from the registry's rows, never spelled by name at the site: a new row
(registered with monkeypatch, the whole row: the list, the index by name) with the fact set reaches the plan's
penalty counting, the stage a stage takes over, the engine notes, llama.cpp's mirostat-like chain, the constraint's
trace numbers and --choice check, why-this-token's words and the noise verdict's scaling stages, with no other edit.
And the sites that read them spell no stage name."""

from __future__ import annotations

import ast
from dataclasses import dataclass, fields, replace
from pathlib import Path

import pytest
import torch

from decodelab.core.analysis import noise
from decodelab.core.errors import ConfigError
from decodelab.core.methods.choice import check_choice_settings
from decodelab.core.methods.score import ScoreSettings
from decodelab.core.sampling import registry
from decodelab.core.sampling.registry import Param, Stage, constraint_stage, windowed
from decodelab.core.sampling.semantics import LLAMACPP_ORDER, active_stages, own_order, plan
from decodelab.core.sampling.settings import ChainSettings
from decodelab.core.trace.records import StageStat, Step, constraint_summary
from decodelab.core.trace.why import decide

CORE = Path(__file__).resolve().parents[2] / "core"


@dataclass(frozen=True)
class WithFake(ChainSettings):
    fake_cut: float | None = None


def fake_stage(name: str = "fake-cut", **row) -> Stage:
    return Stage(name, (Param("fake_cut", float, "A new stage."),), **row)


@pytest.fixture
def with_row(monkeypatch):
    def add(stage: Stage, instead_of: str | None = None) -> Stage:
        rows = [r for r in registry.STAGES if r.name != instead_of]
        at = next((i for i, r in enumerate(registry.STAGES) if r.name == instead_of), len(rows))
        monkeypatch.setattr(registry, "STAGES", rows[:at] + [stage] + rows[at:])
        if instead_of is not None:
            monkeypatch.delitem(registry.BY_NAME, instead_of)
        monkeypatch.setitem(registry.BY_NAME, stage.name, stage)
        return stage
    return add


# --- penalties on the tokens seen: --penalty-last-n's window, each engine's counting ------------------------------


def test_the_windowed_penalties_are_the_rows(with_row):
    assert windowed() == ("repetition-penalty", "frequency-penalty", "presence-penalty")
    assert plan(ChainSettings(semantics="vllm", temperature=1.0)).counting == {
        "frequency-penalty": ("output", None), "presence-penalty": ("output", None)}
    with_row(fake_stage(engines={"llamacpp": 99, "vllm": 99}))  # the negative control: no penalty
    assert "fake-cut" not in plan(WithFake(penalty_last_n=8, fake_cut=1.0)).counting


def test_a_new_windowed_penalty_is_counted_by_every_plan(with_row):
    with_row(fake_stage(engines={"llamacpp": 99, "vllm": 99}, windowed=True, counts={"vllm": "output"}))
    assert plan(WithFake(penalty_last_n=8, fake_cut=1.0)).counting["fake-cut"] == ("all", 8)
    assert plan(WithFake(semantics="vllm", temperature=1.0, fake_cut=1.0)).counting["fake-cut"] == ("output", None)
    llamacpp = plan(WithFake(semantics="llamacpp", fake_cut=1.0))
    assert llamacpp.counting["fake-cut"] == ("all", 64)
    assert "penalties count prompt and output, the last 64 tokens" in llamacpp.notes
    # llama.cpp's window 0 switches every penalty off, the new one too
    assert plan(WithFake(semantics="llamacpp", fake_cut=1.0, penalty_last_n=0)).settings.fake_cut is None


# --- a stage that takes another over ------------------------------------------------------------------------------


def test_a_stage_that_takes_another_over_is_the_rows(with_row):
    assert active_stages(ChainSettings(temperature=0.7, dynatemp_range=0.5)) == ["dynatemp"]
    assert active_stages(WithFake(top_k=5, fake_cut=1.0)) == ["top-k"]  # before the row: no such stage
    with_row(fake_stage(replaces="top-k"))
    assert active_stages(WithFake(top_k=5, fake_cut=1.0)) == ["fake-cut"]
    assert active_stages(WithFake(top_k=5)) == ["top-k"]  # the stage taken over runs when the other is off
    # a stage taken over is still named as set where a greedy engine drops it
    greedy = plan(WithFake(semantics="hf", temperature=0.0, top_k=5, fake_cut=1.0))
    assert "top-k" in greedy.notes[0] and greedy.settings.top_k is None


# --- what an engine does differently with a stage: its row's notes -------------------------------------------------


def test_an_engine_note_of_a_new_row_reaches_the_plan(with_row):
    with_row(fake_stage(engines={"llamacpp": 99}, notes={"llamacpp": "fake-cut: llama.cpp's own way",
                                                         "hf": "fake-cut: transformers places it elsewhere"}))
    assert "fake-cut: llama.cpp's own way" in plan(WithFake(semantics="llamacpp", fake_cut=1.0)).notes
    assert "fake-cut: llama.cpp's own way" not in plan(WithFake(semantics="llamacpp")).notes  # off: no note
    hf = plan(WithFake(semantics="hf", temperature=0.7, fake_cut=1.0)).notes
    assert "fake-cut: transformers places it elsewhere" in hf
    assert not any("has no" in n for n in hf)  # its note says how transformers takes it: not listed as lacking
    vllm = plan(WithFake(semantics="vllm", temperature=0.7, fake_cut=1.0)).notes
    assert "vLLM has no fake-cut: kept at decodelab's position" in vllm  # no note for vLLM: lacking


# --- a stage with which an engine keeps only a few others (llama.cpp's mirostat) ----------------------------------


def test_a_stage_that_runs_alone_with_a_few_is_the_rows(with_row):
    assert "mirostat" not in LLAMACPP_ORDER
    with_row(fake_stage(engines={"llamacpp": 99}, alone={"llamacpp": ("bias",)}))
    assert "fake-cut" not in own_order("llamacpp")
    p = plan(WithFake(semantics="llamacpp", top_k=5, fake_cut=1.0, logit_bias=(("3", 1.0),)))
    assert p.order == ["bias", "fake-cut"]
    assert any(n.endswith("ignored by llama.cpp when fake-cut is on (its chain is logit bias, temperature, "
                          "fake-cut)") and "top-k" in n for n in p.notes)
    assert "top-k" in plan(WithFake(semantics="llamacpp", top_k=5)).order  # off: the whole chain


# --- the constraint: its trace numbers and --choice's check follow its row's name ---------------------------------


def renamed_constraint(with_row) -> str:
    row = replace(registry.BY_NAME["constraint"], name="fake-grammar")
    with_row(row, instead_of="constraint")
    return row.name


def step(state: dict, stages: list) -> Step:
    return Step(0, 3, 7, "x", 0.5, -0.7, 0.5, -0.7, 1, 0.1, 0.1, 2, stages=stages, state=state)


def test_the_constraint_summary_reads_the_stage_the_row_names(with_row):
    numbers = {"allowed": 2.0, "forced": 0.0, "top1_banned": 1.0, "whitespace_only": 0.0, "log_mass_kept": -0.5}
    before = constraint_summary([step({f"constraint.{k}": v for k, v in numbers.items()},
                                      [StageStat("constraint", 2, 0.1, 0.4)])])
    assert (before.steps, before.top1_banned_steps, before.hardest[0].mass_removed) == (1, 1, 0.4)
    name = renamed_constraint(with_row)
    assert constraint_stage() == name
    after = constraint_summary([step({f"{name}.{k}": v for k, v in numbers.items()}, [StageStat(name, 2, 0.1, 0.4)])])
    assert after == before
    assert constraint_summary([step({f"constraint.{k}": v for k, v in numbers.items()}, [])]) is None


def test_choice_allows_the_constraint_the_row_names_and_nothing_else(with_row):
    check_choice_settings(ScoreSettings(choice="a,b"))
    renamed_constraint(with_row)
    check_choice_settings(ScoreSettings(choice="a,b"))  # the renamed constraint is the --choice stage itself
    with pytest.raises(ConfigError, match="drop the top-k stage"):
        check_choice_settings(ScoreSettings(choice="a,b", top_k=5))


# --- why this token: a stage that adds a bias brings a token in ---------------------------------------------------


def test_why_says_a_bias_row_brought_the_token_in(with_row):
    names = ["raw", "fake-cut"]
    assert decide(names, 2, [1, 2], [3], [False], True).why == "fake-cut lifted it from rank 3"  # no row
    with_row(Stage("fake-cut", (Param("fake_pairs", str, "TEXT=BIAS.", pairs=True),)))
    assert decide(names, 2, [1, 2], [3], [False], True).why == "fake-cut brought it in from rank 3"
    assert decide(["raw", "bias"], 2, [1, 2], [3], [False], True).why == "bias brought it in from rank 3"
    assert decide(["raw", "top-k"], 2, [1, 2], [3], [False], True).why == "top-k lifted it from rank 3"


# --- the noise verdict leaves out the stages that divide every logit alike -----------------------------------------


@dataclass
class Tripling:
    """Every logit times 3: the margin triples, unless the verdict leaves the stage out."""

    name: str = "fake-cut"

    def __call__(self, ids, logits):
        return logits * 3


class OneStage:
    processors = [Tripling()]

    def reset(self, prompt_len):
        pass


@pytest.fixture(scope="module")
def tiny():
    from decodelab.core.engine.models import load_model

    return load_model("tiny", device="cpu", dtype="float32")


@pytest.mark.parametrize("scales", [True, False])
def test_the_noise_verdict_leaves_out_the_rows_that_scale(with_row, tiny, scales):
    lm = tiny
    ids = lm.encode("Once upon a time there was")
    prompt, generated = ids[:3], ids[3:]
    plain = noise.noise_verdict(lm, prompt, generated, 1, ids[0])
    with_row(fake_stage(scales=scales))
    got = noise.noise_verdict(lm, prompt, generated, 1, ids[0], OneStage())
    expected = plain.margin if scales else 3 * plain.margin
    assert got.margin == pytest.approx(expected, rel=1e-5)
    assert torch.isfinite(torch.tensor(got.margin))


# --- check-sampler's truncation defects: the filters are the rows' ------------------------------------------------


@pytest.mark.parametrize("row, filters", [(dict(warper=True), True), (dict(warper=True, scales=True), False),
                                          (dict(warper=True, needs=frozenset({"state"})), False), (dict(), False)])
def test_a_new_filter_row_takes_part_in_the_truncation_defects(with_row, row, filters):
    from decodelab.core.analysis.sampler_check import truncation_filters

    assert set(truncation_filters()) == {"top-n-sigma", "top-k", "top-p", "min-p", "typical-p", "epsilon-cutoff",
                                         "eta-cutoff"}
    with_row(fake_stage(**row))
    assert ("fake-cut" in truncation_filters()) == filters


# --- the sites spell no stage name ----------------------------------------------------------------------------------

# where a stage's name may be spelled: the registry, and each stage's class (its ``name`` and ``@implements``);
# besides them, what is spelled on purpose (every other file of core/ and cli/ asks the registry's rows). A stage
# name that is also a settings field ("temperature", "allow", "ban", "softcap") is the field and is not looked for.
DECLARING = {"core/sampling/registry.py", "core/sampling/biases.py", "core/sampling/constraint.py",
             "core/sampling/filters.py", "core/sampling/llamacpp.py", "core/sampling/penalties.py",
             "core/sampling/scaling.py", "core/sampling/thinking.py"}
SPELLED = {
    "core/engine/http/llamacpp.py": {"mirostat"},  # the /completion field of llama.cpp's mirostat mode (0: off)
    "cli/options.py": {"constraint"},  # the --help panel's key
    "cli/view/constraint.py": {"constraint"},  # the summary's attribute
}
ROOT = CORE.parent


def spelled_names(path: Path) -> set[str]:
    names = {s.name for s in registry.STAGES} - {f.name for f in fields(ChainSettings)}
    return {n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant) and n.value in names}


def test_core_and_cli_spell_no_stage_name_but_where_the_registry_is_declared():
    found = {}
    for folder in ("core", "cli"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in DECLARING:
                continue
            extra = spelled_names(path) - SPELLED.get(rel, set())
            if extra:
                found[rel] = sorted(extra)
    assert found == {}, f"stage names spelled outside the registry: {found}; ask the registry's rows"
    assert spelled_names(CORE / "sampling/semantics.py") == set()  # the plan: every fact from the rows
