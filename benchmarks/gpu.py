"""Every figure of issue 34 on one GPU, in one Python process, each against its reference measured in the same run.

1. Batch 1 (a random model of Llama-3.2-1B's shape in bfloat16; prompt 128 tokens, 256 new, greedy and top-p):
   traced `sample` against warm `generate` (eager, dynamic cache); `sample --cache static --compile` against
   `generate` with its static cache compiled; both against the roofline: the weights' bytes per token at the copy
   bandwidth measured here (a device-to-device copy: read + write bytes / seconds). Beside them the device loop
   (core/methods/device_loop.py: chain, selection and statistics on the device, one transfer per run; with
   --compile its step captured in CUDA graphs), and torch.profiler's top operators of a traced greedy step.
2. Batches (32 requests x 64 new tokens, a 200-token shared prefix, --max-batch 32): `batch` against transformers'
   batched `generate` (left-padded) and its continuous batching.
3. Greedy == `generate` on llama, qwen2, gemma2 and gpt2 (small random models) in bfloat16 and float32: the tokens
   equal, and where they part the first divergence and the top-2 margin of `generate`'s logits there (a margin at
   the dtype's noise says the two sides broke a near tie differently).
4. Host transfers (reads of a tensor into Python) and CUDA synchronisations (torch.cuda.set_sync_debug_mode) per
   token: traced `sample` greedy and top-p, `speculate --proposer ngram`.

Timing rule (core/engine/warmup.py): every variant runs once untimed (its warm-up: CUDA's first calls, compilation,
autotuning; reported as `warmup_s`), then `--rounds` rounds in an order rotated each round; medians of wall seconds
on the one clock (core/engine/run.py: the device synchronised before each reading). Rates are end to end (prefill
included, the same for every variant).

    python benchmarks/gpu.py [--rounds 2] [--out DIR]     # on a CUDA machine: planned for under 8 minutes
    python benchmarks/gpu.py --small                      # the same code, tiny configs, on the CPU (CI)

Writes DIR/gpu.json and DIR/gpu.md (default DIR: benchmarks/out). Needs no tokenizer, no model files, no network,
no tabulate and no llguidance (the paths used here import neither).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from decodelab.core.engine.models import LoadedModel
from decodelab.core.engine.reference import continuous_batching_generate, hf_generate
from decodelab.core.engine.run import clock
from decodelab.core.engine.runtime import Runtime
from decodelab.core.engine.stopping import StopRules
from decodelab.core.engine.warmup import interleaved, warm_up
from decodelab.core.kv import parse_cache_spec
from decodelab.core.methods.batch.run import BatchSettings, Entry, run_batch
from decodelab.core.methods.device_loop import decode_on_device
from decodelab.core.methods.sample import REPORT_BLOCK, Sampler
from decodelab.core.methods.speculative.proposers import NGramProposer
from decodelab.core.methods.speculative.run import Speculator
from decodelab.core.sampling.chain import build_chain
from decodelab.core.sampling.select import make_selector
from decodelab.core.sampling.semantics import plan
from decodelab.core.sampling.settings import ChainSettings

# --- sizes ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """Every size of the run: the full one (the issue's) and --small (the same code on the CPU in seconds)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    prompt: int  # batch-1 prompt tokens
    new: int  # batch-1 new tokens
    requests: int
    request_new: int
    prefix: int  # the requests' shared prefix
    max_batch: int
    exact_hidden: int  # the small models of the greedy == generate check
    exact_new: int
    transfer_new: int


FULL = Sizes(2048, 8192, 16, 32, 8, 128256, 128, 256, 32, 64, 200, 32, 256, 64, 64)
SMALL = Sizes(64, 128, 2, 4, 2, 256, 16, 16, 4, 8, 16, 4, 64, 16, 8)
ARCHS = ("llama", "qwen2", "gemma2", "gpt2")


def config_for(arch: str, s: Sizes, hidden: int | None = None, layers: int | None = None, vocab: int | None = None):
    """A transformers config of ``arch`` at the given sizes (heads of 32 dims at the small sizes)."""
    from transformers import AutoConfig

    h, n, v = hidden or s.hidden, layers or s.layers, vocab or s.vocab
    heads = s.heads if hidden is None else max(2, h // 32)
    kv = s.kv_heads if hidden is None else max(1, heads // 2)
    if arch == "gpt2":
        return AutoConfig.for_model("gpt2", n_embd=h, n_layer=n, n_head=heads, vocab_size=v, n_positions=1024,
                                    bos_token_id=0, eos_token_id=1)
    common = dict(hidden_size=h, intermediate_size=(s.intermediate if hidden is None else 2 * h),
                  num_hidden_layers=n, num_attention_heads=heads, num_key_value_heads=kv, vocab_size=v,
                  max_position_embeddings=4096, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    if arch == "llama":
        return AutoConfig.for_model("llama", rope_theta=500000.0, tie_word_embeddings=True, **common)
    if arch == "qwen2":
        return AutoConfig.for_model("qwen2", **common)
    return AutoConfig.for_model("gemma2", head_dim=h // heads, sliding_window=32, query_pre_attn_scalar=h // heads,
                                **common)


def random_model(config, device, dtype, seed: int = 0, scale: float = 1.0):
    """Random weights made on the device itself (a 1B model in seconds), in ``dtype``; ``scale`` spreads the
    output logits so that greedy near-ties are rare."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if scale != 1.0:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(scale)
    return model.eval()


@dataclass
class IdsModel(LoadedModel):
    """A loaded model whose "text" is its token ids separated by spaces: no tokenizer anywhere."""

    def encode(self, text: str, chat: bool = False) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))

    def token_text(self, token_id: int) -> str:
        return str(token_id)


# --- the measurements ----------------------------------------------------------------------------------------------

GREEDY = {"temperature": 0.0}
TOP_P = {"temperature": 0.8, "top-p": 0.9}


def selector_for(settings: dict) -> str:
    """The selector the semantics plan names for these stage values (the plan decides greedy, not a temperature
    check here)."""
    return plan(ChainSettings(temperature=settings["temperature"], top_p=settings.get("top-p"))).selector


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def copy_bandwidth(device, nbytes: int, rounds: int = 5) -> float:
    """Bytes per second of a device-to-device copy (read + write counted), the median of ``rounds``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm
    seconds = []
    for _ in range(rounds):
        start = clock(device)
        dst.copy_(src)
        seconds.append(clock(device) - start)
    return 2 * nbytes / statistics.median(seconds)


def sampler_call(model, prompt, settings: dict, n: int, seed: int, device, runtime_factory=None):
    """One traced `sample` run as the CLI runs it (trace in blocks): returns the run (its summary holds its own
    warm-excluded rates)."""
    runtime = runtime_factory() if runtime_factory else None
    run = Sampler(model, prompt, build_chain(settings), make_selector(selector_for(settings), seed, device),
                  StopRules(n, ignore_eos=True), str, None, top=5, runtime=runtime, block=REPORT_BLOCK)
    for _ in run:
        pass
    return run


def batch1(s: Sizes, device, dtype, rounds: int) -> dict:
    """Figure 1: batch-1 decoding against `generate`, eager and compiled, and the roofline."""
    model = random_model(config_for("llama", s), device, dtype, seed=0)
    prompt = torch.randint(2, s.vocab, (s.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    n = s.new
    compiled_ok = device.type == "cuda"  # inductor on the CPU needs a C++ toolchain and minutes: --small skips it
    static = parse_cache_spec("static")

    held = {}

    def static_runtime():
        """One static cache for every compiled call, rolled back to empty each time: CUDA graphs are recorded over
        its tensors' addresses, so a fresh cache per call would re-record them inside the timed part. (Where the
        image's transformers cannot roll a static cache back, before 5.24, a fresh one per call.)"""
        rt = held.get("runtime")
        if rt is not None:
            try:
                rt.truncate(0)
                return rt
            except Exception:  # noqa: BLE001  StaticLayer.crop is missing: a fresh cache
                pass
        rt = held["runtime"] = Runtime.create(model, static, capacity=len(prompt) + n)
        rt.compile_decode()
        return rt

    variants = {
        "sample greedy (traced)": lambda: sampler_call(model, prompt, GREEDY, n, 0, device),
        "sample top-p (traced)": lambda: sampler_call(model, prompt, TOP_P, n, 0, device),
        "generate greedy (eager)": lambda: hf_generate(model, prompt, n, do_sample=False),
        "generate top-p (eager)": lambda: hf_generate(model, prompt, n, do_sample=True, temperature=0.8, top_p=0.9,
                                                      top_k=0),
    }
    variants["device loop greedy (one transfer)"] = lambda: decode_on_device(
        Runtime.create(model, None, capacity=len(prompt) + n), prompt, build_chain(GREEDY),
        make_selector("greedy", 0, device), n)
    if compiled_ok:
        variants["device loop greedy --compile (static, graphs)"] = lambda: decode_on_device(
            static_runtime(), prompt, build_chain(GREEDY), make_selector("greedy", 0, device), n)
        variants["sample greedy --compile (static)"] = lambda: sampler_call(model, prompt, GREEDY, n, 0, device,
                                                                            static_runtime)
        variants["generate greedy (static, compiled)"] = lambda: hf_generate(model, prompt, n, do_sample=False,
                                                                             cache_implementation="static")
    warm_up(model)
    timed = interleaved(variants, rounds, device)
    tps = {name: n / timed.median(name) for name in variants}
    bandwidth = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (64 << 20))
    roofline = bandwidth / weight_bytes(model)
    summary = {name: getattr(r, "summary", None) for name, r in timed.results.items()}
    out = {
        "parameters": sum(p.numel() for p in model.parameters()), "weight_bytes": weight_bytes(model),
        "prompt_tokens": len(prompt), "new_tokens": n, "rounds": rounds,
        "tokens_per_s": tps, "warmup_s": timed.warmup_s, "seconds": timed.seconds,
        "own_decode_tokens_per_s": {k: v().decode_tokens_per_s for k, v in summary.items() if v is not None},
        "copy_bandwidth_bytes_per_s": bandwidth, "roofline_tokens_per_s": roofline,
        "ratios": {
            "sample/generate greedy (eager)": tps["sample greedy (traced)"] / tps["generate greedy (eager)"],
            "sample/generate top-p (eager)": tps["sample top-p (traced)"] / tps["generate top-p (eager)"],
            "sample greedy / roofline": tps["sample greedy (traced)"] / roofline,
        },
        "compiled": "measured" if compiled_ok else "skipped: no CUDA (inductor on the CPU is not what is measured)",
    }
    out["ratios"]["device loop / generate greedy (eager)"] = \
        tps["device loop greedy (one transfer)"] / tps["generate greedy (eager)"]
    if compiled_ok:
        ours, theirs = tps["sample greedy --compile (static)"], tps["generate greedy (static, compiled)"]
        out["ratios"]["sample --compile / generate compiled"] = ours / theirs
        out["ratios"]["sample --compile / roofline"] = ours / roofline
        graphs = tps["device loop greedy --compile (static, graphs)"]
        out["ratios"]["device loop --compile / generate compiled"] = graphs / theirs
        out["ratios"]["device loop --compile / roofline"] = graphs / roofline
    out["profile"] = profile_steps(model, prompt, device)
    del model
    return out


def profile_steps(model, prompt: list[int], device, steps: int = 16, top: int = 15) -> list[dict]:
    """Where a traced greedy step's time goes: torch.profiler over ``steps`` tokens of `sample` (warm), the ``top``
    operators by self time on the device (CUDA) or the CPU, per token."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        sampler_call(model, prompt, GREEDY, steps, 0, device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0.0), reverse=True)[:top]
    return [{"op": e.key, "calls_per_token": e.count / steps, "self_us_per_token": getattr(e, key, 0.0) / steps,
             "cpu_us_per_token": e.self_cpu_time_total / steps} for e in rows]


def batches(s: Sizes, device, dtype, rounds: int) -> dict:
    """Figure 2: `batch` against transformers' batched `generate` and its continuous batching, same requests."""
    model = random_model(config_for("llama", s), device, dtype, seed=1)
    lm = IdsModel("random-llama", model, None, device, dtype)
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(2, s.vocab, (s.prefix,), generator=gen).tolist()
    prompts = [prefix + torch.randint(2, s.vocab, (4 + i % 5,), generator=gen).tolist() for i in range(s.requests)]
    settings = BatchSettings(max_new_tokens=s.request_new, max_batch=s.max_batch, block_size=16,
                             max_tokens_per_iteration=4096, baselines=(), temperature=0.0, ignore_eos=True)
    entries = [Entry(str(i), " ".join(map(str, p)), settings) for i, p in enumerate(prompts)]
    work = [(p, s.request_new) for p in prompts]

    def ours():
        return run_batch(lm, settings, entries)

    def padded_generate():
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=s.request_new, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        return out[:, width:].tolist()

    def continuous():
        return continuous_batching_generate(model, work, s.max_batch, 4096, 16)[0]

    variants = {"batch": ours, "generate batched": padded_generate, "continuous batching": continuous}
    try:
        timed = interleaved(variants, rounds, device)
    except Exception as exc:  # noqa: BLE001  transformers' continuous batching varies by version: say why
        variants.pop("continuous batching")
        timed = interleaved(variants, rounds, device)
        timed.warmup_s["continuous batching"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    tokens = s.requests * s.request_new
    tps = {name: tokens / timed.median(name) for name in variants}
    mine = [r.new_ids for r in timed.results["batch"].results]
    out = {"requests": s.requests, "new_tokens_each": s.request_new, "shared_prefix": s.prefix,
           "max_batch": s.max_batch, "rounds": rounds, "tokens_per_s": tps, "warmup_s": timed.warmup_s,
           "seconds": timed.seconds, "same_tokens": {}, "ratios": {}}
    for name in variants:
        if name != "batch":
            out["same_tokens"][name] = sum(a == b for a, b in zip(mine, timed.results[name]))
            out["ratios"][f"batch/{name}"] = tps["batch"] / tps[name]
    del model, lm
    return out


def top2_margin(logits: torch.Tensor) -> float:
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def exactness(s: Sizes, device) -> list[dict]:
    """Figure 3: greedy `sample` against `generate` per architecture and dtype: tokens equal, else the first
    divergence and generate's top-2 logit margin there."""
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for arch in ARCHS:
            model = random_model(config_for(arch, s, hidden=s.exact_hidden, layers=2, vocab=256), device, dtype,
                                 seed=7, scale=8.0)
            prompt = list(range(5, 5 + 12))
            run = sampler_call(model, prompt, GREEDY, s.exact_new, 0, device)
            ours = list(run.new_ids)
            with torch.inference_mode():
                ref = model.generate(torch.tensor([prompt], device=device), attention_mask=None, do_sample=False,
                                     max_new_tokens=s.exact_new, eos_token_id=None, pad_token_id=0,
                                     output_scores=True, return_dict_in_generate=True)
            theirs = ref.sequences[0, len(prompt):].tolist()
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
            rows.append({"arch": arch, "dtype": str(dtype).removeprefix("torch."), "tokens": len(theirs),
                         "equal": ours == theirs, "first_divergence": at,
                         "top2_margin_there": None if at is None else top2_margin(ref.scores[at][0]),
                         "attn_implementation": getattr(model.config, "_attn_implementation", None)})
            del model
    return rows


HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def counting(device):
    """Counts host reads (Tensor methods that bring values into Python) and, on CUDA, synchronisations (the sync
    debug mode's warnings)."""
    counts = collections.Counter()
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def wrap(name, method):
        def read(self, *args, **kwargs):
            counts["host_reads"] += 1
            return method(self, *args, **kwargs)
        return read

    for name, method in saved.items():
        setattr(torch.Tensor, name, wrap(name, method))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counts
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
            for name, method in saved.items():
                setattr(torch.Tensor, name, method)
            counts["cuda_syncs"] = sum("synchroniz" in str(w.message).lower() for w in caught)


def transfers(s: Sizes, device, dtype) -> dict:
    """Figure 4: host reads and CUDA synchronisations per emitted token."""
    model = random_model(config_for("llama", s, hidden=s.exact_hidden, layers=2, vocab=256), device, dtype, seed=3,
                         scale=4.0)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]
    n = s.transfer_new
    out = {}
    sampler_call(model, prompt, GREEDY, 2, 0, device)  # warm
    for label, settings in (("sample greedy (traced)", GREEDY), ("sample top-p (traced)", TOP_P)):
        with counting(device) as c:
            run = sampler_call(model, prompt, settings, n, 0, device)
        emitted = len(run.new_ids)
        out[label] = {k: v / emitted for k, v in c.items()} | {"tokens": emitted}
    with counting(device) as c:
        spec = Speculator(model, NGramProposer(2), prompt, build_chain(GREEDY), StopRules(n, ignore_eos=True), 4)
        for _ in spec:
            pass
    emitted = len(spec.new_ids)
    out["speculate ngram greedy"] = {k: v / emitted for k, v in c.items()} | {"tokens": emitted}
    out["cuda_syncs_counted"] = device.type == "cuda"
    del model
    return out


# --- the report ----------------------------------------------------------------------------------------------------

GOALS = {
    "sample/generate greedy (eager)": 1.0,
    "sample --compile / generate compiled": 2.0,
    "sample --compile / roofline": 0.4,
    "batch/generate batched": 1.0,
    "batch/continuous batching": 1.5,
}


def markdown(doc: dict) -> str:
    lines = [f"# benchmarks/gpu.py ({doc['mode']}), {doc['started']}", "",
             f"{doc['device']}; torch {doc['versions']['torch']}, transformers {doc['versions']['transformers']}; "
             f"{doc['seconds']:.0f} s in all", "", "| figure | measured | goal |", "|---|---:|---:|"]
    for part in ("batch1", "batch"):
        for name, value in doc[part]["ratios"].items():
            goal = GOALS.get(name)
            lines.append(f"| {name} | {value:.2f}x | {'' if goal is None else f'>= {goal:.1f}x'} |")
    lines += ["", "| tokens/s (warm, median) | value | warm-up s |", "|---|---:|---:|"]
    for part in ("batch1", "batch"):
        for name, value in doc[part]["tokens_per_s"].items():
            warm = doc[part]["warmup_s"].get(name)
            lines.append(f"| {name} | {value:.1f} | {warm if isinstance(warm, str) else f'{warm:.2f}'} |")
    b1 = doc["batch1"]
    lines += ["", f"roofline: {b1['roofline_tokens_per_s']:.1f} tokens/s ({b1['weight_bytes'] / 1e9:.3f} GB of "
              f"weights at {b1['copy_bandwidth_bytes_per_s'] / 1e12:.3f} TB/s measured copy bandwidth); "
              f"compiled variants: {b1['compiled']}", "",
              "| greedy == generate | dtype | equal | first divergence | top-2 margin there |", "|---|---|---|---:|---:|"]
    for r in doc["exactness"]:
        margin = "" if r["top2_margin_there"] is None else f"{r['top2_margin_there']:.3g}"
        lines.append(f"| {r['arch']} | {r['dtype']} | {r['equal']} | "
                     f"{'' if r['first_divergence'] is None else r['first_divergence']} | {margin} |")
    if b1.get("profile"):
        lines += ["", "| where a traced greedy step's time goes (top operators) | calls / token | self us / token |",
                  "|---|---:|---:|"]
        lines += [f"| `{r['op']}` | {r['calls_per_token']:.1f} | {r['self_us_per_token']:.1f} |" for r in b1["profile"]]
    lines += ["", "| per emitted token | host reads | CUDA syncs |", "|---|---:|---:|"]
    for name, row in doc["transfers"].items():
        if isinstance(row, dict):
            syncs = f"{row.get('cuda_syncs', 0):.2f}" if doc["transfers"]["cuda_syncs_counted"] else "n/a (CPU)"
            lines.append(f"| {name} | {row.get('host_reads', 0):.2f} | {syncs} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny configs on the CPU (CI): the same code in seconds")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per comparison (default 2; --small 1)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out"), help="folder for gpu.json and gpu.md")
    ap.add_argument("--only", default="batch1,batch,exactness,transfers", help="comma-separated parts to run")
    args = ap.parse_args(argv)
    if args.small:
        device, dtype, sizes = torch.device("cpu"), torch.float32, SMALL
    elif torch.cuda.is_available():
        device, dtype, sizes = torch.device("cuda"), torch.bfloat16, FULL
    else:
        print("benchmarks/gpu.py: no CUDA device; run with --small for the CPU check", file=sys.stderr)
        return 2
    rounds = args.rounds or (1 if args.small else 2)
    import transformers

    started = time.time()
    doc = {"mode": "small (CPU)" if args.small else "full", "started": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                                    time.gmtime()),
           "device": torch.cuda.get_device_name(0) if device.type == "cuda" else f"CPU ({platform.processor()})",
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "python": platform.python_version()}, "dtype": str(dtype), "sizes": sizes.__dict__}
    parts = set(args.only.split(","))
    for name, fn in (("batch1", lambda: batch1(sizes, device, dtype, rounds)),
                     ("batch", lambda: batches(sizes, device, dtype, rounds)),
                     ("exactness", lambda: exactness(sizes, device)),
                     ("transfers", lambda: transfers(sizes, device, dtype))):
        if name in parts:
            t0 = time.time()
            doc[name] = fn()
            print(f"{name}: {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
        else:
            doc[name] = {"ratios": {}, "tokens_per_s": {}, "warmup_s": {}} if name in ("batch1", "batch") else \
                ([] if name == "exactness" else {"cuda_syncs_counted": False})
    doc["seconds"] = time.time() - started
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps(doc, indent=2, default=str))
    text = markdown(doc) if "batch1" in parts else json.dumps(doc, indent=2, default=str)
    (out / "gpu.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
