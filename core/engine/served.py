"""A served model as a decodelab backend: an OpenAI-compatible completions server (vLLM first; SGLang and
llama.cpp's server through small adapters), reached over HTTP with the standard library only.

Every number this module returns says what it is:

* ``values`` -- ``raw`` (log softmax of the model's logits at temperature 1, before any processor), ``processed``
  (log softmax after the engine's processors: allowed ids, bad words, min_tokens, logit bias, penalties,
  temperature, min-p, top-k, top-p; renormalised over the kept set), or ``raw_logits`` / ``processed_logits``
  (unnormalised logits, where a vLLM server runs with ``--logprobs-mode raw_logits|processed_logits``).
* ``top`` -- the alternatives are the engine's top N only (truncated): each listed value is exact as the
  engine computed it (float32), but the tokens outside the list are unknown; ``tail_mass`` bounds their total
  probability (1 - the listed probabilities' sum).

A prompt position's value in vLLM is always raw (prompt tokens never pass through the sampler): the raw logprob,
or the raw logit when the server runs in a logits mode. Where the facts come from: ``docs/engines.md``.

Every failure is one :class:`EngineError` line naming ``--engine URL`` and what happened. Nothing but the URL
given is ever contacted: no proxy from the environment, no redirect followed.
"""

from __future__ import annotations

import json
import math
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import ConfigError
from .backend import Capabilities

RAW = "raw"
PROCESSED = "processed"
RAW_LOGITS = "raw_logits"
PROCESSED_LOGITS = "processed_logits"
# vLLM's --logprobs-mode values -> what its numbers are (vllm/config/model.py LogprobsMode)
VLLM_MODES = {"raw_logprobs": RAW, "processed_logprobs": PROCESSED, "raw_logits": RAW_LOGITS,
              "processed_logits": PROCESSED_LOGITS}
LOGPROB_KINDS = (RAW, PROCESSED)  # values that are log-probabilities (sum of exp over the vocabulary is 1)

VLLM_MASKED = -9999.0  # vLLM writes -inf (a token the processors removed) as -9999.0: JSON has no -inf
VLLM_MIN_TEMPERATURE = 0.01  # vllm/sampling_params.py _MAX_TEMP: 0 < t < 0.01 is silently raised to 0.01
VLLM_MAX_BIAS = 100.0  # vllm/sampling_params.py from_optional: each logit bias is clamped to [-100, 100]
DEFAULT_TIMEOUT_S = 60.0


class EngineError(ConfigError):
    """A served engine that cannot be reached or answers something decodelab cannot use; one line."""


# ---------------------------------------------------------------------------------------------------------------
# records


@dataclass(frozen=True)
class Alternative:
    """One listed candidate at a position: its id and its value (a logprob or a logit, per the result's label)."""

    token_id: int
    logprob: float


@dataclass(frozen=True)
class Position:
    """One token with its value, its rank (the number of tokens at least as likely, so 1 = the most likely; None
    where the engine gave none and the token is outside the listed top N) and the engine's top-N alternatives,
    highest first."""

    index: int  # position in the scored sequence, or step in a generation
    token_id: int
    logprob: float | None  # None: the first prompt token (nothing before it to condition on)
    rank: int | None
    top: tuple[Alternative, ...]
    defects: tuple[str, ...] = ()  # what the engine's answer got wrong here (check-logprobs reports them)

    def tail_mass(self) -> float | None:
        """Probability outside the listed tokens: 1 - sum(exp(top)). An upper bound on any unlisted token's
        probability; meaningful only when the values are logprobs."""
        if not self.top:
            return None
        return max(0.0, 1.0 - math.fsum(math.exp(a.logprob) for a in self.top))


@dataclass(frozen=True)
class Labels:
    """What a result's numbers are: ``values`` (raw / processed / raw_logits / processed_logits), the requested
    top N (truncated: tokens outside it are unknown), and the engine that computed them."""

    values: str
    top_n: int
    engine: str  # vllm, sglang, llamacpp
    exact: bool = True  # each listed number is the engine's own (float32), not an estimate

    def describe(self) -> str:
        return f"{self.values} values from {self.engine}, exact for the listed tokens, top-{self.top_n} truncated"


