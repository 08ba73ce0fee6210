"""`decodelab speculate`: speculative decoding with a draft model or an n-gram proposer, traced per round."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text

from ...core.settings import as_dict
from .. import options as o
from ..loop import drive, interrupted, phase
from ..view import output, render
from ..view.live import LiveSteps

SPEC = "Speculative decoding"

DraftOpt = Annotated[Optional[str], typer.Option(
    "--draft", help="Proposer: a draft model sharing the target's vocabulary (bundled name or folder), or 'ngram' "
    "(prompt lookup) (default tiny-draft).", rich_help_panel=SPEC, show_default=False)]
GammaOpt = Annotated[Optional[int], typer.Option("--gamma", "-g", help="Tokens drafted per round, >= 1 "
                                                 "(default 4).", rich_help_panel=SPEC, show_default=False)]
NgramSizeOpt = Annotated[Optional[int], typer.Option("--ngram-size", help="Longest n-gram the 'ngram' proposer "
                                                     "matches, falling back to shorter ones (default 3).",
                                                     rich_help_panel=SPEC, show_default=False)]
SweepOpt = Annotated[Optional[str], typer.Option("--sweep-gamma", help="Also measure these gammas, e.g. "
                                                 "1,2,3,4,6,8, and name the best.", rich_help_panel=SPEC)]
RoundsOpt = Annotated[Optional[int], typer.Option(
    "--speedup-rounds", help="Timing rounds behind the measured speedup: speculative and plain decoding alternate, "
    "each round gives plain / speculative time per token; reported: median, min, max (1..100, default 3; 1 = one "
    "pair).", rich_help_panel=SPEC, show_default=False)]


@o.command(o.PROMPT, o.MODEL, o.SETTINGS, o.GENERATE, ("stop_id",), o.OUTPUT, o.CHAIN, o.SAMPLERS,
           without=("device_map",))
def speculate(
    opts: o.Opts,
    draft: DraftOpt = None,
    gamma: GammaOpt = None,
    ngram_size: NgramSizeOpt = None,
    sweep_gamma: SweepOpt = None,
    speedup_rounds: RoundsOpt = None,
) -> None:
    """A proposer drafts tokens, the target verifies a block per forward; shows every accept/reject and the speedup."""
    from ...core.engine.models import load_draft
    from ...core.methods.speculative.run import (
        SpeedupRounds,
        best_gamma,
        with_gamma,
        build_speculator,
        parse_gammas,
        warm_up_speculate,
    )
    from ...core.sampling.chain import make_chain
    from ..pipeline import export_instead, load, read_prompt
    explicit = o.explicit(opts, "max_new_tokens", "seed", "top", "ignore_eos", "stop")
    explicit.update(draft=draft, gamma=gamma, ngram_size=ngram_size, sweep_gamma=parse_gammas(sweep_gamma),
                    speedup_rounds=speedup_rounds)
    from ...core.methods.registry import settings_for
    settings = settings_for("speculate", opts.preset, explicit, opts.set_)
    if opts.export is not None:
        export_instead(opts, settings, load(opts))
        return
    text = read_prompt(opts.prompt, opts.prompt_file)
    lm = load(opts)
    draft_lm = None if settings.draft == "ngram" else load_draft(settings.draft, lm, opts.dtype,
                                                                 opts.trust_remote_code)
    processors = make_chain(lm, settings)
    prompt_ids = lm.encode(text, opts.chat)
    phase(lambda: warm_up_speculate(lm, draft_lm, settings, prompt_ids, processors))
    # with --sweep-gamma the sweep runs first, so the run shown (traced) is the gamma the sweep names best
    sweep, measured = [], {}
    gammas = [int(x) for x in settings.sweep_gamma]
    for k, g in enumerate(gammas):
        if interrupted():
            break  # the rows measured so far are kept
        progress(f"speculate: timing gamma {g} ({k + 1}/{len(gammas)}, {settings.speedup_rounds} rounds each)")
        row = SpeedupRounds(lm, draft_lm, settings, prompt_ids, processors, g)
        phase(row.run)
        if row.rounds:  # a gamma cut before its first round completed has no row
            sweep.append(row.first.summary(row.rounds))
            measured[g] = row.rounds
    best = best_gamma(sweep) if sweep else None
    shown = best if best is not None else settings.gamma
    settings = with_gamma(settings, shown)
    spec = build_speculator(lm, draft_lm, settings, prompt_ids, shown, processors)
    if interrupted():
        spec.interrupt()  # Ctrl-C before the shown run: an empty run, reported as interrupted
    else:
        with LiveSteps(render.console(), None, unit="rounds", enabled=opts.fmt == o.Format.table) as live:
            drive(spec, opts.fmt, row=lambda rnd: render.clean(rnd.to_dict()), on_step=live.add,
                  text_of=lambda: lm.decode(spec.new_ids), stops=tuple(settings.stop))
    if shown in measured:
        rounds = measured[shown]  # the sweep timed this gamma already, on the same tokens
    else:  # the shown run is round 1's speculative half; a Ctrl-C keeps the rounds completed (none: speedups null)
        progress(f"speculate: timing against plain decoding ({settings.speedup_rounds} rounds)")
        timing = SpeedupRounds(lm, draft_lm, settings, prompt_ids, processors, shown, first=spec)
        phase(timing.run)
        rounds = timing.rounds
    summary = spec.summary(rounds)
    emit(opts.fmt, lm, settings, processors, text, prompt_ids, spec, summary, sweep, best, opts.save_html,
         opts.save_svg)


def progress(message: str) -> None:
    """A line on stderr for a phase that takes a while (timing rounds, the gamma sweep), on a terminal only."""
    err = render.error_console()
    if err.is_terminal:
        err.print(message, style="dim")


def emit(fmt, lm, settings, processors, text, prompt_ids, spec, summary, sweep, best, save_html, save_svg) -> None:
    from ...core.trace import reasoning
    token_ids = spec.new_ids
    out_text = lm.decode(token_ids)
    extra = {"sweep": [r.to_dict() for r in sweep], "best_gamma": best} if sweep else {}
    extra.update(reasoning.for_tokens(settings, lm, prompt_ids, token_ids))  # the split (docs/reasoning.md)
    head = render.document("speculate", lm, as_dict(settings), processors.names, text, prompt_ids,
                           draft=settings.draft, gamma=settings.gamma,
                           verification="greedy" if spec.greedy else "speculative-sampling")

    def views() -> list:
        title = (f"{lm.name} <- {spec.proposer.name} · gamma {settings.gamma} · "
                 f"{'greedy verification' if spec.greedy else 'speculative sampling'} · chain: "
                 f"{' -> '.join(processors.names) or '(none)'}")
        out = [rounds_table(spec.rounds, title, spec.greedy), marked_text(text, spec.rounds),
               speedup_line(summary), render.summary_line(summary)]
        if sweep:
            out += [sweep_table(sweep), Text(f"best gamma: {best} (highest measured speedup)", style="bold")]
        return out

    output.emit(output.Output(
        document={**head, "steps": [r.to_dict() for r in spec.rounds], "text": out_text, "token_ids": token_ids,
                  "summary": summary.to_dict(), **extra},
        text=out_text,
        jsonl=[{"type": "sweep", **render.clean(row)} for row in extra.get("sweep", [])]
        + [output.summary_record("speculate", lm.name, {"text": out_text, "token_ids": token_ids}, summary.to_dict(),
                                 {"best_gamma": best} if sweep else {})],
        tables=[(None, [sweep_row(r) for r in sweep] if sweep else round_rows(spec.rounds))], views=views),
        fmt.value, save_html, save_svg)


# --- views ---------------------------------------------------------------------------------------------------------


def proposed_text(rnd) -> Text:
    """Accepted drafts green, the rejected one red and struck, never-judged ones dim and struck."""
    out = Text()
    for t in rnd.proposed:
        style = "bold green" if t.accepted else ("bold red strike" if t.reached else "dim strike")
        out.append(render.show_token(t.token), style=style)
        out.append(" ")
    return out


def final_text(rnd) -> Text:
    f = rnd.final
    if f is None:
        return Text("")
    out = Text(render.show_token(f.token), style="bold yellow" if f.emitted else "dim yellow strike")
    out.append(f" {f.kind} {render.fmt_p(f.prob)}", style="yellow")
    return out


def rounds_table(rounds, title: str, greedy: bool) -> Table:
    table = Table(title=title, header_style="bold")
    table.add_column("#", justify="right")
    table.add_column("proposed", overflow="fold")
    table.add_column("q->p u", overflow="fold")
    table.add_column("acc", justify="right")
    table.add_column("correction / bonus / plain", overflow="fold")
    # greedy draws from a point mass: show the target's own softmax around it instead
    table.add_column("target raw p (top)" if greedy else "drawn from: residual or p (top)", overflow="fold")
    for r in rounds:
        checks = "  ".join(f"{render.fmt_p(t.q)}->{render.fmt_p(t.p)}" + (f" u={t.u:.2f}" if t.u is not None else "")
                           for t in r.proposed if t.reached)
        top = "  ".join(f"{render.show_token(e.token)} {render.fmt_p(e.raw_p if greedy else e.prob)}"
                        for e in (r.final.top if r.final else []))
        table.add_row(str(r.index), proposed_text(r), checks, f"{r.accepted}/{r.drafted}", final_text(r), top)
    return table


def marked_text(prompt: str, rounds) -> Text:
    """The prompt dimmed, accepted drafts green, the target's own tokens (correction, bonus, plain) yellow."""
    out = Text()
    out.append(prompt, style="dim")  # a span: the Text's base style would dim every token after it
    for r in rounds:
        for t in r.proposed[: r.accepted]:
            out.append(t.token, style="green")
        if r.final is not None and r.final.emitted:
            out.append(r.final.token, style="black on yellow")
    return out


