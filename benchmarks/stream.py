"""Bounded KV caches on text far past the context: the StreamingLLM table, per-token latency and KV memory.

On the first --tokens (default 8192) tokens of presets/models/validation.txt (held-out documents, 41k tokens, so
nothing is repeated), for each bundled model:

* perplexity (raw model probabilities, every token after the first) of full, window keep/rerotate, sinks
  keep/rerotate, fed one token per forward (exact StreamingLLM; `full` in chunks of 256, which changes nothing
  for it), and of recompute (a fresh forward over the last W + 1 tokens: the same span a window of W attends to)
  on every --stride-th token (recompute costs W + 1 token-forwards per scored token); the other policies are also
  reported on that same subsample, so the recompute comparison is like for like;
* perplexity over position (spans of 512 tokens): where full collapses past the trained context;
* per-token latency at token ~8k against token ~512: two runtimes of the same policy, one at each length, fed one
  token in turn for --rounds rounds (interleaved), medians; goal <= 1.2x for window and sinks;
* KV bytes (real tensor bytes) at 512 and at the end, and the peak over the run: flat for bounded policies.

Goal: sinks/rerotate perplexity within 10% of recompute's on the same tokens.

    python benchmarks/stream.py [--models tiny,tiny-draft] [--tokens 8192] [--window 256] [--sinks 4]
                                [--stride 16] [--rounds 64] [--threads 1] [--out stream.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from decodelab.core.kv import parse_cache_spec
from decodelab.core.engine.models import bundled_dir, load_model
from decodelab.core.engine.runtime import Runtime

SPAN = 512


def policies(w: int, s: int) -> dict[str, str]:
    return {
        "full": "full",
        "window keep": f"window:size={w},positions=keep",
        "window rerotate": f"window:size={w},positions=rerotate",
        "sinks keep": f"sinks:sinks={s},recent={w - s},positions=keep",
        "sinks rerotate": f"sinks:sinks={s},recent={w - s},positions=rerotate",
    }


def token_nlls(model, spec: str, ids: torch.Tensor, chunk: int):
    """-log p(x_t | kept context) for t = 1..n-1, the peak KV bytes, the bytes at 512 tokens, and the runtime."""
    rt = Runtime.create(model, parse_cache_spec(spec))
    nll = torch.empty(ids.shape[1] - 1)
    prev, peak, at_512 = None, 0, None
    for start in range(0, ids.shape[1], chunk):
        piece = ids[:, start : start + chunk]
        logits = rt.feed(piece, keep="all")[0]
        logp = torch.log_softmax(logits, dim=-1)
        if prev is not None:
            nll[start - 1] = -prev[piece[0, 0]]
        inner = -logp[:-1].gather(1, piece[0, 1:].view(-1, 1)).view(-1)
        nll[start : start + inner.numel()] = inner
        prev = logp[-1]
        peak = max(peak, rt.policy.nbytes())
        if at_512 is None and rt.seen >= SPAN:
            at_512 = rt.policy.nbytes()
    return nll, peak, at_512, rt


def recompute_nlls(model, w: int, ids: torch.Tensor, stride: int) -> tuple[dict[int, float], Runtime]:
    """recompute:size=w+1 scored on tokens t = stride, 2 stride, ...: feed chunks of stride tokens and keep only the
    last logits (one fresh forward over the last w + 1 tokens per chunk)."""
    rt = Runtime.create(model, parse_cache_spec(f"recompute:size={w + 1}"))
    out = {}
    for start in range(0, ids.shape[1] - 1, stride):
        end = min(start + stride, ids.shape[1] - 1)
        logits = rt.feed(ids[:, start:end], keep="last")[0]
        out[end] = float(-torch.log_softmax(logits, dim=-1)[ids[0, end]])  # predicts x_end (index end - 1 of nll)
    return out, rt


def ppl(values) -> float:
    values = list(values)
    return math.exp(sum(values) / len(values))


def latency(model, spec: str, ids: torch.Tensor, far: Runtime, rounds: int) -> tuple[float, float]:
    """Median seconds of a one-token forward at ~512 tokens and at the far runtime's length, interleaved."""
    near = Runtime.create(model, parse_cache_spec(spec))
    near.feed(ids[:, :SPAN])
    token = ids[:, SPAN : SPAN + 1]
    a, b = [], []
    for _ in range(rounds):
        for rt, times in ((near, a), (far, b)):
            t0 = time.perf_counter()
            rt.feed(token, keep="last")
            times.append(time.perf_counter() - t0)
    return statistics.median(a), statistics.median(b)


