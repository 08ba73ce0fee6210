"""``recompute``: no KV cache between tokens; the logits of every token come from a fresh forward over the last W
tokens (that token and the W - 1 before it) at positions 0..W-1. The quality baseline for bounded caches
(StreamingLLM's "sliding window with re-computation"): every token's context is encoded from scratch, so nothing a
bounded cache approximates is approximated here, at W times the work per token.

It works through the runtime's one rewrite hook (:meth:`decodelab.core.engine.runtime.Runtime.feed`): ``rewrite(ids,
keep)`` says which forwards to run, the runtime runs them without a cache, then ``after_forward(n)`` commits the
ids. The id history is kept in full (8 bytes a token), so a rollback (``truncate``) and row reordering are exact;
no keys or values are held between forwards, so ``layer_nbytes`` is 0 for every layer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import ConfigError
from .protocol import KVPolicy, ModelInfo, positive_int, register

BATCH_TOKENS = 8192  # windows stacked into one forward, at most this many tokens


@register
class RecomputePolicy(KVPolicy):
    name = "recompute"
    capabilities = frozenset({"truncate", "reorder", "rows"})
    feed_invariant = True  # nothing is evicted, compressed or quantized between forwards
    summary = "no cache: each token's logits from a fresh forward over the last W tokens (size=W; quality baseline)"
    params = {"size": positive_int}

    @staticmethod
    def check_options(values: dict) -> dict:
        if "size" not in values:
            raise ValueError("recompute needs size=W (the tokens each forward re-encodes)")
        return values

    def __init__(self, info: ModelInfo, capacity: int | None = None, needs: frozenset[str] = frozenset(),
                 size: int = 0):
        super().__init__(info, capacity, needs)
        if size < 1:
            raise ConfigError("--cache recompute: needs size=W (an integer >= 1)")
        self.size = size
        self.model_cache = None
        self.history: Tensor | None = None  # [B, seen] every id fed so far
        self._pending: Tensor | None = None

    @property
    def stored(self) -> int:
        return 0  # no keys or values are held between forwards

    def rewrite(self, ids: Tensor, keep: str):
        """The forwards that give the logits of ``ids`` [B, n]: for each wanted token t (the last one, or all),
        the window ids[t - W + 1 .. t] of the whole history, at positions 0..m-1. Yields (windows [B, k, m],
        positions [1, m]): k windows of equal length m stacked (the runtime runs them as B * k rows)."""
        if self.history is not None and self.history.shape[0] != ids.shape[0]:
            raise ConfigError("--cache recompute: the rows changed without a reorder")
        self._pending = ids
        full = ids if self.history is None else torch.cat([self.history[:, -(self.size - 1):] if self.size > 1
                                                          else self.history[:, :0], ids], dim=1)
        offset = full.shape[1] - ids.shape[1]  # index in `full` of ids[:, 0]
        wanted = [ids.shape[1] - 1] if keep == "last" else range(ids.shape[1])
        group: list[Tensor] = []
        for j in wanted:
            end = offset + j + 1
            window = full[:, max(end - self.size, 0) : end]
            if group and (window.shape[1] != group[0].shape[1] or (len(group) + 1) * window.shape[1] > BATCH_TOKENS):
                yield self._stacked(group)
                group = []
            group.append(window)
        if group:
            yield self._stacked(group)

    def slot_ranges(self) -> list[list[int]]:
        """The next token's forward re-encodes the last W - 1 tokens seen from position 0 (with itself at W - 1)."""
        start = max(self.seen - (self.size - 1), 0)
        return [[start, self.seen, 0]] if self.seen > start else []

    def _stacked(self, group: list[Tensor]) -> tuple[Tensor, Tensor]:
        m = group[0].shape[1]
        return torch.stack(group, dim=1), torch.arange(m, device=group[0].device).unsqueeze(0)

    def after_forward(self, n: int) -> None:
        ids, self._pending = self._pending, None
        if ids is None or ids.shape[1] != n:
            raise RuntimeError("recompute: after_forward without the rewrite of the same ids")
        self.history = ids if self.history is None else torch.cat([self.history, ids], dim=1)
        self.seen += n

    def truncate(self, seen: int) -> None:
        if seen > self.seen:
            raise ValueError(f"cannot truncate a cache that has seen {self.seen} tokens to {seen}")
        if self.history is not None:
            self.history = self.history[:, :seen]
        self.seen = seen

    def reorder(self, rows: Tensor) -> None:
        if self.history is not None:
            self.history = self.history.index_select(0, rows.to(self.history.device))

    def layer_nbytes(self) -> list[int]:
        return [0] * self.info.num_layers

    def describe(self) -> dict:
        return {"policy": self.name, "seen": self.seen, "stored": 0, "window": min(self.seen, self.size)}
