"""quantize-kv: what a quantized KV cache saves, what it costs, and where the error enters.

* memory: real bytes of the quantized cache holding the text, against the full cache in the model's dtype and in
  float16; the per-token formula 2 x layers x kv_heads x head_dim x bytes (2: keys and values) and what grouped-query
  attention saves (heads / kv_heads); bytes projected at the model's context and at ``context`` x ``batch``.
* fidelity (through :mod:`decodelab.core.methods.score`): the text teacher-forced under the quantized cache
  against the same model under the full cache, fed ``feed`` tokens a forward (1: every token reads every earlier one from the cache,
  the decode path): per-token KL(full || quantized), top-1 agreement, perplexity of both.
* reconstruction: the full-precision keys and values of the text, put through the policy's layouts (exact window
  included), per layer and head: relative error ||x - x'|| / ||x|| and the largest |x - x'|.
* outliers: per channel max|x| / median|x| over the tokens, the channel that sets a per-tensor scale, and the error
  of per-tensor, per-token, per-channel and grouped scaling of the same tensor at the same bits.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..engine.forward import model_info
from ..engine.models import LoadedModel
from ..engine.run import Origin, drain
from ..engine.runtime import Runtime
from ..errors import ConfigError
from ..kv import POLICIES, CacheSpec, compresses_once, parse_cache_spec, parse_policy_list
from ..kv.press import PressPolicy
from ..kv.quant import AXES, QuantPolicy
from ..kv.quantize import dequantize, quantize
from .reuse import NAMES as REUSE_NAMES
from .reuse import build_case, reuse_row
from .reuse import ranked as ranked_reuse
from ..methods.score import Scorer, ScoreSettings, blocks
from ..sampling.chain import build_chain
from ..sampling.settings import ChainSettings
from ..settings import _check
from .policies import fidelity_row, ranked
from .probe import Prober, ProbeSettings

GRID_BITS = (8, 4, 2)
GRID_AXES = ("tensor", "token", "channel", "group", "kivi")


@dataclass(frozen=True)
class QuantizeKVSettings(ChainSettings):
    cache: str = "int4-kivi"
    bits: str | None = None  # overrides of the --cache quant spec
    axis: str | None = None
    group_size: int | None = None
    residual: int | None = None
    symmetric: bool | None = None
    limit: int | None = 256  # tokens of the text
    feed: int = 1  # tokens per forward in the fidelity run (1: the decode path)
    grid: bool = False
    activations: int | None = None  # a decoder layer whose input activations get the outlier analysis
    prefill: int | None = None  # the fidelity run's first forward (the prompt a press that compresses once compresses)
    policies: str | None = None  # --policies: a ranking of these cache specs against the full cache
    probe: bool = False  # the ranking's retrieval probe (core/analysis/probe.py) over the text
    reuse: int | None = None  # --reuse K: the --policies caches compressed once, then asked K questions (reuse.py)
    context: int | None = None  # projected bytes at this many tokens ...
    batch: int = 1  # ... in this many rows
    top: int = 4  # outlier channels listed per tensor


def validate_quantize_kv(s: QuantizeKVSettings) -> CacheSpec:
    """Every check that needs no model; returns the resolved quant spec."""
    for key in ("limit", "feed", "context", "group_size", "prefill"):
        value = getattr(s, key)
        if value is not None:
            _check(value >= 1, key, value, "must be an integer >= 1")
    _check(s.batch >= 1, "batch", s.batch, "must be an integer >= 1")
    _check(s.top >= 0, "top", s.top, "must be >= 0")
    if s.residual is not None:
        _check(s.residual >= 0, "residual", s.residual, "must be an integer >= 0")
    if s.axis is not None:
        _check(s.axis in AXES, "axis", s.axis, f"allowed: {', '.join(AXES)}")
    if s.bits is not None:
        _check(str(s.bits) in ("2", "4", "8", "fp8"), "bits", s.bits, "allowed: 2, 4, 8, fp8")
    if s.limit is not None:
        _check(s.limit >= 2, "limit", s.limit, "must be >= 2 (the first token is context)")
    specs = [kv_spec(s)] + (list(parse_policy_list(s.policies).values()) if s.policies is not None else [])
    for spec in specs:
        if compresses_once(spec) and s.prefill is None:
            raise ConfigError(f"--cache {spec}: it compresses once, after the prompt, and the measured text has no "
                              "prompt; give --prefill N (the first N tokens are its prompt)")
    if s.probe and s.policies is None:
        raise ConfigError("--probe: ranks the retrieval of --policies; give --policies (or use stream --probe)")
    if s.reuse is not None:
        _check(s.policies is not None, "reuse", s.reuse, "ranks the caches of --policies; give --policies")
        _check(2 <= s.reuse <= len(REUSE_NAMES), "reuse", s.reuse, f"must be 2..{len(REUSE_NAMES)} (questions)")
    return specs[0]


def is_quant(spec: CacheSpec) -> bool:
    """A quantized cache (quant, turbo): memory, fidelity and reconstruction."""
    return issubclass(POLICIES[spec.name], QuantPolicy)


def is_press(spec: CacheSpec) -> bool:
    """A score-based policy (snapkv, h2o, tova, knorm, pyramidkv, keydiff): measured for fidelity and bytes only."""
    return issubclass(POLICIES[spec.name], PressPolicy)


def press_names() -> str:
    """The score-based policies, as the policy registry lists them."""
    return ", ".join(name for name, cls in POLICIES.items() if issubclass(cls, PressPolicy))


def kv_spec(s: QuantizeKVSettings) -> CacheSpec:
    """--cache (a quant spec or alias), with --bits/--axis/--group-size/--residual/--symmetric laid over it."""
    base = s.cache_spec
    overrides = {"bits": s.bits, "axis": s.axis, "group": s.group_size, "residual": s.residual,
                 "symmetric": s.symmetric}
    if is_press(base):
        given = [k for k, v in overrides.items() if v is not None]
        if given:
            raise ConfigError(f"--{given[0].replace('group', 'group-size')}: sets a quant cache; --cache {s.cache} is a "
                              "score-based press (give its own keys in the spec)")
        return base
    if base.name == "turbo":
        given = [k for k, v in overrides.items() if v is not None]
        if given:
            raise ConfigError(f"--{given[0].replace('group', 'group-size')}: sets a quant cache; --cache {s.cache} is "
                              "turbo (give its own keys in the spec: bits, keys, residual)")
        return base
    if base.name != "quant":
        raise ConfigError(f"--cache {s.cache}: quantize-kv measures a quant policy (quant:..., int8, int4-kivi, "
                          f"int2-kivi, int4, fp8) or a score-based press ({press_names()}: memory and fidelity)")
    options = dict(base.options)
    given = {k: v for k, v in overrides.items() if v is not None}
    if "axis" in given and given["axis"] != options.get("axis"):
        options = {k: v for k, v in options.items() if k == "bits"}  # defaults follow the new axis
    options.update(given)
    if options.get("axis") == "token":
        options.pop("group", None)
    text = "quant:" + ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in options.items())
    return parse_cache_spec(text)


# --- memory ----------------------------------------------------------------------------------------------------------


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def per_token_formula(info, heads: int) -> dict:
    """2 x layers x kv_heads x head_dim x bytes per token (keys and values), and without grouped-query attention."""
    elements = 2 * info.num_layers * info.kv_heads * info.head_dim
    return {
        "formula": "2 x layers x kv_heads x head_dim x bytes",
        "layers": info.num_layers, "heads": heads, "kv_heads": info.kv_heads, "head_dim": info.head_dim,
        "cache_dtype": str(info.dtype).replace("torch.", ""),
        "bytes_per_token": elements * dtype_bytes(info.dtype),
        "fp16_bytes_per_token": elements * 2,
        "bytes_per_token_without_gqa": elements * heads // info.kv_heads * dtype_bytes(info.dtype),
        "gqa_saving": heads / info.kv_heads,
    }


def available_memory(device: torch.device) -> int | None:
    """Free bytes where the cache would live: free CUDA memory, else available system memory."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError, RuntimeError):
        return None


