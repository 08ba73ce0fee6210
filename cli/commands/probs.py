"""`decodelab probs`: the next-token distribution after every stage of the chain, without generating."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.table import Table

from ...core.errors import ConfigError
from ...core.settings import as_dict
from .. import options as o
from ..view import output, render

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
    from ...core.methods.probs import build_probs
    from ...core.sampling.semantics import plan
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
    stages, tracked = build_probs(lm, settings, prompt_ids)
    names = [s.name for s in stages]
    extra = {"semantics": plan(settings).describe()} if settings.semantics is not None else {}
    doc = render.document("probs", lm, as_dict(settings), names[1:], text, prompt_ids,
                          stages=stages, tokens=tracked, **extra)
    rows = [{"token_id": t.token_id, "token": t.token, "logit": t.logit,
             **{f"p_{name}": t.probs[name] for name in names}} for t in tracked]
    output.emit_for(opts, output.Output(
        document=doc, jsonl=[doc], tables=[(None, rows)],
        views=lambda: [tokens_table(tracked, names, lm.name), stages_table(stages)]))


def given_probs(opts: o.Opts, settings: ProbsSettings, dist, logits, logits_file, history) -> None:
    """--dist / --logits / --logits-file: the chain on a distribution typed in by hand; nothing is loaded."""
    from ...core.inputs import parse_int
    from ...core.methods.probs import dist_stages, given_logits
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
    doc = {"command": "probs", "model": None, "device": str(raw.device), "dtype": "float32",
           "config": as_dict(settings), "chain": result.chain, "given": {"logits": raw[0].tolist(), "history": ids},
           "stages": result.stages, "tokens": result.tokens, "state": result.state}
    if top >= vocab:
        doc["probs"] = result.probs()  # every token's probability after the last stage, by id
    if settings.semantics is not None:
        doc["semantics"] = result.plan.describe()
    rows = [{"token_id": t.token_id, "logit": t.logit, **{f"p_{name}": t.probs[name] for name in names}}
            for t in result.tokens]
    output.emit_for(opts, output.Output(
        document=doc, jsonl=[doc], tables=[(None, rows)],
        views=lambda: [tokens_table(result.tokens, names, "given distribution"), stages_table(result.stages)]))


def tokens_table(tracked, names: list[str], model_name: str) -> Table:
    table = Table(title=f"{model_name} · next-token probability after each stage", header_style="bold")
    table.add_column("token")
    table.add_column("id", justify="right")
    table.add_column("logit", justify="right")
    for name in names:
        table.add_column(f"{name}\np (rank)", justify="right")
    for t in tracked:
        cells = []
        for name in names:
            p, rank = t.probs[name], t.ranks[name]
            cells.append(f"{render.fmt_p(p)} ({rank})" if rank is not None else "[dim]removed[/dim]")
        table.add_row(render.show_token(t.token), str(t.token_id), f"{t.logit:.3f}", *cells)
    return table


def stages_table(stages) -> Table:
    table = Table(title="stages", header_style="bold")
    for col in ("stage", "kept", "entropy (nats)", "mass removed"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for s in stages:
        table.add_row(s.name, str(s.kept), f"{s.entropy:.3f}", f"{s.mass_removed:.4f}")
    return table
