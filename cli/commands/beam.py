"""`decodelab beam`: beam search with length normalization, a tree of the search, and where the winner flips."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from .. import options as o
from ..loop import drive, phase
from ..view import beam_view, output, render
from ..view.live import LiveSteps

BEAM = "Beam search"

Beams = Annotated[Optional[int], typer.Option("--beams", "-b", help="Live beams per step, >= 1 (default 4).",
                                              rich_help_panel=BEAM, show_default=False)]
Return = Annotated[Optional[int], typer.Option("--return", help="Hypotheses returned, best first, 1..beams "
                                               "(default: all beams).", rich_help_panel=BEAM, show_default=False)]
LengthPenalty = Annotated[Optional[float], typer.Option(
    "--length-penalty", help="a in score = sum_logprob / norm(L): > 0 favours longer hypotheses, < 0 shorter, 0 is "
    "the raw sum (default 1.0).", rich_help_panel=BEAM, show_default=False)]
LengthNorm = Annotated[Optional[str], typer.Option(
    "--length-norm", help="norm(L), L = generated tokens incl. EOS, P = prompt tokens, a = --length-penalty: "
    "hf = L ** a (transformers); gnmt = ((5 + L) / 6) ** a; prompt-inclusive = (P + L) ** a (vLLM); "
    "none = 1 (raw sum) (default hf).", rich_help_panel=BEAM, show_default=False)]
EarlyStopping = Annotated[Optional[str], typer.Option(
    "--early-stopping", help="transformers' meaning: true = stop once `beams` hypotheses finished; false = also stop "
    "when the best live beam, scored at its current length, cannot beat the worst finished one (heuristic); "
    "never = the same test at the longest allowed length when a > 0 (exact) (default false).",
    rich_help_panel=BEAM, show_default=False)]
Sweep = Annotated[Optional[str], typer.Option(
    "--sweep-length-penalty", help="Comma-separated penalties, e.g. 0,0.5,1,1.5,2: one full search each, the "
    "winner per value, changes marked (JSON 'sweep'; csv prints the sweep rows).", rich_help_panel=BEAM)]

TreeView = Annotated[str, typer.Option(
    "--tree", help="The search tree in the table view: full (every candidate, its numbers), collapsed (the live "
    "beams and the finished hypotheses only, short numbers), none; auto = collapsed when the terminal is narrower "
    "than 120 columns.", rich_help_panel=o.OUT)]


@o.command(o.PROMPT, o.MODEL, o.SETTINGS, ("max_new_tokens", "ignore_eos"), ("fmt", "save_html", "save_svg"),
           o.PENALTIES)
def beam(
    opts: o.Opts,
    beams: Beams = None,
    num_return: Return = None,
    length_penalty: LengthPenalty = None,
    length_norm: LengthNorm = None,
    early_stopping: EarlyStopping = None,
    sweep: Sweep = None,
    tree: TreeView = "auto",
) -> None:
    """Beam search (transformers semantics) with a tree of every step: live beams, pruned candidates, finished
    hypotheses. Scores are labelled: sum_logprob = decoding sum after the processors (run on log-probabilities,
    as transformers does), raw_sum_logprob = the unprocessed model's log-probability, score = sum_logprob /
    norm(L). Processors: --repetition-penalty, --no-repeat-ngram, --logit-bias (sampling filters do not apply).
    Default -n is 32."""
    view = beam_view.tree_view(tree, render.console().width)
    from ...core.methods.beam import beam_run, parse_penalties
    from ...core.methods.registry import settings_for
    from ..pipeline import load, read_prompt
    text = read_prompt(opts.prompt, opts.prompt_file)
    explicit = o.explicit(opts, "max_new_tokens", "ignore_eos")
    explicit.update(beams=beams, num_return=num_return, length_penalty=length_penalty,
                    length_norm=length_norm.strip().lower() if length_norm else None,
                    early_stopping=early_stopping.strip().lower() if early_stopping else None)
    settings = settings_for("beam", opts.preset, explicit, opts.set_)
    penalties = parse_penalties(sweep) if sweep is not None else None
    lm = load(opts)
    prompt_ids = lm.encode(text, opts.chat)
    search = beam_run(lm, settings, text, prompt_ids)
    with LiveSteps(render.console(), None, settings.max_new_tokens, unit="steps",
                   enabled=opts.fmt == o.Format.table) as live:
        drive(search, opts.fmt, on_step=live.add)
    if penalties is not None:
        phase(lambda: search.run_sweep(penalties))
    document = search.document()  # the best hypothesis's reasoning split included (docs/reasoning.md)
    result = {k: document[k] for k in ("text", "token_ids", "hypotheses", "sweep") if k in document}
    tables = beam_view.tables(document)
    output.emit_for(opts, output.Output(  # csv: the sweep when there is one, else the hypotheses
        document=document, jsonl=[output.summary_record("beam", lm.name, result, document["summary"])],
        text=document["text"], tables=tables, csv=tables[-1][1],
        views=lambda: beam_view.views(lm.name, text, search, settings, document, view)))
