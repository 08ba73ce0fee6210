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


# ---------------------------------------------------------------------------------------------------------------
# audit-numerics

SPARK = "▁▂▃▄▅▆▇█"


def numerics_table(audit, title: str) -> Table:
    table = Table(title=title, header_style="bold")
    for col in ("condition", "dtype", "max |Δ logprob|", "mean |Δ logprob|", "KL mean", "KL max", "TV mean",
                "ratio ∉ [0.9, 1.1]", "argmax flips (margin)", "first divergence", "first layer beyond noise",
                "verdict"):
        table.add_column(col, justify="left" if col in ("condition", "verdict", "dtype") else "right")
    for c in audit.conditions:
        flips = ", ".join(f"{f.position} ({f.reference_margin:.2g})" for f in c.flips[:3]) + \
            (f" +{len(c.flips) - 3}" if len(c.flips) > 3 else "")
        style = "dim" if c.skipped else ("green" if c.within_noise else "red")
        table.add_row(c.condition, c.dtype or "-", _num(c.max_abs_delta_logprob, 3), _num(c.mean_abs_delta_logprob, 3),
                      _num(c.kl_mean, 3) + (" ≥" if c.truncated else ""), _num(c.kl_max, 3), _num(c.tv_mean, 3),
                      _num(c.outside_band, 3), flips or "0", _num(c.first_divergence),
                      c.first_layer_beyond_noise or "-", Text(c.verdict, style=style))
    return table


def layers_plot(audit) -> Table:
    """Each condition's hidden-state error at each layer over its floor: a bar of log10(e / floor) from -4 to +2,
    red where it is beyond noise."""
    shown = [c for c in audit.conditions if c.layers]
    table = Table(title="hidden states: relative error / noise floor per layer (bar: log10, -4 .. +2; red: beyond)",
                  header_style="bold")
    table.add_column("layer")
    for c in shown:
        table.add_column(c.condition)
    rows = max((len(c.layers) for c in shown), default=0)
    for i in range(rows):
        cells = []
        for c in shown:
            la = c.layers[i]
            ratio = la.relative_error / la.floor if la.floor > 0 else (0.0 if la.relative_error == 0 else math.inf)
            level = 0.0 if ratio <= 0 else min(1.0, max(0.0, (math.log10(ratio) + 4) / 6)) if math.isfinite(ratio) \
                else 1.0
            bar = "█" * round(level * 8)
            cells.append(Text(f"{bar:<8} {_num(ratio, 2)}", style="red" if la.beyond_noise else "green"))
        table.add_row(shown[0].layers[i].layer if shown else str(i), *cells)
    return table


def deltas_plot(audit) -> Table:
    table = Table(title="|Δ logprob| of the text's tokens by position (each row scaled to its own max)",
                  header_style="bold")
    table.add_column("condition")
    table.add_column("max", justify="right")
    table.add_column("positions")
    for c in audit.conditions:
        if not c.abs_delta_logprob:
            continue
        top = max(c.abs_delta_logprob)
        line = "".join(SPARK[min(7, int(8 * d / top))] if top > 0 else SPARK[0] for d in c.abs_delta_logprob)
        table.add_row(c.condition, _num(top, 3), line)
    return table


def numerics_views(audit, title: str) -> list:
    out = [numerics_table(audit, title), layers_plot(audit), deltas_plot(audit)]
    for f in audit.floors:
        out.append(Text(f"floor {f['dtype']}: eps {f['eps']:.3g}, logprob floor {f['logprob']:.3g}, layers "
                        f"{_num(min(f['layers']), 2)} .. {_num(max(f['layers']), 2)}", style="dim"))
    out.append(Text(f"noise floor: {audit.floor_rule}", style="dim"))
    return out