def speedup_line(summary) -> Text:
    """The measured speedup with its spread and the number of timing rounds behind it, in words."""
    if summary.measured_speedup is None:
        return Text("measured speedup: not measured (interrupted before a timing round completed)", style="bold")
    rounds = summary.speedup_rounds
    spread = (f"median of {rounds} timing rounds, min {summary.measured_speedup_min:.2f}x, max "
              f"{summary.measured_speedup_max:.2f}x" if rounds > 1 else "1 timing round, no spread")
    predicted = (f"; predicted {summary.predicted_speedup:.2f}x" if summary.predicted_speedup is not None else "")
    rates = ""
    if summary.speculative_tokens_per_s is not None and summary.baseline_tokens_per_s is not None:
        rates = (f"; {summary.speculative_tokens_per_s:.1f} vs {summary.baseline_tokens_per_s:.1f} tokens/s, both "
                 "untraced loops of the same rounds")
    line = Text(f"measured speedup {summary.measured_speedup:.2f}x over plain decoding ({spread}){predicted}{rates}",
                style="bold")
    if summary.speedup_noisy:
        line.append("\nnoisy: the timing rounds disagree (spread over 25% of the median, or on both sides of 1x); "
                    "the machine was too busy to trust this figure: rerun when it is idle, or with more "
                    "--speedup-rounds", style="bold red")
    return line


