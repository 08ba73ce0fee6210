"""llama.cpp's own forms of two filters, run under ``--semantics llamacpp`` (the registry's ``llamacpp`` variants):
top-k keeps exactly k tokens, and min-p above 1 keeps one.

Top-k and ties (``src/llama-sampler.cpp`` ``llama_sampler_top_k_impl``)
---------------------------------------------------------------------
llama.cpp shrinks its candidate array to the first k after a partial sort by logit, descending. When the k-th
logit is tied with tokens past it, which of them stay is decided by the sort, and the sort is not stable:

* k <= 128: ``std::partial_sort(first, first + k, last)``. In libstdc++ (GCC, the Linux build) that is a heap
  selection: a heap of the first k candidates whose top is the smallest logit; every later candidate with a logit
  *strictly* greater than the top replaces it (the top is moved out, the newcomer sifted down). So the kept tied
  tokens are those the heap happens to hold, not simply the lowest ids.
* k > 128: a bucket pass: 128 buckets over logits [-10, 10] (``int(6.4f * z + 64.0f)``, clamped), every bucket
  above the one where the count reaches k is kept whole, and the heap selection above runs over the boundary
  bucket's candidates (in their array order) for the rest.

:func:`heap_select` and :func:`partial_sort_keep` replay both, in float32, on the candidates in token-id order: the
array's order when top-k is the first sorting stage (as in llama.cpp's default order: penalties, DRY and
top-n-sigma do not reorder it). Two limits, said in docs/semantics.md: after a stage that sorted the array (a
``--chain`` with top-p, min-p or typical before top-k) llama.cpp keeps that sort's order instead; and a build that
fuses ``6.4f * z + 64.0f`` into one FMA can put a logit within rounding of a bucket edge into the next bucket.
Without a tie across the k-th place every rule keeps the same k tokens, and the fast path never leaves the device.

Min-p above 1 (``llama_sampler_min_p_apply``)
--------------------------------------------
llama.cpp keeps z_i >= z_max + log(min_p), in float32; above 1 no logit reaches it and its fallback keeps only the
first candidate of its sorted array: one token, the most likely. Among tokens tied at the top decodelab keeps the
lowest id (what top-k 1 keeps; llama.cpp keeps whichever its last sort put first).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .distribution import NEG_INF
from .filters import MinP, TopK
from .registry import implements

HEAP_SORT_MAX_K = 128  # llama_token_data_array_partial_sort_inplace: std::partial_sort up to this k
BUCKETS, BUCKET_LOW, BUCKET_HIGH = 128, -10.0, 10.0


# --- libstdc++'s heap selection, replayed ------------------------------------------------------------------------


def _greater(values, a: int, b: int) -> bool:
    """llama.cpp's comparator: ``a.logit > b.logit``."""
    return values[a] > values[b]


def _push_heap(values, heap: list[int], hole: int, top: int, value: int) -> None:
    """libstdc++ ``__push_heap``: move ``value`` up from ``hole`` while its parent compares below it."""
    parent = (hole - 1) // 2
    while hole > top and _greater(values, heap[parent], value):
        heap[hole] = heap[parent]
        hole = parent
        parent = (hole - 1) // 2
    heap[hole] = value


def _adjust_heap(values, heap: list[int], hole: int, length: int, value: int) -> None:
    """libstdc++ ``__adjust_heap``: sift the hole down to a leaf along the larger child, then push ``value`` up."""
    top = hole
    child = hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        if _greater(values, heap[child], heap[child - 1]):
            child -= 1
        heap[hole] = heap[child]
        hole = child
    if length % 2 == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        heap[hole] = heap[child - 1]
        hole = child - 1
    _push_heap(values, heap, hole, top, value)


