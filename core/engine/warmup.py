"""Warm-up, apart from every timed part (issue 34): a model's first calls in a process pay costs no later call pays
(CUDA kernel loading and cuBLAS handles, the caching allocator growing, oneDNN primitives on the CPU), so a timing
that includes them is no steady-state figure, and of two runs compared the first would pay them alone.

* :func:`warm_up`: once per model and decode width per process, a short one-row prefill and a few one-token
  decodes at the run's width (``rows``: beam search decodes its beams together, and a GPU's kernels are chosen per
  shape) through a runtime of its own under the run's kind of cache (no run's cache is touched), before any
  stopwatch starts; its seconds are the run's ``warmup_s``.
* :func:`interleaved`: the comparison rule. Each variant is called once untimed (its own warm-up, reported apart),
  then ``rounds`` timed rounds, the order rotated each round, so whichever runs first pays no more than the others.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import ConfigError
from ..kv import CacheSpec, make_policy
from .forward import model_info
from .run import clock
from .runtime import Runtime

WARM_TOKENS = 8  # the warm-up prefill's length
WARM_DECODES = 2  # one-token forwards after it (the decode kernels differ from the prefill's)

# The runtime's own feed, as defined: the warm-up's forwards are no run's, so a wrapper a caller puts on
# Runtime.feed to watch a run (a test's interrupt after the n-th token, say) does not see them.
FEED = Runtime.feed

_warm: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {decode rows: seconds its warm-up took}


def device_of(model) -> torch.device:
    return next(model.parameters()).device


def warm_up(model, spec: CacheSpec | None = None, rows: int = 1) -> float:
    """Warm ``model`` up once in this process for decodes of ``rows`` rows, through a runtime of its own under
    ``spec`` (the run's kind of cache: its kernels are the ones warmed): the prompt's row is prefilled, copied to
    ``rows`` rows (as beam search expands its prompt) and decoded. The seconds it took, 0.0 when it was warm already
    at that width (a model that is no ``torch.nn.Module`` with parameters, a test's stand-in, has nothing to warm)."""
    if not isinstance(model, torch.nn.Module) or rows in _warm.get(model, {}):
        return 0.0
    try:
        device = device_of(model)
    except StopIteration:
        return 0.0
    start = clock(device)
    # a runtime of its own (the only caller of a model), made apart from Runtime.create: no run's runtime
    runtime = Runtime(model, warm_policy(model, spec, rows))
    ids = torch.zeros(1, WARM_TOKENS, dtype=torch.long, device=device)
    FEED(runtime, ids)
    if rows > 1:
        runtime.reorder(torch.zeros(rows, dtype=torch.long, device=device))
    for _ in range(WARM_DECODES):
        FEED(runtime, torch.zeros(rows, 1, dtype=torch.long, device=device))
    seconds = clock(device) - start
    _warm.setdefault(model, {})[rows] = seconds
    return seconds


def warm_policy(model, spec: CacheSpec | None, rows: int = 1):
    """The run's kind of cache at the warm-up's size (able to copy rows when ``rows`` > 1); where that is refused (a
    policy that needs more room than the warm-up's few tokens), the default cache: the warm-up never fails a run that
    would run."""
    info, capacity = model_info(model), WARM_TOKENS + WARM_DECODES
    needs = frozenset({"reorder", "rows"}) if rows > 1 else frozenset()
    try:
        return make_policy(spec or CacheSpec(), info, capacity, needs)
    except ConfigError:
        return make_policy(CacheSpec(), info, capacity, needs)


def is_warm(model) -> bool:
    return model in _warm


def rotated(names: list, r: int) -> list:
    """Round ``r``'s order: the list rotated by r, so over len(names) rounds each name runs first once."""
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


@dataclass
class Interleaved:
    """Per variant: the untimed warm-up call's seconds, each timed round's seconds and the last call's result."""

    warmup_s: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, list[float]] = field(default_factory=dict)
    results: dict[str, object] = field(default_factory=dict)
    order: list[list[str]] = field(default_factory=list)  # the order of each round

    def median(self, name: str) -> float:
        ordered = sorted(self.seconds[name])
        n = len(ordered)
        return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2.0


def interleaved(variants: dict[str, Callable[[], object]], rounds: int, device, warm: bool = True,
                timer: Callable[[], float] | None = None) -> Interleaved:
    """Call each variant once untimed (``warm``), then ``rounds`` rounds of every variant, round r starting at
    variant r mod n (a rotation: each variant runs first equally often); each call timed on the one clock
    (``timer`` replaces it in tests)."""
    names = list(variants)
    read = timer or (lambda: clock(device))
    out = Interleaved(seconds={name: [] for name in names})
    if warm:
        for name in names:
            start = read()
            out.results[name] = variants[name]()
            out.warmup_s[name] = read() - start
    for r in range(rounds):
        order = rotated(names, r)
        out.order.append(order)
        for name in order:
            start = read()
            out.results[name] = variants[name]()
            out.seconds[name].append(read() - start)
    return out
