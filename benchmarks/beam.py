"""Tokens/s of decodelab's beam search against transformers `generate(num_beams=...)`, side by side in one run.

Both decode the same prompt with the same settings (beams, length penalty, early stopping, new tokens) on the
same model; the variants alternate round after round and the median of the rounds is reported. Before timing, the
hypotheses of both are checked equal (token ids, and scores to 1e-4), so both do the same search.

tokens/s = steps * beams / seconds: the beam tokens the model scored (prefill included in the time). By default
EOS is ignored by both (transformers: eos_token_id=None, which adds nothing to its loop, unlike min_new_tokens;
decodelab: --ignore-eos), so every run is exactly n steps; --allow-eos lets hypotheses finish (the step count then
comes from the search itself).

Goal: decodelab / generate >= 1.1x on the bundled model on CPU. A third variant, the floor, replays the
same search's model work alone (prefill once, then per step the cache reorder and one forward of B rows), so the
report also shows how much of decodelab's time is the model's.

    python benchmarks/beam.py [--model tiny] [--beams 4] [--tokens 64] [--rounds 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from decodelab.core.methods.beam import BeamSettings, ModelStepper
from decodelab.core.methods.beam import build_beam
from decodelab.core.engine.models import load_model

PROMPT = "Once upon a time, in a land far away, there lived"
EARLY = {"true": True, "false": False, "never": "never"}


def runs(lm, prompt_ids, s: BeamSettings) -> dict:
    model, device = lm.model, lm.device
    ids = torch.tensor([prompt_ids], device=device)
    mask = torch.ones_like(ids)
    eos = () if s.ignore_eos else tuple(lm.eos_ids)

    def generate():
        out = model.generate(ids, attention_mask=mask, num_beams=s.beams, num_return_sequences=s.returned,
                             length_penalty=s.length_penalty, early_stopping=s.early, do_sample=False,
                             max_new_tokens=s.max_new_tokens, eos_token_id=list(eos) or None, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
        return [(seq[len(prompt_ids):].tolist(), float(sc)) for seq, sc in zip(out.sequences, out.sequences_scores)]

    def ours(record: bool):
        search = build_beam(lm, s, prompt_ids, record=record)
        search.run()
        return search

    recorded = ours(True)
    moves = [([b.parent for b in step.beams], [b.token_ids[-1] for b in step.beams]) for step in recorded.steps]

    def floor():
        """The model work alone: the same prefill, then per step the same cache reorder and B-row forward."""
        stepper = ModelStepper(model)
        stepper.start(prompt_ids)
        for parents, tokens in moves[:-1]:
            stepper.advance(parents, torch.tensor(parents, device=device), torch.tensor(tokens, device=device))

    return {"generate": generate, "decodelab (trace off)": lambda: ours(False),
            "decodelab (trace on)": lambda: ours(True), "floor (forwards + reorders only)": floor}


def check_equal(fns: dict, pad: int = 0) -> int:
    """Both searches return the same hypotheses; returns the step count (the same for both)."""
    ref = fns["generate"]()
    search = fns["decodelab (trace off)"]()
    for h, (seq, score) in zip(search.hypotheses, ref):
        assert h.token_ids == seq[: h.length] and all(t == pad for t in seq[h.length:]), "token ids differ"
        assert abs(h.score - score) < 1e-4, f"scores differ: {h.score} vs {score}"
    return search.n_steps


def measure(fns: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds per variant and round, variants alternating within each round (after one warm-up round), so drift
    of a shared machine falls on all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:  # the order rotates round by round
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--length-penalty", type=float, default=1.0)
    parser.add_argument("--early-stopping", default="false", choices=list(EARLY))
    parser.add_argument("--allow-eos", action="store_true", help="let hypotheses finish at EOS")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: a B-row decode step of a "
                        "small model is too small to split, and extra threads on a busy machine only wait; 0 = "
                        "torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, device=args.device)
    model, prompt_ids, name = lm.model, lm.encode(PROMPT), lm.name
    s = BeamSettings(beams=args.beams, num_return=1, length_penalty=args.length_penalty,
                     early_stopping=args.early_stopping, max_new_tokens=args.tokens, ignore_eos=not args.allow_eos)
    fns = runs(lm, prompt_ids, s)
    steps = check_equal(fns)
    times = measure(fns, args.rounds)
    seconds = {name: statistics.median(ts) for name, ts in times.items()}
    fastest = {name: min(ts) for name, ts in times.items()}
    work = steps * args.beams
    print(f"model {name} on {next(model.parameters()).device}, torch threads {torch.get_num_threads()}, prompt "
          f"{len(prompt_ids)} tokens, beams {args.beams}, {steps} steps "
          f"({'EOS allowed' if args.allow_eos else 'EOS ignored'}), length penalty {args.length_penalty:g}, early "
          f"stopping {args.early_stopping}, {args.rounds} alternating rounds; hypotheses checked equal")
    width = max(map(len, seconds))
    for label, sec in seconds.items():
        print(f"  {label:<{width}}  {work / sec:8.1f} beam tok/s median  ({sec * 1000:.1f} ms per search; "
              f"fastest {fastest[label] * 1000:.1f} ms)")
    for label in ("decodelab (trace off)", "decodelab (trace on)"):
        print(f"ratio {label} / generate: {seconds['generate'] / seconds[label]:.2f}x median, "
              f"{fastest['generate'] / fastest[label]:.2f}x fastest   (goal >= 1.10x)")
    floor = "floor (forwards + reorders only)"
    print(f"floor / decodelab (trace off): {seconds[floor] / seconds['decodelab (trace off)']:.2f}x median, "
          f"{fastest[floor] / fastest['decodelab (trace off)']:.2f}x fastest (1.00 = no time beyond the model's); "
          f"the best any loop could do against generate: {seconds['generate'] / seconds[floor]:.2f}x median")


if __name__ == "__main__":
    main()
