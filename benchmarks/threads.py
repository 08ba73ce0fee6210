"""torch CPU threads: decoding tokens/s with one thread against the machine's physical cores, paired in one process.

The same traced greedy run (``decodelab sample``'s loop, ``-n`` tokens) alternates between thread counts round after
round (order rotated); the ratio is the median over rounds of the per-round ratio of wall times (> 1: more threads is
faster), with the lowest and highest. Models: the bundled ``tiny`` (12 layers, width 128, 2.6M parameters) and
random Llamas of growing width (same tokenizer, weights random: only the time matters), so the table shows at which
size a second thread starts to pay. The load average is printed with the figures: on a machine whose cores are
already busy, an OpenMP thread that has no core spins waiting for the others, and more threads lose.

This is the measurement behind ``--threads``'s default (``core/engine/models.py`` ``default_threads``).

    python benchmarks/threads.py [--tokens 48] [--rounds 5] [--widths 128,512,1024] [--threads 1,2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from decodelab.core.engine.models import LoadedModel, load_model, physical_cores
from decodelab.core.methods.sample import SampleSettings, build_sampler

PROMPT = "Once upon a time, in a land far away, there lived"


def random_llama(tiny: LoadedModel, width: int) -> LoadedModel:
    """A random Llama of the given width (8 layers, head size 64, GQA 2:1) on the bundled tokenizer."""
    heads = max(width // 64, 2)
    cfg = LlamaConfig(vocab_size=tiny.vocab_size, hidden_size=width, intermediate_size=int(width * 2.75),
                      num_hidden_layers=8, num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1),
                      max_position_embeddings=512, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    return LoadedModel(f"random width {width}", model, tiny.tokenizer, torch.device("cpu"), torch.float32, [0])


def run_once(lm: LoadedModel, prompt_ids: list[int], n: int, threads: int) -> float:
    torch.set_num_threads(threads)
    sampler = build_sampler(lm, SampleSettings(max_new_tokens=n, ignore_eos=True, temperature=0.0), prompt_ids)
    start = time.perf_counter()
    for _ in sampler:
        pass
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--widths", default="128,512,1024", help="random Llama widths besides the bundled tiny")
    ap.add_argument("--threads", default=f"1,{physical_cores()}")
    args = ap.parse_args()
    counts = [int(t) for t in args.threads.split(",")]
    tiny = load_model("tiny", device="cpu")
    models = [tiny] + [random_llama(tiny, int(w)) for w in args.widths.split(",") if w]
    prompt_ids = tiny.encode(PROMPT)
    print(f"{os.cpu_count()} logical / {physical_cores()} physical cores; load average before "
          f"{os.getloadavg()[0]:.1f}; {args.tokens} tokens, {args.rounds} rounds")
    print(f"| model | parameters | tok/s at {counts[0]} thread | " + " | ".join(
        f"{c} threads / {counts[0]}: median (min-max)" for c in counts[1:]) + " |")
    print("|---|---:|---:|" + "---:|" * (len(counts) - 1))
    for lm in models:
        run_once(lm, prompt_ids, 4, counts[0])  # warm-up
        times: dict[int, list[float]] = {c: [] for c in counts}
        for r in range(args.rounds):
            order = counts[r % len(counts):] + counts[:r % len(counts)]
            for c in order:
                times[c].append(run_once(lm, prompt_ids, args.tokens, c))
        params = sum(p.numel() for p in lm.model.parameters())
        cells = []
        for c in counts[1:]:
            ratios = [a / b for a, b in zip(times[counts[0]], times[c])]
            cells.append(f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
        print(f"| {lm.name} | {params / 1e6:.1f}M | {args.tokens / statistics.median(times[counts[0]]):.1f} | "
              + " | ".join(cells) + " |")
    print(f"load average after {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
