"""The warm server behind `decodelab warm start`: a process that has imported everything a run needs (torch,
transformers' model and tokenizer modules, decodelab's core and its CLI) and has run no torch operation, so that
forking it is safe (no OpenMP thread pool, CUDA never initialized, one thread). It listens on a Unix socket in a
private folder (:mod:`.warm_wire`) and, for each client of the same user and the same identity, forks a child that
becomes the client's command: the client's fds 0, 1, 2, working folder, environment, umask and ignored signals, and
the same Typer app run on its command line. The server reports the child's exit status to the client, relays the
signals the client forwards, kills the child if the client goes away, and exits after its idle time.
"""

from __future__ import annotations

import importlib
import importlib.resources
import gc

import io
import json
import os
import pkgutil
import resource
import selectors
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from . import warm_child
from . import warm_wire as wire

WARM_PACKAGES = ("decodelab.core", "decodelab.cli")


@dataclass
class Job:
    conn: socket.socket
    pid: int
    pidfd: int
    alive: bool = True


@dataclass
class Server:
    listener: socket.socket
    path: str
    ident: dict
    idle_s: float
    wake_r: int
    wake_w: int
    selector: selectors.BaseSelector = field(default_factory=selectors.DefaultSelector)
    jobs: dict = field(default_factory=dict)  # pid -> Job
    started: float = field(default_factory=time.time)
    idle_since: float = field(default_factory=time.monotonic)
    stopping: bool = False
    runs: int = 0


def warm_up() -> list[str]:
    """Import every decodelab module and the transformers classes the bundled models load through; no torch op
    runs. The modules that failed to import (listed in the log)."""
    failed = []
    importlib.import_module("decodelab.cli.main")
    for package in WARM_PACKAGES:
        pkg = importlib.import_module(package)
        for info in pkgutil.walk_packages(pkg.__path__, package + "."):
            if info.name.split(".")[-1].startswith("warm_"):
                continue
            try:
                importlib.import_module(info.name)
            except Exception as exc:  # an optional dependency missing: that module loads when a run needs it
                failed.append(f"{info.name}: {type(exc).__name__}: {exc}")
    failed += import_bundled_model_classes()
    failed += fill_caches()
    return failed


def fill_caches() -> list[str]:
    """Work every run repeats once per process and that touches no tensor: transformers' table of checkpoint
    renamings (about a thousand regular expressions, compiled at the first load of any model), and typer's parsing
    of a command line (its first parse imports pydantic): a command line refused before torch is used."""
    failed = []
    try:
        from transformers import conversion_mapping

        conversion_mapping.get_checkpoint_conversion_mapping("llama")
    except Exception as exc:
        failed.append(f"transformers' conversion mapping: {type(exc).__name__}: {exc}")
    from . import main as cli

    saved = sys.stderr
    sys.stderr = io.StringIO()
    try:
        cli.run_cli(["sample", "warm", "--top-p", "1.5"])  # exit 2 at the range check, before any tensor
    finally:
        sys.stderr = saved
    return failed


def import_bundled_model_classes() -> list[str]:
    """transformers loads a model's modeling and tokenizer modules lazily, by its config: import those of every
    bundled model (its config.json's architectures and tokenizer_config.json's tokenizer_class)."""
    import transformers

    failed = []
    models = Path(str(importlib.resources.files("decodelab.presets") / "models"))
    for folder in sorted(p for p in models.iterdir() if (p / "config.json").is_file()):
        names = json.loads((folder / "config.json").read_text()).get("architectures", [])
        tok = folder / "tokenizer_config.json"
        if tok.is_file():
            names.append(json.loads(tok.read_text()).get("tokenizer_class") or "PreTrainedTokenizerFast")
        for name in names + ["AutoModelForCausalLM", "AutoTokenizer", "AutoConfig", "GenerationConfig"]:
            try:
                getattr(transformers, name)
            except Exception as exc:
                failed.append(f"transformers.{name}: {type(exc).__name__}: {exc}")
    return failed


def threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def fork_safe() -> str | None:
    """Why forking this process would be unsafe (another thread, CUDA initialized), or None."""
    if threads() != 1:
        return f"{threads()} threads after the imports (a fork would copy one of them)"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialized during the imports"
    if cuda_driver_loaded():
        return "the CUDA driver (libcuda) was loaded during the imports; a forked child could not use it"
    return None