def projection(policy: QuantPolicy, tokens: int, rows: int, free: int | None) -> dict:
    """Bytes at ``tokens`` tokens x ``rows`` rows: quantized (formula checked against the stored tensors), and the
    full cache in the model's dtype and in float16 (2 x layers x kv_heads x head_dim x bytes per token)."""
    info = policy.info
    full = rows * tokens * 2 * info.num_layers * info.kv_heads * info.head_dim
    quant = policy.bytes_at(tokens, rows)
    baseline = full * dtype_bytes(info.dtype)
    return {"tokens": tokens, "batch": rows, "kv_bytes": quant, "baseline_kv_bytes": baseline,
            "fp16_kv_bytes": full * 2, "bytes_ratio": quant / (full * 2),
            "fp16_model_bytes_ratio": fp16_model_bytes(policy, tokens, rows) / (full * 2),
            "fits": None if free is None else quant <= free,
            "baseline_fits": None if free is None else baseline <= free}


def fp16_model_bytes(policy: QuantPolicy, tokens: int, rows: int = 1) -> int:
    """The bytes of the same layout in a float16 model: the exact window at 2 bytes a value. A cache stores its
    exact window in the model's dtype (exact is exact), so a float32 model's window costs twice this; against
    float16 keys and values, this is the figure a float16 model gets (the one KIVI's own figures describe)."""
    return policy.bytes_at(tokens, rows, exact_dtype=torch.float16)


