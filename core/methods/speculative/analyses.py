"""What ``speculate`` can be asked about a run after it ran, over the run's own output: ``--predict`` (the offline
acceptance prediction beside the measured one, :func:`~.planning.prediction_for`) and ``--audit-width`` (the target's
logits at the verify width against one row per forward, :func:`~.width.audit_width`). Each is part of the run's
document (``prediction``, ``width_audit``), so a script that asks for them reports the run as the command does."""

from __future__ import annotations

from collections.abc import Callable

from .planning import prediction_for
from .predict import Prediction
from .width import WidthAudit, audit_width


def call(fn):
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
