"""`decodelab speculate --predict-only`: acceptance and speedup per gamma predicted with no speculative run."""

from __future__ import annotations

from ..loop import phase
from ..view import output
from ..view.speculation import prediction_views


def predict_only_run(opts, lm, draft_lm, settings, chain, text, prompt_ids, predict_text) -> None:
    """The prediction and its document (built in core: core/methods/speculative/analyses.py) in its format."""
    from ...core.methods.speculative.analyses import predict_only

    report = predict_only(lm, draft_lm, settings, chain, text, prompt_ids, predict_text, guard=phase)
    prediction = report.prediction
    rows = [{k: v for k, v in p.to_dict().items() if k != "per_position_acceptance"} for p in prediction.plans]
    output.emit_for(opts, output.Output(
        document=report.document(), text=report.text, jsonl=[{"type": "prediction", **prediction.to_dict()}],
        tables=[(None, rows)], views=lambda: prediction_views(prediction, [])))
