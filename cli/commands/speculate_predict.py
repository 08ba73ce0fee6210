"""`decodelab speculate --predict-only`: acceptance and speedup per gamma predicted with no speculative run."""

from __future__ import annotations

from ...core.settings import as_dict
from ..loop import phase
from ..view import output, render
from ..view.speculation import prediction_views


def predict_only_run(opts, lm, draft_lm, settings, chain, text, prompt_ids, predict_text) -> None:
    from ...core.methods.speculative.planning import (
        measured_cost_ratio,
        plain_continuation,
        prediction_for,
        text_continuation,
    )

    if predict_text is not None:
        new_ids, source = text_continuation(lm, predict_text), "text"
    else:
        new_ids, source = phase(lambda: plain_continuation(lm, settings, prompt_ids, chain), []), "plain"
    cost = phase(lambda: measured_cost_ratio(lm, draft_lm, settings, prompt_ids, chain))  # None: cut by Ctrl-C
    prediction = prediction_for(lm, draft_lm, settings, prompt_ids, chain, new_ids, source, cost)
    head = render.document("speculate", lm, as_dict(settings), chain.names, text, prompt_ids,
                           draft=settings.draft, gamma=settings.gamma, verification=prediction.verification)
    out_text = lm.decode(new_ids)
    rows = [{k: v for k, v in p.to_dict().items() if k != "per_position_acceptance"} for p in prediction.plans]
    output.emit_for(opts, output.Output(
        document={**head, "text": out_text, "token_ids": new_ids, "prediction": prediction.to_dict()},
        text=out_text, jsonl=[{"type": "prediction", **prediction.to_dict()}],
        tables=[(None, rows)], views=lambda: prediction_views(prediction, [])))