# --- reconstruction and outliers -------------------------------------------------------------------------------------


def capture_kv(lm: LoadedModel, ids: list[int]) -> list[tuple[Tensor, Tensor]]:
    """Full-precision keys and values [kv_heads, T, head_dim] of every layer for the text (one forward, full cache;
    a sliding layer of the model holds its window)."""
    runtime = Runtime.create(lm.model, parse_cache_spec("full"))
    runtime.feed(torch.tensor([ids], device=lm.device), keep="last")
    return [(layer.keys[0].float(), layer.values[0].float()) for layer in runtime.policy.model_cache.layers]


def activation_layers(model, layer: int) -> list:
    """The model's decoder layers, once ``layer`` (--activations) is checked to be one of them."""
    layers = decoder_layers(model)
    if not 0 <= layer < len(layers):
        raise ConfigError(f"--activations {layer}: the model has decoder layers 0..{len(layers) - 1}")
    return layers


def capture_activations(lm: LoadedModel, ids: list[int], layer: int) -> Tensor:
    """The input hidden states [T, hidden] of decoder layer ``layer`` (a forward pre-hook on it)."""
    layers = activation_layers(lm.model, layer)
    seen: list[Tensor] = []

    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        seen.append(hidden.detach()[0].float())

    handle = layers[layer].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        Runtime.create(lm.model, parse_cache_spec("full")).feed(torch.tensor([ids], device=lm.device))
    finally:
        handle.remove()
    return seen[0]


def decoder_layers(model) -> torch.nn.ModuleList:
    """The model's list of decoder layers: the ModuleList as long as its layer count."""
    count = model_info(model).num_layers
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return module
    raise ConfigError("--activations: cannot find this model's decoder layers")


def reconstruction(kv: list[tuple[Tensor, Tensor]], policy: QuantPolicy) -> list[dict]:
    """Per layer and head: the keys and values put through the policy's key and value streams (quantized part and
    exact window), relative error ||x - x'|| / ||x|| and max |x - x'|; and the error of attention scores the stored
    keys give (:func:`score_error`)."""
    rows = []
    for index, (keys, values) in enumerate(kv):
        errors, stored = {}, {}
        for kind, x in (("key", keys), ("value", values)):
            stream = policy.stream(kind)
            stream.append(x.unsqueeze(0))
            stored[kind] = stream.states(torch.float32)[0]
            diff = stored[kind] - x  # [H, T, D]
            norm = x.flatten(1).norm(dim=1).clamp_min(1e-30)
            errors[kind] = (diff.flatten(1).norm(dim=1) / norm, diff.abs().flatten(1).amax(dim=1))
        bias, rms = score_error(keys, stored["key"])
        for head in range(keys.shape[0]):
            rows.append({"layer": index, "head": head,
                         "key_rel_error": errors["key"][0][head].item(), "key_max_error": errors["key"][1][head].item(),
                         "value_rel_error": errors["value"][0][head].item(),
                         "value_max_error": errors["value"][1][head].item(),
                         "score_bias": bias[head].item(), "score_rms_error": rms[head].item()})
    return rows


def score_error(keys: Tensor, stored: Tensor) -> tuple[Tensor, Tensor]:
    """Per head, the error of attention logits q . k' / sqrt(D) - q . k / sqrt(D) over every (probe, token) pair:
    its mean (the bias: negative where a code shrinks inner products) and its root mean square. The probes are the
    head's own full-precision keys (queries are not captured; keys live in the same rotated space), so the pairs
    include each key with itself, where a shrinking code shows most. keys, stored [H, T, D]."""
    err = keys @ (stored - keys).transpose(-1, -2) / math.sqrt(keys.shape[-1])  # [H, T probes, T tokens]
    return err.mean(dim=(1, 2)), err.pow(2).mean(dim=(1, 2)).sqrt()


