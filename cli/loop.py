"""The one loop every command streams its run through: JSONL lines flushed as steps come, Ctrl-C kept."""

from __future__ import annotations

from collections.abc import Callable

from ..core.errors import EMPTY_CHAIN, ChainError, DecodelabError
from .options import Format
from .view import render

# One interrupt path for every command and every phase: a Ctrl-C inside a run or a later phase (a baseline, a sweep)
# is noted here, the command prints what it has (whole lines, the summary), and main() exits with status 130.
_interrupted = False
# Likewise a chain that leaves no candidate mid-run: the run ends with stop_reason "empty_chain", the command prints
# what it has (a JSONL stream still ends with its summary line), and main() prints the error and exits with 2. A
# served engine that fails after some answers came back (a replay, one request of a batch) is noted the same way.
_error: DecodelabError | None = None


# With -f text the continuation is printed as it grows; this is how much of it is on stdout already.
_printed = ""


def reset() -> None:
    global _interrupted, _error, _printed
    _interrupted, _error, _printed = False, None, ""


def print_text(text: str, final: bool = False, stops: tuple[str, ...] = ()) -> None:
    """``-f text``: print what ``text`` (the continuation so far) adds to what is printed. A trailing U+FFFD (a
    token that ends inside a UTF-8 character) waits for the next token, and so does any text a stop string could
    still claim (``stops``: what ``--trim-stop`` would cut is never printed early); ``final`` prints the rest (the
    command's final text) and a newline."""
    global _printed
    ready = text if final else before_stop(text.rstrip("\ufffd"), stops)
    if not ready.startswith(_printed):  # the text changed behind us (a stop string trimmed): print no more of it
        ready = _printed
    new = ready[len(_printed):] + ("\n" if final else "")
    if new:
        render.write_record(new)
    _printed = ready


def before_stop(text: str, stops: tuple[str, ...]) -> str:
    """The part of ``text`` no stop string can claim: up to the first complete stop string, else all but the
    longest tail that begins some stop string (the next tokens may complete it)."""
    stops = tuple(s for s in stops if s)
    hits = [text.find(s) for s in stops if s in text]
    if hits:
        return text[: min(hits)]
    for k in range(min(len(text), max((len(s) for s in stops), default=1) - 1), 0, -1):
        if any(s.startswith(text[-k:]) for s in stops):
            return text[:-k]
    return text


def note_error(exc: DecodelabError) -> None:
    global _error
    if _error is None:
        _error = exc


def error() -> DecodelabError | None:
    return _error


def note_interrupt() -> None:
    global _interrupted
    _interrupted = True


def interrupted() -> bool:
    return _interrupted


def drive(run, fmt: Format, row: Callable[[object], dict] = render.clean,
          on_step: Callable[[object], None] | None = None, kind: str = "step",
          text_of: Callable[[], str] | None = None, stops: tuple[str, ...] = ()) -> None:
    """Iterate ``run``; with ``-f jsonl`` print each step as one flushed line (``{"type": kind, ...}``); ``on_step``
    sees each step (a live table, a progress bar); with ``-f text``, ``text_of()`` (the continuation so far) is
    printed as it grows. An interrupt ends the run with what it produced (``run.interrupt()``: stop_reason "interrupted"); the
    caller then prints the summary as usual."""
    try:
        for step in run:
            if fmt == Format.jsonl:
                render.print_jsonl({"type": kind, **row(step)})
            elif fmt == Format.text and text_of is not None:
                print_text(text_of(), stops=stops)
            if on_step is not None:
                on_step(step)
    except KeyboardInterrupt:
        run.interrupt()
        note_interrupt()
    except ChainError as exc:
        run.end(EMPTY_CHAIN)
        note_error(exc)


def phase(fn: Callable[[], object], default=None):
    """A later phase of a command (a reference run, a sweep): skipped once interrupted or once a chain emptied, and
    a Ctrl-C or an empty chain inside it ends it with ``default`` so the command still prints what it has."""
    if _interrupted or _error is not None:
        return default
    try:
        return fn()
    except KeyboardInterrupt:
        note_interrupt()
        return default
    except ChainError as exc:
        note_error(exc)
        return default
