"""`check-logprobs --full --engine URL --prompt TEXT [--spec-engine URL2]`: the engine's whole next-token
distribution against the local one, position by position (core/analysis/full_logprobs.py)."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from ...core.errors import ConfigError
from .. import options as o


def check_full(opts: o.Opts, file, prompt: str | None, tolerance: float, top: int, spec_engine: str | None) -> None:
    from ...core.analysis.full_logprobs import full_check, speculative_drift
    from ...core.engine.http.client import ServedEngine
    from ...core.engine.http.transport import base_url
    from ..pipeline import load
    from ..served import connect
    from ..view import output, render

    if file is not None or opts.engine is None:
        raise ConfigError("--full: with --engine URL and --prompt (the distributions are asked of the engine)")
    if prompt is None:
        raise ConfigError("--prompt: missing; with --engine give the prompt to ask it")
    if not 1 <= top <= 1_000_000:
        raise ConfigError(f"--full-top {top}: must be an integer in [1, 1000000]")
    if spec_engine is not None:
        base_url(spec_engine)
    n = opts.max_new_tokens if opts.max_new_tokens is not None else 16
    lm = load(opts)
    prompt_ids = lm.encode(prompt)
    conn = connect(opts, lm, {"score": "check-logprobs --full"})
    # the connection's client lists at most 20 (vLLM's default --max-logprobs); a larger --full-top asks a client
    # allowed that many (the server refuses it unless it runs with a larger --max-logprobs)
    engine = conn.engine if top <= (conn.engine.capabilities.max_top_n or top) else ServedEngine(
        opts.engine, model=conn.engine.model, logprobs_mode=conn.logprobs_mode, timeout=opts.engine_timeout,
        max_top_n=top)
    with render.status(f"scoring {len(prompt_ids) + n} tokens on {opts.engine}"):
        report = full_check(engine, lm, prompt_ids, n, top)
    if spec_engine is not None:
        other = ServedEngine(spec_engine, model=conn.engine.model, timeout=opts.engine_timeout)
        report.speculative = speculative_drift(conn.engine, other, prompt_ids, n, min(top, 20), tolerance)
    doc = report.document(lm, {"engine": conn.describe()}, prompt, prompt_ids)  # built in core
    spec, summary = report.speculative, doc["summary"]
    output.emit_for(opts, output.Output(
        document=doc, jsonl=[{"type": "position", **render.clean(r.to_dict())} for r in report.positions]
        + [output.summary_record("check-logprobs", lm.name, summary)],
        tables=[(None, [render.clean(r.to_dict()) for r in report.positions])],
        views=lambda: [full_table(report, lm.name, opts.engine), summary_text(summary, spec)]))


def _f(x, d=3) -> str:
    return "-" if x is None else f"{x:.{d}g}"


def full_table(report, model: str, url: str) -> Table:
    s = report.summary
    label = f"top-{s['top_n']} truncated: KL and TV are bounds" if s["truncated"] else "whole vocabulary: exact"
    t = Table(title=f"{url} against {model}, position by position ({label})", header_style="bold")
    for col in ("pos", "token", "KL lower", "KL upper", "TV lower", "TV upper", "top-K overlap", "LSE drift",
                "|Δ logprob|", "argmax (engine / local)", "local margin"):
        t.add_column(col, justify="right")
    for r in report.positions:
        flip = r.engine_argmax != r.local_argmax
        t.add_row(str(r.position), str(r.token_id), _f(r.kl_lower), _f(r.kl_upper), _f(r.tv_lower), _f(r.tv_upper),
                  _f(r.topk_overlap, 2), _f(r.lse_drift), _f(r.abs_delta_logprob),
                  Text(f"{r.engine_argmax} / {r.local_argmax}", style="red" if flip else ""), _f(r.local_margin))
    return t


def summary_text(s: dict, spec: dict | None) -> Text:
    line = (f"KL mean in [{_f(s['kl_lower_mean'])}, {_f(s['kl_upper_mean'])}], TV mean in [{_f(s['tv_lower_mean'])}, "
            f"{_f(s['tv_upper_mean'])}], top-K overlap {_f(s['topk_overlap_mean'], 2)}, LSE drift "
            f"[{_f(s['lse_drift_min'])}, {_f(s['lse_drift_max'])}], max |Δ logprob| {_f(s['max_abs_delta_logprob'])}, "
            f"{len(s['argmax_flips'])} argmax flip(s)")
    if spec is not None:
        line += ("; speculative decoding: " + (spec["defect"] or f"same tokens, logprobs within {spec['tolerance']:g}"))
    return Text(line, style="bold cyan")
