"""`decodelab compare`: decoding settings side by side on the same prompts and seeds (coupled random draws)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from ...core.errors import EMPTY_CHAIN, ChainError, ConfigError
from ...core.settings import as_dict
from .. import options as o
from ..loop import note_error, note_interrupt
from ..view import output, render

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
                                                     "\"prompt\" and \"id\".")]
Seeds = Annotated[Optional[str], typer.Option("--seeds", help="Seeds, e.g. 0-9 or 1,3,5 (default 0).",
                                              show_default=False)]

ROW_COLUMNS = ("variant", "prompt", "seed", "text", "length", "stop_reason", "mean_logprob", "raw_perplexity",
               "distinct_1", "distinct_2", "repetition_rate", "mean_kept", "mean_entropy", "tokens_per_s")


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
    with progress(run.total, opts.fmt) as advance:
        run.on_row = lambda row: (advance(row), stream_row(row, opts.fmt))
        try:
            run.run()
        except KeyboardInterrupt:  # the rows so far are printed; main() then says "interrupted" and exits 130
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


class progress:
    """A progress bar on stderr (a terminal only, so piped output and tests stay clean)."""

    def __init__(self, total: int, fmt):
        self.bar = None
        if sys.stderr.isatty() and fmt != o.Format.jsonl:
            self.bar = Progress(TextColumn("compare"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                TextColumn("{task.description}"), console=render.error_console(), transient=True)
        self.total = total

    def __enter__(self):
        if self.bar is None:
            return lambda row: None
        self.bar.start()
        task = self.bar.add_task("", total=self.total)
        return lambda row: self.bar.update(task, advance=1, description=f"{row.variant} · prompt {row.prompt} · "
                                                                        f"seed {row.seed}")

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
        return False


def stream_row(row, fmt) -> None:
    if fmt == o.Format.jsonl:
        render.print_jsonl({"type": "row", **render.clean(row)})


def flat_row(row) -> dict:
    d = render.clean(row)
    return {k: d[k] for k in ROW_COLUMNS}


def rows_split(lm, run) -> list[dict]:
    """Per row with thinking markers, its reasoning / answer split (parts and counts; core/trace/reasoning.py)."""
    from ...core.trace import reasoning

    texts = {p.id: p.text for p in run.prompts}
    out = []
    for row in run.rows:
        settings = run.settings[row.variant, row.seed]
        part = reasoning.for_tokens(settings, lm, lm.encode(texts[row.prompt]), row.token_ids)
        if part:
            out.append({"variant": row.variant, "prompt": row.prompt, "seed": row.seed, **part["reasoning"]})
    return out


def emit(opts, lm, run: Comparison) -> None:
    from ...core.analysis.compare import variant_summary
    from ...core.sampling.chain import make_chain
    from ...core.sampling.registry import DEFAULT_ORDER
    first = run.prompts[0]
    chains = {v.name: make_chain(lm, run.settings[v.name, run.seeds[0]]).names for v in run.variants}
    doc = {"command": "compare", "model": lm.name, "device": str(lm.device),
           "dtype": str(lm.dtype).replace("torch.", ""),
           "config": {"seeds": run.seeds, **{k: v for k, v in render.clean(run.base).items() if v is not None}},
           "chain": [n for n in DEFAULT_ORDER if any(n in names for names in chains.values())],
           "chains": chains,
           "prompt": {"text": first.text, "token_ids": lm.encode(first.text)},
           "variants": [{"name": v.name, "method": v.method, "spec": v.describe(),
                         "settings": as_dict(run.settings[v.name, run.seeds[0]])} for v in run.variants],
           "prompts": [{"id": p.id, "text": p.text} for p in run.prompts],
           "rows": run.rows, "pairs": run.pairs, "summary": {"variants": variant_summary(run.rows)}}
    split = rows_split(lm, run)
    if split:
        doc["reasoning"] = split
    output.emit_for(opts, output.Output(
        document=doc,
        jsonl=[{"type": "pair", **render.clean(pair)} for pair in run.pairs]
        + [output.summary_record("compare", lm.name, {"rows": len(run.rows), "pairs": len(run.pairs)},
                                 doc["summary"])],
        tables=[(None, [flat_row(r) for r in run.rows]), (None, [render.clean(p) for p in run.pairs])],
        views=lambda: tables(lm, run)))


def fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def summary_table(summary: list[dict]) -> Table:
    """Per variant over its prompts and seeds: mean (min-max) of each measure."""
    t = Table(title="per variant: mean (min-max) over prompts and seeds", header_style="bold")
    t.add_column("variant", no_wrap=True)
    t.add_column("runs", justify="right")
    for name in ("logp", "ppl", "d-2", "rep", "H", "tok/s"):
        t.add_column(name, justify="right", no_wrap=True)
    for v in summary:
        cells = []
        for key, spec in (("mean_logprob", ".3f"), ("raw_perplexity", ".2f"), ("distinct_2", ".2f"),
                          ("repetition_rate", ".2f"), ("mean_entropy", ".2f"), ("tokens_per_s", ".1f")):
            m = v["measures"][key]
            cells.append("-" if m is None else f"{m['mean']:{spec}} ({m['min']:{spec}}-{m['max']:{spec}})")
        t.add_row(Text(v["variant"], style="bold"), str(v["runs"]), *cells)
    return t


def tables(lm, run: Comparison) -> list:
    """Per (prompt, seed): the variants side by side; then every pair's first divergence."""
    out = []
    for prompt in run.prompts:
        for seed in run.seeds:
            rows = [r for r in run.rows if r.prompt == prompt.id and r.seed == seed]
            if not rows:
                continue
            t = Table(title=f"{lm.name} · prompt {prompt.id}: {render.cut(render.one_line(prompt.text), 60)} · seed {seed}",
                      header_style="bold")
            t.add_column("variant", no_wrap=True)
            t.add_column("text", ratio=1)
            for name in ("len", "stop", "logp", "ppl", "d-1", "d-2", "rep", "kept", "H", "tok/s"):
                t.add_column(name, justify="right", no_wrap=True)
            for r in rows:
                t.add_row(Text(r.variant, style="bold"), render.one_line(r.text), str(r.length), r.stop_reason,
                          fmt(r.mean_logprob), fmt(r.raw_perplexity, ".2f"), fmt(r.distinct_1, ".2f"),
                          fmt(r.distinct_2, ".2f"), fmt(r.repetition_rate, ".2f"), fmt(r.mean_kept, ".1f"),
                          fmt(r.mean_entropy, ".2f"), fmt(r.tokens_per_s, ".1f"))
            t.caption = ("logp: mean processed log-prob; ppl: the model's own perplexity of the output; d-1/d-2: "
                         "distinct uni/bigrams; rep: repeated 4-grams; kept: candidates per step; H: processed "
                         "entropy (nats)")
            out.append(t)
    from ...core.analysis.compare import variant_summary

    out.append(summary_table(variant_summary(run.rows)))
    if run.pairs:
        t = Table(title="where the variants part (same seed = same random draws)", header_style="bold")
        t.key_columns = 4  # a, b, prompt and seed name a pair: a split panel repeats them
        for name in ("a", "b", "prompt", "seed", "first divergence", "deciding stage", "why"):
            t.add_column(name, no_wrap=name != "why")
        for p in run.pairs:
            t.add_row(p.a, p.b, p.prompt, str(p.seed), "identical" if p.first_divergence is None
                      else f"step {p.first_divergence}", p.deciding_stage or "-", p.why or "")
        out.append(t)
    return out


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
    conn = run.conn
    with progress(run.total * 2, opts.fmt) as advance:
        run.on_row = lambda row: (advance(row), stream_row(row, opts.fmt))
        try:
            run.run()
        except KeyboardInterrupt:
            note_interrupt()
    emit_engine(opts, lm, conn, run)


