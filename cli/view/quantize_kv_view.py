"""`quantize-kv`'s views: memory, fidelity, reconstruction per layer and head, outlier channels, the grid and the
ranking, and their flat rows for markdown and csv."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from . import render


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
    from .policies import ranking_table
    if not report.ranking:
        return []
    out = [ranking_table(report.ranking, f"every policy against the full cache · {report.fidelity.tokens} tokens "
                         f"fed {report.feed} a forward", report.probe is not None)]
    if report.probe is not None:
        out.append(Text("probe: " + report.probe["verdict"], style="cyan"))
    if report.reuse:
        from .reuse import reuse_plot, reuse_table, reuse_verdict
        out += [reuse_table(report.reuse), reuse_plot(report.reuse),
                Text("reuse: " + reuse_verdict(report.reuse), style="cyan")]
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
