"""Renderers: rich tables for people; JSON, JSONL, markdown and CSV for scripts. Every number comes from a trace."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import signal
import stat
import sys
import threading
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text
from tabulate import tabulate

from ...core.errors import ConfigError

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


class OutputError(Exception):
    """Writing the output failed (a full disk, a closed stdout): one line, exit status 1."""


class ReaderGone(Exception):
    """The reader of stdout went away (``| head -1``): the run ends quietly."""


def write_record(text: str) -> None:
    """Write one whole record (a JSON document, a JSONL line, a table) to stdout and flush it.

    A record is never torn: a Ctrl-C that arrives while it is written waits until it is out, and when stdout is a
    file and the write fails (a full disk), the file is cut back to where the record began, so every whole record
    already written stays and no half one follows it."""
    if sys.stdout is None:
        raise OutputError("stdout is closed; give the command somewhere to write (a file, a pipe, a terminal)")
    data = text.encode("utf-8", "backslashreplace")
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if _main_thread() else None
    try:
        sys.stdout.flush()
        fd = sys.stdout.fileno()
        start = os.lseek(fd, 0, os.SEEK_CUR) if stat.S_ISREG(os.fstat(fd).st_mode) else None
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except BrokenPipeError:
            raise ReaderGone() from None
        except OSError as exc:
            if start is not None:
                os.ftruncate(fd, start)
            raise OutputError(f"writing the output to stdout failed ({exc.strerror or exc}); every whole record "
                              "before it was kept") from None
    except (io.UnsupportedOperation, AttributeError):  # a stdout without a file descriptor (a test's buffer)
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:
            raise ReaderGone() from None
    finally:
        if previous is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def print_json(obj) -> None:
    write_record(json.dumps(clean(obj), ensure_ascii=False, allow_nan=False, indent=2) + "\n")


def print_jsonl(obj) -> None:
    """One line, written whole and flushed at once, so a reader (or an interrupted run) always has whole lines."""
    write_record(dumps(obj) + "\n")


def document(command: str, lm, config: dict, chain_names: list[str], prompt_text: str, prompt_ids: list[int],
             **rest) -> dict:
    """The top level every command's JSON shares (CLI.md), built in core (:class:`~decodelab.core.engine.run.Origin`);
    commands add steps, text, token_ids, summary, ..."""
    from ...core.engine.run import head  # torch loads when a command runs, not for --help

    return head(command, lm, config, chain_names, prompt_text, prompt_ids, **rest)


def one_line(text: str) -> str:
    """Text on one table line: backslashes, newlines, tabs and carriage returns escaped, spaces kept."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")


