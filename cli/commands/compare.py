"""`decodelab compare`: decoding settings side by side on the same prompts and seeds (coupled random draws)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ...core.errors import EMPTY_CHAIN, ChainError, ConfigError
from .. import options as o
from ..loop import note_error, note_interrupt
from ..view import compare_view, output, render

if TYPE_CHECKING:  # the core (and torch) load when a command runs, not for --help
    from ...core.analysis.compare import Comparison, Prompt

Prompts = Annotated[Optional[list[str]], typer.Argument(help="Prompts to compare on (or --prompts-file).",
                                                        show_default=False)]
VariantOpt = Annotated[Optional[list[str]], typer.Option(
    "--variant", "-V", help="'name: key=value,...' (repeatable). Keys: the settings (temperature, top_p, ...), "
    "method=sample|beam|speculate, cache=SPEC, preset=NAME.", show_default=False)]
Presets = Annotated[Optional[list[str]], typer.Option("--preset", "-p", help="A preset as one variant "
                                                      "(repeatable).", show_default=False)]
Job = Annotated[Optional[Path], typer.Option("--job", help="A job file: TOML ([[variant]] tables, optional prompts, "
                                             "seeds, [defaults]) or JSONL (one variant object a line).")]
PromptsFile = Annotated[Optional[Path], typer.Option("--prompts-file", help="One prompt a line, or JSONL with "
                                                     "\"prompt\", \"id\" and, as in batch, any setting but seed "
                                                     "(it overrides every variant's for that prompt).")]
Seeds = Annotated[Optional[str], typer.Option("--seeds", help="Seeds, e.g. 0-9 or 1,3,5 (default 0).",
                                              show_default=False)]

@o.command(o.MODEL, o.GENERATE, o.OUTPUT, o.CHAIN, o.ENGINE, without=("seed", "top", "cache"))
def compare(opts: o.Opts, prompts: Prompts = None, variant: VariantOpt = None, preset: Presets = None,
            job: Job = None, prompts_file: PromptsFile = None, seeds: Seeds = None) -> None:
    """Several settings side by side on the same prompts and seeds; each seed's random draws are shared by every
    variant, so a difference comes from the settings. Each pair: the first step where they part, and the stage
    that made the difference."""
    from ...core.analysis.compare import (
        Comparison,
        check_names,
        load_job,
        parse_seeds,
        parse_variant,
        preset_variant,
    )
    from ...core.engine.models import load_draft
    from ..pipeline import load
    variants, extras = [], {}
    if job is not None:
        variants, extras = load_job(job)
    variants += [preset_variant(p) for p in preset or []]
    variants += [parse_variant(v, len(variants) + i) for i, v in enumerate(variant or [])]
    check_names(variants)
    prompt_list = collect_prompts(prompts, prompts_file, extras.get("prompts"))
    seed_list = parse_seeds(seeds if seeds is not None else extras.get("seeds", "0"))
    base = o.explicit(opts, "max_new_tokens", "ignore_eos", "stop")  # every variant starts from these
    if opts.engine is not None:
        return on_engine(opts, variants, prompt_list, seed_list, base)
    lm = load(opts)
    drafts = lambda spec: load_draft(spec, lm, opts.dtype, opts.trust_remote_code)  # noqa: E731
    run = Comparison(lm, variants, prompt_list, seed_list, base, load_draft=drafts)
    with compare_view.progress(run.total, opts.fmt) as advance:
        run.on_row = lambda row: (advance(row), stream_row(row, opts.fmt))
        try:
            run.run()
        except KeyboardInterrupt:  # the rows so far are printed; main() then says "interrupted" and exits 130
            run.interrupted = True
            note_interrupt()
    emit(opts, lm, run)
    report_empty_chains(run.rows)


def report_empty_chains(rows) -> None:
    """A row whose chain left no candidate ended early (stop_reason empty_chain) while the others ran on: every
    row is printed, then the error line, and the exit status is 2."""
    for row in rows:
        if row.stop_reason == EMPTY_CHAIN:
            note_error(ChainError(f"variant {row.variant} (prompt {row.prompt}, seed {row.seed}): its chain left no "
                                  f"candidate token after {row.length} tokens (stop_reason {EMPTY_CHAIN}); loosen "
                                  "its filters or bans"))
            return


def collect_prompts(args: list[str] | None, path: Path | None, from_job) -> list[Prompt]:
    from ...core.analysis.compare import Prompt, read_prompts
    if args and path is not None:
        raise ConfigError("PROMPTS and --prompts-file: give one of them, not both")
    if path is not None:
        return read_prompts(path)
    texts = args or from_job
    if not texts:
        raise ConfigError("PROMPTS: missing; give prompts as arguments, --prompts-file, or prompts in the job file")
    if isinstance(texts, str):
        texts = [texts]
    return [Prompt(str(i), t) for i, t in enumerate(texts, 1)]


def stream_row(row, fmt) -> None:
    if fmt == o.Format.jsonl:
        render.print_jsonl({"type": "row", **render.clean(row)})


def emit(opts, lm, run: Comparison) -> None:
    """The comparison's document (built in core) in its format."""
    doc = run.document()
    output.emit_for(opts, output.Output(
        document=doc,
        jsonl=[{"type": "pair", **render.clean(pair)} for pair in doc["pairs"]]
        + [output.summary_record("compare", lm.name, {"rows": len(run.rows), "pairs": len(run.pairs)},
                                 doc["summary"])],
        tables=[(None, [compare_view.settings_row(run, r, doc["pairs"]) for r in run.rows]),
                (None, [render.clean(p) for p in doc["pairs"]])],
        views=lambda: compare_view.tables(lm, run, doc["pairs"])))


# --- on a served engine (--engine URL) ----------------------------------------------------------------------------


def on_engine(opts, variants, prompts, seeds, base: dict) -> None:
    """compare --engine: every variant on the server and here (read as vLLM reads it), token by token and
    distribution by distribution (core/analysis/engine_compare.py)."""
    from ...core.analysis.engine_compare import EngineComparison
    from ..pipeline import load
    from ..served import connect

    lm = load(opts)
    run = EngineComparison(lm, None, variants, prompts, seeds, base)  # every setting checked before contact
    run.conn = connect(opts, lm, {"generate": "compare --engine", "replay": "compare --engine (teacher-forced KL)"})
    with compare_view.progress(run.total * 2, opts.fmt) as advance:
        run.on_row = lambda row: (advance(row), stream_row(row, opts.fmt))
        try:
            run.run()
        except KeyboardInterrupt:
            note_interrupt()
    emit_engine(opts, lm, run)


def emit_engine(opts, lm, run) -> None:
    """The comparison's document (built in core: EngineComparison.document) in its format."""
    from ..view.served_view import engine_pairs_table

    doc = run.document()
    rows_only = SimpleNamespace(prompts=run.prompts, seeds=run.seeds, rows=run.rows, pairs=[])
    output.emit_for(opts, output.Output(
        document=doc,
        jsonl=[{"type": "engine_pair", **render.clean(p)} for p in run.pairs]
        + [output.summary_record("compare", lm.name, {"rows": len(run.rows), "engine_pairs": len(run.pairs)})],
        tables=[("rows", [compare_view.flat_row(r) for r in run.rows]),
                ("engine pairs", [render.clean(p) for p in run.pairs])],
        views=lambda: compare_view.tables(lm, rows_only) + [engine_pairs_table(run.pairs)]))
    for pair in run.pairs:
        if pair.engine_error:
            note_error(ConfigError(pair.engine_error))
            break
