"""`speculate`'s views: the verification rounds, the text marked by who wrote each token, the measured speedup in
words, the gamma sweep, and their flat rows for markdown and csv."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from . import render


def views(model_name: str, spec, prompt: str, summary, sweep) -> list:
    """The rounds table, the marked text, the speedup line, the summary line, and the sweep when one ran."""
    s = spec.settings
    title = (f"{model_name} <- {spec.proposer.name} · gamma {s.gamma} · "
             f"{'greedy verification' if spec.greedy else 'speculative sampling'} · chain: "
             f"{' -> '.join(spec.chain.names) or '(none)'}")
    out = [rounds_table(spec.rounds, title, spec.greedy), marked_text(prompt, spec.rounds),
           speedup_line(summary), render.summary_line(summary)]
    if sweep.rows:
        out += [sweep_table(sweep.rows), Text(f"best gamma: {sweep.best} (highest measured speedup)", style="bold")]
    return out


def sweep_rows(rows) -> list[dict]:
    return [sweep_row(r) for r in rows]


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
        checks = "  ".join(f"{render.fmt_p(t.q)}->{render.fmt_p(t.p)}" + (f",u={t.u:.2f}" if t.u is not None else "")
                           for t in r.proposed if t.reached)
        # token:p with no space inside, so that wrapping never puts a probability on another line than its token
        top = "  ".join(f"{render.show_token(e.token)}:{render.fmt_p(e.raw_p if greedy else e.prob)}"
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
