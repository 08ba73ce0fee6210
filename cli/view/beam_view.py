"""`beam`'s views: the search tree, the finished hypotheses, the winner per length penalty, and their flat rows for
markdown and csv. Every number comes from the run (its document and its steps)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Group
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from ...core.errors import ConfigError
from . import render

if TYPE_CHECKING:  # the core (and torch) load when a command runs, not for --help
    from ...core.methods.beam import BeamSearch, BeamSettings

TREES = ("auto", "full", "collapsed", "none")
FULL_TREE_WIDTH = 120


def tables(document: dict) -> list[tuple[str | None, list[dict]]]:
    """markdown: the hypotheses, then the sweep when one ran (csv prints the last)."""
    sweep = document.get("sweep")
    return [(None, hypothesis_rows(document["hypotheses"]))] + ([(None, sweep_table_rows(sweep))]
                                                                 if sweep is not None else [])


def views(model_name: str, prompt: str, search: BeamSearch, settings: BeamSettings, document: dict,
          tree: str) -> list:
    """The tree (``tree``: full, collapsed or none), the hypotheses, the sweep, the summary line."""
    out = [] if tree == "none" else [search_tree(model_name, prompt, search, settings, collapsed=tree == "collapsed")]
    out += [hypotheses_table(document["hypotheses"])]
    if document.get("sweep") is not None:
        out.append(sweep_table(document["sweep"], settings.length_norm))
    return out + [render.summary_line(document["summary"])]


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


# Levels a tree shows before a live beam's children restart at the left margin ("↳ step k, continued: ..."): rich
# indents 4 columns a level, and a collapsed label is at most about 44 columns (80 = 9 x 4 + 44); a full one about
# 72 (120 = 12 x 4 + 72). Deeper, a label would be folded into 4-column slivers.
COLLAPSED_DEPTH, FULL_DEPTH = 9, 12


def search_tree(model_name: str, prompt: str, search: BeamSearch, s: BeamSettings, collapsed: bool = False) -> Group:
    """Every candidate of every step under the beam it extends: live (●), finished into the pool (✔), finished but
    worse than the full pool (✘), pruned (·). Numbers: step logprob (processed), raw logprob, running sum, score.
    ``collapsed``: no pruned candidates, and only the step logprob and the running sum (scores of finished ones),
    so a line fits 80 columns. A beam deeper than a line allows goes on under a new root below the tree."""
    title = (f"{model_name} · beams {s.beams} · {s.length_norm} norm, penalty {s.length_penalty:g} · early "
             f"stopping {s.early_stopping}")
    root = Tree(Text.assemble((title + "\n", "bold"), (prompt, "dim")), guide_style="dim")
    nodes: dict[tuple[int, ...], Tree] = {(): root}
    depth = COLLAPSED_DEPTH if collapsed else FULL_DEPTH
    continued: list[Tree] = []  # subtrees past `depth` levels, each restarted at the left margin
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
                key = parent_key + (c.token_id,)
                if len(key) % depth == 0:  # as deep as a line allows: its children go on under a new root
                    node = Tree(Text.assemble((f"↳ step {len(key) - 1}, continued: ", "dim"), label.copy()),
                                guide_style="dim")
                    continued.append(node)
                nodes[key] = node
        previous = [tuple(b.token_ids) for b in step.beams]
    return Group(root, *continued)


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
