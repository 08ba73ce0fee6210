"""`decodelab quantize-kv`: a quantized KV cache's memory against the full one, its fidelity on a text, the
reconstruction error per layer and head, and the outlier channels that set the scales."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text

from ...core.errors import ConfigError
from ...core.settings import as_dict, resolve
from .. import options as o
from ..loop import drive, phase
from ..view import output, render

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
        fidelity,
        grid_cells,
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
    cells = grid_cells(settings)
    for k, cell in enumerate(cells):
        tell(f"grid {k + 1}/{len(cells)}: {cell}")
        measured = phase(lambda: fidelity(lm, ids, cell, settings.feed))  # noqa: B023 (called at once)
        if measured is None:  # Ctrl-C: the cells so far are reported, main() then exits 130
            report.stop_reason = "interrupted"
            break
        report.grid.append(measured)
    if report.stop_reason != "interrupted":
        measure_ranking(lm, ids, settings, report, tell)
    emit(opts, lm, settings, body, ids, report)


def measure_ranking(lm, ids: list[int], settings, report, tell) -> None:
    """--policies: each cache's fidelity (and probe) one at a time, so an interrupt keeps the rows measured."""
    from ...core.analysis.policies import fidelity_row, ranked
    from ...core.analysis.probe import Prober, ProbeSettings
    from ...core.analysis.quantize_kv import fidelity, ranking_cells
    from ..view.policies import probe_document
    cells = ranking_cells(settings)
    prober = Prober(lm.model, lm.tokenizer, ids, ProbeSettings(), lm.context_length) if settings.probe else None
    rows, full_bytes = [], 0
    for k, (label, cell) in enumerate(cells.items()):
        tell(f"policy {k + 1}/{len(cells)}: {label}")
        measured = phase(lambda: (fidelity(lm, ids, cell, settings.feed, keep_steps=True,  # noqa: B023
                                           prefill=settings.prefill),
                                  prober.policy(cell, label) if prober else None))  # noqa: B023
        if measured is None:
            report.stop_reason = "interrupted"
            break
        full_bytes = full_bytes or measured[0].kv_bytes
        rows.append(fidelity_row(label, measured[0], full_bytes, measured[1]))
    report.ranking = ranked(rows)
    if prober is not None and rows:
        report.probe = probe_document(prober.report([]))
    if settings.reuse is not None and report.stop_reason != "interrupted":
        measure_reuse(lm, ids, settings, report, tell)


def measure_reuse(lm, ids: list[int], settings, report, tell) -> None:
    """--reuse: each --policies cache compressed once and asked every question (one cache at a time)."""
    from ...core.analysis.quantize_kv import ranking_cells
    from ...core.analysis.reuse import build_case, ranked, reuse_row
    case = build_case(lm.tokenizer, ids, settings.reuse, lm.context_length)
    rows = []
    for k, (label, cell) in enumerate(ranking_cells(settings).items()):
        tell(f"reuse {k + 1}: {label}")
        measured = phase(lambda: reuse_row(lm.model, case, cell, label))  # noqa: B023 (called at once)
        if measured is None:
            report.stop_reason = "interrupted"
            break
        rows.append(measured)
    report.reuse = [r.row() for r in ranked(rows)] if rows else []


def _read(text: str | None, text_file: Path | None) -> str:
    from ..pipeline import read_prompt
    if text is None and text_file is None:
        from ...core.engine.models import bundled_dir

        return (bundled_dir("tiny").parent / "validation.txt").read_text(encoding="utf-8")
    try:
        return read_prompt(text, text_file)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("--prompt-file", "--text-file").replace("PROMPT", "TEXT")) from None


def document(lm, settings, body: str, ids: list[int], report) -> dict:
    head = render.document("quantize-kv", lm, as_dict(settings), [], body, ids)
    steps = [s.to_dict() for s in report.fidelity.steps]
    return {**head, "steps": steps, "text": "", "token_ids": [], "memory": report.memory,
            "projections": report.projections, "reconstruction": report.reconstruction, "outliers": report.outliers,
            "activations": report.activations, "grid": [g.row() for g in report.grid], "summary": report.summary(),
            **({"ranking": report.ranking} if report.ranking else {}),
            **({"probe": report.probe} if report.probe else {}),
            **({"reuse": report.reuse} if report.reuse else {})}


def emit(opts, lm, settings, body: str, ids: list[int], report) -> None:
    doc = document(lm, settings, body, ids, report)
    closing = output.summary_record("quantize-kv", lm.name, doc["summary"], {
        k: doc[k] for k in ("memory", "projections", "reconstruction", "outliers", "activations", "grid")})
    output.emit_for(opts, output.Output(  # csv: the grid when asked for, else reconstruction and outliers per head
        document=doc,
        jsonl=[{"type": "step", **render.clean(s.to_dict())} for s in report.fidelity.steps] + [closing],
        tables=list(sections(report)), csv=[g.row() for g in report.grid] if report.grid else layer_rows(report),
        views=lambda: views(lm, report)))