def outlier_view(x: Tensor, names: list[str], bits, group: int, top: int) -> dict:
    """x [T, C] (tokens x channels). Per channel max|x| and median|x| over the tokens; the channel that sets a
    per-tensor scale; relative error ||x - x'|| / ||x|| and mean step of per-tensor, per-token, per-channel and
    grouped (``group`` channels) scaling at ``bits``, symmetric (so the step is max|x| / (2^(b-1) - 1))."""
    bits = 8 if bits == "fp8" else bits
    absx = x.abs()
    absmax = absx.amax(dim=0)
    median = absx.median(dim=0).values.clamp_min(1e-30)
    ratio = absmax / median
    order = absmax.argsort(descending=True)[:top]
    typical = absmax.median().clamp_min(1e-30)
    setter = int(order[0]) if len(order) else 0
    group = group if x.shape[-1] % group == 0 else x.shape[-1]
    layouts = {}
    norm = x.norm().clamp_min(1e-30)
    for axis in ("tensor", "token", "channel", "group"):
        qx = quantize(x, bits, axis, group if axis == "group" else None, symmetric=True)
        layouts[axis] = {"rel_error": ((dequantize(qx) - x).norm() / norm).item(), "mean_step": qx.step().mean().item()}
    lost = math.log2(layouts["tensor"]["mean_step"] / max(layouts["channel"]["mean_step"], 1e-30))
    return {
        "channels": x.shape[-1], "tokens": x.shape[0],
        "scale_setter": {"channel": names[setter], "max": absmax[setter].item(),
                         "times_typical_channel_max": (absmax[setter] / typical).item()},
        "top_channels": [{"channel": names[int(c)], "max": absmax[c].item(), "median": median[c].item(),
                          "max_over_median": ratio[c].item()} for c in order],
        "max_over_median": {"median": ratio.median().item(), "max": ratio.max().item()},
        "layouts": layouts,
        "bits_lost_per_tensor_vs_channel": lost,  # log2 of the step ratio: resolution the outliers cost
    }


def kv_outliers(kv: list[tuple[Tensor, Tensor]], bits, group: int, top: int) -> list[dict]:
    """The outlier view of every layer's keys and values, channels named h<head>.d<dim>."""
    out = []
    for index, (keys, values) in enumerate(kv):
        H, T, D = keys.shape
        names = [f"h{h}.d{d}" for h in range(H) for d in range(D)]
        for kind, x in (("keys", keys), ("values", values)):
            out.append({"layer": index, "kind": kind,
                        **outlier_view(x.permute(1, 0, 2).reshape(T, H * D), names, bits, group, top)})
    return out


# --- fidelity --------------------------------------------------------------------------------------------------------


@dataclass
class Fidelity:
    cache: str
    tokens: int
    kl_mean: float
    top1_agreement: float
    perplexity: float
    baseline_perplexity: float
    kv_bytes: int
    bytes_ratio: float  # kv_bytes / fp16 bytes of the same tokens (kv_bytes: the exact window in the model's dtype)
    fp16_model_bytes_ratio: float  # the same layout in a float16 model (exact window at 2 bytes) / fp16 bytes
    steps: list = field(default_factory=list, repr=False)  # the scored tokens (score's ScoredToken), when kept
    stop_reason: str = "end"  # "interrupted": a Ctrl-C cut the scoring; the numbers are over the tokens scored

    def row(self) -> dict:
        return {"cache": self.cache, "tokens": self.tokens, "kv_bytes": self.kv_bytes, "bytes_ratio": self.bytes_ratio,
                "fp16_model_bytes_ratio": self.fp16_model_bytes_ratio, "kl_mean": self.kl_mean, "top1_agreement": self.top1_agreement, "perplexity": self.perplexity,
                "baseline_perplexity": self.baseline_perplexity,
                "perplexity_change": relative_change(self.perplexity, self.baseline_perplexity)}


def relative_change(value: float, baseline: float | None) -> float:
    """value / baseline - 1; nan where nothing was scored (an interrupted run with no token)."""
    return value / baseline - 1 if baseline else float("nan")


