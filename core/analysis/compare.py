"""`compare`: several decoding settings side by side on the same prompts and seeds, on coupled randomness.

The coupling. The sampling selector draws x_t = argmax_i (z_t,i - log E_t,i), with E_t,i ~ Exp(1) i.i.d. (an
exponential race, the Gumbel-max trick: -log E is a standard Gumbel variable), from an explicit generator seeded
with the run's seed, one [1, V] vector per step whatever the chain. Every variant run with seed s therefore uses the
same vector E_t at step t. This is exact for each variant: E_t is independent of everything before step t, so
given the prefix, P(x_t = i) = p_i / sum_j p_j for that variant's own processed distribution p = softmax(z_t), its
marginal law is untouched; only the joint law of the variants is chosen. Under it:

* two variants whose processed logits at step t differ by a constant (the same distribution) pick the same token;
* a truncation filter (top-k, top-p, min-p, typical-p, bans) changes the token only when it removes the token the
  untruncated distribution would have picked with the same draws; otherwise the pick is identical;
* so a difference between two rows comes from the settings, not from luck, and the first step where they part is
  a step where the settings changed the outcome (the pair's ``deciding_stage`` names the stage).

What breaks the coupling: XTC draws its own coin from the run's generator before the selector draws, so a variant
with XTC sees shifted draws (exact, not coupled; its pairs are reported as ``stateful``, as are mirostat's, whose
state a one-step replay cannot restore); speculative decoding draws from the same seed but consumes the generator
differently (a uniform per judged draft and a race per round, plus the draft model's own draws), so its rows are
exact but not coupled to plain sampling; beam search is deterministic (no draws). Greedy variants use no draws at all.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from itertools import combinations
from pathlib import Path

import torch

from ..engine.run import drain
from ..engine.runtime import Runtime
from ..engine.warmup import rotated, warm_up
from ..errors import ConfigError
from ..inputs import parse_int, parse_json, parse_toml, read_input_text
from ..methods.batch.run import request_settings
from ..methods.registry import CONTINUING
from ..methods.speculative.chained import model_member
from ..sampling import replay
from ..sampling.chain import Chain, build_chain, make_chain
from ..sampling.registry import DEFAULT_ORDER, STAGES, params, stateful
from ..sampling.select import make_generator
from ..sampling.registry import StageContext
from ..sampling.semantics import merge_order, plan
from ..sampling.settings import ChainSettings
from ..sampling.tokens import Tokens, resolve
from ..settings import META_KEYS, as_dict, coerce, did_you_mean, load_preset, normalize_key
from ..trace import reasoning
from ..trace.stats import COLUMN, scored_rows
from .noise import noise_verdict

SPECIAL = ("method", "preset")
NOT_PER_VARIANT = ("seed",)  # the comparison's axis: set with --seeds
MAX_SEEDS = 4096  # seeds in one comparison (each is a run of every variant on every prompt)
MAX_PROMPTS = 100_000
# why a divergence under a stateful stage is not attributed, each such stage of the registry named
STATEFUL_WHY = " and ".join(f"{s.name} " + ("draws its own coin from the run's generator" if "generator" in s.needs
                                             else "carries state") for s in STAGES if "state" in s.needs) + \
    ": not attributed"


# ---------------------------------------------------------------------------------------------------------------
# variants, prompts, seeds
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One column of the comparison: a method, an optional preset and settings (raw values, coerced per method;
    ``cache`` is one of them)."""

    name: str
    method: str = "sample"
    preset: str | None = None
    values: tuple[tuple[str, object], ...] = ()

    def describe(self) -> str:
        parts = [f"method={self.method}"] if self.method != "sample" else []
        parts += [f"preset={self.preset}"] if self.preset else []
        parts += [f"{k}={v}" for k, v in self.values]
        return ",".join(parts)


def _all_keys() -> set[str]:
    return {f.name for m in CONTINUING.values() for f in fields(m.settings)} | set(SPECIAL)


