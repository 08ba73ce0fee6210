"""The served-engine client: a backend on an OpenAI-compatible server (vLLM first; SGLang and llama.cpp's server
through their adapters) that lists models, scores token ids and generates from token ids.

The client sends (:mod:`.transport`), the adapter of the server's kind builds the bodies and reads the answers
(:mod:`.adapter`), every answer becomes the records of :mod:`.wire`, whose numbers each say what they are. Nothing
but the URL given is ever contacted.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from ..backend import Capabilities
from .adapter import ADAPTERS, OWNERS, Adapter
from .transport import DEFAULT_TIMEOUT_S, EngineError, Transport
from .wire import VLLM_MODES, Generated, Labels, SamplingSettings, Scored


class ServedEngine:
    """A backend on an OpenAI-compatible server: list models, score token ids, generate from token ids."""

    def __init__(self, url: str, model: str | None = None, kind: str = "auto", logprobs_mode: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S, max_top_n: int = 20, transport: Transport | None = None):
        self.transport = transport or Transport(url, timeout)
        self._requested_model = model
        self._kind, self._mode, self._max_top_n = kind, logprobs_mode, max_top_n
        self._adapter = None
        self._model: str | None = None

    @property
    def url(self) -> str:
        return self.transport.url

    # discovery ------------------------------------------------------------------------------------------------

    def models(self) -> list[dict]:
        """The served models as the server lists them (``id``, ``owned_by``, ``max_model_len`` where given)."""
        resp = self.transport.get("/v1/models")
        data = resp.get("data") if isinstance(resp, dict) else None
        if not isinstance(data, list) or not data:
            raise self.transport.fail("GET /v1/models lists no model")
        return [dict(m) for m in data if isinstance(m, dict) and "id" in m]

    @property
    def model(self) -> str:
        if self._model is None:
            self._resolve()
        return self._model

    @property
    def adapter(self) -> Adapter:
        if self._adapter is None:
            self._resolve()
        return self._adapter

    @property
    def capabilities(self) -> Capabilities:
        return self.adapter.capabilities

    def _resolve(self) -> None:
        served = self.models()
        names = [m["id"] for m in served]
        if self._requested_model is None:
            if len(names) > 1:
                raise self.transport.fail(f"serves {len(names)} models ({', '.join(names)}); name one")
            chosen = served[0]
        else:
            match = [m for m in served if m["id"] == self._requested_model]
            if not match:
                raise self.transport.fail(f"serves {', '.join(repr(n) for n in names)}, "
                                          f"not {self._requested_model!r} (model name mismatch)")
            chosen = match[0]
        kind = self._kind if self._kind != "auto" else OWNERS.get(str(chosen.get("owned_by", "")).lower())
        if kind not in ADAPTERS:
            raise self.transport.fail(f"cannot tell the server kind (owned_by {chosen.get('owned_by')!r}); "
                                      f"give one of {', '.join(ADAPTERS)}")
        try:
            self._adapter = ADAPTERS[kind](self._mode or ADAPTERS[kind].default_mode, self._max_top_n)
        except EngineError as e:
            raise self.transport.fail(str(e)) from None
        self._model = chosen["id"]

    def labels(self, top_n: int, values: str | None = None) -> Labels:
        return Labels(values or self.adapter.values, top_n, self.adapter.kind)

    # scoring and generation -----------------------------------------------------------------------------------

    def score(self, token_ids: Sequence[int], top_n: int = 5) -> Scored:
        """Per-position raw logprobs (raw logits on a vLLM in a logits mode), ranks and top-N alternatives of a
        token sequence, teacher-forced."""
        ids = _check_ids(self.transport, token_ids, minimum=2)
        self._check_top_n(top_n)
        if not self.capabilities.score:
            raise self.transport.fail(f"{self.adapter.kind} cannot score a sequence (no prompt logprobs)")
        body = self.adapter.score_body(self.model, ids, top_n)
        resp = self.transport.post(self.adapter.path, body)
        self._check_answer_model(resp)
        positions = self.adapter.read_score(self.transport, body, resp)
        return Scored(self.model, tuple(ids), positions, self.labels(top_n, self.adapter.prompt_values), body)

    def generate(self, prompt_ids: Sequence[int], settings: SamplingSettings) -> Generated:
        """A continuation of prompt_ids under settings, every sampling field written into the request."""
        ids = _check_ids(self.transport, prompt_ids, minimum=1)
        self._check_top_n(settings.logprobs)
        if settings.logprobs < 1:
            raise self.transport.fail("generate needs logprobs >= 1 (each token's logprob is read)")
        refused = self.adapter.check(settings)
        if refused:
            raise self.transport.fail(refused)
        body = self.adapter.generate_body(self.model, ids, settings)
        started = time.perf_counter()
        resp = self.transport.post(self.adapter.path, body)
        seconds = time.perf_counter() - started
        self._check_answer_model(resp)
        new_ids, steps, finish = self.adapter.read_generation(self.transport, body, resp)
        return Generated(self.model, tuple(ids), new_ids, steps, finish, self.labels(settings.logprobs), body,
                         seconds, self.adapter.cached_tokens(resp))

    # the server's tokenizer, its prefix cache, its logprobs mode ------------------------------------------------

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int] | None:
        """The server's token ids for ``text`` (None: the server kind has no tokenize endpoint)."""
        if self.adapter.tokenize_path is None:
            return None
        resp = self.transport.post(self.adapter.tokenize_path,
                                   self.adapter.tokenize_body(self.model, text, add_special_tokens))
        tokens = resp.get("tokens") if isinstance(resp, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(i, int) for i in tokens):
            raise self.transport.fail(f"POST {self.adapter.tokenize_path}: the answer has no token ids")
        return tokens

    def prefix_cache_counters(self) -> dict[str, float] | None:
        """The server's prefix-cache counters since it started, in tokens: ``hits`` (read from the cache) and
        ``queries`` (looked up), summed over its engines; None where the server kind exports none. Server-wide:
        other clients' requests count too."""
        if self.adapter.metrics_path is None:
            return None
        return self.adapter.prefix_cache_counters(self.transport.get_text(self.adapter.metrics_path))

    def detect_logprobs_mode(self, probe_ids: Sequence[int], tolerance: float = 1e-3) -> str:
        """What the server's generation logprobs are, found by one probe, not assumed: one token at temperature
        0.5 with top-k 2 (logprobs 2), then the same sequence scored (prompt values: raw, in every mode). For the
        two kept tokens a, b with generation values v and replay values r (docs/engines.md, "the probe"):

            raw modes:        v_a - v_b = r_a - r_b              (logits: some value > 0, or sum exp v > 1)
            processed modes:  v_a - v_b = (r_a - r_b) / 0.5      (logprobs: log(exp v_a + exp v_b) = 0, the two
                                                                  kept tokens renormalised)

        The adapter is then rebuilt for the mode found, which is returned."""
        g = self.generate(probe_ids, PROBE)
        step = g.steps[0]
        replay = self.score(list(probe_ids) + [step.token_id], top_n=2).positions[-1]
        v = {a.token_id: a.logprob for a in step.top if math.isfinite(a.logprob)}
        r = {a.token_id: a.logprob for a in replay.top}
        pair = [t for t in v if t in r][:2]
        if len(pair) < 2 or abs(r[pair[0]] - r[pair[1]]) < 10 * tolerance:
            raise self.transport.fail("cannot tell the server's --logprobs-mode: the probe's two kept tokens are "
                                      "tied or not both listed")
        a, b = pair
        dv, dr = v[a] - v[b], r[a] - r[b]
        logits = max(v.values()) > tolerance or math.fsum(math.exp(x) for x in v.values()) > 1 + tolerance
        if abs(dv - dr) < tolerance:
            mode = "raw_logits" if logits else "raw_logprobs"
        elif abs(dv - dr / PROBE.temperature) < tolerance:
            normalised = abs(math.log(math.fsum(math.exp(x) for x in (v[a], v[b])))) < tolerance
            mode = "processed_logprobs" if normalised else "processed_logits"
        else:
            raise self.transport.fail(f"cannot tell the server's --logprobs-mode: the probe's logprob gap {dv:.4f} "
                                      f"is neither the raw gap {dr:.4f} nor the tempered one {dr / 0.5:.4f}")
        self.use_mode(mode)
        return mode

    def use_mode(self, logprobs_mode: str) -> None:
        """Read the generation values as ``logprobs_mode`` from now on (the adapter rebuilt for it)."""
        try:
            self._adapter = ADAPTERS[self.adapter.kind](logprobs_mode, self._max_top_n)
        except EngineError as e:
            raise self.transport.fail(str(e)) from None
        self._mode = logprobs_mode

    @property
    def logprobs_mode(self) -> str:
        """The mode the generation values are read as (the adapter's; see :meth:`detect_logprobs_mode`)."""
        return {v: k for k, v in VLLM_MODES.items()}[self.adapter.values]

    def _check_top_n(self, n: int) -> None:
        cap = self.capabilities.max_top_n
        if n < 0 or (cap is not None and n > cap):
            raise self.transport.fail(f"top {n} logprobs asked; the limit is 0..{cap} (vLLM's --max-logprobs, "
                                      f"default 20; give max_top_n for a server started with more)")

    def _check_answer_model(self, resp) -> None:
        answered = resp.get("model") if isinstance(resp, dict) else None
        if answered is not None and self.adapter.answers_model and answered != self.model:
            raise self.transport.fail(f"answered for model {answered!r}, not {self.model!r} (model name mismatch)")


# the logprobs-mode probe: two kept tokens (top-k 2) at temperature 0.5, seeded, one token
PROBE = SamplingSettings(max_tokens=1, temperature=0.5, top_k=2, seed=0, logprobs=2, ignore_eos=True)


def _check_ids(t: Transport, ids: Sequence[int], minimum: int) -> list[int]:
    out = [int(i) for i in ids]
    if len(out) < minimum:
        raise t.fail(f"{len(out)} token ids given; at least {minimum} needed")
    if any(i < 0 for i in out):
        raise t.fail("token ids must be >= 0")
    return out
