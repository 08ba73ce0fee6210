"""`probs`' views: the listed tokens' probability and rank after each stage, and each stage's kept count, entropy
and mass removed."""

from __future__ import annotations

from rich.table import Table

from . import render


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
