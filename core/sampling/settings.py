"""The chain's settings, derived from the stage registry: one field per stage parameter (None or empty = off), plus
the chain's own fields: the explicit order (``chain``), the KV-cache policy (``cache``) and the engine whose reading
applies (``semantics``). temperature 0 means greedy."""

from __future__ import annotations

from dataclasses import field, make_dataclass
from functools import lru_cache

from ..kv import CacheSpec, engine_reading, parse_cache_spec
from ..settings import PAIRS

from . import registry
from .registry import Param, params


def annotation(p: Param):
    """The field's type: a tuple of texts, of (text, bias) pairs, or an optional scalar."""
    if p.pairs:
        return PAIRS
    if p.many:
        return tuple[str, ...]
    return p.kind | None


def stage_values(self, resolved: dict | None = None) -> dict:
    """Stage name -> constructor value (None: off), the shape :func:`~.chain.build_chain` takes. ``resolved`` holds
    the token ids of the text-valued settings ("sequence-bias", "ban", "allow", "dry-breakers", "bias"), as
    :func:`~.tokens.resolve` gives them (over ``Tokens.placeholder()`` when no tokenizer exists yet); a set text-valued
    setting without its ids is a KeyError."""
    resolved = resolved or {}
    return {stage.name: stage.value(self, resolved) for stage in registry.STAGES}  # every row, a new one too


@lru_cache(maxsize=64)
def parsed_cache(spec: str) -> CacheSpec:
    """A ``--cache`` spec parsed once (every key and value checked; no model needed); settings only hold the text."""
    return parse_cache_spec(spec)


def _cache_spec(self) -> CacheSpec:
    """The policy as the run reads it: with ``semantics`` set, that engine's defaults where the spec is silent."""
    return engine_reading(parsed_cache(self.cache), self.semantics)


ChainSettings = make_dataclass(
    "ChainSettings",
    [(p.field, annotation(p), field(default=p.default)) for p in params()]
    + [("chain", tuple[str, ...] | None, field(default=None)),
       ("cache", str, field(default="full")),  # the KV-cache policy, `NAME[:key=value,...]`
       ("semantics", str | None, field(default=None))],  # hf | vllm | llamacpp: read the settings as it does
    frozen=True,
    namespace={"stage_values": stage_values, "cache_spec": property(_cache_spec), "__doc__": __doc__,
               "__module__": __name__},
)