def make_variant(name: str, items: dict | list[tuple[str, object]], where: str) -> Variant:
    """A variant from key -> value pairs (method and preset taken out)."""
    pairs = list(items.items()) if isinstance(items, dict) else list(items)
    method, preset, values = "sample", None, []
    known = _all_keys()
    for key, raw in pairs:
        k = str(key).strip().replace("-", "_")
        if k == "method":
            method = str(raw).strip()
            if method not in CONTINUING:
                raise ConfigError(f"{where}: method={method!r}; allowed: {', '.join(CONTINUING)}")
        elif k == "preset":
            preset = str(raw).strip()
        elif k in NOT_PER_VARIANT:
            raise ConfigError(f"{where}: {k} is the comparison's axis, not a variant setting; use --seeds")
        elif k not in known:
            raise ConfigError(f"{where}: unknown key {key!r}{did_you_mean(k, known | {'method', 'preset'})}; "
                              "allowed: method, cache, preset and the settings "
                              f"{', '.join(sorted(known - set(SPECIAL)))}")
        else:
            values.append((k, raw))
    variant = Variant(name, method, preset, tuple(values))
    allowed = {f.name for f in fields(CONTINUING[method].settings)}
    for k, _ in values:
        if k not in allowed:
            raise ConfigError(f"{where}: {k} is not a setting of method={method}; allowed: "
                              f"{', '.join(sorted(allowed - set(NOT_PER_VARIANT)))}")
    return variant


def parse_variant(text: str, index: int = 0) -> Variant:
    """``"name: key=value,key=value"`` (the name is optional). A comma-separated piece that does not start with a
    known key continues the previous value, so ``chain=temperature,top-p`` and ``cache=window:size=8,positions=keep``
    and ``logit_bias=42=-inf,7=1.5`` read as one value each. A stage's text value (``choice``, ``stop``,
    ``logit_bias``, ``regex``, ...) keeps its spaces, as the option does (``choice= yes, no``: the labels " yes" and
    " no"); every other value is stripped."""
    head, sep, rest = text.partition(":")
    if sep and "=" not in head:
        name, body = head.strip(), rest
    else:
        name, body = f"v{index + 1}", text
    if not name:
        raise ConfigError(f"--variant {text!r}: the name before ':' is empty")
    known = _all_keys()
    items: list[list] = []
    for piece in body.split(","):
        key, eq, value = piece.partition("=")
        if eq and key.strip().replace("-", "_") in known:
            items.append([key.strip(), value])
        elif items:
            items[-1][1] += "," + piece
        elif piece.strip():
            guess = did_you_mean(key.strip().replace("-", "_"), known) if eq else ""
            raise ConfigError(f"--variant {text!r}: {piece.strip()!r} is not KEY=VALUE with a known key{guess}; allowed: "
                              f"{', '.join(sorted(known))}")
    text_fields = {p.field for p in params() if p.kind is str or p.many or p.pairs} | {"stop"}  # stop: a run setting
    return make_variant(name, [(k, v if k.replace("-", "_") in text_fields else v.strip()) for k, v in items],
                        f"--variant {name}")


def preset_variant(spec: str) -> Variant:
    name, _ = load_preset(spec)
    return Variant(name, preset=spec)


def load_job(path: str | Path) -> tuple[list[Variant], dict]:
    """A job file: TOML (``[[variant]]`` tables with ``name`` and keys; optional ``prompts`` list, ``seeds``
    string and a ``[defaults]`` table applied to every variant) or JSONL (one variant object a line).
    Returns the variants and the job-level extras (prompts, seeds)."""
    path = Path(path)
    text = read_input_text("--job", path)
    where = f"--job {path}"
    if path.suffix == ".toml":
        doc = parse_toml(where, text)
        tables = doc.get("variant") or doc.get("variants") or []
        defaults = doc.get("defaults", {})
        extras = {k: doc[k] for k in ("prompts", "seeds") if k in doc}
    else:
        tables, defaults, extras = [], {}, {}
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                tables.append(parse_json(f"{where}: line {n}", line))
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(f"{where}: no variants; TOML needs [[variant]] tables, JSONL one object a line")
    if not isinstance(defaults, dict):
        raise ConfigError(f"{where}: [defaults] must be a table of settings")
    if "seeds" in extras:  # checked here, so that a bad value names the job; kept as written
        parse_seeds(extras["seeds"], f"{where}: seeds")
    if "prompts" in extras:
        extras["prompts"] = job_prompts(where, extras["prompts"])
    variants = []
    for i, table in enumerate(tables):
        table = {**defaults, **table}
        name = str(table.pop("name", f"v{i + 1}"))
        variants.append(make_variant(name, table, f"{where}: variant {name}"))
    return variants, extras


