"""KV-cache policies: what a decoding run keeps of the keys and values it has computed.

The protocol (``KVPolicy``)
---------------------------
A policy owns the model's cache object (``model_cache``, what :func:`decodelab.core.engine.forward.forward` hands
the model) and is the only code that changes it. The runtime (:mod:`decodelab.core.engine.runtime`) asks it, for every forward:

* ``seen``: tokens consumed so far = the absolute position of the next token. Positions always come from here.
* ``stored``: positions the cache holds now (``seen`` minus what was evicted; per row, all rows equal).
* ``positions(n)``: the position ids [1, n] the next ``n`` tokens are run at: ``seen .. seen + n - 1`` for a policy
  that keeps original positions; a policy that moves tokens to cache slots (re-rotated keys) returns slot positions.
* ``attention_mask(n)``: None (the model's causal mask), or the 4D mask of a policy that lays rows out itself.
* ``after_forward(n)``: ``n`` tokens were just fed; ``seen += n``, and a bounded policy evicts here.
* ``truncate(seen)``: forget every token from absolute position ``seen`` on (a speculative draft was rejected).
* ``reorder(rows)``: gather batch rows (beam search follows the parents of the surviving beams).
* ``layer_nbytes()``: real bytes of the tensors each layer stores (codes, scales and zero points for quantized
  layers); ``nbytes()`` their sum.
* ``capabilities``: what it can do among ``CAPABILITIES``; a run that needs what its policy lacks is refused by
  :func:`require` when it is configured, before any model loads.
* ``feed_invariant``: whether the logits of a text are the same however it is split into forwards (nothing is
  evicted, compressed or quantized between forwards: full, static, paged, recompute). Every other policy changes
  what later tokens see only *between* forwards (a forward's queries see its own tokens exactly), so a whole text
  fed in one forward never reads what the policy keeps; ``score`` feeds such a policy one token a forward, as
  decoding does (:func:`feed_invariant`).
* ``compresses_once(options)``: whether it acts once, after the first forward only (a press with
  ``compress=prefill``): what it costs then depends on where the prompt ends (:func:`compresses_once`).

Optional abilities, each declared on :class:`KVPolicy` with what a policy without it does, so that no caller probes
for one: ``check_options`` / ``capabilities_for`` (the spec's values checked together; capabilities its options
narrow), ``rewrite`` (recompute: the forwards to run instead of the ids), ``wants_attentions``
/ ``observe_attentions`` (a score-based press sees a forward's attention), ``one_token_a_forward`` (layers of unequal
lengths), ``slot_ranges`` (what the next forward attends to, at which positions), ``kept_positions`` (per-head kept
positions), ``attention_space`` (a rotating quantized cache: attention in its rotated space, .attention),
``spec_text``, ``evicted`` and ``last_evicted``.

Policies register in ``POLICIES`` (name -> class). A class declares ``name``, ``capabilities``, ``summary`` (one
line for ``decodelab models``), ``params`` (allowed ``key=value`` names with their parser) and is built by
:func:`make_policy` from a :class:`CacheSpec` and a :class:`ModelInfo` (config, device, dtype, and the model's rotary
parameters, so a policy that re-rotates keys has inv_freq and the rotary dimensions).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import ConfigError
from ..inputs import is_int_text, parse_int

CAPABILITIES = ("truncate", "reorder", "rows", "compile")


@dataclass(frozen=True)
class Rotary:
    """The model's rotary position embedding: angle of pair i at position p is p * inv_freq[i]."""

    inv_freq: Tensor  # [rotary_dim / 2], float32
    rope_type: str  # "default", "linear", "llama3", "yarn", "dynamic", ...
    rotary_dim: int  # leading dims of each head that are rotated (head_dim * partial_rotary_factor)
    head_dim: int
    attention_scaling: float = 1.0  # cos/sin multiplier some rope types apply