def cuda_driver_loaded() -> bool:
    """libcuda mapped into this process (a device count asked of the CUDA runtime loads and initializes it)."""
    try:
        with open("/proc/self/maps") as f:
            return any("libcuda.so" in line for line in f)
    except OSError:
        return False


def live(path: str) -> bool:
    """Does a server answer on ``path``? (A socket file nobody listens on is left by a server that died.)"""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def bind(path: str) -> socket.socket:
    """Listen on ``path`` (mode 0600); a socket left there by a dead server is replaced, a live one is an error."""
    if os.path.exists(path):
        if live(path):
            raise wire.WireError(f"a warm server already listens on {path}")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(64)
    return sock


def serve(idle_minutes: float, ready_fd: int, added: tuple[str, ...] = ()) -> int:
    """Start (identity first, before the imports it describes), tell the starter on ``ready_fd``, then serve. The
    socket appears only once the imports are done: a client never waits on a server still importing. ``added``: the
    environment variables the starter set for the server alone (``commands.warm.server_environment``), not part of
    the identity its clients must match."""
    ident = wire.identity({k: v for k, v in os.environ.items() if k not in added})
    try:
        path = wire.socket_path(create=True)
        if os.path.exists(path) and live(path):
            raise wire.WireError(f"a warm server already listens on {path}")
    except (wire.WireError, OSError) as exc:
        return tell(ready_fd, f"error: {exc}", 1)
    try:
        failed = warm_up()
    except Exception as exc:
        return tell(ready_fd, f"error: importing decodelab failed: {type(exc).__name__}: {exc}", 1)
    for line in failed:
        print(f"warm: not preloaded: {line}", file=sys.stderr, flush=True)
    unsafe = fork_safe()
    if unsafe:
        return tell(ready_fd, f"error: cannot serve: {unsafe}", 1)
    try:
        listener = bind(path)
    except (wire.WireError, OSError) as exc:
        return tell(ready_fd, f"error: {exc}", 1)
    gc.collect()
    gc.freeze()  # children share these pages; the collector leaves them alone
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    server = Server(listener, path, ident, idle_minutes * 60.0, wake_r, wake_w)
    signal.set_wakeup_fd(wake_w)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: setattr(server, "stopping", True))
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    tell(ready_fd, f"ready {os.getpid()} {path}", 0)
    print(f"warm: pid {os.getpid()} listening on {path}", file=sys.stderr, flush=True)
    try:
        loop(server)
    finally:
        close_listener(server)
    return 0


def tell(fd: int, line: str, code: int) -> int:
    try:
        os.write(fd, (line + "\n").encode("utf-8", "backslashreplace"))
        os.close(fd)
    except OSError:
        pass
    return code


def close_listener(server: Server) -> None:
    if server.listener.fileno() >= 0:
        try:
            server.selector.unregister(server.listener)
        except (KeyError, ValueError):
            pass
        server.listener.close()
        try:
            os.unlink(server.path)
        except OSError:
            pass


def loop(server: Server) -> None:
    sel = server.selector
    sel.register(server.listener, selectors.EVENT_READ, ("accept", None))
    sel.register(server.wake_r, selectors.EVENT_READ, ("wake", None))
    while True:
        if server.stopping:
            close_listener(server)
            if not server.jobs:
                return
        timeout = None
        if not server.jobs and not server.stopping:
            timeout = server.idle_s - (time.monotonic() - server.idle_since)
            if timeout <= 0:
                return
        for key, _ in sel.select(timeout):
            what, job = key.data
            if what == "accept" and not server.stopping:
                accept(server)
            elif what == "wake":
                drain(server.wake_r)
            elif what == "conn":
                from_client(server, job)
            elif what == "exit":
                reap(server, job)


def drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except (BlockingIOError, OSError):
        pass


def accept(server: Server) -> None:
    try:
        conn, _ = server.listener.accept()
    except OSError:
        return
    conn.settimeout(5.0)
    fds: list[int] = []
    try:
        if wire.peer_uid(conn) != os.getuid():
            conn.close()
            return
        _, fds, _, _ = socket.recv_fds(conn, 1, 3)
        message = wire.receive(conn)
        if message is None:
            raise wire.WireError("closed")
        answer(server, conn, message, fds)
    except (OSError, ValueError, wire.WireError):
        conn.close()
    finally:
        for fd in fds:
            os.close(fd)


