"""`decodelab speculate`: speculative decoding with a draft model or an n-gram proposer, traced per round."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from .. import options as o
from ..loop import drive, interrupted, phase
from ..view import output, render, speculate_view
from ..view.live import LiveSteps

SPEC = "Speculative decoding"

DraftOpt = Annotated[Optional[str], typer.Option(
    "--draft", help="Proposer: a draft model sharing the target's vocabulary (bundled name or folder), 'ngram' "
    "(prompt lookup), 'suffix' (suffix-trie counts over prompt and output), or a comma-separated chain, e.g. "
    "ngram,tiny-draft: the first that proposes drafts the round (default tiny-draft).", rich_help_panel=SPEC, show_default=False)]
GammaOpt = Annotated[Optional[int], typer.Option("--gamma", "-g", help="Tokens drafted per round, >= 1 "
                                                 "(default 4).", rich_help_panel=SPEC, show_default=False)]
NgramSizeOpt = Annotated[Optional[int], typer.Option("--ngram-size", help="Longest n-gram the 'ngram' proposer "
                                                     "matches, falling back to shorter ones (default 3).",
                                                     rich_help_panel=SPEC, show_default=False)]
SweepOpt = Annotated[Optional[str], typer.Option("--sweep-gamma", help="Also measure these gammas, e.g. "
                                                 "1,2,3,4,6,8, and name the best.", rich_help_panel=SPEC)]
RoundsOpt = Annotated[Optional[int], typer.Option(
    "--speedup-rounds", help="Timing rounds behind the measured speedup: speculative and plain decoding alternate, "
    "each round gives plain / speculative time per token; reported: median, min, max (1..100, default 3; 1 = one "
    "pair).", rich_help_panel=SPEC, show_default=False)]
PredictOpt = Annotated[bool, typer.Option(
    "--predict", help="Also predict acceptance offline: one teacher-forced forward of target and draft over the "
    "run's output gives alpha_i = sum_x min(p_i, q_i) per position, the acceptance by draft depth and the expected "
    "tokens and speedup per gamma, shown beside the measured ones.", rich_help_panel=SPEC)]
PredictOnlyOpt = Annotated[bool, typer.Option(
    "--predict-only", help="Predict without running speculative decoding: over --predict-text, else over a plain "
    "target continuation (same settings and seed); the cost ratio from plain decoding of each model.",
    rich_help_panel=SPEC)]
PredictTextOpt = Annotated[Optional[str], typer.Option(
    "--predict-text", help="With --predict-only: the continuation (after the prompt) to teacher-force instead of a "
    "generated one.", rich_help_panel=SPEC)]
AuditWidthOpt = Annotated[bool, typer.Option(
    "--audit-width", help="Also audit the verify width: the target's logits over the run's output computed with "
    "gamma + 1 rows per forward (as verification does) and one row per forward (plain decoding), per token: drift, "
    "argmax flips, margins.", rich_help_panel=SPEC)]


@o.command(o.PROMPT, o.MODEL, o.SETTINGS, o.GENERATE, ("stop_id",), o.OUTPUT, o.CHAIN, o.SAMPLERS,
           without=("device_map",))
def speculate(
    opts: o.Opts,
    draft: DraftOpt = None,
    gamma: GammaOpt = None,
    ngram_size: NgramSizeOpt = None,
    sweep_gamma: SweepOpt = None,
    speedup_rounds: RoundsOpt = None,
    predict: PredictOpt = False,
    predict_only: PredictOnlyOpt = False,
    predict_text: PredictTextOpt = None,
    audit_width: AuditWidthOpt = False,
) -> None:
    """A proposer drafts tokens, the target verifies a block per forward; shows every accept/reject and the speedup."""
    from ...core.engine.models import load_draft
    from ...core.methods.registry import settings_for
    from ...core.methods.speculative.run import (SpeedupRounds, parse_gammas, speculate_run, warm_up_speculate,
                                                 with_gamma)
    from ...core.methods.speculative.sweep import sweep_gammas
    from ...core.sampling.chain import make_chain
    from ..pipeline import export_instead, load, read_prompt
    explicit = o.explicit(opts, "max_new_tokens", "seed", "top", "ignore_eos", "stop")
    explicit.update(draft=draft, gamma=gamma, ngram_size=ngram_size, sweep_gamma=parse_gammas(sweep_gamma),
                    speedup_rounds=speedup_rounds)
    settings = settings_for("speculate", opts.preset, explicit, opts.set_)
    if opts.export is not None:
        export_instead(opts, settings, load(opts))
        return
    text = read_prompt(opts.prompt, opts.prompt_file)
    lm = load(opts)
    from ...core.methods.speculative.chained import model_member
    model_name = model_member(settings.draft)
    draft_lm = None if model_name is None else load_draft(model_name, lm, opts.dtype, opts.trust_remote_code)
    processors = make_chain(lm, settings)
    prompt_ids = lm.encode(text, opts.chat)
    if predict or predict_only or predict_text is not None:
        from ...core.methods.speculative.planning import require_model_draft
        require_model_draft(draft_lm, settings.draft)
    if predict_only or predict_text is not None:
        from .speculate_predict import predict_only_run
        predict_only_run(opts, lm, draft_lm, settings, processors, text, prompt_ids, predict_text)
        return
    warm: dict[str, float] = {}
    phase(lambda: warm.update(s=warm_up_speculate(lm, draft_lm, settings, prompt_ids, processors)))
    # with --sweep-gamma the sweep runs first, so the run shown (traced) is the gamma the sweep names best
    sweep = sweep_gammas(lm, draft_lm, settings, prompt_ids, processors, phase, interrupted, progress)
    settings = with_gamma(settings, sweep.shown_gamma(settings))
    spec = speculate_run(lm, settings, text, prompt_ids, draft_lm, processors)
    spec.sweep_part = sweep.document_part()
    if interrupted():
        spec.interrupt()  # Ctrl-C before the shown run: an empty run, reported as interrupted
    else:
        with LiveSteps(render.console(), None, unit="rounds", enabled=opts.fmt == o.Format.table) as live:
            drive(spec, opts.fmt, row=lambda rnd: render.clean(rnd.to_dict()), on_step=live.add,
                  text_of=lambda: lm.decode(spec.new_ids), stops=tuple(settings.stop))
    if settings.gamma in sweep.measured:
        spec.timed = sweep.measured[settings.gamma]  # the sweep timed this gamma already, on the same tokens
    else:  # the shown run is round 1's speculative half; a Ctrl-C keeps the rounds completed (none: speedups null)
        progress(f"speculate: timing against plain decoding ({settings.speedup_rounds} rounds)")
        timing = SpeedupRounds(lm, draft_lm, settings, prompt_ids, processors, settings.gamma, first=spec)
        phase(timing.run)
        spec.timed = timing.rounds
    spec.warmup_s = warm.get("s", float("nan"))
    from ...core.methods.speculative.analyses import analyse
    prediction, audit = analyse(spec, lm, draft_lm, processors, predict, audit_width, guard=phase)  # in its document
    emit(opts, lm, spec, sweep, prediction, audit)


def progress(message: str) -> None:
    """A line on stderr for a phase that takes a while (timing rounds, the gamma sweep), on a terminal only."""
    err = render.error_console()
    if err.is_terminal:
        err.print(message, style="dim")


def emit(opts: o.Opts, lm, spec, sweep, prediction=None, audit=None) -> None:
    """The run's document (built in core) in its format."""
    document = spec.document()  # the reasoning split included (docs/reasoning.md)
    delivered = {"text": document["text"], "token_ids": document["token_ids"]}
    output.emit_for(opts, output.Output(
        document=document, text=document["text"],
        jsonl=[{"type": "sweep", **render.clean(row)} for row in document.get("sweep", [])]
        + [output.summary_record("speculate", lm.name, delivered, document["summary"],
                                 {"best_gamma": sweep.best} if sweep.rows else {})],
        tables=[(None, speculate_view.sweep_rows(sweep.rows) if sweep.rows
                 else speculate_view.round_rows(spec.rounds))],
        views=lambda: speculate_view.views(lm.name, spec, document["prompt"]["text"], spec.summary(), sweep)
        + analysis_views(spec.summary(), sweep, prediction, audit)))  # --chat: prompt.chat, as every command


def analysis_views(summary, sweep, prediction, audit) -> list:
    """--predict's and --audit-width's views, after the run's."""
    out = []
    if prediction is not None:
        from .speculate_predict import prediction_views
        out += prediction_views(prediction, [summary, *sweep.rows])
    if audit is not None:
        from ..view.speculation import width_line
        out.append(width_line(audit))
    return out