def check_names(variants: list[Variant]) -> None:
    seen = set()
    for v in variants:
        if v.name in seen:
            raise ConfigError(f"--variant {v.name}: the name is used twice; give each variant its own name")
        seen.add(v.name)
    if not variants:
        raise ConfigError("--variant: nothing to compare; give --variant, --preset or --job")


def job_prompts(where: str, prompts) -> list[str]:
    """A job's ``prompts``: a text or a list of texts."""
    texts = [prompts] if isinstance(prompts, str) else prompts
    if not isinstance(texts, list) or not all(isinstance(t, str) and t for t in texts):
        raise ConfigError(f"{where}: prompts must be a text or a list of non-empty texts")
    if len(texts) > MAX_PROMPTS:
        raise ConfigError(f"{where}: {len(texts)} prompts; at most {MAX_PROMPTS}")
    return texts


def parse_seeds(text: str | int | list, option: str = "--seeds") -> list[int]:
    """'0-9', '1,3,5', '0-3,7' (or a job's int or list of ints) -> sorted unique seeds in [0, 2**64). Their number
    is counted from the merged ranges before any is listed: at most MAX_SEEDS."""
    usage = f"expected seeds >= 0 as a range or list, e.g. 0-9 or 1,3,5 (at most {MAX_SEEDS} seeds)"
    if isinstance(text, (int, list)) and not isinstance(text, bool):
        items = text if isinstance(text, list) else [text]
        if len(items) > MAX_SEEDS:
            raise ConfigError(f"{option}: {len(items)} seeds; at most {MAX_SEEDS}")
        return sorted({parse_int(s, option, 0, 2**64 - 1) for s in items})
    if not isinstance(text, str):
        raise ConfigError(f"{option} {text!r}: {usage}")
    ranges = []
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            a = parse_int(lo, option, 0, 2**64 - 1) if lo.strip() else None
            b = parse_int(hi, option, 0, 2**64 - 1) if dash else a
        except ConfigError:
            raise ConfigError(f"{option} {text!r}: {usage}") from None
        if a is None or b is None or b < a:
            raise ConfigError(f"{option} {text!r}: {usage}")
        ranges.append((a, b))
    count = seed_count(ranges)
    if count > MAX_SEEDS:
        raise ConfigError(f"{option} {text!r}: {count} seeds; at most {MAX_SEEDS} (each runs every variant on every "
                          "prompt)")
    return sorted({s for a, b in ranges for s in range(a, b + 1)})


def seed_count(ranges: list[tuple[int, int]]) -> int:
    """Distinct integers in the union of inclusive ranges (merged in order, none listed)."""
    total, end = 0, -1
    for a, b in sorted(ranges):
        if b > end:
            total += b - max(a, end + 1) + 1
            end = b
    return total


@dataclass
class Prompt:
    id: str
    text: str
    # the prompt's own settings (a JSONL line's, read as batch reads them): they override every variant's for it
    settings: dict = field(default_factory=dict)


PROMPT_KEYS = ("prompt", "text", "id")  # a JSONL line's prompt and id; any other key is one of the prompt's settings


def read_prompts(path: str | Path) -> list[Prompt]:
    """One prompt a line, or JSONL objects with ``prompt`` (or ``text``) and an optional ``id``."""
    path = Path(path)
    lines = [line for line in read_input_text("--prompts-file", path).splitlines() if line.strip()]
    if not lines:
        raise ConfigError(f"--prompts-file {path}: no prompts (one a line, or JSONL with \"prompt\")")
    if all(line.lstrip().startswith("{") for line in lines):
        prompts = []
        for n, line in enumerate(lines, 1):
            obj = parse_json(f"--prompts-file {path}: line {n}", line)
            text = obj.get("prompt", obj.get("text")) if isinstance(obj, dict) else None
            if not isinstance(text, str) or not text:
                raise ConfigError(f"--prompts-file {path}: line {n} has no \"prompt\" text")
            where = f"--prompts-file {path}: line {n}"
            own = request_settings(where, obj, PROMPT_KEYS)  # batch's reading of a line's settings
            if "seed" in own:  # the one setting that cannot differ by prompt: the seeds are what the rows share
                raise ConfigError(f"{where} sets 'seed': the seeds are the comparison's axis, the same for every "
                                  "prompt and variant (--seeds); remove it from the line")
            prompts.append(Prompt(str(obj.get("id", n)), text, own))
        return prompts
    return [Prompt(str(n), line) for n, line in enumerate(lines, 1)]


