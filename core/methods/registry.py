"""The method registry: each decoding method by name, with its settings class and the check that runs before any
model loads. Commands and ``compare``'s variants (``method=sample|beam|speculate``) find a method here, and every
method's run keeps one contract (:class:`~decodelab.core.engine.run.Run`: iterate its steps, then ``stop_reason``,
``interrupted``, ``new_ids`` and ``summary()``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..settings import resolve
from .batch.run import BatchSettings, validate_batch
from .beam import BeamSettings, validate_beam
from .probs import ProbsSettings
from .sample import SampleSettings, validate_sample
from .score import ScoreSettings, validate_score
from .speculative.run import SpeculateSettings, validate_speculate
from .stream import StreamSettings, validate_stream


@dataclass(frozen=True)
class Method:
    name: str
    settings: type
    validate: Callable[[object], object]
    continues: bool = False  # it generates a continuation a `compare` variant can set side by side


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("sample", SampleSettings, validate_sample, continues=True),
    Method("probs", ProbsSettings, validate_sample),
    Method("score", ScoreSettings, validate_score),
    Method("beam", BeamSettings, validate_beam, continues=True),
    Method("speculate", SpeculateSettings, validate_speculate, continues=True),
    Method("stream", StreamSettings, validate_stream),
    Method("batch", BatchSettings, validate_batch),
)}
CONTINUING = {name: m for name, m in METHODS.items() if m.continues}


def settings_for(name: str, preset: str | None = None, options: dict | None = None, sets: list[str] | None = None):
    """A method's settings: its defaults, then the preset, then explicit options, then --set; checked before any
    model loads."""
    method = METHODS[name]
    settings = resolve(method.settings, preset, options, sets)
    method.validate(settings)
    return settings
