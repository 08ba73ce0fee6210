"""`decodelab stream`: generation or scoring past the model's context under a bounded KV policy, a side-by-side
comparison of the policies, and the attention-sink diagnosis."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Group
from rich.progress import Progress
from rich.table import Table
from rich.text import Text

from ...core.errors import ConfigError
from ...core.settings import as_dict
from .. import options as o
from ..loop import drive
from ..view import kept as kept_view
from ..view import output, render
from ..view.live import LiveSteps

if TYPE_CHECKING:  # the core (and torch) load when a command runs, not for --help
    from ...core.methods.stream import StreamSettings

STREAM = "Streaming"
TABLE_ROWS = 200

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
    from ...core.methods.stream import StreamScore
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
    run = StreamScore(lm.model, ids, chain, lm.token_text, settings)
    with_progress(run, opts.fmt, "scoring")
    summary = run.summary()
    kept = kept_view.kept_after(getattr(run.scorer, "runtime", None), len(ids))
    head = render.document("stream", lm, as_dict(settings), chain.names, body, ids, mode="score")
    output.emit_for(opts, output.Output(
        document={**head, "steps": run.chunks, "text": "", "token_ids": [], "summary": summary,
                  **kept_view.document_part(kept)},
        jsonl=[output.summary_record("stream", lm.name, summary, kept_view.document_part(kept))],
        tables=[(None, [render.clean(c) for c in run.chunks]), *kept_view.table_part(kept)],
        views=lambda: [chunks_table(run.chunks, f"{lm.name} · cache {summary.policy} · {summary.tokens} tokens scored, "
                                    f"{settings.feed} per forward"),
                       *kept_view.kept_views(kept, lm.token_text, ids, f"kept by {summary.policy} after the text"),
                       render.summary_line(_scalars(summary))]))


def _read(opts, text_file: Path | None) -> str:
    from ..pipeline import read_prompt
    if text_file is None:
        return read_prompt(opts.prompt, opts.prompt_file)
    try:
        return read_prompt(None, text_file)
    except ConfigError as exc:  # the shared reader names --prompt-file; say --text-file here
        raise ConfigError(str(exc).replace("--prompt-file", "--text-file")) from None


def _scalars(summary) -> dict:
    return {k: v for k, v in render.clean(summary).items() if k != "chunks"}


def with_progress(run, fmt: o.Format, label: str) -> None:
    """Iterate a run (JSONL lines as spans come; a progress bar on a terminal); Ctrl-C keeps what was scored."""
    show = sys.stderr.isatty() and run.total > 256
    with Progress(transient=True, disable=not show, console=render.error_console()) as progress:
        task = progress.add_task(label, total=run.total)
        drive(run, fmt, on_step=lambda chunk: progress.advance(task, chunk.tokens))


# --- generation ----------------------------------------------------------------------------------------------------


def run_generate(opts, lm, settings: StreamSettings, text: str, chain) -> None:
    from ...core.methods.stream import StreamGenerate
    from ...core.trace import reasoning
    prompt_ids = lm.encode(text, opts.chat)
    # -f jsonl and -f text write each step (or its text) as it comes: no step is kept, unless a page is saved
    keep = opts.fmt not in (o.Format.jsonl, o.Format.text) or bool(opts.save_html or opts.save_svg)
    run = StreamGenerate(lm, prompt_ids, chain, settings, keep_steps=keep)
    if opts.fmt == o.Format.table:
        with LiveSteps(render.console(), None, settings.max_new_tokens) as live:
            drive(run, opts.fmt, on_step=live.add)
    else:
        drive(run, opts.fmt, text_of=lambda: lm.decode(run.new_ids), stops=tuple(settings.stop))
    token_ids = run.new_ids
    out_text, summary = lm.decode(token_ids), run.summary()
    kept = kept_view.kept_after(run.runtime, len(prompt_ids))
    head = render.document("stream", lm, as_dict(settings), chain.names, text, prompt_ids, mode="generate",
                           selector=run.selector.name)
    rows = render.step_rows(run.steps)
    for row, step in zip(rows, run.steps):
        row.update(cache_tokens=step.cache_tokens, kv_bytes=step.kv_bytes, evicted=_range(step.evicted),
                   slots=_slots(step.slots))
    output.emit_for(opts, output.Output(
        document={**head, "steps": run.steps, "text": out_text, "token_ids": token_ids, "summary": summary,
                  **kept_view.document_part(kept), **reasoning.for_run(settings, lm, prompt_ids, run.steps)},
        text=out_text,
        jsonl=[output.summary_record("stream", lm.name, {"text": out_text, "token_ids": token_ids}, summary,
                                     kept_view.document_part(kept))],
        tables=[(None, rows), *kept_view.table_part(kept)],
        views=lambda: [cache_table(run.steps, f"{lm.name} (context {lm.context_length} positions) · cache "
                                   f"{summary.policy}"),
                       render.shaded_text(text, [(s.token, s.raw_prob) for s in run.steps]),
                       render.shading_legend("raw p"),
                       *kept_view.kept_views(kept, lm.token_text, prompt_ids, f"kept by {summary.policy} after the run"),
                       render.summary_line(_scalars(summary))]))


def _range(r: list[int]) -> str:
    return "" if not r else f"{r[0]}" if r[1] - r[0] == 1 else f"{r[0]}-{r[1] - 1}"


def _slots(runs: list[list[int]]) -> str:
    """'0-3@0 260-511@4': each run of original positions @ the assigned position of its first token."""
    return " ".join(f"{_range([a, b])}@{s}" for a, b, s in runs)


def cache_table(steps, title: str) -> Table:
    table = Table(title=title, header_style="bold")
    for name in ("step", "pos", "token", "raw p", "cache", "KV bytes", "evicted", "slots"):
        table.add_column(name, justify="left" if name in ("token", "slots") else "right", no_wrap=True)
    shown = steps if len(steps) <= TABLE_ROWS else steps[: TABLE_ROWS // 2] + steps[-TABLE_ROWS // 2 :]
    for s in shown:
        table.add_row(str(s.index), str(s.position), render.show_token(s.token), render.fmt_p(s.raw_prob),
                      str(s.cache_tokens), f"{s.kv_bytes:,}", _range(s.evicted), _slots(s.slots))
    table.caption = ("cache, evicted, slots: after the forward that gave the step's logits; slots: original "
                     "positions @ the position the first of them runs at; raw p: the model's own probability" + (f"; first and last {TABLE_ROWS // 2} of {len(steps)} steps"
                                          if len(steps) > TABLE_ROWS else ""))
    return table


# --- scoring -------------------------------------------------------------------------------------------------------


def chunks_table(chunks, title: str) -> Table:
    table = Table(title=title, header_style="bold")
    for name in ("positions", "perplexity", "cache tokens", "KV bytes", "tokens/s"):
        table.add_column(name, justify="right")
    for c in chunks:
        table.add_row(f"{c.start}-{c.end - 1}", f"{c.perplexity:.2f}", str(c.cache_tokens), f"{c.kv_bytes:,}",
                      "-" if math.isnan(c.tokens_per_s) else f"{c.tokens_per_s:.1f}")
    table.caption = "perplexity: raw model probabilities of the text's tokens; cache and bytes: after each span"
    return table


def run_compare(opts, lm, settings: StreamSettings, body: str, ids: list[int], chain) -> None:
    from ...core.analysis.policies import policy_row, ranked
    from ...core.engine.forward import model_info
    from ...core.methods.stream import compare_policies
    from ..view import policies as policies_view
    prober = make_prober(lm, settings, ids) if settings.probe else None
    results = []
    for label, run in compare_policies(lm.model, ids, chain, lm.token_text, settings, model_info(lm.model)):
        if isinstance(run, str):
            results.append({"label": label, "skipped": run})
            continue
        with_progress(run, opts.fmt, label)
        results.append({"label": label, "spec": str(run.spec), "summary": run.summary()})
        if run.interrupted:
            break
        if prober is not None:
            results[-1]["probe"] = prober.policy(run.spec, label)
    full_bytes = next((r["summary"].kv_bytes_peak for r in results if r["label"] == "full" and "summary" in r), 0)
    rows = ranked([policy_row(r["label"], r["summary"], full_bytes, r.get("probe")) for r in results
                   if "summary" in r])
    for r in results:
        r["rank"] = next((row.rank for row in rows if row.label == r["label"]), None)
        if "probe" in r:
            r["probe"] = {k: v for k, v in render.clean(r["probe"]).items() if k != "results"}
    head = render.document("stream", lm, as_dict(settings), chain.names, body, ids, mode="compare")
    totals = {"tokens": len(ids) - 1, "context_length": lm.context_length}
    extra = {}
    if prober is not None:
        extra["probe"] = policies_view.probe_document(prober.report([]))
    output.emit_for(opts, output.Output(
        document={**head, "policies": results, "ranking": rows, **extra, "steps": [], "text": "", "token_ids": [],
                  "summary": totals},
        jsonl=[{"type": "policy", **render.clean(r)} for r in results]
        + [output.summary_record("stream", lm.name, totals, {"policies": len(results)})],
        tables=[(None, [_compare_row(r, lm.context_length) for r in results]),
                ("ranking", policies_view.ranking_rows(rows))],
        views=lambda: [compare_table(results, lm, len(ids) - 1), ppl_plot(results, lm.context_length),
                       policies_view.ranking_table(rows, f"{lm.name} · {len(ids) - 1} tokens · every policy against "
                                                   "the full cache", prober is not None),
                       *([Text("probe: " + extra["probe"]["verdict"], style="cyan")] if extra else [])]))


def make_prober(lm, settings: StreamSettings, ids: list[int]):
    """The probe over the text ``ids`` (fitted to the model's context), keys and depths from the settings."""
    from ...core.analysis.probe import Prober, ProbeSettings
    from ...core.methods.stream import probe_depths
    probe = ProbeSettings(keys=settings.probe_keys, depths=probe_depths(settings), seed=settings.seed)
    return Prober(lm.model, lm.tokenizer, ids, probe, lm.context_length)


def run_probe(opts, lm, settings: StreamSettings, body: str, ids: list[int], chain) -> None:
    """--probe under --cache: every trial under the full cache, the policy, and the full cache without the needle."""
    from ..view import policies as policies_view
    prober = make_prober(lm, settings, ids)
    status = render.error_console()
    if opts.fmt == o.Format.table:
        status.print(f"[dim]probe: {len(prober.trials)} trials under full and {settings.cache}[/dim]")
    report = prober.report([settings.cache_spec], [settings.cache])
    summary = {**policies_view.probe_summary(report), "policy": str(settings.cache_spec),  # every key shown
               "tokens": prober.filler_tokens}
    head = render.document("stream", lm, as_dict(settings), chain.names, body, ids, mode="probe")
    document = policies_view.probe_document(report)
    output.emit_for(opts, output.Output(
        document={**head, "probe": document, "steps": [], "text": "", "token_ids": [], "summary": summary},
        jsonl=[{"type": "trial", **render.clean(t)} for t in document["trials"]]
        + [output.summary_record("stream", lm.name, summary)],
        tables=[(None, policies_view.probe_rows(report))],
        views=lambda: [policies_view.probe_table(report, f"{lm.name} · retrieval probe · {len(prober.trials)} trials"),
                       render.summary_line(summary)]))


def _ppl_after(chunks, start: int) -> float:
    chosen = [c for c in chunks if c.start > start]
    tokens = sum(c.tokens for c in chosen)
    return math.exp(sum(c.tokens * math.log(c.perplexity) for c in chosen) / tokens) if tokens else float("nan")


def _compare_row(r: dict, context: int | None) -> dict:
    if "skipped" in r:
        return {"policy": r["label"], "spec": "", "perplexity": None, "skipped": r["skipped"]}
    s = r["summary"]
    return {"policy": r["label"], "spec": r["spec"], "perplexity": s.perplexity,
            "perplexity_past_context": _ppl_after(s.chunks, context or 0), "max_cache_tokens": s.max_cache_tokens,
            "kv_bytes_peak": s.kv_bytes_peak, "tokens_per_s": s.tokens_per_s}


def compare_table(results, lm, tokens: int) -> Table:
    table = Table(title=f"{lm.name} · {tokens} tokens scored · context {lm.context_length}", header_style="bold")
    for name in ("policy", "perplexity", f"ppl past {lm.context_length}", "max cache", "peak KV bytes",
                 "tokens/s"):
        table.add_column(name, justify="left" if name == "policy" else "right")
    for r in results:
        row = _compare_row(r, lm.context_length)
        if "skipped" in row:
            table.add_row(row["policy"], Text("skipped: " + row["skipped"], style="yellow"), "", "", "", "")
            continue
        table.add_row(row["policy"], f"{row['perplexity']:.2f}",
                      _num(row["perplexity_past_context"]), str(row["max_cache_tokens"]),
                      f"{row['kv_bytes_peak']:,}", f"{row['tokens_per_s']:.1f}")
    specs = "; ".join(f"{r['label']}: {r['spec']}" for r in results if "spec" in r and r["label"] != "full")
    table.caption = ("raw model perplexity of the text; full and recompute are fed --chunk tokens per forward (the "
                     f"same numbers at any feed), the others --feed; {specs}")
    return table


def _num(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.2f}"


MARKS = "FwWskR*+"
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


# --- attention -----------------------------------------------------------------------------------------------------


def emit_attention(opts, lm, settings: StreamSettings, body: str, chain) -> None:
    from ...core.analysis.attention import attention_profile
    ids = lm.encode(body)[: settings.limit]
    rows, meta = attention_profile(lm.model, ids, settings.sinks, lm.context_length)
    strongest = max(rows, key=lambda r: r.ratio)
    summary = {**meta, "max_ratio": strongest.ratio, "max_layer": strongest.layer, "max_head": strongest.head,
               "mean_ratio": sum(r.ratio for r in rows) / len(rows)}
    head = render.document("stream", lm, as_dict(settings), chain.names, body, ids[: meta["tokens"]],
                           mode="attention")
    output.emit_for(opts, output.Output(
        document={**head, "attention": rows, "steps": [], "text": "", "token_ids": [], "summary": summary},
        jsonl=[{"type": "head", **render.clean(r)} for r in rows] + [output.summary_record("stream", lm.name, summary)],
        tables=[(None, [render.clean(r) for r in rows])],
        views=lambda: [heat_table(rows, lm, meta), render.summary_line(summary)]))


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
        cells = [Text(f"{r.ratio:.1f}x", style=_heat(r.ratio)) for r in mine]
        table.add_row(str(layer), *cells, f"{sum(r.sink_mass for r in mine) / len(mine):.3f}")
    table.caption = ("1x: the first positions get what any position gets; a sink draws many times more "
                     "(see the README for what pretrained models show)")
    return table


def _heat(ratio: float) -> str:
    if ratio >= 10:
        return "bold white on red"
    if ratio >= 3:
        return "black on yellow"
    if ratio >= 1.5:
        return "green"
    return "dim"
