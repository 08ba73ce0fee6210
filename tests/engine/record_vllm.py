"""Record request/response pairs from a real vLLM server on the bundled tiny model, for the default CI's fake
server (tests/engine/fake_server.py). Run it from decodelab's venv; it starts vLLM from its own venv:

    .ci/vllm-venv.sh                      # once per machine
    python tests/engine/record_vllm.py    # writes tests/engine/recordings/vllm-0.32.0.json

The server runs once per --logprobs-mode (raw_logprobs, processed_logprobs) and gets the same fixed requests
through decodelab's client: scoring snippets of presets/models/validation.txt, greedy generation, and seeded
sampling under many settings; then the decodelab commands of engine_cases.py (sample, score, compare, batch,
check-logprobs with --engine) through a recording proxy, their exchanges kept under ``cli``. Each exchange is stored verbatim (the answer as the server's JSON text), so a
replay shows the client exactly what vLLM sent. It also prints what it observed about vLLM (seeded
reproducibility, prompt logprobs under both modes, a repeated score with the prefix cache warm).
"""

from __future__ import annotations

import json
import platform
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from engine_cases import CASES, args_for  # noqa: E402
from vllm_server import ROOT, SERVED_NAME, TINY, VLLM_VERSION, server_command, vllm_python, vllm_server  # noqa: E402

from decodelab.core.engine.http.client import ServedEngine  # noqa: E402
from decodelab.core.engine.http.transport import EngineError, Transport  # noqa: E402
from decodelab.core.engine.http.wire import SamplingSettings  # noqa: E402

OUT = HERE / "recordings" / f"vllm-{VLLM_VERSION}.json"
MODES = ("raw_logprobs", "processed_logprobs")
SNIPPET_STARTS = (0, 400, 1500, 4000)  # token offsets into validation.txt
SNIPPET_LEN = 32
SCORE_TOP = 5
EOS = 0  # presets/models/tiny: bos = eos = pad = 0
COLLIDING = [5, 100, 200, 300]  # id 100 decodes to "" (a partial UTF-8 byte), as do likely next tokens such as 124

# Seeded sampling settings (name, settings): each alone, then in combination. ignore_eos keeps lengths fixed.
BASE = SamplingSettings(max_tokens=8, ignore_eos=True, logprobs=5)
SAMPLING = [
    ("t1.0", replace(BASE, temperature=1.0, seed=1)),
    ("t0.7", replace(BASE, temperature=0.7, seed=2)),
    ("t1.3", replace(BASE, temperature=1.3, seed=3)),
    ("top_p0.9", replace(BASE, temperature=1.0, top_p=0.9, seed=4)),
    ("top_k3", replace(BASE, temperature=1.0, top_k=3, seed=5)),
    ("top_k5_t0.8", replace(BASE, temperature=0.8, top_k=5, seed=6, logprobs=8)),
    ("top_k2_t0.5", replace(BASE, temperature=0.5, top_k=2, seed=17)),
    ("min_p0.1", replace(BASE, temperature=1.0, min_p=0.1, seed=7)),
    ("rep1.3", replace(BASE, temperature=1.0, repetition_penalty=1.3, seed=8)),
    ("presence0.5", replace(BASE, temperature=1.0, presence_penalty=0.5, seed=9)),
    ("frequency0.7", replace(BASE, temperature=1.0, frequency_penalty=0.7, seed=10)),
    ("t0.8_p0.95_k20", replace(BASE, temperature=0.8, top_p=0.95, top_k=20, seed=11)),
    ("t0.9_minp0.05_rep1.1", replace(BASE, temperature=0.9, min_p=0.05, repetition_penalty=1.1, seed=12)),
    ("bias", replace(BASE, temperature=1.0, logit_bias={284: 5.0, 525: -5.0}, seed=13)),
    ("greedy_rep1.5", replace(BASE, temperature=0.0, repetition_penalty=1.5)),
    ("min_tokens4_stop_eos", replace(BASE, temperature=1.0, ignore_eos=False, min_tokens=4,
                                     stop_token_ids=(EOS,), seed=15)),
]
GREEDY = replace(BASE, max_tokens=16, temperature=0.0)
ERRORS = [  # requests the server refuses: their one-line messages are replayed too
    ("temperature2.5", [5, 6, 7], replace(BASE, temperature=2.5)),
    ("logprobs21", [5, 6, 7], replace(BASE, logprobs=21)),
    ("out_of_vocab", [5000], BASE),
]


