"""The runtime: the only code that calls the model.

Every method (sample, probs, score, beam, the draft model and the target of speculative decoding) feeds tokens
through a :class:`Runtime`, which takes positions from its KV policy's ``seen`` count, calls
:func:`decodelab.core.engine.forward.forward` and tells the policy how many tokens it fed. So a policy that evicts,
re-rotates or quantizes works under every method, and positions are never inferred from what the cache happens to store.
"""

from __future__ import annotations

import time  # noqa: F401  (the clock reads time.perf_counter; tests replace it through this name)
from collections.abc import Iterator
from contextlib import nullcontext

import torch
from torch import Tensor

from ..errors import ConfigError
from ..kv import CacheSpec, KVPolicy, make_policy
from ..kv.attention import install_for
from .forward import forward, forward_attending, forward_with_queries, model_info
from .models import LoadedModel
from .run import clock


class Runtime:
    """A model and its KV policy. ``calls`` counts forwards (the prefill included); ``fed`` counts the tokens of the
    caller's sequence fed so far (its index space), while positions follow the policy's ``seen``."""

    def __init__(self, model, policy: KVPolicy):
        self.model, self.policy = model, policy
        self.device = policy.info.device
        self.calls = 0
        self.fed = 0
        self._compiled = None
        self.spec: CacheSpec | None = None  # the spec it was created from (Runtime.create)
        self.compile_s: float | None = None  # the first compiled call's seconds (compile_decode; None: not yet)
        # a rotating quantized cache attends in its rotated space: the model's attention wrapped for as long as this
        # runtime lives (None: the model's own attention; a cache with a space then rotates back, the same numbers)
        self._attention = install_for(model, policy.attention_space)

    @classmethod
    def create(cls, model, spec: CacheSpec | None = None, capacity: int | None = None,
               needs: frozenset[str] = frozenset()) -> Runtime:
        runtime = cls(model, make_policy(spec or CacheSpec(), model_info(model), capacity, needs))
        runtime.spec = spec or CacheSpec()  # what a warm-up runtime of the same kind is made from (engine/warmup.py)
        return runtime

    @property
    def seen(self) -> int:
        return self.policy.seen

    def feed(self, ids: Tensor, keep: str = "last") -> Tensor:
        """Run ``ids`` [B, n] at positions seen .. seen + n - 1; returns float32 logits [B, V] of the last position
        (``keep="last"``) or [B, n, V] of all of them (``keep="all"``)."""
        rewritten = self.policy.rewrite(ids, keep)  # None but for a policy that rewrites what is fed (recompute)
        if rewritten is not None:
            return self._feed_rewritten(ids, keep, rewritten)
        n = ids.shape[1]
        if n > 1 and self.policy.one_token_a_forward():
            return self._feed_one_by_one(ids, keep)
        positions = self.policy.positions(n)
        if positions.shape[0] != ids.shape[0]:
            positions = positions.expand(ids.shape[0], -1)
        mask = self.policy.attention_mask(n)  # None but for a policy that lays rows out itself (paged)
        with self.policy.attention_space if self._attention is not None else nullcontext():
            logits = self._forward(ids, positions, mask, keep)
        self.calls += 1
        self.fed += n
        self.policy.after_forward(n)
        return logits[:, -1] if keep == "last" else logits

    def _forward(self, ids: Tensor, positions: Tensor, mask: Tensor | None, keep: str) -> Tensor:
        n = ids.shape[1]
        if self._compiled is not None and n == 1 and keep == "last":
            logits = self._compiled_call(ids, positions)
        elif self.policy.wants_attentions(n):  # a score-based press (snapkv, h2o, ...) sees this forward's attention
            logits, attentions = forward_attending(self.model, ids, self.policy.model_cache, positions, mask,
                                                   logits_to_keep=1 if keep == "last" else 0)
            self.policy.observe_attentions(attentions)
        elif self.policy.wants_queries(n):  # a press that models future queries (expected attention)
            logits, queries = forward_with_queries(self.model, ids, self.policy.model_cache, positions, mask,
                                                   logits_to_keep=1 if keep == "last" else 0)
            self.policy.observe_queries(queries)
        else:
            logits = forward(self.model, ids, self.policy.model_cache, positions, attention_mask=mask,
                             logits_to_keep=1 if keep == "last" else 0, inference=self._compiled is None)
        return logits

    def _feed_one_by_one(self, ids: Tensor, keep: str) -> Tensor:
        rows = [self.feed(ids[:, i : i + 1], keep="last") for i in range(ids.shape[1])]
        return rows[-1] if keep == "last" else torch.stack(rows, dim=1)

    def _feed_rewritten(self, ids: Tensor, keep: str, rewritten: Iterator[tuple[Tensor, Tensor]]) -> Tensor:
        """The one hook for a policy that rewrites what is fed (``recompute``: the last W ids at fresh positions).
        ``rewritten`` (what ``rewrite(ids, keep)`` returned) yields (windows [B, k, m], positions [1, m]): k
        forwards of m ids each, run without a cache; the last logits of each are one wanted token's (the last of
        ``ids``, or each of them in order)."""
        b = ids.shape[0]
        rows = []
        for windows, positions in rewritten:
            k, m = windows.shape[1], windows.shape[2]
            logits = forward(self.model, windows.reshape(b * k, m), None, positions.expand(b * k, -1),
                             logits_to_keep=1)
            rows.append(logits[:, -1].view(b, k, -1))
            self.calls += 1
        self.fed += ids.shape[1]
        self.policy.after_forward(ids.shape[1])
        out = torch.cat(rows, dim=1)
        return out[:, -1] if keep == "last" else out

    def prefill(self, ids: Tensor, hold_last: bool = False, chunk: int | None = None) -> Tensor | None:
        """Feed a prompt [B, T] (in chunks of ``chunk`` tokens if given); returns the logits [B, V] for the token
        after it. ``hold_last`` feeds all but the last token and returns None: the caller feeds that token with
        the next block (speculative decoding verifies [last prompt token, drafts...] in one forward)."""
        end = ids.shape[1] - 1 if hold_last else ids.shape[1]
        step = chunk or max(end, 1)
        logits = None
        for start in range(0, end, step):
            logits = self.feed(ids[:, start : min(start + step, end)])
        return None if hold_last else logits

    def truncate(self, seen: int) -> None:
        """Forget every token from absolute position ``seen`` on."""
        self.fed -= self.policy.seen - seen
        self.policy.truncate(seen)

    def rollback(self, tokens: int) -> None:
        """Forget the last ``tokens`` fed (a rejected draft suffix), whatever positions they ran at."""
        if tokens:
            self.truncate(self.policy.seen - tokens)

    def reorder(self, rows: Tensor) -> None:
        self.policy.reorder(rows)

    def compile_decode(self) -> None:
        """Compile the one-token decode forward (static cache: fixed shapes, in-place updates). Compiled once per
        model and reused by every later run on it (the cache is an argument, so a new run's cache of the same shape
        does not recompile). A platform that cannot compile is refused at the first decode step."""
        compiled = getattr(self.model, "_decodelab_compiled_step", None)
        if compiled is None:
            model = self.model

            def one_token(ids: Tensor, positions: Tensor, cache) -> Tensor:
                return forward(model, ids, cache, positions, logits_to_keep=1, inference=False)

            # on CUDA the step is captured in CUDA graphs (mode reduce-overhead): its launches replayed as one
            mode = {"mode": "reduce-overhead"} if on_cuda(self.device) else {}
            compiled = torch.compile(one_token, dynamic=False, fullgraph=False, **mode)
            model._decodelab_compiled_step = compiled
        cache = self.policy.model_cache
        if on_cuda(self.device):
            def replay(ids: Tensor, positions: Tensor) -> Tensor:
                torch.compiler.cudagraph_mark_step_begin()
                return compiled(ids, positions, cache).clone()  # a graph's output is overwritten by its next replay

            self._compiled = replay
        else:
            self._compiled = lambda ids, positions: compiled(ids, positions, cache)
        self.compile_s = None  # seconds of the first compiled call (tracing and code generation, if any, included)

    def _compiled_call(self, ids: Tensor, positions: Tensor) -> Tensor:
        if self.compile_s is not None:
            return self._compiled(ids, positions)
        start = clock(self.device)
        try:
            logits = self._compiled(ids, positions)
        except Exception as exc:  # inductor needs a C++ toolchain on CPU, Triton on CUDA
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"--compile: torch.compile cannot compile here ({first}); run without --compile") \
                from exc
        self.compile_s = clock(self.device) - start
        return logits


def on_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def runtime_for(lm: LoadedModel, spec: CacheSpec, capacity: int, needs=frozenset(), compile: bool = False) -> Runtime:
    runtime = Runtime.create(lm.model, spec, capacity, frozenset(needs))
    if compile:
        runtime.compile_decode()  # compiles lazily: a platform that cannot is refused at the first decode step
    return runtime
