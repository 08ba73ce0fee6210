"""Quantized KV caches on the bundled model: real bytes and fidelity over a long held-out text, beside transformers'
own quantized cache (the peer) on the same text when its backend is installed.

For each passage (consecutive windows of ``--tokens`` tokens of presets/models/validation.txt, text the bundled
models never trained on) and each cache, the passage is scored teacher-forced by ``decodelab.core.score`` under
the quantized cache against the same model under the full cache, ``--feed`` tokens a forward (1: every token reads
every earlier token from the cache, as in decoding):

* bytes: the real bytes of the cache holding a whole passage (codes, scales, zero points, the exact window);
  ratio against float16 keys and values of the same tokens (2 x layers x kv_heads x head_dim x 2 bytes a token);
* KL(full || quantized) per token (mean), top-1 agreement, perplexity of both (over all passages' tokens).

Goals (issue #10): int8 per token <= 0.55x the fp16 bytes with perplexity within 1%; 4-bit kivi (group 32, residual
32) <= 0.35x within 5%; 2-bit kivi <= 0.25x (perplexity reported).

The peer: transformers' ``QuantizedCache`` (``--peer quanto`` needs optimum-quanto, ``hqq`` needs hqq; ``auto`` takes
the first one installed; both quantize keys and values per token in groups of ``q_group_size`` channels, and keep a
full-precision residual of up to ``residual_length`` tokens that is flushed into the quantized part when full). It
enters the same scorer as a cache policy registered by this script (``hf-quantized``); its bytes are those of the
backend's stored tensors, walked the same way.

    python benchmarks/quantize_kv.py [--tokens 512] [--passages 3] [--dtypes bfloat16,float32] [--feed 1]
                                     [--peer auto|quanto|hqq|none] [--threads 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import torch

from decodelab.core.kv import KVPolicy, ModelInfo, parse_cache_spec, register
from decodelab.core.kv.protocol import choice, non_negative_int, positive_int
from decodelab.core.engine.models import load_model
from decodelab.core.engine.forward import model_info
from decodelab.core.analysis.quantize_kv import fidelity

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "presets" / "models" / "validation.txt"
OURS = ["int8", "int4-kivi", "quant:bits=4,axis=kivi,symmetric=true", "int2-kivi"]
GOALS = {"int8": (0.55, 0.01), "int4-kivi": (0.35, 0.05), "quant:bits=4,axis=kivi,symmetric=true": (0.35, 0.05),
         "int2-kivi": (0.25, None)}


# --- the peer: transformers' QuantizedCache as a decodelab cache policy ----------------------------------------------


def walk_bytes(obj, seen=None) -> int:
    """Bytes of every plain tensor reachable from ``obj`` (tensor subclasses such as quanto's packed tensors are
    walked into; storages counted once)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor) and type(obj) is torch.Tensor:
        key = ("storage", obj.untyped_storage().data_ptr())
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, (list, tuple)):
        return sum(walk_bytes(o, seen) for o in obj)
    if isinstance(obj, dict):
        return sum(walk_bytes(o, seen) for o in obj.values())
    if hasattr(obj, "__dict__") and (isinstance(obj, torch.Tensor) or type(obj).__module__.split(".")[0] in
                                     ("optimum", "hqq", "transformers")):
        return sum(walk_bytes(o, seen) for o in vars(obj).values())
    return 0


@register
class HFQuantizedPolicy(KVPolicy):
    name = "hf-quantized"
    capabilities = frozenset()
    summary = "transformers QuantizedCache (benchmark peer)"
    params = {"backend": choice("quanto", "hqq"), "bits": positive_int, "group": positive_int,
              "residual": non_negative_int}

    def __init__(self, info: ModelInfo, capacity=None, needs=frozenset(), backend="quanto", bits=4, group=32,
                 residual=32):
        super().__init__(info, capacity, needs)
        from transformers import QuantizedCache

        axis = 0 if backend == "quanto" else 1  # each backend's "per token, groups along head_dim"
        self.model_cache = QuantizedCache(backend, info.config, nbits=bits, axis_key=axis, axis_value=axis,
                                          q_group_size=group, residual_length=residual)

    @property
    def stored(self) -> int:
        return self.seen

    def layer_nbytes(self) -> list[int]:
        out = []
        for layer in self.model_cache.layers:
            tensors = [getattr(layer, name, None) for name in ("keys", "values", "_quantized_keys",
                                                                "_quantized_values")]
            out.append(walk_bytes(tensors))
        return out


