"""decodelab's presses against NVIDIA's kvpress on the bundled model: which tokens each keeps, and what that does to
the log-probabilities of what follows.

kvpress pins transformers < 5.3, so it runs in its own venv (.ci/kvpress-venv.sh builds it; --python or
DECODELAB_KVPRESS_PYTHON names its python) through tests/kv/kvpress_kept.py, one subprocess per press. Both sides
load the same folder (presets/models/tiny, float32, eager attention) and see the same ids: the first --tokens tokens
of presets/models/validation.txt, the first --prompt of them the context each press compresses once (kvpress only
compresses a prefill), the rest the continuation, fed in one forward through the compressed cache at its original
positions (as kvpress's pipeline feeds a question) and scored token by token.

Per press and kept fraction r (decodelab's `ratio=r` is kvpress's `compression_ratio=1 - r`):

* kept-set agreement: per layer and KV head |ours & theirs| / |theirs| (1 = the same tokens); the mean over heads per
  layer, the lowest head, and how many of the layers x heads sets are identical;
* log-probabilities of the continuation's tokens: the largest |log p_ours - log p_kvpress|, the mean KL(kvpress ||
  ours) per position, and each side's mean KL against the full cache (what the compression costs) and perplexity.

    python benchmarks/kvpress_compare.py [--tokens 512] [--prompt 256] [--ratios 0.5,0.25] [--presses all]
                                         [--python PATH] [--out kvpress.json] [--small]

--small: 96 tokens, a 64-token prompt, ratio 0.5, keydiff, expected-attention and keydiff-blocks only (checks that the
script runs).
Figures from this script do not depend on timing or load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from decodelab.core.engine.models import bundled_dir, load_model
from decodelab.core.engine.runtime import Runtime
from decodelab.core.kv import parse_cache_spec

ROOT = Path(__file__).resolve().parents[1]
KEPT_SCRIPT = ROOT / "tests" / "kv" / "kvpress_kept.py"

# decodelab spec (with {r}) -> kvpress press and its keyword arguments (with the compression ratio filled in).
# Where kvpress's defaults differ from ours, ours are named to match: SnapKV pools with avg in kvpress; TOVA and
# h2o default to compress=decode here, kvpress compresses only the prefill.
PRESSES = {
    "keydiff": ("keydiff:ratio={r}", "KeyDiffPress", {}),
    "expected-attention": ("expected-attention:ratio={r}", "ExpectedAttentionPress",
                           {"n_future_positions": 512, "n_sink": 4, "use_covariance": True, "use_vnorm": True}),
    "knorm": ("knorm:ratio={r}", "KnormPress", {}),
    "snapkv": ("snapkv:ratio={r},window=8,kernel=5,pool=avg", "SnapKVPress", {"window_size": 8, "kernel_size": 5}),
    "tova": ("tova:ratio={r},compress=prefill", "TOVAPress", {}),
    # KeyDiff as its paper runs it (block-wise eviction): kvpress's BlockPress keeps the first B = int(r x T) prompt
    # tokens, then adds BLOCK at a time and keeps the B best; here the prompt is fed B tokens, then BLOCK a forward,
    # to keydiff:size=B,compress=decode. kvpress computes every key in one forward and evicts afterwards; here each
    # block's forward attends only to what was kept (a real chunked prefill).
    "keydiff-blocks": ("keydiff:size={n},compress=decode", "BlockPress", {}),
}
BLOCK = 32


def ours(model, spec: str, prompt: list[int], rest: list[int], chunks: tuple[int, ...] = ()) -> tuple[list, torch.Tensor]:
    """decodelab: the prompt in one forward (or cut at ``chunks``; the press compresses after each forward), the
    continuation in one more; returns the kept positions [layer][kv head] after the prompt and the continuation's
    log-softmax [n, V]."""
    rt = Runtime.create(model, parse_cache_spec(spec))
    with torch.no_grad():
        for a, b in zip([0, *chunks], [*chunks, len(prompt)]):
            rt.feed(torch.tensor([prompt[a:b]]))
        kept = rt.policy.kept_positions() if hasattr(rt.policy, "kept_positions") else None
        logits = rt.feed(torch.tensor([rest]), keep="all")[0]
    return kept, torch.log_softmax(logits.float(), dim=-1)


def theirs(python: str, folder: Path, press: str, kwargs: dict, prompt: list[int], rest: list[int]) -> tuple:
    """kvpress in its own venv: kept positions and the continuation's log-softmax, or raises with its stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "kvpress.pt"
        run = subprocess.run([python, str(KEPT_SCRIPT), str(folder), json.dumps(prompt), press, json.dumps(kwargs),
                              json.dumps(rest), str(out)], capture_output=True, text=True, check=False,
                             env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
        if run.returncode != 0:
            raise RuntimeError(f"kvpress {press} failed (exit {run.returncode}): {run.stderr.strip()[-2000:]}")
        saved = torch.load(out)
    return saved["kept"], saved["logprobs"]


def agreement(mine: list, press: list) -> dict:
    """Per layer: the mean and lowest share over KV heads of kvpress's kept tokens that we keep too."""
    layers, identical, heads = [], 0, 0
    for our_heads, their_heads in zip(mine, press):
        shares = [len(set(a) & set(b)) / max(len(b), 1) for a, b in zip(our_heads, their_heads)]
        identical += sum(sorted(a) == sorted(b) for a, b in zip(our_heads, their_heads))
        heads += len(shares)
        layers.append({"mean": sum(shares) / len(shares), "min": min(shares),
                       "kept_ours": len(our_heads[0]), "kept_kvpress": len(their_heads[0])})
    return {"per_layer": layers, "identical_sets": identical, "sets": heads,
            "mean": sum(x["mean"] for x in layers) / len(layers)}


def kl(p_log: torch.Tensor, q_log: torch.Tensor) -> float:
    """Mean over positions of KL(p || q) from log-probabilities [n, V]."""
    return float((p_log.exp() * (p_log - q_log)).sum(-1).mean())


def scored(logprobs: torch.Tensor, rest: list[int]) -> torch.Tensor:
    """log p of each continuation token from the position before it (the first is predicted by the prompt's last
    position, which is the uncompressed prefill's under every policy, so it is left out)."""
    return logprobs[:-1].gather(-1, torch.tensor(rest[1:])[:, None])[:, 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--ratios", default="0.5,0.25")
    ap.add_argument("--presses", default="all", help=f"comma-separated from {','.join(PRESSES)}")
    ap.add_argument("--python", default=os.environ.get("DECODELAB_KVPRESS_PYTHON"),
                    help="a python that has kvpress (default: $DECODELAB_KVPRESS_PYTHON)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    if args.small:
        args.tokens, args.prompt, args.ratios = 96, 64, "0.5"
        args.presses = "keydiff,expected-attention,keydiff-blocks" if args.presses == "all" else args.presses
    if not args.python:
        sys.exit("--python: no kvpress python given (set DECODELAB_KVPRESS_PYTHON; .ci/kvpress-venv.sh builds one)")
    names = list(PRESSES) if args.presses == "all" else args.presses.split(",")
    unknown = [n for n in names if n not in PRESSES]
    if unknown:
        sys.exit(f"--presses {','.join(unknown)}: not one of {','.join(PRESSES)}")
    torch.set_num_threads(args.threads)
    folder = bundled_dir("tiny")
    lm = load_model("tiny", device="cpu", dtype="float32")
    ids = lm.encode((folder.parent / "validation.txt").read_text(encoding="utf-8"))[: args.tokens]
    prompt, rest = ids[: args.prompt], ids[args.prompt:]
    _, full = ours(lm.model, "full", prompt, rest)
    full_lp = scored(full, rest)
    report = {"tokens": len(ids), "prompt": len(prompt), "scored": len(rest) - 1,
              "full_perplexity": math.exp(-float(full_lp.mean())), "rows": []}
    print(f"tiny, {len(ids)} tokens of validation.txt: prompt {len(prompt)} compressed once, {len(rest) - 1} "
          f"continuation tokens scored; full cache perplexity {report['full_perplexity']:.3f}")
    print("| press | r | kept (ours / kvpress) | sets identical | agreement mean | lowest layer (mean / min head) "
          "| max abs dlogp | KL(kvpress \\|\\| ours) | KL vs full: ours / kvpress | ppl: ours / kvpress |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in [float(x) for x in args.ratios.split(",")]:
        for name in names:
            spec_t, press, extra = PRESSES[name]
            kwargs, chunks = {"compression_ratio": 1 - r, **extra}, ()
            if press == "BlockPress":
                kept = int(len(prompt) * r)
                kwargs = {"block_size": BLOCK, "press": {"press": "KeyDiffPress", "kwargs": kwargs}}
                chunks = tuple(range(kept, len(prompt), BLOCK))
            spec = spec_t.format(r=f"{r:g}", n=int(len(prompt) * r))
            mine, my_lp = ours(lm.model, spec, prompt, rest, chunks)
            press_kept, their_lp = theirs(args.python, folder, press, kwargs, prompt, rest)
            agree = agreement(mine, press_kept)
            a, b = scored(my_lp, rest), scored(their_lp, rest)
            row = {"press": name, "ratio": r, "spec": spec, "kvpress": press, "kvpress_kwargs": kwargs,
                   "agreement": agree, "max_abs_dlogp": float((a - b).abs().max()),
                   "kl_kvpress_ours": kl(their_lp[:-1], my_lp[:-1]),
                   "kl_vs_full_ours": kl(full[:-1], my_lp[:-1]), "kl_vs_full_kvpress": kl(full[:-1], their_lp[:-1]),
                   "ppl_ours": math.exp(-float(a.mean())), "ppl_kvpress": math.exp(-float(b.mean())),
                   "kept_ours": mine, "kept_kvpress": press_kept}
            report["rows"].append(row)
            low = min(agree["per_layer"], key=lambda x: x["mean"])
            at = agree["per_layer"].index(low)
            print(f"| `{spec}` | {r:g} | {low['kept_ours']} / {low['kept_kvpress']} | {agree['identical_sets']} / "
                  f"{agree['sets']} | {agree['mean']:.3f} | layer {at}: {low['mean']:.3f} / {low['min']:.3f} | "
                  f"{row['max_abs_dlogp']:.2e} | {row['kl_kvpress_ours']:.2e} | {row['kl_vs_full_ours']:.4f} / "
                  f"{row['kl_vs_full_kvpress']:.4f} | {row['ppl_ours']:.3f} / {row['ppl_kvpress']:.3f} |",
                  flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
