"""Score-based eviction ("presses"): the part shared by ``snapkv``, ``pyramidkv``, ``h2o``, ``tova`` and ``knorm``.

A press keeps, in every layer and KV head, the ``budget`` tokens its score ranks highest, and evicts the rest.

Budget and timing
-----------------
``size=S`` keeps S tokens; ``ratio=r`` (0 < r <= 1, exact decimal) keeps floor(r * t) (at least 1), t the tokens
seen when it compresses. ``compress=prefill`` compresses once, after the first forward (the prompt: t = T), and
lets later tokens accumulate; ``compress=decode`` also compresses after every later forward, so between forwards
the cache holds at most S tokens (flat memory), or r of the text seen so far (within a forward of n tokens it
holds that plus n). A forward that leaves the cache within budget evicts nothing, so ``ratio=1`` (or a size of at
least the text) is the full cache exactly.

Layout: per-head slots, no mask
-------------------------------
Each layer is a transformers ``DynamicLayer`` whose keys and values are [B, H_kv, L, D]: every KV head of a layer
holds the same number of slots L (the budget) but each head its own tokens, chosen per head and gathered with
``torch.gather`` into that head's slots. ``pos[l]`` [B, H_kv, L] (int32) is the absolute position of every slot,
and slots stay in ascending position order (a compression keeps the chosen slots in order; new tokens are appended
after them, at larger positions). No mask is needed: keys carry RoPE of their original position (no re-rotation,
so ``positions(n)`` is seen .. seen + n - 1 and only ``stored`` shrinks), a softmax over a set of keys does not
depend on their order, and every cached token precedes every new query. So a query of head h attending over slots
0 .. L - 1 of its KV head plus the causal chunk attends over exactly head h's kept tokens.

The model builds one causal mask for all layers (from layer 0's length). That fits when every layer holds L slots;
a press with per-layer budgets (pyramidkv) gives a mask of one column, zero (it broadcasts to every layer's length),
and takes one token a forward (``one_token_a_forward``: the runtime splits longer forwards).

Selection and ties
------------------
``keep_top`` keeps the k highest scores per (row, KV head); among equal scores the EARLIER position is kept (a
stable descending sort on slots in position order). Max pooling makes ties common, and ``torch.topk`` leaves their
order unspecified, so the rule is stated and tested. Forced tokens (SnapKV's observation window, H2O's recent
tokens) get the score +inf.

How the attention reaches a press
---------------------------------
A press that scores by attention declares ``model_needs = {"attentions"}``. Before a forward the runtime asks
``wants_attentions(n)``; when true it calls the model through :func:`decodelab.core.engine.forward.forward_attending`
(``output_attentions=True`` under eager attention for that forward only) and hands the per-layer probabilities
[B, H, n, L + n] to ``observe_attentions``, before ``after_forward(n)``. Columns are the layer's slots, then the n
new tokens, in that order (``DynamicLayer.update`` appends). A press that needs only keys (knorm) declares
``{"keys"}`` and never switches the model's attention implementation.
"""

from __future__ import annotations

from fractions import Fraction

import torch
from torch import Tensor

from ..errors import ConfigError
from .protocol import KVPolicy, ModelInfo, choice, positive_int, tensor_nbytes

PHASES = ("prefill", "decode")


class Ratio(Fraction):
    """The kept fraction r in (0, 1], exact (floor(r * T) has no float error: 0.29 * 100 is 29), shown as typed."""

    def __str__(self) -> str:
        value = float(self)
        return str(int(value)) if value.is_integer() else repr(value)


def ratio(key: str, text: str) -> Ratio:
    try:  # ASCII only: Fraction would read '٠.٥' as 0.5
        value = Ratio(Fraction(text.strip())) if text.isascii() else Ratio(0)
    except (ValueError, ZeroDivisionError):
        value = Ratio(0)
    if not 0 < value <= 1:
        raise ValueError(f"{key} must be a number in (0, 1] (the fraction of tokens kept)")
    return value


def odd_int(key: str, text: str) -> int:
    value = positive_int(key, text)
    if value % 2 == 0:
        raise ValueError(f"{key} must be odd (the pooling is centred on each token)")
    return value


def budget_params(phases: tuple[str, ...] = PHASES) -> dict:
    """The ``key=value`` parsers every press takes: ratio= or size=, and compress= where both phases are allowed."""
    params = {"ratio": ratio, "size": positive_int}
    if len(phases) > 1:
        params["compress"] = choice(*phases)
    return params