def cut(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters: cut with an ellipsis, never silently."""
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def show_token(text: str) -> str:
    """A token as it reads in a table: control characters escaped, leading/trailing spaces made visible."""
    out = one_line(text)
    return out.replace(" ", "␣") if out != out.strip() else out  # all spaces too: then out.strip() is ""


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


# Shading in four classes that survive a 16-colour terminal and NO_COLOR: each class has a standard colour and its own
# attributes (none, italic, underline, bold underline), which NO_COLOR keeps; (lower bound of p, style, name in the legend), most likely first.
SHADES = (
    (0.5, "black on green", "green"),
    (0.1, "italic black on yellow", "yellow+italic"),
    (0.01, "underline white on red", "red+underline"),
    (0.0, "bold underline white on magenta", "magenta+bold+underline"),
)
PROMPT_STYLE = "dim italic"
PROMPT_MARK = "▕"  # between the prompt and the output, visible without any style (a pipe, NO_COLOR)


def prob_style(p: float) -> str:
    """The style of a token drawn with probability p: the first class whose lower bound p reaches."""
    return next(style for low, style, _ in SHADES if p >= low or low == 0.0)


def shaded_text(prompt: str, tokens: list[tuple[str, float]]) -> Text:
    """The prompt in its own style, a mark, then each generated token shaded by its probability."""
    text = Text()
    text.append(prompt, style=PROMPT_STYLE)  # a span, not the Text's base style, which would style every token
    text.append(PROMPT_MARK, style="dim")
    for token, p in tokens:
        text.append(token, style=prob_style(p))
    return text


def shading_legend(shaded_by: str, before: str = "prompt", after: str = "output") -> Text:
    """What the shading means, in words that hold with or without colour."""
    classes = [f"{name} p < {SHADES[i - 1][0]:g}" if low == 0.0 else f"{name} p >= {low:g}"
               for i, (low, _, name) in enumerate(SHADES)]
    return Text(f"text: {before} {PROMPT_MARK} {after}; each token shaded by its {shaded_by}: " + ", ".join(classes),
                style="dim")


def step_rows(steps) -> list[dict]:
    """Flat per-step rows for markdown and CSV: the token's real text (each format escapes it by its own rules when
    printed) and the alternatives as one JSON cell, every number whole."""
    rows = []
    for s in steps:
        rows.append({
            "index": s.index, "position": s.position, "token_id": s.token_id, "token": s.token,
            "prob": s.prob, "logprob": s.logprob, "raw_prob": s.raw_prob, "raw_logprob": s.raw_logprob,
            "raw_rank": s.raw_rank, "entropy": s.entropy, "raw_entropy": s.raw_entropy, "kept": s.kept,
            "alternatives": json_cell(s.alternatives), "decided_by": s.decided_by, "why": s.why,
        })
    return rows


def json_cell(value) -> str:
    """A list or record as one table cell: JSON, text kept as it is."""
    return json.dumps(clean(value), ensure_ascii=False, allow_nan=False)


def markdown_cell(value):
    """A markdown table cell: text on one line (backslash escapes) with its pipes escaped, read as text even when
    it looks like a number ("007"); floats to 6 significant digits (csv and json keep every digit)."""
    if isinstance(value, str):
        return one_line(value).replace("|", "\\|")
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


def print_rows(rows: list[dict], fmt: str) -> None:
    """markdown (tabulate, GitHub style; cells escaped by :func:`markdown_cell`) or csv (RFC 4180 via the csv
    module, which quotes what needs quoting). Rows hold real text: neither format loses a character."""
    if fmt == "markdown":
        cells = [{k: markdown_cell(v) for k, v in row.items()} for row in rows]
        # tabulate strips cells unless told: " upon" would print as "upon"
        write_record(tabulate(cells, headers="keys", tablefmt="github", disable_numparse=True,
                              preserve_whitespace=True) + "\n")
    else:
        buf = io.StringIO()
        if rows:
            writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
        write_record(buf.getvalue())


def console() -> Console:
    return Console(highlight=False)


def error_console() -> Console:
    """Progress and status lines go to stderr, so stdout stays the output."""
    return Console(stderr=True, highlight=False)


@contextmanager
def status(message: str):
    """A spinner and a message on stderr while something slow runs, only when stderr is a terminal."""
    out = error_console()
    if not out.is_terminal:
        yield
        return
    with out.status(message):
        yield


def exp(logprob: float) -> float:
    return math.exp(logprob)  # exp(-inf) is 0.0


SAVE_WIDTH = 160  # --save-html / --save-svg record at this width, whatever the terminal's


def fitted(renderables, width: int, out: Console) -> list:
    """Tables too wide for ``width`` become panels of their columns (cli/view/fit.py); everything else as it is."""
    from .fit import fit_table

    return [part for r in renderables for part in (fit_table(r, width, out) if isinstance(r, Table) else [r])]


def show(renderables, save_html: Path | None = None, save_svg: Path | None = None, to_screen: bool = True) -> None:
    """Print rich renderables, and also write them as HTML/SVG when asked (whatever the --format)."""
    if to_screen:
        out = console()
        for r in fitted(renderables, out.width, out):
            print_rich(out, r)
    save(renderables, save_html, save_svg)


def print_rich(out: Console, renderable) -> None:
    """One renderable on the terminal console, rendered first and written as one record."""
    if out.file is not sys.stdout:
        out.print(renderable)
        return
    buffer = io.StringIO()
    twin = Console(file=buffer, width=out.width, color_system=out.color_system, force_terminal=out.is_terminal,
                   no_color=out.no_color, legacy_windows=False, highlight=False)
    twin.print(renderable)
    write_record(buffer.getvalue())


def save(renderables, save_html: Path | None, save_svg: Path | None) -> None:
    """Write the renderables as HTML and/or SVG, recorded at SAVE_WIDTH columns."""
    if save_html is None and save_svg is None:
        return
    recorder = Console(record=True, file=io.StringIO(), width=SAVE_WIDTH, highlight=False)
    for r in fitted(renderables, SAVE_WIDTH, recorder):
        recorder.print(r)
    try:  # checked when the command started; a disk that fills or turns read-only since is still one line
        if save_html is not None:
            recorder.save_html(str(save_html), clear=False)
        if save_svg is not None:
            recorder.save_svg(str(save_svg), clear=False, title="decodelab")
    except OSError as exc:
        raise ConfigError(f"--save-html/--save-svg: cannot write the file ({exc.strerror or exc})") from None


def summary_line(summary) -> Text:
    """key=value for every scalar (and list) of a summary (a dataclass or a dict)."""
    d = clean(summary)
    parts = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items()
             if v is not None and not isinstance(v, dict)]  # a nested record has its own view
    return Text("summary: " + "  ".join(parts), style="cyan")


def samples_views(rows, spread, title: str) -> list:
    """`sample -N`: one row per sample, the first-token frequencies, and the spread summary."""
    table = Table(title=title, header_style="bold")
    for name, justify in (("#", "right"), ("seed", "right"), ("text", "left"), ("len", "right"),
                          ("stop", "left"), ("sum logp", "right"), ("mean logp", "right")):
        table.add_column(name, justify=justify, no_wrap=name != "text")
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
    d.pop("first_tokens")
    return [table, firsts, summary_line(d)]
