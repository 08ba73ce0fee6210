"""decodelab against transformers `generate`, side by side in one process (the engine of `decodelab bench`).

Greedy, sampling and beam search with the trace on and off, speculative decoding against assisted generation with
the same draft model, and the n-gram proposer against prompt lookup; the same prompt and number of new tokens on
both sides, interleaved rounds, medians and paired ratios (see decodelab/core/bench.py for the fairness rules).

    python benchmarks/bench.py [--model tiny] [--draft tiny-draft] [--tokens 128] [--rounds 5] [--threads 1]
"""

from __future__ import annotations

import argparse

import torch

from decodelab.core.analysis.bench import Bench, parse_settings
from decodelab.core.engine.models import load_model

PROMPT = "God blessed Noah and his sons, and said to them"  # the opening of the bundled held-out text

GOALS = {"greedy, trace on": 1.1, "sampling t=0.8 top-p=0.95, trace on": 1.1, "beam 4, trace off": 1.1,
         "speculative draft: best vs best": 1.1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--draft", default="tiny-draft")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gammas", default="1,2,4,8")
    parser.add_argument("--settings", default=None, help="comma-separated subset of: greedy, sampling, beam, "
                        "speculative, prompt-lookup")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = parse_settings(args.settings)
    lm = load_model(args.model, device=args.device)
    draft = load_model(args.draft, device=str(lm.device)).model if "speculative" in settings else None
    prompt_ids = lm.encode(args.prompt)
    bench = Bench(lm.model, prompt_ids, args.tokens, settings, draft,
                  tuple(int(g) for g in args.gammas.split(",")))
    bench.time(args.rounds, on_round=lambda r: print(f"round {r + 1}/{args.rounds} done", flush=True))
    print(f"model {lm.name} (draft {args.draft}) on {lm.device}, torch threads {torch.get_num_threads()}, "
          f"prompt {len(prompt_ids)} tokens, {args.tokens} new tokens, median of {args.rounds} interleaved rounds")
    print("| setting | decodelab tok/s | generate tok/s | ratio (median, low-high) | goal |")
    print("|---|---:|---:|---|---|")
    for r in bench.rows():
        goal = f">= {GOALS[r.setting]}x" if r.setting in GOALS else ""
        note = f" ({r.note})" if r.note else ""
        print(f"| {r.setting}{note} | {r.decodelab_tokens_per_s:.1f} | {r.transformers_tokens_per_s:.1f} | "
              f"{r.ratio:.2f}x ({r.ratio_low:.2f}-{r.ratio_high:.2f}) | {goal} |")


if __name__ == "__main__":
    main()