@dataclass(frozen=True)
class Scored:
    """A token sequence scored teacher-forced: ``positions[i]`` is token i given tokens 0..i-1 (position 0 has no
    logprob)."""

    model: str
    token_ids: tuple[int, ...]
    positions: tuple[Position, ...]
    labels: Labels
    request: dict = field(repr=False)

    @property
    def defects(self) -> tuple[str, ...]:
        return tuple(d for p in self.positions for d in p.defects)


@dataclass(frozen=True)
class Generated:
    """A continuation: each step's sampled token with its value and top-N alternatives."""

    model: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    steps: tuple[Position, ...]
    finish_reason: str | None  # "length", "stop" (EOS or a stop token), ...
    labels: Labels
    request: dict = field(repr=False)
    seconds: float = math.nan  # the request's wall time, sent to answered
    cached_tokens: int | None = None  # prompt tokens the server read from its prefix cache, where it says

    @property
    def defects(self) -> tuple[str, ...]:
        return tuple(d for p in self.steps for d in p.defects)


@dataclass(frozen=True)
class SamplingSettings:
    """Every sampling field a request writes. Defaults are the neutral values (no processor active), never the
    server's: a field left out of a request is filled from the model's generation_config by vLLM."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # divides positive logits, multiplies negative ones, of tokens seen anywhere
    presence_penalty: float = 0.0  # subtracted once from each token generated so far
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int = 5  # top N returned per step
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings (the server matches them on its own detokenised text)
    include_stop_str_in_output: bool = False
    allowed_token_ids: tuple[int, ...] = ()  # an allow-list mask (empty: every token)
    bad_words: tuple[str, ...] = ()  # texts never to produce (the server tokenises them)


# ---------------------------------------------------------------------------------------------------------------
# transport


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect would send the request to another address than the one given: never follow one (the 3xx
    answer then surfaces as an HTTPError)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


# ProxyHandler({}) ignores http_proxy/https_proxy: the request goes to the given host and nowhere else
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


class _Object(dict):
    """A JSON object that remembers the keys it held more than once (json.loads keeps only the last value)."""

    repeated: dict

    @classmethod
    def from_pairs(cls, pairs: list) -> _Object:
        obj = cls(pairs)
        counts = Counter(key for key, _ in pairs)
        obj.repeated = {k: [v for key, v in pairs if key == k] for k, n in counts.items() if n > 1}
        return obj


def _repeated(obj) -> dict:
    return getattr(obj, "repeated", {})


def loads(text: str | bytes):
    """JSON as an engine wrote it, every object remembering the keys it held more than once (``repeated``):
    a repeated key is a defect Python's json would hide by keeping the last value."""
    return json.loads(text, object_pairs_hook=_Object.from_pairs)


def repeated_keys(obj) -> dict:
    """The keys an object read by :func:`loads` held more than once -> every value they had."""
    return _repeated(obj)


def base_url(url: str) -> str:
    """``http://host:port`` from what a user gives (a trailing ``/`` or ``/v1`` is dropped)."""
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise EngineError(f"--engine {url}: not an http(s) URL (for example http://127.0.0.1:8000)")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