@dataclass(frozen=True)
class ModelInfo:
    """What a policy may know about the model it caches for."""

    config: object
    device: torch.device
    dtype: torch.dtype
    rotary: Rotary | None  # None: no RoPE (absolute positions, as GPT-2)
    num_layers: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class CacheSpec:
    """A parsed ``--cache NAME[:key=value,...]``; values already converted and checked by the policy's parsers."""

    name: str = "full"
    params: tuple[tuple[str, object], ...] = ()

    @property
    def options(self) -> dict:
        return dict(self.params)

    def __str__(self) -> str:
        if not self.params:
            return self.name
        return self.name + ":" + ",".join(f"{k}={_show(v)}" for k, v in self.params)


def _show(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class KVPolicy:
    """Base of every policy: counts ``seen``; subclasses hold the tensors."""

    name = "?"
    capabilities: frozenset[str] = frozenset()
    summary = ""
    params: dict = {}
    feed_invariant = False  # the same logits at any split of a text into forwards (module docstring)
    engine_defaults: dict[str, dict] = {}  # engine -> options its reading sets where the spec is silent
    # a rotating quantized cache's attention space (.attention.AttentionSpace): the runtime rotates the query and the
    # attention output instead of the cache rotating every stored token back; None: attention as the model does it
    attention_space = None

    @classmethod
    def compresses_once(cls, options: dict) -> bool:
        """Whether the policy acts once, after the first forward only (module docstring)."""
        return False

    def __init__(self, info: ModelInfo, capacity: int | None = None, needs: frozenset[str] = frozenset()):
        self.info = info
        self.needs = needs
        self.capacity = capacity  # prompt + new tokens when the command knows it (static preallocation)
        self.seen = 0

    @property
    def stored(self) -> int:
        raise NotImplementedError

    def positions(self, n: int) -> Tensor:
        return torch.arange(self.seen, self.seen + n, device=self.info.device).unsqueeze(0)

    def attention_mask(self, n: int) -> Tensor | None:
        """A 4D mask for the next ``n`` tokens, for a policy that lays rows out itself (paged); None: the model
        builds its causal mask."""
        return None

    def after_forward(self, n: int) -> None:
        self.seen += n

    def truncate(self, seen: int) -> None:
        raise NotImplementedError

    def reorder(self, rows: Tensor) -> None:
        raise NotImplementedError

    def layer_nbytes(self) -> list[int]:
        raise NotImplementedError

    def nbytes(self) -> int:
        return sum(self.layer_nbytes())

    def describe(self) -> dict:
        """What a trace reports about the cache after a forward."""
        return {"policy": self.name, "seen": self.seen, "stored": self.stored}

    # --- optional abilities: declared here with what a policy without the ability does; a policy that has one
    # overrides it (module docstring, "optional abilities") ------------------------------------------------------

    evicted = 0  # what was evicted so far (tokens for a place-based cache, (row, head, token) entries for a press)
    last_evicted: tuple[int, int] = (0, 0)  # original positions [start, end) the last forward evicted

    @staticmethod
    def check_options(values: dict) -> dict:
        """The spec's values checked together (each key alone was checked by its parser); a ValueError refuses."""
        return values

    @classmethod
    def capabilities_for(cls, options: dict) -> frozenset[str]:
        """What a policy built with ``options`` can do (a subset of ``capabilities`` where options narrow it)."""
        return cls.capabilities

    def spec_text(self) -> str:
        """The spec as a report names it: the policy's name, with the options it was built with where they matter."""
        return self.name

    def rewrite(self, ids: Tensor, keep: str) -> Iterator[tuple[Tensor, Tensor]] | None:
        """None: ``ids`` are fed as they are, through the cache. A policy that rewrites what is fed (recompute)
        returns the forwards that give the logits of ``ids`` instead, as (windows [B, k, m], positions [1, m])
        pairs the runtime runs without a cache (:meth:`decodelab.core.engine.runtime.Runtime.feed`)."""
        return None

    def wants_attentions(self, n: int) -> bool:
        """Whether the forward of the next ``n`` tokens must hand every layer's attention probabilities to
        :meth:`observe_attentions` (a score-based press, before it evicts)."""
        return False

    def observe_attentions(self, attentions: tuple) -> None:
        """The attention probabilities of one forward, every layer, where :meth:`wants_attentions` asked."""

    def wants_queries(self, n: int) -> bool:
        """Whether the forward of the next ``n`` tokens must hand every layer's queries (before RoPE) to
        :meth:`observe_queries` (a press that models future queries from the prompt's, before it evicts)."""
        return False

    def observe_queries(self, queries: tuple) -> None:
        """Every layer's queries [B, H, n, D] (before RoPE) of one forward, where :meth:`wants_queries` asked."""

    def one_token_a_forward(self) -> bool:
        """Whether the next forward must take one token (layers holding different numbers of tokens: the model
        builds one causal mask, which fits only layers of one length)."""
        return False

    def slot_ranges(self) -> list[list[int]]:
        """What the next forward attends to: [original start, original end, assigned start] per contiguous run of
        tokens; by default every token seen, at its own position."""
        return [[0, self.seen, 0]] if self.seen else []

    def kept_positions(self, row: int = 0) -> list[list[list[int]]] | None:
        """The absolute positions each KV head of each layer holds for batch row ``row``; None for a policy that
        keeps by place, the same positions in every head (:mod:`decodelab.core.kv.kept`)."""
        return None


def tensor_nbytes(t: Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


# --- parameters --------------------------------------------------------------------------------------------------


def positive_int(key: str, text: str) -> int:
    return _int_at_least(key, text, 1)


def non_negative_int(key: str, text: str) -> int:
    return _int_at_least(key, text, 0)


def _int_at_least(key: str, text: str, lo: int) -> int:
    """A spec's integer key, read by the one number reader (ASCII digits; at most 2**40: no cache holds more)."""
    try:
        return parse_int(text, key, lo, 2**40)
    except ConfigError:
        raise ValueError(f"{key} must be an integer >= {lo}" + ("" if is_int_text(text) else f", not {text!r}")
                         ) from None


def boolean(key: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"{key} must be true or false")


def choice(*allowed: str):
    def parse(key: str, text: str) -> str:
        if text not in allowed:
            raise ValueError(f"{key} must be one of {', '.join(allowed)}")
        return text

    return parse


# --- the registry --------------------------------------------------------------------------------------------------

POLICIES: dict[str, type[KVPolicy]] = {}
ALIASES: dict[str, str] = {}  # short name -> long spec, e.g. "int8" -> "quant:bits=8,axis=token"


def register(cls: type[KVPolicy]) -> type[KVPolicy]:
    POLICIES[cls.name] = cls
    return cls


def parse_cache_spec(text: str | None, option: str = "--cache") -> CacheSpec:
    """'NAME' or 'NAME:key=value,key=value' -> CacheSpec, every key and value checked (no model needed)."""
    if text is None:
        return CacheSpec()
    if not str(text).strip():
        raise ConfigError(f"{option} {text!r}: names no policy; give one of {', '.join(list(POLICIES) + list(ALIASES))}"
                          " (full keeps every position)")
    raw = str(text).strip()
    raw = ALIASES.get(raw, raw)
    name, _, rest = raw.partition(":")
    name = name.strip()
    if name not in POLICIES:
        allowed = ", ".join(list(POLICIES) + list(ALIASES))
        raise ConfigError(f"{option} {text!r}: unknown policy {name!r}; allowed: {allowed}")
    cls = POLICIES[name]
    values: dict[str, object] = {}
    for item in (p.strip() for p in rest.split(",") if p.strip()):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not value.strip():
            raise ConfigError(f"{option} {text!r}: {item!r} is not key=value")
        if key not in cls.params:
            allowed = ", ".join(cls.params) or "none"
            raise ConfigError(f"{option} {text!r}: {name} takes no {key!r}; its keys: {allowed}")
        try:
            values[key] = cls.params[key](key, value.strip())
        except ValueError as exc:
            raise ConfigError(f"{option} {text!r}: {exc}") from None
    try:
        values = cls.check_options(values)
    except ValueError as exc:
        raise ConfigError(f"{option} {text!r}: {exc}") from None
    return CacheSpec(name, tuple(sorted(values.items())))


def require(spec: CacheSpec, needs: set[str] | frozenset[str], why: str, option: str = "--cache") -> None:
    """Refuse a run whose policy lacks a capability it needs (before the model loads)."""
    cls = POLICIES[spec.name]
    missing = [c for c in CAPABILITIES if c in needs and c not in policy_capabilities(spec)]
    if missing:
        allowed = [n for n, c in POLICIES.items() if set(needs) <= set(c.capabilities)]
        raise ConfigError(f"{option} {spec}: {why} needs the cache to {_verb(missing[0])}, which {cls.name} "
                          f"cannot; policies that can: {', '.join(allowed)}")


def policy_capabilities(spec: CacheSpec) -> frozenset[str]:
    return POLICIES[spec.name].capabilities_for(spec.options)


def feed_invariant(spec: CacheSpec) -> bool:
    """Whether the logits of a text under ``spec`` do not depend on how it is split into forwards."""
    return POLICIES[spec.name].feed_invariant


def engine_reading(spec: CacheSpec, engine: str | None) -> CacheSpec:
    """``spec`` as ``engine`` reads it (``--semantics``): the policy's defaults for that engine fill the options the
    spec does not name (what the user named wins)."""
    defaults = POLICIES[spec.name].engine_defaults.get(engine or "", {})
    missing = {k: v for k, v in defaults.items() if k not in spec.options}
    return CacheSpec(spec.name, tuple(sorted({**spec.options, **missing}.items()))) if missing else spec


def compresses_once(spec: CacheSpec) -> bool:
    """Whether ``spec`` acts once, after the first forward (the prompt) only."""
    return POLICIES[spec.name].compresses_once(spec.options)


def _verb(capability: str) -> str:
    return {"truncate": "roll back (truncate)", "reorder": "reorder rows", "rows": "hold several rows",
            "compile": "be compiled"}[capability]


def make_policy(spec: CacheSpec, info: ModelInfo, capacity: int | None = None,
                needs: frozenset[str] = frozenset()) -> KVPolicy:
    """Build the policy for a loaded model. ``needs`` (capabilities the run uses) lets a policy whose abilities
    depend on the model (a static cache over sliding layers cannot roll back) refuse with one line."""
    return POLICIES[spec.name](info, capacity, needs=frozenset(needs), **spec.options)



def listing() -> list[dict]:
    """For `decodelab models`: each policy, what it does, its keys and capabilities."""
    rows = [{"name": name, "summary": cls.summary, "keys": list(cls.params),
             "capabilities": [c for c in CAPABILITIES if c in cls.capabilities]} for name, cls in POLICIES.items()]
    rows += [{"name": alias, "summary": f"alias of {target}", "keys": [], "capabilities": []}
             for alias, target in ALIASES.items()]
    return rows




def split_policy_list(text: str) -> list[str]:
    """'snapkv:ratio=0.5,window=8,h2o:size=64,full' -> ['snapkv:ratio=0.5,window=8', 'h2o:size=64', 'full']: pieces
    are split on ',' (or on ';' when the text has one); a piece that is a bare name (``full``, ``int8``) or starts
    ``NAME:`` begins a policy, any other ``key=value`` belongs to the policy before it."""
    pieces = [p.strip() for p in str(text).split(";" if ";" in str(text) else ",") if p.strip()]
    groups: list[list[str]] = []
    for piece in pieces:
        head = piece.partition("=")[0]
        if "=" not in piece or ":" in head or not groups:
            groups.append([piece])
        else:
            groups[-1].append(piece)
    return [",".join(g) for g in groups]


def parse_policy_list(text: str, option: str = "--policies") -> dict[str, CacheSpec]:
    """Each policy of a list (:func:`split_policy_list`) as typed -> its CacheSpec, every spec checked, none twice."""
    texts = split_policy_list(text)
    if not texts:
        raise ConfigError(f"{option} {text!r}: names no policy; give specs such as snapkv:ratio=0.5,h2o:size=64")
    out: dict[str, CacheSpec] = {}
    for item in texts:
        spec = parse_cache_spec(item, option)
        if any(str(spec) == str(other) for other in out.values()):
            raise ConfigError(f"{option} {text!r}: {spec} is named twice")
        out[item] = spec
    return out
