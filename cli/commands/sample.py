"""`decodelab sample`: greedy or sampled decoding through the processor chain, one traced row per token."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ...core.errors import ConfigError
from .. import options as o
from ..loop import drive
from ..view import kept as kept_view
from ..view import output, render, sample_view
from ..view.live import LiveSteps
from ..view.steps_view import StepsTable

if TYPE_CHECKING:  # annotations only: the settings classes load torch
    from ...core.methods.sample import SampleSettings

Compile = Annotated[Optional[bool], typer.Option(
    "--compile", help="torch.compile the one-token decode step over the static cache (needs --cache static; the "
    "first steps pay the compile time).", rich_help_panel=o.RUN, show_default=False)]
BRANCH = "Branching and many samples"
NumSamples = Annotated[Optional[int], typer.Option(
    "--num-samples", "-N", help="Draw N continuations (sample i with seed + i; batched when the cache holds rows) "
    "and summarise their spread.", rich_help_panel=BRANCH, show_default=False)]
Force = Annotated[Optional[list[str]], typer.Option(
    "--force", help="STEP=TOKEN (repeatable): pick TOKEN (an id or a one-token text) at STEP; every other step keeps "
    "its random draws.", rich_help_panel=BRANCH, show_default=False)]
KeptIds = Annotated[Optional[bool], typer.Option(
    "--kept-ids", help="Also export, per step, the token ids that survive each stage of the chain (JSON: kept_sets; "
    "ids null where every token survives).", rich_help_panel=o.OUT, show_default=False)]
Resume = Annotated[Optional[Path], typer.Option(
    "--resume", help="Continue a saved `sample -f json` trace with its settings and seed (-n more tokens; options "
    "given override the saved settings).", rich_help_panel=BRANCH, show_default=False)]


@o.command(o.PROMPT, o.MODEL, o.SETTINGS, o.GENERATE, o.STOPS, o.OUTPUT, o.CHAIN, o.SAMPLERS, o.ENGINE)
def sample(opts: o.Opts, compile_: Compile = None, num_samples: NumSamples = None, force: Force = None,
           resume: Resume = None, kept_ids: KeptIds = None) -> None:
    """Generate text token by token and show, per token, the processed and the raw probability."""
    from ...core.methods.branch import Branched, load_trace, parse_force, resume_values
    from ...core.methods.sample import SampleSettings, sample_run
    from ...core.sampling.chain import refuse_stepwise_stages
    from ..pipeline import export_instead, load, read_prompt
    if num_samples is not None and num_samples < 1:
        raise ConfigError(f"--num-samples {num_samples}: must be >= 1")
    if num_samples is not None and (force or resume):
        raise ConfigError("--num-samples: cannot be combined with --force or --resume (one run each)")
    point = load_trace(resume) if resume is not None else None
    if point is not None and (opts.prompt is not None or opts.prompt_file is not None):
        raise ConfigError("--resume: the prompt comes from the saved trace; give no PROMPT")
    explicit = o.explicit(opts, "max_new_tokens", "seed", "top", "ignore_eos", "stop")
    explicit["compile"] = compile_
    if point is not None:  # the saved settings, below what is given now
        explicit = {**resume_values(point, SampleSettings), **{k: v for k, v in explicit.items()
                                                               if v is not None and v != ()}}
    from ...core.methods.registry import settings_for
    settings = settings_for("sample", opts.preset, explicit, opts.set_)
    if opts.export is not None:
        export_instead(opts, settings, load(opts))
        return
    if kept_ids and num_samples is not None:
        raise ConfigError("--kept-ids: one run's steps; not with --num-samples")
    if opts.engine is not None:
        return on_engine(opts, settings, {"--num-samples": num_samples, "--force": force, "--resume": resume,
                                          "--compile": compile_}, bool(kept_ids))
    if force:
        parse_force(force, token_id=lambda token: 0)  # the STEP=TOKEN shape, before the model loads
    text = point.prompt_text if point is not None else read_prompt(opts.prompt, opts.prompt_file)
    lm = load(opts)
    if point is not None and point.model is not None and point.model != lm.name:
        raise ConfigError(f"--resume: the trace was made with model {point.model!r}; pass -m {point.model}")
    force_steps = parse_force(force, lm.token_id) if force else None
    prompt_ids = point.prompt_ids if point is not None else lm.encode(text, opts.chat)
    if num_samples is not None:
        return many(opts, lm, settings, text, prompt_ids, num_samples)
    sampler = sample_run(lm, settings, text, prompt_ids, point.context_ids if point is not None else None,
                         kept=bool(kept_ids), block=trace_block(opts.fmt, point is not None or bool(force_steps),
                                                                render.console().is_terminal))
    if point is not None:  # skipping the saved steps' draws assumes one race vector per step and no carried state
        refuse_stepwise_stages(sampler.chain, "sample --resume")
    if point is not None or force_steps:
        sampler = Branched(sampler, force_steps, point.generated_ids if point else None, lm.vocab_size)
    table = sample_view.steps_table(lm, settings, sampler, len(point.generated_ids) if point is not None else 0)
    if opts.fmt == o.Format.table:
        with LiveSteps(render.console(), table, settings.max_new_tokens) as live:
            drive(sampler, opts.fmt, on_step=live.add)
        emit(opts, lm, settings, sampler, table, printed=live.shown)
    else:
        drive(sampler, opts.fmt, text_of=lambda: lm.decode(getattr(sampler, "all_ids", None) or sampler.new_ids),
              stops=tuple(settings.stop))
        emit(opts, lm, settings, sampler, table)


def trace_block(fmt: o.Format, branched: bool, terminal: bool) -> int:
    """Steps traced together: a document written at the end (json, csv, markdown, a table printed to a file or a
    pipe) takes its steps in blocks, one set of tensor operations per block; a stream (jsonl, text, the live table
    on a terminal) takes each step as it comes. A forced or resumed run renumbers and labels each step as it comes:
    one at a time."""
    at_end = fmt in (o.Format.json, o.Format.csv, o.Format.markdown) or (fmt == o.Format.table and not terminal)
    from ...core.methods.sample import REPORT_BLOCK
    return REPORT_BLOCK if at_end and not branched else 1


def many(opts: o.Opts, lm, settings: SampleSettings, text: str, prompt_ids: list[int], n: int) -> None:
    """-N: the samples and their spread, and where greedy samples part, the noise verdicts (the report and its
    document built in core: core/analysis/agreement.py)."""
    from ...core.analysis.agreement import sample_many_report
    report = sample_many_report(lm, settings, text, prompt_ids, n)
    rows, spread, noise = report.rows, report.spread, report.noise
    document = report.document()
    output.emit_for(opts, output.Output(
        document=document,
        jsonl=[{"type": "sample", **render.clean(r)} for r in rows]
        + [output.summary_record("sample", lm.name, spread)],
        tables=[(None, [render.clean(r) for r in rows])],
        views=lambda: render.samples_views(rows, spread, sample_view.many_title(lm.name, n, report.chain))
        + [noise_line(v) for v in noise]))


def noise_line(v: dict):
    from rich.text import Text

    return Text(f"{v['against']} parts from sample 0 at step {v['step']} ({v['token_a']} vs {v['token_b']}): "
                f"{v['words']} (margin {abs(v['margin']):.3g} vs {v['dtype']} floor {v['floor']:.3g})",
                style="yellow" if v["words"].startswith("within") else "red")


def emit(opts: o.Opts, lm, settings: SampleSettings, sampler, table: StepsTable, printed: bool = False) -> None:
    """The run's document (built in core) in its format; ``printed``: the table's rows are already on the terminal
    (live)."""
    from ...core.analysis.loops import explain
    explain(sampler, lm)  # a repetition stop's loop, into the run's document
    document = sampler.document()  # the reasoning split and the loop included (built in core)
    kept = document.get("kv_kept")
    delivered = {"text": document["text"], "token_ids": document["token_ids"]}
    kept_sets = [{"type": "kept", **k} for k in getattr(sampler, "kept_sets", [])]  # --kept-ids
    parts = (table, document, sampler.steps, lm.token_text, settings.cache)
    output.emit_for(opts, output.Output(
        document=document, text=document["text"],
        jsonl=kept_sets + [output.summary_record("sample", lm.name, delivered, document["summary"],
                                                 kept_view.document_part(kept))],
        tables=[(None, render.step_rows(sampler.steps)), *kept_view.table_part(kept)],
        views=lambda: sample_view.run_views(*parts),
        screen=(lambda: sample_view.screen_views(*parts)) if printed else None))


# --- on a served engine (--engine URL) ----------------------------------------------------------------------------


def on_engine(opts: o.Opts, settings: SampleSettings, refused: dict, kept_ids: bool) -> None:
    """sample --engine: the tokens and their numbers as the server gives them (see core/methods/served.py)."""
    from ...core.methods.served import ServedSample, request_for, request_of, require_logprobs, sample_needs
    from ..loop import note_error
    from ..pipeline import read_prompt
    from ..served import connect, local_tokenizer, refuse_options

    refuse_options("sample", refused)
    text = read_prompt(opts.prompt, opts.prompt_file)
    local = local_tokenizer(opts)
    prompt_ids = local.encode(text, opts.chat)
    request_of(local, settings, settings.top)  # a setting vLLM has no equivalent for: refused before contact
    conn = connect(opts, local, sample_needs(settings, kept_ids))
    require_logprobs(conn, "sample")
    request, notes = request_for(conn, settings, settings.top)
    run = ServedSample(conn, prompt_ids, request, notes, settings=settings, prompt_text=text)
    drive(run, opts.fmt, text_of=lambda: local.decode(run.new_ids))
    emit_engine(opts, conn, settings, text, run)
    if run.error is not None:  # the tokens are printed; the replay's failure is the exit status
        note_error(run.error)


def emit_engine(opts: o.Opts, conn, settings: SampleSettings, text: str, run) -> None:
    """The run's document (built in core: ServedSample.document) in its format."""
    document = run.document()
    summary, ids, out_text = document["summary"], document["token_ids"], document["text"]
    output.emit_for(opts, output.Output(
        document=document, text=out_text,
        jsonl=[output.summary_record("sample", conn.local.name, {"text": out_text, "token_ids": ids}, summary)],
        tables=[(None, sample_view.engine_rows(run.steps))],
        views=lambda: sample_view.engine_views(conn, run, summary, text, settings.top)))