class Transport:
    """JSON over HTTP to one base URL, with a timeout; each failure becomes one EngineError line."""

    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT_S):
        self.url = base_url(url)
        self.timeout = timeout

    def fail(self, what: str) -> EngineError:
        return EngineError(f"--engine {self.url}: {what}")

    def get(self, path: str) -> dict:
        return self._send(urllib.request.Request(self.url + path, method="GET"))

    def get_text(self, path: str) -> str:
        """A plain-text answer (Prometheus metrics)."""
        req = urllib.request.Request(self.url + path, method="GET")
        status, raw = self.exchange(req, f"GET {path}")
        if status >= 300:
            raise self.fail(f"GET {path}: HTTP {status}: {_server_message(raw)}")
        return raw.decode(errors="replace")

    def post(self, path: str, body: dict) -> dict:
        data = json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        return self._send(req)

    def _send(self, req: urllib.request.Request) -> dict:
        where = f"{req.method} {urllib.parse.urlsplit(req.full_url).path}"
        status, raw = self.exchange(req, where)
        if 300 <= status < 400:
            raise self.fail(f"{where}: HTTP {status}: redirect refused (only the URL given is contacted)")
        if status >= 400:
            raise self.fail(f"{where}: HTTP {status}: {_server_message(raw)}")
        try:
            return loads(raw)
        except ValueError:
            raise self.fail(f"{where}: the answer is not JSON ({raw[:80]!r})") from None

    def exchange(self, req: urllib.request.Request, where: str) -> tuple[int, bytes]:
        """One HTTP round trip: (status, body). An HTTP error status is an answer; no answer is an EngineError."""
        try:
            with _OPENER.open(req, timeout=self.timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, _error_body(e)
        except (socket.timeout, TimeoutError):
            raise self.fail(f"{where}: no answer within {self.timeout:g} s (timeout)") from None
        except urllib.error.URLError as e:
            raise self.fail(f"{where}: {_reason(e.reason)}") from None
        except OSError as e:
            raise self.fail(f"{where}: {_reason(e)}") from None


def _error_body(e: urllib.error.HTTPError) -> bytes:
    try:
        return e.read() or b""
    except OSError:
        return b""


def _reason(reason) -> str:
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused (is the server running?)"
    if isinstance(reason, (socket.timeout, TimeoutError)):
        return "no answer in time (timeout)"
    if isinstance(reason, socket.gaierror):
        return f"host not found ({reason.strerror})"
    return str(getattr(reason, "strerror", None) or reason)


def _server_message(raw: bytes) -> str:
    """The server's own error text: OpenAI's {"error": {"message": ...}}, SGLang's {"message": ...}, or the body."""
    body = raw.decode(errors="replace")
    try:
        data = json.loads(body)
    except ValueError:
        return _one_line(body) or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict) and err.get("message"):
            return _one_line(str(err["message"]))
        if isinstance(err, str):
            return _one_line(err)
    return _one_line(body)


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------------------------
# parsing helpers shared by the adapters


def _finite(value: float, masked: float | None) -> float:
    """An engine's value with its stand-in for -inf turned back into -inf."""
    return -math.inf if masked is not None and value <= masked else float(value)


read_value = _finite  # public: check-logprobs reads files with the same rule


def _sorted_top(entries: dict[int, float], n: int) -> tuple[Alternative, ...]:
    """The n highest entries, highest first (ties by token id, as torch.topk's order is not part of any API)."""
    ranked = sorted(entries.items(), key=lambda kv: (-kv[1], kv[0]))
    return tuple(Alternative(t, lp) for t, lp in ranked[:n])


def _rank_in_top(token_id: int, logprob: float | None, top: tuple[Alternative, ...]) -> int | None:
    """The number of listed tokens at least as likely (vLLM's rule: ties count against; exact when every token
    tied with it is listed); None when the token is not among them."""
    if logprob is None or all(a.token_id != token_id for a in top):
        return None
    return sum(1 for a in top if a.logprob >= logprob)


def _order_defect(keys: list[int], values: dict[int, float], expected_first: int | None) -> str | None:
    """vLLM lists the chosen token first and then the top N; any other order out of rank is a defect."""
    rest = [k for k in keys if k != expected_first] if expected_first is not None else keys
    if any(values[a] < values[b] for a, b in zip(rest, rest[1:])):
        return "top logprobs not sorted (the engine's top-N order is broken)"
    return None


# ---------------------------------------------------------------------------------------------------------------
# adapters: one per server kind, each builds its request bodies and reads its answers


