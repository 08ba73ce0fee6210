"""Reading what the user hands in, bounded: text files and stdin (one line naming the option when a file is missing,
a folder, unreadable, too large or not UTF-8), JSON and TOML documents (nesting and size bounded), output paths
checked before a run, and every number typed on the command line or written in a file (ASCII digits only).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

import tomllib

from .errors import ConfigError

MAX_TEXT_BYTES = 64 * 2**20  # a prompt, a text or an input file is read whole: at most 64 MiB
MAX_DEPTH = 64  # nesting of a JSON or TOML document handed in (a preset is flat, a saved trace 4 deep)
MAX_DIGITS = 40  # an integer typed with more digits is past every bound decodelab has (2**64 has 20)


def check_output_file(option: str, path: Path) -> None:
    """A file written at the end of a run: not a folder, in a folder that exists and can be written."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ConfigError(f"{option} {path}: is a folder; give a file name")
    if not folder.is_dir():
        raise ConfigError(f"{option} {path}: the folder {folder} does not exist")
    if not os.access(path if path.exists() else folder, os.W_OK):
        raise ConfigError(f"{option} {path}: cannot write there (permission denied)")


def check_input_file(option: str, path: Path) -> None:
    """A text file read as input: it exists, is a file, and is UTF-8."""
    read_input_text(option, path)


def read_input_text(option: str, path: str | Path, limit: int = MAX_TEXT_BYTES) -> str:
    """The text of a file given as ``option``: one line naming the option and the file when it is missing, a folder,
    unreadable, larger than ``limit`` bytes or not UTF-8. A pipe or a device is read up to the limit (never whole:
    /dev/zero ends at ``limit`` + 1 bytes)."""
    path = Path(path).expanduser()
    if path.is_dir() or not path.exists():
        raise ConfigError(f"{option} {path}: {'is a folder' if path.is_dir() else 'no such file'}; give a text file")
    try:
        with open(path, "rb") as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise ConfigError(f"{option} {path}: cannot read it ({exc.strerror})") from None
    return decode_text(f"{option} {path}", data, limit)


def read_stdin(option: str, limit: int = MAX_TEXT_BYTES) -> str:
    """The text piped to ``option -``: one line when stdin is closed (``<&-``), unreadable, more than ``limit`` bytes
    (``< /dev/zero``) or not UTF-8."""
    stream = sys.stdin
    closed = f"{option} -: stdin is closed; pipe the text in, or give it as an argument or a file"
    if stream is None or getattr(stream, "closed", False):
        raise ConfigError(closed)
    try:
        source = getattr(stream, "buffer", None)
        data = (source or stream).read(limit + 1)
    except (OSError, ValueError):  # a closed or unreadable descriptor
        raise ConfigError(closed) from None
    if isinstance(data, str):  # a text stream without a byte buffer (a test's StringIO)
        data = data.encode("utf-8", "surrogateescape")
    return decode_text(f"{option} -", data, limit)


def decode_text(where: str, data: bytes, limit: int = MAX_TEXT_BYTES) -> str:
    """Bytes read (at most ``limit`` + 1 of them) -> UTF-8 text with universal newlines (as text mode reads it:
    \\r\\n and \\r become \\n); ``where`` names the input."""
    if len(data) > limit:
        raise ConfigError(f"{where}: more than {limit} bytes ({limit // 2**20} MiB), the most decodelab reads; "
                          "give a shorter text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where}: not UTF-8 text (byte {exc.start}); give a UTF-8 file") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


# --- documents: JSON and TOML, nesting bounded ---------------------------------------------------------------------


