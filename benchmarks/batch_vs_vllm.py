"""`decodelab batch` against vLLM's own batching and transformers' continuous batching, paired in one run.

Workload (as benchmarks/engine_batch_vllm.py): 32 requests, each the same 200-token prefix of the bundled
validation text plus 8 tokens of its own, 64 new tokens each, greedy, EOS ignored, on presets/models/tiny in
float32, one torch thread for decodelab and transformers. Each round runs, in rotated order:

* vLLM, prefix not cached: a new 200-token prefix every round (its prefix cache cannot hold it yet), all 32
  requests sent at once on 32 threads through decodelab's client to a vLLM server on loopback;
* vLLM, prefix cached: the same requests again;
* decodelab: the scheduler of `decodelab batch` (``--max-batch 32``: every request runs at once, as vLLM runs
  them) on a fresh pool, the prefix computed by the first request and shared by the others;
* transformers' continuous batching (``init_continuous_batching``, the same batch size, page size and tokens per
  iteration), with ``--transformers``.

Reported: medians over rounds of the wall seconds and the per-round ratios (decodelab's speed / the other's), with
the lowest and highest; the tokens of decodelab and transformers are checked equal to vLLM's first. vLLM's server
(and its engine process) shares the cores with this process: its CPU seconds during decodelab's turn are printed,
so an idle server that still takes CPU would show.

    python benchmarks/batch_vs_vllm.py [--rounds 5] [--transformers] [--max-batch 32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))

import torch  # noqa: E402

from decodelab.core.engine.models import bundled_dir, load_model  # noqa: E402
from decodelab.core.engine.reference import continuous_batching_generate  # noqa: E402
from decodelab.core.engine.stopping import StopRules  # noqa: E402
from decodelab.core.methods.batch.scheduler import Request, Scheduler  # noqa: E402
from decodelab.core.sampling.chain import build_chain  # noqa: E402
from decodelab.core.sampling.select import Greedy  # noqa: E402

REQUESTS, OWN, NEW, PREFIX = 32, 8, 64, 200


def corpus(lm) -> list[int]:
    return lm.tokenizer.encode((bundled_dir("tiny").parent / "validation.txt").read_text(), add_special_tokens=False)


def vllm_workload(lm, round_: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, new tokens) x 32: a 200-token prefix (round 0: the text's first 200 tokens, as
    engine_batch_vllm.py sends; round r: 200 tokens from another place of the text) + 8 tokens of each request's
    own."""
    ids = corpus(lm)
    start = (round_ * 1237) % (len(ids) - PREFIX)
    prefix = ids[start: start + PREFIX]
    return [(prefix + ids[1000 + OWN * i: 1000 + OWN * (i + 1)], NEW) for i in range(REQUESTS)]


def decodelab_run(lm, work, max_batch: int, block: int, budget: int) -> tuple[list[list[int]], float]:
    requests = [Request(f"r{i}", p, build_chain({}), Greedy(), StopRules(n, ignore_eos=True))
                for i, (p, n) in enumerate(work)]
    sched = Scheduler(lm.model, requests, max_batch=max_batch, max_tokens_per_iteration=budget, block_size=block)
    start = time.perf_counter()
    results = sched.run()
    return [r.new_ids for r in results], time.perf_counter() - start


def spread(xs: list[float], digits: int = 2) -> str:
    return f"{statistics.median(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-tokens-per-iteration", type=int, default=2048)
    ap.add_argument("--transformers", action="store_true", help="also transformers' continuous batching")
    args = ap.parse_args()
    from engine_batch_vllm import server_pid, tree_cpu_s
    from vllm_server import SERVED_NAME, vllm_python, vllm_server

    from decodelab.core.engine.http.client import ServedEngine
    from decodelab.core.engine.http.wire import SamplingSettings
    if vllm_python() is None:
        print("no vLLM venv: run .ci/vllm-venv.sh or set DECODELAB_VLLM_PYTHON", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    lm = load_model("tiny", device="cpu")
    settings = SamplingSettings(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=1)
    print(f"load average before start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    times: dict[str, list[float]] = {"vllm uncached": [], "vllm cached": [], "decodelab": [], "transformers": []}
    server_cpu: list[float] = []
    with vllm_server("raw_logprobs") as url:
        from concurrent.futures import ThreadPoolExecutor

        engine = ServedEngine(url, model=SERVED_NAME, timeout=900)
        server = server_pid(url)

        def vllm(work) -> tuple[list[list[int]], float]:
            start = time.perf_counter()
            with ThreadPoolExecutor(len(work)) as pool:
                out = list(pool.map(lambda w: list(engine.generate(w[0], settings).token_ids), work))
            return out, time.perf_counter() - start

        engine.generate(corpus(lm)[30000:30000 + PREFIX], settings)  # warm-up on other tokens
        decodelab_run(lm, vllm_workload(lm, 99), 4, args.block_size, args.max_tokens_per_iteration)
        reference, _ = vllm(vllm_workload(lm, 98))
        ours, _ = decodelab_run(lm, vllm_workload(lm, 98), args.max_batch, args.block_size,
                                args.max_tokens_per_iteration)
        print(f"decodelab: {sum(a == b for a, b in zip(ours, reference))}/{REQUESTS} requests with vLLM's tokens")
        if args.transformers:
            theirs, _ = continuous_batching_generate(lm.model, vllm_workload(lm, 98), args.max_batch,
                                                     args.max_tokens_per_iteration, args.block_size)
            print(f"transformers: {sum(a == b for a, b in zip(theirs, reference))}/{REQUESTS} requests with "
                  "vLLM's tokens")
        for r in range(args.rounds):
            work = vllm_workload(lm, r + 1)
            steps = ["vllm", "decodelab"] + (["transformers"] if args.transformers else [])
            for step in steps[r % len(steps):] + steps[:r % len(steps)]:
                if step == "vllm":
                    times["vllm uncached"].append(vllm(work)[1])
                    times["vllm cached"].append(vllm(work)[1])
                elif step == "decodelab":
                    before = tree_cpu_s(server)
                    times["decodelab"].append(decodelab_run(lm, work, args.max_batch, args.block_size,
                                                            args.max_tokens_per_iteration)[1])
                    server_cpu.append(tree_cpu_s(server) - before)
                else:
                    times["transformers"].append(continuous_batching_generate(
                        lm.model, work, args.max_batch, args.max_tokens_per_iteration, args.block_size)[1])
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items() if v), flush=True)
    tokens = REQUESTS * NEW
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}; {args.rounds} rounds; {tokens} tokens a round; "
          f"vLLM's server took {spread(server_cpu)} CPU s during decodelab's turns")
    print("| variant | wall s, median (min-max) | tokens/s | decodelab / it, median (min-max) |")
    print("|---|---:|---:|---:|")
    for name, ts in times.items():
        if not ts:
            continue
        ratio = "" if name == "decodelab" else spread([b / a for a, b in zip(times["decodelab"], ts)])
        print(f"| {name} | {spread(ts)} | {tokens / statistics.median(ts):.0f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