class VllmAdapter:
    """vLLM's /v1/completions (vllm/entrypoints/openai/completion/protocol.py CompletionRequest)."""

    kind = "vllm"
    path = "/v1/completions"
    tokenize_path = "/tokenize"
    metrics_path = "/metrics"  # Prometheus text: vllm:prefix_cache_hits_total, vllm:prefix_cache_queries_total
    masked = VLLM_MASKED

    def __init__(self, logprobs_mode: str = "raw_logprobs", max_top_n: int = 20):
        if logprobs_mode not in VLLM_MODES:
            raise EngineError(f"logprobs mode {logprobs_mode!r}; allowed: {', '.join(VLLM_MODES)}")
        self.values = VLLM_MODES[logprobs_mode]
        # prompt tokens skip the sampler: raw log softmax, or raw logits in a logits mode
        # (v1/worker/gpu_model_runner.py _get_prompt_logprobs_dict)
        self.prompt_values = RAW if self.values in LOGPROB_KINDS else RAW_LOGITS
        self.capabilities = Capabilities(score=True, generate=True, seeded=True, prompt_ranks=True,
                                         full_logits=False, max_top_n=max_top_n)

    # requests -------------------------------------------------------------------------------------------------

    def check(self, s: SamplingSettings) -> str | None:
        """A setting vLLM would change without saying so: refused rather than silently different."""
        if 0 < s.temperature < VLLM_MIN_TEMPERATURE:
            return (f"temperature {s.temperature:g}: vLLM raises 0 < t < {VLLM_MIN_TEMPERATURE:g} to "
                    f"{VLLM_MIN_TEMPERATURE:g}; use 0 (greedy) or at least {VLLM_MIN_TEMPERATURE:g}")
        clamped = [t for t, b in s.logit_bias.items() if abs(b) > VLLM_MAX_BIAS]
        if clamped:
            return f"logit bias of token {clamped[0]}: vLLM clamps biases to [-100, 100]"
        return None

    def score_body(self, model: str, ids: Sequence[int], top_n: int) -> dict:
        # prompt_logprobs are computed from the raw model output; max_tokens must be >= 1 (0 only with echo)
        return {"model": model, "prompt": list(ids), "prompt_logprobs": top_n, "max_tokens": 1,
                "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                "presence_penalty": 0.0, "frequency_penalty": 0.0, "seed": None, "n": 1, "echo": False,
                "stream": False, "add_special_tokens": False, "return_tokens_as_token_ids": True,
                "return_token_ids": True}

    def generate_body(self, model: str, ids: Sequence[int], s: SamplingSettings) -> dict:
        return {"model": model, "prompt": list(ids), "max_tokens": s.max_tokens, "min_tokens": s.min_tokens,
                "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p,
                "repetition_penalty": s.repetition_penalty, "presence_penalty": s.presence_penalty,
                "frequency_penalty": s.frequency_penalty, "seed": s.seed, "ignore_eos": s.ignore_eos,
                "logprobs": s.logprobs, "logit_bias": {str(t): b for t, b in s.logit_bias.items()},
                "stop_token_ids": list(s.stop_token_ids), "stop": list(s.stop),
                "allowed_token_ids": list(s.allowed_token_ids) or None, "bad_words": list(s.bad_words),
                "n": 1, "echo": False, "stream": False, "skip_special_tokens": False,
                "include_stop_str_in_output": s.include_stop_str_in_output, "add_special_tokens": False,
                "return_tokens_as_token_ids": True, "return_token_ids": True}

    def tokenize_body(self, model: str, text: str, add_special_tokens: bool) -> dict:
        # vllm/entrypoints/serve/tokenize/protocol.py TokenizeCompletionRequest
        return {"model": model, "prompt": text, "add_special_tokens": add_special_tokens}

    # answers --------------------------------------------------------------------------------------------------

    @staticmethod
    def cached_tokens(resp: dict) -> int | None:
        """usage.prompt_tokens_details.cached_tokens: only a server run with --enable-prompt-tokens-details
        writes it."""
        details = ((resp.get("usage") or {}).get("prompt_tokens_details") or {}) if isinstance(resp, dict) else {}
        value = details.get("cached_tokens")
        return int(value) if isinstance(value, int) else None

    def read_score(self, t: Transport, body: dict, resp: dict) -> tuple[Position, ...]:
        choice = _first_choice(t, resp)
        plp = choice.get("prompt_logprobs")
        ids = body["prompt"]
        if not isinstance(plp, list):
            raise t.fail("the answer has no prompt_logprobs (choices[0].prompt_logprobs is missing)")
        if len(plp) != len(ids):
            raise t.fail(f"prompt_logprobs cover {len(plp)} positions for {len(ids)} prompt tokens")
        return tuple(self._prompt_position(t, i, tok, plp[i], body["prompt_logprobs"]) for i, tok in enumerate(ids))

    def _prompt_position(self, t: Transport, i: int, token_id: int, entry, top_n: int) -> Position:
        if entry is None:
            if i == 0:
                return Position(0, token_id, None, None, ())
            raise t.fail(f"prompt_logprobs[{i}] is null (only the first position has none)")
        defects = [f"position {i}: token {k} listed {len(v)} times" for k, v in _repeated(entry).items()]
        values = {int(k): _finite(v["logprob"], self.masked) for k, v in entry.items()}
        if token_id not in values:
            raise t.fail(f"prompt_logprobs[{i}] has no entry for the prompt token {token_id}")
        # vLLM's rank: the number of tokens at least as likely as this one (1 = the most likely)
        rank = entry[str(token_id)].get("rank")
        order = _order_defect([int(k) for k in entry], values, expected_first=token_id)
        if order:
            defects.append(f"position {i}: {order}")
        return Position(i, token_id, values[token_id], rank, _sorted_top(values, top_n), tuple(defects))

    def read_generation(self, t: Transport, body: dict, resp: dict) -> tuple[tuple[int, ...], tuple[Position, ...],
                                                                          str | None]:
        choice = _first_choice(t, resp)
        lp = choice.get("logprobs")
        if not isinstance(lp, dict) or not isinstance(lp.get("tokens"), list):
            raise t.fail("the answer has no logprobs (choices[0].logprobs is null); was logprobs sent?")
        ids = tuple(_token_id(t, tok) for tok in lp["tokens"])
        echoed = choice.get("token_ids")
        if echoed is not None and tuple(echoed) != ids:
            raise t.fail(f"token_ids {list(echoed)[:8]} disagree with the logprobs' tokens {list(ids)[:8]}")
        tops = lp.get("top_logprobs") or []
        if len(tops) != len(ids) or len(lp.get("token_logprobs") or []) != len(ids):
            raise t.fail(f"logprobs cover {len(tops)} steps for {len(ids)} tokens")
        steps = tuple(self._step(t, i, tok, lp["token_logprobs"][i], tops[i], body["logprobs"])
                      for i, tok in enumerate(ids))
        return ids, steps, choice.get("finish_reason")

    def _step(self, t: Transport, i: int, token_id: int, logprob, entry, top_n: int) -> Position:
        if logprob is None or not isinstance(entry, dict):
            raise t.fail(f"step {i} has no logprob (top_logprobs[{i}] is null)")
        defects = [f"step {i}: token {_token_id(t, k)} listed {len(v)} times in top logprobs"
                   + ("" if len(set(v)) == 1 else f" with different values {v}")
                   for k, v in _repeated(entry).items()]
        keys = [_token_id(t, k) for k in entry]
        values = {_token_id(t, k): _finite(v, self.masked) for k, v in entry.items()}
        value = _finite(logprob, self.masked)
        if token_id in values and values[token_id] != value:
            defects.append(f"step {i}: token {token_id} has logprob {value} but {values[token_id]} in top logprobs")
        order = _order_defect(keys, values, expected_first=token_id)
        if order:
            defects.append(f"step {i}: {order}")
        top = _sorted_top(values, top_n)
        return Position(i, token_id, value, _rank_in_top(token_id, value, top), top, tuple(defects))


