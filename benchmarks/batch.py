"""Iteration-level batching against static batching and transformers' continuous batching, and prefix sharing.

Workload A: 32 requests (prompts from the bundled validation text, 12-40 tokens) whose output lengths are spread
evenly from 8 to 256 tokens (shuffled with a fixed seed; EOS ignored, so each request runs to its length). Greedy.

* decodelab iteration-level (the scheduler: finished rows leave, waiting ones join every iteration)
* decodelab static batching, same batch size (batches in arrival order run until their longest member ends; a
  finished row keeps computing, as ``generate`` does with padding). Same runtime, same paged attention, so the
  ratio is the scheduling alone. Goal: iteration-level / static >= 1.5x.
* transformers continuous batching (``init_continuous_batching``, sdpa, per-request ``max_new_tokens``, the same
  batch size, tokens per iteration and page size). Goal: decodelab / transformers >= 1.0x.

tokens/s = generated tokens / seconds of the whole workload (setup and prefills included), both wall seconds and
CPU seconds of this process (all its threads): on a machine shared with other jobs the wall time swings with their
load, while CPU time counts only the work each variant did. Variants alternate round after round; medians. Before
timing, every variant's tokens are checked against decodelab's (greedy: equal runs must give equal tokens; a
mismatch is printed, not hidden).

Workload B: 32 requests sharing a 90% prefix (each prompt = the same 144 tokens + 16 of its own), 16 new tokens
each: prefill tokens computed with prefix caching against the prompt tokens without it. Goal: >= 80% fewer.

    python benchmarks/batch.py [--model tiny] [--max-batch 8] [--block-size 16] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from decodelab.core.engine.models import bundled_dir, load_model
from decodelab.core.engine.reference import continuous_batching_generate
from decodelab.core.sampling.chain import build_chain
from decodelab.core.methods.batch.scheduler import Request, Scheduler
from decodelab.core.sampling.select import Greedy
from decodelab.core.engine.stopping import StopRules


def corpus_ids(lm) -> list[int]:
    path = bundled_dir("tiny").parent / "validation.txt"
    text = path.read_text() if path.is_file() else "Once upon a time there was a little fox. " * 200
    return lm.encode(text)


def workload_a(lm, n: int = 32, low: int = 8, high: int = 256) -> list[tuple[list[int], int]]:
    """(prompt ids, new tokens): prompts are slices of the validation text, outputs spread evenly low..high."""
    rng = random.Random(0)
    ids = corpus_ids(lm)
    outs = [round(low + (high - low) * i / (n - 1)) for i in range(n)]
    rng.shuffle(outs)
    work = []
    for out in outs:
        length = rng.randrange(12, 41)
        start = rng.randrange(0, len(ids) - length)
        work.append((ids[start : start + length], out))
    return work


def workload_b(lm, n: int = 32, prefix: int = 144, own: int = 16, new: int = 16) -> list[tuple[list[int], int]]:
    ids = corpus_ids(lm)
    shared = ids[:prefix]
    rng = random.Random(1)
    return [(shared + [ids[rng.randrange(prefix, len(ids))] for _ in range(own)], new) for _ in range(n)]


def requests(work) -> list[Request]:
    return [Request(f"r{i}", p, build_chain({}), Greedy(), StopRules(n, ignore_eos=True)) for i, (p, n) in
            enumerate(work)]


def ours(model, work, args, static: bool, prefix_caching: bool | None = None):
    sched = Scheduler(model, requests(work), max_batch=args.max_batch,
                      max_tokens_per_iteration=args.max_tokens_per_iteration, block_size=args.block_size,
                      static=static, prefix_caching=prefix_caching)
    start = time.perf_counter()
    results = sched.run()
    seconds = time.perf_counter() - start
    return [r.new_ids for r in results], seconds, sched


def transformers_cb(model, work, args):
    """transformers' own continuous batching (core.model.continuous_batching_generate); (token lists, seconds)."""
    return continuous_batching_generate(model, work, args.max_batch, args.max_tokens_per_iteration, args.block_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-tokens-per-iteration", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model, device=args.device)
    model = lm.model
    work = workload_a(lm)
    generated = sum(n for _, n in work)
    print(f"model {lm.name} on {lm.device}, torch threads {torch.get_num_threads()}; workload A: {len(work)} "
          f"requests, prompts {min(len(p) for p, _ in work)}-{max(len(p) for p, _ in work)} tokens, outputs "
          f"{min(n for _, n in work)}-{max(n for _, n in work)} ({generated} tokens), max batch {args.max_batch}, "
          f"{args.max_tokens_per_iteration} tokens/iteration, block {args.block_size}")

    variants = {
        "decodelab iteration-level": lambda: ours(model, work, args, static=False)[:2],
        "decodelab static batching": lambda: ours(model, work, args, static=True)[:2],
    }
    if not args.skip_transformers:
        variants["transformers continuous batching"] = lambda: transformers_cb(model, work, args)
    reference, _ = variants["decodelab iteration-level"]()
    for name in list(variants)[1:]:
        try:
            tokens, _ = variants[name]()
        except Exception as exc:  # a reference that cannot run here is reported, with its reason
            print(f"{name}: cannot run here: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            del variants[name]
            continue
        same = sum(a == b for a, b in zip(tokens, reference))
        print(f"{name}: {same}/{len(work)} requests with the same tokens as decodelab iteration-level")
    wall = {name: [] for name in variants}
    cpu = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, run in variants.items():
            w, c = time.perf_counter(), time.process_time()
            run()
            wall[name].append(time.perf_counter() - w)
            cpu[name].append(time.process_time() - c)
    for label, times in (("wall", wall), ("CPU", cpu)):
        median = {name: statistics.median(ts) for name, ts in times.items()}
        print(f"{label} time (median of {args.rounds} interleaved rounds; each variant's whole call, setup included):")
        for name, sec in median.items():
            print(f"  {name:<34} {generated / sec:8.1f} tok/{label}-s ({sec:.2f} s; rounds "
                  f"{', '.join(f'{t:.2f}' for t in times[name])})")
        best = median["decodelab iteration-level"]
        for name in list(variants)[1:]:
            print(f"  ratio iteration-level / {name}: {median[name] / best:.2f}x")

    work_b = workload_b(lm)
    _, _, shared = ours(model, work_b, args, static=False)
    _, _, plain = ours(model, work_b, args, static=False, prefix_caching=False)
    computed = sum(r.prefill_tokens for r in shared.iterations)
    baseline = sum(r.prefill_tokens for r in plain.iterations)
    hits = sum(r.prefix_hit_tokens for r in shared.results)
    prompt_tokens = sum(len(p) for p, _ in work_b)
    print(f"workload B: {len(work_b)} requests sharing 144 of 160 prompt tokens, 16 new each: prefill tokens "
          f"computed {computed} with prefix caching vs {baseline} without ({prompt_tokens} prompt tokens): "
          f"{100 * (1 - computed / baseline):.1f}% fewer; prefix hit rate {hits / prompt_tokens:.1%}; "
          f"peak blocks {shared.peak_blocks} vs {plain.peak_blocks}; "
          f"{sum(len(r.new_ids) for r in shared.results) / shared.seconds:.1f} vs "
          f"{sum(len(r.new_ids) for r in plain.results) / plain.seconds:.1f} tok/s")


if __name__ == "__main__":
    main()
