"""`decodelab sample`: greedy or sampled decoding through the processor chain, one traced row per token."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..core.build import build_sampler
from ..core.config import SampleSettings, as_dict, resolve, validate_sample
from ..core.semantics import plan
from ..core.step import trim_stop
from . import options as o
from . import render
from .loop import drive
from .pipeline import export_instead, load, read_prompt

Compile = Annotated[Optional[bool], typer.Option(
    "--compile", help="torch.compile the one-token decode step over the static cache (needs --cache static; the "
    "first steps pay the compile time).", rich_help_panel=o.RUN, show_default=False)]


@o.command(o.PROMPT, o.MODEL, o.SETTINGS, o.GENERATE, o.STOPS, o.OUTPUT, o.CHAIN, o.SAMPLERS)
def sample(opts: o.Opts, compile_: Compile = None) -> None:
    """Generate text token by token and show, per token, the processed and the raw probability."""
    explicit = o.explicit(opts, "max_new_tokens", "seed", "top", "ignore_eos", "stop")
    explicit["compile"] = compile_
    settings = resolve(SampleSettings, opts.preset, explicit, opts.set_)
    validate_sample(settings)
    if opts.export is not None:
        export_instead(opts, settings, load(opts))
        return
    text = read_prompt(opts.prompt, opts.prompt_file)
    lm = load(opts)
    prompt_ids = lm.encode(text, opts.chat)
    sampler = build_sampler(lm, settings, prompt_ids)
    drive(sampler, opts.fmt)
    emit(opts, lm, settings, text, prompt_ids, sampler)


def emit(opts: o.Opts, lm, settings: SampleSettings, text: str, prompt_ids: list[int], sampler) -> None:
    fmt, names = opts.fmt, sampler.chain.names
    token_ids = sampler.new_ids
    out_text = lm.decode(token_ids)
    effective = plan(settings)
    if settings.trim_stop if settings.trim_stop is not None else effective.trim_stop:
        token_ids, out_text = trim_stop(token_ids, sampler.stop_reason, sampler.rules, lm.decode)
    summary = sampler.summary()
    if fmt == o.Format.jsonl:
        render.print_jsonl({"type": "summary", "command": "sample", "model": lm.name, "text": out_text,
                            "token_ids": token_ids, **render.clean(summary)})
    elif fmt == o.Format.json:
        head = render.document("sample", lm, as_dict(settings), names, text, prompt_ids,
                               selector=sampler.selector.name)
        if settings.semantics is not None:
            head["semantics"] = effective.describe()
        render.print_json({**head, "steps": sampler.steps, "text": out_text, "token_ids": token_ids,
                           "summary": summary})
    elif fmt in (o.Format.markdown, o.Format.csv):
        render.print_rows(render.step_rows(sampler.steps), fmt.value)
    if fmt == o.Format.table or opts.save_html or opts.save_svg:
        views = [
            render.steps_table(sampler.steps, settings.top, title=f"{lm.name} · cache {settings.cache} · chain: "
                               f"{' -> '.join(names + [sampler.selector.name])}"),
            render.shaded_text(text, [(s.token, s.prob) for s in sampler.steps]),
            render.summary_line(summary),
        ]
        render.show(views, opts.save_html, opts.save_svg, to_screen=fmt == o.Format.table)