def settings_for(v: Variant, base: dict, seed: int):
    """The variant's settings for one seed: method defaults < its preset < the command's options (``base``, typed
    values, None = not given) < the variant's own keys; validated with the method's rules."""
    cls = CONTINUING[v.method].settings
    names = {f.name for f in fields(cls)}
    values: dict = {}
    try:
        if v.preset is not None:
            pname, table = load_preset(v.preset)
            for key, raw in table.items():
                if key not in META_KEYS:
                    k = normalize_key(cls, key)
                    values[k] = coerce(cls, k, raw)
        values.update({k: raw for k, raw in base.items() if k in names and raw is not None})
        for key, raw in v.values:
            values[key] = coerce(cls, key, raw)
        if "seed" in names:
            values["seed"] = seed
        settings = replace(cls(), **values)
        CONTINUING[v.method].validate(settings)
    except ConfigError as exc:
        raise ConfigError(f"variant {v.name}: {exc}") from None
    return settings


def own_settings(variants: list[Variant], prompts: list[Prompt], settings: dict, seed: int) -> dict:
    """(variant, prompt id) -> the settings of that variant on a prompt with its own settings: the variant's
    (settings_for) with the prompt's keys over them, for that prompt only, as batch lays a line's settings over the
    command's. Each is checked before anything runs; a key some variant's method does not have is refused (it
    would apply to some variants and not others), as are two such prompts with one id (rows name their prompt by it)."""
    out: dict = {}
    ids = Counter(p.id for p in prompts)
    for p in prompts:
        if not p.settings:
            continue
        if ids[p.id] > 1:
            raise ConfigError(f"--prompts-file: prompt id {p.id!r} is used twice and one has its own settings; give "
                              "each prompt its own id")
        for v in variants:
            cls = CONTINUING[v.method].settings
            names = {f.name for f in fields(cls)}
            missing = [k for k in p.settings if k not in names]
            if missing:
                raise ConfigError(f"--prompts-file: prompt {p.id} sets {missing[0]!r}, which variant {v.name} "
                                  f"(method={v.method}) does not have; a prompt's own settings must apply to every "
                                  "variant")
            try:
                own = replace(settings[v.name, seed], **p.settings)
                CONTINUING[v.method].validate(own)
            except ConfigError as exc:
                raise ConfigError(f"--prompts-file: prompt {p.id}, variant {v.name}: {exc}") from None
            out[v.name, p.id] = own
    return out


# ---------------------------------------------------------------------------------------------------------------
# metrics of one output (hand-checkable)
# ---------------------------------------------------------------------------------------------------------------


def ngrams(ids: list[int], n: int) -> list[tuple[int, ...]]:
    return [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]


def distinct_n(ids: list[int], n: int) -> float | None:
    """distinct-n (Li et al. 2016): different n-grams / all n-grams of the output; None without any n-gram."""
    grams = ngrams(ids, n)
    return len(set(grams)) / len(grams) if grams else None


def repetition_rate(ids: list[int], n: int = 4) -> float | None:
    """The share of the output's n-grams that already occurred earlier in it (seq-rep-n of Welleck et al. 2019,
    n = 4): 1 - distinct-n. 0 for text that never repeats a 4-gram; near 1 for a loop."""
    d = distinct_n(ids, n)
    return None if d is None else 1.0 - d


