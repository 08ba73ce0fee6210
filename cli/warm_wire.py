"""What the warm server and its clients share, standard library only (the client side runs before typer, rich or
torch are imported): where the socket lives, the identity that decides whether a server may run a client's command,
and the framing of messages on the socket.

A server may run a command only if a cold process started by the client would have run the same code on the same
settings: the same interpreter (``sys.executable``, its flags and ``sys.path``), the same decodelab source files
(paths, sizes and modification times of every installed file), the same torch and transformers, the same CPUs to
run on, and the same value of every environment variable that a library reads once, at import (Python's own, the
locale, Hugging Face's, torch's, OpenMP's and MKL's, CUDA's). Any difference and the client runs cold.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import struct
import sys
from importlib import metadata, util

DIR_ENV = "DECODELAB_WARM_DIR"  # the runtime folder (tests point it at a temporary one)
OFF_ENV = "DECODELAB_NO_WARM"  # 1: never hand a command to a warm server
REPORT_ENV = "DECODELAB_WARM_REPORT"  # 1: one line on stderr saying which path ran (as --debug does)
PACKAGES = ("decodelab.cli", "decodelab.core", "decodelab.presets")
# environment variables read at import by Python, the C library's locale, huggingface_hub, transformers, tokenizers,
# torch, OpenMP (libgomp/Intel), MKL, OpenBLAS and CUDA: a forked child would keep the server's values
IMPORT_TIME_PREFIXES = ("PYTHON", "LC_", "HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "TORCH", "PYTORCH",
                        "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS", "CUDA", "NVIDIA", "LD_", "DECODELAB_")
IMPORT_TIME_NAMES = ("LANG", "LANGUAGE", "HOME", "XDG_CACHE_HOME", "TMPDIR")
NOT_IDENTITY = (DIR_ENV, OFF_ENV, REPORT_ENV)  # the warm path's own switches
SOCKET_PATH_MAX = 107  # sun_path is 108 bytes with its terminating NUL


class WireError(Exception):
    """The socket, its folder or a message is not what it should be: the client runs cold."""


def runtime_dir() -> str:
    """$DECODELAB_WARM_DIR, else $XDG_RUNTIME_DIR/decodelab, else ~/.cache/decodelab/run."""
    if os.environ.get(DIR_ENV):
        return os.environ[DIR_ENV]
    if os.environ.get("XDG_RUNTIME_DIR"):
        return os.path.join(os.environ["XDG_RUNTIME_DIR"], "decodelab")
    return os.path.join(os.path.expanduser("~"), ".cache", "decodelab", "run")


def private_dir(create: bool) -> str:
    """The runtime folder, owned by this user and closed to everyone else (mode 0700), created if asked."""
    path = runtime_dir()
    if create:
        os.makedirs(path, mode=0o700, exist_ok=True)
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise WireError(f"no runtime folder {path}: {exc.strerror}") from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise WireError(f"{path} is not a folder owned by this user")
    if info.st_mode & 0o077:
        raise WireError(f"{path} is open to other users (mode {stat.S_IMODE(info.st_mode):o}); it must be 0700")
    return path


def socket_path(create: bool = False) -> str:
    """One server per interpreter: the socket's name carries a digest of ``sys.executable``."""
    digest = hashlib.sha256(sys.executable.encode("utf-8", "surrogateescape")).hexdigest()[:12]
    path = os.path.join(private_dir(create), f"warm-{digest}.sock")
    if len(os.fsencode(path)) > SOCKET_PATH_MAX:
        raise WireError(f"socket path too long for a Unix socket ({len(path)} bytes): {path}")
    return path


def log_path() -> str:
    return socket_path()[:-len(".sock")] + ".log"


def source_fingerprint() -> str:
    """A digest of every installed decodelab file: relative path, size and modification time (an edited file, one
    added or one removed changes it)."""
    h = hashlib.sha256()
    for name in PACKAGES:
        spec = util.find_spec(name)
        for root in sorted(spec.submodule_search_locations or []) if spec else []:
            for folder, dirs, files in os.walk(root):
                dirs[:] = sorted(d for d in dirs if d != "__pycache__")
                for file in sorted(files):
                    info = os.stat(os.path.join(folder, file))
                    rel = os.path.relpath(os.path.join(folder, file), root)
                    h.update(f"{name}/{rel}\0{info.st_size}\0{info.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def version_of(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def import_time_environment(environ) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k not in NOT_IDENTITY
            and (k.startswith(IMPORT_TIME_PREFIXES) or k in IMPORT_TIME_NAMES)}


def identity(environ=None) -> dict:
    """Everything that must match between a server and a client (see the module's docstring)."""
    environ = os.environ if environ is None else environ
    return {
        "executable": sys.executable,
        "flags": list(sys.flags), "warnoptions": list(sys.warnoptions),
        "xoptions": sorted(f"{k}={v}" for k, v in sys._xoptions.items()),
        "path": list(sys.path),
        "decodelab": version_of("decodelab"), "torch": version_of("torch"),
        "transformers": version_of("transformers"),
        "source": source_fingerprint(),
        "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "environment": import_time_environment(environ),
    }


def differences(server: dict, client: dict) -> list[str]:
    """The identity fields that differ (environment variables by name)."""
    out = [k for k in sorted(set(server) | set(client)) if k != "environment" and server.get(k) != client.get(k)]
    se, ce = server.get("environment", {}), client.get("environment", {})
    out += [f"${k}" for k in sorted(set(se) | set(ce)) if se.get(k) != ce.get(k)]
    return out


def send(sock: socket.socket, message: dict) -> None:
    """One message: 4 bytes of length, then JSON (lone surrogates in paths and the environment survive as escapes)."""
    data = json.dumps(message).encode("ascii")
    sock.sendall(struct.pack("!I", len(data)) + data)


def receive(sock: socket.socket) -> dict | None:
    """The next message, or None when the peer closed the connection."""
    head = read_exactly(sock, 4)
    if head is None:
        return None
    body = read_exactly(sock, struct.unpack("!I", head)[0])
    if body is None:
        raise WireError("connection closed mid-message")
    return json.loads(body.decode("ascii"))


def read_exactly(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            if got:
                raise WireError("connection closed mid-message")
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end (SO_PEERCRED: pid, uid, gid as three C ints)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def connect(timeout: float = 5.0) -> socket.socket:
    """A connection to this interpreter's server, checked to run as this user; WireError if there is none."""
    path = socket_path()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
        if peer_uid(sock) != os.getuid():
            raise WireError(f"the server on {path} runs as another user")
    except OSError as exc:
        sock.close()
        raise WireError(f"no warm server on {path} ({exc.strerror or exc})") from None
    except WireError:
        sock.close()
        raise
    return sock
