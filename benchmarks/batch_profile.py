"""Where an iteration of `decodelab batch` spends its time: scheduling, planning (block tables, positions, the mask),
the KV writes and block gathers inside the forward, attention, the rest of the forward, and selecting each row's
token.

The scheduler runs its real loop; each phase is timed by wrapping the function that does it (wall clock, one
thread), so the phases add up to the iteration's time and the rest is the model's own work (its linear layers,
norms, rotary embedding and Python). Workloads: ``vllm`` (32 requests of the same 200-token prefix plus 8 tokens
of their own, 64 new tokens each: benchmarks/batch_vs_vllm.py's) and ``readme`` (workload A of benchmarks/batch.py:
32 requests, outputs 8..256 tokens). Shares are of the summed iteration time; on a busy machine read the shares,
not the milliseconds.

    python benchmarks/batch_profile.py [--workload vllm|readme] [--max-batch 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from batch import workload_a  # noqa: E402
from batch_vs_vllm import vllm_workload  # noqa: E402

from decodelab.core.engine.models import load_model  # noqa: E402
from decodelab.core.engine.stopping import StopRules  # noqa: E402
from decodelab.core.kv import paged  # noqa: E402
from decodelab.core.methods.batch import scheduler as sched_mod  # noqa: E402
from decodelab.core.methods.batch.scheduler import Request, Scheduler  # noqa: E402
from decodelab.core.sampling.chain import build_chain  # noqa: E402
from decodelab.core.sampling.select import Greedy  # noqa: E402

SPENT: dict[str, float] = defaultdict(float)


def timed(name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[name] += time.perf_counter() - start
    return wrapper


def instrument() -> None:
    """Wrap the phases (the forward's share is what the wrapped parts inside it leave)."""
    S = Scheduler
    S._schedule_running = timed("schedule", S._schedule_running)
    S._admit = timed("schedule", S._admit)
    S._retire = timed("schedule", S._retire)
    paged.PagedPolicy.plan = timed("plan: block tables, positions, mask", paged.PagedPolicy.plan)
    paged.PagedCache.update = timed("KV write + block gather", paged.PagedCache.update)
    sched_mod.select = timed("select (chain, selector)", sched_mod.select)
    runtime_feed = sched_mod.Runtime.feed
    sched_mod.Runtime.feed = timed("forward (all of it)", runtime_feed)
    sdpa = F.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = timed("attention (sdpa)", sdpa)


def requests(work) -> list[Request]:
    return [Request(f"r{i}", p, build_chain({}), Greedy(), StopRules(n, ignore_eos=True))
            for i, (p, n) in enumerate(work)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=("vllm", "readme"), default="vllm")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-tokens-per-iteration", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    lm = load_model("tiny", device="cpu")
    work = vllm_workload(lm) if args.workload == "vllm" else workload_a(lm)
    instrument()
    shares: dict[str, list[float]] = defaultdict(list)
    totals, iterations = [], 0
    for _ in range(args.rounds + 1):  # the first round warms up and is not counted
        SPENT.clear()
        sched = Scheduler(lm.model, requests(work), max_batch=args.max_batch,
                          max_tokens_per_iteration=args.max_tokens_per_iteration, block_size=args.block_size)
        sched.run()
        total = sched.seconds
        if _ == 0:
            continue
        iterations = len(sched.iterations)
        totals.append(total)
        inner = SPENT["KV write + block gather"] + SPENT["attention (sdpa)"]
        parts = {k: v for k, v in SPENT.items() if k != "forward (all of it)"}
        parts["rest of the forward (linear, norms, rotary, Python)"] = SPENT["forward (all of it)"] - inner
        parts["rest of the iteration (bookkeeping)"] = total - sum(parts.values())
        for k, v in parts.items():
            shares[k].append(v / total)
    print(f"workload {args.workload}: {len(work)} requests, max batch {args.max_batch}, {iterations} iterations; "
          f"iteration time median {1000 * statistics.median(totals) / iterations:.1f} ms over {args.rounds} rounds")
    print("| phase | share of the iteration, median (min-max) |")
    print("|---|---:|")
    for k, v in sorted(shares.items(), key=lambda kv: -statistics.median(kv[1])):
        print(f"| {k} | {100 * statistics.median(v):.1f}% ({100 * min(v):.1f}-{100 * max(v):.1f}) |")


if __name__ == "__main__":
    main()
