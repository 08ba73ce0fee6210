"""`audit-numerics`: one text teacher-forced under a matrix of numerical conditions, each against a reference (the
loaded model: whole text in one forward, batch 1, its dtype, attention implementation and device), and the noise
verdict ``compare``, ``batch`` and ``sample -N`` give where two runs that should agree part.

**Per condition** (positions i = 0 .. T-2, row i predicting token i + 1; P the reference's distribution, Q the
condition's, both the raw log softmax in float64):

* max and mean |log q(t) - log p(t)| over the text's tokens t;
* KL(P || Q) and TV = 1/2 sum |p - q| over the whole vocabulary, mean and max over positions;
* the share of tokens whose probability ratio q(t) / p(t) leaves [0.9, 1.1];
* argmax flips: positions where the two argmaxes differ, each with both top-2 margins (log p1 - log p2); the first
  one is the **first divergence** (where greedy decoding would take another path);
* hidden states layer by layer: e_l = max over positions of ||h'_l - h_l||_2 / ||h_l||_2 (l = 0 the embeddings,
  l = i + 1 the output of decoder layer i).

**The noise floor.** How far this model carries rounding of a dtype is measured, not assumed: the reference model
run once more with every element of the embeddings and of each layer's output multiplied by (1 + eps u), u uniform
in [-1, 1], eps the machine epsilon of the less precise of the two dtypes compared (a rounding errs by at most eps / 2
relative). That run's e_l times :data:`FLOOR_FACTOR` is layer l's floor; its largest |logit change| times the factor
is the logit floor ``delta``. A layer is beyond noise when e_l exceeds its floor; the first such is named. A condition
is **within numeric noise** when no layer is beyond its floor and every |delta logprob| is at most 2 delta (a log
probability z - logsumexp z moves by at most twice the largest logit change).

The floor and the noise verdict where two runs part live in :mod:`.noise` (``compare``, ``batch`` and ``sample -N``
use them too).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from ..engine import numerics as engine_numerics
from ..engine.numerics import DTYPES, Forced
from ..engine.run import head
from ..errors import ConfigError
from ..kv.attention import own_implementation
from .check_logprobs import RATIO_BAND
from .engine_compare import truncated_kl
from .noise import (FLOOR_FACTOR, NOT_EXPLAINED, WITHIN, Floor, Floors, coarser, relative_errors,  # noqa: F401
                    top2_margins)

SIDES = ("left", "right")
ATTENTIONS = {"sdpa": "sdpa", "eager": "eager", "flash": "flash_attention_2"}
DEFAULT_MATRIX = ("dtype:bf16", "dtype:fp16", "batch:3:left", "batch:3:right", "decode", "chunks:4", "attn:eager")
CONDITION_HELP = ("dtype:fp32|bf16|fp16, batch:N:left|right (with N other rows, padded), decode (one token a "
                  "forward), chunks:K (K tokens a forward), attn:sdpa|eager|flash, device:cpu|cuda|mps")


# ---------------------------------------------------------------------------------------------------------------
# conditions


@dataclass(frozen=True)
class Condition:
    name: str  # as given
    kind: str  # dtype | batch | chunks | attn | device | engine
    dtype: str | None = None
    rows: int = 0
    side: str | None = None
    chunk: int | None = None
    attention: str | None = None
    device: str | None = None


def parse_condition(text: str) -> Condition:
    """One condition of ``--conditions``; a bad one is one line naming what is allowed."""
    parts = text.strip().split(":")
    kind, args = parts[0], parts[1:]

    def bad(why: str) -> ConfigError:
        return ConfigError(f"--conditions {text!r}: {why}; allowed: {CONDITION_HELP}")

    if kind == "dtype" and len(args) == 1 and args[0] in DTYPES:
        return Condition(text, "dtype", dtype=args[0])
    if kind == "batch" and len(args) == 2 and args[0].isdigit() and args[1] in SIDES:
        if not 1 <= int(args[0]) <= 64:
            raise bad("N other rows must be in [1, 64]")
        return Condition(text, "batch", rows=int(args[0]), side=args[1])
    if kind == "decode" and not args:
        return Condition(text, "chunks", chunk=1)
    if kind == "chunks" and len(args) == 1 and args[0].isdigit() and int(args[0]) >= 1:
        return Condition(text, "chunks", chunk=int(args[0]))
    if kind == "attn" and len(args) == 1 and args[0] in ATTENTIONS:
        return Condition(text, "attn", attention=ATTENTIONS[args[0]])
    if kind == "device" and len(args) == 1 and args[0] in ("cpu", "cuda", "mps"):
        return Condition(text, "device", device=args[0])
    raise bad("not a condition")


def unavailable(c: Condition) -> str | None:
    """Why a condition cannot run on this machine (None: it can)."""
    if c.kind == "attn" and c.attention == "flash_attention_2" and not engine_numerics.flash_available():
        return "flash_attention_2 needs CUDA and the flash_attn package"
    if c.kind == "device" and c.device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device"
    if c.kind == "device" and c.device == "mps" and not torch.backends.mps.is_available():
        return "no MPS device"
    return None


def other_rows(ids: list[int], n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """N rows of random tokens, each longer than the text by 3, 6, ... (so the text's row is the one padded)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (len(ids) + 3 * (j + 1),), generator=g).tolist() for j in range(n)]


def run_condition(model, c: Condition, ids: list[int], vocab: int) -> tuple[Forced, torch.dtype]:
    """The condition's forward (and the dtype its numbers were computed in)."""
    dtype = next(model.parameters()).dtype
    if c.kind == "batch":
        return engine_numerics.batched(model, ids, other_rows(ids, c.rows, vocab), c.side), dtype
    if c.kind == "chunks":
        return engine_numerics.chunked(model, ids, c.chunk), dtype
    if c.kind == "dtype":
        other = engine_numerics.copy_as(model, dtype=DTYPES[c.dtype])
        return engine_numerics.whole(other, ids), DTYPES[c.dtype]
    if c.kind == "attn":
        return engine_numerics.whole(engine_numerics.copy_as(model, attention=c.attention), ids), dtype
    if c.kind == "device":
        return engine_numerics.whole(engine_numerics.copy_as(model, device=c.device), ids), dtype
    raise ConfigError(f"condition {c.name}: unknown kind {c.kind}")


# ---------------------------------------------------------------------------------------------------------------
# comparing a condition with the reference


@dataclass
class Flip:
    position: int  # the row (predicting token position + 1)
    reference_token: int
    condition_token: int
    reference_margin: float  # log p1 - log p2 of the reference
    condition_margin: float | None


@dataclass
class Layer:
    layer: str  # embeddings | layer i | (the last row is after the final norm where the model applies one)
    relative_error: float
    floor: float
    beyond_noise: bool


@dataclass
class ConditionResult:
    condition: str
    kind: str
    dtype: str | None
    positions: int
    max_abs_delta_logprob: float | None
    mean_abs_delta_logprob: float | None
    kl_mean: float | None  # KL(reference || condition), nats
    kl_max: float | None
    tv_mean: float | None
    tv_max: float | None
    outside_band: float | None  # share of tokens whose probability ratio leaves [0.9, 1.1]
    flips: list[Flip] = field(default_factory=list)
    first_divergence: int | None = None
    layers: list[Layer] = field(default_factory=list)
    first_layer_beyond_noise: str | None = None
    logprob_floor: float | None = None
    within_noise: bool | None = None
    verdict: str = ""
    truncated: bool = False  # an engine's top-N: KL and TV are bounds
    kl_upper_mean: float | None = None
    skipped: str | None = None  # why the condition did not run
    abs_delta_logprob: list[float] = field(default_factory=list)  # per position, the text's token

    def to_dict(self) -> dict:
        return asdict(self)


def layer_name(row: int) -> str:
    return "embeddings" if row == 0 else f"layer {row - 1}"


def compare_forced(name: str, kind: str, ids: list[int], ref: Forced, cond: Forced, floor: Floor,
                   dtype: torch.dtype) -> ConditionResult:
    """Every figure of one condition against the reference (see the module doc)."""
    n = len(ids) - 1
    p = torch.log_softmax(ref.logits[:n].double(), -1)
    q = torch.log_softmax(cond.logits[:n].double(), -1)
    targets = torch.tensor(ids[1:])
    lp, lq = p.gather(-1, targets[:, None])[:, 0], q.gather(-1, targets[:, None])[:, 0]
    delta = (lq - lp).abs()
    kl = (p.exp() * (p - q)).sum(-1)
    tv = 0.5 * (p.exp() - q.exp()).abs().sum(-1)
    ratio = (lq - lp).exp()
    lo, hi = RATIO_BAND
    outside = float(((ratio < lo) | (ratio > hi)).double().mean())
    arg_p, margin_p = top2_margins(p)
    arg_q, margin_q = top2_margins(q)
    flips = [Flip(i, int(arg_p[i]), int(arg_q[i]), float(margin_p[i]), float(margin_q[i]))
             for i in torch.nonzero(arg_p != arg_q)[:, 0].tolist()]
    errors = relative_errors(cond.hidden, ref.hidden)
    layers = [Layer(layer_name(i), e, f, e > f) for i, (e, f) in enumerate(zip(errors, floor.layers))]
    beyond = next((la.layer for la in layers if la.beyond_noise), None)
    worst = float(delta.max())
    within = beyond is None and worst <= floor.logprob
    return ConditionResult(name, kind, str(dtype).replace("torch.", ""), n, worst, float(delta.mean()),
                           float(kl.mean()), float(kl.max()), float(tv.mean()), float(tv.max()), outside, flips,
                           flips[0].position if flips else None, layers, beyond, floor.logprob, within,
                           _verdict(within, beyond, worst, floor), abs_delta_logprob=delta.tolist())


def _verdict(within: bool, beyond: str | None, worst: float, floor: Floor) -> str:
    if within:
        return f"{WITHIN} ({floor.dtype}: max |delta logprob| {worst:.3g} <= floor {floor.logprob:.3g})"
    where = f"first beyond noise at {beyond}" if beyond else f"max |delta logprob| {worst:.3g} > floor " \
                                                             f"{floor.logprob:.3g}"
    return f"{NOT_EXPLAINED} ({where})"


# ---------------------------------------------------------------------------------------------------------------
# the audit


@dataclass
class Audit:
    reference: dict
    text_token_ids: list[int]
    conditions: list[ConditionResult]
    floors: list[dict]
    floor_rule: str

    def summary(self) -> dict:
        return {"conditions": len(self.conditions),
                "within_noise": [c.condition for c in self.conditions if c.within_noise],
                "not_explained": [c.condition for c in self.conditions if c.within_noise is False],
                "skipped": [c.condition for c in self.conditions if c.skipped],
                "floor_rule": self.floor_rule}

    def document(self, lm, conditions: list[Condition], greedy: int, engine_dtype: str | None, prompt_text: str,
                 prompt_ids: list[int], engine: dict | None = None) -> dict:
        """``audit-numerics``' JSON document: the head (the conditions asked, ``greedy`` tokens generated, the
        engine's dtype with an engine), the audited text's ids, the reference, a result per condition, the floors,
        the summary, and ``engine`` (the connection's description) as the source when one was audited."""
        config = {"conditions": [c.name for c in conditions], "greedy": greedy,
                  "engine_dtype": engine_dtype if engine is not None else None}
        return head("audit-numerics", lm, config, [], prompt_text, prompt_ids, text_token_ids=self.text_token_ids,
                    reference=self.reference, conditions=[c.to_dict() for c in self.conditions], floors=self.floors,
                    summary=self.summary(), **({"source": {"engine": engine}} if engine is not None else {}))


FLOOR_RULE = (f"rounding envelope measured on the reference: every element of the embeddings and of each layer's output "
              f"times (1 + eps u), u uniform in [-1, 1], eps the coarser dtype's machine epsilon; a layer's floor is "
              f"{FLOOR_FACTOR:g} x that run's max relative L2 error; the logprob floor is 2 x {FLOOR_FACTOR:g} x its "
              "largest logit change")


def greedy_text(model, prompt_ids: list[int], n: int) -> list[int]:
    """prompt + n raw greedy tokens of the reference model (its argmax, teacher-forced one forward a token)."""
    ids = list(prompt_ids)
    for _ in range(n):
        ids.append(int(engine_numerics.whole(model, ids).logits[-1].argmax()))
    return ids


def audit(lm, ids: list[int], conditions: list[Condition], engine=None, engine_dtype: str = "bf16",
          top_n: int = 20, on_condition=None) -> Audit:
    """The reference, each condition against it (a condition this machine lacks is listed with why), and an engine's
    scoring of the text as one more condition."""
    if len(ids) < 2:
        raise ConfigError("the text is one token: nothing to teacher-force (give a longer text or --greedy N)")
    model = lm.model
    ref = engine_numerics.whole(model, ids)
    ref_dtype = next(model.parameters()).dtype
    floors = Floors(model, ids, ref)
    out = []
    for c in conditions:
        why = unavailable(c)
        if why is not None:
            out.append(ConditionResult(c.name, c.kind, c.dtype, 0, None, None, None, None, None, None, None,
                                       skipped=why, verdict=f"skipped: {why}"))
        else:
            forced, dtype = run_condition(model, c, ids, lm.vocab_size)
            floor = floors.of(coarser(ref_dtype, dtype))
            out.append(compare_forced(c.name, c.kind, ids, ref, forced, floor, dtype))
        if on_condition is not None:
            on_condition(out[-1])
    if engine is not None:
        out.append(compare_engine(engine, ids, ref, floors.of(coarser(ref_dtype, DTYPES[engine_dtype])), top_n,
                                  engine_dtype))
    reference = {"dtype": str(ref_dtype).replace("torch.", ""), "device": str(lm.device),
                 "attention": own_implementation(model), "batch": 1, "forward": "whole text"}
    used = [asdict(f) | {"logprob": f.logprob} for f in floors.measured()]
    return Audit(reference, list(ids), out, used, FLOOR_RULE)


def compare_engine(engine, ids: list[int], ref: Forced, floor: Floor, top_n: int, dtype: str) -> ConditionResult:
    """The served engine scores the text (prompt logprobs: raw, its top N): |delta logprob| exact on the text's
    tokens, KL(engine || local) bounded from its top N (``truncated_kl``), flips of its top-1 against the local
    argmax. No hidden states: the layer columns stay empty."""
    scored = engine.score(ids, top_n)
    positions = scored.positions[1:]
    local = torch.log_softmax(ref.logits[: len(ids) - 1].double(), -1)
    deltas, lower, upper, flips = [], [], [], []
    arg, margin = top2_margins(local)
    for i, pos in enumerate(positions):
        deltas.append(abs(pos.logprob - float(local[i, pos.token_id])))
        lo, hi, _ = truncated_kl([(a.token_id, a.logprob) for a in pos.top], local[i])
        lower.append(lo)
        upper.append(hi)
        if pos.top and pos.top[0].token_id != int(arg[i]):
            flips.append(Flip(i, int(arg[i]), pos.top[0].token_id, float(margin[i]),
                              pos.top[0].logprob - pos.top[1].logprob if len(pos.top) > 1 else None))
    worst = max(deltas)
    within = worst <= floor.logprob
    lo, hi = RATIO_BAND
    outside = sum(1 for i, pos in enumerate(positions)
                  if not lo <= math.exp(float(local[i, pos.token_id]) - pos.logprob) <= hi) / len(positions)
    return ConditionResult(f"engine {engine.url}", "engine", dtype, len(positions), worst, sum(deltas) / len(deltas),
                           sum(lower) / len(lower), max(lower), None, None, outside, flips,
                           flips[0].position if flips else None, [], None, floor.logprob, within,
                           _verdict(within, None, worst, floor) + f" (top-{top_n} truncated: KL is a lower bound; "
                           f"the engine's dtype taken as {dtype})", truncated=True,
                           kl_upper_mean=sum(upper) / len(upper), abs_delta_logprob=deltas)
