"""What a score-based policy kept: per layer and KV head, the positions its slots hold, and its real bytes.

A press (:mod:`.press`) chooses tokens per layer and head, so "which tokens survived" has one answer per (layer,
head). :func:`kept_map` reads it off the policy after a run, for one batch row:

    heads[l][h]   = the absolute positions KV head h of layer l holds, ascending (``PressPolicy.kept_positions``)
    slots[l]      = len(heads[l][h]) (every head of a layer holds as many slots)
    kv_bytes[l]   = real bytes the layer stores (keys, values, slot positions, per-slot scores: ``layer_nbytes``)
    kept_by()[p]  = the number of (layer, head) pairs that hold position p, out of layers x kv_heads

A policy that keeps positions by place (full, window, sinks, quant, ...) has no per-head choice to show:
:func:`kept_map` returns None for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KeptLayer:
    layer: int
    slots: int  # slots each KV head holds
    kv_bytes: int  # real bytes this layer stores
    heads: list[list[int]] = field(default_factory=list)  # per KV head: the absolute positions it holds, ascending


@dataclass
class KeptMap:
    policy: str  # the spec, every key shown
    seen: int  # tokens the cache has been fed (the next position)
    prompt_tokens: int  # positions 0 .. prompt_tokens - 1 are the prompt (the text, for score)
    kv_bytes: int  # real bytes of the whole cache (the sum of the layers')
    evicted: int  # (layer, head, position) entries evicted so far
    layers: list[KeptLayer] = field(default_factory=list)

    def kept_by(self, layers: list[int] | None = None) -> list[int]:
        """Per position 0 .. seen - 1: how many (layer, head) pairs of ``layers`` (default all) hold it."""
        counts = [0] * self.seen
        for layer in self.layers if layers is None else [self.layers[i] for i in layers]:
            for head in layer.heads:
                for p in head:
                    counts[p] += 1
        return counts

    def pairs(self) -> int:
        return sum(len(layer.heads) for layer in self.layers)

    def prompt_kept(self, layer: int, head: int) -> list[int]:
        """The prompt positions one head holds."""
        return [p for p in self.layers[layer].heads[head] if p < self.prompt_tokens]


def kept_map(policy, prompt_tokens: int, row: int = 0) -> KeptMap | None:
    """The kept map of ``policy`` for batch row ``row`` (None for a policy without per-head kept positions)."""
    per_layer = policy.kept_positions(row)
    if per_layer is None:
        return None
    nbytes = policy.layer_nbytes()
    layers = [KeptLayer(i, len(heads[0]) if heads else 0, nbytes[i], heads) for i, heads in enumerate(per_layer)]
    return KeptMap(policy.spec_text(), policy.seen, prompt_tokens, sum(nbytes), policy.evicted, layers)


def kept_after(runtime, prompt_tokens: int) -> KeptMap | None:
    """The kept map of a finished run's cache over its first ``prompt_tokens`` (None: no run yet, or a policy that
    keeps by place)."""
    return None if runtime is None else kept_map(runtime.policy, min(prompt_tokens, runtime.policy.seen))


def document_part(kept: KeptMap | None) -> dict:
    """The ``kv_kept`` field of a run's JSON document (absent for a policy without a kept map)."""
    return {} if kept is None else {"kv_kept": kept}
