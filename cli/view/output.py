"""The one output path every command prints through: the same run report in table, json, jsonl, markdown or csv,
and the saved HTML/SVG, so each format is written (and guarded against write faults) in one place."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from .. import loop, machine
from . import render
from ...core.trace.format import FORMAT_VERSION
from ...core.trace.openai import to_completion
from .html import write_page


@dataclass
class Output:
    """What one command prints.

    * ``document``: the ``-f json`` object (the shared top level of CLI.md and the command's own fields);
    * ``jsonl``: the lines ``-f jsonl`` ends with, after the steps streamed while the run went (by default one
      ``{"type": "summary", ...}`` line, see :func:`summary_record`);
    * ``tables``: flat row tables, each with an optional title: markdown prints every one; csv (no room for two)
      prints ``csv``, by default the first table;
    * ``views``: builds the rich renderables for the terminal and for ``--save-svg`` (``--save-html`` writes the
      trace page of ``document``);
      ``screen``: what the terminal still needs when a live table already printed the rows.
    """

    document: dict
    jsonl: list[dict]
    text: str | None = None  # the continuation, for -f text (what streaming printed already is not printed again)
    tables: list[tuple[str | None, list[dict]]] = field(default_factory=list)
    csv: list[dict] | None = None
    views: Callable[[], list] | None = None
    screen: Callable[[], list] | None = None


def summary_record(command: str, model: str | None, *parts) -> dict:
    """The closing JSONL line: ``{"type": "summary", "command", "model", ...}`` with the parts' fields merged, and
    the versions the numbers came from."""
    out = {"type": "summary", "command": command, "model": model}
    for part in parts:
        out.update(render.clean(part))
    return {**out, "versions": versions()}


def versions() -> dict:
    """decodelab, torch and transformers as installed (read from the package metadata: nothing is imported)."""
    out = {}
    for name in ("decodelab", "torch", "transformers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def emit(out: Output, fmt: str, save_html: Path | None = None, save_svg: Path | None = None) -> None:
    """Print ``out`` in format ``fmt`` (table, json, jsonl, markdown, csv), and save HTML/SVG when asked; a run
    timed on an oversubscribed machine carries the ``machine`` field and prints a note (cli/machine.py)."""
    marked, jsonl = machine.mark(out.document, out.jsonl)
    document = stamped(marked)
    if fmt == "json":
        render.print_json(document)
    elif fmt == "openai":
        render.print_json(to_completion(render.clean(document)))
    elif fmt == "text":
        loop.print_text(out.text or "", final=True)
    elif fmt == "jsonl":
        for line in jsonl:
            render.print_jsonl(line)
    elif fmt == "markdown":
        for i, (title, rows) in enumerate(out.tables):
            render.write_record(("\n" if i else "") + (f"### {title}\n\n" if title else ""))
            render.print_rows(rows, "markdown")
    elif fmt == "csv" and (out.csv is not None or out.tables):
        render.print_rows(out.csv if out.csv is not None else out.tables[0][1], "csv")
    if save_html is not None:
        save_page(document, save_html)
    if out.views is None or not (fmt == "table" or save_svg):
        return
    views = out.views()
    if fmt == "table":
        render.show(out.screen() if out.screen is not None else views)
    render.save(views, None, save_svg)


def stamped(document: dict) -> dict:
    """The document as every format writes it: with its format version (what `decodelab view` checks) and the
    versions of the software behind its numbers."""
    return {**document, "format_version": FORMAT_VERSION, "versions": versions()}


def save_page(document: dict, path: Path) -> None:
    """``--save-html``: the trace page (cli/view/html.py) drawn from the same document ``-f json`` prints."""
    write_page(document, path, "--save-html")


def emit_for(opts, out: Output) -> None:
    """:func:`emit` with a command's shared output options (``-f``, ``--save-html``, ``--save-svg``); a prompt
    wrapped by the chat template (``--chat``) says so in the document (``prompt.chat``), so that a rerun of it
    can wrap it again."""
    if getattr(opts, "chat", False):
        mark_chat(out.document)
    emit(out, opts.fmt.value, getattr(opts, "save_html", None), getattr(opts, "save_svg", None))
    from ..early import temperature_note

    temperature_note(opts)


def mark_chat(document) -> None:
    prompt = document.get("prompt") if isinstance(document, dict) else None
    if isinstance(prompt, dict):
        prompt["chat"] = True
