"""References for the presses, written from each paper's definition in plain torch, independent of
``decodelab.core.kv`` (nothing here imports it).

Everything is in ABSOLUTE POSITIONS, never cache slots: a reference keeps, per layer, a LongTensor
``kept[l]`` [B, H_kv, k] of the positions each KV head holds (ascending), and its scores are indexed by position.

The harness (:class:`KeptRun`) runs the model with a full transformers cache that never evicts, and attends with
its own attention function (registered for the run): for layer l and KV head g it gathers the keys and values at
``kept[l][:, g]`` plus the forward's own tokens, and computes

    A = softmax(Q K^T * scale + M)      M = 0, or the dtype's minimum where a chunk query would see a later token
    out = A V

(each query head h reads KV head h // (H / H_kv)). So its logits are, by construction, those of attending over
exactly the kept tokens of each head: the recompute oracle. A press object decides after every forward what each
head keeps, from that forward's probabilities A [B, H, n, K], the positions of its K columns, and the keys; a
:class:`Follow` press copies what a policy reports instead (the oracle for a policy's storage).

Ties: among equal scores the earlier position wins, written as a rank (positions better, plus equal and earlier).
GQA: a KV head's score is the mean over the query heads of its group (kvpress's rule; the SnapKV authors'
issue #22), taken per query for H2O (then summed over queries) and after pooling for SnapKV.
"""

from __future__ import annotations

from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import Tensor

# --- selection --------------------------------------------------------------------------------------------------


def top_by_rank(scores: Tensor, positions: Tensor, k: int) -> Tensor:
    """The k positions of highest score per (row, head), ascending. rank(j) = #{i: s_i > s_j} + #{i before j:
    s_i == s_j} (candidates are given in ascending position order); keep rank < k."""
    greater = (scores.unsqueeze(-2) > scores.unsqueeze(-1)).sum(-1)  # [..., N]: how many beat j
    n = scores.shape[-1]
    earlier = torch.ones(n, n, dtype=torch.bool).tril(-1)  # earlier[j, i]: i < j
    equal_before = ((scores.unsqueeze(-2) == scores.unsqueeze(-1)) & earlier).sum(-1)
    keep = (greater + equal_before) < k
    return positions[keep].view(*positions.shape[:-1], k)


def per_group(x: Tensor, kv_heads: int) -> Tensor:
    """[B, H, ...] -> [B, H_kv, ...]: mean over the query heads that share a KV head."""
    b, h = x.shape[:2]
    return x.reshape(b, kv_heads, h // kv_heads, *x.shape[2:]).mean(dim=2)


def kept_budget(ratio: Fraction | None, size: int | None, seen: int) -> int:
    """size, or floor(ratio * seen) (at least 1)."""
    return size if size is not None else max(int(Fraction(ratio) * seen), 1)


# --- the papers -------------------------------------------------------------------------------------------------


def snapkv_keep(attn: Tensor, window: int, kernel: int, budget: int, kv_heads: int, pool: str) -> Tensor:
    """SnapKV on one layer's prompt attention ``attn`` [B, H, T, T]: the last ``window`` queries' probabilities
    over the prefix keys, summed over those queries, pooled along the keys (stride 1, centred), averaged over the
    group, the best ``budget - window`` prefix positions, plus the window."""
    b, _, t, _ = attn.shape
    votes = attn[:, :, t - window :, : t - window].float().sum(dim=2)  # [B, H, T - w]
    if pool == "max":
        votes = F.max_pool1d(votes, kernel_size=kernel, stride=1, padding=kernel // 2)
    else:
        votes = F.avg_pool1d(votes, kernel_size=kernel, stride=1, padding=kernel // 2)
    votes = per_group(votes, kv_heads)
    prefix = torch.arange(t - window).expand(b, kv_heads, -1)
    chosen = top_by_rank(votes, prefix, budget - window)
    return torch.cat([chosen, torch.arange(t - window, t).expand(b, kv_heads, -1)], dim=-1)


def snapkv_budget(ratio, size, window: int, prompt: int) -> int:
    """The window is always kept; a prompt within the budget is kept whole."""
    return min(max(kept_budget(ratio, size, prompt), window), prompt)


def pyramid_budgets(mean: int, prompt: int, window: int, beta: int, layers: int) -> list[int]:
    """PyramidKV: budgets in arithmetic progression from the first layer (2 mean - mean / beta, at most the prompt)
    to the last (mean / beta, or what keeps the mean when the first is capped), rounded half to even; all ``mean``
    when the last would be below the window."""
    if layers == 1:
        return [mean]
    last = Fraction(mean) / beta
    first = 2 * mean - last
    if first > prompt:
        first = Fraction(prompt)
        last = 2 * mean - first
    if last < window:
        return [mean] * layers
    return [round(first + (last - first) * Fraction(i, layers - 1)) for i in range(layers)]


def tova_keep(probs: Tensor, cols: Tensor, budget: int) -> Tensor:
    """TOVA: the ``budget`` columns the LAST query attends to most, its probabilities averaged over all heads;
    the same positions for every KV head."""
    score = probs[:, :, -1, :].float().mean(dim=1, keepdim=True).expand(-1, cols.shape[1], -1)
    return top_by_rank(score, cols, budget)


def knorm_keep(keys: Tensor, cols: Tensor, budget: int) -> Tensor:
    """KNorm: the ``budget`` positions whose cached key (RoPE applied) has the lowest L2 norm, per KV head."""
    held = keys.gather(2, cols.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1]))
    return top_by_rank(-held.float().norm(dim=-1), cols, budget)


def keydiff_keep(keys: Tensor, cols: Tensor, budget: int) -> Tensor:
    """KeyDiff: the ``budget`` positions whose cached key has the LOWEST cosine similarity to the anchor, the mean of
    the held keys each divided by its norm, per KV head."""
    held = keys.gather(2, cols.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])).double()
    anchor = F.normalize(held, dim=-1).mean(dim=2, keepdim=True)
    return top_by_rank(-F.cosine_similarity(held, anchor, dim=-1).float(), cols, budget)


