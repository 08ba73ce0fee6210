"""What ``speculate`` can be asked about a run after it ran, over the run's own output: ``--predict`` (the offline
acceptance prediction beside the measured one, :func:`~.planning.prediction_for`) and ``--audit-width`` (the target's
logits at the verify width against one row per forward, :func:`~.width.audit_width`). Each is part of the run's
document (``prediction``, ``width_audit``), so a script that asks for them reports the run as the command does."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...engine.run import Origin
from ...settings import as_dict
from .planning import measured_cost_ratio, plain_continuation, prediction_for, text_continuation
from .predict import Prediction
from .width import WidthAudit, audit_width


def call(fn, default=None):
    return fn()


def analyse(spec, lm, draft, chain, predict: bool = False, width: bool = False,
            guard: Callable = call) -> tuple[Prediction | None, WidthAudit | None]:
    """The analyses asked of the finished run ``spec`` (a :class:`~.run.Speculator` built by ``speculate_run``: its
    settings, prompt, rounds and timing), into its document (``spec.analyses``); returned for the views.
    ``predict``: teacher-forced target (``lm``) and ``draft`` over the new tokens, the cost ratio from the run's
    summary; ``width``: the audit at gamma + 1 rows per forward. ``guard(fn)`` runs each (a caller's interrupt
    handling: None back means interrupted, and that analysis is left out)."""
    settings, prompt_ids = spec.settings, spec.prompt_ids
    prediction = audit = None
    if predict:
        cost_ratio = spec.summary().cost_ratio
        prediction = guard(lambda: prediction_for(lm, draft, settings, prompt_ids, chain, spec.new_ids, "run",
                                                  cost_ratio, spec.rounds))
    if width:
        audit = guard(lambda: audit_width(lm.model, prompt_ids, spec.new_ids, settings.gamma + 1,
                                          settings.cache_spec))
    spec.analyses = {**({"prediction": prediction.to_dict()} if prediction is not None else {}),
                     **({"width_audit": audit.to_dict()} if audit is not None else {})}
    return prediction, audit


@dataclass
class PredictOnly:
    """``speculate --predict-only``: the acceptance and speedup per gamma predicted over a continuation, with no
    speculative run; ``document()`` is the command's JSON document."""

    origin: Origin
    draft: str
    gamma: int
    token_ids: list[int]  # the continuation teacher-forced (given, or a plain target continuation)
    text: str
    prediction: Prediction

    def document(self) -> dict:
        head = self.origin.head(draft=self.draft, gamma=self.gamma, verification=self.prediction.verification)
        return {**head, "text": self.text, "token_ids": self.token_ids, "prediction": self.prediction.to_dict()}


def predict_only(lm, draft, settings, chain, prompt_text: str, prompt_ids: list[int], predict_text: str | None = None,
                 guard: Callable = call) -> PredictOnly:
    """Predict over ``predict_text`` (the continuation after the prompt), else over a plain target continuation
    (same settings and seed); the cost ratio from plain decoding of each model. ``guard(fn, default)`` runs the
    continuation and the timing (a caller's interrupt handling: the default back, an empty continuation or no cost
    ratio, means interrupted)."""
    if predict_text is not None:
        new_ids, source = text_continuation(lm, predict_text), "text"
    else:
        new_ids, source = guard(lambda: plain_continuation(lm, settings, prompt_ids, chain), []), "plain"
    cost = guard(lambda: measured_cost_ratio(lm, draft, settings, prompt_ids, chain))  # None: cut short
    prediction = prediction_for(lm, draft, settings, prompt_ids, chain, new_ids, source, cost)
    origin = Origin.of("speculate", lm, as_dict(settings), chain.names, prompt_text, prompt_ids)
    return PredictOnly(origin, settings.draft, settings.gamma, new_ids, lm.decode(new_ids), prediction)