# --- flat rows (markdown, csv) ---------------------------------------------------------------------------------------


def memory_rows(report) -> list[dict]:
    m = report.memory
    per_token = report.fidelity.kv_bytes / m["tokens"]
    return [
        # a quantized cache's spec is in the title line: the long spec in a cell would squeeze the numbers
        {"what": "quantized cache, measured" if report.reconstruction else f"({report.cache}), measured",
         "bytes_per_token": per_token,
         "bytes": report.fidelity.kv_bytes},
        {"what": f"full cache ({m['cache_dtype']})", "bytes_per_token": m["bytes_per_token"],
         "bytes": m["baseline_kv_bytes"]},
        {"what": "full cache (float16)", "bytes_per_token": m["fp16_bytes_per_token"], "bytes": m["fp16_kv_bytes"]},
        {"what": f"full cache without GQA ({m['heads']} kv heads, {m['cache_dtype']})",
         "bytes_per_token": m["bytes_per_token_without_gqa"], "bytes": m["bytes_per_token_without_gqa"] * m["tokens"]},
    ]


def layer_rows(report) -> list[dict]:
    """Per layer and head: reconstruction errors, with the layer's key/value outlier figures."""
    out = {(o_["layer"], o_["kind"]): o_ for o_ in report.outliers}
    rows = []
    for r in report.reconstruction:
        if not out:  # a code without scales (turbo): no outlier view of them
            rows.append(dict(r))
            continue
        k, v = out[(r["layer"], "keys")], out[(r["layer"], "values")]
        rows.append({**r, "key_scale_setter": k["scale_setter"]["channel"],
                     "key_max_over_median": k["max_over_median"]["max"],
                     "value_scale_setter": v["scale_setter"]["channel"],
                     "value_max_over_median": v["max_over_median"]["max"]})
    return rows


def outlier_rows(outliers: list[dict]) -> list[dict]:
    rows = []
    for o_ in outliers:
        row = {k: o_[k] for k in ("layer", "kind") if k in o_}
        row.update(scale_setter=o_["scale_setter"]["channel"], setter_max=o_["scale_setter"]["max"],
                   setter_x_typical=o_["scale_setter"]["times_typical_channel_max"],
                   max_over_median=o_["max_over_median"]["max"],
                   bits_lost=o_["bits_lost_per_tensor_vs_channel"],
                   **{f"err_{axis}": v["rel_error"] for axis, v in o_["layouts"].items()})
        rows.append(row)
    return rows


def sections(report) -> list[tuple[str, list[dict]]]:
    out = [("summary", [report.summary()]), ("memory", memory_rows(report)),
           ("projected bytes", report.projections), ("reconstruction per layer and head", report.reconstruction),
           ("outliers per layer", outlier_rows(report.outliers))]
    if report.activations is not None:
        out.append((f"activations (input of layer {report.activations['layer']})",
                    outlier_rows([report.activations])))
    if report.grid:
        out.append(("grid: bits x layout", [g.row() for g in report.grid]))
    if report.ranking:
        out.append(("every policy against the full cache", [render.clean(r) for r in report.ranking]))
    if report.reuse:
        out.append(("one compressed context, several questions",
                    [{k: v for k, v in r.items() if k != "answers"} for r in report.reuse]))
    return out


# --- rich views ------------------------------------------------------------------------------------------------------


def mib(n) -> str:
    return "?" if n is None else f"{n / 2**20:,.2f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def views(lm, report) -> list:
    m, f = report.memory, report.fidelity
    out = [Text(f"{lm.name} · {report.cache} · keys: {report.keys} · values: {report.values}", style="bold")]
    mem = Table(title=f"memory after {m['tokens']} tokens · per token: {m['formula']} = 2 x {m['layers']} x "
                f"{m['kv_heads']} x {m['head_dim']} x bytes", header_style="bold")
    for name in ("cache", "bytes / token", "bytes", "x fp16"):
        mem.add_column(name, justify="left" if name == "cache" else "right")
    for row in memory_rows(report):
        mem.add_row(row["what"], f"{row['bytes_per_token']:,.1f}", mib(row["bytes"]),
                    f"{row['bytes'] / m['fp16_kv_bytes']:.3f}")
    mem.caption = (f"grouped-query attention: {m['heads']} query heads share {m['kv_heads']} kv heads, "
                   f"{m['gqa_saving']:.1f}x fewer bytes; bytes are the stored tensors (codes, scales, zero points, "
                   "exact window)")
    out.append(mem)
    proj = Table(title="projected", header_style="bold")
    for name in ("at", "tokens", "batch", "quantized", "full", "fp16", "x fp16", "fits"):
        proj.add_column(name, justify="right")
    free = m.get("available_bytes")
    for p in report.projections:
        fits = "?" if p["fits"] is None else ("yes" if p["fits"] else "NO")
        proj.add_row(p["at"], str(p["tokens"]), str(p["batch"]), mib(p["kv_bytes"]), mib(p["baseline_kv_bytes"]),
                     mib(p["fp16_kv_bytes"]), f"{p['bytes_ratio']:.3f}", fits)
    proj.caption = f"fits: within the {mib(free)} free where the cache lives (device memory, else system memory)"
    if report.projections:
        out.append(proj)
    out.append(Text(f"fidelity over {f.tokens} tokens (fed {report.feed} a forward), against the full cache: "
                    f"KL(full || this cache) mean {f.kl_mean:.5f} nats · top-1 agreement {f.top1_agreement:.4f} · "
                    f"perplexity {f.perplexity:.3f} vs {f.baseline_perplexity:.3f} "
                    f"({f.perplexity / f.baseline_perplexity - 1:+.2%})", style="cyan"))
    if report.reconstruction:  # a quant cache (a press has no reconstruction or scales)
        out.append(layer_table(report))
        out.append(outlier_table(report.outliers, "outliers: the channels that set the scale (max|x| / median|x| "
                                 "over tokens) and the relative error of each scaling at these bits"))
    if report.activations is not None:
        out.append(outlier_table([report.activations], f"activations: input of decoder layer "
                                                      f"{report.activations['layer']}"))
    if report.grid:
        out.append(grid_table(report))
    out += ranking_views(report)
    out.append(render.summary_line(report.summary()))
    return out


