"""`decodelab probs`: the next-token distribution after every stage of the chain, without generating."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ...core.errors import ConfigError
from .. import options as o
from ..view import output, probs_view

if TYPE_CHECKING:  # annotations only: the settings classes load torch
    from ...core.methods.probs import ProbsSettings

GIVEN = "Given distribution (no model)"
Dist = Annotated[Optional[str], typer.Option("--dist", help="P0,P1,...: run the chain on this distribution, no model "
                                             "(token ids 0..n-1; logits log P).", rich_help_panel=GIVEN)]
Logits = Annotated[Optional[str], typer.Option("--logits", help="Z0,Z1,...: the same with logits (-inf allowed).",
                                               rich_help_panel=GIVEN)]
LogitsFile = Annotated[Optional[Path], typer.Option("--logits-file", help="A file of logits (commas or whitespace).",
                                                    rich_help_panel=GIVEN)]
History = Annotated[Optional[str], typer.Option("--history", help="ID,ID,...: the tokens before (penalties and DRY "
                                                "see them as generated output).", rich_help_panel=GIVEN)]


@o.command(o.PROMPT, o.MODEL, o.SETTINGS, o.OUTPUT, o.CHAIN, o.SAMPLERS, ("seed",))
def probs(opts: o.Opts, dist: Dist = None, logits: Logits = None, logits_file: LogitsFile = None,
          history: History = None) -> None:
    """Show how each stage of the chain reshapes the next-token distribution (top tokens, kept, entropy)."""
    from ...core.engine.run import drain
    from ...core.methods.probs import probs_run
    from ..pipeline import export_instead, load, read_prompt
    given = dist is not None or logits is not None or logits_file is not None
    from ...core.methods.registry import settings_for
    settings = settings_for("probs", opts.preset, o.explicit(opts, "top", "seed"), opts.set_)
    if given:
        return given_probs(opts, settings, dist, logits, logits_file, history)
    if history is not None:
        raise ConfigError("--history: only with --dist, --logits or --logits-file (with a model the prompt is the "
                          "history)")
    if opts.export is not None:
        export_instead(opts, settings, load(opts))
        return
    text = read_prompt(opts.prompt, opts.prompt_file)
    lm = load(opts)
    prompt_ids = lm.encode(text, opts.chat)
    run = probs_run(lm, settings, text, prompt_ids)
    drain(run)
    document = run.document()
    stages, tracked = document["stages"], document["tokens"]
    names = [s.name for s in stages]
    rows = [{"token_id": t.token_id, "token": t.token, "logit": t.logit,
             **{f"p_{name}": t.probs[name] for name in names}} for t in tracked]
    output.emit_for(opts, output.Output(
        document=document, jsonl=[document], tables=[(None, rows)],
        views=lambda: [probs_view.tokens_table(tracked, names, lm.name), probs_view.stages_table(stages)]))


def given_probs(opts: o.Opts, settings: ProbsSettings, dist, logits, logits_file, history) -> None:
    """--dist / --logits / --logits-file: the chain on a distribution typed in by hand; nothing is loaded."""
    from ...core.inputs import parse_int
    from ...core.methods.probs import dist_stages, given_document, given_logits
    from ..pipeline import export_instead
    if opts.prompt is not None or opts.prompt_file is not None:
        raise ConfigError("PROMPT: not used with --dist/--logits/--logits-file (no model runs); drop one of them")
    raw = given_logits(dist, logits, logits_file)
    try:
        ids = [parse_int(t, "--history", 0) for t in (history or "").replace(",", " ").split()]
    except ConfigError:
        raise ConfigError(f"--history {history!r}: token ids are integers >= 0, e.g. 3,17,17") from None
    if export_instead(opts, settings, vocab=raw.shape[-1]):
        return
    vocab = raw.shape[-1]
    top = opts.top if opts.top is not None else (vocab if vocab <= 64 else settings.top)  # small: every token
    result = dist_stages(settings, raw, ids, seed=settings.seed, top=top)
    names = [s.name for s in result.stages]
    doc = given_document(settings, raw, ids, result, top)
    rows = [{"token_id": t.token_id, "logit": t.logit, **{f"p_{name}": t.probs[name] for name in names}}
            for t in result.tokens]
    output.emit_for(opts, output.Output(
        document=doc, jsonl=[doc], tables=[(None, rows)],
        views=lambda: [probs_view.tokens_table(result.tokens, names, "given distribution"),
                       probs_view.stages_table(result.stages)]))