def mean_or_none(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


# ---------------------------------------------------------------------------------------------------------------
# rows
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Row:
    variant: str
    method: str
    prompt: str  # the prompt's id
    seed: int
    text: str
    token_ids: list[int]
    length: int
    stop_reason: str
    mean_logprob: float | None  # processed distribution (what the method drew or searched with)
    raw_perplexity: float | None  # exp(-mean raw log-prob): the model's own surprise at the output
    distinct_1: float | None
    distinct_2: float | None
    repetition_rate: float | None  # seq-rep-4
    mean_kept: float | None  # candidates left by the chain, per step
    mean_entropy: float | None  # nats, of the processed distribution, per step
    tokens_per_s: float  # generated tokens / the run's time (prefill included)
    decided_by: list[str] = field(default_factory=list)  # per step (sample rows)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Scored:
    """Per generated token, teacher-forced: the model's raw log-prob, and under the chain the processed log-prob,
    candidates kept and entropy."""

    raw_logprob: list[float]
    logprob: list[float]
    kept: list[int]
    entropy: list[float]


@torch.inference_mode()
def teacher_forced(model, prompt_ids: list[int], out_ids: list[int], chain: Chain) -> Scored:
    """One forward over prompt + output (no cache reuse), then the chain replayed at each generated position from
    the prompt's end (:mod:`~decodelab.core.sampling.replay`)."""
    if not out_ids:
        return Scored([], [], [], [])
    logits = replay.forced_logits(model, prompt_ids, out_ids)  # [T, V]: row i predicts out_ids[i]
    target = torch.tensor(out_ids, dtype=torch.long, device=logits.device)
    processed = replay.along(chain, prompt_ids, out_ids, logits)
    head = scored_rows(logits, processed, target).T  # [HEAD, T]: the per-step statistics of every method
    host = head[[COLUMN[k] for k in ("raw_logprob", "logprob", "kept", "entropy")]].tolist()  # one transfer
    return Scored(host[0], host[1], [int(k) for k in host[2]], host[3])


class Comparison:
    """Run every (prompt, seed, variant), then compare the variants pairwise on each (prompt, seed).

    ``lm``: a :class:`~decodelab.core.engine.models.LoadedModel` (or anything with its attributes); runs are built by
    :mod:`decodelab.core.methods` as every command builds them. ``load_draft(spec) -> LoadedModel`` loads a
    speculative variant's draft model (once per spec); ``base``: the command's typed options (None = not given)."""

    def __init__(self, lm, variants: list[Variant], prompts: list[Prompt], seeds: list[int], base: dict | None = None,
                 load_draft: Callable | None = None, on_row: Callable[[Row], None] | None = None):
        check_names(variants)
        if not prompts:
            raise ConfigError("PROMPT: nothing to compare on; give prompts or --prompts-file")
        self.lm, self.variants, self.prompts, self.seeds = lm, variants, prompts, seeds
        self.base = base or {}
        self.load_draft, self.on_row = load_draft, on_row
        self.drafts: dict[str, object] = {}
        # every setting checked before anything runs; no alternatives in the trace (rows need none)
        self.settings = {(v.name, s): settings_for(v, {**self.base, "top": 0}, s) for v in variants for s in seeds}
        self.own = own_settings(variants, prompts, self.settings, seeds[0]) if seeds else {}
        self.rows: list[Row] = []
        self.pairs: list[Pair] = []
        self.interrupted = False  # a Ctrl-C cut the comparison: its rows are the ones finished before

    @property
    def total(self) -> int:
        return len(self.prompts) * len(self.seeds) * len(self.variants)

    def settings_of(self, variant: str, prompt: str, seed: int):
        """What a row ran with: the variant's settings for the seed, or, where its prompt has its own settings,
        those over them (own_settings)."""
        own = self.own.get((variant, prompt))
        if own is None:
            return self.settings[variant, seed]
        return replace(own, seed=seed) if hasattr(own, "seed") else own

    def run(self) -> Comparison:
        """Every (prompt, seed) runs each variant once. Timings are warm and interleaved (issue 34): the model is
        warmed before the first row (``warmup_s``), and the variants run in an order rotated from one (prompt, seed)
        to the next, so none always runs first; rows are kept and reported in the variants' order."""
        self.warmup_s = warm_up(self.lm.model)
        group = 0
        for prompt in self.prompts:
            prompt_ids = self.lm.encode(prompt.text)
            for seed in self.seeds:
                rows = {}
                for v in rotated(self.variants, group):
                    rows[v.name] = self.run_one(v, self.settings_of(v.name, prompt.id, seed), prompt, prompt_ids,
                                                seed)
                group += 1
                for v in self.variants:
                    self.rows.append(rows[v.name])
                    if self.on_row is not None:
                        self.on_row(rows[v.name])
                for a, b in combinations(self.variants, 2):
                    self.pairs.append(self.compare_pair(a, b, rows[a.name], rows[b.name], prompt_ids, seed))
        return self

    def document(self) -> dict:
        """``compare``'s JSON document: the model, the command's options and seeds, every variant's chain (and the
        union of their stages in the default order), the variants and prompts, every row and pair, per-variant
        measures."""
        lm, first, seed = self.lm, self.prompts[0], self.seeds[0]
        chains = {v.name: make_chain(lm, self.settings[v.name, seed]).names for v in self.variants}
        return {"command": "compare", "model": lm.name, "device": str(lm.device),
                "dtype": str(lm.dtype).replace("torch.", ""),
                "config": {"seeds": self.seeds, **{k: v for k, v in self.base.items() if v is not None}},
                "chain": [n for n in DEFAULT_ORDER if any(n in names for names in chains.values())],
                "chains": chains,
                "prompt": {"text": first.text, "token_ids": lm.encode(first.text)},
                "variants": [{"name": v.name, "method": v.method, "spec": v.describe(),
                              "settings": as_dict(self.settings[v.name, seed])} for v in self.variants],
                "prompts": [{"id": p.id, "text": p.text, **({"settings": p.settings} if p.settings else {})}
                            for p in self.prompts],
                "rows": self.rows, "pairs": [self.pair_texts(p) for p in self.pairs],
                "summary": {"variants": variant_summary(self.rows), **self.cut_short()},
                **({"reasoning": split} if (split := self.rows_split()) else {})}

    def rows_split(self) -> list[dict]:
        """Per row with thinking markers, its reasoning / answer split (parts and counts; core/trace/reasoning.py)."""
        texts = {p.id: p.text for p in self.prompts}
        out = []
        for row in self.rows:
            settings = self.settings_of(row.variant, row.prompt, row.seed)
            part = reasoning.for_tokens(settings, self.lm, self.lm.encode(texts[row.prompt]), row.token_ids)
            if part:
                out.append({"variant": row.variant, "prompt": row.prompt, "seed": row.seed, **part["reasoning"]})
        return out

    def pair_texts(self, pair: Pair) -> dict:
        """A pair with what parted as text: the two tokens at the first divergence (``None`` where one output ended)
        and each output's text from there on (``None``: identical), decoded from the two rows' ids."""
        rows = {(r.variant, r.prompt, r.seed): r for r in self.rows}
        d = pair.first_divergence
        texts = {"a_token_text": None, "b_token_text": None, "a_after": None, "b_after": None}
        if d is not None:
            for side, name in (("a", pair.a), ("b", pair.b)):
                ids = rows[name, pair.prompt, pair.seed].token_ids
                texts[f"{side}_token_text"] = self.lm.token_text(ids[d]) if d < len(ids) else None
                texts[f"{side}_after"] = self.lm.decode(ids[d:])
        return {**asdict(pair), **texts}

    def cut_short(self) -> dict:
        """Whether every row ran: ``stop_reason`` ``end``, or ``interrupted`` when Ctrl-C cut the comparison, with
        the rows planned beside the rows run."""
        return {"stop_reason": "interrupted" if self.interrupted else "end", "rows_planned": self.total,
                "rows_run": len(self.rows)}

    # --- one run -------------------------------------------------------------------------------------------------

    def run_one(self, v: Variant, settings, prompt: Prompt, prompt_ids: list[int], seed: int) -> Row:
        """The variant's run, built and reported by its method (the registry): a traced run's row from its own
        steps, any other's from its ids scored teacher-forced under its chain."""
        method = CONTINUING[v.method]
        parts = {"draft": self.draft_for(v, settings)} if hasattr(settings, "draft") else {}
        run = method.build(self.lm, settings, prompt.text, prompt_ids, summary_only=True, **parts)
        drain(run)  # an empty chain ends this row (stop_reason empty_chain), not the comparison
        out = method.report(run)
        if out.steps is None:
            return self.scored_row(v, prompt, seed, prompt_ids, run.chain, out.token_ids, out.stop_reason,
                                   out.tokens_per_s, out.text)
        steps, ids = out.steps, out.token_ids
        return Row(variant=v.name, method=v.method, prompt=prompt.id, seed=seed, text=out.text,
                   token_ids=ids, length=len(ids), stop_reason=out.stop_reason,
                   mean_logprob=mean_or_none([s.logprob for s in steps]),
                   raw_perplexity=math.exp(-mean_or_none([s.raw_logprob for s in steps])) if steps else None,
                   distinct_1=distinct_n(ids, 1), distinct_2=distinct_n(ids, 2), repetition_rate=repetition_rate(ids),
                   mean_kept=mean_or_none([s.kept for s in steps]), mean_entropy=mean_or_none([s.entropy for s in steps]),
                   tokens_per_s=out.tokens_per_s, decided_by=[s.decided_by for s in steps])

    def draft_for(self, v: Variant, settings):
        """The draft model a variant's settings name (loaded once per name); None when no member is a model."""
        name = model_member(settings.draft)
        if name is None:
            return None
        if self.load_draft is None:
            raise ConfigError(f"variant {v.name}: draft={settings.draft}: no draft loader here; use draft=ngram")
        if name not in self.drafts:
            self.drafts[name] = self.load_draft(name)
        return self.drafts[name]

    def scored_row(self, v: Variant, prompt: Prompt, seed: int, prompt_ids: list[int], chain: Chain,
                   ids: list[int], reason: str, tokens_per_s: float, text: str | None = None) -> Row:
        """A row from given ids, scored teacher-forced under ``chain``; ``text``: the run's delivered text (None:
        the ids decoded)."""
        s = teacher_forced(self.lm.model, prompt_ids, ids, chain)
        return Row(variant=v.name, method=v.method, prompt=prompt.id, seed=seed,
                   text=self.lm.decode(ids) if text is None else text,
                   token_ids=ids, length=len(ids), stop_reason=reason, mean_logprob=mean_or_none(s.logprob),
                   raw_perplexity=math.exp(-mean_or_none(s.raw_logprob)) if ids else None,
                   distinct_1=distinct_n(ids, 1), distinct_2=distinct_n(ids, 2), repetition_rate=repetition_rate(ids),
                   mean_kept=mean_or_none(s.kept), mean_entropy=mean_or_none(s.entropy), tokens_per_s=tokens_per_s)

    # --- pairs ---------------------------------------------------------------------------------------------------

    def compare_pair(self, a: Variant, b: Variant, ra: Row, rb: Row, prompt_ids: list[int], seed: int) -> Pair:
        d = first_divergence(ra.token_ids, rb.token_ids)
        pair = Pair(a.name, b.name, ra.prompt, seed, d, None)
        if d is None:
            return pair
        if d >= min(ra.length, rb.length):
            shorter = ra if ra.length < rb.length else rb
            pair.deciding_stage, pair.why = "stop", f"{shorter.variant} stopped ({shorter.stop_reason})"
            return pair
        pair.a_token, pair.b_token = ra.token_ids[d], rb.token_ids[d]
        sa, sb = self.settings_of(a.name, ra.prompt, seed), self.settings_of(b.name, rb.prompt, seed)
        if a.method != b.method:
            pair.deciding_stage, pair.why = "method", f"{a.method} vs {b.method}"
        elif a.method != "sample":
            keys = differing_keys(sa, sb)
            pair.deciding_stage = "method"
            pair.why = (f"{a.method} settings differ ({', '.join(keys)})" if keys
                        else f"{a.method} with the same settings")
        elif stateful(make_chain(self.lm, sa).names + make_chain(self.lm, sb).names):
            pair.deciding_stage, pair.why = "stateful", STATEFUL_WHY
        else:
            pair.deciding_stage, pair.why = self.attribute(sa, sb, prompt_ids + ra.token_ids[:d], d, seed,
                                                           pair.a_token)
        if should_agree(pair.deciding_stage, sa, sb):
            pair.noise = noise_verdict(self.lm, prompt_ids, ra.token_ids, d, pair.b_token,
                                       make_chain(self.lm, sa)).to_dict()
        return pair

    @torch.inference_mode()
    def attribute(self, sa, sb, prefix: list[int], step: int, seed: int, token_a: int):
        """Which setting flipped the token at ``step``: starting from a's settings, switch the differing stages to
        b's one at a time in the default chain order, with the same raw logits and the same race draws E_step;
        the first switch that changes the token decides."""
        model = self.lm.model
        device = next(model.parameters()).device
        ids = torch.tensor([prefix], dtype=torch.long, device=device)
        z = Runtime.create(model, None, capacity=len(prefix)).prefill(ids)  # [1, V]
        race = replay_race(seed, step, z.shape[-1], device)
        tokens = Tokens.of(self.lm)
        pa, pb = plan(sa), plan(sb)  # each side as its semantics reads it
        va = pa.settings.stage_values(resolved=resolve(pa.settings, tokens))
        vb = pb.settings.stage_values(resolved=resolve(pb.settings, tokens))
        same_order = sa.chain == sb.chain and sa.semantics == sb.semantics
        end_ids = pa.context(None, tuple(self.lm.eos_ids), getattr(sa, "stop_id", ())).end_ids
        # the plans say which side is greedy; where one samples, the race (a temperature-0 stage leaves a point
        # mass, whose arg-max the race picks too)
        greedy = pa.greedy and pb.greedy

        def context_for(values: dict) -> StageContext:
            """a's context, except that a penalty switched to b's value counts tokens as b does."""
            counting = dict(pa.counting)
            for name in set(pa.counting) | set(pb.counting):
                if values.get(name) is not va.get(name):
                    counting.pop(name, None)
                    counting.update({name: pb.counting[name]} if name in pb.counting else {})
            return StageContext(end_ids=end_ids, counting=counting, eos_ids=tuple(self.lm.eos_ids), tokens=tokens)

        def pick(values: dict, order=None) -> int:
            active = [n for n in DEFAULT_ORDER if values.get(n) is not None]
            chain = build_chain(values, merge_order(tuple(pa.order), active) if order is None else order,
                                context_for(values))
            replay.start(chain, len(prefix) - step)  # the prompt: stages that count or read generated tokens start there
            processed = replay.processed(chain, ids, z, len(prefix)).float()
            return int((processed if greedy else processed - race.log()).argmax(dim=-1)[0])

        current = pick(va, pa.order)
        if current != token_a:
            reason = "cache" if sa.cache != sb.cache else "numerics"
            return reason, f"a's token is not reproduced from a full-cache recompute ({reason} differs)"
        values = dict(va)
        for name in DEFAULT_ORDER:
            if va.get(name) == vb.get(name):
                continue
            values[name] = vb.get(name)
            token = pick(values)
            if token != current:
                return name, f"{name} {_show(va.get(name))} -> {_show(vb.get(name))} changes the token"
        if not same_order:
            return "chain", "the stage order (--chain) differs"
        if sa.cache != sb.cache:
            return "cache", f"cache {sa.cache} vs {sb.cache}: the raw logits differ"
        return "numerics", "no setting explains it (floating-point differences between the runs)"


def _show(value) -> str:
    return "off" if value is None else str(value)


def differing_keys(sa, sb) -> list[str]:
    return [f.name for f in fields(sa) if f.name != "seed" and getattr(sa, f.name) != getattr(sb, f.name)]


def replay_race(seed: int, step: int, vocab: int, device) -> torch.Tensor:
    """The Exp(1) vector [1, V] a sampling run with ``seed`` draws at ``step`` (one [1, V] vector per step)."""
    gen = make_generator(seed, device)
    race = torch.empty(1, vocab, dtype=torch.float32, device=device)
    for _ in range(step + 1):
        race.exponential_(1.0, generator=gen)
    return race


MEASURES = ("length", "mean_logprob", "raw_perplexity", "distinct_1", "distinct_2", "repetition_rate", "mean_kept",
            "mean_entropy", "tokens_per_s")


def variant_summary(rows: list[Row]) -> list[dict]:
    """Per variant, over its prompts and seeds: each measure's mean, min and max (None where no run has it)."""
    out = []
    for variant in dict.fromkeys(r.variant for r in rows):
        mine = [r for r in rows if r.variant == variant]
        measures = {}
        for key in MEASURES:
            values = [v for v in (getattr(r, key) for r in mine) if v is not None and math.isfinite(v)]
            measures[key] = ({"mean": sum(values) / len(values), "min": min(values), "max": max(values)}
                             if values else None)
        out.append({"variant": variant, "method": mine[0].method, "runs": len(mine), "measures": measures})
    return out


def should_agree(deciding: str | None, sa, sb) -> bool:
    """Two runs that part where no setting explains it (numerics, the cache), or two greedy runs of different
    methods: they should have agreed, and the noise verdict says whether rounding can explain the split."""
    greedy = all(isinstance(s, ChainSettings) and plan(s).greedy for s in (sa, sb))  # the plan decides greedy
    return deciding in ("numerics", "cache") or (deciding == "method" and greedy)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where the outputs differ (or where the shorter one ended); None if identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class Pair:
    a: str
    b: str
    prompt: str
    seed: int
    first_divergence: int | None  # the first step where the two outputs part (None: identical)
    deciding_stage: str | None  # the stage (or cache, method, stop, chain) that made the difference there
    why: str | None = None
    a_token: int | None = None
    b_token: int | None = None
    noise: dict | None = None  # where the two should agree (numerics, cache, greedy methods): the noise verdict

    def to_dict(self) -> dict:
        out = asdict(self)
        if out["noise"] is None:  # only pairs that should agree carry one
            del out["noise"]
        return out
