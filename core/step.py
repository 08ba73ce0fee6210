"""One decode step, one stop checker, one token buffer: shared by plain decoding, the draft model of speculative
decoding and beam search.

A step is: chain (processed logits) -> selector (token) -> append. Nothing here reads a device value: whether the
chain left the selected token a finite logit (an all -inf row makes the argmax meaningless) travels to the host
with the token id, in the step's one transfer, and :func:`check_selected` turns it into a clean error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from .errors import ConfigError
from .processors import Chain, empty_chain_error


# --- the token buffer ---------------------------------------------------------------------------------------------


class TokenBuffer:
    """The ids so far (prompt + generated) in a preallocated [rows, capacity] tensor, so the prefix the chain sees is
    a view; positions past ``length`` are scratch (drafts). ``tokens`` mirrors row 0 on the host (rows that differ,
    as beams do, are written with :meth:`push` and have no host mirror)."""

    def __init__(self, prompt_ids: list[int], capacity: int, device, rows: int = 1):
        self.ids = torch.zeros(rows, max(capacity, len(prompt_ids)), dtype=torch.long, device=device)
        self.ids[:, : len(prompt_ids)] = torch.tensor(prompt_ids)  # copied to the buffer's device and dtype
        self.tokens = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self._length = len(prompt_ids)

    @property
    def length(self) -> int:
        return self._length

    @property
    def new_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    def prefix(self, extra: int = 0) -> Tensor:
        """[rows, length + extra]: the committed ids plus the first ``extra`` scratch ids."""
        return self.ids[:, : self._length + extra]

    def last(self) -> Tensor:
        """[rows, 1]: the newest committed token (the one the next forward feeds)."""
        n = self._length
        return self.ids[:, n - 1 : n]

    def append(self, token_ids: list[int], device_tokens: Tensor | None = None) -> None:
        """Commit host ids (row 0); ``device_tokens`` [rows, k] writes them without a host-to-device copy."""
        start = self._length
        values = device_tokens if device_tokens is not None else torch.tensor(token_ids)
        self.ids[:, start : start + len(token_ids)] = values
        self.tokens.extend(token_ids)
        self._length += len(token_ids)

    def push(self, device_tokens: Tensor) -> None:
        """Commit one token per row [rows, 1] from the device (rows differ: no host mirror)."""
        self.ids[:, self._length : self._length + 1] = device_tokens
        self._length += 1

    def reorder(self, rows: Tensor) -> None:
        """Rows follow their parents (beam search)."""
        n = self._length
        self.ids[:, :n] = self.ids[rows, :n]


# --- stopping --------------------------------------------------------------------------------------------------


@dataclass
class StopRules:
    """When generation ends: an EOS id (unless ignored), a stop string in the generated text, -n, or the context."""

    max_new_tokens: int
    eos_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    context_length: int | None = None
    stop_ids: tuple[int, ...] = ()  # token ids that end the run like a stop string (--stop-id; not ignored)

    def capacity(self, prompt_len: int) -> int:
        """Positions a run can fill: the prompt and -n new tokens, never past the context (a huge -n allocates no
        more than the context)."""
        total = prompt_len + self.max_new_tokens
        return total if self.context_length is None else max(prompt_len, min(total, self.context_length))


class StopChecker:
    """Checks one appended token at a time, in this order: eos, stop string, context, length.

    A stop string is looked for only in the text of the newest tokens: a match that does not involve the newest
    token would have stopped the run earlier. Each token is at least one byte and a character at most four, so
    the last 4 * (longest stop string) + 4 tokens cover every match that ends in the newest token; the cost per
    token is constant, not the length of the text so far.
    """

    def __init__(self, rules: StopRules, detok: Callable[[list[int]], str] | None = None):
        self.rules = rules
        self.eos = frozenset(() if rules.ignore_eos else rules.eos_ids)
        self.stop_ids = frozenset(rules.stop_ids)
        self.strings = tuple(s for s in rules.stop_strings if s) if detok is not None else ()
        self.detok = detok
        self.window = 4 * max((len(s) for s in self.strings), default=0) + 4

    def check(self, new_ids: list[int], length: int) -> str | None:
        """``new_ids``: generated so far (the newest last); ``length``: the whole sequence, prompt included."""
        if new_ids[-1] in self.eos:
            return "eos"
        if new_ids[-1] in self.stop_ids:
            return "stop"
        if self.strings:
            tail = self.detok(new_ids[-self.window :])
            if any(s in tail for s in self.strings):
                return "stop"
        if self.rules.context_length is not None and length >= self.rules.context_length:
            return "context"
        if len(new_ids) >= self.rules.max_new_tokens:
            return "length"
        return None


def trim_stop(new_ids: list[int], stop_reason: str, rules: StopRules,
              detok: Callable[[list[int]], str]) -> tuple[list[int], str]:
    """``--trim-stop``: the generated ids and text without what stopped the run. A stop id is dropped from both; a
    stop string is cut from the text at its first occurrence (with whatever followed it in the last token), and
    the ids stay as generated (the string may end inside a token)."""
    if stop_reason == "stop" and new_ids and new_ids[-1] in set(rules.stop_ids):
        return new_ids[:-1], detok(new_ids[:-1])
    text = detok(new_ids)
    if stop_reason != "stop":
        return new_ids, text
    hits = [text.find(s) for s in rules.stop_strings if s and s in text]
    return new_ids, text[: min(hits)] if hits else text


def check_prompt(prompt_len: int, context_length: int | None) -> None:
    if prompt_len == 0:
        raise ConfigError("PROMPT: the prompt is empty (0 tokens); give some text")
    if context_length is not None and prompt_len >= context_length:
        raise ConfigError(
            f"PROMPT: the prompt is {prompt_len} tokens but the model's context is {context_length}; shorten it"
        )


# --- one step ----------------------------------------------------------------------------------------------------


class Selected(NamedTuple):
    token: Tensor  # [B] on the device
    processed: Tensor  # [B, V] the distribution the selector drew from (logits)
    stages: list[tuple[str, Tensor]] | None  # ("raw", logits), then each stage's output, when recorded
    finite: Tensor  # [B] bool: the chain left the selected token a finite logit


def select(chain: Chain, selector, ids: Tensor, logits: Tensor, record: bool = False) -> Selected:
    """Chain, then selector, on the device (no host read)."""
    if record:
        processed, stages = chain.run_recorded(ids, logits)
    else:
        processed, stages = chain.apply(ids, logits), None
    token = selector.from_logits(processed)
    finite = torch.isfinite(processed.gather(-1, token.unsqueeze(-1)).squeeze(-1))
    return Selected(token, processed, stages, finite)


def check_selected(finite: bool, chain: Chain, logits: Tensor | None = None) -> None:
    """The argmax of an all -inf (or NaN) row is meaningless: one clean error instead (``logits``, the processed
    rows, tell an overflow from a chain that removed everything)."""
    if not finite:
        raise empty_chain_error(chain.names, logits)
