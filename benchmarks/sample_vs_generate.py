"""Tokens/s of decodelab's decode loop against transformers `generate` and a bare forward loop, side by side.

Every variant decodes the same prompt for the same number of tokens on the same model; the variants run in
alternation, round after round, and the median of the rounds is reported, so slow drift of the machine affects
all of them alike. Ratios:

* trace on  / generate   (goal >= 1.3x): the full per-token trace (--top 5) against transformers' own loop;
* trace off / bare loop  (goal >= 0.85x): decodelab's loop without the trace against the fastest loop possible
  for that model (prefill, then forward + argmax per token, nothing else).

    python benchmarks/sample_vs_generate.py [--model tiny] [--tokens 128] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from decodelab.core.runtime import Runtime
from decodelab.core.decode import Sampler, StopRules, decode_tokens
from decodelab.core.model import forward, load_model
from decodelab.core.processors import build_chain
from decodelab.core.select import make_selector

PROMPT = "Once upon a time, in a land far away, there lived"


def bare_loop(model, ids: torch.Tensor, n: int) -> list[int]:
    """The floor: prefill, then one forward and an argmax per token."""
    cache = make_cache("full", model.config)
    logits = forward(model, ids, cache.model_cache)[:, -1]
    out = []
    for i in range(n):
        token = logits.argmax(dim=-1, keepdim=True)
        out.append(int(token))
        if i + 1 < n:
            logits = forward(model, token, cache.model_cache)[:, -1]
    return out


def variants(lm, prompt_ids: list[int], n: int) -> dict:
    model = lm.model
    ids = torch.tensor([prompt_ids], device=lm.device)
    rules = StopRules(n, ignore_eos=True)
    settings = {"greedy": ({"temperature": 0}, {"do_sample": False}),
                "top-p": ({"temperature": 0.8, "top-p": 0.9}, {"do_sample": True, "temperature": 0.8, "top_p": 0.9})}
    runs = {"bare loop (greedy)": lambda: bare_loop(model, ids, n)}
    for label, (stages, hf_kwargs) in settings.items():
        chain = build_chain(stages)
        temperature = stages["temperature"]

        def traced(chain=chain, t=temperature):
            sampler = Sampler(model, prompt_ids, chain, make_selector(t, 0, lm.device), rules, lm.token_text,
                              None, top=5)
            return [s.token_id for s in sampler]

        def untraced(chain=chain, t=temperature):
            return [d.token_id for d in decode_tokens(model, prompt_ids, chain, make_selector(t, 0, lm.device),
                                                      rules)]

        def generate(kw=hf_kwargs):
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, pad_token_id=0, **kw)
            return out[0, ids.shape[1]:].tolist()

        runs[f"generate ({label})"] = generate
        runs[f"decodelab trace on ({label})"] = traced
        runs[f"decodelab trace off ({label})"] = untraced
    return runs


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
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, device=args.device)
    prompt_ids = lm.encode(PROMPT)
    bare_ids = bare_loop(lm.model, torch.tensor([prompt_ids], device=lm.device), args.tokens)
    chain = build_chain({"temperature": 0})
    ours = [d.token_id for d in decode_tokens(lm.model, prompt_ids, chain, make_selector(0, 0, lm.device),
                                              StopRules(args.tokens, ignore_eos=True))]
    assert ours == bare_ids, "greedy decodelab and the bare loop disagree"
    tps = measure(variants(lm, prompt_ids, args.tokens), args.tokens, args.rounds)
    print(f"model {lm.name} on {lm.device} ({str(lm.dtype).replace('torch.', '')}), torch threads "
          f"{torch.get_num_threads()}, prompt {len(prompt_ids)} tokens, {args.tokens} new tokens, "
          f"median of {args.rounds} alternating rounds")
    width = max(map(len, tps))
    for name, value in tps.items():
        print(f"  {name:<{width}}  {value:8.1f} tok/s")
    print("ratios:")
    for label in ("greedy", "top-p"):
        on = tps[f"decodelab trace on ({label})"] / tps[f"generate ({label})"]
        print(f"  trace on  / generate ({label}):  {on:.2f}x   (goal >= 1.30x)")
    for label in ("greedy", "top-p"):
        off = tps[f"decodelab trace off ({label})"] / tps["bare loop (greedy)"]
        print(f"  trace off ({label}) / bare loop:  {off:.2f}x   (goal >= 0.85x)")
    print(f"  bare loop / generate (greedy):  {tps['bare loop (greedy)'] / tps['generate (greedy)']:.2f}x")


if __name__ == "__main__":
    main()
