"""``full``: every position, in the model's own layout (a model with sliding layers of its own keeps them)."""

from __future__ import annotations

from torch import Tensor

from .protocol import KVPolicy, ModelInfo, register, tensor_nbytes


@register
class FullPolicy(KVPolicy):
    name = "full"
    capabilities = frozenset({"truncate", "reorder", "rows"})
    feed_invariant = True  # nothing is evicted, compressed or quantized between forwards
    summary = "every position (the model's own cache layout; its sliding layers stay sliding)"
    params: dict = {}

    def __init__(self, info: ModelInfo, capacity: int | None = None, needs: frozenset[str] = frozenset()):
        super().__init__(info, capacity, needs)
        from transformers import DynamicCache

        self.model_cache = DynamicCache(config=info.config)
        if "truncate" in needs:
            # sliding layers keep what they would drop until the next truncate, so a rollback can restore them
            self.model_cache.activate_past_recording()

    @property
    def stored(self) -> int:
        held = [layer.keys.shape[-2] for layer in self.model_cache.layers
                if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4]
        return max(held, default=0)

    def truncate(self, seen: int) -> None:
        drop = self.seen - seen
        if drop < 0:
            raise ValueError(f"cannot truncate a cache that has seen {self.seen} tokens to {seen}")
        if drop:
            self.model_cache.crop(-drop)  # transformers: crop(-k) removes the last k positions
            self.seen = seen

    def reorder(self, rows: Tensor) -> None:
        self.model_cache.reorder_cache(rows)

    def layer_nbytes(self) -> list[int]:
        return [tensor_nbytes(getattr(layer, "keys", None)) + tensor_nbytes(getattr(layer, "values", None))
                for layer in self.model_cache.layers]