def _first_choice(t: Transport, resp: dict) -> dict:
    choices = resp.get("choices") if isinstance(resp, dict) else None
    if not choices or not isinstance(choices[0], dict):
        raise t.fail("the answer has no choices")
    return choices[0]


def _token_id(t: Transport, token) -> int:
    """vLLM's ``token_id:N`` (sent with return_tokens_as_token_ids); a token text cannot be mapped back safely."""
    if isinstance(token, str) and token.startswith("token_id:") and token[9:].lstrip("-").isdigit():
        return int(token[9:])
    raise t.fail(f"token {token!r} is text, not token_id:N (the server ignored return_tokens_as_token_ids)")


class SglangAdapter:
    """SGLang's native /generate (sglang/srt/managers/io_struct.py GenerateReqInput): token ids in and out.

    Its output logprobs are computed after temperature (and, in the versions read, renormalised over top-p)
    unless the server runs with SGLANG_RETURN_ORIGINAL_LOGPROB=1; scoring runs at temperature 1, so prompt
    logprobs are raw either way."""

    kind = "sglang"
    path = "/generate"
    tokenize_path = None  # not in the versions read
    metrics_path = None
    masked = None
    prompt_values = RAW
    cached_tokens = staticmethod(lambda resp: None)

    def __init__(self, logprobs_mode: str = "processed_logprobs", max_top_n: int | None = None):
        if logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise EngineError(f"SGLang logprobs are raw_logprobs (SGLANG_RETURN_ORIGINAL_LOGPROB=1) "
                              f"or processed_logprobs, not {logprobs_mode!r}")
        self.values = VLLM_MODES[logprobs_mode]
        self.capabilities = Capabilities(score=True, generate=True, seeded=True, prompt_ranks=False,
                                         full_logits=False, max_top_n=max_top_n)

    def check(self, s: SamplingSettings) -> str | None:
        if s.allowed_token_ids or s.bad_words:
            return "allowed_token_ids / bad_words: SGLang's /generate has no such field"
        return None

    def _sampling(self, s: SamplingSettings) -> dict:
        return {"max_new_tokens": s.max_tokens, "min_new_tokens": s.min_tokens, "temperature": s.temperature,
                "top_p": s.top_p, "top_k": s.top_k if s.top_k > 0 else -1, "min_p": s.min_p,
                "repetition_penalty": s.repetition_penalty, "presence_penalty": s.presence_penalty,
                "frequency_penalty": s.frequency_penalty, "sampling_seed": s.seed, "ignore_eos": s.ignore_eos,
                "logit_bias": {str(t): b for t, b in s.logit_bias.items()},
                "stop_token_ids": list(s.stop_token_ids), "stop": list(s.stop), "skip_special_tokens": False, "n": 1}

    def score_body(self, model: str, ids: Sequence[int], top_n: int) -> dict:
        sampling = self._sampling(SamplingSettings(max_tokens=1, logprobs=top_n))
        return {"input_ids": list(ids), "sampling_params": sampling, "return_logprob": True,
                "logprob_start_len": 0, "top_logprobs_num": top_n, "return_text_in_logprobs": False}

    def generate_body(self, model: str, ids: Sequence[int], s: SamplingSettings) -> dict:
        return {"input_ids": list(ids), "sampling_params": self._sampling(s), "return_logprob": True,
                "logprob_start_len": -1, "top_logprobs_num": s.logprobs, "return_text_in_logprobs": False}

    def read_score(self, t: Transport, body: dict, resp: dict) -> tuple[Position, ...]:
        meta = _meta(t, resp)
        lps, tops = meta.get("input_token_logprobs"), meta.get("input_top_logprobs")
        ids = body["input_ids"]
        if not isinstance(lps, list) or len(lps) != len(ids):
            raise t.fail("the answer has no input_token_logprobs for every prompt token")
        return tuple(self._position(t, i, lps[i], (tops or [None] * len(ids))[i], body["top_logprobs_num"])
                     for i in range(len(ids)))

    def read_generation(self, t: Transport, body: dict, resp: dict):
        meta = _meta(t, resp)
        lps, tops = meta.get("output_token_logprobs"), meta.get("output_top_logprobs")
        if not isinstance(lps, list):
            raise t.fail("the answer has no output_token_logprobs (was return_logprob sent?)")
        steps = tuple(self._position(t, i, lps[i], (tops or [None] * len(lps))[i], body["top_logprobs_num"])
                      for i in range(len(lps)))
        finish = meta.get("finish_reason")
        return tuple(p.token_id for p in steps), steps, finish.get("type") if isinstance(finish, dict) else finish

    def _position(self, t: Transport, i: int, triple, top, top_n: int) -> Position:
        # each entry is (logprob, token_id, text or None); the first prompt token's logprob is None
        logprob, token_id = triple[0], int(triple[1])
        values = {int(e[1]): float(e[0]) for e in (top or []) if e[0] is not None}
        listed = _sorted_top(values, top_n)
        value = None if logprob is None else float(logprob)
        return Position(i, token_id, value, _rank_in_top(token_id, value, listed), listed)