class RecordingTransport(Transport):
    """A Transport that keeps every exchange: method, path, the JSON body sent, the status, the answer text."""

    def __init__(self, url: str, timeout: float = 120.0):
        super().__init__(url, timeout)
        self.exchanges: list[dict] = []

    def exchange(self, req, where):
        status, raw = super().exchange(req, where)
        body = json.loads(req.data) if req.data else None
        self.exchanges.append({"method": req.method, "path": where.split(" ", 1)[1], "body": body,
                               "status": status, "response": raw.decode()})
        return status, raw


def snippets() -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY)
    ids = tok.encode((ROOT / "presets" / "models" / "validation.txt").read_text(), add_special_tokens=False)
    return [ids[s:s + SNIPPET_LEN] for s in SNIPPET_STARTS]


def run_mode(url: str, mode: str, texts: list[list[int]], notes: list[str]) -> list[dict]:
    transport = RecordingTransport(url)
    engine = ServedEngine(url, model=SERVED_NAME, logprobs_mode=mode, transport=transport)
    engine.models()
    scores = [engine.score(ids, top_n=SCORE_TOP) for ids in texts]
    for ids in (t[:12] for t in texts[:3]):
        engine.generate(ids, GREEDY)
    prompt = texts[0][:12]
    for _, settings in SAMPLING:
        engine.generate(prompt, settings)
    for _, ids, settings in ERRORS:
        try:
            engine.generate(ids, settings)
        except EngineError as e:
            notes.append(f"{mode}: refused as expected: {e}")
    for body in openai_shapes(COLLIDING + texts[1][:8]):
        try:
            transport.post(body.pop("_path"), body)
        except EngineError as e:
            notes.append(f"{mode}: {e}")
    observe(ServedEngine(url, model=SERVED_NAME, logprobs_mode=mode), prompt, scores[0], mode, notes)
    return transport.exchanges


NEUTRAL = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
           "frequency_penalty": 0.0}


def openai_shapes(ids: list[int]) -> list[dict]:
    """The answers people log and check-logprobs reads: echo (prompt logprobs in OpenAI's completions shape),
    with token-id keys and with text keys (where ids decoding to the same text collide), and chat completions."""
    echo = {"_path": "/v1/completions", "model": SERVED_NAME, "prompt": ids, "max_tokens": 0, "echo": True,
            "logprobs": 5, "temperature": 1.0, **NEUTRAL, "seed": 1}
    chat = {"_path": "/v1/chat/completions", "model": SERVED_NAME,
            "messages": [{"role": "user", "content": "God blessed Noah and his sons"}], "logprobs": True,
            "top_logprobs": 5, "max_completion_tokens": 8, "temperature": 1.0, **NEUTRAL, "seed": 1,
            "ignore_eos": True, "return_token_ids": True}
    return [dict(echo, return_tokens_as_token_ids=True), dict(echo), dict(chat, return_tokens_as_token_ids=True),
            dict(chat)]


def observe(engine: ServedEngine, prompt: list[int], first: object, mode: str, notes: list[str]) -> None:
    """Facts checked live on a second, unrecorded client (the fake server replays one answer per request)."""
    name, settings = SAMPLING[0]
    a, b = engine.generate(prompt, settings), engine.generate(prompt, settings)
    notes.append(f"{mode}: seeded {name} twice -> same tokens: {a.token_ids == b.token_ids}, same logprobs: "
                 f"{[p.logprob for p in a.steps] == [p.logprob for p in b.steps]}")
    again = engine.score(first.token_ids, top_n=SCORE_TOP)  # the prefix cache now holds this sequence
    same = [p.logprob for p in again.positions] == [p.logprob for p in first.positions]
    notes.append(f"{mode}: score repeated with a warm prefix cache -> identical prompt logprobs: {same}")


