"""The trace file format: which version of the JSON documents this decodelab reads, and telling a decodelab trace
from an OpenAI completions response (the two kinds `decodelab view` takes) and from anything else.

A document without ``format_version`` is version 1 (every document written before the field existed); a document
from a newer decodelab carries a higher number and is refused with one line rather than shown half-understood."""

from __future__ import annotations

from ..errors import ConfigError
from ..inputs import parse_json
from .openai import is_openai

FORMAT_VERSION = 1  # bump when a field changes meaning or moves; adding fields keeps the version

DECODELAB = "decodelab"
OPENAI = "openai"


def format_version(doc: dict) -> int:
    """The document's format version (1 when it has none)."""
    return doc.get("format_version", 1)


def check_version(doc: dict, source: str) -> None:
    version = format_version(doc)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ConfigError(f"{source}: format_version {version!r} is not a version number (1, 2, ...)")
    if version > FORMAT_VERSION:
        raise ConfigError(f"{source}: format_version {version} is newer than this decodelab reads "
                          f"({FORMAT_VERSION}); upgrade decodelab to view it")


def parse_trace(source: str, text: str):
    """One JSON document (:func:`decodelab.core.inputs.parse_json`: malformed input, JSON lines and nesting past its
    bound are one line)."""
    return parse_json(source, text, expected="give one document, a trace written with `-f json` or an OpenAI "
                      "completions response")


def trace_kind(doc, source: str, commands) -> str:
    """``decodelab`` (a document of one of ``commands``) or ``openai`` (a completions response or its logprobs
    object); anything else is refused with one line."""
    if isinstance(doc, dict) and isinstance(doc.get("command"), str):
        if doc["command"] not in commands:
            raise ConfigError(f"{source}: command {doc['command']!r} is not a decodelab command "
                              f"({', '.join(sorted(commands))})")
        check_version(doc, source)
        return DECODELAB
    if isinstance(doc, dict) and is_openai(doc):
        return OPENAI
    what = type(doc).__name__ if not isinstance(doc, dict) else "an object without `command` or `choices`"
    raise ConfigError(f"{source}: not a decodelab trace (`-f json` output, with a `command`) nor an OpenAI "
                      f"completions response (`choices[].logprobs` with `tokens` and `token_logprobs`): {what}")
