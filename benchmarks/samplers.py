"""Tokens/s of sampled decoding with `--semantics hf` against transformers `generate(do_sample=True)`, and what the
new stages cost, side by side in one run.

Variants (the same prompt, the same number of tokens, EOS banned by min_new_tokens in both engines):

* ``generate``: ``torch.manual_seed(s); generate(do_sample=True, temperature=0.8, top_p=0.95,
  repetition_penalty=1.2)`` (transformers adds top_k=50 itself), the reference;
* decodelab ``--semantics hf`` with the same settings, trace off and on; the tokens are checked equal to
  ``generate``'s first (same seed, same draws), so both do the same work;
* decodelab, the same sampled chain in decodelab's own reading (exponential-race selector), trace off;
* decodelab with the new stages, llama.cpp style (penalties over the last 64 tokens with frequency and presence,
  DRY, min-p, XTC, temperature), trace off and on: the price of DRY's host-side scan and XTC's sort.

Variants alternate round after round; medians are reported.

    python benchmarks/samplers.py [--model tiny] [--tokens 128] [--rounds 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from decodelab.core.methods.sample import build_sampler
from decodelab.core.sampling.chain import make_chain
from decodelab.core.methods.sample import SampleSettings, validate_sample
from decodelab.core.engine.models import load_model

PROMPT = "Once upon a time, in a land far away, there lived"
HF = dict(temperature=0.8, top_p=0.95, repetition_penalty=1.2)
NEW_STAGES = dict(semantics="llamacpp", temperature=0.8, top_k=0, top_p=1.0, min_p=0.05, repetition_penalty=1.1,
                  frequency_penalty=0.1, presence_penalty=0.1, penalty_last_n=64, dry_multiplier=0.8,
                  xtc_probability=0.5, xtc_threshold=0.1)


def decodelab_run(lm, prompt_ids, settings: SampleSettings, traced: bool, chain=None):
    """Built by core.build as the CLI builds it (semantics plan, selector, chain, stop rules). ``chain``: built once
    outside the timed runs (resolving DRY's breakers scans the vocabulary: setup, not per-token cost); the plan's
    selector gets a fresh generator every run, and the chain is reset by the run."""
    sampler = build_sampler(lm, settings, prompt_ids, chain=chain, record=traced)
    for _ in sampler:
        pass
    return sampler.new_ids


def variants(lm, prompt_ids: list[int], n: int, seed: int) -> dict:
    ids = torch.tensor([prompt_ids], device=lm.device)
    hf = SampleSettings(semantics="hf", min_new_tokens=n, max_new_tokens=n, seed=seed, **HF)
    native = SampleSettings(min_new_tokens=n, max_new_tokens=n, seed=seed, top_k=50, **HF)
    new = SampleSettings(min_new_tokens=n, max_new_tokens=n, seed=seed, **NEW_STAGES)
    for s in (hf, native, new):
        validate_sample(s)
    native_chain, new_chain = make_chain(lm, native), make_chain(lm, new)

    def generate():
        torch.manual_seed(seed)
        out = lm.model.generate(ids, do_sample=True, max_new_tokens=n, min_new_tokens=n, pad_token_id=0, **HF)
        return out[0, ids.shape[1]:].tolist()

    return {
        "generate(do_sample=True)": generate,
        "decodelab --semantics hf, trace off": lambda: decodelab_run(lm, prompt_ids, hf, False),
        "decodelab --semantics hf, trace on": lambda: decodelab_run(lm, prompt_ids, hf, True),
        "decodelab native race, trace off": lambda: decodelab_run(lm, prompt_ids, native, False, native_chain),
        "new stages (DRY, XTC, penalties), trace off": lambda: decodelab_run(lm, prompt_ids, new, False, new_chain),
        "new stages (DRY, XTC, penalties), trace on": lambda: decodelab_run(lm, prompt_ids, new, True, new_chain),
    }


def measure(runs: dict, n: int, rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():  # warm-up
        fn()
    for _ in range(rounds):
        for name, fn in runs.items():
            start = time.perf_counter()
            produced = fn()
            times[name].append(time.perf_counter() - start)
            assert len(produced) == n, (name, len(produced))
    return {name: n / statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, device=args.device)
    prompt_ids = lm.encode(PROMPT)
    runs = variants(lm, prompt_ids, args.tokens, args.seed)
    same = runs["generate(do_sample=True)"]() == runs["decodelab --semantics hf, trace off"]()
    assert same, "--semantics hf did not draw generate's tokens"
    tps = measure(runs, args.tokens, args.rounds)
    print(f"model {lm.name} on {lm.device} ({str(lm.dtype).replace('torch.', '')}), torch threads "
          f"{torch.get_num_threads()}, prompt {len(prompt_ids)} tokens, {args.tokens} new tokens, seed {args.seed}, "
          f"median of {args.rounds} alternating rounds; --semantics hf drew generate's tokens: {same}")
    ref = tps["generate(do_sample=True)"]
    width = max(map(len, tps))
    for name, value in tps.items():
        print(f"  {name:<{width}}  {value:8.1f} tok/s  {value / ref:5.2f}x generate")
    base = tps["decodelab native race, trace off"]
    print(f"  new stages / plain sampled chain (trace off): "
          f"{tps['new stages (DRY, XTC, penalties), trace off'] / base:.2f}x")


if __name__ == "__main__":
    main()