def fidelity(lm: LoadedModel, ids: list[int], spec: CacheSpec, feed: int, keep_steps: bool = False,
             drive=None, prefill: int | None = None) -> Fidelity:
    """Score the text under ``spec`` against the same model under the full cache (the score machinery: ``score
    --cache spec --against-cache full --feed feed --prefill prefill``); the bytes are those of a ``spec`` cache
    holding the text (real tensors). ``drive(run)`` iterates the scoring run (the CLI's loop, which turns a Ctrl-C
    into ``run.interrupt()``): an interrupted run is measured on the tokens it scored."""
    scorer = Scorer(lm.model, ids, build_chain({}), lm.token_text, ScoreSettings(feed=feed, prefill=prefill),
                    cache=spec, reference=lm.model, reference_cache=parse_cache_spec("full"), reference_name="full")
    (drive or drain)(scorer)
    summary = scorer.summary()
    held_ids = ids[: summary.tokens + 1] if scorer.interrupted else ids  # the tokens the cache actually held
    plain_quant = is_quant(spec) and not sliding(lm)
    held = held_bytes(lm, held_ids, spec, None if plain_quant else feed, None if plain_quant else prefill)
    info = model_info(lm.model)
    fp16 = len(held_ids) * 2 * info.num_layers * info.kv_heads * info.head_dim * 2
    as_fp16 = fp16_model_bytes(POLICIES[spec.name](info, **spec.options), len(held_ids)) if is_quant(spec) else held
    return Fidelity(str(spec), summary.tokens, summary.kl_mean, summary.top1_agreement, summary.perplexity,
                    summary.reference_perplexity, held, held / fp16, as_fp16 / fp16, scorer.steps if keep_steps else [],
                    scorer.stop_reason)


def held_bytes(lm: LoadedModel, ids: list[int], spec: CacheSpec, feed: int | None = None,
               prefill: int | None = None) -> int:
    """Real bytes of a ``spec`` cache after the text, fed ``prefill`` tokens and then ``feed`` a forward (None: all
    at once; a quant cache without sliding layers stores the same whatever the split, while a cache that flushes its
    residual window when full, as transformers' QuantizedCache does, or a press, must be fed as the fidelity run
    fed it)."""
    runtime = Runtime.create(lm.model, spec)
    ids_t = torch.tensor([ids], device=lm.device)
    for start, end in blocks(len(ids) + 1, feed or len(ids), prefill):  # every token of the text, in those blocks
        runtime.feed(ids_t[:, start:end])
    return runtime.policy.nbytes()


def sliding(lm: LoadedModel) -> bool:
    """Whether the model has sliding-window layers of its own."""
    cfg = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    return getattr(cfg, "sliding_window", None) is not None or "sliding_attention" in (
        getattr(cfg, "layer_types", None) or ())


GRID_RESIDUAL = 0  # every cell quantizes every token unless --residual says otherwise (the same for every layout)


def grid_specs(bits: tuple = GRID_BITS, axes: tuple[str, ...] = GRID_AXES, group: int | None = None,
               residual: int | None = None) -> list[CacheSpec]:
    """bits x layout, every cell with the same exact residual window (``residual``, default GRID_RESIDUAL: none), so
    the layouts are compared on equal terms (kivi's own default of 32 exact tokens against none for the others made
    the grid compare windows, not layouts). With a window, kivi's keys keep it as the others do (``kivi_keys=window``:
    the last R exact, not KIVI's T mod R), and any R goes."""
    residual = GRID_RESIDUAL if residual is None else residual
    specs = []
    for b in bits:
        for axis in axes:
            parts = [f"bits={b}", f"axis={axis}", f"residual={residual}"]
            if group is not None and axis != "token":
                parts.append(f"group={group}")
            if axis == "kivi" and residual:
                parts.append("kivi_keys=window")
            specs.append(parse_cache_spec("quant:" + ",".join(parts)))
    return specs


# --- the whole report ------------------------------------------------------------------------------------------------