SWEEP_COLUMNS = {"gamma": "g", "acceptance_rate": "a", "mean_accepted": "acc/round",
                 "tokens_per_target_call": "tok/call", "target_calls": "target calls", "draft_calls": "draft calls",
                 "cost_ratio": "c", "predicted_speedup": "predicted", "measured_speedup": "measured",
                 "measured_speedup_min": "min", "measured_speedup_max": "max", "speedup_rounds": "timing rounds",
                 "stop_reason": "stop"}


def sweep_row(summary) -> dict:
    d = summary.to_dict()
    return {k: d[k] for k in SWEEP_COLUMNS}


def sweep_table(rows) -> Table:
    """Fits 80 columns: the measured speedup is the median over the timing rounds, its min-max beside it."""
    table = Table(title="gamma sweep: speedups against plain target decoding, same run", header_style="bold",
                  show_edge=False, caption="a: acceptance rate · c: draft step / target step · measured: median "
                  "(min-max) over n timing rounds")
    for header in ("g", "a", "tok/call", "c", "pred.", "measured", "min-max", "n", "stop"):
        table.add_column(header, justify="left" if header == "stop" else "right", no_wrap=True)
    for r in rows:
        spread = (f"{r.measured_speedup_min:.2f}-{r.measured_speedup_max:.2f}" if r.measured_speedup is not None
                  else "-")
        table.add_row(str(r.gamma), f"{r.acceptance_rate:.3f}", f"{r.tokens_per_target_call:.2f}",
                      "-" if r.cost_ratio is None else f"{r.cost_ratio:.3f}", times(r.predicted_speedup),
                      times(r.measured_speedup), spread, str(r.speedup_rounds), r.stop_reason)
    return table


def times(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def round_rows(rounds) -> list[dict]:
    """One flat row per round for markdown and CSV."""
    rows = []
    for r in rounds:
        f = r.final
        rows.append({
            "index": r.index, "position": r.position, "drafted": r.drafted, "accepted": r.accepted,
            "proposed": render.json_cell([{"token_id": t.token_id, "token": t.token, "q": t.q, "p": t.p,
                                           "accepted": t.accepted} for t in r.proposed]),
            "final_kind": f.kind if f else "", "final_token": f.token if f else "",
            "final_prob": f.prob if f else None, "emitted": r.emitted_text,
        })
    return rows
