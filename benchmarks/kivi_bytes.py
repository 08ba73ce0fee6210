"""Real bytes of the KIVI caches (and 4-bit layouts beside them) against the float16 full cache, by context length.

The bundled model `tiny` (12 layers, 2 KV heads, head_dim 32) is fed the first T tokens of
presets/models/validation.txt (in chunks of 256; past its 512 trained positions the text is still fed, since bytes
do not depend on what the model makes of it), and the cache's stored tensors are counted: codes, every float16 scale
and zero point, and the exact window (`KVPolicy.nbytes()`, the storages the layers hold). The float16 full cache is
2 x layers x kv_heads x head_dim x 2 bytes a token.

Keys in the kivi layout follow KIVI's own rule (Algorithm 1 of Liu et al. 2024): the full-precision key tail is
quantized whole (per channel, in blocks of G = 32 tokens) each time it holds R = 32 tokens, so after T tokens
T - (T mod 32) keys are quantized and T mod 32 (0 to 31) are exact; values: the last 32 exact. The ratio is therefore
a sawtooth in T: lowest at T = 32k, highest at T = 32k + 31. The table gives each context, the worst length at or
below it (T = 32k + 31, where the key tail is full: 479 for 480), and the asymptote (codes + scales only). The row
with ``kivi_keys=window`` is the sliding key window decodelab kept before (the last 32 keys exact always, 32 to 63).

    python benchmarks/kivi_bytes.py [--contexts 480,512,1024,2048,4096] [--small]

--small: contexts 64,95 (checks that the script runs). Figures from this script do not depend on timing or load.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from decodelab.core.engine.models import bundled_dir, load_model
from decodelab.core.engine.runtime import Runtime
from decodelab.core.kv import parse_cache_spec

SPECS = {
    "int4-kivi": "int4-kivi",
    "int4-kivi, symmetric": "quant:bits=4,axis=kivi,residual=32,residual_dtype=16,symmetric=true",
    "int2-kivi": "int2-kivi",
    "int4-kivi, sliding key window": "quant:bits=4,axis=kivi,residual=32,residual_dtype=16,kivi_keys=window",
    "4-bit per token, groups of 32, symmetric (llama.cpp q4_0's bits)": "quant:bits=4,axis=group,group=32,symmetric=true",
}
# bits a value once every token is quantized: codes + 16-bit scale (+ 16-bit zero) per 32 values
ASYMPTOTE = {"int4-kivi": 5 / 16, "int4-kivi, symmetric": 4.5 / 16, "int2-kivi": 3 / 16,
             "int4-kivi, sliding key window": 5 / 16,
             "4-bit per token, groups of 32, symmetric (llama.cpp q4_0's bits)": 4.5 / 16}


def stored_bytes(model, spec: str, ids: list[int], chunk: int = 256) -> tuple[int, int]:
    """Feed ``ids`` through a cache of ``spec``; returns (the bytes it stores, its projection ``bytes_at``)."""
    rt = Runtime.create(model, parse_cache_spec(spec))
    with torch.no_grad():
        for a in range(0, len(ids), chunk):
            rt.feed(torch.tensor([ids[a: a + chunk]]))
    return rt.policy.nbytes(), rt.policy.bytes_at(len(ids))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="480,512,1024,2048,4096")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    contexts = [64, 95] if args.small else [int(c) for c in args.contexts.split(",")]
    torch.set_num_threads(args.threads)
    lm = load_model("tiny", device="cpu", dtype="float32")
    cfg = lm.model.config
    fp16_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    ids = lm.encode((bundled_dir("tiny").parent / "validation.txt").read_text(encoding="utf-8"))
    lengths = sorted({t for c in contexts for t in (c - (c - 31) % 32, c)})  # c and the worst length <= c
    rows = []
    print(f"tiny: float16 full cache {fp16_per_token} bytes a token; stored bytes / float16 full cache")
    print("| cache | " + " | ".join(f"T={t}" for t in lengths) + " | asymptote |")
    print("|---|" + "---:|" * (len(lengths) + 1))
    for label, spec in SPECS.items():
        ratios = []
        for t in lengths:
            real, projected = stored_bytes(lm.model, spec, ids[:t])
            assert real == projected, (spec, t, real, projected)  # the stored tensors, as the formula says
            ratios.append(real / (fp16_per_token * t))
            rows.append({"cache": label, "spec": spec, "tokens": t, "kv_bytes": real,
                         "fp16_full_bytes": fp16_per_token * t, "ratio": ratios[-1]})
        print(f"| `{spec}` | " + " | ".join(f"{r:.4f}" for r in ratios) + f" | {ASYMPTOTE[label]:.4f} |",
              flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
