"""Tokens/s of decodelab's decode loop against transformers `generate`, side by side in one process.

Every variant decodes the same prompt for exactly the same number of tokens on the same model. The variants run in
alternation, round after round, in a fresh random order each round; each reported ratio is the median over rounds
of the per-round ratio of the two wall times (paired, so slow drift of a busy machine affects both sides alike),
and tok/s is the median rate.

`generate` is configured as its best users would: EOS ignored through `eos_token_id=None` (not `min_new_tokens`,
which adds a logits processor to its loop), and `top_k=0` when sampling (its default would add top-k 50, which
decodelab's chain does not run). decodelab runs the same settings through `core.build`, exactly as the CLI does, and
its time includes the prefill, the loop and (traced) the full per-token trace with 5 alternatives, built into the
steps and the summary a command prints. "traced" is the trace as `sample -f json` (or csv, markdown) takes it: steps
traced together in blocks (`Sampler(block=...)`, REPORT_BLOCK, as the CLI does); "traced, streamed" is the trace as
`-f jsonl`, `-f text` and the live table take it, one step at a time.

Goals: traced greedy and traced top-p >= 1.1x `generate`; trace on >= 0.95x trace off. The trace's cost is also
read inside each traced run, where it cannot drift against its reference: the stopwatch's trace laps (statistics,
the transfer, the steps built) over the rest of the same run (prefill, forwards, chain, selector), token after
token interleaved (the in-run share; the pairing of traced and untraced runs also counts what tracing does to the
forwards around it, such as a colder cache, and moves by several hundredths on a machine whose speed drifts).
With `--compile`: the static cache with the one-token step compiled, against `generate` with its own static cache
compiled (compile times reported separately, rates measured after compiling).

    python benchmarks/sample_vs_generate.py [--model tiny] [--tokens 128] [--rounds 7] [--threads 1] [--compile]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from decodelab.core.methods.sample import build_sampler
from decodelab.core.methods.sample import REPORT_BLOCK, SampleSettings
from decodelab.core.engine.models import load_model
from decodelab.core.engine.run import synchronize

PROMPT = "Once upon a time, in a land far away, there lived"
SETTINGS = {"greedy": {"temperature": 0.0}, "top-p": {"temperature": 0.8, "top_p": 0.9}}


def generate_kwargs(label: str, n: int) -> dict:
    kwargs = {"max_new_tokens": n, "eos_token_id": None, "pad_token_id": 0}
    if label == "greedy":
        return {**kwargs, "do_sample": False}
    s = SETTINGS[label]
    return {**kwargs, "do_sample": True, "temperature": s["temperature"], "top_p": s["top_p"], "top_k": 0}


def ours(lm, prompt_ids, label: str, n: int, trace: bool, cache: str = "full", compile: bool = False,
         block: int = REPORT_BLOCK):
    settings = SampleSettings(max_new_tokens=n, ignore_eos=True, top=5, cache=cache, compile=compile,
                              **SETTINGS[label])

    def run() -> int:
        sampler = build_sampler(lm, settings, prompt_ids, record=trace, block=block)
        for _ in sampler:
            pass
        sampler.summary()
        timing = sampler.watch.timing
        run.shares.append(timing.trace_s / (timing.prefill_s + timing.loop_s))
        return len(sampler.new_ids)

    run.shares = []  # per run: the time spent tracing / the rest of that run (prefill, forwards, chain, selector)
    return run


def theirs(lm, ids, label: str, n: int, **extra):
    kwargs = {**generate_kwargs(label, n), **extra}

    def run() -> int:
        out = lm.model.generate(ids, **kwargs)
        return out.shape[1] - ids.shape[1]

    return run


def timed(fn, device) -> float:
    synchronize(device)
    start = time.perf_counter()
    produced = fn()
    synchronize(device)
    return time.perf_counter() - start, produced


def measure(runs: dict, n: int, rounds: int, device) -> dict[str, list[float]]:
    for fn in runs.values():  # warm-up (and, with --compile, the compilation)
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    order = random.Random(0)
    for _ in range(rounds):
        # a fresh order every round: a run is slower or faster after some variants (what they leave in the caches
        # and the allocator), and a rotation would keep each variant behind the same neighbour every round
        names = order.sample(list(runs), len(runs))
        for name in names:
            seconds, produced = timed(runs[name], device)
            assert produced == n, (name, produced)
            times[name].append(seconds)
    return times


def paired(times: dict, ours_name: str, ref_name: str) -> float:
    """Median over rounds of ref time / our time: > 1 means decodelab is faster."""
    return statistics.median(r / o for r, o in zip(times[ref_name], times[ours_name]))


def compile_time(fn, device) -> float:
    """Seconds of the first call beyond a steady call: what compiling cost."""
    first, _ = timed(fn, device)
    steady, _ = timed(fn, device)
    return first - steady


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--compile", action="store_true", help="also the compiled static-cache pair")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, device=args.device)
    prompt_ids = lm.encode(PROMPT)
    ids = torch.tensor([prompt_ids], device=lm.device)
    n = args.tokens
    runs = {}
    for label in SETTINGS:
        runs[f"generate {label}"] = theirs(lm, ids, label, n)
        runs[f"decodelab traced {label}"] = ours(lm, prompt_ids, label, n, trace=True)
        runs[f"decodelab traced, streamed {label}"] = ours(lm, prompt_ids, label, n, trace=True, block=1)
        runs[f"decodelab untraced {label}"] = ours(lm, prompt_ids, label, n, trace=False)
    # greedy outputs must agree before any timing means anything
    greedy_ref = lm.model.generate(ids, **generate_kwargs("greedy", n))[0, len(prompt_ids):].tolist()
    sampler = build_sampler(lm, SampleSettings(max_new_tokens=n, ignore_eos=True, temperature=0.0), prompt_ids)
    list(sampler)
    assert sampler.new_ids == greedy_ref, "decodelab greedy and generate greedy disagree"
    compiled = {}
    if args.compile:
        from transformers import CompileConfig

        config = CompileConfig(fullgraph=False, dynamic=False)
        config._compile_all_devices = True  # generate compiles only on GPUs unless told otherwise
        compiled = {"generate static compiled greedy": theirs(lm, ids, "greedy", n, cache_implementation="static",
                                                              compile_config=config),
                    "decodelab static compiled greedy (traced)": ours(lm, prompt_ids, "greedy", n, trace=True,
                                                                       cache="static", compile=True),
                    "decodelab static compiled greedy (untraced)": ours(lm, prompt_ids, "greedy", n, trace=False,
                                                                         cache="static", compile=True)}
        compile_s = {name: compile_time(fn, lm.device) for name, fn in compiled.items()}
        runs.update(compiled)
    times = measure(runs, n, args.rounds, lm.device)
    print(f"model {lm.name} on {lm.device} ({str(lm.dtype).replace('torch.', '')}), torch threads "
          f"{torch.get_num_threads()}, prompt {len(prompt_ids)} tokens, {n} new tokens, {args.rounds} rounds "
          f"(a fresh random order each round), medians")
    width = max(map(len, times))
    for name, ts in times.items():
        print(f"  {name:<{width}}  {n / statistics.median(ts):8.1f} tok/s")
    print("paired ratios (median over rounds of the per-round time ratio):")
    for label in SETTINGS:
        print(f"  traced {label} / generate {label}:    {paired(times, f'decodelab traced {label}', f'generate {label}'):.2f}x"
              "   (goal >= 1.10x)")
        print(f"  untraced {label} / generate {label}:  "
              f"{paired(times, f'decodelab untraced {label}', f'generate {label}'):.2f}x")
        print(f"  traced {label} / untraced {label}:    "
              f"{paired(times, f'decodelab traced {label}', f'decodelab untraced {label}'):.2f}x   (goal >= 0.95x)")
        print(f"  traced, streamed {label} / generate {label}:  "
              f"{paired(times, f'decodelab traced, streamed {label}', f'generate {label}'):.2f}x")
        print(f"  traced, streamed {label} / untraced {label}:  "
              f"{paired(times, f'decodelab traced, streamed {label}', f'decodelab untraced {label}'):.2f}x")
        for kind in ("traced", "traced, streamed"):
            share = statistics.median(runs[f"decodelab {kind} {label}"].shares[1:])  # the warm-up run left out
            print(f"  {kind} {label}, in-run trace share (trace time / the rest of the same run): {share:.1%}"
                  + ("   (goal <= 5%)" if kind == "traced" else ""))
    if compiled:
        for kind in ("traced", "untraced"):
            ratio = paired(times, f"decodelab static compiled greedy ({kind})", "generate static compiled greedy")
            print(f"  static compiled, decodelab {kind} / generate: {ratio:.2f}x   (goal >= 1.0x)")
        for name, seconds in compile_s.items():
            print(f"  compile time, {name}: {seconds:.1f} s")


if __name__ == "__main__":
    main()