@dataclass
class QuantizeKVReport:
    cache: str
    keys: str
    values: str
    memory: dict
    projections: list[dict]
    fidelity: Fidelity
    reconstruction: list[dict]
    outliers: list[dict]
    activations: dict | None = None
    grid: list[Fidelity] = field(default_factory=list)
    ranking: list = field(default_factory=list)  # --policies: PolicyRow (core/analysis/policies.py), best first
    probe: dict | None = None  # --probe: the probe's trials and verdict
    reuse: list = field(default_factory=list)  # --reuse: ReuseRow.row() per cache (core/analysis/reuse.py), full first
    feed: int = 1  # tokens per forward in the fidelity runs
    stop_reason: str = "end"  # "interrupted": Ctrl-C cut the main run (its numbers are over the tokens it scored) or
    # the grid (it holds the cells measured before)

    def document(self, origin: Origin) -> dict:
        """``quantize-kv``'s JSON document: a step per scored token, memory, projections, reconstruction, outliers,
        activations, the grid, the summary, and the ranking and probe when measured."""
        return origin.head(steps=[s.to_dict() for s in self.fidelity.steps], text="", token_ids=[],
                           memory=self.memory, projections=self.projections, reconstruction=self.reconstruction,
                           outliers=self.outliers, activations=self.activations, grid=[g.row() for g in self.grid],
                           summary=self.summary(), **({"ranking": self.ranking} if self.ranking else {}),
                           **({"probe": self.probe} if self.probe else {}),
                           **({"reuse": self.reuse} if self.reuse else {}))

    def summary(self) -> dict:
        f = self.fidelity
        return {"cache": self.cache, "tokens": f.tokens, "kv_bytes": f.kv_bytes,
                "baseline_kv_bytes": self.memory["baseline_kv_bytes"], "fp16_kv_bytes": self.memory["fp16_kv_bytes"],
                "bytes_ratio": f.bytes_ratio, "fp16_model_bytes_ratio": f.fp16_model_bytes_ratio,
                "baseline_bytes_ratio": f.kv_bytes / self.memory["baseline_kv_bytes"],
                "kl_mean": f.kl_mean, "top1_agreement": f.top1_agreement, "perplexity": f.perplexity,
                "baseline_perplexity": f.baseline_perplexity,
                "perplexity_change": relative_change(f.perplexity, f.baseline_perplexity),
                "stop_reason": self.stop_reason}


def run_quantize_kv(lm: LoadedModel, ids: list[int], settings: QuantizeKVSettings, spec: CacheSpec,
                    progress=None, drive=None) -> QuantizeKVReport:
    """Everything quantize-kv reports for the text ``ids``, but the grid (``grid_cells``). ``progress(label)`` is told
    what runs next; ``drive`` iterates the main fidelity run (see :func:`fidelity`): an interrupted one is reported
    with what it scored, stop_reason "interrupted"."""
    tell = progress or (lambda label: None)
    if len(ids) < 2:
        raise ConfigError(f"--text-file: {len(ids)} token(s); quantize-kv needs at least 2")
    info = model_info(lm.model)
    cfg = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", info.kv_heads)
    quant = is_quant(spec)
    policy = POLICIES[spec.name](info, **spec.options) if quant else None  # a press: memory and fidelity only
    scaled = spec.name == "quant"  # codes with scales (turbo's have none: no outlier view of scales)
    if settings.activations is not None and not scaled:
        raise ConfigError(f"--activations: the outlier view is of a quant cache's scales; --cache {spec} is "
                          f"{'a press' if not quant else 'turbo (no scales)'}")
    if settings.activations is not None:
        activation_layers(lm.model, settings.activations)  # refused before the fidelity run, not after it
    free = available_memory(lm.device)
    if quant:
        tell("full-precision keys and values")
    kv = capture_kv(lm, ids) if quant else []
    tell(f"fidelity of {spec}")
    main = fidelity(lm, ids, spec, settings.feed, keep_steps=True, drive=drive, prefill=settings.prefill)
    full_bytes = len(ids) * 2 * info.num_layers * info.kv_heads * info.head_dim
    memory = {**per_token_formula(info, heads), "tokens": len(ids), "kv_bytes": main.kv_bytes,
              "baseline_kv_bytes": held_bytes(lm, ids, parse_cache_spec("full")), "fp16_kv_bytes": full_bytes * 2,
              "available_bytes": free}
    sizes = [("context_length", lm.context_length)] + [("context", settings.context)]
    projections = [{"at": label, **projection(policy, tokens, settings.batch if label == "context" else 1, free)}
                   for label, tokens in sizes if tokens and quant]
    keys = policy.layouts["key"].describe() if quant else "score-based eviction"
    values = policy.layouts["value"].describe() if quant else "score-based eviction"
    report = QuantizeKVReport(str(spec), keys, values, memory, projections, main,
                              reconstruction(kv, policy) if quant else [],
                              kv_outliers(kv, policy.bits, policy.group, settings.top) if scaled else [],
                              feed=settings.feed, stop_reason=main.stop_reason)
    if settings.activations is not None:
        tell(f"activations of layer {settings.activations}")
        x = capture_activations(lm, ids, settings.activations)
        report.activations = {"layer": settings.activations, "where": "input of the decoder layer",
                              **outlier_view(x, [f"c{i}" for i in range(x.shape[-1])], policy.bits, policy.group,
                                             settings.top)}
    return report


