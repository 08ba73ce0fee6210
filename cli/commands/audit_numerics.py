"""`decodelab audit-numerics PROMPT`: one text teacher-forced under a matrix of numerical conditions (dtype, batch
composition and padding, prefill vs decode vs chunks, attention implementation, device, a served engine), each
against the reference, with the measured noise floor of each dtype and the first layer beyond it."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ...core.errors import ConfigError
from .. import options as o

AUDIT = "Numerics audit"

Conditions = Annotated[Optional[str], typer.Option(
    "--conditions", help="Comma-separated conditions, each against the reference (the loaded model: whole text, "
    "batch 1): dtype:fp32|bf16|fp16, batch:N:left|right, decode, chunks:K, attn:sdpa|eager|flash, device:cpu|cuda|mps. "
    "Default: dtype:bf16,dtype:fp16,batch:3:left,batch:3:right,decode,chunks:4,attn:eager.", rich_help_panel=AUDIT,
    show_default=False)]
Greedy = Annotated[int, typer.Option("--greedy", help="Append this many greedy tokens of the reference to the text "
                                     "(prompt + its greedy continuation).", rich_help_panel=AUDIT)]
EngineDtype = Annotated[str, typer.Option("--engine-dtype", help="With --engine: the dtype the server computes in "
                                          "(its noise floor): fp32, bf16, fp16.", rich_help_panel=AUDIT)]
EngineTop = Annotated[int, typer.Option("--engine-top", help="With --engine: prompt logprobs listed per position "
                                        "(KL is bounded from them).", rich_help_panel=AUDIT)]


@o.command(o.PROMPT, o.MODEL, o.OUTPUT, o.ENGINE, without=("cache", "top", "save_html"))
def audit_numerics(opts: o.Opts, conditions: Conditions = None, greedy: Greedy = 0, engine_dtype: EngineDtype = "bf16",
                   engine_top: EngineTop = 20) -> None:
    """Teacher-force one text under each condition and hold it against the reference: max and mean |delta logprob|
    of the text's tokens, KL and TV over the whole vocabulary, the share of tokens whose probability ratio leaves
    [0.9, 1.1], argmax flips with their top-2 margins, the first divergence, and the first layer whose hidden
    states differ beyond the dtype's measured noise floor; "within numeric noise" or "not explained by numerics"."""
    from ...core.analysis.numerics import DEFAULT_MATRIX, audit, greedy_text, parse_condition
    from ...core.engine.numerics import DTYPES
    from ..pipeline import load, read_prompt
    from ..view import output, render
    from ..view.audit_view import numerics_views

    chosen = [parse_condition(c) for c in (conditions.split(",") if conditions is not None else DEFAULT_MATRIX)
              if c.strip()]
    if not chosen and opts.engine is None:
        raise ConfigError("--conditions: names no condition (and no --engine)")
    if engine_dtype not in DTYPES:
        raise ConfigError(f"--engine-dtype {engine_dtype!r}: allowed: fp32, bf16, fp16")
    if not 0 <= greedy <= 4096:
        raise ConfigError(f"--greedy {greedy}: must be an integer in [0, 4096]")
    if not 1 <= engine_top <= 1000:
        raise ConfigError(f"--engine-top {engine_top}: must be an integer in [1, 1000]")
    text = read_prompt(opts.prompt, opts.prompt_file)
    lm = load(opts)
    ids = greedy_text(lm.model, lm.encode(text, opts.chat), greedy)
    conn = None
    if opts.engine is not None:
        from ..served import connect

        conn = connect(opts, lm, {"score": "audit-numerics --engine"})
    with render.status(f"running {len(chosen)} conditions"):
        result = audit(lm, ids, chosen, conn.engine if conn is not None else None, engine_dtype, engine_top)
    doc = result.document(lm, chosen, greedy, engine_dtype, text, lm.encode(text, opts.chat),
                          conn.describe() if conn is not None else None)  # built in core
    rows = [{k: v for k, v in c.to_dict().items() if k not in ("layers", "flips", "abs_delta_logprob")}
            | {"flips": len(c.flips)} for c in result.conditions]
    output.emit_for(opts, output.Output(
        document=doc, jsonl=[{"type": "condition", **render.clean(c.to_dict())} for c in result.conditions]
        + [output.summary_record("audit-numerics", lm.name, result.summary())],
        tables=[(None, rows)],
        views=lambda: numerics_views(result, f"{lm.name} · {len(ids)} tokens · each condition against the "
                                             f"reference ({result.reference['dtype']}, whole text, batch 1)")))
