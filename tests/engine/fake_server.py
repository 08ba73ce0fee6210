"""A loopback HTTP server that replays answers recorded from a real vLLM (tests/engine/record_vllm.py), so the
default CI exercises decodelab's client against vLLM's exact JSON without vLLM installed.

A request is matched by method, path and JSON body (key order ignored); one that was never recorded gets a 404
with an OpenAI-style error naming it. Faults can be injected:

* ``timeout``      -- the answer never comes (the handler waits until the server stops)
* ``no_logprobs``  -- completions answers lose ``logprobs`` and ``prompt_logprobs`` (set to null)
* ``duplicate``    -- the first step's top logprobs list the sampled token twice (a repeated JSON key)
* ``refused``      -- nothing listens at the URL (connection refused)
* ``tokenizer``    -- /tokenize answers one id more (a BOS the local tokenizer does not add)
* ``vocabulary``   -- generations (of more than one token) name a token id past the bundled vocabulary in their
                      top logprobs
* ``replay_error`` -- a scoring request (prompt_logprobs) longer than the logprobs-mode probe's gets HTTP 500

The exchanges of the decodelab commands (``cli`` in the recording) are replayed too. A request recorded several
times with different answers (GET /metrics before and after a batch) gets them in the recorded order.

Use the ``fake_vllm`` fixture: ``server = fake_vllm(mode="raw_logprobs", fault=None)``; it is stopped afterwards.

For answers no recording holds, :class:`TableTransport` answers the client from a table of hand-written answers
(``table_engine``, ``completion_answer``, ``prompt_answer``), without a socket.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from decodelab.core.engine.http.client import ServedEngine
from decodelab.core.engine.http.transport import EngineError

RECORDING = Path(__file__).resolve().parent / "recordings" / "vllm-0.32.0.json"
FAULTS = (None, "timeout", "no_logprobs", "duplicate", "refused", "tokenizer", "vocabulary", "replay_error")
PROBE_LEN = 9  # the logprobs-mode probe scores 8 prompt ids + 1 token (core/methods/served.py PROBE_TOKENS)
_DUP = "\u0000dup"  # a placeholder key, replaced in the JSON text by the repeated token key


def load_recording(path: Path = RECORDING) -> dict:
    return json.loads(path.read_text())


def request_key(method: str, path: str, body) -> tuple[str, str, str]:
    return method, path, json.dumps(body, sort_keys=True)


def index(exchanges: list[dict]) -> dict:
    """(method, path, body) -> [(status, answer text), ...] in the recorded order."""
    out: dict = {}
    for x in exchanges:
        out.setdefault(request_key(x["method"], x["path"], x["body"]), []).append((x["status"], x["response"]))
    return out


def drop_logprobs(text: str) -> str:
    data = json.loads(text)
    for choice in data.get("choices", []):
        choice["logprobs"] = None
        choice["prompt_logprobs"] = None
    return json.dumps(data)


def duplicate_sampled(text: str) -> str:
    """The sampled token of step 0 listed twice in its top logprobs (JSON allows a repeated key; json.dumps
    cannot write one, so a placeholder key is swapped for the real one in the text)."""
    data = json.loads(text)
    lp = (data.get("choices") or [{}])[0].get("logprobs")
    if not lp or not lp.get("top_logprobs"):
        return text
    token, value = lp["tokens"][0], lp["token_logprobs"][0]
    lp["top_logprobs"][0] = {_DUP: value, **lp["top_logprobs"][0]}
    return json.dumps(data).replace(json.dumps(_DUP), json.dumps(token), 1)


def foreign_token(text: str, token_id: int = 5000) -> str:
    """The last listed alternative of every generated step renamed to an id past the bundled vocabulary (4096)."""
    data = json.loads(text)
    lp = (data.get("choices") or [{}])[0].get("logprobs")
    if not lp or not lp.get("top_logprobs"):
        return text
    for top in lp["top_logprobs"]:
        if top:
            last = list(top)[-1]
            top[f"token_id:{token_id}"] = top.pop(last)
    return json.dumps(data)


def refused_url() -> str:
    """A loopback URL where nothing listens (a port just bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class FakeServer:
    """Replays one logprobs mode of a recording on 127.0.0.1, optionally with a fault."""

    def __init__(self, recording: dict, mode: str = "raw_logprobs", fault: str | None = None):
        if fault not in FAULTS:
            raise ValueError(f"fault {fault!r}; allowed: {FAULTS}")
        self.answers = index(recording["modes"][mode] + recording.get("cli", {}).get(mode, []))
        self.calls: dict = {}  # request key -> how many times asked
        self.fault = fault
        self.seen: list[tuple[str, str, object]] = []
        self._release = threading.Event()
        self._httpd: ThreadingHTTPServer | None = None
        self.url = refused_url() if fault == "refused" else None

    def start(self) -> FakeServer:
        if self.fault == "refused":
            return self
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                server.handle(self, None)

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                server.handle(self, json.loads(self.rfile.read(length) or b"null"))

            def log_message(self, *args):  # keep pytest output clean
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._httpd.block_on_close = False
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        self._release.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()

    def handle(self, h: BaseHTTPRequestHandler, body) -> None:
        self.seen.append((h.command, h.path, body))
        if self.fault == "timeout":
            self._release.wait(10)
            return
        key = request_key(h.command, h.path, body)
        answers = self.answers.get(key, [(404, None)])
        n = self.calls[key] = self.calls.get(key, 0) + 1
        status, text = answers[min(n, len(answers)) - 1]
        if text is None:
            text = json.dumps({"error": {"message": f"fake server: no recorded answer for {h.command} {h.path} "
                                                    f"with this body", "type": "NotFoundError", "param": None,
                                         "code": 404}})
        elif self.fault == "replay_error" and isinstance(body, dict) and body.get("prompt_logprobs") \
                and len(body.get("prompt", [])) > PROBE_LEN:
            status, text = 500, json.dumps({"error": {"message": "fake server: injected failure", "code": 500}})
        elif status == 200 and h.path == "/v1/completions":
            text = self._fault(text, body)
        elif status == 200 and h.path == "/tokenize" and self.fault == "tokenizer":
            data = json.loads(text)
            data["tokens"] = [0] + data["tokens"]
            text = json.dumps(data)
        data = text.encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _fault(self, text: str, body) -> str:
        if self.fault == "no_logprobs":
            return drop_logprobs(text)
        if self.fault == "duplicate":
            return duplicate_sampled(text)
        if self.fault == "vocabulary" and isinstance(body, dict) and body.get("max_tokens", 0) > 1:
            return foreign_token(text)  # not the logprobs-mode probe's one token
        return text


@pytest.fixture
def fake_vllm():
    """A factory: ``fake_vllm(mode="raw_logprobs", fault=None)`` starts a FakeServer; all are stopped after."""
    if not RECORDING.exists():
        pytest.skip(f"no recording at {RECORDING} (run tests/engine/record_vllm.py)")
    recording = load_recording()
    started: list[FakeServer] = []

    def start(mode: str = "raw_logprobs", fault: str | None = None) -> FakeServer:
        server = FakeServer(recording, mode, fault).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


# ---------------------------------------------------------------------------------------------------------------
# the client without a socket: a transport answering from a table, and answers written by hand


class TableTransport:
    """A transport that answers from a table, path -> answer (or a function of the body), and keeps what it was
    sent; it opens no socket. Its failures are worded as Transport's."""

    url = "http://127.0.0.1:9"

    def __init__(self, answers: dict):
        self.answers, self.sent = answers, []

    def fail(self, what: str) -> EngineError:
        return EngineError(f"--engine {self.url}: {what}")

    def _answer(self, method, path, body):
        self.sent.append((method, path, body))
        answer = self.answers[path]
        return answer(body) if callable(answer) else answer

    def get(self, path):
        return self._answer("GET", path, None)

    def get_text(self, path):
        return self._answer("GET", path, None)

    def post(self, path, body):
        return self._answer("POST", path, body)


def models_answer(*ids, owned_by="vllm"):
    return {"object": "list", "data": [{"id": i, "owned_by": owned_by} for i in ids]}


def table_engine(answers: dict, **kw) -> tuple[ServedEngine, TableTransport]:
    t = TableTransport({"/v1/models": models_answer("tiny"), **answers})
    return ServedEngine("unused", transport=t, **kw), t


def completion_answer(tokens, token_logprobs, tops, model="tiny", finish="length", **extra) -> dict:
    """A vLLM /v1/completions answer with generation logprobs (tokens as token_id:N), written by hand."""
    return {"model": model, **extra, "choices": [{"finish_reason": finish, "token_ids": list(tokens), "logprobs": {
        "tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": list(token_logprobs),
        "top_logprobs": None if tops is None else [
            None if top is None else {f"token_id:{k}": v for k, v in top.items()} for top in tops]}}]}


def prompt_answer(entries, model="tiny") -> dict:
    """A vLLM answer with prompt_logprobs: per position None or {id: (logprob, rank)}."""
    return {"model": model, "choices": [{"prompt_logprobs": [
        None if e is None else {str(k): {"logprob": lp, "rank": r} for k, (lp, r) in e.items()} for e in entries]}]}


# ---------------------------------------------------------------------------------------------------------------
# a sampling engine: vLLM's completions API over a local model, its sampler written here by hand (an oracle apart
# from decodelab's chain), optionally with a known sampler defect


SAMPLER_DEFECTS = (None, "temperature_twice", "temperature_ignored", "truncation_ignored",
                   "truncation_before_temperature", "greedy")


def vllm_filters(logits, top_k: int, top_p: float, min_p: float):
    """vLLM v1's filters on (already tempered) logits [V] float64, in its order: min-p (keep p >= min_p * max p),
    top-k (keep logits >= the k-th largest), top-p (sorted ascending, drop the prefix whose cumulative probability
    is <= 1 - p, the largest token always kept). Removed tokens get -inf."""
    import torch

    z = logits.clone()
    if min_p > 0:
        p = torch.softmax(z, -1)
        z[p < min_p * p.max()] = float("-inf")
    if 0 < top_k < z.shape[-1]:
        kth = torch.topk(z, top_k).values[-1]
        z[z < kth] = float("-inf")
    if top_p < 1:
        order = torch.argsort(z)  # ascending
        cum = torch.softmax(z[order], -1).cumsum(-1)
        drop = cum <= 1 - top_p
        drop[-1] = False
        z[order[drop]] = float("-inf")
    return z


def sampler_law(raw, body: dict, defect: str | None = None):
    """The law [V] (float64) vLLM's sampler draws from for a request's fields, or a defect's."""
    import torch

    z = raw.double()
    if defect == "greedy" or float(body.get("temperature", 1.0)) < 1e-5:  # vLLM: below 1e-5 is greedy
        out = torch.zeros_like(z)
        out[z.argmax()] = 1.0
        return out
    t = float(body.get("temperature", 1.0))
    top_k, top_p, min_p = int(body.get("top_k") or 0), float(body.get("top_p", 1.0)), float(body.get("min_p") or 0)
    top_k = 0 if top_k < 0 else top_k
    if defect == "temperature_twice":
        t = t * t
    elif defect == "temperature_ignored":
        t = 1.0
    if defect == "truncation_ignored":
        return torch.softmax(z / t, -1)
    if defect == "truncation_before_temperature":
        return torch.softmax(vllm_filters(z, top_k, top_p, min_p) / t, -1)
    return torch.softmax(vllm_filters(z / t, top_k, top_p, min_p), -1)


class SamplingServer:
    """vLLM's /v1/models, /tokenize and /v1/completions (generation with ``n`` and ``seed``; prompt_logprobs) over
    a loaded model, in ``--logprobs-mode raw_logprobs``. Draws come from :func:`sampler_law` with a torch.Generator
    seeded by the request's seed (unseeded requests: one server generator seeded 0), so every test is repeatable.
    Sampling fields it does not implement (penalties, logit bias, allowed ids) are refused with HTTP 400."""

    def __init__(self, lm, defect: str | None = None, name: str = "tiny", logprob_shift: float = 0.0):
        """``logprob_shift``: added to every logprob the server returns (an engine whose numbers are not the
        model's normalised ones)."""
        import torch

        if defect not in SAMPLER_DEFECTS:
            raise ValueError(f"defect {defect!r}; allowed: {SAMPLER_DEFECTS}")
        self.lm, self.defect, self.name, self.shift = lm, defect, name, logprob_shift
        self.requests = 0
        self._cache: dict = {}
        self._lock = threading.Lock()
        self._generator = torch.Generator().manual_seed(0)
        self._httpd: ThreadingHTTPServer | None = None
        self.url = None

    def start(self) -> SamplingServer:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                server.reply(self, *server.answer("GET", self.path, None))

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                server.reply(self, *server.answer("POST", self.path, json.loads(self.rfile.read(length) or b"null")))

            def log_message(self, *args):
                pass

        class Server(ThreadingHTTPServer):
            request_queue_size = 256  # seeded requests come many at once (the default backlog of 5 resets some)

        self._httpd = Server(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()

    @staticmethod
    def reply(h: BaseHTTPRequestHandler, status: int, answer: dict) -> None:
        data = json.dumps(answer).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def raw(self, ids: tuple[int, ...]):
        """log softmax of the model's logits after ``ids`` [V] float64 (cached per prefix)."""
        import torch

        with self._lock:
            if ids not in self._cache:
                with torch.inference_mode():
                    logits = self.lm.model(torch.tensor([list(ids)])).logits[0, -1].double()
                self._cache[ids] = torch.log_softmax(logits, -1)
            return self._cache[ids]

    def values(self, ids: tuple[int, ...]):
        """The logprobs the server returns after ``ids``: the raw ones, shifted by ``logprob_shift``."""
        return self.raw(ids) + self.shift

    def answer(self, method: str, path: str, body) -> tuple[int, dict]:
        if method == "GET" and path == "/v1/models":
            return 200, models_answer(self.name)
        if path == "/tokenize":
            ids = list(self.lm.tokenizer.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens",
                                                                                             True)))
            return 200, {"tokens": ids, "count": len(ids), "max_model_len": 4096}
        if path != "/v1/completions":
            return 404, {"error": {"message": f"no {path}", "code": 404}}
        refused = [k for k, off in (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                                    ("min_tokens", 0)) if body.get(k, off) != off]
        refused += [k for k in ("logit_bias", "allowed_token_ids", "bad_words") if body.get(k)]
        if refused:
            return 400, {"error": {"message": f"fake sampling server: {refused[0]} not implemented", "code": 400}}
        self.requests += 1
        if body.get("prompt_logprobs"):
            return 200, self.score(body)
        return 200, self.generate(body)

    def listed(self, logp, token: int, n: int) -> dict:
        """The token first, then the top n by value (vLLM's order), keys as token_id:N."""
        import torch

        top = torch.topk(logp, n)
        out = {f"token_id:{token}": float(logp[token])}
        for v, i in zip(top.values.tolist(), top.indices.tolist()):
            out.setdefault(f"token_id:{i}", v)
        return out

    def generate(self, body: dict) -> dict:
        import torch

        seed = body.get("seed")
        g = torch.Generator().manual_seed(int(seed)) if seed is not None else self._generator
        choices = []
        for c in range(int(body.get("n") or 1)):
            ids, tokens, values, tops = list(body["prompt"]), [], [], []
            for _ in range(int(body.get("max_tokens") or 16)):
                raw = self.raw(tuple(ids))
                law = sampler_law(raw, body, self.defect)
                token = int(torch.multinomial(law, 1, generator=g))
                shown = self.values(tuple(ids))
                tokens.append(token)
                values.append(float(shown[token]))
                tops.append(self.listed(shown, token, int(body.get("logprobs") or 0)))
                ids.append(token)
            choices.append({"index": c, "text": self.lm.decode(tokens), "token_ids": tokens, "finish_reason": "length",
                            "logprobs": {"tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": values,
                                         "top_logprobs": tops, "text_offset": [0] * len(tokens)}})
        return {"model": self.name, "object": "text_completion", "choices": choices}

    def score(self, body: dict) -> dict:
        import torch

        ids, n = list(body["prompt"]), int(body["prompt_logprobs"])
        entries = [None]
        for i in range(1, len(ids)):
            raw = self.values(tuple(ids[:i]))
            listed = self.listed(raw, ids[i], n)
            entries.append({k[len("token_id:"):]: {"logprob": v, "rank": int((raw > v).sum()) + 1,
                                                    "decoded_token": None} for k, v in listed.items()})
        raw = self.raw(tuple(ids))
        token = int(raw.argmax())
        return {"model": self.name, "choices": [{"index": 0, "text": "", "token_ids": [token], "finish_reason": "length",
                                                  "prompt_token_ids": ids, "prompt_logprobs": entries,
                                                  "logprobs": {"tokens": [f"token_id:{token}"],
                                                               "token_logprobs": [float(raw[token])],
                                                               "top_logprobs": [self.listed(raw, token, 1)]}}]}
