"""``static``: every position in tensors preallocated to prompt + new tokens, written in place (the fixed shapes and
addresses torch.compile and CUDA graphs need)."""

from __future__ import annotations

from torch import Tensor

from ..errors import ConfigError
from .protocol import KVPolicy, ModelInfo, register, tensor_nbytes


@register
class StaticPolicy(KVPolicy):
    name = "static"
    capabilities = frozenset({"truncate", "reorder", "rows", "compile"})
    feed_invariant = True  # nothing is evicted, compressed or quantized between forwards
    summary = "every position, preallocated to prompt + -n and written in place (for --compile)"
    params: dict = {}

    def __init__(self, info: ModelInfo, capacity: int | None = None, needs: frozenset[str] = frozenset()):
        super().__init__(info, capacity, needs)
        from transformers import StaticCache

        if capacity is None:
            raise ConfigError("--cache static: this command does not know its length up front; use --cache full")
        self.model_cache = StaticCache(config=info.config, max_cache_len=capacity)
        if "truncate" in needs and not all(getattr(layer, "is_croppable", True) for layer in self.model_cache.layers):
            raise ConfigError(f"--cache static: the model's own sliding layers ({capacity} positions > their window) "
                              "cannot be rolled back once full; use --cache full")

    @property
    def stored(self) -> int:
        return self.seen  # every seen position has its slot (sliding layers of the model hold their window)

    def positions(self, n: int) -> Tensor:
        if self.seen + n > self.capacity:
            raise ConfigError(f"--cache static: {self.seen + n} positions exceed the preallocated {self.capacity}")
        return super().positions(n)

    def truncate(self, seen: int) -> None:
        drop = self.seen - seen
        if drop < 0:
            raise ValueError(f"cannot truncate a cache that has seen {self.seen} tokens to {seen}")
        if drop:
            self.model_cache.crop(-drop)  # stale slots past `seen` are overwritten by the next update
            self.seen = seen

    def reorder(self, rows: Tensor) -> None:
        for layer in self.model_cache.layers:
            if getattr(layer, "is_initialized", False):
                # in place, so the preallocated tensors keep their addresses (and a row count that may grow once,
                # from the prompt's single row to the beams)
                if rows.shape[0] == layer.keys.shape[0]:
                    layer.keys.copy_(layer.keys.index_select(0, rows))
                    layer.values.copy_(layer.values.index_select(0, rows))
                else:
                    layer.keys = layer.keys.index_select(0, rows)
                    layer.values = layer.values.index_select(0, rows)

    def layer_nbytes(self) -> list[int]:
        return [tensor_nbytes(getattr(layer, "keys", None)) + tensor_nbytes(getattr(layer, "values", None))
                for layer in self.model_cache.layers]