def _meta(t: Transport, resp) -> dict:
    if isinstance(resp, list):
        resp = resp[0] if resp else {}
    meta = resp.get("meta_info") if isinstance(resp, dict) else None
    if not isinstance(meta, dict):
        raise t.fail("the answer has no meta_info")
    return meta


class LlamacppAdapter:
    """llama.cpp's native /completion (tools/server/server-task.cpp params_from_json_cmpl): token ids in and out,
    ``n_probs`` alternatives; raw softmax values unless ``post_sampling_probs`` (then probabilities after the
    sampler chain, turned into logs here). It returns no prompt logprobs, so it cannot score."""

    kind = "llamacpp"
    prompt_values = RAW
    path = "/completion"
    tokenize_path = "/tokenize"  # tools/server: {"content", "add_special"} -> {"tokens"}
    metrics_path = None
    masked = -3.0e38  # llama.cpp writes log(0) as the lowest float
    cached_tokens = staticmethod(lambda resp: None)

    def tokenize_body(self, model: str, text: str, add_special_tokens: bool) -> dict:
        return {"content": text, "add_special": add_special_tokens}

    def __init__(self, logprobs_mode: str = "raw_logprobs", max_top_n: int | None = None):
        if logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise EngineError(f"llama.cpp gives raw_logprobs or processed_logprobs (post_sampling_probs), "
                              f"not {logprobs_mode!r}")
        self.values = VLLM_MODES[logprobs_mode]
        self.capabilities = Capabilities(score=False, generate=True, seeded=True, prompt_ranks=False,
                                         full_logits=False, max_top_n=max_top_n, replay=False)

    def check(self, s: SamplingSettings) -> str | None:
        if s.min_tokens:
            return "min_tokens: llama.cpp's server has no such field"
        if s.stop_token_ids:
            return "stop_token_ids: llama.cpp's server has no such field"
        if s.allowed_token_ids or s.bad_words:
            return "allowed_token_ids / bad_words: llama.cpp's server has no such field"
        return None

    def score_body(self, model: str, ids: Sequence[int], top_n: int) -> dict:
        raise EngineError("llama.cpp's server returns no prompt logprobs: it cannot score a sequence")

    def generate_body(self, model: str, ids: Sequence[int], s: SamplingSettings) -> dict:
        # the sampler order is written out, so the server's --samplers default cannot reorder the chain
        return {"prompt": list(ids), "n_predict": s.max_tokens, "temperature": s.temperature, "top_k": s.top_k,
                "top_p": s.top_p, "min_p": s.min_p, "typical_p": 1.0, "repeat_penalty": s.repetition_penalty,
                "repeat_last_n": -1, "presence_penalty": s.presence_penalty,
                "frequency_penalty": s.frequency_penalty, "dry_multiplier": 0.0, "xtc_probability": 0.0,
                "top_n_sigma": -1.0, "mirostat": 0, "dynatemp_range": 0.0, "min_keep": 0,
                "seed": -1 if s.seed is None else s.seed, "ignore_eos": s.ignore_eos, "n_probs": s.logprobs,
                "post_sampling_probs": self.values == PROCESSED,
                "logit_bias": [[t, b] for t, b in s.logit_bias.items()],
                "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"], "return_tokens": True,
                "stop": list(s.stop), "cache_prompt": False, "stream": False}

    def read_score(self, t: Transport, body: dict, resp: dict):
        raise t.fail("llama.cpp's server returns no prompt logprobs")

    def read_generation(self, t: Transport, body: dict, resp: dict):
        probs = resp.get("completion_probabilities") if isinstance(resp, dict) else None
        if not isinstance(probs, list):
            raise t.fail("the answer has no completion_probabilities (was n_probs sent?)")
        post = body["post_sampling_probs"]
        steps = tuple(self._step(i, e, post, body["n_probs"]) for i, e in enumerate(probs))
        finish = {"eos": "stop", "word": "stop", "limit": "length"}.get(resp.get("stop_type"), resp.get("stop_type"))
        return tuple(p.token_id for p in steps), steps, finish

    def _step(self, i: int, e: dict, post: bool, top_n: int) -> Position:
        def value(d):  # post_sampling_probs gives probabilities; log(0) is -inf
            if post:
                return math.log(d["prob"]) if d["prob"] > 0 else -math.inf
            return _finite(d["logprob"], self.masked)

        listed = _sorted_top({int(d["id"]): value(d) for d in e.get("top_probs" if post else "top_logprobs", [])},
                             top_n)
        v = value(e)
        return Position(i, int(e["id"]), v, _rank_in_top(int(e["id"]), v, listed), listed)


