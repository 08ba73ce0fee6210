"""`decodelab view`: a trace (any command's `-f json`, or an OpenAI completions response) as one HTML page."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

Trace = Annotated[str, typer.Argument(help="A trace: a command's `-f json` output, or an OpenAI completions "
                                      "response with logprobs; '-' reads stdin.", show_default=False)]
Output = Annotated[Optional[Path], typer.Option("--output", "-o", help="The page to write (default: the trace's "
                                                "name with .html; for stdin, trace.html).", show_default=False)]


def view(trace: Trace, output: Output = None) -> None:
    """Write one self-contained HTML page of a trace: the text shaded by probability with each token's numbers on
    hover, the command that branches at a token, beam trees, speculative rounds, compare rows, batch timelines. It
    opens from disk: no server, no network."""
    from ...core.errors import ConfigError
    from ...core.inputs import check_output_file, read_input_text
    from ...core.trace.format import parse_trace
    from ..view.html import write_page

    if trace == "-":
        text, name, default = sys.stdin.read(), "TRACE (stdin)", Path("trace.html")
    else:
        text, name, default = read_input_text("TRACE", trace), f"TRACE {trace}", Path(trace).with_suffix(".html")
    path = output if output is not None else default
    if path.resolve() == Path(trace).resolve() and trace != "-":
        raise ConfigError(f"--output {path}: is the trace itself; give another file")
    check_output_file("--output", path)
    write_page(parse_trace(name, text), path, "--output", source=name)
    sys.stderr.write(f"wrote {path}\n")
