"""The token buffer every decoding loop appends to, and the prompt-length check against the model's context.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import ConfigError

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


def check_prompt(prompt_len: int, context_length: int | None) -> None:
    if prompt_len == 0:
        raise ConfigError("PROMPT: the prompt is empty (0 tokens); give some text")
    if context_length is not None and prompt_len >= context_length:
        raise ConfigError(
            f"PROMPT: the prompt is {prompt_len} tokens but the model's context is {context_length}; shorten it"
        )
