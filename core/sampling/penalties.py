"""Stages that penalise what was already said: the CTRL repetition penalty (whole sequence or a window), frequency
and presence penalties (counting prompt and output or the output only, in a window), no-repeat n-grams, DRY.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import ChainError
from .distribution import NEG_INF
from .stage import _bad, _finite
from .registry import implements


@implements("repetition-penalty")
@dataclass
class RepetitionPenalty:
    """For every token already in the sequence: z / theta if z > 0, else z * theta (CTRL, Keskar et al. 2019)."""

    penalty: float
    name: str = "repetition-penalty"
    reads_ids = True

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        seen = torch.gather(logits, 1, ids)
        penalized = torch.where(seen > 0, seen / self.penalty, seen * self.penalty)
        return logits.scatter(1, ids, penalized)


@implements("no-repeat-ngram")
@dataclass
class NoRepeatNGram:
    """Ban every token that would complete an n-gram already present in the sequence."""

    n: int
    name: str = "no-repeat-ngram"
    reads_ids = True

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        length = ids.shape[1]
        if length < self.n:  # no complete n-gram yet, so nothing to ban (n-1 tokens would give unfold nothing)
            return logits.clone()
        out = logits.clone()
        if self.n == 1:
            return out.scatter(1, ids, NEG_INF)
        grams = ids.unfold(1, self.n, 1)  # [B, G, n]: every n-gram seen so far
        tail = ids[:, length - self.n + 1 :]  # the n-1 tokens a new n-gram would start with
        matches = (grams[:, :, :-1] == tail[:, None, :]).all(dim=-1)  # [B, G]
        for row in range(ids.shape[0]):
            banned = grams[row, matches[row], -1]
            out[row, banned] = NEG_INF
        return out

SCOPES = ("all", "output")


# --- which earlier tokens a penalty counts ---------------------------------------------------------------------


@dataclass
class Counted:
    """The tokens a penalty looks at: prompt and output (``scope="all"``) or the generated tokens only
    (``"output"``), and of those only the last ``last_n`` (llama.cpp's ``penalty_last_n``; None = all)."""

    scope: str = "all"
    last_n: int | None = None
    prompt_len: int | None = field(default=None, repr=False)
    reads_ids = True  # each position needs its own prefix (Chain.uses_ids)

    def check_counted(self, option: str) -> None:
        if self.scope not in SCOPES:
            raise _bad(option + " scope", self.scope, f"allowed: {', '.join(SCOPES)}")
        if self.last_n is not None and (not isinstance(self.last_n, int) or self.last_n < 0):
            raise _bad("--penalty-last-n", self.last_n, "must be an integer >= 0 (0 switches the penalties off)")

    def reset(self, prompt_len: int) -> None:
        self.prompt_len = prompt_len

    def counted(self, ids: Tensor) -> Tensor:
        """[B, n]: the counted ids, oldest first."""
        start = 0
        if self.scope == "output":
            if self.prompt_len is None:
                raise ChainError(f"{self.name}: counts generated tokens only, but the run never said where the "
                                 "prompt ends (Chain.reset(prompt_len))")
            start = self.prompt_len
        if self.last_n is not None:
            start = max(start, ids.shape[1] - self.last_n)
        return ids[:, min(start, ids.shape[1]):]

    def counts(self, ids: Tensor, logits: Tensor) -> Tensor:
        """[B, V] float: how often each token occurs among the counted ids."""
        seen = self.counted(ids)
        out = torch.zeros(logits.shape, dtype=logits.dtype, device=logits.device)
        return out.scatter_add_(1, seen, torch.ones(seen.shape, dtype=logits.dtype, device=logits.device))


@implements("repetition-penalty", "windowed")
@dataclass
class WindowedRepetitionPenalty(Counted):
    """The CTRL repetition penalty (z / theta if z > 0, else z * theta) on the counted tokens only (a window, or
    the output only), as llama.cpp's ``penalties`` sampler does with ``penalty_last_n``."""

    penalty: float = 1.0
    name: str = "repetition-penalty"

    def __post_init__(self):
        if not (_finite(self.penalty) and self.penalty > 0):
            raise _bad("--repetition-penalty", self.penalty, "must be > 0 (1 = off)")
        self.check_counted("--repetition-penalty")

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        seen = self.counted(ids)
        if seen.shape[1] == 0:
            return logits.clone()
        return RepetitionPenalty(self.penalty)(seen, logits)


@implements("frequency-penalty")
@dataclass
class FrequencyPenalty(Counted):
    """z_t -= alpha * count(t) among the counted tokens (OpenAI's definition; vLLM counts the output only)."""

    value: float = 0.0
    name: str = "frequency-penalty"

    def __post_init__(self):
        if not _finite(self.value):
            raise _bad("--frequency-penalty", self.value, "must be a finite number")
        self.check_counted("--frequency-penalty")

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        return logits - self.value * self.counts(ids, logits)


@implements("presence-penalty")
@dataclass
class PresencePenalty(Counted):
    """z_t -= alpha if t occurs among the counted tokens (once is enough)."""

    value: float = 0.0
    name: str = "presence-penalty"

    def __post_init__(self):
        if not _finite(self.value):
            raise _bad("--presence-penalty", self.value, "must be a finite number")
        self.check_counted("--presence-penalty")

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        return logits - self.value * (self.counts(ids, logits) > 0).to(logits.dtype)


# --- DRY ---------------------------------------------------------------------------------------------------------


def z_function(seq: list[int]) -> list[int]:
    """z[k] = the length of the longest common prefix of seq and seq[k:] (z[0] = len(seq)); linear time."""
    n = len(seq)
    z = [0] * n
    if n:
        z[0] = n
    left = right = 0  # [left, right) is the rightmost window known to match a prefix
    for k in range(1, n):
        if k < right:
            z[k] = min(right - k, z[k - left])
        while k + z[k] < n and seq[z[k]] == seq[k + z[k]]:
            z[k] += 1
        if k + z[k] > right:
            left, right = k, k + z[k]
    return z


@implements("dry")
@dataclass
class DRY:
    """DRY ("don't repeat yourself", p-e-w 2024; llama.cpp ``src/llama-sampler.cpp`` ``llama_sampler_dry_apply``).

    In the last ``last_n`` tokens h_0..h_{N-1}, for every earlier position j let n_j be the length of the longest
    common suffix of h_0..h_j and the whole window (capped at the number of tokens after the most recent sequence
    breaker). Emitting h_{j+1} would extend that repeat, so for n = max n_j over its occurrences, if
    n >= allowed_length:  z_{h_{j+1}} -= multiplier * base ** (n - allowed_length)  (exponent capped so the power
    stays finite in float32). A token that is itself a one-token breaker is never penalized. ``breakers`` are token
    id sequences (head first). Nothing happens while N <= allowed_length. Reads the window's ids on the host.
    """

    multiplier: float
    base: float = 1.75
    allowed_length: int = 2
    breakers: tuple[tuple[int, ...], ...] = ()
    last_n: int | None = None  # None: the whole sequence (llama.cpp's -1, the context size)
    name: str = "dry"
    reads_ids = True

    def __post_init__(self):
        if not (_finite(self.multiplier) and self.multiplier > 0):
            raise _bad("--dry-multiplier", self.multiplier, "must be > 0 (0 = off)")
        if not (_finite(self.base) and self.base >= 1):
            raise _bad("--dry-base", self.base, "must be >= 1")
        if not isinstance(self.allowed_length, int) or self.allowed_length < 0:
            raise _bad("--dry-allowed-length", self.allowed_length, "must be an integer >= 0")
        if self.last_n is not None and (not isinstance(self.last_n, int) or self.last_n < 1):
            raise _bad("--dry-penalty-last-n", self.last_n, "must be an integer >= 1 (or unset for all tokens)")
        self.breakers = tuple(tuple(int(t) for t in b) for b in self.breakers if len(b) > 0)
        self._single = {b[0] for b in self.breakers if len(b) == 1}
        # llama.cpp: max_exponent = FLOAT_MAX_LOG / log(base), FLOAT_MAX_LOG = log(FLT_MAX) = 88.7228391
        self._max_exp = int(88.7228391 / math.log(self.base)) if self.base > 1.000001 else 0

    def repeat_limit(self, h: list[int]) -> int:
        """Tokens after the end of the most recent breaker in the window (its whole length if none)."""
        n = len(h)
        for i in range(n):  # i tokens after the head candidate h[n-1-i]
            head = n - 1 - i
            longest = -1
            for b in self.breakers:
                tail = len(b) - 1
                if b[0] == h[head] and longest < tail <= i and tuple(h[head + 1 : head + 1 + tail]) == b[1:]:
                    longest = tail
            if longest >= 0:
                return i - longest
        return n

    def penalties(self, h: list[int]) -> dict[int, float]:
        """token -> amount subtracted from its logit, for one row's window h."""
        n = len(h)
        if n <= self.allowed_length:
            return {}
        limit = self.repeat_limit(h)
        if limit < self.allowed_length:
            return {}
        # the longest common suffix of h[:j+1] and h is z[n-1-j] of the reversed window
        z = z_function(h[::-1])
        longest: dict[int, int] = {}
        for j in range(n - 1):
            m = min(z[n - 1 - j], limit)
            if m >= self.allowed_length:
                t = h[j + 1]
                longest[t] = max(longest.get(t, 0), m)
        out = {}
        for t, m in longest.items():
            if t in self._single:
                continue
            exp = m - self.allowed_length
            if self._max_exp > 0:
                exp = min(exp, self._max_exp)
            out[t] = self.multiplier * self.base ** exp
        return out

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        window = ids if self.last_n is None else ids[:, -self.last_n :]
        out = logits.clone()
        for row, h in enumerate(window.tolist()):
            pen = self.penalties(h)
            if pen:
                tokens = torch.tensor(list(pen), device=logits.device)
                out[row, tokens] -= torch.tensor(list(pen.values()), dtype=logits.dtype, device=logits.device)
        return out
