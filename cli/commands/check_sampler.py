"""`decodelab check-sampler PROMPT [--engine URL]`: N draws at fixed prefixes tested against the exact processed law
recomputed here (chi-square, KL of the frequencies), and the known sampler defect the draws match when they fail."""

from __future__ import annotations

from typing import Annotated

import typer

from ...core.errors import ConfigError
from .. import options as o

CHECK = "Sampler check"

Draws = Annotated[int, typer.Option("--draws", "-N", help="Draws at each prefix.", rich_help_panel=CHECK)]
Prefixes = Annotated[int, typer.Option("--prefixes", help="Fixed prefixes: the prompt, then the prompt with 1, 2, "
                                       "... tokens of its greedy continuation.", rich_help_panel=CHECK)]
Alpha = Annotated[float, typer.Option("--alpha", help="The false-alarm rate: the check fails when the combined "
                                      "chi-square p-value is below it.", rich_help_panel=CHECK)]
How = Annotated[str, typer.Option("--how", help="With --engine: seeded (N requests, seeds SEED, SEED+1, ...) or n "
                                  "(one request with n = N, vLLM).", rich_help_panel=CHECK)]
HOWS = ("seeded", "n")


@o.command(o.PROMPT, o.MODEL, o.SETTINGS, o.OUTPUT, o.CHAIN, o.SAMPLERS, o.ENGINE, ("seed",),
           without=("cache", "export", "top", "save_html"))
def check_sampler(opts: o.Opts, draws: Draws = 1000, prefixes: Prefixes = 3, alpha: Alpha = 0.01,
                  how: How = "seeded") -> int:
    """Check that a sampler draws from the law its settings define: N one-token draws at fixed prefixes (from
    --engine URL, or from the embedded runtime) against the exact processed distribution recomputed locally:
    Pearson's chi-square (cells with expected count < 5 pooled) with its p-value, the KL of the empirical
    frequencies, and, when the draws fail, the known defect they match (temperature applied twice, temperature
    ignored, truncation ignored or in the wrong order, a greedy cut-off). Exit status 1 when the check fails."""
    from ...core.analysis.sampler_check import check_sampler as run_check, require_sampled
    from ...core.methods.registry import settings_for
    from ..pipeline import load, read_prompt
    from ..view import output, render
    from ..view.audit_view import sampler_views

    if how not in HOWS:
        raise ConfigError(f"--how {how!r}: allowed: {', '.join(HOWS)}")
    if how != "seeded" and opts.engine is None:
        raise ConfigError("--how n: only with --engine (the embedded runtime draws with seeded runs)")
    if draws < 1 or draws > 1_000_000:
        raise ConfigError(f"-N {draws}: must be an integer in [1, 1000000]")
    if not 1 <= prefixes <= 64:
        raise ConfigError(f"--prefixes {prefixes}: must be an integer in [1, 64]")
    if not 0 < alpha < 1:
        raise ConfigError(f"--alpha {alpha}: the false-alarm rate must be in (0, 1)")
    settings = settings_for("sample", opts.preset, o.explicit(opts, "seed"), opts.set_)
    if opts.engine is not None and settings.semantics not in (None, "vllm"):
        raise ConfigError(f"--semantics {settings.semantics}: with --engine the settings are read as the engine "
                          "reads them (vllm)")
    if opts.engine is not None and settings.min_new_tokens:
        raise ConfigError("--min-new-tokens: not with --engine (each draw is a one-token request with EOS allowed to "
                          "be drawn; vLLM holds EOS back only without ignore_eos)")
    require_sampled(settings)  # before the model loads (the plan decides greedy; core asks again in the server's reading)
    text = read_prompt(opts.prompt, opts.prompt_file)
    lm = load(opts)
    prompt_ids = lm.encode(text, opts.chat)
    conn = None
    if opts.engine is not None:
        from ..served import connect

        conn = connect(opts, lm, {"generate": "check-sampler --engine", "seeded": "--how seeded"})
    with render.status(f"drawing {draws} tokens at each of {prefixes} prefixes"):
        result = run_check(lm, settings, prompt_ids, prefixes, draws, alpha, conn, how)
    doc = result.document(lm, settings, text, prompt_ids, conn)  # built in core
    rows = [{k: v for k, v in p.to_dict().items() if k not in ("top", "log_likelihood", "prefix_token_ids")}
            for p in result.prefixes]
    where = conn.engine.url if conn is not None else "the embedded runtime"
    output.emit_for(opts, output.Output(
        document=doc, jsonl=[{"type": "prefix", **r} for r in rows]
        + [output.summary_record("check-sampler", lm.name, result.summary())],
        tables=[(None, rows), ("laws", [render.clean(vars(f)) for f in result.laws])],
        views=lambda: sampler_views(result, f"{where} · {draws} draws per prefix against {lm.name}'s exact law")))
    return 0 if result.passed else 1
