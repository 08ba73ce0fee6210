"""`decodelab quantize-kv`: a quantized KV cache's memory against the full one, its fidelity on a text, the
reconstruction error per layer and head, and the outlier channels that set the scales."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ...core.errors import ConfigError
from ...core.settings import as_dict, resolve
from .. import options as o
from ..loop import drive, phase
from ..view import output, quantize_kv_view, render

Q = "Quantization"
DEFAULT_TEXT = "presets/models/validation.txt"

TextArg = Annotated[Optional[str], typer.Argument(help="The text to score; '-' reads stdin (default: the bundled "
                                                  "held-out text, presets/models/validation.txt).",
                                                  show_default=False)]
TextFile = Annotated[Optional[Path], typer.Option("--text-file", help="Read the text from a file.", rich_help_panel=Q)]
Limit = Annotated[Optional[int], typer.Option("--limit", help="Use the first N tokens of the text (default 256).",
                                              rich_help_panel=Q, show_default=False)]
Feed = Annotated[Optional[int], typer.Option("--feed", help="Tokens per forward in the fidelity run (default 1: "
                                             "every token reads every earlier one from the cache, as in decoding).",
                                             rich_help_panel=Q, show_default=False)]
Bits = Annotated[Optional[str], typer.Option("--bits", help="2, 4, 8 or fp8 (laid over --cache).", rich_help_panel=Q)]
Axis = Annotated[Optional[str], typer.Option("--axis", help="tensor, token, channel, group or kivi (laid over "
                                             "--cache).", rich_help_panel=Q)]
GroupSize = Annotated[Optional[int], typer.Option("--group-size", help="Channels per group (axis group; kivi "
                                                  "values) or tokens per block (channel, tensor; kivi keys).",
                                                  rich_help_panel=Q)]
Residual = Annotated[Optional[int], typer.Option("--residual", help="Most recent tokens kept exact.",
                                                 rich_help_panel=Q)]
Symmetric = Annotated[Optional[bool], typer.Option("--symmetric/--asymmetric", help="Scales only, or scales and "
                                                   "zero points.", rich_help_panel=Q, show_default=False)]
Grid = Annotated[bool, typer.Option("--grid", help="Fidelity and bytes of every bits x layout "
                                    "(8/4/2 x tensor/token/channel/group/kivi).", rich_help_panel=Q)]
Activations = Annotated[Optional[int], typer.Option("--activations", help="Also the outlier view of the input "
                                                    "activations of this decoder layer.", rich_help_panel=Q)]
Prefill = Annotated[Optional[int], typer.Option("--prefill", help="The fidelity run's first N tokens in one forward "
                                                "(the prompt a press that compresses once compresses), then --feed.",
                                                rich_help_panel=Q, show_default=False)]
Policies = Annotated[Optional[str], typer.Option("--policies", help="Also rank these cache specs against the full "
                                                 "cache (comma-separated, e.g. int4-kivi,snapkv:ratio=0.5,h2o:size=64)"
                                                 ": bytes, KL, top-1 flips, perplexity.", rich_help_panel=Q,
                                                 show_default=False)]
Probe = Annotated[bool, typer.Option("--probe", help="--policies: add the retrieval probe (a pass key planted in the "
                                     "text) to the ranking.", rich_help_panel=Q)]
Reuse = Annotated[Optional[int], typer.Option("--reuse", help="--policies: compress a context of K planted facts "
                                             "once (with the first question), then ask all K questions of that "
                                             "compressed cache: query-aware and query-free presses side by side.",
                                             rich_help_panel=Q, show_default=False)]
Context = Annotated[Optional[int], typer.Option("--context", help="Project the cache's bytes at this many tokens.",
                                                rich_help_panel=Q)]
Batch = Annotated[Optional[int], typer.Option("--batch", help="... in this many rows (default 1).", rich_help_panel=Q,
                                              show_default=False)]


@o.command(o.MODEL, o.SETTINGS, o.OUTPUT)
def quantize_kv(opts: o.Opts, text: TextArg = None, text_file: TextFile = None, limit: Limit = None,
                feed: Feed = None, bits: Bits = None, axis: Axis = None, group_size: GroupSize = None,
                residual: Residual = None, symmetric: Symmetric = None, grid: Grid = False,
                activations: Activations = None, context: Context = None, batch: Batch = None,
                prefill: Prefill = None, policies: Policies = None, probe: Probe = False, reuse: Reuse = None) -> None:
    """A quantized KV cache (--cache quant:..., int8, int4-kivi, int2-kivi; default int4-kivi) against the full one:
    memory (real bytes, the per-token formula, projections), fidelity on a text (KL, top-1 agreement, perplexity),
    reconstruction error per layer and head, and the outlier channels that set the scales."""
    from ...core.analysis.quantize_kv import (
        QuantizeKVSettings,
        measure_grid,
        measure_ranking,
        measure_reuse,
        run_quantize_kv,
        validate_quantize_kv,
    )
    from ..pipeline import load
    explicit = {"cache": opts.cache, "top": opts.top, "limit": limit, "feed": feed, "bits": bits, "axis": axis,
                "group_size": group_size, "residual": residual, "symmetric": symmetric, "grid": grid or None,
                "activations": activations, "context": context, "batch": batch, "prefill": prefill,
                "policies": policies, "probe": probe or None, "reuse": reuse}
    settings = resolve(QuantizeKVSettings, opts.preset, explicit, opts.set_)
    spec = validate_quantize_kv(settings)
    body = _read(text, text_file)
    lm = load(opts)
    ids = lm.encode(body)[: settings.limit]
    if lm.context_length is not None and len(ids) > lm.context_length:
        raise ConfigError(f"--limit {settings.limit}: {len(ids)} tokens exceed the context of {lm.name!r} "
                          f"({lm.context_length}); give --limit {lm.context_length} or less")
    status = render.error_console()
    tell = (lambda label: status.print(f"[dim]{label}[/dim]")) if opts.fmt == o.Format.table else (lambda label: None)
    report = run_quantize_kv(lm, ids, settings, spec, progress=tell, drive=lambda run: drive(run, o.Format.table))
    measure_grid(lm, ids, settings, report, phase, tell)
    if report.stop_reason != "interrupted":
        measure_ranking(lm, ids, settings, report, phase, tell)
    if report.stop_reason != "interrupted":
        measure_reuse(lm, ids, settings, report, phase, tell)  # --reuse (nothing without it)
    emit(opts, lm, settings, body, ids, report)


def _read(text: str | None, text_file: Path | None) -> str:
    from ..pipeline import read_prompt
    if text is None and text_file is None:
        from ...core.engine.models import bundled_dir

        return (bundled_dir("tiny").parent / "validation.txt").read_text(encoding="utf-8")
    try:
        return read_prompt(text, text_file)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("--prompt-file", "--text-file").replace("PROMPT", "TEXT")) from None


def emit(opts, lm, settings, body: str, ids: list[int], report) -> None:
    from ...core.engine.run import Origin
    doc = report.document(Origin.of("quantize-kv", lm, as_dict(settings), [], body, ids))
    closing = output.summary_record("quantize-kv", lm.name, doc["summary"], {
        k: doc[k] for k in ("memory", "projections", "reconstruction", "outliers", "activations", "grid")})
    output.emit_for(opts, output.Output(  # csv: the grid when asked for, else reconstruction and outliers per head
        document=doc,
        jsonl=[{"type": "step", **render.clean(s.to_dict())} for s in report.fidelity.steps] + [closing],
        tables=list(quantize_kv_view.sections(report)),
        csv=[g.row() for g in report.grid] if report.grid else quantize_kv_view.layer_rows(report),
        views=lambda: quantize_kv_view.views(lm, report)))


