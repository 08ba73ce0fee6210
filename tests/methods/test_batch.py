"""Paged KV and iteration-level batching against solo decoding and a contiguous cache.

Oracles: each request's own solo decode (core.decode.decode_tokens with the full cache), a fresh prefill with the
full cache, and bookkeeping facts checked by hand (names appear exactly when a block fills, every block is
released). The ``*_catches_*`` tests inject the bugs the checks exist for and require the check to fail.
"""

from __future__ import annotations

import random
import time

import pytest
import torch
from conftest import ROOT, random_model

from decodelab.core.methods.sample import decode_tokens
from decodelab.core.errors import ConfigError
from decodelab.core.kv import CacheSpec, parse_cache_spec
from decodelab.core.kv import paged as paged_mod
from decodelab.core.sampling.chain import build_chain
from decodelab.core.engine.runtime import Runtime
from decodelab.core.methods.batch.scheduler import Request, Scheduler
from decodelab.core.sampling.select import Greedy, Multinomial, make_generator
from decodelab.core.engine.stopping import StopRules

TINY = ROOT / "presets" / "models" / "tiny"
BS = 4  # block size of most tests: small, so prompts span several blocks


def prompts_of(lengths, vocab=256, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def solo(model, prompt, n, settings=None, seed=None, eos=()):
    """The oracle: the request alone, full cache."""
    selector = Greedy() if seed is None else Multinomial(make_generator(seed, "cpu"))
    return [d.token_id for d in decode_tokens(model, prompt, build_chain(settings or {}), selector,
                                              StopRules(n, tuple(eos)))]


def request(i, prompt, n, settings=None, seed=None, eos=()):
    selector = Greedy() if seed is None else Multinomial(make_generator(seed, "cpu"))
    return Request(str(i), prompt, build_chain(settings or {}), selector, StopRules(n, tuple(eos)))


def paged_runtime(model, blocks=64, block=BS):
    return Runtime.create(model, CacheSpec("paged", (("block", block), ("blocks", blocks))))


def full_logits(model, ids):
    """Logits of every position of ``ids`` from one fresh prefill with the full cache."""
    return Runtime.create(model).feed(torch.tensor([ids]), keep="all")[0]


def paged_logits(runtime, key, ids, share=True):
    """Admit ``ids`` as a sequence (sharing its cached prefix) and compute the rest; returns (hit, logits of the
    computed positions)."""
    policy = runtime.policy
    hit = policy.admit(key, ids, share=share)
    out = runtime.feed(policy.plan([(key, ids[hit:])]), keep="all")[0]
    return hit, out


# --- batching equals solo --------------------------------------------------------------------------------------


LENGTHS = [5, 17, 33, 3, 40, 9, 12]
OUTPUTS = [10, 3, 25, 7, 12, 30, 1]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_batched_greedy_equals_solo(arch):
    """Catches: a row reading another row's blocks, wrong per-row positions, a pad token written into a block,
    a chunk boundary that drops or repeats a token, a mask off by one."""
    model = random_model(arch, scale=20.0)
    prompts = prompts_of(LENGTHS)
    expected = [solo(model, p, n) for p, n in zip(prompts, OUTPUTS)]
    sched = Scheduler(model, [request(i, p, n) for i, (p, n) in enumerate(zip(prompts, OUTPUTS))],
                      max_batch=3, max_tokens_per_iteration=16, block_size=BS)
    records = list(sched)
    assert [r.new_ids for r in sched.results] == expected
    assert any(len(r.joined) and r.index > 0 for r in records)  # requests joined mid-run
    checked = 0
    for r, after in zip(records, records[1:]):  # a freed row is taken in the very next iteration (budget allowing)
        if r.finished and r.waiting and after.tokens < 16:
            assert len(after.joined) >= min(len(r.finished), r.waiting)
            checked += 1
    assert checked >= 2
    assert any(r.prefill_tokens and r.decode_tokens for r in records)  # prefill chunks and decodes in one forward
    assert max(r.running for r in records) == 3


def test_batched_sampling_equals_solo_with_own_generators():
    """Each request its own chain and seeded generator: a shared generator, or a chain applied to the wrong row,
    changes some request's tokens."""
    model = random_model("llama", scale=3.0)
    prompts = prompts_of(LENGTHS, seed=1)
    settings = [{"temperature": 1.0}, {"temperature": 0.7, "top-k": 20}, {"repetition-penalty": 1.3},
                {"temperature": 1.5, "top-p": 0.9}, {"temperature": 1.0}, {"min-p": 0.05}, {"temperature": 2.0}]
    seeds = [11, 12, 13, 14, 15, 16, 11]
    expected = [solo(model, p, n, s, seed) for p, n, s, seed in zip(prompts, OUTPUTS, settings, seeds)]
    reqs = [request(i, p, n, s, seed) for i, (p, n, s, seed) in enumerate(zip(prompts, OUTPUTS, settings, seeds))]
    sched = Scheduler(model, reqs, max_batch=4, max_tokens_per_iteration=20, block_size=BS)
    assert [r.new_ids for r in sched.run()] == expected


def test_plain_greedy_rows_selected_together_keep_their_own_numbers():
    """Greedy rows with no stage are selected together (one argmax, one log-softmax over all of them) beside rows
    with their own chains and draws. Catches: a row given another row's token or log-probabilities, the processed
    and raw log-probabilities swapped, a sampled row's processed distribution replaced by the raw one."""
    from decodelab.core.sampling.distribution import log_softmax

    model = random_model("llama", scale=3.0)
    prompts = prompts_of(LENGTHS, seed=4)
    settings = [{}, {"temperature": 0.7, "top-k": 20}, {}, {"temperature": 0.5}, {}, {"min-p": 0.05}, {}]
    seeds = [None, 12, None, 14, None, 16, None]
    expected = []
    for p, n, st, seed in zip(prompts, OUTPUTS, settings, seeds):
        selector = Greedy() if seed is None else Multinomial(make_generator(seed, "cpu"))
        steps = list(decode_tokens(model, p, build_chain(st), selector, StopRules(n)))
        expected.append([(d.token_id, log_softmax(d.processed_logits)[d.token_id].item(),
                          log_softmax(d.raw_logits)[d.token_id].item()) for d in steps])
    reqs = [request(i, p, n, st, seed) for i, (p, n, st, seed) in enumerate(zip(prompts, OUTPUTS, settings, seeds))]
    results = Scheduler(model, reqs, max_batch=5, max_tokens_per_iteration=32, block_size=BS).run()
    for result, want in zip(results, expected):
        assert [s.token_id for s in result.steps] == [t for t, _, _ in want]
        assert [s.logprob for s in result.steps] == pytest.approx([lp for _, lp, _ in want], abs=1e-5)
        assert [s.raw_logprob for s in result.steps] == pytest.approx([r for _, _, r in want], abs=1e-5)
    assert all(s.logprob == s.raw_logprob for s in results[0].steps)  # plain greedy: processed is raw
    assert any(s.logprob != s.raw_logprob for s in results[3].steps)  # temperature 0.5 changes it


def test_bundled_tiny_batched_equals_solo_with_eos():
    if not (TINY / "model.safetensors").is_file():
        pytest.skip("the bundled tiny model's weights are not installed")
    from decodelab.core.engine.models import load_model

    lm = load_model("tiny", device="cpu")
    texts = ["Once upon a time", "The little fox ran to the", "She said", "In the morning, the sun"]
    prompts = [lm.encode(t) for t in texts]
    outs = [12, 20, 6, 16]
    eos = tuple(lm.eos_ids)
    bias = {"bias": {lm.eos_ids[0]: 6.0}}  # an EOS bias: the last request stops early (EOS at 6)
    expected = [solo(lm.model, p, n, bias, eos=eos) for p, n in zip(prompts, outs)]
    sched = Scheduler(lm.model, [request(i, p, n, bias, eos=eos) for i, (p, n) in enumerate(zip(prompts, outs))],
                      max_batch=2, max_tokens_per_iteration=8, block_size=BS)
    results = sched.run()
    assert [r.new_ids for r in results] == expected
    assert any(r.stop_reason == "eos" for r in results)


def test_static_batching_gives_the_same_tokens():
    model = random_model("llama", scale=20.0)
    prompts = prompts_of(LENGTHS)
    expected = [solo(model, p, n) for p, n in zip(prompts, OUTPUTS)]
    sched = Scheduler(model, [request(i, p, n) for i, (p, n) in enumerate(zip(prompts, OUTPUTS))],
                      max_batch=3, block_size=BS, static=True)
    records = list(sched)
    assert [r.new_ids for r in sched.results] == expected
    joins = [r.index for r in records if r.joined]
    # a batch joins only when the previous one has entirely finished: batches of 3, 3, 1 start at 0, 25, 55
    assert [len(r.joined) for r in records if r.joined] == [3, 3, 1]
    assert joins == [0, max(OUTPUTS[:3]), max(OUTPUTS[:3]) + max(OUTPUTS[3:6])]


def test_paged_cache_as_a_one_row_policy_equals_full():
    model = random_model("qwen2", scale=20.0)
    prompt = prompts_of([13])[0]
    expected = solo(model, prompt, 20)
    got = [d.token_id for d in decode_tokens(model, prompt, build_chain({}), Greedy(), StopRules(20),
                                             cache=parse_cache_spec("paged:block=4"))]
    assert got == expected


def test_models_with_sliding_layers_are_refused():
    with pytest.raises(ConfigError) as err:
        paged_runtime(random_model("gemma2"))
    assert str(err.value) == ("--cache paged: this model has sliding-window layers, which paged attention here does "
                              "not window; use --cache full")
    # a composite (multimodal) config names its layers in its text config: Gemma 3's has sliding layers
    from transformers import Gemma3Config

    assert getattr(Gemma3Config(), "layer_types", None) is None
    with pytest.raises(ConfigError, match="sliding"):
        paged_mod.refuse_sliding(Gemma3Config())


# --- exact attention over blocks ----------------------------------------------------------------------------------


def test_non_contiguous_blocks_equal_a_contiguous_cache():
    """The free list scrambled, so consecutive logical blocks land in scattered physical blocks; logits of a
    chunked prefill and of single-token steps equal a fresh full-cache prefill."""
    model = random_model("llama", scale=20.0)
    ids = prompts_of([23])[0]
    runtime = paged_runtime(model, blocks=16)
    policy = runtime.policy
    order = list(policy.pool.free)
    random.Random(5).shuffle(order)
    policy.pool.free = type(policy.pool.free)((b, None) for b in order)
    policy.admit("a", [])
    got = [runtime.feed(policy.plan([("a", ids[:10])]), keep="all")[0]]
    for t in ids[10:]:
        got.append(runtime.feed(policy.plan([("a", [t])]), keep="all")[0])
    table = policy.table("a")
    assert table != sorted(table) and any(b - a != 1 for a, b in zip(table, table[1:]))
    torch.testing.assert_close(torch.cat(got), full_logits(model, ids), rtol=1e-5, atol=1e-5)


def test_layout_by_hand():
    """Block 2; row 0 has 3 tokens stored in physical blocks [5, 2] and 1 new; row 1 has 0 stored, 2 new in block
    7. Row 0's new token (position 3) goes to block 2 offset 1 = slot 5; its padding column writes to scratch and
    sees key 0 only."""
    table = torch.tensor([[5, 2], [7, 0]])
    pos, write, gather, mask = paged_mod.layout([3, 0], [1, 2], table, 2, 99, torch.float32)
    assert pos.tolist() == [[0, 3], [0, 1]]
    assert write.tolist() == [99, 5, 14, 15]
    assert gather.tolist() == [10, 11, 4, 5, 14, 15, 99, 99]
    seen = (mask[:, 0] == 0).int().tolist()
    assert seen == [[[1, 0, 0, 0], [1, 1, 1, 1]], [[1, 0, 0, 0], [1, 1, 0, 0]]]
    assert mask.min().item() == torch.finfo(torch.float32).min


def test_rows_of_different_lengths_in_one_forward_equal_their_own_prefills():
    """Left padding, per-row positions and the 4D mask: two rows with different pasts and chunk lengths."""
    model = random_model("qwen2", scale=20.0)
    a, b = prompts_of([14, 6], seed=3)
    runtime = paged_runtime(model)
    policy = runtime.policy
    policy.admit("a", [])
    policy.admit("b", [])
    runtime.feed(policy.plan([("a", a[:9]), ("b", b[:2])]))
    out = runtime.feed(policy.plan([("a", a[9:]), ("b", b[2:])]), keep="all")  # 5 and 4 new tokens
    torch.testing.assert_close(out[0], full_logits(model, a)[9:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1, 1:], full_logits(model, b)[2:], rtol=1e-5, atol=1e-5)


# --- prefix caching -----------------------------------------------------------------------------------------------


def check_shared_prefix_logits():
    """A second sequence sharing 3 full blocks computes only its own tail, and its logits equal a fresh prefill."""
    model = random_model("llama", scale=20.0)
    base = prompts_of([3 * BS + 2], seed=7)[0]
    other = base[: 3 * BS] + prompts_of([5], seed=8)[0]
    runtime = paged_runtime(model)
    paged_logits(runtime, "a", base)
    hit, logits = paged_logits(runtime, "b", other)
    assert hit == 3 * BS
    torch.testing.assert_close(logits, full_logits(model, other)[hit:], rtol=1e-5, atol=1e-5)
    assert runtime.policy.table("b")[:3] == runtime.policy.table("a")[:3]


def check_same_block_elsewhere_never_hits():
    """Block X at position 1 of a cached sequence is not block X at position 0 of another: its keys were computed
    after other tokens (the parent's name is in the hash)."""
    model = random_model("llama", scale=20.0)
    x, y = prompts_of([BS, BS], seed=9)
    runtime = paged_runtime(model)
    paged_logits(runtime, "a", y + x + [1])
    hit, logits = paged_logits(runtime, "b", x + [2, 3])
    assert hit == 0
    torch.testing.assert_close(logits, full_logits(model, x + [2, 3]), rtol=1e-5, atol=1e-5)


def check_block_named_exactly_when_full():
    """A block gets its name (becomes shareable) when its last slot is written, not a token earlier or later;
    a block-aligned cached prompt still leaves its last token to compute."""
    model = random_model("llama", scale=20.0)
    ids = prompts_of([3 * BS], seed=10)[0]
    runtime = paged_runtime(model)
    policy = runtime.policy
    policy.admit("a", [])
    runtime.feed(policy.plan([("a", ids[: 2 * BS - 1])]))
    assert len(policy.pool.by_name) == 1
    runtime.feed(policy.plan([("a", ids[2 * BS - 1 : 2 * BS])]))
    assert len(policy.pool.by_name) == 2
    runtime.feed(policy.plan([("a", ids[2 * BS :])]))
    assert len(policy.pool.by_name) == 3
    assert policy.match(ids[: 2 * BS + 1]) == 2 * BS
    assert policy.match(ids) == 2 * BS  # all 3 blocks cached, but the last token needs a forward
    hit, logits = paged_logits(runtime, "b", ids)
    assert hit == 2 * BS
    torch.testing.assert_close(logits, full_logits(model, ids)[hit:], rtol=1e-5, atol=1e-5)


def check_every_block_returns():
    """Reference counts: shared blocks count their holders; after a scheduled run every block is free again."""
    model = random_model("llama", scale=20.0)
    runtime = paged_runtime(model)
    policy = runtime.policy
    base = prompts_of([2 * BS + 1], seed=11)[0]
    paged_logits(runtime, "a", base)
    paged_logits(runtime, "b", base[: 2 * BS] + [7, 8])
    shared = policy.table("a")[:2]
    assert [policy.pool.refs[b] for b in shared] == [2, 2]
    policy.free("a")
    assert [policy.pool.refs[b] for b in shared] == [1, 1]
    policy.free("b")
    assert policy.blocks_used == 0 and set(policy.pool.refs) == {0}
    prompts = [base + p for p in prompts_of([3, 9, 1, 6], seed=12)]
    sched = Scheduler(model, [request(i, p, 6) for i, p in enumerate(prompts)], max_batch=2, block_size=BS,
                      num_blocks=12)
    sched.run()
    assert sched.policy.blocks_used == 0 and set(sched.policy.pool.refs) == {0}


CHECKS = [check_shared_prefix_logits, check_same_block_elsewhere_never_hits, check_block_named_exactly_when_full,
          check_every_block_returns]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_prefix_cache(check):
    check()


def _hash_without_parent(parent, token_ids, salt):
    return paged_mod.__dict__["_original_block_hash"](None, token_ids, salt)


MUTANTS = {
    "hash-without-parent": ("block_hash", _hash_without_parent, check_same_block_elsewhere_never_hits),
    "named-a-token-early": ("full_blocks", lambda tokens, block: (tokens + 1) // block,
                            check_block_named_exactly_when_full),
    "named-a-token-late": ("full_blocks", lambda tokens, block: max(tokens - 1, 0) // block,
                           check_block_named_exactly_when_full),
    "refcount-not-decremented": ("release", None, check_every_block_returns),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_prefix_cache_checks_catch_injected_bugs(mutant, monkeypatch):
    name, replacement, check = MUTANTS[mutant]
    if name == "release":
        monkeypatch.setattr(paged_mod.BlockPool, "release", lambda self, block: None)
    else:
        monkeypatch.setattr(paged_mod, "_original_block_hash", paged_mod.block_hash, raising=False)
        monkeypatch.setattr(paged_mod, name, replacement)
    with pytest.raises(AssertionError):
        check()


def test_text_that_tokenizes_differently_never_hits():
    """The same text as other token ids (one id per character instead of the tokenizer's merges) shares nothing,
    while the tokenizer's own ids for it do."""
    if not (TINY / "tokenizer.json").is_file():
        pytest.skip("the bundled tokenizer is missing")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY)
    text = "Once upon a time there was a little fox who lived in the forest"
    merged = tok.encode(text, add_special_tokens=False)
    chars = [i for c in text for i in tok.encode(c, add_special_tokens=False)]
    assert tok.decode(merged) == tok.decode(chars) == text and merged != chars
    model = random_model("llama", vocab_size=len(tok), scale=5.0)
    runtime = paged_runtime(model, blocks=64)
    paged_logits(runtime, "merged", merged + [5])
    assert paged_logits(runtime, "chars", chars + [5])[0] == 0
    assert paged_logits(runtime, "again", merged + [6])[0] == len(merged) // BS * BS


def test_shared_prefix_requests_hit_and_wait_for_an_in_flight_prefix():
    """Requests sharing a long prefix: the first computes it, the others share its blocks (one waits an iteration
    rather than computing the same blocks) and still equal their solo decodes."""
    model = random_model("llama", scale=20.0)
    prefix = prompts_of([6 * BS], seed=13)[0]
    prompts = [prefix + tail for tail in prompts_of([3, 2, 5, 1], seed=14)]
    expected = [solo(model, p, 8) for p in prompts]
    sched = Scheduler(model, [request(i, p, 8) for i, p in enumerate(prompts)], max_batch=4, block_size=BS)
    results = sched.run()
    assert [r.new_ids for r in results] == expected
    assert [r.prefix_hit_tokens for r in results] == [0] + [6 * BS] * 3
    assert sum(r.computed_tokens for r in results) == sum(len(p) + 8 - 1 for p in prompts) - 3 * 6 * BS



def test_a_block_half_computed_by_a_running_prefill_is_waited_for():
    """The in-flight blocks of a running prefill start at the block it is computing (``computed // block``), not the
    one after (issue 40: counted one block later, and no test failed). Hand count, blocks of 4, 10 tokens an
    iteration, two requests of the same 6-block prefix (24 tokens) and a tail: the first computes 10, then 10, and
    in the third iteration its last 7 (tokens 20-26), which leaves 3 of the budget for the second to join. By then
    blocks 0-4 are named and block 5 is being computed: the second must wait for it (one iteration) and then hit all
    6 blocks (24 tokens); not counting block 5 as in flight, it would join with a 5-block hit (20 tokens) and compute
    block 5 a second time."""
    model = random_model("llama", scale=20.0)
    prefix = prompts_of([6 * BS], seed=13)[0]
    prompts = [prefix + tail for tail in prompts_of([3, 2], seed=15)]
    expected = [solo(model, p, 4) for p in prompts]
    sched = Scheduler(model, [request(i, p, 4) for i, p in enumerate(prompts)], max_batch=2, block_size=BS,
                      max_tokens_per_iteration=2 * BS + 2)
    results = sched.run()
    assert [r.new_ids for r in results] == expected
    assert [r.prefix_hit_tokens for r in results] == [0, 6 * BS]
    assert sum(r.computed_tokens for r in results) == sum(len(p) + 4 - 1 for p in prompts) - 6 * BS

# --- exact edges the mutation run of core/kv/paged.py (2026-12-01) showed no test pinned --------------------------


def test_a_freed_sequence_gives_back_its_tail_first():
    """free() releases a sequence's blocks last first, so the next allocation overwrites its tail and its leading
    blocks stay findable longest. A pool of 3 blocks of 4: a 12-token sequence fills (and names) all 3 and is
    freed; a new sequence taking one block gets the third (the tail), and the first two are still a prefix hit of
    8 tokens. Released front first, the allocation would take the first block and lose the whole chain."""
    model = random_model("llama", scale=20.0)
    ids = prompts_of([3 * BS], seed=21)[0]
    runtime = paged_runtime(model, blocks=3)
    policy = runtime.policy
    paged_logits(runtime, "a", ids)
    table = policy.table("a")
    assert len(policy.pool.by_name) == 3 and policy.blocks_free == 0
    policy.free("a")
    assert policy.blocks_used == 0 and list(policy.pool.free) == table[::-1]
    policy.admit("c", [])
    policy.plan([("c", [1])])  # reserves one block
    assert policy.table("c") == [table[2]] and policy.blocks_used == 1
    assert policy.match(ids[: 2 * BS] + [5]) == 2 * BS


def test_blocks_filled_after_a_prefix_hit_are_named_on_the_right_chain():
    """A sequence that starts from a 1-block hit records the hit's token ids and names and goes on naming the
    blocks it fills chained on them: b shares a's first block, computes 3 more, and c (the same 4 blocks and
    another last token) then hits all 4 (16 tokens) and its logits equal a fresh prefill. Catches the hit's ids
    left out of the sequence (block 2 named from the wrong ids: hit 4) or its named count left at 0 (block 0
    named again, so block 3 chained on block 0's name: hit 8). ``admit`` shares unless told not to."""
    model = random_model("llama", scale=20.0)
    ids = prompts_of([4 * BS], seed=22)[0]
    runtime = paged_runtime(model)
    paged_logits(runtime, "a", ids[:BS] + [1])
    assert paged_logits(runtime, "b", ids + [2])[0] == BS
    assert len(runtime.policy.pool.by_name) == 4
    policy = runtime.policy
    hit = policy.admit("c", ids + [3])
    assert hit == 4 * BS and policy.table("c") == policy.table("b")[:4]
    logits = runtime.feed(policy.plan([("c", [3])]), keep="all")[0]
    torch.testing.assert_close(logits, full_logits(model, ids + [3])[hit:], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="^sequence 'c' is already in the pool$"):
        policy.admit("c", [1])


def test_plan_left_pads_the_new_ids_with_zeros():
    """The ids a plan returns, by hand: rows of 3 and 1 new ids left-padded with 0 to 3; a row given as a count
    (self-planned: ids unknown) is zeros; positions of the padding are 0. A counted row names no block, and the
    rows after it in the same forward still do."""
    runtime = paged_runtime(random_model("llama"))
    policy = runtime.policy
    for key in "abc":
        policy.admit(key, [])
    ids = policy.plan([("a", [5, 6, 7]), ("b", [9]), ("c", 2)])
    assert ids.dtype == torch.long and ids.tolist() == [[5, 6, 7], [0, 0, 9], [0, 0, 0]]
    assert policy.positions(3).tolist() == [[0, 1, 2], [0, 0, 0], [0, 0, 1]]
    policy.plan_ = None  # that plan is not run
    # a counted row before a row of known ids in one forward: the known row still fills and names its block
    policy.admit("d", [])
    runtime.feed(policy.plan([("c", 1), ("d", [5, 6, 7, 8])]))
    assert len(policy.pool.by_name) == 1 and policy.match([5, 6, 7, 8, 1]) == BS


def test_a_bfloat16_pool_holds_the_model_dtype():
    """A bfloat16 model's pool is bfloat16 (5 blocks of 4: 2 x 21 x 2 x 16 x 2 = 2688 bytes a layer, half the
    float32 figure) and its logits over two rows of different lengths equal the full cache's prefills (the mask in
    the model's dtype: a float32 pool or mask would meet bfloat16 queries)."""
    model = random_model("llama", scale=20.0).to(torch.bfloat16)
    runtime = paged_runtime(model, blocks=5)
    policy = runtime.policy
    assert policy.layer_nbytes() == [2688, 2688] and policy.k[0].dtype == policy.v[1].dtype == torch.bfloat16
    a, b = prompts_of([7, 3], seed=23)
    policy.admit("a", [])
    policy.admit("b", [])
    out = runtime.feed(policy.plan([("a", a), ("b", b)]), keep="all")
    assert out.dtype == torch.float32
    for row, ids in ((0, a), (1, b)):
        want = full_logits(model, ids)
        torch.testing.assert_close(out[row, 7 - len(ids):], want, rtol=0.02, atol=0.02)


def test_paged_bytes_and_description_by_hand():
    """The random Llama (2 layers, 2 KV heads, head_dim 16, float32) in 5 blocks of 4: each layer's keys and
    values are pools of 5 x 4 + 1 slots (the last is scratch) of 2 x 16 floats, 2 x 21 x 2 x 16 x 4 = 5376 bytes
    a layer, whatever is stored. Sequence a (6 tokens, 2 blocks) and b (1 token, 1 block) in one forward; then a
    is freed: ``stored`` follows the sequences held (1), ``seen`` the last forward (6)."""
    model = random_model("llama")
    runtime = paged_runtime(model, blocks=5)
    policy = runtime.policy
    assert policy.layer_nbytes() == [5376, 5376] and policy.nbytes() == 2 * 5376
    policy.admit("a", [])
    policy.admit("b", [])
    runtime.feed(policy.plan([("a", list(range(3, 9))), ("b", [3])]))
    assert policy.describe() == {"policy": "paged", "seen": 6, "stored": 6, "blocks_used": 3, "blocks_free": 2}
    policy.free("a")
    assert policy.describe() == {"policy": "paged", "seen": 6, "stored": 1, "blocks_used": 1, "blocks_free": 4}
    assert policy.layer_nbytes() == [5376, 5376]


def test_paged_sizes_and_refusals_by_hand():
    """The default block is 16; with a known length (capacity) and no blocks=, ceil(9 / 4) = 3 blocks of 4;
    without either, one exact line. No rollback, no reorder (rows are the scheduler's sequences)."""
    model = random_model("llama")
    assert Runtime.create(model, parse_cache_spec("paged:blocks=2")).policy.block == 16
    policy = Runtime.create(model, parse_cache_spec("paged:block=4"), capacity=9).policy
    assert policy.num_blocks == 3
    with pytest.raises(ConfigError) as err:
        Runtime.create(model, parse_cache_spec("paged:block=4"))
    assert str(err.value) == "--cache paged: give blocks=N (this command does not know its length up front)"
    with pytest.raises(NotImplementedError, match="^paged: no rollback$"):
        policy.truncate(0)
    with pytest.raises(NotImplementedError, match="^paged: rows are sequences of the scheduler$"):
        policy.reorder(torch.tensor([0]))


# --- preemption ---------------------------------------------------------------------------------------------------


def test_preemption_and_recompute_give_the_same_tokens():
    """A pool too small for every running sequence: the last to join is preempted, recomputes its prompt and
    output later, and every request's tokens equal its solo decode (greedy and sampled)."""
    model = random_model("llama", scale=4.0)
    prompts = prompts_of([9, 14, 6, 11, 7], seed=15)
    outs = [20, 18, 22, 15, 19]
    seeds = [None, 3, None, 4, 5]
    temp = lambda seed: None if seed is None else {"temperature": 1.0}  # noqa: E731
    expected = [solo(model, p, n, temp(s), s) for p, n, s in zip(prompts, outs, seeds)]
    reqs = [request(i, p, n, temp(s), s) for i, (p, n, s) in enumerate(zip(prompts, outs, seeds))]
    sched = Scheduler(model, reqs, max_batch=4, max_tokens_per_iteration=32, block_size=BS, num_blocks=20)
    records = list(sched)
    assert sum(len(r.preempted) for r in records) > 0
    assert sum(r.preemptions for r in sched.results) == sum(len(r.preempted) for r in records)
    assert [r.new_ids for r in sched.results] == expected
    assert max(r.blocks_used for r in records) <= 20
    assert sched.policy.blocks_used == 0


def test_the_last_to_join_is_the_one_preempted_by_hand():
    """Tokens never show which request was preempted (recompute is exact), so the victim is pinned by hand. Two
    6-token prompts, 8 new tokens each, blocks of 4, a pool of 4 blocks. Iteration 0 prefills both (2 blocks
    each, 12 tokens); 1 and 2 decode token 7 and 8 of each within those blocks. In iteration 3 request 0 needs a
    third block for its 9th token: the pool is full, and request 1, which joined last, is preempted (if request 0
    went, request 1 would finish first). Request 0 runs alone and finishes in iteration 7 (14 tokens, 4 blocks);
    request 1 rejoins in 8, recomputes its prompt and the 3 tokens it had (9 tokens) and finishes in 12."""
    model = random_model("llama", scale=4.0)
    prompts = prompts_of([6, 6], seed=3)
    sched = Scheduler(model, [request(i, p, 8) for i, p in enumerate(prompts)], max_batch=2,
                      max_tokens_per_iteration=64, block_size=BS, num_blocks=4)
    records = list(sched)
    assert {r.index: r.preempted for r in records if r.preempted} == {3: ["1"]}
    assert [(r.index, r.joined) for r in records if r.joined] == [(0, ["0", "1"]), (8, ["1"])]
    assert [(r.index, r.finished) for r in records if r.finished] == [(7, ["0"]), (12, ["1"])]
    assert [r.prefill_tokens for r in records if r.prefill_tokens] == [12, 9]
    assert [(r.preemptions, r.finished, r.computed_tokens) for r in sched.results] == [(0, 7, 13), (1, 12, 21)]
    assert [r.new_ids for r in sched.results] == [solo(model, p, 8) for p in prompts]


def test_bad_settings_are_refused_in_whole_lines():
    """Each refusal names the option and what is allowed; the smallest allowed values run."""
    model = random_model("llama")
    reqs = [request(0, [1, 2, 3], 5)]
    for kwargs, message in [
        (dict(max_batch=0), "--max-batch 0: must be an integer >= 1"),
        (dict(max_tokens_per_iteration=0), "--max-tokens-per-iteration 0: must be an integer >= 1"),
        (dict(block_size=4, num_blocks=1), "--blocks 1: the longest request needs 2 blocks of 4 tokens; give more"),
    ]:
        with pytest.raises(ConfigError) as err:
            Scheduler(model, reqs, **kwargs)
        assert str(err.value) == message
    with pytest.raises(ConfigError) as err:
        Scheduler(model, reqs + [request(0, [4, 5], 2)])
    assert str(err.value) == "--prompts-file: request ids must be unique"
    one = Scheduler(model, reqs, max_batch=1, max_tokens_per_iteration=1, block_size=4, num_blocks=2)
    assert [r.new_ids for r in one.run()] == [solo(model, [1, 2, 3], 5)]
    assert all(r.tokens == 1 for r in one.iterations)  # one token a forward: the prompt in three chunks
    static = Scheduler(model, reqs + [request(1, [6], 2)], static=True, block_size=4)
    assert static.budget == float("inf") and static.prefix_caching is False
    assert [r.new_ids for r in static.run()] == [solo(model, [1, 2, 3], 5), solo(model, [6], 2)]


def test_a_request_whose_chain_empties_ends_alone():
    """Request 1 bans every token after its first: it ends with empty_chain at its second draw; request 0 runs
    its whole length, its tokens its solo decode's."""
    model = random_model("llama", scale=4.0)
    prompts = prompts_of([5, 4], seed=2)
    first = solo(model, prompts[1], 1)[0]
    ban_all = build_chain({"allow": (first,), "no-repeat-ngram": 1})
    reqs = [request(0, prompts[0], 6),
            Request("1", prompts[1], ban_all, Greedy(), StopRules(6, ()))]
    sched = Scheduler(model, reqs, max_batch=2, block_size=BS)
    results = sched.run()
    assert results[0].new_ids == solo(model, prompts[0], 6) and results[0].stop_reason == "length"
    assert results[1].new_ids == [first] and results[1].stop_reason == "empty_chain"
    assert results[1].finished == 1 and [r.finished for r in sched.iterations if r.finished] == [["1"], ["0"]]


def test_bad_settings_are_refused():
    model = random_model("llama")
    reqs = [request(0, [1, 2, 3], 40)]
    with pytest.raises(ConfigError, match="--blocks"):
        Scheduler(model, reqs, block_size=4, num_blocks=3)
    with pytest.raises(ConfigError, match="--max-batch"):
        Scheduler(model, reqs, max_batch=0)
    with pytest.raises(ConfigError, match="block"):
        parse_cache_spec("paged:block=0")


# --- the command line ---------------------------------------------------------------------------------------------


def run_json(cli, *args):
    import json

    code, out, err = cli(*args, "-f", "json")
    assert code == 0, err
    return json.loads(out)


def test_cli_batch_equals_each_request_sampled_alone(cli, toy_model_dir, tmp_path):
    """JSONL with per-request settings: each request's tokens equal `decodelab sample` with those settings; the
    static baseline gives the same tokens; every field CLI.md names is there."""
    import json

    lines = [{"id": "g", "prompt": "Once upon a time", "temperature": 0, "max_new_tokens": 9},
             {"id": "s", "prompt": "Once upon a time there was", "seed": 4, "top_k": 20, "max_new_tokens": 12},
             {"id": "t", "prompt": "The machine", "temperature": 0.7, "seed": 9, "max_new_tokens": 5}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    doc = run_json(cli, "batch", "--prompts-file", path, "-m", toy_model_dir, "--ignore-eos", "--max-batch", "2",
                   "--block-size", "4", "--max-tokens-per-iteration", "8")
    for key in ("command", "model", "config", "requests", "iterations", "summary"):
        assert key in doc
    assert [r["id"] for r in doc["requests"]] == ["g", "s", "t"]
    for line, req in zip(lines, doc["requests"]):
        args = ["sample", line["prompt"], "-m", toy_model_dir, "--ignore-eos", "-n", str(line["max_new_tokens"])]
        for key in ("temperature", "seed", "top_k"):
            if key in line:
                args += [f"--{key.replace('_', '-')}", str(line[key])]
        alone = run_json(cli, *args)
        assert req["token_ids"] == alone["token_ids"], req["id"]
        assert req["text"] == alone["text"]
        assert [s["token_id"] for s in req["steps"]] == req["token_ids"]
        for key in ("id", "prompt", "token_ids", "text", "prefix_hit_tokens"):
            assert key in req
    assert doc["requests"][1]["prefix_hit_tokens"] == 4  # "Once upon a time" fills one block of 4 ids
    for it in doc["iterations"]:
        for key in ("index", "running", "joined", "finished", "waiting", "blocks_used"):
            assert key in it
    s = doc["summary"]
    for key in ("tokens_per_s", "static_tokens_per_s", "speedup_vs_static", "prefix_hit_rate", "peak_blocks",
                "slot_utilisation"):
        assert key in s
    assert s["static_same_tokens"] == 3 and s["tokens"] == 26
    assert max(it["running"] for it in doc["iterations"]) == 2


@pytest.mark.parametrize("fmt", ["table", "jsonl", "markdown", "csv"])
def test_cli_batch_every_format(cli, toy_model_dir, tmp_path, fmt):
    import json

    path = tmp_path / "prompts.txt"
    path.write_text("Once upon a time\n\nThe machine\n")
    code, out, err = cli("batch", "--prompts-file", path, "-m", toy_model_dir, "-n", "3", "--ignore-eos",
                         "--baselines", "none", "-f", fmt)
    assert code == 0, err
    if fmt == "jsonl":
        rows = [json.loads(line) for line in out.splitlines()]
        assert [r["type"] for r in rows][-3:] == ["request", "request", "summary"]
        assert {r["type"] for r in rows[:-3]} == {"iteration"}
        assert "static_tokens_per_s" not in rows[-1]
    elif fmt == "csv":
        assert out.splitlines()[0].startswith("id,prompt,")
        assert len(out.splitlines()) == 3
    elif fmt == "markdown":
        assert "Once upon a time" in out and out.splitlines()[0].split()[:4] == ["|", "id", "|", "prompt"]
    else:
        assert "paged pool of 2 blocks x 16 tokens" in out and "slot_utilisation" in out


@pytest.mark.parametrize("content, args, needle", [
    (None, (), "--prompts-file"),
    ("", (), "no prompts"),
    ('{"prompt": "a"}\n{"prompt": "b", "top_p": 2}\n', (), "line 2: --top-p"),
    ('{"prompt": "a", "colour": 1}\n', (), "line 1: unknown setting 'colour'"),
    ('{"text": "a"}\n', (), "prompt"),
    ('{"prompt": "a", "cache": "full"}\n', (), "line 1: 'cache' is not a per-request setting"),
    ("a\n", ("--max-batch", "0"), "--max-batch 0"),
    ("a\n", ("--block-size", "0"), "--block-size 0"),
    ("a\n", ("--block-size", "4097"), "--block-size 4097: must be an integer in [1, 4096]"),
    ("a\n", ("--block-size", str(2**63)), "--block-size 9223372036854775808: must be an integer in [1, 4096]"),
    ("a\n", ("--blocks", str(2**21)), "--blocks 2097152: must be an integer in [1, 1048576]"),
    ("a\n", ("--max-batch", "4097"), "--max-batch 4097: must be an integer in [1, 4096]"),
    ("a\n", ("--baselines", "vllm"), "--baselines 'vllm'"),
])
def test_cli_batch_bad_input_is_one_line(cli, tmp_path, content, args, needle):
    path = tmp_path / "prompts.txt"
    if content is not None:
        path.write_text(content)
    code, out, err = cli("batch", "--prompts-file", path, "-m", "/nonexistent-model-folder", *args)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_cli_batch_json_fields_are_the_json_docs(cli, toy_model_dir, tmp_path):
    """docs/json.md's table for batch against real output, both ways (as tests/test_json_docs.py does)."""
    import json

    from test_json_docs import documented, fields

    table = documented()["batch"]
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Once upon a time", "id": "x", "temperature": 0}\n{"prompt": "Once upon a time it"}\n')
    printed = set()
    for args in (["--baselines", "static,transformers"], ["--baselines", "none"],
                 ["--batch-invariant", "--baselines", "batched"]):
        code, out, err = cli("batch", "--prompts-file", path, "-m", toy_model_dir, "-n", "3", "--block-size", "4",
                             *args, "-f", "json")
        assert code == 0, err
        # objects documented with `*` (config, versions) vary by key: not descended into, as in test_json_docs
        printed |= fields(json.loads(out), wild=frozenset(p for p, f in table if f == "*"))
    listed = {(p, f) for p, f in table if f != "*"}
    undocumented = {(p, f) for p, f in printed if p != "config"} - listed
    assert not undocumented, f"batch prints fields docs/json.md does not list: {sorted(undocumented)}"
    missing = {(p, f) for (p, f), required in table.items() if required and f != "*"} - printed
    assert not missing, f"docs/json.md lists batch fields it does not print: {sorted(missing)}"


# --- the schedule against a model of its documented rules ------------------------------------------------------------


class RuleModel:
    """The scheduler's documented rules without a model or a pool (module docstring of core/methods/batch/
    scheduler.py; prefix caching off): each iteration schedules the running sequences, decodes first and then
    prefill chunks in join order, within the token budget, taking blocks of ``block`` tokens from a pool of
    ``blocks`` (a sequence keeps the blocks it got when the pool runs dry); while a sequence cannot get its blocks,
    the last to join is preempted (blocks freed, computed tokens forgotten, back to the front of the queue, its
    budget this iteration returned). With no preemption, waiting sequences join in queue order while there is a
    row, budget and blocks for their first chunk. A sequence whose tokens are all computed draws one token; one
    that has drawn its N tokens finishes and frees its blocks."""

    def __init__(self, prompts: list[int], outs: list[int], max_batch: int, budget: int, block: int, blocks: int):
        self.seqs = [{"id": str(i), "P": p, "N": n, "tokens": p, "computed": 0, "blocks": 0, "join": 0, "pre": 0,
                      "fed": 0, "joined": -1, "finished": -1} for i, (p, n) in enumerate(zip(prompts, outs))]
        self.max_batch, self.budget, self.block, self.free = max_batch, budget, block, blocks
        self.waiting, self.running, self.joins = list(self.seqs), [], 0
        self.returned = 0

    def take(self, s, n) -> bool:
        """Blocks for n more tokens; as many as there are when short (False)."""
        need = -(-(s["computed"] + n) // self.block) - s["blocks"]
        got = min(need, self.free)
        s["blocks"] += got
        self.free -= got
        return got == need

    def release(self, s):
        self.free += s["blocks"]
        s["blocks"] = 0

    def iterate(self, index: int) -> dict:
        schedule, budget, preempted, joined = [], self.budget, [], []
        for s in sorted(self.running, key=lambda s: (s["tokens"] - s["computed"] > 1, s["join"])):
            n = min(s["tokens"] - s["computed"], budget)
            if n <= 0 or s not in self.running:
                continue
            while s in self.running and not self.take(s, n):
                victim = max(self.running, key=lambda v: v["join"])
                self.release(victim)
                self.running.remove(victim)
                victim["computed"], victim["pre"] = 0, victim["pre"] + 1
                self.waiting.insert(0, victim)
                back = sum(m for v, m in schedule if v is victim)
                budget += back
                self.returned += back  # tokens a preempted, already scheduled victim gave back
                schedule = [(v, m) for v, m in schedule if v is not victim]
                preempted.append(victim["id"])
            if s in self.running:
                schedule.append((s, n))
                budget -= n
        if not preempted:
            for s in list(self.waiting):
                if len(self.running) >= self.max_batch or budget <= 0:
                    break
                n = min(s["tokens"], budget)
                if not self.take(s, n):
                    self.release(s)
                    break
                s["computed"] = 0
                if s["joined"] < 0:
                    s["joined"] = index
                self.joins += 1
                s["join"] = self.joins
                self.waiting.remove(s)
                self.running.append(s)
                schedule.append((s, n))
                joined.append(s["id"])
                budget -= n
        used = sum(s["blocks"] for s in self.seqs)
        decodes = sum(1 for s, n in schedule if s["tokens"] - s["computed"] == 1 and s["tokens"] > s["P"])
        finished = []
        for s, n in schedule:
            s["computed"] += n
            s["fed"] += n
        for s, n in schedule:
            if s["computed"] == s["tokens"]:
                s["tokens"] += 1
                if s["tokens"] - s["P"] == s["N"]:
                    s["finished"] = index
                    finished.append(s)
        for s in finished:
            self.running.remove(s)
            self.release(s)
        fed = sum(n for _, n in schedule)
        return {"index": index, "running": len(self.running) + len(finished), "rows": len(schedule),
                "joined": joined, "finished": [s["id"] for s in finished], "waiting": len(self.waiting),
                "blocks_used": used, "preempted": preempted, "tokens": fed, "prefill_tokens": fed - decodes,
                "decode_tokens": decodes}

    def run(self) -> list[dict]:
        out, index = [], 0
        while self.waiting or self.running:
            out.append(self.iterate(index))
            index += 1
        return out


FIELDS = ("index", "running", "rows", "joined", "finished", "waiting", "blocks_used", "preempted", "tokens",
          "prefill_tokens", "decode_tokens")


@pytest.mark.parametrize("prompts,outs,max_batch,budget,blocks", [
    ([5, 9, 3, 7], [6, 4, 8, 5], 3, 6, 7),  # chunked prefills, a preempted sequence that was already scheduled
    ([6, 6], [8, 8], 2, 64, 4),  # the hand-worked case above
    ([2, 11, 4, 8, 3], [9, 3, 6, 2, 7], 4, 5, 9),
    ([10, 1, 6], [3, 12, 5], 2, 3, 5),  # a budget smaller than a prompt
    # (mutation run, mutbeam) request 0 is preempted twice, and a sequence after the one short of blocks is still
    # scheduled in the iteration of a preemption (so the budget left must be kept, not reset)
    ([2, 4, 3], [8, 2, 2], 3, 3, 3),
])
def test_iterations_follow_the_documented_rules(prompts, outs, max_batch, budget, blocks):
    """Every iteration record and every request's preemptions, join and finish iteration and computed tokens equal
    the rule model's (the tokens themselves are each request's solo decode, checked elsewhere)."""
    model = random_model("llama", scale=4.0)
    ids = prompts_of(prompts, seed=21)
    sched = Scheduler(model, [request(i, p, n) for i, (p, n) in enumerate(zip(ids, outs))], max_batch=max_batch,
                      max_tokens_per_iteration=budget, block_size=BS, num_blocks=blocks, prefix_caching=False)
    got = [{f: getattr(r, f) for f in FIELDS} for r in sched]
    rules = RuleModel(prompts, outs, max_batch, budget, BS, blocks)
    assert got == rules.run()
    assert [(r.preemptions, r.joined, r.finished, r.computed_tokens) for r in sched.results] == [
        (s["pre"], s["joined"], s["finished"], s["fed"]) for s in rules.seqs]
    if budget == 6:
        assert any(r["preempted"] for r in got) and any(0 < r["prefill_tokens"] < r["tokens"] for r in got)
    # the victim is never already scheduled: decodes go first in join order, the last to join comes after the
    # sequence short of blocks, and a prefill chunk takes all of a sequence's pending tokens the budget allows, so
    # a later joiner is scheduled only after an earlier one's prefill completes (20,000 random cases agree)
    assert rules.returned == 0
    assert all(r.blocks_free == blocks - r.blocks_used and r.prefix_hit_tokens == 0 and r.seconds > 0
               for r in sched.iterations)
    assert sched.peak_blocks == max(r.blocks_used for r in sched.iterations)
    assert sched.seconds == pytest.approx(sum(r.seconds for r in sched.iterations))


def test_a_batch_run_ended_for_a_cause_keeps_its_requests_and_names_the_cause():
    """BatchRun keeps the Run contract: ``end(reason)`` after some iterations reports every request, the unfinished
    ones with that reason (not "interrupted"), and the run's own stop_reason."""
    from decodelab.core.engine.models import load_model
    from decodelab.core.methods.batch.run import BatchRun, BatchSettings, Entry

    lm = load_model("tiny", device="cpu")
    settings = BatchSettings(max_new_tokens=6, temperature=0.0, ignore_eos=True, max_batch=2, baselines=())
    run = BatchRun(lm, settings, [Entry("a", "Once upon a time", settings), Entry("b", "The compiler", settings)])
    for i, _ in enumerate(run):
        if i == 1:
            break
    run.end("empty_chain")
    report = run.report()
    assert report.stop_reason == "empty_chain"
    assert len(report.results) == 2 and {r.stop_reason for r in report.results} == {"empty_chain"}
    assert all(0 < len(r.new_ids) < 6 for r in report.results)


# --- mutation run of core/methods/batch/scheduler.py (2026-12-01, helper mutbeam): what its survivors asked for -------


def test_interrupt_reports_the_finished_the_running_and_the_waiting_in_request_order():
    """One row (max_batch 1): request 0 (2 new tokens) finishes at iteration 1 while 1 and 2 still wait; then 1 joins
    and draws a token, and the run is interrupted: 0 keeps "length" and its 2 tokens, 1 ends with the cause and its
    token so far, 2 (never joined) with the cause and none. Interrupted before the first iteration: no results."""
    model = random_model("llama", scale=4.0)
    prompts = prompts_of([3, 3, 3], seed=5)
    reqs = [request(i, p, n) for i, (p, n) in enumerate(zip(prompts, [2, 6, 4]))]
    fresh = Scheduler(model, reqs, max_batch=1, block_size=BS)
    fresh.interrupt()
    assert fresh.results == []
    sched = Scheduler(model, reqs, max_batch=1, block_size=BS)
    for record in sched:
        if record.index == 2:
            break
    sched.interrupt()
    got = [(r.id, r.stop_reason, r.new_ids, r.joined) for r in sched.results]
    assert got == [("0", "length", solo(model, prompts[0], 2), 0), ("1", "interrupted", solo(model, prompts[1], 1), 2),
                   ("2", "interrupted", [], -1)]
    sched = Scheduler(model, reqs, max_batch=1, block_size=BS)
    next(iter(sched))
    sched.interrupt("budget")
    assert [(r.id, r.stop_reason) for r in sched.results] == [("0", "budget"), ("1", "budget"), ("2", "budget")]


def test_iteration_seconds_are_time_spent_inside_the_run():
    model = random_model("llama", scale=4.0)
    sched = Scheduler(model, [request(i, p, 3) for i, p in enumerate(prompts_of([4, 5], seed=6))], block_size=BS)
    start = time.perf_counter()
    records = list(sched)
    elapsed = time.perf_counter() - start
    assert all(0 < r.seconds for r in records) and sum(r.seconds for r in records) <= elapsed


def test_prefix_hits_of_two_requests_joining_in_one_iteration_add_up():
    """Requests 1 and 2 share request 0's first two blocks (8 tokens) and differ after them: both wait while 0
    computes the blocks (iteration 0), then join together in iteration 1, finding 8 cached tokens each: 16.
    Request 3 shares nothing: the ones waiting before it do not hold it back, it joins in iteration 0."""
    model = random_model("llama", scale=20.0)
    prefix, other = prompts_of([2 * BS, 5], seed=7)
    prompts = [prefix + [1, 2, 3], prefix + [4, 5], prefix + [6, 7], other]
    sched = Scheduler(model, [request(i, p, 4) for i, p in enumerate(prompts)], max_batch=4, block_size=BS)
    records = list(sched)
    assert [(r.index, r.joined, r.prefix_hit_tokens) for r in records if r.joined] == [(0, ["0", "3"], 0),
                                                                                     (1, ["1", "2"], 16)]
    assert [r.prefix_hit_tokens for r in sched.results] == [0, 8, 8, 0]
    assert [r.new_ids for r in sched.results] == [solo(model, p, 4) for p in prompts]


def test_static_batching_refuses_a_pool_its_batch_outgrows():
    """Static batching never preempts: two 4-token prompts take a block of 4 each from a pool of 2, and the first
    decode needs a second block for request 0."""
    model = random_model("llama", scale=4.0)
    sched = Scheduler(model, [request(i, p, 4) for i, p in enumerate(prompts_of([4, 4], seed=8))], max_batch=2,
                      block_size=BS, num_blocks=2, static=True)
    with pytest.raises(ConfigError) as err:
        list(sched)
    assert str(err.value) == "--blocks: the pool is too small for this batch"


def test_a_chain_that_empties_in_the_first_row_leaves_the_rows_after_it_their_tokens():
    """As test_a_request_whose_chain_empties_ends_alone, with the emptying request in row 0: request 1, in the row
    after it, still gets the token of that iteration, and all its tokens are its solo decode's."""
    model = random_model("llama", scale=4.0)
    prompts = prompts_of([4, 5], seed=2)
    first = solo(model, prompts[0], 1)[0]
    ban_all = build_chain({"allow": (first,), "no-repeat-ngram": 1})
    reqs = [Request("0", prompts[0], ban_all, Greedy(), StopRules(6, ())), request(1, prompts[1], 6)]
    results = Scheduler(model, reqs, max_batch=2, block_size=BS).run()
    assert (results[0].new_ids, results[0].stop_reason) == ([first], "empty_chain")
    assert (results[1].new_ids, results[1].stop_reason) == (solo(model, prompts[1], 6), "length")


def test_a_stop_string_ends_a_batched_request_where_it_ends_the_solo_decode():
    """The request's own detokenizer reads its stop string: with each token written <id>, the string <t> of the
    first token t of the solo decode that did not occur before ends the request right after t."""
    model = random_model("llama", scale=4.0)
    prompt = prompts_of([5], seed=9)[0]
    free = solo(model, prompt, 12)
    k = max(i for i, t in enumerate(free) if t not in free[:i])  # the last first occurrence
    detok = lambda ids: "".join(f"<{t}>" for t in ids)  # noqa: E731
    rules = StopRules(12, (), stop_strings=(f"<{free[k]}>",))
    reqs = [Request("0", prompt, build_chain({}), Greedy(), rules, detok), request(1, prompts_of([3], seed=10)[0], 4)]
    result = Scheduler(model, reqs, max_batch=2, block_size=BS).run()[0]
    assert (result.new_ids, result.stop_reason) == (free[: k + 1], "stop")
    assert k > 0


def test_a_finished_static_row_keeps_computing_one_token_an_iteration():
    """Static batch of prompts 3 and 5, 2 and 4 new tokens: iteration 0 prefills both (8 tokens); request 0 draws
    its last token in iteration 1, and its row is still fed one token in iterations 2 and 3, until request 1
    finishes: 2 rows and 2 decode tokens in each of iterations 1-3, and 3 + 3 and 5 + 3 tokens computed."""
    model = random_model("llama", scale=4.0)
    prompts = prompts_of([3, 5], seed=11)
    sched = Scheduler(model, [request(i, p, n) for i, (p, n) in enumerate(zip(prompts, [2, 4]))], max_batch=2,
                      block_size=BS, static=True)
    records = list(sched)
    assert [(r.rows, r.tokens, r.prefill_tokens, r.decode_tokens) for r in records] == \
        [(2, 8, 8, 0), (2, 2, 0, 2), (2, 2, 0, 2), (2, 2, 0, 2)]
    assert [(r.finished, r.computed_tokens) for r in sched.results] == [(1, 6), (3, 8)]
    assert [r.new_ids for r in sched.results] == [solo(model, p, n) for p, n in zip(prompts, [2, 4])]


def test_the_defaults_are_8_rows_512_tokens_and_blocks_of_16():
    """Nine 2-token requests under the defaults: 8 join the first iteration, the ninth when one leaves."""
    model = random_model("llama", scale=4.0)
    sched = Scheduler(model, [request(i, p, 2) for i, p in enumerate(prompts_of([2] * 9, seed=12))])
    assert (sched.max_batch, sched.budget, sched.policy.block, sched.prefix_caching) == (8, 512, 16, True)
    assert [len(r.joined) for r in sched if r.joined] == [8, 1]


def test_no_requests_make_a_one_block_pool_and_no_iterations_and_a_prompt_filling_its_context_is_refused():
    """With no request the longest sequence is taken as 1 token: one block of 1 (static too), and the run has no
    iteration and no result. A request's prompt as long as its own context is refused before anything runs."""
    model = random_model("llama", scale=4.0)
    for static in (False, True):
        sched = Scheduler(model, [], block_size=1, static=static)
        assert sched.results == [] and sched.peak_blocks == 0  # before the run, as after it
        assert sched.policy.num_blocks == 1 and list(sched) == [] and sched.results == [] and sched.peak_blocks == 0
    long = Request("0", [1, 2, 3, 4], build_chain({}), Greedy(), StopRules(2, (), context_length=4))
    with pytest.raises(ConfigError) as err:
        Scheduler(model, [long])
    assert str(err.value) == "PROMPT: the prompt is 4 tokens but the model's context is 4; shorten it"


def test_cli_batch_json_and_csv_carry_each_requests_mean_logprobs(cli, toy_model_dir, tmp_path):
    """Issue 40: the table showed each request's mean log-probability (processed and raw) and the CSV/JSON did not.
    The fields are the means of the request's own steps (worked from them here), and the CSV's columns equal them."""
    import csv
    import io
    import json

    path = tmp_path / "prompts.txt"
    path.write_text("Once upon a time\nThe machine\n")
    args = ("batch", "--prompts-file", path, "-m", toy_model_dir, "-n", "4", "--ignore-eos", "--baselines", "none",
            "-t", "0.8", "--top-k", "20", "--seed", "3")
    doc = run_json(cli, *args)
    for r in doc["requests"]:
        steps = r["steps"]
        assert r["mean_logprob"] == pytest.approx(sum(s["logprob"] for s in steps) / len(steps), abs=0)
        assert r["mean_raw_logprob"] == pytest.approx(sum(s["raw_logprob"] for s in steps) / len(steps), abs=0)
        assert r["mean_logprob"] != r["mean_raw_logprob"]  # top-k and temperature change the distribution
    code, out, err = cli(*args, "-f", "csv")
    assert code == 0, err
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [float(row["mean_logprob"]) for row in rows] == [r["mean_logprob"] for r in doc["requests"]]
    assert [float(row["mean_raw_logprob"]) for row in rows] == [r["mean_raw_logprob"] for r in doc["requests"]]