def answer(server: Server, conn: socket.socket, message: dict, fds: list[int]) -> None:
    kind = message.get("kind")
    if kind == "status":
        wire.send(conn, status(server))
        conn.close()
    elif kind == "stop":
        server.stopping = True
        wire.send(conn, {"ok": True, "server": os.getpid()})
        conn.close()
    elif kind == "run":
        why = refusal(server, message, fds)
        if why:
            wire.send(conn, {"ok": False, "why": why})
            conn.close()
            return
        wire.send(conn, {"ok": True, "server": os.getpid()})
        go = wire.receive(conn)  # the client commits (or, if it gave up waiting and ran cold, has closed)
        if go is None or go.get("kind") != "go":
            conn.close()
            return
        start(server, conn, message, fds)
    else:
        conn.close()


def status(server: Server) -> dict:
    idle_left = None if server.jobs else max(0.0, server.idle_s - (time.monotonic() - server.idle_since))
    return {"ok": True, "server": os.getpid(), "socket": server.path, "started": server.started,
            "identity": server.ident, "running": len(server.jobs), "runs": server.runs,
            "idle_minutes": server.idle_s / 60.0, "idle_left_s": idle_left, "children_cpu_s": children_cpu()}


def children_cpu() -> float:
    """User + system CPU seconds of every child run so far (each is reaped before its client gets its status)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def refusal(server: Server, message: dict, fds: list[int]) -> str | None:
    if len(fds) != 3:
        return "the client's fds 0, 1, 2 did not arrive"
    diffs = wire.differences(server.ident, message.get("identity") or {})
    if diffs:
        return "the warm server's identity differs: " + ", ".join(diffs[:8])
    return None


def start(server: Server, conn: socket.socket, message: dict, fds: list[int]) -> None:
    pid = os.fork()
    if pid == 0:
        child(server, conn, message, fds)  # never returns
    pidfd = os.pidfd_open(pid)
    job = Job(conn, pid, pidfd)
    server.jobs[pid] = job
    server.runs += 1
    try:
        wire.send(conn, {"pid": pid})
    except OSError:
        kill(job)
    conn.settimeout(5.0)
    server.selector.register(conn, selectors.EVENT_READ, ("conn", job))
    server.selector.register(pidfd, selectors.EVENT_READ, ("exit", job))


def kill(job: Job, sig: int = signal.SIGKILL) -> None:
    if job.alive:
        try:
            os.kill(job.pid, sig)
        except ProcessLookupError:
            pass


def from_client(server: Server, job: Job) -> None:
    """A signal to forward, or the client gone (its connection closed): a child without its client is killed."""
    try:
        message = wire.receive(job.conn)
    except (OSError, ValueError, wire.WireError):
        message = None
    if message is None:
        server.selector.unregister(job.conn)
        kill(job)
        return
    if message.get("kind") == "signal" and message.get("signal") in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        kill(job, int(message["signal"]))


def reap(server: Server, job: Job) -> None:
    _, status_word = os.waitpid(job.pid, 0)
    job.alive = False
    server.selector.unregister(job.pidfd)
    os.close(job.pidfd)
    try:
        wire.send(job.conn, {"exit": os.waitstatus_to_exitcode(status_word)})
    except OSError:
        pass
    try:
        server.selector.unregister(job.conn)
    except (KeyError, ValueError):
        pass
    job.conn.close()
    del server.jobs[job.pid]
    if not server.jobs:
        server.idle_since = time.monotonic()


def child(server: Server, conn: socket.socket, message: dict, fds: list[int]) -> None:
    """Become the client's command and exit with its status; never returns to the server's loop."""
    code = 1
    try:
        warm_child.die_with_server()
        leave_server(server, conn)
        warm_child.take_over(message, fds)
        code = warm_child.run(message["argv"])
    except BaseException:
        try:
            traceback.print_exc()
        except BaseException:
            pass
    finally:
        os._exit(code)


def leave_server(server: Server, conn: socket.socket) -> None:
    """Drop what belongs to the server: its signal handlers, its wake-up pipe, its sockets and the other runs'."""
    signal.set_wakeup_fd(-1)
    for job in server.jobs.values():
        job.conn.close()
        os.close(job.pidfd)
    for fd in (server.wake_r, server.wake_w):
        os.close(fd)
    server.selector.close()
    server.listener.close()
    conn.close()


def main() -> None:
    """``python -c`` bootstrap: ``sys.path`` as the starter had it, then serve."""
    args = json.loads(sys.argv[1])
    sys.path[:] = args["path"]
    sys.exit(serve(args["idle_minutes"], args["ready_fd"], tuple(args.get("added", ()))))
