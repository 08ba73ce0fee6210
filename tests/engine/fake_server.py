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
