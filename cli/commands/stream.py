"""`decodelab stream`: generation or scoring past the model's context under a bounded KV policy, a side-by-side
comparison of the policies, and the attention-sink diagnosis."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.progress import Progress
from rich.text import Text

from ...core.errors import ConfigError
from .. import options as o
from ..loop import drive
from ..view import kept as kept_view
from ..view import output, render, stream_view
from ..view.live import LiveSteps

if TYPE_CHECKING:  # the core (and torch) load when a command runs, not for --help
    from ...core.methods.stream import StreamSettings

STREAM = "Streaming"

TextFile = Annotated[Optional[Path], typer.Option("--text-file", help="Score this text (instead of generating from "
                                                  "PROMPT).", rich_help_panel=STREAM)]
Limit = Annotated[Optional[int], typer.Option("--limit", help="Score only the first N tokens.",
                                              rich_help_panel=STREAM)]
Chunk = Annotated[Optional[int], typer.Option("--chunk", help="Tokens per reported span (default 256).",
                                              rich_help_panel=STREAM, show_default=False)]
Feed = Annotated[Optional[int], typer.Option("--feed", help="Tokens per forward when scoring (default 1: every "
                                             "query sees exactly what the policy keeps; a forward of N tokens "
                                             "evicts after all N).", rich_help_panel=STREAM, show_default=False)]
Compare = Annotated[Optional[bool], typer.Option("--compare-policies", help="Score the text under full, window "
                                                 "(keep, rerotate), sinks (keep, rerotate) and recompute, all "
                                                 "holding --window tokens; plot perplexity over position.",
                                                 rich_help_panel=STREAM, show_default=False)]
Window = Annotated[Optional[int], typer.Option("--window", help="--compare-policies: tokens every bounded cache "
                                               "holds (default 256).", rich_help_panel=STREAM, show_default=False)]
Sinks = Annotated[Optional[int], typer.Option("--sinks", help="--compare-policies and --attention: the first S "
                                              "positions (default 4).", rich_help_panel=STREAM, show_default=False)]
Policies = Annotated[Optional[str], typer.Option("--policies", help="--compare-policies: rank these cache specs "
                                                "instead (comma-separated, e.g. snapkv:ratio=0.5,h2o:size=64,"
                                                "window:size=128; full is always the reference) by bytes, KL and "
                                                "top-1 flips against the full cache (and the probe with --probe).",
                                                rich_help_panel=STREAM, show_default=False)]
Prefill = Annotated[Optional[int], typer.Option("--prefill", help="Scoring: the first N tokens in one forward (the "
                                                "prompt a press that compresses once compresses), then --feed a "
                                                "forward.", rich_help_panel=STREAM, show_default=False)]
Probe = Annotated[Optional[bool], typer.Option("--probe", help="The retrieval probe: a pass key planted in the "
                                              "--text-file at several depths, asked for at the end; log P(answer) "
                                              "and greedy accuracy under --cache (or every policy of "
                                              "--compare-policies) against the full cache.",
                                              rich_help_panel=STREAM, show_default=False)]
ProbeKeys = Annotated[Optional[str], typer.Option("--probe-keys", help="--probe: the keys, comma-separated "
                                                  "(default: two random 5-digit keys from --seed).",
                                                  rich_help_panel=STREAM, show_default=False)]
ProbeDepths = Annotated[Optional[str], typer.Option("--probe-depths", help="--probe: where the needle goes, "
                                                    "fractions of the text (default 0.1,0.5,0.9).",
                                                    rich_help_panel=STREAM, show_default=False)]
Attention = Annotated[Optional[bool], typer.Option("--attention", help="Per layer and head, the attention weight "
                                                   "late queries put on the first --sinks positions against an "
                                                   "average position (the attention-sink diagnosis).",
                                                   rich_help_panel=STREAM, show_default=False)]


@o.command(o.PROMPT, o.MODEL, o.SETTINGS, o.GENERATE, o.OUTPUT, o.CHAIN)
def stream(opts: o.Opts, text_file: TextFile = None, limit: Limit = None, chunk: Chunk = None, feed: Feed = None,
           compare_policies_: Compare = None, window: Window = None, sinks: Sinks = None,
           attention: Attention = None, policies: Policies = None, prefill: Prefill = None, probe: Probe = None,
           probe_keys: ProbeKeys = None, probe_depths: ProbeDepths = None) -> None:
    """Decode or score past the model's context under a bounded KV cache (default sinks:sinks=4,recent=252): with
    PROMPT, generate -n tokens with the cache length, evicted positions and slot map per token; with --text-file,
    score the text (perplexity, cache tokens, KV bytes and tokens/s per span)."""
    from ...core.methods.stream import stream_score_run
    from ...core.sampling.chain import make_chain
    from ..pipeline import load
    explicit = o.explicit(opts, "max_new_tokens", "seed", "top", "ignore_eos", "stop")
    explicit.update(limit=limit, chunk=chunk, feed=feed, window=window, sinks=sinks,
                    compare_policies=compare_policies_, attention=attention, policies=policies, prefill=prefill,
                    probe=probe, probe_depths=probe_depths,
                    probe_keys=tuple(k.strip() for k in probe_keys.split(",")) if probe_keys is not None else None)
    from ...core.methods.registry import settings_for
    from ...core.methods.score import check_scorable
    settings = settings_for("stream", opts.preset, explicit, opts.set_)
    if text_file is not None and opts.prompt is not None:
        raise ConfigError("PROMPT and --text-file: give one of them (PROMPT generates, --text-file scores)")
    if settings.compare_policies and text_file is None:
        raise ConfigError("--compare-policies: needs --text-file (the text every policy scores)")
    if settings.probe and text_file is None:
        raise ConfigError("--probe: needs --text-file (the filler text the pass key is planted in)")
    body = _read(opts, text_file)
    lm = load(opts)
    chain = make_chain(lm, settings)
    if settings.attention:
        return emit_attention(opts, lm, settings, body, chain)
    if text_file is None:
        return run_generate(opts, lm, settings, body, chain)
    ids = lm.encode(body)[: settings.limit]
    check_scorable(ids, f"--text-file {text_file}")
    if settings.compare_policies:
        return run_compare(opts, lm, settings, body, ids, chain)
    if settings.probe:
        return run_probe(opts, lm, settings, body, ids, chain)
    run = stream_score_run(lm, settings, body, ids, chain)
    with_progress(run, opts.fmt, "scoring")
    document = run.document()
    summary, kept = document["summary"], document.get("kv_kept")
    output.emit_for(opts, output.Output(
        document=document,
        jsonl=[output.summary_record("stream", lm.name, summary, kept_view.document_part(kept))],
        tables=[(None, [render.clean(c) for c in run.chunks]), *kept_view.table_part(kept)],
        views=lambda: stream_view.score_views(lm, settings, run, document)))


def _read(opts, text_file: Path | None) -> str:
    from ..pipeline import read_prompt
    if text_file is None:
        return read_prompt(opts.prompt, opts.prompt_file)
    try:
        return read_prompt(None, text_file)
    except ConfigError as exc:  # the shared reader names --prompt-file; say --text-file here
        raise ConfigError(str(exc).replace("--prompt-file", "--text-file")) from None


def with_progress(run, fmt: o.Format, label: str) -> None:
    """Iterate a run (JSONL lines as spans come; a progress bar on a terminal); Ctrl-C keeps what was scored."""
    show = sys.stderr.isatty() and run.total > 256
    with Progress(transient=True, disable=not show, console=render.error_console()) as progress:
        task = progress.add_task(label, total=run.total)
        drive(run, fmt, on_step=lambda chunk: progress.advance(task, chunk.tokens))


# --- generation ----------------------------------------------------------------------------------------------------


def run_generate(opts, lm, settings: StreamSettings, text: str, chain) -> None:
    from ...core.methods.stream import stream_run
    prompt_ids = lm.encode(text, opts.chat)
    # -f jsonl and -f text write each step (or its text) as it comes: no step is kept, unless a page is saved
    keep = opts.fmt not in (o.Format.jsonl, o.Format.text) or bool(opts.save_html or opts.save_svg)
    run = stream_run(lm, settings, text, prompt_ids, keep_steps=keep)  # its chain shares the selector's generator
    if opts.fmt == o.Format.table:
        with LiveSteps(render.console(), None, settings.max_new_tokens) as live:
            drive(run, opts.fmt, on_step=live.add)
    else:
        drive(run, opts.fmt, text_of=lambda: lm.decode(run.new_ids), stops=tuple(settings.stop))
    document = run.document()  # the reasoning split included (docs/reasoning.md)
    summary, kept = document["summary"], document.get("kv_kept")
    delivered = {"text": document["text"], "token_ids": document["token_ids"]}
    output.emit_for(opts, output.Output(
        document=document, text=document["text"],
        jsonl=[output.summary_record("stream", lm.name, delivered, summary, kept_view.document_part(kept))],
        tables=[(None, stream_view.step_rows(run.steps)), *kept_view.table_part(kept)],
        views=lambda: stream_view.generate_views(lm, run, document)))


def run_compare(opts, lm, settings: StreamSettings, body: str, ids: list[int], chain) -> None:
    from ...core.analysis.stream_modes import PolicyComparison
    from ..view import policies as policies_view
    run = PolicyComparison(lm, settings, body, ids, chain).run(lambda r, label: with_progress(r, opts.fmt, label))
    document = run.document()
    results, rows, probe = run.results, run.rows, document.get("probe")
    output.emit_for(opts, output.Output(
        document=document,
        jsonl=[{"type": "policy", **render.clean(r)} for r in results]
        + [output.summary_record("stream", lm.name, document["summary"], {"policies": len(results)})],
        tables=[(None, [stream_view.compare_row(r, lm.context_length) for r in results]),
                ("ranking", policies_view.ranking_rows(rows))],
        views=lambda: [stream_view.compare_table(results, lm, len(ids) - 1),
                       stream_view.ppl_plot(results, lm.context_length),
                       policies_view.ranking_table(rows, f"{lm.name} · {len(ids) - 1} tokens · every policy against "
                                                   + ("the full cache" if run.by == "kl_vs_full" else
                                                      "the text's own tokens (longer than the trained context "
                                                      f"{run.trained_context()}: the full cache is no reference "
                                                      "there)"), probe is not None, run.by),
                       *([Text("probe: " + probe["verdict"], style="cyan")] if probe else [])]))


def run_probe(opts, lm, settings: StreamSettings, body: str, ids: list[int], chain) -> None:
    """--probe under --cache: every trial under the full cache, the policy, and the full cache without the needle."""
    from ...core.analysis.stream_modes import make_prober, probe_document
    from ..view import policies as policies_view
    prober = make_prober(lm, settings, ids)
    status = render.error_console()
    if opts.fmt == o.Format.table:
        status.print(f"[dim]probe: {len(prober.trials)} trials under full and {settings.cache}[/dim]")
    document, report = probe_document(lm, settings, body, ids, chain, prober)
    summary = document["summary"]
    output.emit_for(opts, output.Output(
        document=document,
        jsonl=[{"type": "trial", **render.clean(t)} for t in document["probe"]["trials"]]
        + [output.summary_record("stream", lm.name, summary)],
        tables=[(None, policies_view.probe_rows(report))],
        views=lambda: [policies_view.probe_table(report, f"{lm.name} · retrieval probe · {len(prober.trials)} trials"),
                       render.summary_line(summary)]))


# --- attention -----------------------------------------------------------------------------------------------------


def emit_attention(opts, lm, settings: StreamSettings, body: str, chain) -> None:
    from ...core.analysis.stream_modes import attention_document
    document = attention_document(lm, settings, body, chain)
    rows, summary = document["attention"], document["summary"]
    output.emit_for(opts, output.Output(
        document=document,
        jsonl=[{"type": "head", **render.clean(r)} for r in rows] + [output.summary_record("stream", lm.name, summary)],
        tables=[(None, [render.clean(r) for r in rows])],
        views=lambda: [stream_view.heat_table(rows, lm, summary), render.summary_line(summary)]))