ADAPTERS = {"vllm": VllmAdapter, "sglang": SglangAdapter, "llamacpp": LlamacppAdapter}
OWNERS = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llamacpp"}  # /v1/models owned_by -> kind


# ---------------------------------------------------------------------------------------------------------------
# the client


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
    def adapter(self):
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
        default = {"vllm": "raw_logprobs", "sglang": "processed_logprobs", "llamacpp": "raw_logprobs"}[kind]
        try:
            self._adapter = ADAPTERS[kind](self._mode or default, self._max_top_n)
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
        text = self.transport.get_text(self.adapter.metrics_path)
        return {"hits": prometheus_sum(text, "vllm:prefix_cache_hits_total"),
                "queries": prometheus_sum(text, "vllm:prefix_cache_queries_total")}

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
        if answered is not None and self.adapter.kind == "vllm" and answered != self.model:
            raise self.transport.fail(f"answered for model {answered!r}, not {self.model!r} (model name mismatch)")


# the logprobs-mode probe: two kept tokens (top-k 2) at temperature 0.5, seeded, one token
PROBE = SamplingSettings(max_tokens=1, temperature=0.5, top_k=2, seed=0, logprobs=2, ignore_eos=True)


def prometheus_sum(text: str, name: str) -> float:
    """The sum of a Prometheus counter's samples over its label sets (``name{labels} value [timestamp]`` lines,
    the fields parted by blanks or tabs; a label value may hold a blank, the value and timestamp never a ``}``)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        rest = line[len(name):]
        if rest.startswith("{"):
            rest = rest[rest.rfind("}") + 1:]
        elif rest[:1] not in (" ", "\t"):
            continue  # another metric whose name starts with this one
        fields = rest.split()
        try:
            total += float(fields[0])
        except (IndexError, ValueError):
            continue
    return total


def _check_ids(t: Transport, ids: Sequence[int], minimum: int) -> list[int]:
    out = [int(i) for i in ids]
    if len(out) < minimum:
        raise t.fail(f"{len(out)} token ids given; at least {minimum} needed")
    if any(i < 0 for i in out):
        raise t.fail("token ids must be >= 0")
    return out
