"""Per-token decoding time through a quantized KV cache against the full cache, paired in one run.

Each cache prefills the same ``--context`` tokens of the held-out text (presets/models/validation.txt), then feeds
``--tokens`` more one token a forward, as decoding does (every forward reads every stored token). The caches take
turns round after round (order rotated); per cache, the time per fed token; the ratio is the median over rounds of
the per-round ratio to the full cache (<= 1.2x is issue 38's goal), with the lowest and highest. The bytes are the stored
tensors' (codes, scales, zero points, the exact window) at the end, which the change must not move.

``--pairing token`` pairs more tightly, for a machine others load: every cache holds its own prefilled cache side by
side and each token is fed to every cache in turn (order rotated token by token); the ratio is then the median over
all rounds' tokens of the per-token ratio to the full cache, so a change in the machine's load between two caches'
runs does not enter it.

The default caches are issue 38's: ``int8``, ``int4-kivi``, ``int2-kivi``, a rotated 4-bit KIVI layout and
``turbo`` at 2, 3 and 4 bits (the rotated layouts attend in their rotated space: the query rotated, the output
rotated back; see docs/kv-policies.md). While a rotated cache's runtime lives on the model, every runtime on it
attends through decodelab's wrapper of the model's attention (a pass-through for the full cache: one Python call a
layer), so the full cache's time here includes that call. ``--small`` is a check that the script runs (a short context, a few tokens,
one round): its figures mean nothing.

``--shape llama3-8b`` decodes instead with a stack of ``--layers`` (default 2) decoder layers of Llama-3-8B's shapes
(hidden 4096, MLP 14336, 32 query heads and 8 KV heads of 128 dims; random weights, the bundled tokenizer's 4096-token
vocabulary): where the model's own products dominate a token's time, as they do at the sizes people serve, rather
than the cache's per-layer operations, as they do on the bundled model (hidden 128, 2 KV heads of 32 dims).

    python benchmarks/quant_decode.py [--context 384] [--tokens 64] [--rounds 5] [--pairing round|token] [--small]
                                      [--caches int8,int4-kivi,...] [--shape tiny|llama3-8b] [--layers 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from decodelab.core.engine.models import load_model
from decodelab.core.engine.runtime import Runtime
from decodelab.core.kv import parse_cache_spec

TEXT = Path(__file__).resolve().parents[1] / "presets" / "models" / "validation.txt"
DEFAULT_CACHES = ("int8,int4-kivi,int2-kivi,quant:bits=4,axis=kivi,residual=32,residual_dtype=16,rotate=hadamard,"
                  "turbo:bits=2,turbo:bits=3,turbo:bits=4")


def decode_seconds(lm, spec: str, ids: list[int], context: int) -> tuple[float, float, int]:
    """Wall and CPU seconds (this process: one thread, so the CPU seconds leave out the time spent waiting for a core
    on a busy machine) per token of the one-token forwards after the prefill, and the stored bytes at the end."""
    runtime = Runtime.create(lm.model, parse_cache_spec(spec), capacity=len(ids))
    runtime.prefill(torch.tensor([ids[:context]]))
    start, cpu = time.perf_counter(), time.process_time()
    for t in ids[context:]:
        runtime.feed(torch.tensor([[t]]))
    n = len(ids) - context
    return (time.perf_counter() - start) / n, (time.process_time() - cpu) / n, sum(runtime.policy.layer_nbytes())


def token_paired(lm, caches: list[str], ids: list[int], context: int) -> tuple[dict, dict, dict]:
    """One round of ``--pairing token``: each cache prefilled, then each token fed to every cache in turn. Per cache,
    the wall and CPU seconds of every one-token forward, and the stored bytes at the end."""
    runtimes = {}
    for spec in caches:
        runtimes[spec] = Runtime.create(lm.model, parse_cache_spec(spec), capacity=len(ids))
        runtimes[spec].prefill(torch.tensor([ids[:context]]))
    wall: dict[str, list[float]] = {c: [] for c in caches}
    cpu: dict[str, list[float]] = {c: [] for c in caches}
    for i, t in enumerate(ids[context:]):
        for spec in caches[i % len(caches):] + caches[: i % len(caches)]:
            start, c0 = time.perf_counter(), time.process_time()
            runtimes[spec].feed(torch.tensor([[t]]))
            wall[spec].append(time.perf_counter() - start)
            cpu[spec].append(time.process_time() - c0)
    return wall, cpu, {spec: sum(rt.policy.layer_nbytes()) for spec, rt in runtimes.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=384)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pairing", choices=("round", "token"), default="round")
    ap.add_argument("--caches", default=DEFAULT_CACHES)
    ap.add_argument("--small", action="store_true", help="a check that it runs: context 48, 4 tokens, 1 round")
    ap.add_argument("--shape", choices=("tiny", "llama3-8b"), default="tiny")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of --shape llama3-8b")
    args = ap.parse_args()
    if args.small:
        args.context, args.tokens, args.rounds = 48, 4, 1
    torch.set_num_threads(1)
    lm = load_model("tiny", device="cpu")
    ids = lm.encode(TEXT.read_text())[: args.context + args.tokens]
    if args.shape == "llama3-8b":
        lm = SimpleNamespace(model=llama3_8b_shaped(args.layers, lm.model.config.vocab_size))
    caches = merge_specs(args.caches)
    for spec in caches:  # warm-up
        decode_seconds(lm, spec, ids[: args.context + 4], args.context)
    load_before = os.getloadavg()[0]
    times: dict[str, list[float]] = {c: [] for c in caches}
    cpu: dict[str, list[float]] = {c: [] for c in caches}
    stored: dict[str, int] = {}
    for r in range(args.rounds):
        if args.pairing == "token":
            wall, cpu_seconds, stored = token_paired(lm, caches, ids, args.context)
            for spec in caches:
                times[spec] += wall[spec]
                cpu[spec] += cpu_seconds[spec]
            continue
        for spec in caches[r % len(caches):] + caches[: r % len(caches)]:
            seconds, cpu_seconds, stored[spec] = decode_seconds(lm, spec, ids, args.context)
            times[spec].append(seconds)
            cpu[spec].append(cpu_seconds)
    paired = "token by token" if args.pairing == "token" else "round by round"
    if args.small:
        print("--small: a check that the script runs; these figures mean nothing")
    model = "tiny" if args.shape == "tiny" else f"{args.layers} layers of Llama-3-8B's shapes (random weights)"
    print(f"{model}, one thread, context {args.context} then {args.tokens} one-token forwards, {args.rounds} rounds "
          f"paired {paired}; "
          f"1-minute load average {load_before:.1f} before the rounds, {os.getloadavg()[0]:.1f} after, on "
          f"{os.cpu_count()} cores")
    print("| cache | wall ms per token | / full, wall: median (min-max) | / full, CPU: median (min-max) | stored "
          "bytes |")
    print("|---|---:|---:|---:|---:|")
    for spec, ts in times.items():
        print(f"| `{spec}` | {1000 * statistics.median(ts):.2f} | {ratio(ts, times['full'])} | "
              f"{ratio(cpu[spec], cpu['full'])} | {stored[spec]:,} |")


def llama3_8b_shaped(layers: int, vocab: int):
    """A Llama of Llama-3-8B's layer shapes, ``layers`` deep, random weights (seed 0), float32, eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=vocab,
                                  rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=True)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def ratio(ours: list[float], full: list[float]) -> str:
    xs = [a / b for a, b in zip(ours, full)]
    return f"{statistics.median(xs):.2f}x ({min(xs):.2f}-{max(xs):.2f})"


def merge_specs(text: str) -> list[str]:
    """The full cache first, then the listed specs (a spec's own commas join it to the next item when that item is
    a key=value of the same spec)."""
    out: list[str] = []
    for item in text.split(","):
        if out and "=" in item and ":" not in item and out[-1].startswith(("quant:", "turbo:")):
            out[-1] += "," + item
        elif item:
            out.append(item)
    return ["full"] + out


if __name__ == "__main__":
    main()