class RecordingProxy:
    """A loopback HTTP proxy in front of the server that keeps every exchange (as RecordingTransport does): the
    decodelab commands of engine_cases.py run against it unchanged."""

    def __init__(self, target: str):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.exchanges: list[dict] = []
        lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self.forward(None)

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                self.forward(self.rfile.read(length))

            def forward(self, data):
                transport = Transport(target, 600.0)
                req = urllib.request.Request(target + self.path, data=data, method=self.command,
                                             headers={"Content-Type": "application/json"} if data else {})
                status, raw = transport.exchange(req, f"{self.command} {self.path}")
                text = raw.decode()
                if self.path == "/metrics":  # only the counters decodelab reads (the full page is ~50 KB)
                    text = "\n".join(line for line in text.splitlines() if "prefix_cache" in line) + "\n"
                with lock:
                    proxy.exchanges.append({"method": self.command, "path": self.path,
                                            "body": json.loads(data) if data else None, "status": status,
                                            "response": text})
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def run_cases(url: str, mode: str, notes: list[str]) -> list[dict]:
    """Every command of engine_cases.py through a recording proxy; the exchanges they made."""
    import contextlib
    import io
    import tempfile

    from decodelab.cli.main import main as cli

    proxy = RecordingProxy(url)
    try:
        with tempfile.TemporaryDirectory() as folder:
            for name in CASES:
                out, err = io.StringIO(), io.StringIO()
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    code = cli(args_for(name, proxy.url, Path(folder)))
                notes.append(f"{mode}: decodelab {name}: exit {code}" + (f" ({err.getvalue().strip()})"
                                                                          if code else ""))
    finally:
        proxy.stop()
    return proxy.exchanges


def main() -> int:
    python = vllm_python()
    if python is None:
        print("no vLLM venv: run .ci/vllm-venv.sh or set DECODELAB_VLLM_PYTHON", file=sys.stderr)
        return 2
    texts = snippets()
    recorded, cli, notes = {}, {}, []
    for mode in MODES:
        started = time.monotonic()
        with vllm_server(mode, python) as url:
            print(f"{mode}: server up in {time.monotonic() - started:.0f} s at {url}", flush=True)
            recorded[mode] = run_mode(url, mode, texts, notes)
            cli[mode] = run_cases(url, mode, notes)
    raw_scores = [x["response"] for x in recorded[MODES[0]] if x["body"] and "prompt_logprobs" in x["body"]]
    proc_scores = [x["response"] for x in recorded[MODES[1]] if x["body"] and "prompt_logprobs" in x["body"]]
    notes.append(f"prompt_logprobs identical under raw_logprobs and processed_logprobs: "
                 f"{[json.loads(r)['choices'][0]['prompt_logprobs'] for r in raw_scores] == [json.loads(r)['choices'][0]['prompt_logprobs'] for r in proc_scores]}")
    meta = {"vllm": VLLM_VERSION, "model": "presets/models/tiny", "served_as": SERVED_NAME,
            "server": " ".join(server_command(Path("python"), 0, "MODE", Path("presets/models/tiny"))[1:])
            .replace("--port 0", "--port PORT"),
            "env": "VLLM_CPU_KVCACHE_SPACE=1", "platform": platform.platform(),
            "recorded": time.strftime("%Y-%m-%d"), "sampling": [name for name, _ in SAMPLING],
            "errors": [name for name, _, _ in ERRORS], "observed": notes}
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({"meta": meta, "modes": recorded, "cli": cli}, indent=1) + "\n")
    print("\n".join(notes))
    print(f"wrote {OUT.relative_to(ROOT)} ({OUT.stat().st_size // 1024} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
