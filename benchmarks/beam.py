"""Tokens/s of decodelab's beam search against transformers `generate(num_beams=...)`, side by side in one run.

Both decode the same prompt with the same settings (beams, length penalty, early stopping, new tokens) on the
same model; the variants alternate round after round and the median of the rounds is reported. Before timing, the
hypotheses of both are checked equal (token ids, and scores to 1e-4), so both do the same search.

tokens/s = steps * beams / seconds: the beam tokens the model scored (prefill included in the time). By default
EOS is banned for both (transformers: min_new_tokens = n; decodelab: a -inf logit bias on EOS), so every run is
exactly n steps; --allow-eos lets hypotheses finish (the step count then comes from the search itself).

Goal: decodelab (trace off) / generate >= 1.2x on the bundled model on CPU. A third variant, the floor, replays the
same search's model work alone (prefill once, then per step the cache reorder and one forward of B rows), so the
report also shows how much of decodelab's time is the model's.

    python benchmarks/beam.py [--model tiny] [--beams 4] [--tokens 64] [--rounds 5] [--threads 1]

Without the bundled weights, a random Llama of the bundled model's shape is used (hidden 192, 12 layers, 6 heads,
2 KV heads, MLP 448, vocab 4096).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from decodelab.core.beam import BeamSearch, BeamSettings, ModelStepper
from decodelab.core.model import bundled_dir, load_model
from decodelab.core.processors import build_chain

PROMPT = "Once upon a time, in a land far away, there lived"
EARLY = {"true": True, "false": False, "never": "never"}


def random_tiny_shape():
    """A random Llama shaped like the bundled `tiny` (its tokenizer, if present, encodes the prompt)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=192, num_hidden_layers=12, num_attention_heads=6,
                      num_key_value_heads=2, intermediate_size=448, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def load(spec: str, device: str):
    """(model, prompt ids, eos id, name): the bundled/local model, or the random stand-in when weights are absent."""
    if spec == "tiny" and not (bundled_dir("tiny") / "model.safetensors").is_file():
        model = random_tiny_shape().to(device if device != "auto" else "cpu")
        tok_dir = bundled_dir("tiny")
        if (Path(tok_dir) / "tokenizer.json").is_file():
            from transformers import AutoTokenizer

            ids = AutoTokenizer.from_pretrained(tok_dir).encode(PROMPT)
        else:
            ids = list(range(5, 17))
        return model, ids, 0, "random Llama shaped like tiny (bundled weights absent)"
    lm = load_model(spec, device=device)
    return lm.model, lm.encode(PROMPT), lm.eos_ids[0], lm.name


def runs(model, prompt_ids, eos: int, s: BeamSettings, allow_eos: bool) -> dict:
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    mask = torch.ones_like(ids)
    chain = build_chain({} if allow_eos else {"bias": {eos: float("-inf")}})
    extra = {} if allow_eos else {"min_new_tokens": s.max_new_tokens}

    def generate():
        out = model.generate(ids, attention_mask=mask, num_beams=s.beams, num_return_sequences=s.returned,
                             length_penalty=s.length_penalty, early_stopping=s.early, do_sample=False,
                             max_new_tokens=s.max_new_tokens, eos_token_id=eos, pad_token_id=eos,
                             output_scores=True, return_dict_in_generate=True, **extra)
        return [(seq[len(prompt_ids):].tolist(), float(sc)) for seq, sc in zip(out.sequences, out.sequences_scores)]

    def ours(record: bool):
        search = BeamSearch(ModelStepper(model), prompt_ids, chain, s, (eos,), record=record)
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


def check_equal(fns: dict, eos: int) -> int:
    """Both searches return the same hypotheses; returns the step count (the same for both)."""
    ref = fns["generate"]()
    search = fns["decodelab (trace off)"]()
    for h, (seq, score) in zip(search.hypotheses, ref):
        assert h.token_ids == seq[: h.length] and all(t == eos for t in seq[h.length:]), "token ids differ"
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
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: a B-row decode step of a "
                        "small model is too small to split, and extra threads on a busy machine only wait; 0 = "
                        "torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, prompt_ids, eos, name = load(args.model, args.device)
    s = BeamSettings(beams=args.beams, num_return=1, length_penalty=args.length_penalty,
                     early_stopping=args.early_stopping, max_new_tokens=args.tokens)
    fns = runs(model, prompt_ids, eos, s, args.allow_eos)
    steps = check_equal(fns, eos)
    times = measure(fns, args.rounds)
    seconds = {name: statistics.median(ts) for name, ts in times.items()}
    fastest = {name: min(ts) for name, ts in times.items()}
    work = steps * args.beams
    print(f"model {name} on {next(model.parameters()).device}, torch threads {torch.get_num_threads()}, prompt "
          f"{len(prompt_ids)} tokens, beams {args.beams}, {steps} steps "
          f"({'EOS allowed' if args.allow_eos else 'EOS banned'}), length penalty {args.length_penalty:g}, early "
          f"stopping {args.early_stopping}, {args.rounds} alternating rounds; hypotheses checked equal")
    width = max(map(len, seconds))
    for label, sec in seconds.items():
        print(f"  {label:<{width}}  {work / sec:8.1f} beam tok/s median  ({sec * 1000:.1f} ms per search; "
              f"fastest {fastest[label] * 1000:.1f} ms)")
    for label in ("decodelab (trace off)", "decodelab (trace on)"):
        print(f"ratio {label} / generate: {seconds['generate'] / seconds[label]:.2f}x median, "
              f"{fastest['generate'] / fastest[label]:.2f}x fastest   (goal >= 1.20x)")
    floor = "floor (forwards + reorders only)"
    print(f"floor / decodelab (trace off): {seconds[floor] / seconds['decodelab (trace off)']:.2f}x median, "
          f"{fastest[floor] / fastest['decodelab (trace off)']:.2f}x fastest (1.00 = no time beyond the model's); "
          f"the best any loop could do against generate: {seconds['generate'] / seconds[floor]:.2f}x median")


if __name__ == "__main__":
    main()
