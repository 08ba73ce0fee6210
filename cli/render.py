"""Renderers: rich tables for people; JSON, JSONL, markdown and CSV for scripts. Every number comes from a trace."""

from __future__ import annotations

import csv
import io
import json
import math
import sys
from dataclasses import asdict, is_dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text
from tabulate import tabulate

from ..core.errors import ConfigError

BAR_WIDTH = 10


def clean(value):
    """JSON has no NaN or infinity: non-finite floats become null; dataclasses become dicts."""
    if is_dataclass(value) and not isinstance(value, type):
        value = asdict(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def dumps(obj) -> str:
    return json.dumps(clean(obj), ensure_ascii=False, allow_nan=False)


def print_json(obj) -> None:
    sys.stdout.write(json.dumps(clean(obj), ensure_ascii=False, allow_nan=False, indent=2) + "\n")
    sys.stdout.flush()


def print_jsonl(obj) -> None:
    """One line, flushed at once, so a reader (or an interrupted run) always has whole lines."""
    sys.stdout.write(dumps(obj) + "\n")
    sys.stdout.flush()


def document(command: str, lm, config: dict, chain_names: list[str], prompt_text: str, prompt_ids: list[int],
             **rest) -> dict:
    """The top level every command's JSON shares (CLI.md); commands add steps, text, token_ids, summary, ..."""
    return {
        "command": command,
        "model": lm.name,
        "device": str(lm.device),
        "dtype": str(lm.dtype).replace("torch.", ""),
        "config": config,
        "chain": chain_names,
        "prompt": {"text": prompt_text, "token_ids": prompt_ids},
        **rest,
    }


def one_line(text: str) -> str:
    """Text on one table line: backslashes, newlines, tabs and carriage returns escaped, spaces kept."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")


def show_token(text: str) -> str:
    """A token as it reads in a table: control characters escaped, leading/trailing spaces made visible."""
    out = one_line(text)
    return out.replace(" ", "␣") if out.strip() == "" or out != out.strip() else out


def bar(p: float, width: int = BAR_WIDTH) -> str:
    eighths = "▏▎▍▌▋▊▉"
    cells = max(0.0, min(1.0, p)) * width
    full = int(cells)
    part = int((cells - full) * 8)
    return ("█" * full + (eighths[part - 1] if part else "")).ljust(width)


def fmt_p(p: float) -> str:
    if p >= 0.001 or p == 0:
        return f"{p:.3f}"
    return f"{p:.1e}"


def prob_style(p: float) -> str:
    """Background from red (unlikely) through yellow to green (likely)."""
    p = max(0.0, min(1.0, p))
    red = int(255 * min(1.0, 2 * (1 - p)))
    green = int(255 * min(1.0, 2 * p))
    return f"black on rgb({red},{green},90)"


def shaded_text(prompt: str, tokens: list[tuple[str, float]]) -> Text:
    """The prompt dimmed, then each generated token shaded by the probability it was drawn with."""
    text = Text()
    text.append(prompt, style="dim")  # a span, not the Text's base style, which would dim every token after it
    for token, p in tokens:
        text.append(token, style=prob_style(p))
    return text


def steps_table(steps, top: int, title: str | None = None) -> Table:
    """One row per token; the fixed columns keep their width and the alternatives wrap in what is left."""
    table = Table(title=title, show_lines=False, header_style="bold")
    table.add_column("#", justify="right", no_wrap=True, min_width=2)
    table.add_column("token", no_wrap=True, min_width=6, max_width=18, overflow="ellipsis")
    table.add_column("prob", justify="left", no_wrap=True, min_width=BAR_WIDTH + 6)
    table.add_column("raw p", justify="right", no_wrap=True, min_width=5)
    table.add_column("raw rank", justify="right", no_wrap=True, min_width=4)
    table.add_column("kept", justify="right", no_wrap=True, min_width=4)
    table.add_column("H", justify="right", no_wrap=True, min_width=4)
    table.add_column("decided by", no_wrap=True, min_width=5, max_width=18, overflow="ellipsis")
    if top:
        table.add_column(f"top {top} alternatives (p)", ratio=1)
    for s in steps:
        alts = "  ".join(f"{show_token(a.token)}\u00a0{fmt_p(a.prob)}" for a in s.alternatives)
        row = [str(s.index), Text(show_token(s.token), style="bold"),
               Text(f"{bar(s.prob)} {fmt_p(s.prob)}"), fmt_p(s.raw_prob), str(s.raw_rank), str(s.kept),
               f"{s.entropy:.2f}", s.decided_by or "-"]
        if top:
            row.append(alts)
        table.add_row(*row)
    table.caption = "prob: the processed distribution the token was drawn from; raw p / raw rank: the model's own " \
                    "softmax; kept: candidates left after the chain; H: entropy (nats) of the processed " \
                    "distribution; decided by: the stage that chose this token with the step's own random draws " \
                    "(model: none changed the model's pick)"
    return table


def step_rows(steps) -> list[dict]:
    """Flat per-step rows for markdown and CSV."""
    rows = []
    for s in steps:
        rows.append({
            "index": s.index, "position": s.position, "token_id": s.token_id, "token": show_token(s.token),
            "prob": s.prob, "logprob": s.logprob, "raw_prob": s.raw_prob, "raw_logprob": s.raw_logprob,
            "raw_rank": s.raw_rank, "entropy": s.entropy, "raw_entropy": s.raw_entropy, "kept": s.kept,
            "alternatives": " ".join(f"{show_token(a.token)}:{a.prob:.4f}" for a in s.alternatives),
            "decided_by": s.decided_by, "why": s.why,
        })
    return rows


def print_rows(rows: list[dict], fmt: str) -> None:
    """markdown (tabulate, GitHub style) or csv (RFC 4180 via the csv module)."""
    if fmt == "markdown":
        sys.stdout.write(tabulate(rows, headers="keys", tablefmt="github", floatfmt=".6g") + "\n")
    else:
        buf = io.StringIO()
        if rows:
            writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
        sys.stdout.write(buf.getvalue())
    sys.stdout.flush()


def console() -> Console:
    return Console(highlight=False)


def error_console() -> Console:
    """Progress and status lines go to stderr, so stdout stays the output."""
    return Console(stderr=True, highlight=False)


def exp(logprob: float) -> float:
    return math.exp(logprob) if logprob != float("-inf") else 0.0


def show(renderables, save_html: Path | None = None, save_svg: Path | None = None, to_screen: bool = True) -> None:
    """Print rich renderables, and also write them as HTML/SVG when asked (whatever the --format)."""
    if to_screen:
        out = console()
        for r in renderables:
            out.print(r)
    if save_html is None and save_svg is None:
        return
    recorder = Console(record=True, file=io.StringIO(), width=160, highlight=False)
    for r in renderables:
        recorder.print(r)
    try:  # checked when the command started; a disk that fills or turns read-only since is still one line
        if save_html is not None:
            recorder.save_html(str(save_html), clear=False)
        if save_svg is not None:
            recorder.save_svg(str(save_svg), clear=False, title="decodelab")
    except OSError as exc:
        raise ConfigError(f"--save-html/--save-svg: cannot write the file ({exc.strerror or exc})") from None


def summary_line(summary) -> Text:
    """key=value for every scalar of a summary (a dataclass or a dict)."""
    d = clean(summary)
    parts = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items() if v is not None]
    return Text("summary: " + "  ".join(parts), style="cyan")


def samples_views(rows, spread, title: str) -> list:
    """`sample -N`: one row per sample, the first-token frequencies, and the spread summary."""
    table = Table(title=title, header_style="bold")
    for name, justify in (("#", "right"), ("seed", "right"), ("text", "left"), ("len", "right"),
                          ("stop", "left"), ("sum logp", "right"), ("mean logp", "right")):
        table.add_column(name, justify=justify, no_wrap=name != "text", ratio=1 if name == "text" else None)
    for r in rows:
        table.add_row(str(r.index), str(r.seed), one_line(r.text), str(r.length), r.stop_reason,
                      f"{r.sum_logprob:.3f}", f"{r.mean_logprob:.3f}")
    table.caption = "logp: processed log-probability (the distribution each token was drawn from)"
    firsts = Table(title="first token", header_style="bold")
    for name in ("token", "id", "count", "share"):
        firsts.add_column(name, justify="left" if name == "token" else "right", no_wrap=True)
    for f in spread.first_tokens:
        firsts.add_row(show_token(f.token), str(f.token_id), str(f.count), f"{bar(f.frequency)} {f.frequency:.2f}")
    d = clean(spread)
    d.pop("first_tokens", None)
    return [table, firsts, summary_line(d)]
