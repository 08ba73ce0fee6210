"""`decodelab batch`: many requests scheduled iteration by iteration over a paged KV pool with prefix sharing."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ...core.errors import EMPTY_CHAIN, ChainError
from .. import options as o
from ..loop import drive, note_error, phase
from ..view import batch_view, output, render
from ..view.live import LiveSteps

if TYPE_CHECKING:  # the core (and torch) load when a command runs, not for --help
    from ...core.methods.batch.run import BatchSettings

BATCH = "Batching"


class Rows(str, Enum):
    requests = "requests"
    iterations = "iterations"


PromptsFile = Annotated[Path, typer.Option("--prompts-file", help="One prompt a line, or JSONL: {\"prompt\": ..., "
                                           "\"id\": ..., any sample setting (temperature, seed, max_new_tokens, "
                                           "...)} a line.", rich_help_panel=BATCH, show_default=False)]
MaxBatch = Annotated[Optional[int], typer.Option("--max-batch", help="Sequences running at once (default 8).",
                                                 rich_help_panel=BATCH, show_default=False)]
MaxTokens = Annotated[Optional[int], typer.Option("--max-tokens-per-iteration", help="Tokens one forward may take: "
                                                  "decodes first, prefill chunks fill the rest (default 512).",
                                                  rich_help_panel=BATCH, show_default=False)]
BlockSize = Annotated[Optional[int], typer.Option("--block-size", help="Tokens per KV block (default 16).",
                                                  rich_help_panel=BATCH, show_default=False)]
Blocks = Annotated[Optional[int], typer.Option("--blocks", help="Blocks in the pool (default: max batch x the "
                                               "longest request's blocks); fewer forces preemption.",
                                               rich_help_panel=BATCH, show_default=False)]
Baselines = Annotated[Optional[str], typer.Option("--baselines", help="Also time the same requests under: static "
                                                  "(fixed batches), transformers (its continuous batching), batched (the ordinary mode, with "
                                                  "--batch-invariant); "
                                                  "comma-separated, or none (default static).",
                                                  rich_help_panel=BATCH, show_default=False)]
Invariant = Annotated[Optional[bool], typer.Option(
    "--batch-invariant", help="One forward per row at shapes the request alone sets (its own prefill chunks, no "
    "shared prefix blocks): each request's tokens and log-probabilities are those of a lone run, whatever shares the "
    "batch. --baselines batched times the ordinary mode beside it (the cost).", rich_help_panel=BATCH,
    show_default=False)]
RowsOpt = Annotated[Rows, typer.Option("--rows", help="What markdown/csv print: requests or iterations.",
                                       rich_help_panel=o.OUT)]


@o.command(o.PROMPT, o.MODEL, o.SETTINGS, o.GENERATE, o.OUTPUT, o.CHAIN, o.ENGINE,
           without=("prompt", "prompt_file", "cache", "top"))
def batch(opts: o.Opts, prompts_file: PromptsFile, max_batch: MaxBatch = None, max_tokens_per_iteration: MaxTokens =
          None, block_size: BlockSize = None, blocks: Blocks = None, baselines: Baselines = None,
          rows: RowsOpt = Rows.requests, batch_invariant: Invariant = None) -> None:
    """Serve many requests at once: one forward per iteration over the running sequences (prefill chunks and
    decodes together), finished ones leave and waiting ones join; KV in a paged pool with shared prefix blocks."""
    from ...core.methods.batch.run import batch_run, read_prompts
    from ..pipeline import load
    explicit = o.explicit(opts, "max_new_tokens", "seed", "ignore_eos", "stop")
    explicit.pop("cache", None)
    explicit.update(max_batch=max_batch, max_tokens_per_iteration=max_tokens_per_iteration, block_size=block_size,
                    blocks=blocks, batch_invariant=batch_invariant)
    if baselines is not None:
        names = tuple(b.strip() for b in baselines.split(",") if b.strip())
        explicit["baselines"] = () if names in ((), ("none",)) else names
    from ...core.methods.registry import settings_for
    settings = settings_for("batch", opts.preset, explicit, opts.set_)
    if baselines is not None and not explicit["baselines"]:
        from dataclasses import replace

        settings = replace(settings, baselines=())
    entries = read_prompts(prompts_file, settings)
    lm = load(opts)
    conn = engine_connection(opts, lm, entries)
    run = batch_run(lm, settings, entries, chat=opts.chat)
    run.conn = conn  # with --engine: the same requests on the server, part of the run's document
    with LiveSteps(render.console(), None, unit="iterations", enabled=opts.fmt == o.Format.table) as live:
        drive(run, opts.fmt, kind="iteration", on_step=live.add)
    report = run.report()
    phase(lambda: run.run_baselines(report))  # skipped after a Ctrl-C; one inside keeps the baselines measured
    if conn is not None:
        phase(lambda: engine_baseline(run, opts.chat))
    from ...core.analysis.agreement import baseline_noise
    phase(lambda: baseline_noise(run))  # into the run's document (run.noise)
    emit(opts, lm, settings, run, rows)
    for r in report.results:  # every request was served and printed; one whose chain emptied makes the status 2
        if r.stop_reason == EMPTY_CHAIN:
            note_error(ChainError(f"request {r.id}: its chain [{', '.join(r.chain)}] left no candidate token after "
                                  f"{len(r.new_ids)} tokens (stop_reason {EMPTY_CHAIN}); loosen its filters or bans"))
            break


def emit(opts: o.Opts, lm, settings: BatchSettings, run, rows: Rows) -> None:
    """The run's document (built in core, the engine's part and the noise verdicts included) in its format."""
    document = run.document()
    noise = run.noise
    requests, summary, report = document["requests"], document["summary"], run.report()
    if rows == Rows.iterations:
        table = [{k: (",".join(v) if isinstance(v, list) else v) for k, v in render.clean(i).items()}
                 for i in report.iterations]
    else:
        table = [{k: v for k, v in r.items() if k not in ("steps", "prompt_token_ids", "token_ids", "chain")}
                 for r in requests]
        for row, r in zip(table, report.results):
            row["prompt"] = row["prompt"] or ""
            row["new_tokens"] = len(r.new_ids)
    output.emit_for(opts, output.Output(
        document=document,
        jsonl=[{"type": "request", **r} for r in requests] + [output.summary_record("batch", lm.name, summary)],
        text="\n".join(render.one_line(r["text"]) for r in requests),  # one request a line
        tables=[(None, table)],
        views=lambda: [batch_view.iterations_table(report, lm.name), batch_view.requests_table(requests),
                       render.summary_line(summary)] + [batch_view.noise_line(v) for v in noise or []]))


# --- against a served engine's own batching (--engine URL) --------------------------------------------------------


def engine_connection(opts: o.Opts, lm, entries):
    """With --engine: the server reached and checked before the local run starts (None without)."""
    if opts.engine is None:
        return None
    from ...core.methods.served import request_of
    from ..served import connect

    for e in entries:  # a setting the server has no equivalent for is refused before anything runs
        request_of(lm, e.settings, 1)
    return connect(opts, lm, {"generate": "batch --engine"})


def engine_baseline(run, chat: bool) -> None:
    """The same requests on the server, all sent at once (its continuous batching): figures in the summary
    (engine_*), its tokens per request in the JSON (engine_requests); a failed request is the exit status."""
    from ...core.methods.served import batch_on_engine

    base = batch_on_engine(run, chat)
    if base.reason:
        from ...core.engine.http.transport import EngineError

        note_error(EngineError(base.reason))

