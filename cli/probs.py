"""`decodelab probs`: the next-token distribution after every stage of the chain, without generating."""

from __future__ import annotations

from rich.table import Table

from ..core.build import build_probs
from ..core.config import ProbsSettings, as_dict, resolve, validate_sample
from . import options as o
from . import render
from .pipeline import load, read_prompt

@o.command(o.PROMPT, o.MODEL, o.SETTINGS, o.OUTPUT, o.CHAIN)
def probs(opts: o.Opts) -> None:
    """Show how each stage of the chain reshapes the next-token distribution (top tokens, kept, entropy)."""
    text = read_prompt(opts.prompt, opts.prompt_file)
    settings = resolve(ProbsSettings, opts.preset, o.explicit(opts, "top"), opts.set_)
    validate_sample(settings)
    lm = load(opts)
    prompt_ids = lm.encode(text, opts.chat)
    stages, tracked = build_probs(lm, settings, prompt_ids)
    names = [s.name for s in stages]
    fmt = opts.fmt
    if fmt == o.Format.json or fmt == o.Format.jsonl:
        doc = render.document("probs", lm, as_dict(settings), names[1:], text, prompt_ids,
                              stages=stages, tokens=tracked)
        (render.print_json if fmt == o.Format.json else render.print_jsonl)(doc)
    elif fmt in (o.Format.markdown, o.Format.csv):
        rows = []
        for t in tracked:
            row = {"token_id": t.token_id, "token": render.show_token(t.token), "logit": t.logit}
            row.update({f"p_{name}": t.probs[name] for name in names})
            rows.append(row)
        render.print_rows(rows, fmt.value)
    if fmt == o.Format.table or opts.save_html or opts.save_svg:
        render.show([tokens_table(tracked, names, lm.name), stages_table(stages)], opts.save_html, opts.save_svg,
                    to_screen=fmt == o.Format.table)


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