def check_budget(name: str, values: dict, default_compress: str | None) -> dict:
    if ("ratio" in values) == ("size" in values):
        raise ValueError(f"{name} needs exactly one of ratio=R (fraction kept) or size=S (tokens kept)")
    if default_compress is not None:
        values = {"compress": default_compress, **values}
    return values


def keep_top(scores: Tensor, k: int) -> Tensor:
    """Slot indices [B, H_kv, k] of the k highest ``scores`` [B, H_kv, N] in ascending order; on equal scores the
    lower slot (the earlier position) is kept."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    return order.sort(dim=-1).values


def group_mean(per_query_head: Tensor, kv_heads: int) -> Tensor:
    """[B, H, ...] -> [B, H_kv, ...]: the mean over the query heads of each KV group (query head h reads KV head
    h // (H / H_kv), as transformers' repeat_kv lays them out)."""
    b, h = per_query_head.shape[:2]
    return per_query_head.view(b, kv_heads, h // kv_heads, *per_query_head.shape[2:]).mean(dim=2)


class PressPolicy(KVPolicy):
    """Per-head score-based eviction over a DynamicCache; subclasses give ``slot_scores`` (and budgets)."""

    capabilities = frozenset({"reorder", "rows"})
    model_needs: frozenset[str] = frozenset({"attentions"})
    phases: tuple[str, ...] = PHASES
    default_compress = "prefill"

    @classmethod
    def compresses_once(cls, options: dict) -> bool:
        """compress=prefill (the only phase of snapkv and pyramidkv): one compression, after the first forward."""
        return (options.get("compress") or cls.default_compress) == "prefill"

    def __init__(self, info: ModelInfo, capacity: int | None, needs: frozenset[str], ratio: Ratio | None = None,
                 size: int | None = None, compress: str | None = None):
        super().__init__(info, capacity, needs)
        self.ratio, self.size = ratio, size
        self.compress = compress or self.default_compress
        if (ratio is None) == (size is None):
            raise ConfigError(f"--cache {self.name}: needs exactly one of ratio=R or size=S")
        missing = sorted(set(needs) - self.capabilities)
        if missing:
            raise ConfigError(f"--cache {self.spec_text()}: this run needs the cache to {missing[0]}, which "
                              f"{self.name} cannot (evicted tokens cannot come back); use --cache full or recompute")
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        self.model_cache = DynamicCache(config=info.config)
        for layer in self.model_cache.layers:
            if type(layer) is not DynamicLayer:
                raise ConfigError(f"--cache {self.spec_text()}: cache layer {type(layer).__name__} of this model is "
                                  "not supported (presses compress plain full-attention layers only)")
        layers = len(self.model_cache.layers)
        self.pos: list[Tensor | None] = [None] * layers  # [B, H_kv, L] absolute position of every slot
        self.budgets: list[int] | None = None  # per layer, set by each compressing forward
        self.evicted = 0  # (row, head, token) entries evicted so far, summed over layers
        self._attentions: tuple | None = None

    # --- what the spec says ----------------------------------------------------------------------------------

    def spec_options(self) -> dict:
        return {"ratio": self.ratio, "size": self.size, "compress": self.compress if len(self.phases) > 1 else None}

    def spec_text(self) -> str:
        opts = {k: v for k, v in sorted(self.spec_options().items()) if v is not None}
        return self.name + ":" + ",".join(f"{k}={v}" for k, v in opts.items())

    def first_budget(self, tokens: int) -> int:
        """Tokens kept per layer when ``tokens`` tokens have been seen."""
        return self.size if self.size is not None else max(int(self.ratio * tokens), 1)

    def layer_budgets(self, tokens: int) -> list[int]:
        return [self.first_budget(tokens)] * len(self.pos)

    # --- the protocol ----------------------------------------------------------------------------------------

    @property
    def stored(self) -> int:
        return max(self.slots(), default=0)

    def slots(self) -> list[int]:
        """Slots each layer holds now."""
        return [0 if p is None else p.shape[-1] for p in self.pos]

    def compresses_after(self, n: int) -> bool:
        """Whether the forward of the next ``n`` tokens is followed by an eviction in some layer."""
        if self.seen and self.compress != "decode":
            return False
        return any(held + n > b for held, b in zip(self.slots(), self.layer_budgets(self.seen + n)))

    def wants_attentions(self, n: int) -> bool:
        return "attentions" in self.model_needs and self.compresses_after(n)

    def observe_attentions(self, attentions: tuple) -> None:
        if len(attentions) != len(self.pos) or any(a is None for a in attentions):
            raise ConfigError(f"--cache {self.spec_text()}: this model returns no attention weights for every layer "
                              "(even under eager attention); use --cache knorm (keys only)")
        self._attentions = attentions

    def one_token_a_forward(self) -> bool:
        return len(set(self.slots())) > 1

    def attention_mask(self, n: int) -> Tensor | None:
        if not self.one_token_a_forward():
            return None  # every layer holds as many slots: the model's causal mask over them is right
        return torch.zeros(1, 1, n, 1, dtype=self.info.dtype, device=self.info.device)  # n == 1 (runtime splits)

    def after_forward(self, n: int) -> None:
        compresses = self.seen == 0 or self.compress == "decode"
        self.seen += n
        if compresses:
            self.budgets = self.layer_budgets(self.seen)
        for layer in range(len(self.pos)):
            self._append(layer, n)
            self.on_appended(layer, n)
            if compresses and self.slots()[layer] > self.budgets[layer]:
                self._keep(layer, self.select(layer, n))
        self._attentions = None

    def _append(self, layer: int, n: int) -> None:
        keys = self.model_cache.layers[layer].keys
        new = torch.arange(self.seen - n, self.seen, dtype=torch.int32, device=keys.device)
        new = new.expand(keys.shape[0], keys.shape[1], n)
        self.pos[layer] = new.clone() if self.pos[layer] is None else torch.cat([self.pos[layer], new], dim=-1)

    def on_appended(self, layer: int, n: int) -> None:
        """After the n new tokens got slots (H2O accumulates its scores here)."""

    def select(self, layer: int, n: int) -> Tensor:
        """Slot indices [B, H_kv, budget] to keep in ``layer``."""
        return keep_top(self.slot_scores(layer, n), self.budgets[layer])

    def slot_scores(self, layer: int, n: int) -> Tensor:
        """[B, H_kv, L] scores of the layer's slots (the last n are the tokens just fed); higher is kept."""
        raise NotImplementedError

    def per_slot(self) -> dict[str, list[Tensor | None]]:
        """Per-slot state [B, H_kv, L] gathered with the keys (H2O's accumulated attention)."""
        return {}

    def _keep(self, layer: int, idx: Tensor) -> None:
        cache = self.model_cache.layers[layer]
        full = cache.keys.shape[-2]
        rows = idx.unsqueeze(-1).expand(-1, -1, -1, cache.keys.shape[-1])
        cache.keys = cache.keys.gather(2, rows)
        cache.values = cache.values.gather(2, rows.expand(-1, -1, -1, cache.values.shape[-1]))
        self.pos[layer] = self.pos[layer].gather(2, idx)
        for tensors in self.per_slot().values():
            if tensors[layer] is not None:
                tensors[layer] = tensors[layer].gather(2, idx)
        self.evicted += (full - idx.shape[-1]) * idx.shape[0] * idx.shape[1]

    def truncate(self, seen: int) -> None:
        raise ConfigError(f"--cache {self.spec_text()}: cannot roll back (evicted tokens are gone)")

    def reorder(self, rows: Tensor) -> None:
        self.model_cache.reorder_cache(rows)
        for tensors in [self.pos, *self.per_slot().values()]:
            for i, t in enumerate(tensors):
                if t is not None:
                    tensors[i] = t.index_select(0, rows.to(t.device))

    def layer_nbytes(self) -> list[int]:
        """Keys and values, plus the int32 slot positions and any per-slot scores (real tensors held)."""
        extra = self.per_slot()
        return [tensor_nbytes(getattr(layer, "keys", None)) + tensor_nbytes(getattr(layer, "values", None))
                + tensor_nbytes(self.pos[i]) + sum(tensor_nbytes(t[i]) for t in extra.values())
                for i, layer in enumerate(self.model_cache.layers)]

    # --- what it kept ----------------------------------------------------------------------------------------

    def kept(self) -> list[Tensor | None]:
        """Per layer, the absolute positions [B, H_kv, L] each KV head holds, ascending."""
        return [None if p is None else p.clone() for p in self.pos]

    def kept_positions(self, row: int = 0) -> list[list[list[int]]]:
        """The same as lists, for one row: [layer][kv head] -> positions (for JSON ids and the kept-token map)."""
        return [[] if p is None else p[row].tolist() for p in self.pos]

    def describe(self) -> dict:
        return {"policy": self.name, "seen": self.seen, "stored": self.stored, "budgets": self.budgets,
                "evicted": self.evicted}