def ranking_views(report) -> list:
    from ..view.policies import ranking_table
    if not report.ranking:
        return []
    out = [ranking_table(report.ranking, f"every policy against the full cache · {report.fidelity.tokens} tokens "
                         f"fed {report.feed} a forward", report.probe is not None)]
    if report.probe is not None:
        out.append(Text("probe: " + report.probe["verdict"], style="cyan"))
    if report.reuse:
        from ..view.reuse import reuse_table, reuse_verdict
        out += [reuse_table(report.reuse), Text("reuse: " + reuse_verdict(report.reuse), style="cyan")]
    return out


def layer_table(report) -> Table:
    table = Table(title="reconstruction ||x - x'|| / ||x|| per layer (mean over heads; worst head)",
                  header_style="bold")
    for name in ("layer", "keys mean", "keys worst", "values mean", "values worst"):
        table.add_column(name, justify="right")
    by_layer: dict[int, list[dict]] = {}
    for r in report.reconstruction:
        by_layer.setdefault(r["layer"], []).append(r)
    for layer, rows in by_layer.items():
        k = [r["key_rel_error"] for r in rows]
        v = [r["value_rel_error"] for r in rows]
        table.add_row(str(layer), f"{sum(k) / len(k):.4f}", f"{max(k):.4f} (h{k.index(max(k))})",
                      f"{sum(v) / len(v):.4f}", f"{max(v):.4f} (h{v.index(max(v))})")
    return table


def outlier_table(outliers: list[dict], title: str) -> Table:
    table = Table(title=title, header_style="bold")
    table.key_columns = 2  # layer and tensor name a row: a split panel repeats both
    for name in ("layer", "tensor", "scale set by", "x typical", "max/median", "bits lost", "per tensor",
                 "per token", "per channel", "grouped"):
        table.add_column(name, justify="right")
    for row in outlier_rows(outliers):
        table.add_row(str(row.get("layer", "")), row.get("kind", "activations"), row["scale_setter"],
                      f"{row['setter_x_typical']:.1f}", f"{row['max_over_median']:.1f}", f"{row['bits_lost']:.2f}",
                      f"{row['err_tensor']:.4f}", f"{row['err_token']:.4f}", f"{row['err_channel']:.4f}",
                      f"{row['err_group']:.4f}")
    table.caption = ("x typical: the setter's max over the median channel's max; bits lost: log2 of the per-tensor "
                     "step over the mean per-channel step")
    return table


def grid_table(report) -> Table:
    residual = int(report.grid[0].cache.split("residual=")[1].split(",")[0]) if "residual=" in report.grid[0].cache else 0
    window = f"every cell keeps the last {residual} tokens exact" if residual else "every token quantized in every cell"
    table = Table(title=f"grid: x fp16 bytes · perplexity change · top-1 agreement ({window})", header_style="bold")
    axes = list(dict.fromkeys(g.cache.split("axis=")[1].split(",")[0] for g in report.grid))
    table.add_column("bits", justify="right")
    for axis in axes:
        table.add_column(axis, justify="right")
    rows: dict[str, dict[str, str]] = {}
    for g in report.grid:
        bits = g.cache.split("bits=")[1].split(",")[0]
        axis = g.cache.split("axis=")[1].split(",")[0]
        rows.setdefault(bits, {})[axis] = (f"{g.bytes_ratio:.2f}x {g.perplexity / g.baseline_perplexity - 1:+.1%} "
                                           f"{g.top1_agreement:.3f}")
    for bits, cells in rows.items():
        table.add_row(bits, *[cells.get(a, "") for a in axes])
    return table
