"""`score`'s views: the scored tokens, the text shaded by each token's raw probability, perplexity per chunk, the
tokens that differ most from a reference, the kept map, the labels of --choice, and the runs on a served engine."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from . import kept as kept_view
from . import render
from .served_view import score_table
from .reasoning import reasoning_line

TABLE_ROWS = 200  # per-token rows a terminal table shows (json/jsonl/csv carry every token)


def views(lm, settings, scorer, document: dict) -> list:
    """Every view of a scored text, each number from the run's document and steps."""
    summary, ids, chain = document["summary"], document["prompt"]["token_ids"], document["chain"]
    out = [tokens_table(scorer.steps, f"{lm.name} · cache {settings.cache} · chain: "
                        f"{' -> '.join(chain) or '(none)'}"),
           render.shaded_text(lm.token_text(ids[0]), [(r.token, render.exp(r.raw_logprob)) for r in scorer.steps]),
           render.shading_legend("raw p (the model's own probability of the given token)",
                                 "first token (not scored)", "scored tokens"),
           chunks_table(summary)]
    if summary.most_different:
        out.append(different_table(summary))
    out += kept_view.kept_views(document.get("kv_kept"), lm.token_text, ids,
                                f"kept by {settings.cache} after the text")
    out.append(render.summary_line({k: v for k, v in render.clean(summary).items()
                                    if k not in ("chunks", "most_different")}))
    return out + [line for line in [reasoning_line(document)] if line is not None]


def thinking_line(thinking: dict) -> str:
    """What --empty-think scored: the block added, and P(START | prompt) where the prompt opened none."""
    p = thinking["p_start"]
    start = "" if p is None else f"; P(the model starts thinking | prompt) = {p:.4g}"
    return (f"thinking: {thinking['mode']} (appended {thinking['appended']!r}): P(label | prompt, empty thinking), "
            f"not the marginal over thoughts{start}")


def engine_views(conn, run, summary, ids: list[int]) -> list:
    """`score --engine`: the server's raw prompt logprobs."""
    return [score_table(run.steps, f"{conn.engine.model} on {conn.kind} at {conn.engine.url} · raw prompt "
                                   "logprobs", run.top_n),
            render.shaded_text(conn.local.token_text(ids[0]),
                               [(r.token, render.exp(r.raw_logprob)) for r in run.steps]),
            render.shading_legend("raw p (the served model's probability of the given token)",
                                  "first token (not scored)", "scored tokens"),
            chunks_table(summary),
            render.summary_line({k: v for k, v in render.clean(summary).items() if k != "chunks"})]


def engine_rows(rows: list[dict]) -> list[dict]:
    """Flat rows for markdown and csv: no nested lists."""
    return [{**{k: v for k, v in render.clean(r).items() if k not in ("alternatives", "defects")},
             "token": render.show_token(r["token"])} for r in rows]


def tokens_table(steps, title: str) -> Table:
    reference = bool(steps) and steps[0].kl is not None
    table = Table(title=title, header_style="bold")
    for name in ("pos", "token", "raw logp", "raw rank", "raw H", "processed logp") + (
            ("ref logp", "KL(ref||model)", "agree") if reference else ()):
        table.add_column(name, justify="left" if name == "token" else "right", no_wrap=True)
    for r in steps[:TABLE_ROWS]:
        cells = [str(r.position), render.show_token(r.token), f"{r.raw_logprob:.3f}", str(r.raw_rank),
                 f"{r.raw_entropy:.2f}", "removed" if r.logprob == float("-inf") else f"{r.logprob:.3f}"]
        if reference:
            cells += [f"{r.reference_logprob:.3f}", f"{r.kl:.4f}", "yes" if r.agree else "NO"]
        table.add_row(*cells)
    if len(steps) > TABLE_ROWS:
        table.caption = f"first {TABLE_ROWS} of {len(steps)} tokens (-f json, jsonl or csv for all)"
    else:
        table.caption = ("raw: the model's own softmax; processed: under the chain's settings (removed = -inf); "
                         "H in nats")
    return table


def chunks_table(summary) -> Table:
    table = Table(title="perplexity per chunk", header_style="bold")
    for name in ("positions", "perplexity"):
        table.add_column(name, justify="right")
    for c in summary.chunks:
        table.add_row(f"{c.start}-{c.end - 1}", f"{c.perplexity:.3f}")
    return table


def different_table(summary) -> Table:
    table = Table(title=f"tokens that differ most from the reference ({summary.reference})", header_style="bold")
    for name in ("pos", "token", "logp", "ref logp", "difference", "KL"):
        table.add_column(name, justify="left" if name == "token" else "right")
    for d in summary.most_different:
        table.add_row(str(d["position"]), render.show_token(d["token"]), f"{d['raw_logprob']:.3f}",
                      f"{d['reference_logprob']:.3f}", Text(f"{d['difference']:+.3f}"), f"{d['kl']:.4f}")
    return table


def choices_table(rows: list[dict], title: str) -> Table:
    table = Table(title=title, header_style="bold")
    for name in ("label", "exact p", "share", "first token", "error", "sampler", "error", "tokenizations"):
        table.add_column(name, justify="left" if name in ("label", "tokenizations") else "right", no_wrap=True)
    for r in rows:
        splits = "  ".join("|".join(render.show_token(t) for t in k["tokens"]) + f" {k['probability']:.3g}"
                           for k in r["tokenizations"])
        table.add_row(render.show_token(r["label"]), f"{r['exact']:.4g}", f"{r['share']:.4f}",
                      f"{r['first_token']:.4f}", f"{r['first_token_error']:+.4f}", f"{r['sampler']:.4f}",
                      f"{r['sampler_error']:+.4f}", splits)
    table.caption = ("exact: sum over the listed tokenizations of the product of the model's conditionals; share: "
                     "exact renormalized over the labels; first token and sampler (the --choice constraint alone, "
                     "temperature 1) estimate the share; error = estimate - share")
    return table