def emit_engine(opts, lm, conn, run) -> None:
    from ..served import document
    from ..view.served_view import engine_pairs_table

    first = run.prompts[0]
    config = {"seeds": run.seeds, **{k: v for k, v in render.clean(run.base).items() if v is not None}}
    doc = document("compare", conn, config, [], first.text, lm.encode(first.text))
    doc.update(device=str(lm.device), dtype=str(lm.dtype).replace("torch.", ""),
               variants=[{"name": v.name, "method": v.method, "spec": v.describe(),
                          "settings": as_dict(run.settings[v.name, run.seeds[0]])} for v in run.variants],
               prompts=[{"id": p.id, "text": p.text} for p in run.prompts], rows=run.rows, engine_pairs=run.pairs)
    rows_only = SimpleNamespace(prompts=run.prompts, seeds=run.seeds, rows=run.rows, pairs=[])
    output.emit_for(opts, output.Output(
        document=doc,
        jsonl=[{"type": "engine_pair", **render.clean(p)} for p in run.pairs]
        + [output.summary_record("compare", lm.name, {"rows": len(run.rows), "engine_pairs": len(run.pairs)})],
        tables=[("rows", [flat_row(r) for r in run.rows]), ("engine pairs", [render.clean(p) for p in run.pairs])],
        views=lambda: tables(lm, rows_only) + [engine_pairs_table(run.pairs)]))
    for pair in run.pairs:
        if pair.engine_error:
            note_error(ConfigError(pair.engine_error))
            break
