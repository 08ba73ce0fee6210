"""`stream`'s views: the cache per generated token, perplexity per span, the policies side by side (a table and a
plot over position), and the attention-sink heat map; flat values for the summary line."""

from __future__ import annotations

import math

from rich.console import Group
from rich.table import Table
from rich.text import Text

from . import kept as kept_view
from . import render

TABLE_ROWS = 200


def generate_views(lm, run, document: dict) -> list:
    """Generation past the context: the cache per token, the prompt shaded by raw p, the kept map, the summary."""
    summary, prompt = document["summary"], document["prompt"]
    return [cache_table(run.steps, f"{lm.name} (context {lm.context_length} positions) · cache {summary.policy}"),
            render.shaded_text(prompt["text"], [(s.token, s.raw_prob) for s in run.steps]),
            render.shading_legend("raw p"),
            *kept_view.kept_views(document.get("kv_kept"), lm.token_text, prompt["token_ids"],
                                  f"kept by {summary.policy} after the run"),
            render.summary_line(scalars(summary))]


def step_rows(steps) -> list[dict]:
    """Flat rows for markdown and csv: a sample step's, with the cache state."""
    rows = render.step_rows(steps)
    for row, step in zip(rows, steps):
        row.update(cache_tokens=step.cache_tokens, kv_bytes=step.kv_bytes, evicted=span(step.evicted),
                   slots=slots(step.slots))
    return rows


def score_views(lm, settings, run, document: dict) -> list:
    """A text scored past the context: perplexity per span, the kept map, the summary."""
    summary, ids = document["summary"], document["prompt"]["token_ids"]
    return [chunks_table(run.chunks, f"{lm.name} · cache {summary.policy} · {summary.tokens} tokens scored, "
                         f"{settings.feed} per forward"),
            *kept_view.kept_views(document.get("kv_kept"), lm.token_text, ids, f"kept by {summary.policy} after the text"),
            render.summary_line(scalars(summary))]


def scalars(summary) -> dict:
    return {k: v for k, v in render.clean(summary).items() if k != "chunks"}


def span(r: list[int]) -> str:
    return "" if not r else f"{r[0]}" if r[1] - r[0] == 1 else f"{r[0]}-{r[1] - 1}"


def slots(runs: list[list[int]]) -> str:
    """'0-3@0 260-511@4': each run of original positions @ the assigned position of its first token."""
    return " ".join(f"{span([a, b])}@{s}" for a, b, s in runs)


