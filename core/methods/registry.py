"""The method registry: each decoding method by name, with its settings class, the check that runs before any model
loads, how its run is built and what that run delivered. Commands and ``compare``'s variants
(``method=sample|beam|speculate``) find a method here, and every method's run keeps one contract
(:class:`~decodelab.core.engine.run.Run`: iterate its steps, then ``stop_reason``, ``new_ids``, ``text()``,
``summary()`` and ``document()``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..engine.run import Run
from ..errors import EMPTY_CHAIN
from ..settings import resolve
from ..trace.records import Step
from .batch.run import BatchSettings, batch_run, validate_batch
from .beam import BeamSearch, BeamSettings, beam_run, validate_beam
from .probs import ProbsSettings, probs_run
from .sample import Sampler, SampleSettings, sample_run, validate_sample
from .score import ScoreSettings, score_run, validate_score
from .speculative.run import SpeculateSettings, Speculator, speculate_run, validate_speculate
from .stream import StreamSettings, stream_run, validate_stream


@dataclass(frozen=True)
class Outcome:
    """What a finished run delivered, as ``compare`` sets it beside other runs."""

    token_ids: list[int]  # the continuation (beam: the best hypothesis)
    stop_reason: str
    tokens_per_s: float  # generated tokens / the run's time, prefill included
    steps: list[Step] | None = None  # its traced steps (the processed numbers it drew with); None: not traced
    text: str | None = None  # the text it delivers (trimmed where its settings say); None: the ids decoded


@dataclass(frozen=True)
class Method:
    """A decoding method: its settings class and their check; ``build(lm, settings, ...) -> Run`` (a continuing
    method's takes ``(lm, settings, prompt_text, prompt_ids, summary_only=False)``, and ``draft=`` when its settings
    name a draft); ``report(run) -> Outcome``."""

    name: str
    settings: type
    validate: Callable[[object], object]
    build: Callable[..., Run]
    report: Callable[[Run], Outcome]
    continues: bool = False  # it generates a continuation a `compare` variant can set side by side


def delivered(run: Run) -> Outcome:
    """Any run: its new ids and stop reason, the summary's rate when it has one."""
    summary = run.summary()
    return Outcome(list(run.new_ids), run.stop_reason, getattr(summary, "tokens_per_s", float("nan")))


def sampled(run: Sampler) -> Outcome:
    """A sampling run: every traced step, the block pending at an early end included."""
    return Outcome(list(run.new_ids), run.stop_reason, run.summary().tokens_per_s, run.steps,
                   run.delivered(run.detok)[1])


def searched(run: BeamSearch) -> Outcome:
    """A beam search: the best hypothesis (none: the ids so far, ended by an empty chain), timed per token."""
    best = run.best()
    if run.stop_reason == EMPTY_CHAIN or best is None:
        ids, reason = run.new_ids, EMPTY_CHAIN
    else:
        ids, reason = best.token_ids, best.reason
    return Outcome(ids, reason, run.watch.timing.tokens_per_s(len(ids)))


def speculated(run: Speculator) -> Outcome:
    ids = list(run.new_ids)
    return Outcome(ids, run.stop_reason, run.watch.timing.tokens_per_s(len(ids)), None, run.delivered(run.detok)[1])


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("sample", SampleSettings, validate_sample, sample_run, sampled, continues=True),
    Method("probs", ProbsSettings, validate_sample, probs_run, delivered),
    Method("score", ScoreSettings, validate_score, score_run, delivered),
    Method("beam", BeamSettings, validate_beam, beam_run, searched, continues=True),
    Method("speculate", SpeculateSettings, validate_speculate, speculate_run, speculated, continues=True),
    Method("stream", StreamSettings, validate_stream, stream_run, delivered),
    Method("batch", BatchSettings, validate_batch, batch_run, delivered),
)}
CONTINUING = {name: m for name, m in METHODS.items() if m.continues}


def settings_for(name: str, preset: str | None = None, options: dict | None = None, sets: list[str] | None = None):
    """A method's settings: its defaults, then the preset, then explicit options, then --set; checked before any
    model loads."""
    method = METHODS[name]
    settings = resolve(method.settings, preset, options, sets)
    method.validate(settings)
    return settings