def ranking_cells(settings: QuantizeKVSettings) -> dict[str, CacheSpec]:
    """The caches of ``--policies`` (label as typed -> spec), full first: each measured with ``fidelity``."""
    if settings.policies is None:
        return {}
    given = {k: v for k, v in parse_policy_list(settings.policies).items() if v.name != "full"}
    return {"full": parse_cache_spec("full"), **given}


def grid_cells(settings: QuantizeKVSettings) -> list[CacheSpec]:
    """The caches of ``--grid`` (none without it): each is measured with ``fidelity``, one at a time, so that an
    interrupted grid keeps the cells already measured."""
    return grid_specs(group=settings.group_size, residual=settings.residual) if settings.grid else []


def call(fn):
    return fn()


def measure_grid(lm: LoadedModel, ids: list[int], settings: QuantizeKVSettings, report: QuantizeKVReport,
                 guard=call, progress=None) -> None:
    """--grid: each cell's fidelity into ``report.grid``, one at a time. ``guard(fn)`` runs one cell (a caller's
    interrupt handling: None back means interrupted, and the cells so far are kept, stop_reason "interrupted")."""
    tell = progress or (lambda label: None)
    cells = grid_cells(settings)
    for k, cell in enumerate(cells):
        tell(f"grid {k + 1}/{len(cells)}: {cell}")
        measured = guard(lambda: fidelity(lm, ids, cell, settings.feed))  # noqa: B023 (called at once)
        if measured is None:
            report.stop_reason = "interrupted"
            return
        report.grid.append(measured)


def measure_ranking(lm: LoadedModel, ids: list[int], settings: QuantizeKVSettings, report: QuantizeKVReport,
                    guard=call, progress=None) -> None:
    """--policies: each cache's fidelity (and probe) one at a time into ``report.ranking``, best first, so an
    interrupt (``guard`` giving None) keeps the rows measured."""
    tell = progress or (lambda label: None)
    cells = ranking_cells(settings)
    prober = Prober(lm.model, lm.tokenizer, ids, ProbeSettings(), lm.context_length) if settings.probe else None
    rows, full_bytes = [], 0
    for k, (label, cell) in enumerate(cells.items()):
        tell(f"policy {k + 1}/{len(cells)}: {label}")
        measured = guard(lambda: (fidelity(lm, ids, cell, settings.feed, keep_steps=True,  # noqa: B023
                                           prefill=settings.prefill),
                                  prober.policy(cell, label) if prober else None))  # noqa: B023
        if measured is None:
            report.stop_reason = "interrupted"
            break
        full_bytes = full_bytes or measured[0].kv_bytes
        rows.append(fidelity_row(label, measured[0], full_bytes, measured[1]))
    report.ranking = ranked(rows)
    if prober is not None and rows:
        report.probe = prober.report([]).document()


def measure_reuse(lm: LoadedModel, ids: list[int], settings: QuantizeKVSettings, report: QuantizeKVReport,
                  guard=call, progress=None) -> None:
    """--reuse K: each --policies cache compressed once and asked every question (one cache at a time, core/analysis/
    reuse.py) into ``report.reuse``, best first; an interrupt (``guard`` giving None) keeps the rows measured.
    Nothing without --reuse."""
    if settings.reuse is None:
        return
    tell = progress or (lambda label: None)
    case = build_case(lm.tokenizer, ids, settings.reuse, lm.context_length)
    rows = []
    for k, (label, cell) in enumerate(ranking_cells(settings).items()):
        tell(f"reuse {k + 1}: {label}")
        measured = guard(lambda: reuse_row(lm.model, case, cell, label))  # noqa: B023 (called at once)
        if measured is None:
            report.stop_reason = "interrupted"
            break
        rows.append(measured)
    report.reuse = [r.row() for r in ranked_reuse(rows)] if rows else []