def heap_select(values, k: int) -> list[int]:
    """Positions of ``values`` that libstdc++'s ``std::partial_sort(first, first + k, last, greater)`` leaves in
    its first k places (``__heap_select``): make a heap of the first k; each later value strictly greater than the
    heap's top (its smallest) replaces the top."""
    heap = list(range(k))
    if k >= 2:  # __make_heap
        parent = (k - 2) // 2
        while True:
            _adjust_heap(values, heap, parent, k, heap[parent])
            if parent == 0:
                break
            parent -= 1
    for i in range(k, len(values)):
        if _greater(values, i, heap[0]):  # __pop_heap(first, middle, i): the top leaves, i is sifted in
            _adjust_heap(values, heap, 0, k, i)
    return heap


def bucket_of(values: np.ndarray) -> np.ndarray:
    """llama.cpp's bucket of each float32 logit: int(6.4f * z + 64.0f) (two float32 roundings, truncated toward 0)
    clamped to [0, 127]; a non-finite logit converts to INT_MIN on x86, so bucket 0."""
    scale = np.float32(BUCKETS / (BUCKET_HIGH - BUCKET_LOW))
    inter = np.float32(-BUCKET_LOW) * scale
    with np.errstate(invalid="ignore", over="ignore"):
        raw = (scale * values.astype(np.float32)).astype(np.float32) + inter
    out = np.zeros(values.shape, dtype=np.int64)
    finite = np.isfinite(raw)
    out[finite] = np.trunc(raw[finite]).astype(np.int64)
    return np.clip(out, 0, BUCKETS - 1)


def partial_sort_keep(values: np.ndarray, k: int) -> list[int]:
    """Positions llama.cpp's top-k keeps of a float32 candidate array in its order (module docstring)."""
    if k <= HEAP_SORT_MAX_K:
        return heap_select(values.tolist(), k)
    bucket = bucket_of(values)
    counts = np.bincount(bucket, minlength=BUCKETS)
    have, edge = 0, BUCKETS - 1
    for edge in range(BUCKETS - 1, -1, -1):  # the highest buckets holding at least k candidates together
        have += int(counts[edge])
        if have >= k:
            break
    whole = np.nonzero(bucket > edge)[0].tolist()
    boundary = np.nonzero(bucket == edge)[0]
    chosen = heap_select(values[boundary].tolist(), k - len(whole))
    return whole + boundary[chosen].tolist()


# --- the stages ---------------------------------------------------------------------------------------------------


@implements("top-k", variant="llamacpp")
@dataclass
class LlamaCppTopK(TopK):
    """Exactly k tokens (decodelab's own top-k also keeps every token tied with the k-th); the tie at the k-th
    place is broken as llama.cpp's libstdc++ build breaks it (module docstring)."""

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        k = min(self.k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]
        above = logits > kth
        tied = logits == kth
        # a row whose k-th logit is not shared with a token past it keeps the same k under every rule; a row whose
        # k-th is -inf keeps every finite token and some -inf ones, which changes nothing
        exact = ((above.sum(-1) + tied.sum(-1)) == k) | torch.isneginf(kth[..., 0])
        keep = above | tied
        rows = (~exact).nonzero().flatten().tolist()
        if rows:
            host = logits[rows].float().cpu().numpy()
            keep = keep.clone()
            for r, row in zip(rows, host):
                mask = torch.zeros(logits.shape[-1], dtype=torch.bool)
                mask[partial_sort_keep(row, k)] = True
                keep[r] = mask.to(logits.device)
        return logits.masked_fill(~keep, NEG_INF)


@implements("min-p", variant="llamacpp")
@dataclass
class LlamaCppMinP(MinP):
    """llama.cpp's min-p: keep z_i >= z_max + log(min_p) (float32); above 1 nothing reaches that and one token
    stays, the most likely (the lowest id among ties at the top)."""

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        z = logits.float()
        top = z.amax(dim=-1, keepdim=True)
        if self.min_p > 1:
            best = z.argmax(dim=-1, keepdim=True)  # torch returns the first maximal index
            return torch.full_like(logits, NEG_INF).scatter(1, best, logits.gather(1, best))
        threshold = top + torch.tensor(np.log(np.float32(self.min_p)), dtype=torch.float32)
        return logits.masked_fill(z < threshold, NEG_INF)
