"""Stages that add to or remove given tokens: logit bias, sequence bias and multi-token bans, the allow-list, and the
minimum-new-tokens ban on the end ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import ChainError, ConfigError
from .distribution import NEG_INF
from .stage import _bad
from .registry import implements


@implements("bias")
@dataclass
class LogitBias:
    """z_t += b_t for each biased token t (b = -inf bans t)."""

    bias: dict[int, float]
    name: str = "bias"

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        out = logits.clone()
        for token_id, value in self.bias.items():
            out[..., token_id] += value
        return out


# --- constraints ----------------------------------------------------------------------------------------------


@implements("min-new-tokens")
@dataclass
class MinNewTokens:
    """Ban the end ids (EOS, and stop ids where the engine does) while fewer than n tokens were generated
    (transformers' ``MinNewTokensLengthLogitsProcessor``; vLLM's ``min_tokens``)."""

    n: int
    end_ids: tuple[int, ...] = ()
    name: str = "min-new-tokens"
    prompt_len: int | None = field(default=None, repr=False)
    reads_ids = True

    def __post_init__(self):
        if not isinstance(self.n, int) or self.n < 0:
            raise _bad("--min-new-tokens", self.n, "must be an integer >= 0")

    def reset(self, prompt_len: int) -> None:
        self.prompt_len = prompt_len

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        if self.prompt_len is None:
            raise ChainError("min-new-tokens: the run never said where the prompt ends (Chain.reset(prompt_len))")
        out = logits.clone()
        if ids.shape[1] - self.prompt_len < self.n and self.end_ids:
            out[:, list(self.end_ids)] = NEG_INF
        return out


@implements("sequence-bias")
@dataclass
class SequenceBias:
    """For each (sequence, bias): add bias to the logit of the sequence's last token when the ids end with the
    rest of it (a one-token sequence always); biases of several sequences add up (transformers'
    ``SequenceBiasLogitsProcessor``; with -inf, ``NoBadWordsLogitsProcessor``)."""

    biases: tuple[tuple[tuple[int, ...], float], ...]
    name: str = "sequence-bias"
    reads_ids = True

    def __post_init__(self):
        cleaned = []
        for seq, bias in self.biases:
            seq = tuple(int(t) for t in seq)
            if not seq:
                raise _bad("--" + self.name, "''", "a sequence needs at least one token")
            if math.isnan(bias):
                raise _bad("--" + self.name, bias, "the bias must be a number or -inf")
            cleaned.append((seq, float(bias)))
        self.biases = tuple(cleaned)

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        out = logits.clone()
        for seq, bias in self.biases:
            last, prefix = seq[-1], seq[:-1]
            if not prefix:
                out[:, last] += bias
                continue
            if ids.shape[1] < len(prefix):
                continue
            want = torch.tensor(prefix, dtype=ids.dtype, device=ids.device)
            match = (ids[:, -len(prefix) :] == want).all(dim=-1)
            out[:, last] = torch.where(match, out[:, last] + bias, out[:, last])
        return out


@implements("ban")
@dataclass
class Ban(SequenceBias):
    """Multi-token bans: the last token of a banned sequence is removed when the ids end with the rest of it."""

    biases: tuple = ()
    sequences: tuple[tuple[int, ...], ...] = ()
    name: str = "ban"

    def __post_init__(self):
        self.biases = tuple((seq, NEG_INF) for seq in self.sequences)
        super().__post_init__()


@implements("allow")
@dataclass
class AllowList:
    """Only the listed token ids stay candidates (vLLM's ``allowed_token_ids``)."""

    token_ids: tuple[int, ...]
    name: str = "allow"

    def __post_init__(self):
        self.token_ids = tuple(sorted({int(t) for t in self.token_ids}))
        if not self.token_ids:
            raise _bad("--allow", "''", "give at least one token")

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        if self.token_ids[-1] >= logits.shape[-1] or self.token_ids[0] < 0:
            raise ConfigError(f"--allow {self.token_ids[-1]}: token id out of range [0, {logits.shape[-1]})")
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        keep[list(self.token_ids)] = True
        return logits.masked_fill(~keep, NEG_INF)
