"""Bounded caches for text longer than the context: ``window`` (the last W tokens) and ``sinks`` (the first S tokens
plus the most recent R, StreamingLLM).

Eviction and timing
-------------------
The cache holds at most B = S + R tokens (S = 0 for ``window``, R = W) between forwards. A forward of n tokens
appends them (so within that forward each query attends to at most B cached tokens plus the chunk up to itself),
then ``after_forward(n)`` evicts the oldest non-sink tokens until B remain. With one token per forward this is
exact StreamingLLM: every query sees the S sinks, the R tokens before it and itself. A prefill chunk of c tokens
lets its queries see up to c - 1 more recent tokens than that (prefill in chunks of 1 for the exact pattern).

Positions
---------
* ``keep``: every token keeps its original position (queries at ``seen``), so relative distances to the sinks grow
  without bound, past the trained context.
* ``rerotate``: positions are cache slots. A token is fed at slot ``stored``; when e tokens are evicted before it,
  its cached key is rotated by R(-e) (:mod:`.rope`), so it always sits at its slot. Sinks stay at 0..S-1 and the
  query is at most at slot S + R. (Within the recent tokens relative distances are the same as with ``keep``; only
  the sinks come closer.) Needs RoPE with fixed frequencies (:func:`.rope.shiftable`).

Models with sliding layers of their own (Gemma 2) keep them: those layers hold the model's last sliding_window - 1
tokens whatever the policy keeps, and with ``rerotate`` their keys are rotated by the same e as the recent tokens,
so every distance inside the model's window is unchanged.

Capabilities: ``rows`` and ``reorder`` (all rows evict the same slots). Not ``truncate``: a rolled-back chunk may
already have evicted tokens that the shorter history would still hold, and the queries of a verified draft block
see more tokens than one-at-a-time decoding would; so speculative decoding is refused rather than silently
different.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import ConfigError
from .protocol import (
    KVPolicy,
    ModelInfo,
    choice,
    non_negative_int,
    positive_int,
    register,
    tensor_nbytes,
)
from .rope import Shifter, shiftable

POSITIONS = ("keep", "rerotate")


class BoundedPolicy(KVPolicy):
    """The first ``sinks`` tokens plus the most recent ``recent``; eviction after each forward."""

    capabilities = frozenset({"reorder", "rows"})
    default_positions = "keep"

    def __init__(self, info: ModelInfo, capacity: int | None, needs: frozenset[str], sinks: int, recent: int,
                 positions: str | None):
        super().__init__(info, capacity, needs)
        self.sinks, self.recent = sinks, recent
        self.mode = positions or self.default_positions
        option = f"--cache {self.spec_text()}"
        missing = sorted(set(needs) - self.capabilities)
        if missing:
            raise ConfigError(f"{option}: this run needs the cache to {missing[0]}, which {self.name} cannot "
                              "(evicted tokens cannot come back); use --cache full or recompute")
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        self.model_cache = DynamicCache(config=info.config)
        for layer in self.model_cache.layers:
            if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer):
                raise ConfigError(f"{option}: cache layer {type(layer).__name__} of this model is not supported "
                                  "(only plain and sliding-window attention layers)")
        self.shifter = Shifter(shiftable(info, option), info.device) if self.mode == "rerotate" else None
        self.context = getattr(info.config, "n_positions", None) if info.rotary is None else None
        self._stored = 0
        self.evicted = 0  # tokens evicted so far (all between the sinks and the recent tokens)
        self.last_evicted = (0, 0)  # original positions [start, end) evicted by the last forward

    def spec_text(self) -> str:
        return f"{self.name}:sinks={self.sinks},recent={self.recent},positions={self.mode}"

    @property
    def budget(self) -> int:
        return self.sinks + self.recent

    @property
    def stored(self) -> int:
        return self._stored

    def positions(self, n: int) -> Tensor:
        start = self._stored if self.mode == "rerotate" else self.seen
        if self.context is not None and start + n > self.context:
            raise ConfigError(f"--cache {self.spec_text()}: position {start + n - 1} is past the model's "
                              f"{self.context} absolute positions; use --cache recompute:size=W")
        return torch.arange(start, start + n, device=self.info.device).unsqueeze(0)

    def after_forward(self, n: int) -> None:
        self.seen += n
        held = self._stored + n
        drop = max(held - self.budget, 0)
        self._stored = held - drop
        first = self.sinks + self.evicted  # original position of the oldest non-sink token held
        self.last_evicted = (first, first + drop)
        self.evicted += drop
        if drop:
            self._evict(drop)

    def _evict(self, drop: int) -> None:
        """Drop slots sinks .. sinks + drop - 1 of every full-attention layer; with rerotate, move the recent keys
        (and the model's own sliding-window keys) back by ``drop`` positions."""
        s = self.sinks
        for layer in self.model_cache.layers:
            if not getattr(layer, "is_initialized", False):
                continue
            if getattr(layer, "is_sliding", False):
                if self.shifter is not None:  # same shift as the query: distances inside the window are unchanged
                    layer.keys = self.shifter.shift(layer.keys, drop)
                continue
            recent_k = layer.keys[:, :, s + drop :]
            recent_v = layer.values[:, :, s + drop :]
            if self.shifter is not None:
                recent_k = self.shifter.shift(recent_k, drop)
            layer.keys = torch.cat([layer.keys[:, :, :s], recent_k], dim=2)
            layer.values = torch.cat([layer.values[:, :, :s], recent_v], dim=2)

    def slot_map(self) -> list[tuple[int, int]]:
        """(original position, assigned position) of every token the cache holds, in slot order."""
        held_sinks = min(self.sinks, self._stored)
        originals = list(range(held_sinks)) + list(range(self.seen - (self._stored - held_sinks), self.seen))
        if self.mode == "rerotate":
            return [(p, slot) for slot, p in enumerate(originals)]
        return [(p, p) for p in originals]

    def slot_ranges(self) -> list[list[int]]:
        """The slot map compactly: [original start, original end, assigned start] per contiguous run."""
        held_sinks = min(self.sinks, self._stored)
        recent = self._stored - held_sinks
        runs = [[0, held_sinks], [self.seen - recent, self.seen]]
        runs = [r for r in runs if r[1] > r[0]]
        if len(runs) == 2 and runs[0][1] == runs[1][0]:
            runs = [[runs[0][0], runs[1][1]]]
        slot, out = 0, []
        for a, b in runs:
            out.append([a, b, slot if self.mode == "rerotate" else a])
            slot += b - a
        return out

    def truncate(self, seen: int) -> None:
        raise ConfigError(f"--cache {self.spec_text()}: cannot roll back (evicted tokens are gone)")

    def reorder(self, rows: Tensor) -> None:
        self.model_cache.reorder_cache(rows)

    def layer_nbytes(self) -> list[int]:
        return [tensor_nbytes(getattr(layer, "keys", None)) + tensor_nbytes(getattr(layer, "values", None))
                for layer in self.model_cache.layers]

    def describe(self) -> dict:
        return {"policy": self.name, "seen": self.seen, "stored": self.stored, "positions": self.mode,
                "evicted": self.evicted, "last_evicted": list(self.last_evicted)}


@register
class WindowPolicy(BoundedPolicy):
    name = "window"
    summary = "the last W tokens (size=W); positions=keep (default) or rerotate (cache slots, keys re-rotated)"
    params = {"size": positive_int, "positions": choice(*POSITIONS)}
    default_positions = "keep"

    @staticmethod
    def check_options(values: dict) -> dict:
        if "size" not in values:
            raise ValueError("window needs size=W (the tokens it keeps)")
        return {"positions": WindowPolicy.default_positions, **values}

    def __init__(self, info: ModelInfo, capacity: int | None = None, needs: frozenset[str] = frozenset(),
                 size: int = 0, positions: str | None = None):
        if size < 1:
            raise ConfigError("--cache window: needs size=W (an integer >= 1)")
        super().__init__(info, capacity, needs, sinks=0, recent=size, positions=positions)

    def spec_text(self) -> str:
        return f"window:size={self.recent},positions={self.mode}"


@register
class SinksPolicy(BoundedPolicy):
    name = "sinks"
    summary = ("the first S tokens plus the last R (sinks=S, default 4, recent=R; StreamingLLM); "
               "positions=rerotate (default) or keep")
    params = {"sinks": non_negative_int, "recent": positive_int, "positions": choice(*POSITIONS)}
    default_positions = "rerotate"

    @staticmethod
    def check_options(values: dict) -> dict:
        if "recent" not in values:
            raise ValueError("sinks needs recent=R (the most recent tokens it keeps)")
        return {"sinks": 4, "positions": SinksPolicy.default_positions, **values}

    def __init__(self, info: ModelInfo, capacity: int | None = None, needs: frozenset[str] = frozenset(),
                 sinks: int = 4, recent: int = 0, positions: str | None = None):
        if recent < 1:
            raise ConfigError("--cache sinks: needs recent=R (an integer >= 1)")
        super().__init__(info, capacity, needs, sinks=sinks, recent=recent, positions=positions)