# --- presses driven by the harness: update(layer, probs, cols, keys, first) -> kept positions ---------------------


class Reference:
    """A press reference: after each forward, what every layer keeps (None: everything it attended to)."""

    decode = False  # also compress after forwards other than the first

    def __init__(self, ratio=None, size=None):
        self.ratio, self.size = ratio, size
        self.budgets: list[int] | None = None

    def set_budgets(self, seen: int, layers: int) -> None:
        """Budgets when ``seen`` tokens have been fed (the prompt, or later for decoding compression)."""
        self.budgets = [kept_budget(self.ratio, self.size, seen)] * layers

    def update(self, layer: int, probs: Tensor, cols: Tensor, keys: Tensor, first: bool) -> Tensor:
        if (first or self.decode) and cols.shape[-1] > self.budgets[layer]:
            return self.choose(layer, probs, cols, keys)
        return cols

    def choose(self, layer, probs, cols, keys) -> Tensor:
        raise NotImplementedError


class SnapKV(Reference):
    def __init__(self, ratio=None, size=None, window=32, kernel=5, pool="max"):
        super().__init__(ratio, size)
        self.window, self.kernel, self.pool = window, kernel, pool

    def set_budgets(self, prompt, layers):
        self.budgets = [snapkv_budget(self.ratio, self.size, self.window, prompt)] * layers

    def choose(self, layer, probs, cols, keys):
        return snapkv_keep(probs, self.window, self.kernel, self.budgets[layer], cols.shape[1], self.pool)


class PyramidKV(SnapKV):
    def __init__(self, ratio=None, size=None, window=32, kernel=5, pool="max", beta=20):
        super().__init__(ratio, size, window, kernel, pool)
        self.beta = beta

    def set_budgets(self, prompt, layers):
        mean = snapkv_budget(self.ratio, self.size, self.window, prompt)
        self.budgets = pyramid_budgets(mean, prompt, self.window, self.beta, layers)


class TOVA(Reference):
    def __init__(self, ratio=None, size=None, decode=True):
        super().__init__(ratio, size)
        self.decode = decode

    def choose(self, layer, probs, cols, keys):
        return tova_keep(probs, cols, self.budgets[layer])


class KNorm(Reference):
    def __init__(self, ratio=None, size=None, decode=False):
        super().__init__(ratio, size)
        self.decode = decode

    def choose(self, layer, probs, cols, keys):
        return knorm_keep(keys, cols, self.budgets[layer])


class KeyDiff(Reference):
    def __init__(self, ratio=None, size=None, decode=False):
        super().__init__(ratio, size)
        self.decode = decode

    def choose(self, layer, probs, cols, keys):
        return keydiff_keep(keys, cols, self.budgets[layer])


