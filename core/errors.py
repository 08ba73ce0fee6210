"""Errors the CLI turns into one line and exit status 2 (bad input), never a traceback."""

from __future__ import annotations


class DecodelabError(Exception):
    """Bad input or an impossible request; the message is shown to the user as is."""


class ConfigError(DecodelabError):
    """An option or preset value outside what is allowed. The message names the option and the allowed values."""


class ModelLoadError(DecodelabError):
    """A model or tokenizer that cannot be found or loaded under the offline, safetensors-only rules."""


class ChainError(DecodelabError):
    """A processor chain that leaves no candidate token."""


# The stop reason of a run whose chain left no candidate mid-run (a ChainError): what was produced is kept.
EMPTY_CHAIN = "empty_chain"
