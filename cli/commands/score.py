"""`decodelab score`: a given text, teacher-forced: per-token log-probabilities, perplexity, and the difference
against a reference model or cache policy."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import Progress

from ...core.errors import ConfigError
from ...core.settings import as_dict
from .. import options as o
from ..loop import drive
from ..view import kept as kept_view
from ..view import output, render, score_view

SCORE = "Scoring"

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
    from ...core.methods.score import score_run, scored_ids
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
    scorer = score_run(lm, settings, body, ids, reference=reference)
    run_with_progress(scorer, opts.fmt)
    emit(opts, lm, settings, scorer)


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


def emit(opts, lm, settings, scorer) -> None:
    """The run's document (built in core) in its format."""
    document = scorer.document()  # the reasoning split included (docs/reasoning.md)
    kept = document.get("kv_kept")
    output.emit_for(opts, output.Output(
        document=document,
        jsonl=[output.summary_record("score", lm.name, document["summary"], kept_view.document_part(kept))],
        tables=[(None, document["steps"]), *kept_view.table_part(kept)],
        views=lambda: score_view.views(lm, settings, scorer, document)))


def choices(opts, settings, body: str, empty_think: bool | None = None) -> None:
    """`score --choice`: the labels after the text, in the command's format (docs/constraints.md, exact choice
    scoring)."""
    from ...core.engine.run import Origin
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
    report = score_choices(lm, settings, body, ids, chain, settings.cache_spec, thinking)
    document = report.document(Origin.of("score", lm, as_dict(settings), chain.names, body, ids))
    rows, summary = document["choices"], document["summary"]
    output.emit_for(opts, output.Output(
        document=document,
        jsonl=[{"type": "choice", **render.clean(r)} for r in rows] + [output.summary_record("score", lm.name,
                                                                                              summary)],
        tables=[(None, [{k: v for k, v in r.items() if k != "tokenizations"} for r in rows])],
        views=lambda: [score_view.choices_table(rows, f"{lm.name} · labels after the text"),
                       render.summary_line(summary)]
        + ([score_view.thinking_line(thinking)] if thinking is not None else [])))


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
    run = ServedScore(conn, ids, top, settings.chunk, settings=settings, text=body)
    run_with_progress(run, opts.fmt)
    emit_engine(opts, conn, ids, run)


def emit_engine(opts: o.Opts, conn, ids: list[int], run) -> None:
    """The run's document (built in core: ServedScore.document) in its format."""
    document = run.document()
    summary, rows = document["summary"], document["steps"]
    output.emit_for(opts, output.Output(
        document=document,
        jsonl=[output.summary_record("score", conn.local.name, summary)],
        tables=[(None, score_view.engine_rows(rows))],
        views=lambda: score_view.engine_views(conn, run, summary, ids)))
