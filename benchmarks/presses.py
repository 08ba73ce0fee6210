"""Score-based KV compression on the bundled model: real bytes, damage against the full cache, and the retrieval
probe, per policy at three budgets.

On the first --tokens (default 512: the bundled models' whole context) tokens of presets/models/validation.txt
(held-out text), with `tiny` (float32, CPU):

* the text as a prompt and its continuation: the first half (--prompt tokens) in one forward, which a press
  compresses, then every later token one forward at a time (decoding), each scored from what the policy kept;
  KL(full || policy) and top-1 flips over those decoded tokens, against the full cache fed the same way (the prompt's
  own tokens are scored by the uncompressed prefill forward under every policy, so they are left out), and the
  perplexity of the decoded tokens;
* bytes: the most real bytes the cache held (keys, values, slot positions, per-slot scores; sampled every 32
  tokens), and their share of the full cache's;
* the retrieval probe (core/analysis/probe.py): a pass key planted at depths 0.1, 0.5, 0.9 of the text (fitted to
  the context), asked for after the compressed context; accuracy, mean log P(answer), and the share of needle
  entries each press kept. `tiny` copies nothing from its context (the full cache misses every key), so its probe
  judges no policy; the same probe is therefore also run on a Llama wired by hand to retrieve the digit in its
  context (tests/analysis/retrieval_model.py; keys "7 7 7 7", "3 3 3 3" in the text with its digits removed), where
  the full cache is right and each policy's accuracy means something.

Policies at each budget r (the kept fraction; --budgets, default 0.5,0.25,0.125): snapkv and pyramidkv (window=8,
kernel=5, compress once after the prompt; pyramidkv with beta=4: at the paper's beta=20 the last layer's budget
B/20 falls below the window at every budget here and pyramidkv falls back to snapkv's uniform budgets), h2o and tova (compress after every forward: at most r of the tokens
seen), knorm (after the prompt), and the place-based window and sinks holding r x prompt tokens (sinks: 4 + the
rest recent) for reference.

    python benchmarks/presses.py [--tokens 512] [--prompt 256] [--budgets 0.5,0.25,0.125] [--threads 1]
                                 [--out presses.json]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from decodelab.core.analysis.probe import Prober, ProbeSettings
from decodelab.core.engine.models import bundled_dir, load_model
from decodelab.core.kv import parse_cache_spec
from decodelab.core.methods.stream import StreamScore, StreamSettings
from decodelab.core.sampling.chain import build_chain

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "analysis"))
from retrieval_model import retrieval_model  # noqa: E402  (the hand-wired model lives with the tests)

DEPTHS = (0.1, 0.5, 0.9)


def policies(r: float, prompt: int) -> dict[str, str]:
    size = max(round(r * prompt), 8)
    return {
        "snapkv": f"snapkv:ratio={r},window=8,kernel=5",
        "pyramidkv": f"pyramidkv:ratio={r},window=8,kernel=5,beta=4",
        "h2o": f"h2o:ratio={r}",
        "tova": f"tova:ratio={r}",
        "knorm": f"knorm:ratio={r}",
        "window": f"window:size={size}",
        "sinks": f"sinks:sinks=4,recent={size - 4}",
    }


def damage(model, ids: list[int], spec: str, prompt: int) -> dict:
    """Prefill ``prompt`` tokens, then one token a forward, against the full cache in lockstep."""
    settings = StreamSettings(cache=spec, chunk=32, feed=1, prefill=prompt)
    run = StreamScore(model, ids, build_chain({}), str, settings, spec, against_full=True)
    start = time.perf_counter()
    for _ in run:
        pass
    seconds = time.perf_counter() - start
    decoded = [s for s in run.scorer.steps if s.position > prompt]
    summary = run.summary()
    exact = run.spec.name == "full"  # the reference itself
    return {"spec": str(run.spec), "kv_bytes_peak": summary.kv_bytes_peak,
            "kl_mean": 0.0 if exact else sum(s.kl for s in decoded) / len(decoded),
            "top1_flips": 0 if exact else sum(not s.agree for s in decoded),
            "decoded": len(decoded),
            "perplexity": math.exp(-sum(s.raw_logprob for s in decoded) / len(decoded)), "seconds": seconds}


def probe_rows(prober: Prober, specs: dict[str, str]) -> dict[str, dict]:
    out = {}
    for label, spec in specs.items():
        p = prober.policy(parse_cache_spec(spec), label)
        out[label] = {"accuracy": p.accuracy, "mean_logprob": p.mean_logprob, "needle_kept": p.needle_kept,
                      "right": p.right, "judged": p.judged}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--budgets", default="0.5,0.25,0.125")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    budgets = [float(b) for b in args.budgets.split(",")]
    lm = load_model("tiny", device="cpu", dtype="float32")
    text = (bundled_dir("tiny").parent / "validation.txt").read_text(encoding="utf-8")
    ids = lm.encode(text)[: args.tokens]
    full = damage(lm.model, ids, "full", args.prompt)
    tiny_probe = Prober(lm.model, lm.tokenizer, ids, ProbeSettings(depths=DEPTHS), lm.context_length)
    wired = retrieval_model(lm.tokenizer, lm.vocab_size)
    digitless = lm.tokenizer.encode(re.sub(r"[0-9]", "", lm.tokenizer.decode(ids)))
    wired_probe = Prober(wired, lm.tokenizer, digitless, ProbeSettings(keys=("7 7 7 7", "3 3 3 3"), depths=DEPTHS),
                         lm.context_length)
    report = {"tokens": len(ids), "prompt": args.prompt, "full": full,
              "tiny_probe_verdict": tiny_probe.report([]).verdict,
              "wired_probe_verdict": wired_probe.report([]).verdict, "rows": []}
    print(f"full: {full['kv_bytes_peak']:,} bytes, ppl {full['perplexity']:.2f} over {full['decoded']} decoded tokens")
    print(f"probe on tiny: {report['tiny_probe_verdict']}")
    print(f"probe on the wired model: {report['wired_probe_verdict']}")
    print("| budget | policy | KV bytes | x full | KL mean | top-1 flips | ppl | needle kept (tiny) | "
          "probe acc (wired) | needle kept (wired) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in budgets:
        specs = policies(r, args.prompt)
        tiny_rows, wired_rows = probe_rows(tiny_probe, specs), probe_rows(wired_probe, specs)
        for label, spec in specs.items():
            row = {"budget": r, "policy": label, **damage(lm.model, ids, spec, args.prompt),
                   "tiny_probe": tiny_rows[label], "wired_probe": wired_rows[label]}
            row["bytes_ratio"] = row["kv_bytes_peak"] / full["kv_bytes_peak"]
            report["rows"].append(row)
            share = lambda x: "-" if x is None else f"{x:.0%}"  # noqa: E731
            print(f"| {r:g} | `{spec}` | {row['kv_bytes_peak']:,} | {row['bytes_ratio']:.2f} | {row['kl_mean']:.4f} | "
                  f"{row['top1_flips']} / {row['decoded']} | {row['perplexity']:.2f} | "
                  f"{share(tiny_rows[label]['needle_kept'])} | {share(wired_rows[label]['accuracy'])} | "
                  f"{share(wired_rows[label]['needle_kept'])} |", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, default=lambda o: asdict(o)))


if __name__ == "__main__":
    main()
