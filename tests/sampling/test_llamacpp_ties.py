"""llama.cpp's top-k under ties, against the C++ standard library it runs on: a small program (written here, not
llama.cpp's) does what ``llama_sampler_top_k_impl`` does to an unsorted candidate array (``std::partial_sort`` for
k <= 128; the 128-bucket pass and a partial sort of the boundary bucket above that), compiled with the system's
g++ (libstdc++, llama.cpp's Linux build); decodelab's replay must keep the same tokens on tie-heavy vectors. Skipped
where no g++ exists; the hand-worked cases below need none."""

from __future__ import annotations

import random
import shutil
import subprocess

import numpy as np
import pytest
import torch

from decodelab.core.sampling.llamacpp import LlamaCppMinP, LlamaCppTopK, bucket_of, heap_select, partial_sort_keep

PROGRAM = r"""
#include <algorithm>
#include <cstdio>
#include <vector>
struct Tok { int id; float logit; };
static bool greater(const Tok & a, const Tok & b) { return a.logit > b.logit; }
int main() {
    int n, k;
    while (std::scanf("%d %d", &n, &k) == 2) {
        std::vector<Tok> a(n);
        for (int i = 0; i < n; i++) { a[i].id = i; std::scanf("%f", &a[i].logit); }
        std::vector<Tok> kept;
        if (k <= 128) {
            std::partial_sort(a.begin(), a.begin() + k, a.end(), greater);
            kept.assign(a.begin(), a.begin() + k);
        } else {
            const float scale = 128 / (10.0f - -10.0f), inter = 10.0f * scale;
            std::vector<int> bucket(n), count(128, 0);
            for (int i = 0; i < n; i++) {
                int b = int(scale * a[i].logit + inter);
                bucket[i] = std::max(0, std::min(127, b));
                count[bucket[i]]++;
            }
            int have = 0, edge = 127;
            for (; edge >= 0; --edge) { have += count[edge]; if (have >= k) break; }
            std::vector<Tok> boundary;
            for (int i = 0; i < n; i++) {
                if (bucket[i] > edge) kept.push_back(a[i]);
                else if (bucket[i] == edge) boundary.push_back(a[i]);
            }
            int rest = k - (int) kept.size();
            std::partial_sort(boundary.begin(), boundary.begin() + rest, boundary.end(), greater);
            kept.insert(kept.end(), boundary.begin(), boundary.begin() + rest);
        }
        std::vector<int> ids;
        for (auto & t : kept) ids.push_back(t.id);
        std::sort(ids.begin(), ids.end());
        for (size_t i = 0; i < ids.size(); i++) std::printf(i ? " %d" : "%d", ids[i]);
        std::printf("\n");
    }
}
"""