def cache_table(steps, title: str) -> Table:
    table = Table(title=title, header_style="bold")
    for name in ("step", "pos", "token", "raw p", "cache", "KV bytes", "evicted", "slots"):
        table.add_column(name, justify="left" if name in ("token", "slots") else "right", no_wrap=True)
    shown = steps if len(steps) <= TABLE_ROWS else steps[: TABLE_ROWS // 2] + steps[-TABLE_ROWS // 2 :]
    for s in shown:
        table.add_row(str(s.index), str(s.position), render.show_token(s.token), render.fmt_p(s.raw_prob),
                      str(s.cache_tokens), f"{s.kv_bytes:,}", span(s.evicted), slots(s.slots))
    table.caption = ("cache, evicted, slots: after the forward that gave the step's logits; slots: original "
                     "positions @ the position the first of them runs at; raw p: the model's own probability" + (f"; first and last {TABLE_ROWS // 2} of {len(steps)} steps"
                                          if len(steps) > TABLE_ROWS else ""))
    return table


def chunks_table(chunks, title: str) -> Table:
    table = Table(title=title, header_style="bold")
    for name in ("positions", "perplexity", "cache tokens", "KV bytes", "tokens/s"):
        table.add_column(name, justify="right")
    for c in chunks:
        table.add_row(f"{c.start}-{c.end - 1}", f"{c.perplexity:.2f}", str(c.cache_tokens), f"{c.kv_bytes:,}",
                      "-" if math.isnan(c.tokens_per_s) else f"{c.tokens_per_s:.1f}")
    table.caption = "perplexity: raw model probabilities of the text's tokens; cache and bytes: after each span"
    return table


def ppl_after(chunks, start: int) -> float:
    chosen = [c for c in chunks if c.start > start]
    tokens = sum(c.tokens for c in chosen)
    return math.exp(sum(c.tokens * math.log(c.perplexity) for c in chosen) / tokens) if tokens else float("nan")


def compare_row(r: dict, context: int | None) -> dict:
    if "skipped" in r:
        return {"policy": r["label"], "spec": "", "perplexity": None, "skipped": r["skipped"]}
    s = r["summary"]
    return {"policy": r["label"], "spec": r["spec"], "perplexity": s.perplexity,
            "perplexity_past_context": ppl_after(s.chunks, context or 0), "max_cache_tokens": s.max_cache_tokens,
            "kv_bytes_peak": s.kv_bytes_peak, "tokens_per_s": s.tokens_per_s}


def compare_table(results, lm, tokens: int) -> Table:
    table = Table(title=f"{lm.name} · {tokens} tokens scored · context {lm.context_length}", header_style="bold")
    for name in ("policy", "perplexity", f"ppl past {lm.context_length}", "max cache", "peak KV bytes",
                 "tokens/s"):
        table.add_column(name, justify="left" if name == "policy" else "right")
    for r in results:
        row = compare_row(r, lm.context_length)
        if "skipped" in row:
            table.add_row(row["policy"], Text("skipped: " + row["skipped"], style="yellow"), "", "", "", "")
            continue
        table.add_row(row["policy"], f"{row['perplexity']:.2f}",
                      num(row["perplexity_past_context"]), str(row["max_cache_tokens"]),
                      f"{row['kv_bytes_peak']:,}", f"{row['tokens_per_s']:.1f}")
    specs = "; ".join(f"{r['label']}: {r['spec']}" for r in results if "spec" in r and r["label"] != "full")
    table.caption = ("raw model perplexity of the text; full and recompute are fed --chunk tokens per forward (the "
                     f"same numbers at any feed), the others --feed; {specs}")
    return table


def num(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.2f}"


# one mark per policy, none repeated and none "*" (a point two policies share); past these, numbered marks repeat
MARKS = "FwWskR+ox#@%&=~abcdeghijlmnpqtuvyz0123456789"


COLOURS = ("red", "blue", "cyan", "magenta", "green", "yellow", "white", "white")


def ppl_plot(results, context: int | None, height: int = 12, width: int = 64) -> Group:
    """Perplexity per span over position, log scale, one marker per policy. Each span has a column per policy where
    the width allows, so equal values stay visible side by side; a cell two policies still share shows ``*``."""
    series = [(r["label"], r["summary"].chunks) for r in results if "summary" in r and r["summary"].chunks]
    if not series:
        return Group(Text("(nothing to plot)"))
    values = [math.log(c.perplexity) for _, chunks in series for c in chunks if c.perplexity > 0]
    lo, hi = min(values), max(values)
    hi = hi if hi > lo else lo + 1.0
    spans = max(len(chunks) for _, chunks in series)
    per_span = max(1, min(len(series) + 1, width // spans))  # a column per policy and a gap, when they fit
    cols = min(width, spans * per_span)
    grid = [[Text(" ") for _ in range(cols)] for _ in range(height)]
    drawn: dict[tuple[int, int], int] = {}
    for k, (label, chunks) in enumerate(series):
        for i, c in enumerate(chunks):
            x = min(i * cols // spans + k % per_span, cols - 1)
            y = height - 1 - round((math.log(c.perplexity) - lo) / (hi - lo) * (height - 1))
            shared = drawn.setdefault((y, x), k) != k
            grid[y][x] = Text("*", style="bold") if shared else Text(MARKS[k % len(MARKS)],
                                                                     style=COLOURS[k % len(COLOURS)])
    lines = []
    for row_index, row in enumerate(grid):
        level = math.exp(hi - (hi - lo) * row_index / (height - 1))
        lines.append(Text(f"{level:9.1f} |").append_text(Text.assemble(*row)))
    end = series[0][1][-1].end
    axis = Text(" " * 10 + "+" + "-" * cols + f"\n{'':11}position 1 .. {end}")
    if context:
        axis.append(f" (trained context {context})")
    legend = [Text(f"{'':11}{MARKS[k % len(MARKS)]} {label}", style=COLOURS[k % len(COLOURS)])
              for k, (label, _) in enumerate(series)]
    if any(cell.plain == "*" for row in grid for cell in row):
        legend.append(Text(f"{'':11}* two or more policies at the same point"))
    return Group(Text("perplexity per span over position (log scale)", style="bold"), *lines, axis, *legend)


def heat_table(rows, lm, meta) -> Table:
    heads = max(r.head for r in rows) + 1
    table = Table(title=f"{lm.name} · weight on the first {meta['sinks']} positions / an average position's "
                  f"(queries {meta['late_from']}..{meta['tokens'] - 1})", header_style="bold")
    table.add_column("layer", justify="right")
    for h in range(heads):
        table.add_column(f"head {h}", justify="right")
    table.add_column("sink mass (mean)", justify="right")
    for layer in sorted({r.layer for r in rows}):
        mine = [r for r in rows if r.layer == layer]
        cells = [Text(f"{r.ratio:.1f}x", style=heat(r.ratio)) for r in mine]
        table.add_row(str(layer), *cells, f"{sum(r.sink_mass for r in mine) / len(mine):.3f}")
    table.caption = ("1x: the first positions get what any position gets; a sink draws many times more "
                     "(docs/kv-policies.md, \"What the bundled models show\": what pretrained models show)")
    return table


def heat(ratio: float) -> str:
    if ratio >= 10:
        return "bold white on red"
    if ratio >= 3:
        return "black on yellow"
    if ratio >= 1.5:
        return "green"
    return "dim"