def run_model(name: str, args, text: str, log) -> dict:
    lm = load_model(name, device="cpu")
    ids = torch.tensor([lm.encode(text)[: args.tokens]])
    n = ids.shape[1]
    if n < args.tokens:
        raise SystemExit(f"validation.txt has only {n} tokens for {name}")
    rows = {}
    rec, rec_rt = recompute_nlls(lm.model, args.window, ids, args.stride)
    sample = sorted(rec)  # token indices scored by recompute
    t0 = time.perf_counter()
    rec_lat = latency(lm.model, f"recompute:size={args.window + 1}", ids, rec_rt, args.rounds)
    rows["recompute"] = {"spec": f"recompute:size={args.window + 1}", "ppl_sample": ppl(rec.values()),
                         "latency_512_ms": 1e3 * rec_lat[0], "latency_far_ms": 1e3 * rec_lat[1],
                         "kv_peak": 0, "kv_512": 0, "kv_end": 0}
    log(f"{name} recompute: ppl on every {args.stride}th token {rows['recompute']['ppl_sample']:.2f} "
        f"({time.perf_counter() - t0:.0f}s latency)")
    for label, spec in policies(args.window, args.sinks).items():
        t0 = time.perf_counter()
        nll, peak, at_512, rt = token_nlls(lm.model, spec, ids, 256 if label == "full" else 1)
        spent = time.perf_counter() - t0
        lat = latency(lm.model, spec, ids, rt, args.rounds)
        spans = [ppl(nll[i : i + SPAN].tolist()) for i in range(0, nll.numel(), SPAN)]
        rows[label] = {"spec": spec, "ppl": ppl(nll.tolist()), "ppl_first_512": ppl(nll[: SPAN - 1].tolist()),
                       "ppl_after_512": ppl(nll[SPAN - 1 :].tolist()),
                       "ppl_sample": ppl(nll[t - 1].item() for t in sample), "ppl_spans": spans,
                       "latency_512_ms": 1e3 * lat[0], "latency_far_ms": 1e3 * lat[1],
                       "kv_peak": peak, "kv_512": at_512, "kv_end": rt.policy.nbytes(), "seconds": spent}
        log(f"{name} {label}: ppl {rows[label]['ppl']:.2f} (after 512: {rows[label]['ppl_after_512']:.2f}), "
            f"latency {lat[0] * 1e3:.2f} -> {lat[1] * 1e3:.2f} ms, peak KV {peak} B, {spent:.0f}s")
    return {"model": name, "tokens": n, "window": args.window, "sinks": args.sinks, "stride": args.stride,
            "rows": rows}


def table(result: dict) -> str:
    rec = result["rows"]["recompute"]["ppl_sample"]
    lines = [f"**{result['model']}**, {result['tokens']} tokens, cache {result['window']} tokens "
             f"(sinks {result['sinks']} + recent {result['window'] - result['sinks']}):", "",
             "| policy | ppl (all) | ppl tokens 1-511 | ppl after 512 | ppl every "
             f"{result['stride']}th token | vs recompute | latency @512 / @{result['tokens']} (ms) | ratio | "
             "KV bytes @512 / end / peak |", "|---|---:|---:|---:|---:|---:|---|---:|---|"]
    for label, r in result["rows"].items():
        ratio = r["latency_far_ms"] / r["latency_512_ms"]
        cells = ["-", "-", "-"] if "ppl" not in r else [f"{r['ppl']:.2f}", f"{r['ppl_first_512']:.2f}",
                                                         f"{r['ppl_after_512']:.2f}"]
        lines.append(f"| {label} (`{r['spec']}`) | " + " | ".join(cells) + f" | {r['ppl_sample']:.2f} | "
                     f"{r['ppl_sample'] / rec:.3f}x | {r['latency_512_ms']:.2f} / {r['latency_far_ms']:.2f} | "
                     f"{ratio:.2f}x | {r['kv_512']:,} / {r['kv_end']:,} / {r['kv_peak']:,} |")
    spans = {label: r["ppl_spans"] for label, r in result["rows"].items() if "ppl_spans" in r}
    lines += ["", "perplexity per span of 512 tokens:", "",
              "| span | " + " | ".join(spans) + " |", "|---|" + "---:|" * len(spans)]
    for i in range(len(next(iter(spans.values())))):
        lines.append(f"| {i * SPAN + 1}-{(i + 1) * SPAN} | " + " | ".join(f"{s[i]:.1f}" for s in spans.values())
                     + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,tiny-draft")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--stride", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    text = (bundled_dir("tiny").parent / "validation.txt").read_text()

    def log(msg: str) -> None:
        print(msg, flush=True)

    results = []
    for name in args.models.split(","):
        results.append(run_model(name, args, text, log))
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
    for result in results:
        print()
        print(table(result))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
