"""Reading what the user hands in: text files (one line naming the option when a file is missing, a folder,
unreadable or not UTF-8), output paths checked before a run, and lists of numbers typed on the command line.
"""

from __future__ import annotations

import math
from pathlib import Path

from .errors import ConfigError


def check_output_file(option: str, path: Path) -> None:
    """A file written at the end of a run: not a folder, in a folder that exists and can be written."""
    import os

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


def read_input_text(option: str, path: str | Path) -> str:
    """The text of a file given as ``option``: one line naming the option and the file when it is missing, a folder,
    unreadable or not UTF-8."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"{option} {path}: {'is a folder' if path.is_dir() else 'no such file'}; give a text file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{option} {path}: not UTF-8 text (byte {exc.start}); give a UTF-8 file") from None
    except OSError as exc:
        raise ConfigError(f"{option} {path}: cannot read it ({exc.strerror})") from None
    check_text(option, text)
    return text


def check_text(option: str, text: str) -> None:
    """Text from the command line or a file must be valid Unicode: undecodable bytes arrive as lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(f"{option} {text.encode('utf-8', 'backslashreplace').decode()!r}: not valid UTF-8 "
                          f"(an undecodable byte at character {exc.start}); give UTF-8 text") from None

def parse_numbers(text: str, option: str) -> list[float]:
    """'0.1,0.2 0.3' -> [0.1, 0.2, 0.3]: commas or whitespace between values; -inf allowed, nan is not."""
    items = [t for t in text.replace(",", " ").split() if t]
    if not items:
        raise ConfigError(f"{option}: no values; give numbers separated by commas, e.g. 0.1,0.2,0.7")
    out = []
    for item in items:
        try:
            value = float(item)
        except ValueError:
            raise ConfigError(f"{option} {item!r}: not a number") from None
        if math.isnan(value):
            raise ConfigError(f"{option} {item!r}: not a number")
        out.append(value)
    return out
