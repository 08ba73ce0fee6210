"""Beam refuses the stages that act only when sampling, read from the registry's ``warper`` flag (never a list kept in
beam): every warper stage of the registry, and a new one registered with no edit to beam."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from decodelab.core.errors import ConfigError
from decodelab.core.methods.beam import BeamSettings, validate_beam
from decodelab.core.sampling import registry
from decodelab.core.sampling.registry import Param, Stage

# a value each warper stage's first field accepts
VALUES = {"temperature": 0.7, "dynatemp": 0.5, "top-n-sigma": 0.5, "top-k": 5, "top-p": 0.9, "min-p": 0.1,
          "typical-p": 0.9, "epsilon-cutoff": 0.2, "eta-cutoff": 0.2, "xtc": 0.5, "mirostat": 5.0}


@pytest.mark.parametrize("option,value", [("epsilon_cutoff", 0.2), ("top_n_sigma", 0.5)])
def test_the_reproduced_cases_are_refused_on_the_command_line(cli, option, value):
    code, out, err = cli("beam", "Once upon", "--set", f"{option}={value}", "--format", "json")
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1].startswith(f"error: --{option.replace('_', '-')} {value}: not used by beam "
                                                   "search")


def test_every_warper_stage_of_the_registry_is_refused():
    warpers = [s for s in registry.STAGES if s.warper]
    assert {s.name for s in warpers} == set(VALUES)  # a new warper: give it a value here
    for stage in warpers:
        field = stage.params[0]
        with pytest.raises(ConfigError) as bad:
            validate_beam(BeamSettings(**{field.field: VALUES[stage.name]}))
        assert str(bad.value).startswith(f"{field.option} {VALUES[stage.name]}: not used by beam search")


def test_a_stage_that_only_samples_is_not_refused_when_it_is_no_warper():
    """The negative control: a penalty (no warper) runs in beam."""
    validate_beam(BeamSettings(repetition_penalty=1.3))
    validate_beam(BeamSettings(frequency_penalty=0.5))


@dataclass(frozen=True)
class WithFakeCut(BeamSettings):
    fake_cut: float | None = None


@dataclass
class FakeCut:
    """The new row's stage: leaves the logits as they are."""

    value: float
    name: str = "fake-cut"

    def __call__(self, ids, logits):
        return logits


@pytest.mark.parametrize("warper", [True, False])
def test_a_new_warper_row_is_refused_with_no_edit_to_beam(monkeypatch, warper):
    fake = Stage("fake-cut", (Param("fake_cut", float, "A new filter."),), warper=warper)
    # the whole row (the list, the index by name, a class): the settings' plan and the chain builder read it too
    fake.cls = FakeCut
    monkeypatch.setattr(registry, "STAGES", registry.STAGES + [fake])
    monkeypatch.setitem(registry.BY_NAME, fake.name, fake)
    if not warper:
        validate_beam(WithFakeCut(fake_cut=0.3))  # no warper: runs
        return
    with pytest.raises(ConfigError, match=r"^--fake-cut 0.3: not used by beam search"):
        validate_beam(WithFakeCut(fake_cut=0.3))
    validate_beam(WithFakeCut())  # unset: nothing to refuse
