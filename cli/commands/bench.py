"""`decodelab bench`: tokens/s of decodelab against transformers `generate` on the same model and settings."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ...core.errors import ConfigError
from .. import options as o
from ..loop import note_interrupt
from ..view import bench_view, output, render

PROMPT = "God blessed Noah and his sons, and said to them"  # the opening of the bundled held-out text

Rounds = Annotated[int, typer.Option("--rounds", help="Timed rounds (after one warm-up round that also checks the "
                                     "outputs).")]
Draft = Annotated[str, typer.Option("--draft", help="Draft model for the speculative rows (a bundled name or a "
                                    "folder; the same model is transformers' assistant_model).")]
Gammas = Annotated[str, typer.Option("--gammas", help="Draft lengths for the speculative and prompt-lookup rows.")]
SettingsOpt = Annotated[Optional[str], typer.Option(
    "--settings", help="Comma-separated subset of: greedy, sampling, beam, speculative, prompt-lookup (default all).",
    show_default=False)]
Beams = Annotated[int, typer.Option("--beams", help="Beams for the beam rows.")]


def parse_gammas(text: str) -> tuple[int, ...]:
    from ...core.inputs import parse_int
    from ...core.methods.speculative.run import MAX_GAMMA

    items = [t.strip() for t in text.split(",") if t.strip()]
    try:
        gammas = [parse_int(t, "--gammas", 1, MAX_GAMMA) for t in items]
    except ConfigError:
        gammas = []
    if not gammas:
        raise ConfigError(f"--gammas {text!r}: comma-separated integers in [1, {MAX_GAMMA}], e.g. 1,2,4,8")
    return tuple(dict.fromkeys(gammas))


@o.command(o.PROMPT, o.MODEL, o.OUTPUT, without=("top", "cache", "chat"))
def bench(opts: o.Opts, max_new_tokens: o.MaxNew = None, rounds: Rounds = 5, draft: Draft = "tiny-draft",
          gammas: Gammas = "1,2,4,8", settings: SettingsOpt = None, beams: Beams = 4) -> None:
    """decodelab against transformers `generate` (greedy, sampling, beam; speculative against assisted generation
    and prompt lookup), trace on and off: interleaved rounds, medians and paired ratios."""
    import torch

    from ...core.analysis.bench import Bench, bench_document, parse_settings, warm_summary
    from ...core.engine.models import load_draft
    from ..pipeline import load, read_prompt

    chosen = parse_settings(settings)
    g = parse_gammas(gammas)
    n = 128 if max_new_tokens is None else max_new_tokens
    if rounds < 1:
        raise ConfigError(f"--rounds {rounds}: must be >= 1")
    if beams < 1:
        raise ConfigError(f"--beams {beams}: must be >= 1")
    text = PROMPT if opts.prompt is None and opts.prompt_file is None else read_prompt(opts.prompt, opts.prompt_file)
    lm = load(opts)  # sets --threads
    draft_lm = load_draft(draft, lm, opts.dtype, opts.trust_remote_code) if "speculative" in chosen else None
    prompt_ids = lm.encode(text)
    run = Bench(lm.model, prompt_ids, n, chosen, draft_lm.model if draft_lm else None, g, beams)
    err = render.error_console()
    stop_reason = "end"
    try:
        run.time(rounds, on_round=lambda r: err.print(f"bench: round {r + 1}/{rounds}") if err.is_terminal else None)
    except KeyboardInterrupt:  # the whole rounds so far are reported; main() then exits 130
        note_interrupt()
        stop_reason = "interrupted"
    rows = run.rows() if run.keep_whole_rounds() else []
    config = {"max_new_tokens": n, "rounds": rounds, "draft": draft if draft_lm else None, "gammas": list(g),
              "settings": list(chosen), "beams": beams, "threads": torch.get_num_threads()}
    doc = bench_document(lm, config, chosen, text, prompt_ids, rows, stop_reason, warm_summary(run))
    output.emit_for(opts, output.Output(
        document=doc,
        jsonl=[{"type": "row", **render.clean(r)} for r in rows]
        + [output.summary_record("bench", lm.name, doc["summary"])],
        tables=[(None, [render.clean(r) for r in rows])], views=lambda: [bench_view.bench_table(lm, n, rows)]))
