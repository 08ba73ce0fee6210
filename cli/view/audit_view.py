"""Views of the audits: check-sampler's test against each law, audit-numerics' conditions against the reference."""

from __future__ import annotations

import math

from rich.table import Table
from rich.text import Text

from . import render


def _num(x: float | None, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.{digits}g}"


def sampler_prefixes_table(check, title: str) -> Table:
    table = Table(title=title, header_style="bold")
    for col in ("prefix", "tokens", "draws", "support", "cells (pooled tokens)", "chi-square", "dof", "p-value",
                "KL(freq||exact)", "KL noise", "forbidden draws", "most drawn: count / expected"):
        table.add_column(col, justify="left" if col.startswith("most") else "right")
    for p in check.prefixes:
        top = ", ".join(f"{render.show_token(t['token'])} {t['count']}/{t['expected']:.1f}" for t in p.top[:3])
        table.add_row(str(p.index), str(len(p.prefix_token_ids)), str(p.draws), str(p.support),
                      f"{p.cells} ({p.pooled_tokens})", _num(p.chi_square), str(p.dof), _num(p.p_value, 3),
                      _num(p.kl_empirical), _num(p.kl_noise), str(p.forbidden_draws), top)
    return table


def sampler_laws_table(check) -> Table:
    table = Table(title="the draws under each law (all prefixes together)", header_style="bold")
    for col in ("law", "what", "log-likelihood", "chi-square", "dof", "p-value", "max TV from exact"):
        table.add_column(col, justify="left" if col in ("law", "what") else "right")
    for f in check.laws:
        style = "bold green" if f.name == (check.named or ("exact" if check.passed else None)) else None
        table.add_row(Text(f.name, style=style or ""), f.what if f.distinguishable else f"{f.what} (indistinguishable)",
                      _num(f.log_likelihood, 6), _num(f.chi_square), str(f.dof), _num(f.p_value, 3), _num(f.tv_max, 3))
    return table


def sampler_views(check, title: str) -> list:
    out = [sampler_prefixes_table(check, title), sampler_laws_table(check)]
    out.append(Text(f"pooling: {check.pooling_rule}", style="dim"))
    out += [Text(f"note: {n}", style="dim") for n in check.notes]
    out.append(Text(f"verdict: {check.verdict}", style="bold green" if check.passed else "bold red"))
    return out
