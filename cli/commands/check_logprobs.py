"""`decodelab check-logprobs FILE | --engine URL`: an engine's logprobs recomputed here on the same model, each token
labelled raw, penalized, temperature-scaled or renormalized, the figures trainers watch, known engine defects."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.text import Text

from ...core.errors import ConfigError
from ...core.sampling.registry import params
from ...core.settings import resolve
from .. import options as o
from ..view import render

CHECK = "Checking"

FileArg = Annotated[Optional[Path], typer.Argument(
    help="An engine's answer: OpenAI completions or chat completions JSON, a list of them, or JSONL (one a line; "
    "a line may be {\"request\": ..., \"response\": ...}).", show_default=False)]
PromptOpt = Annotated[Optional[str], typer.Option("--prompt", help="With --engine: the prompt to ask the engine "
                                                  "(the chain options are what it is asked with).",
                                                  rich_help_panel=CHECK, show_default=False)]
Tolerance = Annotated[float, typer.Option("--tolerance", help="Largest |engine - local| (nats) a label may leave "
                                          "(float32 engines agree to about 1e-5; bfloat16 ones to about 1e-2).",
                                          rich_help_panel=CHECK)]


Full = Annotated[bool, typer.Option("--full", help="With --engine: the whole next-token distribution (the engine's "
                                    "top --full-top per position, labelled truncated) against the local one: KL, TV, "
                                    "top-K overlap, log-sum-exp drift, argmax flips, position by position.",
                                    rich_help_panel=CHECK)]
FullTop = Annotated[int, typer.Option("--full-top", help="With --full: alternatives the engine lists per position (the "
                                      "vocabulary size with a vLLM run with --max-logprobs -1: exact figures).",
                                      rich_help_panel=CHECK)]
SpecEngine = Annotated[Optional[str], typer.Option("--spec-engine", help="With --full: a second server of the same "
                                                   "model with speculative decoding on; its greedy logprobs must "
                                                   "equal --engine's.", rich_help_panel=CHECK, show_default=False)]


@o.command(o.MODEL, o.GENERATE, o.OUTPUT, o.CHAIN, o.SAMPLERS, o.ENGINE,
           without=("cache", "semantics", "export", "stop"))
def check_logprobs(opts: o.Opts, file: FileArg = None, prompt: PromptOpt = None, tolerance: Tolerance = 1e-3,
                   full: Full = False, full_top: FullTop = 20, spec_engine: SpecEngine = None) -> None:
    """Recompute an engine's returned logprobs locally on the same model (-m) and say what each is: raw (the
    model at temperature 1), penalized, temperature-scaled, or renormalized over the kept set. Reports max and
    mean |delta logprob|, the mean importance ratio and the share outside [0.9, 1.1], and flags known engine
    defects (the sampled token listed twice, unsorted top logprobs, a dropped first prompt position, stale
    prompt logprobs). The sampling options say what the engine was asked (they override a logged request's)."""
    from ...core.analysis.check_logprobs import check, read_answers
    from ...core.methods.sample import SampleSettings, validate_sample
    from ..pipeline import load

    if (file is None) == (opts.engine is None):
        raise ConfigError("FILE or --engine URL: give one of them (an answer to check, or an engine to ask)")
    if file is not None and prompt is not None:
        raise ConfigError("--prompt: only with --engine (FILE holds the prompts)")
    if not tolerance > 0:
        raise ConfigError(f"--tolerance {tolerance}: must be > 0")
    if full or spec_engine is not None:
        from .check_logprobs_full import check_full

        return check_full(opts, file, prompt, tolerance, full_top, spec_engine)
    explicit = o.explicit(opts, "max_new_tokens", "seed", "ignore_eos", "top")
    given = {k for k, v in explicit.items() if v is not None and k in SETTINGS_KEYS}
    settings = resolve(SampleSettings, None, explicit, None)
    validate_sample(settings)
    if file is not None:
        from ...core.inputs import check_input_file

        check_input_file("FILE", file)
    lm = load(opts)
    if file is not None:
        answers = read_answers(file, lm, generation_defaults(lm))
        if given:  # what the engine was asked, as the options say
            for a in answers:
                a.settings, a.settings_from = settings, "options"
        source = {"file": str(file)}
        conn = None
    else:
        answers, conn = ask_engine(opts, lm, settings, prompt)
        source = {"engine": conn.describe()}
    report = check(lm, answers, tolerance, markers_from=settings)
    emit(opts, lm, source, report)


# the settings a vLLM request carries: every field with a vLLM name, the structured outputs (sent whole) aside
SETTINGS_KEYS = tuple(p.field for p in params() if "vllm" in p.export and "." not in p.export["vllm"])


def generation_defaults(lm) -> dict:
    """What vLLM fills a request's missing sampling fields with: the model's generation_config (its own keys)."""
    cfg = getattr(lm.model, "generation_config", None)
    own = cfg.to_diff_dict() if cfg is not None else {}
    return {k: own[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty") if k in own}


def ask_engine(opts: o.Opts, lm, settings, prompt: str | None):
    """One generation asked of --engine with the options' settings; its answer, ready to check."""
    from ...core.analysis.check_logprobs import answer_of_query
    from ...core.methods.served import request_for
    from ..served import connect

    if prompt is None:
        raise ConfigError("--prompt: missing; with --engine give the prompt to ask it")
    prompt_ids = lm.encode(prompt)
    conn = connect(opts, lm, {"generate": "check-logprobs --engine"})
    request, _ = request_for(conn, settings, max(1, settings.top))
    g = conn.engine.generate(prompt_ids, request)
    return [answer_of_query(g, settings, f"--engine {conn.engine.url}", lm)], conn


def emit(opts: o.Opts, lm, source: dict, report) -> None:
    """The report's document (built in core, the reasoning split included) in its format."""
    from ..view import output
    from ..view.served_view import check_table, defects_lines, figures_table

    document = report.document(lm, source)
    rows = document["tokens"]

    def views() -> list:
        where = source.get("file") or source["engine"]["url"]
        out = [check_table(report.tokens, f"{where} · recomputed on {lm.name}"), figures_table(report.summary)]
        out += [Text(line, style="red") for line in defects_lines(report.summary["defects"])]
        out += [Text(f"note: {n}", style="dim") for n in sorted({n for a in report.answers for n in a["notes"]})]
        return out + [Text(f"verdict: {report.summary['verdict']}", style="bold cyan")]

    output.emit_for(opts, output.Output(
        document=document,
        jsonl=[{"type": "token", **r} for r in rows] + [output.summary_record("check-logprobs", lm.name,
                                                                              report.summary)],
        tables=[(None, [{**{k: v for k, v in render.clean(r).items() if k != "defects"},
                         "transforms": ", ".join(r["transforms"]), "token": render.show_token(r["token"] or "")}
                        for r in rows])],
        views=views))