def peer_backend(choice_: str) -> str | None:
    installed = {"quanto": importlib.util.find_spec("optimum") is not None
                 and importlib.util.find_spec("optimum.quanto") is not None,
                 "hqq": importlib.util.find_spec("hqq") is not None}
    if choice_ == "none":
        return None
    if choice_ == "auto":
        return next((b for b, ok in installed.items() if ok), None)
    if not installed[choice_]:
        sys.exit(f"--peer {choice_}: its package is not installed (pip install "
                 f"{'optimum-quanto' if choice_ == 'quanto' else 'hqq'})")
    return choice_


# --- the measurement -------------------------------------------------------------------------------------------------


def passages(lm, tokens: int, count: int) -> list[list[int]]:
    ids = lm.encode(TEXT.read_text(encoding="utf-8"))
    out = [ids[i * tokens : (i + 1) * tokens] for i in range(count)]
    return [p for p in out if len(p) == tokens]


def measure(lm, texts: list[list[int]], spec: str, feed: int) -> dict:
    """Fidelity summed over passages (token-weighted), bytes of a cache holding one whole passage."""
    n = kl = agree = nll = ref_nll = 0.0
    start = time.perf_counter()
    for ids in texts:
        f = fidelity(lm, ids, parse_cache_spec(spec), feed)
        n += f.tokens
        kl += f.kl_mean * f.tokens
        agree += f.top1_agreement * f.tokens
        nll += math.log(f.perplexity) * f.tokens
        ref_nll += math.log(f.baseline_perplexity) * f.tokens
    ppl, ref = math.exp(nll / n), math.exp(ref_nll / n)
    return {"cache": spec, "tokens": int(n), "kv_bytes": f.kv_bytes, "bytes_ratio": f.bytes_ratio,
            "kl_mean": kl / n, "top1_agreement": agree / n, "perplexity": ppl, "baseline_perplexity": ref,
            "perplexity_change": ppl / ref - 1, "seconds": time.perf_counter() - start}


def verdict(row: dict) -> str:
    goal = GOALS.get(row["cache"])
    if goal is None:
        return ""
    ratio_ok = row["bytes_ratio"] <= goal[0]
    if goal[1] is None:
        return f"<= {goal[0]}x: {'met' if ratio_ok else 'MISSED'} (perplexity reported)"
    ppl_ok = abs(row["perplexity_change"]) <= goal[1]
    return (f"<= {goal[0]}x and ppl within {goal[1]:.0%}: "
            f"{'met' if ratio_ok and ppl_ok else 'MISSED'}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per passage (at most the model's context)")
    ap.add_argument("--passages", type=int, default=3)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--feed", type=int, default=1)
    ap.add_argument("--peer", default="auto", choices=["auto", "quanto", "hqq", "none"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    backend = peer_backend(args.peer)
    results = []
    for dtype in args.dtypes.split(","):
        lm = load_model(args.model, device="cpu", dtype=dtype)
        info = model_info(lm.model)
        tokens = min(args.tokens, lm.context_length or args.tokens)
        texts = passages(lm, tokens, args.passages)
        specs = list(OURS)
        if backend is not None:
            specs += [f"hf-quantized:backend={backend},bits={b},group=32,residual=32" for b in (4, 2)]
        print(f"# {args.model} ({dtype}): {len(texts)} passages x {tokens} tokens of {TEXT.name}, feed {args.feed}; "
              f"fp16 KV = 2 x {info.num_layers} layers x {info.kv_heads} kv_heads x {info.head_dim} x 2 bytes "
              f"= {2 * info.num_layers * info.kv_heads * info.head_dim * 2} bytes a token", flush=True)
        print("| cache | bytes (one passage) | x fp16 | KL mean | top-1 | ppl | full ppl | ppl change | goal |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---|", flush=True)
        for spec in specs:
            row = {"dtype": dtype, **measure(lm, texts, spec, args.feed)}
            row["goal"] = verdict(row)
            results.append(row)
            print(f"| `{spec}` | {row['kv_bytes']:,} | {row['bytes_ratio']:.3f} | {row['kl_mean']:.5f} | "
                  f"{row['top1_agreement']:.4f} | {row['perplexity']:.3f} | {row['baseline_perplexity']:.3f} | "
                  f"{row['perplexity_change']:+.2%} | {row['goal']} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