class H2O(Reference):
    """Accumulated attention per position (dense over positions), the recent R always kept."""

    def __init__(self, ratio=None, size=None, recent=None, decode=True):
        super().__init__(ratio, size)
        self.recent, self.decode = recent, decode
        self.acc: dict[int, Tensor] = {}

    def update(self, layer, probs, cols, keys, first):
        if first or self.decode:  # every scored forward adds to the tokens it attended to
            votes = per_group(probs.float(), cols.shape[1]).sum(dim=2)  # per query the group mean, then the sum
            acc = self.acc.get(layer)
            if acc is None:
                acc = torch.zeros(*cols.shape[:2], 0)
            acc = F.pad(acc, (0, keys.shape[2] - acc.shape[-1]))
            self.acc[layer] = acc.scatter_add(2, cols, votes)
        return super().update(layer, probs, cols, keys, first)

    def choose(self, layer, probs, cols, keys):
        budget = self.budgets[layer]
        recent = min(budget // 2 if self.recent is None else self.recent, budget)
        newest = keys.shape[2]  # positions 0 .. newest - 1 have been fed
        older = cols[..., : cols.shape[-1] - recent]  # cols ascend: the last `recent` are the newest positions
        assert recent == 0 or bool((cols[..., -recent:] >= newest - recent).all())
        heavy = top_by_rank(self.acc[layer].gather(2, older), older, budget - recent)
        return torch.cat([heavy, cols[..., cols.shape[-1] - recent :]], dim=-1)


class Follow(Reference):
    """Keeps what a policy says it keeps (``kept()`` after the same forward): the oracle for its storage."""

    def __init__(self, policy):
        super().__init__(size=1)
        self.policy = policy

    def set_budgets(self, prompt, layers):
        self.budgets = [0] * layers

    def update(self, layer, probs, cols, keys, first):
        return self.policy.kept()[layer].long()


# --- the harness ------------------------------------------------------------------------------------------------


class KeptRun:
    """Feed a model chunk by chunk, every layer and KV head attending over exactly ``kept`` (see the module doc)."""

    NAME = "press_reference"

    def __init__(self, model, press: Reference):
        from transformers import AttentionInterface, DynamicCache

        AttentionInterface.register(self.NAME, _kept_attention)
        self.model, self.press = model, press
        self.cache = DynamicCache(config=model.config)
        self.layers = model.config.num_hidden_layers
        self.kept: list[Tensor | None] = [None] * self.layers
        self.seen = 0
        self.probs: dict[int, tuple[Tensor, Tensor]] = {}

    @torch.inference_mode()
    def feed(self, ids: Tensor) -> Tensor:
        """Logits [B, n, V] of the chunk ``ids`` [B, n]; then the press updates ``kept``."""
        n = ids.shape[1]
        previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(self.NAME)
        for module in self.model.modules():
            if hasattr(module, "layer_idx") and hasattr(module, "num_key_value_groups"):
                module._reference_run = self
        try:
            out = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=0,
                             position_ids=torch.arange(self.seen, self.seen + n).unsqueeze(0).expand(ids.shape[0], -1))
        finally:
            self.model.set_attn_implementation(previous)
        first = self.seen == 0
        self.seen += n
        if first or self.press.decode:
            self.press.set_budgets(self.seen, self.layers)
        for layer in range(self.layers):
            probs, cols = self.probs[layer]
            self.kept[layer] = self.press.update(layer, probs, cols, self.cache.layers[layer].keys, first)
        return out.logits.float()


def _kept_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """query [B, H, n, D]; key, value [B, H_kv, seen + n, D] (the full cache): attend over kept + the chunk."""
    run: KeptRun = module._reference_run
    layer = module.layer_idx
    b, h, n, _ = query.shape
    kv_heads, total = key.shape[1], key.shape[2]
    chunk = torch.arange(total - n, total).expand(b, kv_heads, n)
    kept = run.kept[layer]
    cols = chunk if kept is None else torch.cat([kept, chunk], dim=-1)  # [B, H_kv, K] positions
    k = key.gather(2, cols.unsqueeze(-1).expand(-1, -1, -1, key.shape[-1]))
    v = value.gather(2, cols.unsqueeze(-1).expand(-1, -1, -1, value.shape[-1]))
    groups = h // kv_heads
    k = k[:, :, None].expand(b, kv_heads, groups, *k.shape[2:]).reshape(b, h, *k.shape[2:])
    v = v[:, :, None].expand(b, kv_heads, groups, *v.shape[2:]).reshape(b, h, *v.shape[2:])
    logits = torch.matmul(query, k.transpose(2, 3)) * scaling
    later = cols[:, :, None, :] > (total - n + torch.arange(n))[None, None, :, None]  # [B, H_kv, n, K]
    later = later[:, :, None].expand(b, kv_heads, groups, n, cols.shape[-1]).reshape(b, h, n, -1)
    mask = torch.zeros_like(logits).masked_fill(later, torch.finfo(logits.dtype).min)
    probs = F.softmax(logits + mask, dim=-1, dtype=torch.float32).to(query.dtype)
    run.probs[layer] = (probs, cols)
    return torch.matmul(probs, v).transpose(1, 2).contiguous(), probs