def cases(seed: int = 0):
    rng = random.Random(seed)
    out = []
    for _ in range(150):  # k <= 128: the heap selection over the whole array
        n = rng.randint(2, 60)
        values = [float(rng.choice([-1, 0, 0.5, 1, 2])) for _ in range(n)]
        out.append((values, rng.randint(1, n)))
    for _ in range(40):  # k > 128: buckets, then the heap selection over the boundary bucket
        n = rng.randint(200, 400)
        values = [float(rng.choice([-12.0, -3.0, 0.0, 0.1, 0.15, 4.0, 9.9, 11.0])) for _ in range(n)]
        out.append((values, rng.randint(129, n)))
    return out


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the libstdc++ oracle")
def test_the_replay_keeps_what_libstdcxx_keeps(tmp_path):
    source, binary = tmp_path / "topk.cpp", tmp_path / "topk"
    source.write_text(PROGRAM)
    subprocess.run(["g++", "-O2", "-o", str(binary), str(source)], check=True, capture_output=True)
    todo = cases()
    text = "".join(f"{len(v)} {k} {' '.join(repr(x) for x in v)}\n" for v, k in todo)
    lines = subprocess.run([str(binary)], input=text, capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(lines) == len(todo)
    lowest_ids_differ = 0
    for (values, k), line in zip(todo, lines):
        expected = [int(x) for x in line.split()]
        assert sorted(partial_sort_keep(np.array(values, dtype=np.float32), k)) == expected, (values, k)
        kth = sorted(values, reverse=True)[k - 1]
        lowest = sorted(i for i, v in enumerate(values) if v > kth) + [i for i, v in enumerate(values) if v == kth]
        lowest_ids_differ += sorted(lowest[:k]) != expected
    assert lowest_ids_differ > 10  # the vectors do reach cases where "lowest ids first" is not llama.cpp's rule


def test_hand_worked_heap_selection():
    """logits [0, 1, 1, 2], k = 2: the heap starts as tokens 0, 1 with 0 (the smallest) on top; token 2 (1 > 0)
    replaces it and is sifted below token 1, so token 1 is on top when token 3 (2 > 1) arrives and replaces it:
    llama.cpp keeps tokens 2 and 3, not the lower id 1 of the two tied at the k-th place. A later value equal to the
    top never enters ([1, 3, 3], k = 1 keeps token 1)."""
    assert sorted(heap_select([0.0, 1.0, 1.0, 2.0], 2)) == [2, 3]
    assert sorted(heap_select([1.0, 1.0, 2.0], 2)) == [0, 2]
    assert heap_select([3.0, 1.0, 1.0], 1) == [0]
    assert heap_select([1.0, 3.0, 3.0], 1) == [1]


def test_bucket_edges_in_float32():
    """int(6.4f * z + 64.0f) clamped to [0, 127]: -10 and below in bucket 0, 10 and above in 127, -inf in 0."""
    z = np.array([-11.0, -10.0, -0.15625, 0.0, 9.84375, 10.0, 25.0, -np.inf], dtype=np.float32)
    assert bucket_of(z).tolist() == [0, 0, 63, 64, 127, 127, 127, 0]


def test_llamacpp_top_k_keeps_exactly_k_and_decodelabs_keeps_the_ties():
    from decodelab.core.sampling.filters import TopK

    logits = torch.tensor([[0.0, 1.0, 1.0, 2.0], [0.5, 0.5, 0.5, 0.5], [3.0, 2.0, 1.0, 0.0]])
    ours = LlamaCppTopK(2)(None, logits)
    assert torch.isfinite(ours).sum(-1).tolist() == [2, 2, 2]
    assert torch.isfinite(ours[0]).tolist() == [False, False, True, True]  # the heap's tie rule (hand-worked above)
    assert torch.isfinite(ours[1]).tolist() == [True, True, False, False]
    assert torch.isfinite(TopK(2)(None, logits)).sum(-1).tolist() == [3, 4, 2]
    assert torch.equal(ours[2], TopK(2)(None, logits)[2])  # no tie across the k-th place: the same k
    masked = torch.tensor([[0.0, float("-inf"), float("-inf"), 1.0]])  # k beyond the finite tokens: unchanged
    assert torch.equal(LlamaCppTopK(3)(None, masked), masked)


def test_llamacpp_min_p_above_one_keeps_one_and_at_one_keeps_the_tied_maximum():
    logits = torch.tensor([[2.0, 1.0, 2.0, 0.0]])
    assert torch.isfinite(LlamaCppMinP(1.05)(None, logits)).tolist() == [[True, False, False, False]]
    assert torch.isfinite(LlamaCppMinP(1.0)(None, logits)).tolist() == [[True, False, True, False]]
    # z >= z_max + log(min_p): e^-1 = 0.3679 of the maximum passes 0.36, not 0.37
    assert torch.isfinite(LlamaCppMinP(0.36)(None, logits)).tolist() == [[True, True, True, False]]
    assert torch.isfinite(LlamaCppMinP(0.37)(None, logits)).tolist() == [[True, False, True, False]]


# --- exact edges the mutation run (tests/mutation/run.sh, core/sampling/llamacpp.py) showed no test pinned -------


def test_llamacpp_min_p_works_row_by_row_in_a_batch():
    """Min-p is relative to each row's own maximum: a batch (beams, batched requests) gives each row what it gives
    alone. Row 1's maximum (1.0) is far below row 0's (5.0), so a batch-wide maximum would empty it; above 1 each
    row keeps its own arg-max (3 and 1), not one position of the flattened batch. Bug caught: the maximum or the
    arg-max taken over the whole batch, or a threshold that lost its row axis."""
    logits = torch.tensor([[5.0, 4.0, 0.0, 4.5], [1.0, 0.5, -3.0, 0.9], [0.0, 2.0, 2.0, 1.0]])
    for min_p in (0.5, 1.0, 1.5):
        stage = LlamaCppMinP(min_p)
        alone = torch.cat([stage(None, row[None]) for row in logits])
        assert torch.equal(stage(None, logits), alone)
    # by hand: z >= max + log 0.5 = max - 0.693
    assert torch.isfinite(LlamaCppMinP(0.5)(None, logits)).tolist() == [
        [True, False, False, True], [True, True, False, True], [False, True, True, False]]
    assert torch.isfinite(LlamaCppMinP(1.5)(None, logits)).tolist() == [
        [True, False, False, False], [True, False, False, False], [False, True, False, False]]


def test_llamacpp_top_1_of_two_tokens_keeps_the_larger():
    """k = 1 of a two-token vocabulary: no tie, so the fast path keeps exactly the arg-max (in each row, whichever
    side it is on). Bug caught: a "tied" mask inverted (!= for ==), which on this row counts exactly k and keeps the
    smaller token."""
    logits = torch.tensor([[1.0, 0.0], [-2.0, 3.0]])
    assert LlamaCppTopK(1)(None, logits).tolist() == [[1.0, float("-inf")], [float("-inf"), 3.0]]


def test_bucket_sum_is_rounded_to_float32_before_truncation():
    """6.4f * z is rounded to float32 and so is the sum with 64.0f: for z just below -3.90625 (one float32 ulp),
    6.4f * z lands one ulp below -25, and 39 - ulp rounds to 39.0f in float32 (bucket 39), while the same sum kept
    in float64 truncates to 38. Bug caught: the second rounding skipped (the sum taken in float64)."""
    z = np.nextafter(np.float32(-3.90625), np.float32(-np.inf))
    assert float(np.float32(6.4) * z) < -25.0
    assert bucket_of(np.array([z, -3.90625], dtype=np.float32)).tolist() == [39, 39]


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the libstdc++ oracle")
def test_the_replay_at_the_heap_limit_and_at_bucket_edges(tmp_path):
    """More arrays for the libstdc++ oracle, at the edges of the bucket pass: k = 128 exactly (still the heap over
    the whole array, with ties past the k-th), k > 128 with no logit in the top bucket (fewer than 128 buckets
    used), and the top buckets holding exactly k (the boundary bucket is kept whole, nothing chosen from the next).
    Bugs caught: the bucket pass from k = 128, a bucket count as long as the highest bucket used, a boundary one
    bucket too low."""
    source, binary = tmp_path / "topk.cpp", tmp_path / "topk"
    source.write_text(PROGRAM)
    subprocess.run(["g++", "-O2", "-o", str(binary), str(source)], check=True, capture_output=True)
    rng = random.Random(1)
    todo = []
    for _ in range(20):
        n = rng.randint(140, 300)
        todo.append(([float(rng.choice([-1.0, 0.0, 0.5, 1.0, 2.0])) for _ in range(n)], 128))
        n = rng.randint(200, 300)
        todo.append(([float(rng.choice([-3.0, 0.0, 0.1, 0.15, 4.0])) for _ in range(n)], rng.randint(129, n)))
    todo.append(([11.0] * 150 + [0.0] * 50, 150))
    todo.append(([11.0] * 100 + [4.0] * 60 + [0.0] * 40, 160))
    text = "".join(f"{len(v)} {k} {' '.join(repr(x) for x in v)}\n" for v, k in todo)
    lines = subprocess.run([str(binary)], input=text, capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(lines) == len(todo)
    for (values, k), line in zip(todo, lines):
        assert sorted(partial_sort_keep(np.array(values, dtype=np.float32), k)) == [int(x) for x in line.split()]
