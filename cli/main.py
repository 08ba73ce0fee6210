"""The `decodelab` entry point: registers the commands and turns bad input into one line and exit status 2."""

from __future__ import annotations

import os
import sys

from . import warm_client

warm_client.from_the_console_script()  # a warm server runs the command: exits here, before typer, rich, torch

import typer  # noqa: E402

try:  # typer >= 0.20 vendors its own copy of click (a private module: guarded, with click's own as the fallback)
    from typer._click import exceptions as cli_errors
except ImportError:  # older typer runs on click
    from click import exceptions as cli_errors
# click >= 8.2 raises NoArgsIsHelpError after printing the help; older click exits through typer.Exit (an empty
# tuple in an except clause catches nothing)
NO_ARGS_IS_HELP = getattr(cli_errors, "NoArgsIsHelpError", ())

from ..core.errors import DecodelabError
from . import loop
from .view import render
from .commands.batch import batch
from .commands.beam import beam
from .commands.bench import bench
from .commands.check_logprobs import check_logprobs
from .commands.check_sampler import check_sampler
from .commands.audit_numerics import audit_numerics
from .commands.compare import compare
from .commands.models import models
from .commands.probs import probs
from .commands.quantize_kv import quantize_kv
from .commands.sample import sample
from .commands.score import score
from .commands.speculate import speculate
from .commands.stream import stream
from .commands.view import view
from .commands.warm import warm


def flags_take_no_value(option_class: type | None = None) -> bool:
    """typer labels an on/off flag ``<bool>`` in the help, as if it took a value: flags show no type. This reaches
    into typer's internals (``TyperOption.display_type_rich``: typer 0.29 has it, 0.16 has not), so it is
    feature-detected: where the hook is missing the help keeps typer's own labels and every command still runs.
    True when patched."""
    if option_class is None:
        try:
            from typer.core import TyperOption as option_class
        except ImportError:
            return False
    labelled = getattr(option_class, "display_type_rich", None)
    if not callable(labelled) or getattr(labelled, "flags_take_no_value", False):
        return callable(labelled)

    def display_type_rich(self, ctx):
        return None if getattr(self, "is_flag", False) and not getattr(self, "count", False) \
            else labelled(self, ctx)

    display_type_rich.flags_take_no_value = True  # patched once, however often this is called
    option_class.display_type_rich = display_type_rich
    return True


flags_take_no_value()
app = typer.Typer(
    name="decodelab",
    help="A decoding workbench for language models: processor chains, per-token probabilities, KV-cache policies.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback(invoke_without_command=True)
def _root(version: bool = typer.Option(False, "--version", help="Print the versions of decodelab, torch and "
                                       "transformers and exit.", is_eager=True)) -> None:
    if version:
        from .view.output import versions

        render.write_record(" ".join(f"{name} {v or '(not installed)'}" for name, v in versions().items()) + "\n")
        raise typer.Exit(0)


app.command()(sample)
app.command()(probs)
app.command()(models)
app.command()(speculate)
app.command()(beam)
app.command()(score)
app.command()(compare)
app.command()(bench)
app.command()(stream)
app.command()(batch)
app.command("quantize-kv")(quantize_kv)
app.command("check-logprobs")(check_logprobs)
app.command("check-sampler")(check_sampler)
app.command("audit-numerics")(audit_numerics)
app.command()(view)
app.add_typer(warm)


def fail(message: str) -> int:
    """One line on stderr; undecodable bytes echoed back from the input (lone surrogates) are shown escaped."""
    line = f"error: {message}".encode("utf-8", "backslashreplace").decode("utf-8")
    sys.stderr.write(line + "\n")
    return 2


def out_of_memory(exc: BaseException) -> bool:
    """An allocation that failed (torch's CPU or CUDA allocator, or Python's), told apart without importing torch."""
    text = str(exc)
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError" or (
        isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text))


COLUMNS = (20, 10_000)  # the terminal widths tables are laid out for


def check_columns() -> None:
    """COLUMNS, when set, is the width every table is laid out to: 0 would print nothing, 3 one letter a line."""
    import os

    from ..core.inputs import parse_int

    value = os.environ.get("COLUMNS")
    if value is not None and value.strip():
        try:
            parse_int(value, "COLUMNS", *COLUMNS)
        except DecodelabError:
            raise DecodelabError(f"COLUMNS={value!r}: the terminal width must be an integer in [{COLUMNS[0]}, "
                                 f"{COLUMNS[1]}]; unset it to use the terminal's") from None


def main(argv: list[str] | None = None) -> int:
    """Run the CLI. ``--debug`` (anywhere) shows tracebacks instead of one-line errors.

    A second Ctrl-C (while the first one's summary is written) is still a quiet exit 130: every record written is
    whole (render.write_record holds the signal until its record is out). A reader that goes away (``| head -1``)
    ends the run quietly with 141, as ``yes | head`` does; a write that fails (a full disk, a closed stdout) is one
    line and exit 1."""
    try:
        handed = warm_client.hand_off(sys.argv[1:]) if argv is None else None  # decodelab warm: a forked run
        return run_cli(argv) if handed is None else handed
    except KeyboardInterrupt:
        return interrupted()
    except render.ReaderGone:
        return reader_gone()
    except render.OutputError as exc:
        fail(str(exc))
        return 1


def interrupted() -> int:
    try:
        sys.stderr.write("interrupted\n")
    except (OSError, ValueError):
        pass
    return 130


def reader_gone() -> int:
    """stdout's reader left: send what Python still holds for stdout to /dev/null, so exiting prints nothing."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
    return 141


def run_cli(argv: list[str] | None) -> int:
    """The command line, its one-line errors and its exit statuses."""
    args = list(sys.argv[1:] if argv is None else argv)
    cut = args.index("--") if "--" in args else len(args)  # after "--" every word is an argument, even "--debug"
    debug = "--debug" in args[:cut]
    args = [a for a in args[:cut] if a != "--debug"] + args[cut:]
    loop.reset()
    try:
        check_columns()
        result = app(args=args, prog_name="decodelab", standalone_mode=False)
        if loop.error() is not None:  # a chain emptied mid-run: the command printed what it had, then the error
            if debug:
                raise loop.error()
            return fail(str(loop.error()))
        # a Ctrl-C inside a run: the command printed what it had, the status still says it was cut short;
        # outside any run (loading, say) typer returns 130 itself
        if loop.interrupted() or result == 130:
            return interrupted()
        return result if isinstance(result, int) else 0
    except typer.Exit as exc:
        return exc.exit_code
    except NO_ARGS_IS_HELP:
        return 0  # the help has been printed
    except cli_errors.UsageError as exc:
        if debug:
            raise
        where = f" ({exc.ctx.command_path})" if exc.ctx is not None else ""
        return fail(exc.format_message().replace("\n", " ") + where)
    except (typer.Abort, KeyboardInterrupt):
        return interrupted()
    except (render.ReaderGone, render.OutputError):
        raise
    except DecodelabError as exc:
        if debug:
            raise
        return fail(str(exc))
    except Exception as exc:
        if debug or not out_of_memory(exc):
            raise
        return fail(f"out of memory: the run asked for more than this machine can allocate "
                    f"({str(exc).strip().splitlines()[0][:160]}); give smaller sizes (-n, --blocks, --batch, "
                    "--context, --beams, -N)")


if __name__ == "__main__":
    sys.exit(main())
