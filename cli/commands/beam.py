"""`decodelab beam`: beam search with length normalization, a tree of the search, and where the winner flips."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from ...core.errors import ConfigError
from ...core.settings import as_dict
from .. import options as o
from ..loop import drive, phase
from ..view import output, render
from ..view.live import LiveSteps

if TYPE_CHECKING:  # the core (and torch) load when a command runs, not for --help
    from ...core.methods.beam import BeamSearch, BeamSettings

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

TREES = ("auto", "full", "collapsed", "none")
TreeView = Annotated[str, typer.Option(
    "--tree", help="The search tree in the table view: full (every candidate, its numbers), collapsed (the live "
    "beams and the finished hypotheses only, short numbers), none; auto = collapsed when the terminal is narrower "
    "than 120 columns.", rich_help_panel=o.OUT)]
FULL_TREE_WIDTH = 120


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
    view = tree_view(tree, render.console().width)
    from ...core.methods.beam import (
        beam_stepper,
        build_beam,
        parse_penalties,
        sweep_length_penalty,
    )
    from ..pipeline import load, read_prompt
    text = read_prompt(opts.prompt, opts.prompt_file)
    explicit = o.explicit(opts, "max_new_tokens", "ignore_eos")
    explicit.update(beams=beams, num_return=num_return, length_penalty=length_penalty,
                    length_norm=length_norm.strip().lower() if length_norm else None,
                    early_stopping=early_stopping.strip().lower() if early_stopping else None)
    from ...core.methods.registry import settings_for
    settings = settings_for("beam", opts.preset, explicit, opts.set_)
    penalties = parse_penalties(sweep) if sweep is not None else None
    lm = load(opts)
    prompt_ids = lm.encode(text, opts.chat)
    search = build_beam(lm, settings, prompt_ids)
    processors = search.chain
    with LiveSteps(render.console(), None, settings.max_new_tokens, unit="steps",
                   enabled=opts.fmt == o.Format.table) as live:
        drive(search, opts.fmt, on_step=live.add)
    hyps = search.hypotheses
    summary = search.summary()
    sweep_rows = None
    if penalties is not None:
        sweep_rows = phase(lambda: sweep_length_penalty(lambda: beam_stepper(lm, settings), prompt_ids, processors,
                                                        settings, penalties, tuple(lm.eos_ids), lm.decode,
                                                        lm.context_length))
    best = hyps[0] if hyps else None
    result = {"text": best.text if best else "", "token_ids": best.token_ids if best else [], "hypotheses": hyps}
    if sweep_rows is not None:
        result["sweep"] = sweep_rows
    from ...core.trace import reasoning
    split_part = reasoning.for_tokens(settings, lm, prompt_ids, result["token_ids"])  # the best hypothesis's split
    head = render.document("beam", lm, as_dict(settings), processors.names, text, prompt_ids)
    tables = [(None, hypothesis_rows(hyps))] + ([(None, sweep_table_rows(sweep_rows))] if sweep_rows is not None else [])

    def views() -> list:
        out = ([] if view == "none" else [search_tree(lm.name, text, search, settings, collapsed=view == "collapsed")])
        out += [hypotheses_table(hyps)]
        if sweep_rows is not None:
            out.append(sweep_table(sweep_rows, settings.length_norm))
        return out + [render.summary_line(summary)]

    output.emit_for(opts, output.Output(  # csv: the sweep when there is one, else the hypotheses
        document={**head, "steps": search.steps, **result, "summary": summary, **split_part},
        jsonl=[output.summary_record("beam", lm.name, result, summary)], text=result["text"],
        tables=tables, csv=tables[-1][1], views=views))


# --- rows for markdown / csv -------------------------------------------------------------------------------


def hypothesis_rows(hyps) -> list[dict]:
    return [{"rank": h.rank, "text": h.text, "length": h.length, "sum_logprob": h.sum_logprob,
             "raw_sum_logprob": h.raw_sum_logprob, "score": h.score, "reason": h.reason, "step": h.step,
             "token_ids": " ".join(map(str, h.token_ids))} for h in hyps]


def sweep_table_rows(rows) -> list[dict]:
    return [{"length_penalty": r.length_penalty, "text": r.winner.text,
             "length": r.winner.length, "raw_sum_logprob": r.winner.raw_sum_logprob,
             "sum_logprob": r.winner.sum_logprob, "score": r.winner.score, "changed": r.changed,
             "token_ids": " ".join(map(str, r.winner.token_ids))} for r in rows]


# --- rich views --------------------------------------------------------------------------------------------

FATE_STYLE = {"live": "bold", "finished": "bold green", "rejected": "yellow", "pruned": "dim"}
FATE_MARK = {"live": "●", "finished": "✔", "rejected": "✘", "pruned": "·"}


def tree_view(choice: str, width: int) -> str:
    """--tree: auto is collapsed on a terminal narrower than FULL_TREE_WIDTH."""
    if choice not in TREES:
        raise ConfigError(f"--tree {choice!r}: allowed: {', '.join(TREES)}")
    return ("collapsed" if width < FULL_TREE_WIDTH else "full") if choice == "auto" else choice


def search_tree(model_name: str, prompt: str, search: BeamSearch, s: BeamSettings, collapsed: bool = False) -> Tree:
    """Every candidate of every step under the beam it extends: live (●), finished into the pool (✔), finished but
    worse than the full pool (✘), pruned (·). Numbers: step logprob (processed), raw logprob, running sum, score.
    ``collapsed``: no pruned candidates, and only the step logprob and the running sum (scores of finished ones),
    so a line fits 80 columns."""
    title = (f"{model_name} · beams {s.beams} · {s.length_norm} norm, penalty {s.length_penalty:g} · early "
             f"stopping {s.early_stopping}")
    root = Tree(Text.assemble((title + "\n", "bold"), (prompt, "dim")), guide_style="dim")
    nodes: dict[tuple[int, ...], Tree] = {(): root}
    previous: list[tuple[int, ...]] = []
    for step in search.steps:
        for c in step.candidates:
            if collapsed and c.fate == "pruned":
                continue
            parent_key = previous[c.parent] if previous else ()
            parent = nodes.get(parent_key, root)
            mark = (f"{FATE_MARK[c.fate]} {render.cut(render.show_token(c.token), 16)}", FATE_STYLE[c.fate])
            if collapsed:
                label = Text.assemble(mark, f" {c.logprob:.2f} Σ{c.sum_logprob:.2f}",
                                      (f" score {c.score:.3f}" if c.finishes else "", FATE_STYLE[c.fate]))
            else:
                label = Text.assemble(
                    mark, f"  logp {c.logprob:.3f} (raw {c.raw_logprob:.3f})  Σ {c.sum_logprob:.3f}",
                    (f"  score {c.score:.4f} [{c.fate}]" if c.finishes else "", FATE_STYLE[c.fate]),
                )
            node = parent.add(label)
            if c.fate == "live":
                nodes[parent_key + (c.token_id,)] = node
        previous = [tuple(b.token_ids) for b in step.beams]
    return root


def hypotheses_table(hyps) -> Table:
    table = Table(title="finished hypotheses (score = sum_logprob / norm(length))", header_style="bold")
    for name, justify in (("#", "right"), ("text", "left"), ("length", "right"), ("sum logprob", "right"),
                          ("raw sum logprob", "right"), ("score", "right"), ("reason", "left")):
        table.add_column(name, justify=justify, overflow="fold", no_wrap=name not in ("text", "reason"))
    for h in hyps:
        table.add_row(str(h.rank), render.one_line(h.text), str(h.length), f"{h.sum_logprob:.4f}",
                      f"{h.raw_sum_logprob:.4f}", f"{h.score:.4f}", h.reason)
    return table


def sweep_table(rows, norm: str) -> Table:
    table = Table(title=f"winner per length penalty ({norm} norm)", header_style="bold")
    for name, justify in (("penalty", "right"), ("winner", "left"), ("length", "right"),
                          ("raw sum logprob", "right"), ("sum logprob", "right"), ("score", "right"), ("", "left")):
        table.add_column(name, justify=justify, overflow="fold", no_wrap=name not in ("winner", ""))
    for r in rows:
        w = r.winner
        table.add_row(f"{r.length_penalty:g}", render.one_line(w.text), str(w.length), f"{w.raw_sum_logprob:.4f}",
                      f"{w.sum_logprob:.4f}", f"{w.score:.4f}",
                      Text("◀ winner changes", style="bold magenta") if r.changed else "")
    return table