def nesting_depth(value) -> int:
    """Containers inside containers: 0 for a scalar, 1 for [1, 2], 2 for {"a": [1]} (iterative: no recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list, tuple)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def check_depth(where: str, value, max_depth: int = MAX_DEPTH):
    if nesting_depth(value) > max_depth:
        raise ConfigError(f"{where}: nested deeper than {max_depth} levels; decodelab reads flatter documents")
    return value


def parse_json(where: str, text: str | bytes, max_depth: int = MAX_DEPTH, expected: str = ""):
    """A JSON document handed in; ``where`` names it ("--resume trace.json", "--job j.jsonl: line 3"). Nesting past
    the parser's own recursion limit and past ``max_depth`` is one line, as is malformed JSON: JSON lines where one
    document was expected are named as such; ``expected`` (what to give instead) ends the line."""
    hint = f"; {expected}" if expected else ""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ConfigError(f"{where}: nested deeper than {max_depth} levels; decodelab reads flatter documents") \
            from None
    except json.JSONDecodeError as exc:
        text = text.decode(errors="replace") if isinstance(text, bytes) else text
        what = ("several JSON values (JSON lines?)" if exc.msg == "Extra data" and text.lstrip().startswith("{")
                and "\n" in text.strip()
                else f"not JSON ({exc.msg} at line {exc.lineno})")
        raise ConfigError(f"{where}: {what}{hint}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where}: not JSON ({exc.reason}){hint}") from None
    return check_depth(where, value, max_depth)


def parse_toml(where: str, text: str, max_depth: int = MAX_DEPTH) -> dict:
    """A TOML document handed in (a preset, a compare job), nesting bounded as :func:`parse_json`'s."""
    try:
        value = tomllib.loads(text)
    except RecursionError:
        raise ConfigError(f"{where}: nested deeper than {max_depth} levels; decodelab reads flatter documents") \
            from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: invalid TOML: {exc}") from None
    return check_depth(where, value, max_depth)


def check_text(option: str, text: str) -> None:
    """Text from the command line or a file must be valid Unicode: undecodable bytes arrive as lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(f"{option} {text.encode('utf-8', 'backslashreplace').decode()!r}: not valid UTF-8 "
                          f"(an undecodable byte at character {exc.start}); give UTF-8 text") from None

# --- numbers: the one reader of every number a user types ----------------------------------------------------------

_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|inf(?:inity)?|nan)", re.IGNORECASE)


def is_int_text(text: str) -> bool:
    """Whether ``text`` is an integer as decodelab reads one: ASCII digits with an optional sign ('²', '١', '1_0',
    '0x10' and '3.0' are not)."""
    return _INT.fullmatch(text.strip()) is not None


def bounds(lo: int | float | None, hi: int | float | None) -> str:
    if lo is not None and hi is not None:
        return f"in [{lo}, {hi}]"
    return f">= {lo}" if lo is not None else f"<= {hi}" if hi is not None else ""


def parse_int(value, option: str, lo: int | None = None, hi: int | None = None) -> int:
    """An integer typed for ``option`` (an option's text, a --set value, a spec's key, a field of a file): a str of
    ASCII digits with an optional sign, or an int (never a bool), then within [lo, hi]; otherwise one line naming
    the option and what is allowed."""
    allowed = bounds(lo, hi)
    if isinstance(value, str):
        if not is_int_text(value):
            raise ConfigError(f"{option} {value!r}: expected int, an integer in ASCII digits 0-9"
                              + (f" {allowed}" if allowed else ""))
        digits = value.strip().lstrip("+-")
        if len(digits) > MAX_DIGITS:  # int() of a long text is slow (and refused past 4300 digits)
            raise ConfigError(f"{option} {value.strip()[:12]}...: {len(digits)} digits, past every bound"
                              + (f"; give an integer {allowed}" if allowed else ""))
        value = int(value.strip())
    elif isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{option} {value!r}: expected an integer" + (f" {allowed}" if allowed else ""))
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ConfigError(f"{option} {value}: must be an integer {allowed}")
    return value


def parse_float(value, option: str) -> float:
    """A number typed for ``option``: a str in ASCII decimal or exponent notation (or inf, nan: the option's own
    range check decides), or an int or float (never a bool); otherwise one line naming the option."""
    if isinstance(value, str):
        if _FLOAT.fullmatch(value.strip()) is None:
            raise ConfigError(f"{option} {value!r}: expected float, a number in ASCII digits (e.g. 0.5 or 1e-3)")
        return float(value.strip())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{option} {value!r}: expected a number")
    try:
        return float(value)
    except OverflowError:
        raise ConfigError(f"{option} {value}: too large for a floating-point number") from None


def parse_numbers(text: str, option: str) -> list[float]:
    """'0.1,0.2 0.3' -> [0.1, 0.2, 0.3]: commas or whitespace between values; -inf allowed, nan is not."""
    items = [t for t in text.replace(",", " ").split() if t]
    if not items:
        raise ConfigError(f"{option}: no values; give numbers separated by commas, e.g. 0.1,0.2,0.7")
    out = []
    for item in items:
        value = parse_float(item, option)
        if math.isnan(value):
            raise ConfigError(f"{option} {item!r}: not a number")
        out.append(value)
    return out


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one): the bound of ``--threads``."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
