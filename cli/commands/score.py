"""`decodelab score`: a given text, teacher-forced: per-token log-probabilities, perplexity, and the difference
against a reference model or cache policy."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import Progress
from rich.table import Table
from rich.text import Text

from ...core.errors import ConfigError
from ...core.settings import as_dict
from .. import options as o
from ..loop import drive
from ..view import output, render

SCORE = "Scoring"
TABLE_ROWS = 200  # per-token rows a terminal table shows (json/jsonl/csv carry every token)

TextArg = Annotated[Optional[str], typer.Argument(help="The text to score; '-' reads stdin.", show_default=False)]
TextFile = Annotated[Optional[Path], typer.Option("--text-file", help="Read the text from a file.",
                                                  rich_help_panel=SCORE)]
Limit = Annotated[Optional[int], typer.Option("--limit", help="Score only the first N tokens.", rich_help_panel=SCORE)]
Chunk = Annotated[Optional[int], typer.Option("--chunk", help="Perplexity per chunk of N scored tokens.",
                                              rich_help_panel=SCORE)]
Feed = Annotated[Optional[int], typer.Option("--feed", help="Tokens per forward (default: the whole text at once, "
                                             "or 1 when --cache or --against-cache acts between forwards: bounded, "
                                             "quantized or compressing, scored as in decoding).",
                                             rich_help_panel=SCORE)]
Prefill = Annotated[Optional[int], typer.Option("--prefill", help="The first N tokens in one forward (the prompt a "
                                                "press that compresses once compresses), then --feed a forward.",
                                                rich_help_panel=SCORE, show_default=False)]
Against = Annotated[Optional[str], typer.Option("--against", help="Reference model (same tokenizer): per-token "
                                                "KL(reference || model), top-1 agreement, log-probability "
                                                "difference.", rich_help_panel=SCORE)]
Renormalize = Annotated[Optional[bool], typer.Option(
    "--renormalize", help="Also each token's raw log-probability renormalized over the chain's kept set "
    "(kept_logprob, kept_mass) and the importance ratio raw / processed before and after it: the correction RL "
    "trainers apply after top-p.", rich_help_panel=SCORE, show_default=False)]
KeptIds = Annotated[Optional[bool], typer.Option(
    "--kept-ids", help="Also, per scored token, the ids that survive each stage of the chain (kept_sets; ids null "
    "where every token survives).", rich_help_panel=SCORE, show_default=False)]
MinMass = Annotated[Optional[float], typer.Option("--min-mass", help="--choice: token paths whose model and "
                                                  "sampler probability are both below this are not walked "
                                                  "(default 1e-6; 0 walks all).", rich_help_panel=SCORE,
                                                  show_default=False)]
EmptyThink = Annotated[Optional[bool], typer.Option(
    "--empty-think", help="--choice on a thinking model: the labels after a forced empty thinking block (markers from "
    "--think-tags or the chat template), and P(the model starts thinking) beside them.", rich_help_panel=SCORE,
    show_default=False)]
AgainstCache = Annotated[Optional[str], typer.Option("--against-cache", help="Reference KV-cache policy (the same "
                                                     "model unless --against), e.g. full to measure --cache.",
                                                     rich_help_panel=SCORE)]


@o.command(o.MODEL, o.SETTINGS, o.OUTPUT, o.CHAIN, o.ENGINE)
def score(opts: o.Opts, text: TextArg = None, text_file: TextFile = None, limit: Limit = None, chunk: Chunk = None,
          feed: Feed = None, against: Against = None, against_cache: AgainstCache = None,
          renormalize: Renormalize = None, kept_ids: KeptIds = None, min_mass: MinMass = None,
          prefill: Prefill = None, empty_think: EmptyThink = None) -> None:
    """Score a text teacher-forced (no generation): per token the model's log-probability, rank and entropy, and
    the log-probability under the chain's settings; perplexity overall and per chunk; with --against or
    --against-cache, the KL divergence and agreement with the reference and the tokens that differ most. With
    --choice A,B,C the text is a prompt: each label's exact probability after it, beside the first-token and the
    constrained-sampler estimates and their errors."""
    from ...core.engine.models import load_draft
    from ...core.methods.score import build_scorer, scored_ids
    from ...core.sampling.chain import make_chain
    from ..pipeline import load
    body = _read(text, text_file)
    explicit = o.explicit(opts, "top")
    explicit.update(limit=limit, chunk=chunk, feed=feed, against=against, against_cache=against_cache,
                    renormalize=renormalize, kept_ids=kept_ids, min_mass=min_mass, prefill=prefill)
    from ...core.methods.registry import settings_for
    settings = settings_for("score", opts.preset, explicit, opts.set_)
    if opts.engine is not None:
        return on_engine(opts, settings, body)
    if settings.choice is not None:
        return choices(opts, settings, body, empty_think)
    if empty_think:
        raise ConfigError("--empty-think: applies to --choice (the labels after an empty thinking block)")
    lm = load(opts)
    reference = None
    if settings.against is not None:
        reference = load_draft(settings.against, lm, opts.dtype, opts.trust_remote_code, option="--against")
    ids = scored_ids(lm, body, settings, "--text-file" if text_file is not None else "TEXT")
    chain = make_chain(lm, settings)
    scorer = build_scorer(lm, settings, ids, chain, reference)
    run_with_progress(scorer, opts.fmt)
    emit(opts, lm, settings, body, ids, chain, scorer)


def _read(text: str | None, text_file: Path | None) -> str:
    from ..pipeline import read_prompt
    try:
        return read_prompt(text, text_file)
    except Exception as exc:  # the shared reader names PROMPT / --prompt-file; say TEXT / --text-file here
        raise type(exc)(str(exc).replace("--prompt-file", "--text-file").replace("PROMPT", "TEXT")) from None


def run_with_progress(scorer, fmt: o.Format) -> None:
    """Stream the scored tokens (JSONL as they come); a progress bar on a terminal for long texts."""
    show = sys.stderr.isatty() and scorer.total > 256
    with Progress(transient=True, disable=not show, console=render.error_console()) as progress:
        task = progress.add_task("scoring", total=scorer.total)
        drive(scorer, fmt, row=lambda r: render.clean(r.to_dict()), on_step=lambda r: progress.advance(task))


def emit(opts, lm, settings, body: str, ids: list[int], chain, scorer) -> None:
    from ...core.trace import reasoning
    from ..view import kept as kept_view
    from ..view.reasoning import reasoning_line
    summary = scorer.summary()
    kept = kept_view.kept_after(getattr(scorer, "runtime", None), len(ids))
    rows = [r.to_dict() for r in scorer.steps]
    head = render.document("score", lm, as_dict(settings), chain.names, body, ids)
    split_part = reasoning.for_score(settings, lm, ids, scorer.steps)

    def views() -> list:
        out = [tokens_table(scorer.steps, f"{lm.name} · cache {settings.cache} · chain: "
                            f"{' -> '.join(chain.names) or '(none)'}"),
               render.shaded_text(lm.token_text(ids[0]), [(r.token, render.exp(r.raw_logprob)) for r in scorer.steps]),
               render.shading_legend("raw p (the model's own probability of the given token)",
                                     "first token (not scored)", "scored tokens"),
               chunks_table(summary)]
        if summary.most_different:
            out.append(different_table(summary))
        out += kept_view.kept_views(kept, lm.token_text, ids, f"kept by {settings.cache} after the text")
        out.append(render.summary_line({k: v for k, v in render.clean(summary).items()
                                        if k not in ("chunks", "most_different")}))
        return out + [line for line in [reasoning_line(split_part)] if line is not None]

    output.emit_for(opts, output.Output(
        document={**head, "steps": rows, "text": "", "token_ids": [], "summary": summary,
                  **kept_view.document_part(kept), **split_part},
        jsonl=[output.summary_record("score", lm.name, summary, kept_view.document_part(kept))],
        tables=[(None, rows), *kept_view.table_part(kept)], views=views))


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


def choices(opts, settings, body: str, empty_think: bool | None = None) -> None:
    """`score --choice`: the labels after the text, in the command's format (docs/constraints.md, exact choice
    scoring)."""
    from ...core.methods.choice import score_choices
    from ...core.sampling.chain import make_chain
    from ..pipeline import load

    lm = load(opts)
    ids = lm.encode(body)
    chain = make_chain(lm, settings)
    thinking = None
    if empty_think:  # the labels after a forced empty thinking block (core/methods/choice_thinking.py)
        from ...core.methods.choice_thinking import empty_block
        body, ids, thinking = empty_block(lm, settings, body, ids)
    report = score_choices(lm, settings, body, ids, chain, settings.cache_spec)
    rows, summary = report.rows(), report.summary()
    if thinking is not None:
        summary["thinking"] = thinking
    head = render.document("score", lm, as_dict(settings), chain.names, body, ids)
    output.emit_for(opts, output.Output(
        document={**head, "choices": rows, "summary": summary},
        jsonl=[{"type": "choice", **render.clean(r)} for r in rows] + [output.summary_record("score", lm.name,
                                                                                              summary)],
        tables=[(None, [{k: v for k, v in r.items() if k != "tokenizations"} for r in rows])],
        views=lambda: [choices_table(rows, f"{lm.name} · labels after the text"), render.summary_line(summary)]
        + ([thinking_line(thinking)] if thinking is not None else [])))


def thinking_line(thinking: dict) -> str:
    """What --empty-think scored: the block added, and P(START | prompt) where the prompt opened none."""
    p = thinking["p_start"]
    start = "" if p is None else f"; P(the model starts thinking | prompt) = {p:.4g}"
    return (f"thinking: {thinking['mode']} (appended {thinking['appended']!r}): P(label | prompt, empty thinking), "
            f"not the marginal over thoughts{start}")


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


# --- on a served engine (--engine URL) ----------------------------------------------------------------------------


def on_engine(opts: o.Opts, settings, body: str) -> None:
    """score --engine: the server's prompt logprobs of the text's token ids (raw in every --logprobs-mode)."""
    from ...core.methods.score import check_scorable
    from ...core.methods.served import ServedScore, score_needs
    from ...core.sampling.semantics import active_stages
    from ..served import connect, local_tokenizer

    needs = score_needs(settings, active_stages(settings), bool(settings.renormalize or settings.kept_ids))
    local = local_tokenizer(opts)
    ids = local.encode(body)[: settings.limit]
    check_scorable(ids)  # before the server is contacted
    conn = connect(opts, local, needs)
    cap = conn.engine.capabilities.max_top_n
    top = max(1, min(settings.top, cap) if cap is not None else settings.top)
    run = ServedScore(conn, ids, top, settings.chunk)
    run_with_progress(run, opts.fmt)
    emit_engine(opts, conn, settings, body, ids, run)


def emit_engine(opts: o.Opts, conn, settings, body: str, ids: list[int], run) -> None:
    from ..served import document
    from ..view.served_view import score_table

    summary = run.summary()
    rows = [r.to_dict() for r in run.steps]

    def views() -> list:
        return [score_table(run.steps, f"{conn.engine.model} on {conn.kind} at {conn.engine.url} · raw prompt "
                                       "logprobs", run.top_n),
                render.shaded_text(conn.local.token_text(ids[0]),
                                   [(r.token, render.exp(r.raw_logprob)) for r in run.steps]),
                render.shading_legend("raw p (the served model's probability of the given token)",
                                      "first token (not scored)", "scored tokens"),
                chunks_table(summary),
                render.summary_line({k: v for k, v in render.clean(summary).items() if k != "chunks"})]

    output.emit_for(opts, output.Output(
        document={**document("score", conn, as_dict(settings), [], body, ids), "steps": rows, "text": "",
                  "token_ids": [], "summary": summary},
        jsonl=[output.summary_record("score", conn.local.name, summary)],
        tables=[(None, [{**{k: v for k, v in render.clean(r).items() if k not in ("alternatives", "defects")},
                         "token": render.show_token(r["token"])} for r in rows])],
        views=views))
