"""JSON over HTTP to the one URL a user named, with the standard library only: no proxy from the environment, no
redirect followed, each failure one :class:`EngineError` line naming ``--engine URL``. Also the two text formats a
server answers in: JSON that remembers repeated keys (:func:`loads`), Prometheus counters (:func:`prometheus_sum`).
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter

from ...errors import ConfigError

DEFAULT_TIMEOUT_S = 60.0


class EngineError(ConfigError):
    """A served engine that cannot be reached or answers something decodelab cannot use; one line."""


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


def loads(text: str | bytes):
    """JSON as an engine wrote it, every object remembering the keys it held more than once (``repeated``):
    a repeated key is a defect Python's json would hide by keeping the last value."""
    return json.loads(text, object_pairs_hook=_Object.from_pairs)


def repeated_keys(obj) -> dict:
    """The keys an object read by :func:`loads` held more than once -> every value they had."""
    return getattr(obj, "repeated", {})


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

