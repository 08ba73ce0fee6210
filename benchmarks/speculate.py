"""Speculative decoding: predicted against measured speedup over plain target decoding, per gamma, in one run.

For each proposer and gamma the plain loop (``decode_tokens``, same chain, same length) and the speculative loop
run in alternation, ``--rounds`` times (plain first in odd rounds, speculative first in even ones), so slow drift
of a shared machine hits both:

* measured speedup = plain time per token / speculative time per token (decode phase: prefill excluded from both;
  the speculative time covers drafting, the block verification, rollback and the stop checks), one ratio per
  round; reported: the median of the per-round ratios and their min-max (``median_spread``, as ``decodelab
  speculate --speedup-rounds`` reports it);
* cost ratio c = drafting time per drafted token / plain time per token (the same runs);
* a = accepted drafts / drafts judged (a round judges its drafts up to the first rejection);
* predicted speedup = (1 - a^(g+1)) / ((1 - a)(g c + 1)). Two assumptions behind it are shown side by side:
  - every draft is accepted independently with probability a, so E(a, g) = (1 - a^(g+1)) / (1 - a) tokens per
    round (compare tok/call: bursty acceptance, all of a round or nothing, as with prompt lookup on repeated text,
    gives fewer);
  - a verification forward over g+1 positions costs one plain step: v = verification time per round / plain step
    shows how far that holds (on CPU the block's extra rows are not free); "pred. with v" puts v in place of 1.

Goals: measured >= 0.8x predicted; a real speedup (> 1.0x) for the n-gram proposer on repetitive text and for the
bundled pair at its best gamma.

    python benchmarks/speculate.py [--tokens 128] [--gammas 1,2,3,4,6,8] [--rounds 3] [--prompts 4]
                                   [--temperature 0] [--threads 1] [--json PATH]

The draft-model rows decode --prompts passages of the bundled models' held-out text (presets/models/validation.txt:
the kind of text the pair was trained on); the n-gram rows decode a repetitive prompt. Every figure sums over the
prompts of a round before the median over rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from decodelab.core.engine.stopping import StopRules
from decodelab.core.engine.models import bundled_dir, load_model
from decodelab.core.sampling.chain import build_chain
from decodelab.core.sampling.select import make_generator, make_selector
from decodelab.core.sampling.semantics import plan
from decodelab.core.sampling.settings import ChainSettings
from decodelab.core.methods.speculative.proposers import ModelProposer, NGramProposer, make_selector_for
from decodelab.core.methods.speculative.run import Speculator
from decodelab.core.methods.speculative.rule import expected_tokens, predicted_speedup
from decodelab.core.methods.speculative.timing import median_spread, time_plain_decoding

STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
REPETITIVE = ("The quick brown fox jumps over the lazy dog. " * 6).strip()


def held_out_prompts(count: int, chars: int = 200) -> list[str]:
    """Passages of the bundled models' held-out text (validation.txt), evenly spaced, cut at spaces: text of the
    kind the pair was trained on, none of it seen in training. Falls back to one story prompt."""
    path = bundled_dir("tiny").parent / "validation.txt"
    if not path.exists():
        return [STORY]
    text = path.read_text(encoding="utf-8")
    out = []
    for i in range(count):
        start = text.find(" ", (i + 1) * len(text) // (count + 1)) + 1
        out.append(text[start : text.rfind(" ", start, start + chars)])
    return out


def one_pair(target, proposer_factory, prompts, chain, temperature, n, gamma, ctx, plain_first=True):
    """Per prompt one plain run and one speculative run (in that order, or the other); returns their summed times
    and counts."""
    selector = plan(ChainSettings(temperature=temperature)).selector  # the plan says greedy or not
    greedy = selector == "greedy"
    total = dict.fromkeys(("plain", "plain_tokens", "spec", "draft", "verify", "accepted", "judged", "drafted",
                           "rounds", "tokens"), 0.0)
    device = next(target.parameters()).device
    for prompt_ids in prompts:
        plain = lambda: time_plain_decoding(target, prompt_ids, chain, make_selector(selector, 0, device), n,  # noqa: E731
                                            ctx)
        base = plain() if plain_first else None
        gen = None if greedy else make_generator(0, device)
        sp = Speculator(target, proposer_factory(make_selector_for(greedy, gen)), prompt_ids, chain,
                        StopRules(n, ignore_eos=True, context_length=ctx), gamma, gen, record=False)
        for _ in sp:
            pass
        base = base or plain()
        s = sp.stats
        for key, value in (("plain", base.decode_seconds), ("plain_tokens", base.tokens - 1),
                           ("spec", sp.watch.timing.loop_s), ("draft", s.draft_seconds), ("verify", s.target_seconds),
                           ("accepted", s.accepted), ("judged", s.judged), ("drafted", s.drafted),
                           ("rounds", s.rounds), ("tokens", len(s.new_ids))):
            total[key] += value
    return {
        "plain_step": total["plain"] / total["plain_tokens"],
        "spec_token": total["spec"] / total["tokens"],
        "draft_step": total["draft"] / total["drafted"] if total["drafted"] else 0.0,
        "verify_step": total["verify"] / total["rounds"],
        **{k: total[k] for k in ("accepted", "judged", "drafted", "rounds", "tokens")},
    }


def measure(label, target, proposer_factory, prompts, chain, temperature, n, gammas, rounds, ctx):
    rows = []
    one_pair(target, proposer_factory, prompts[:1], chain, temperature, min(n, 16), 2, ctx)  # warm-up
    for g in gammas:
        runs = [one_pair(target, proposer_factory, prompts, chain, temperature, n, g, ctx, plain_first=i % 2 == 0)
                for i in range(rounds)]
        plain = statistics.median(r["plain_step"] for r in runs)
        spec = statistics.median(r["spec_token"] for r in runs)
        draft = statistics.median(r["draft_step"] for r in runs)
        verify = statistics.median(r["verify_step"] for r in runs)
        accepted, judged = sum(r["accepted"] for r in runs), sum(r["judged"] for r in runs)
        a = accepted / judged if judged else 0.0
        c, v = draft / plain, verify / plain
        predicted = predicted_speedup(a, c, g)
        measured, low, high, _ = median_spread([r["plain_step"] / r["spec_token"] for r in runs])
        rows.append({
            "proposer": label, "gamma": g, "acceptance_rate": a,
            "mean_accepted": accepted / sum(r["rounds"] for r in runs),
            "mean_drafted": sum(r["drafted"] for r in runs) / sum(r["rounds"] for r in runs),
            "tokens_per_target_call": sum(r["tokens"] for r in runs) / sum(r["rounds"] for r in runs),
            "expected_tokens_per_round": expected_tokens(a, g),
            "plain_ms_per_token": plain * 1e3, "spec_ms_per_token": spec * 1e3, "cost_ratio": c,
            "verify_cost_ratio": v, "predicted_with_v": expected_tokens(a, g) / (g * c + v),
            "predicted_speedup": predicted, "measured_speedup": measured, "measured_speedup_min": low,
            "measured_speedup_max": high, "rounds": rounds, "measured_over_predicted": measured / predicted,
        })
        print(f"  {label:<24} g={g:<2} a={a:.3f} tok/call={rows[-1]['tokens_per_target_call']:.2f} c={c:.3f} "
              f"v={v:.2f} predicted={predicted:.2f}x measured={measured:.2f}x ({low:.2f}-{high:.2f}) "
              f"ratio={measured / predicted:.2f}",
              file=sys.stderr, flush=True)
    return rows


def table(rows) -> str:
    head = ("proposer", "g", "a", "acc/round", "tok/call", "E(a,g)", "c", "v", "plain ms/tok", "spec ms/tok",
            "predicted", "measured (min-max)", "meas/pred", "pred. with v")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(
            f"| {r['proposer']} | {r['gamma']} | {r['acceptance_rate']:.3f} | {r['mean_accepted']:.2f} | "
            f"{r['tokens_per_target_call']:.2f} | {r['expected_tokens_per_round']:.2f} | {r['cost_ratio']:.3f} | "
            f"{r['verify_cost_ratio']:.2f} | "
            f"{r['plain_ms_per_token']:.2f} | "
            f"{r['spec_ms_per_token']:.2f} | {r['predicted_speedup']:.2f}x | {r['measured_speedup']:.2f}x "
            f"({r['measured_speedup_min']:.2f}-{r['measured_speedup_max']:.2f}) | "
            f"{r['measured_over_predicted']:.2f} | {r['predicted_with_v']:.2f}x |")
    return "\n".join(lines)


def goals(rows) -> list[str]:
    """Per proposer: the worst measured/predicted ratio (goal >= 0.8) and the best measured speedup (goal > 1)."""
    out = []
    for label in dict.fromkeys(r["proposer"] for r in rows):
        mine = [r for r in rows if r["proposer"] == label]
        worst = min(mine, key=lambda r: r["measured_over_predicted"])
        best = max(mine, key=lambda r: r["measured_speedup"])
        ratio = worst["measured_over_predicted"]
        speedup = best["measured_speedup"]
        out.append(f"{label}: measured >= 0.8x predicted: worst {ratio:.2f} at g={worst['gamma']} -> "
                   f"{'met' if ratio >= 0.8 else 'MISSED'}; best gamma {best['gamma']}, measured {speedup:.2f}x "
                   f"-> {'real speedup' if speedup > 1.0 else 'NO speedup'}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--gammas", default="1,2,3,4,6,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: stable timings on a shared machine)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy verification (default)")
    ap.add_argument("--model", default="tiny", help="the target (bundled name or folder)")
    ap.add_argument("--draft", default="tiny-draft", help="the draft model (same tokenizer)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--ngram-size", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4, help="held-out passages for the draft-model rows")
    ap.add_argument("--only", choices=("draft", "ngram"), default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gammas = [int(g) for g in args.gammas.split(",")]
    stages = {"temperature": args.temperature}
    chain = build_chain(stages)
    rows = []
    tiny = load_model(args.model, device=args.device)
    target, tok, ctx, name = tiny.model, tiny.tokenizer, tiny.context_length, tiny.name
    draft = load_model(args.draft, device=str(tiny.device))
    print(f"target {name}, {args.tokens} tokens, temperature {args.temperature}, threads {args.threads}, "
          f"rounds {args.rounds}", file=sys.stderr)
    if args.only in (None, "draft"):
        texts = held_out_prompts(args.prompts)
        prompts = [list(tok.encode(t)) for t in texts]
        factory = lambda sel: ModelProposer(draft.model, chain, sel, draft.name, draft.context_length)  # noqa: E731
        label = f"{name} <- {draft.name} ({len(prompts)} held-out)" if len(texts) > 1 else f"{name} <- {draft.name}"
        rows += measure(label, target, factory, prompts, chain, args.temperature, args.tokens, gammas,
                        args.rounds, ctx)
    if args.only in (None, "ngram"):
        ids = list(tok.encode(REPETITIVE))
        factory = lambda sel: NGramProposer(args.ngram_size)  # noqa: E731
        rows += measure(f"{name} <- ngram-{args.ngram_size} (repetitive)", target, factory, [ids], chain,
                        args.temperature, args.tokens, gammas, args.rounds, ctx)
    print(table(rows))
    for line in goals(rows):
        print(line)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    start = time.perf_counter()
    code = main()
    print(f"({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    sys.exit(code)
