"""`decodelab warm start|stop|status`: an opt-in background process that has already imported torch,
transformers and decodelab, so that each later command starts in a fraction of a second (:mod:`..warm_server`;
the hand-off itself is :mod:`..warm_client`). A cold process pays about 5 s of imports before its first forward."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time

import typer

from ...core.errors import ConfigError
from .. import warm_wire as wire
from ..view import render

IDLE_MINUTES = (0.01, 7 * 24 * 60.0)  # what --idle-minutes allows
READY_TIMEOUT_S = 180.0  # the imports take ~5 s on an idle machine, much longer on a loaded one
STOP_TIMEOUT_S = 60.0
BOOT = ("import json, sys; sys.path[:] = json.loads(sys.argv[1])['path']; "
        "from decodelab.cli.warm_server import main; main()")

warm = typer.Typer(name="warm", no_args_is_help=True, add_completion=False,
                   help="A warm background process that has imported torch, transformers and decodelab: later "
                        "commands of this user start at once (fork, not import). Off until `warm start`.")


def say(line: str) -> None:
    render.write_record(line + "\n")


def check_supported() -> None:
    if not (hasattr(os, "pidfd_open") and hasattr(socket, "SO_PEERCRED") and hasattr(socket, "send_fds")):
        raise ConfigError("decodelab warm needs Linux (pidfd_open, SO_PEERCRED and fd passing); commands run cold here")


def ask(kind: str) -> dict | None:
    """The server's answer to a status or stop request, or None when none listens."""
    try:
        sock = wire.connect()
    except wire.WireError:
        return None
    with sock:
        try:
            socket.send_fds(sock, [b"F"], [])
            wire.send(sock, {"kind": kind})
            return wire.receive(sock)
        except (OSError, ValueError, wire.WireError):
            return None


def gone(pid: int) -> bool:
    """No such process, or a zombie nobody reaped yet (the server is not our child)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def stop_server() -> dict | None:
    """Ask the server to stop and wait until it has (running commands finish first); its last status, or None."""
    info = ask("status")
    if info is None or ask("stop") is None:
        return None
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while not gone(info["server"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return info


@warm.command()
def start(idle_minutes: float = typer.Option(30.0, "--idle-minutes", metavar="N",
                                             help="Exit after N minutes without a command.")) -> None:
    """Start the warm server (a detached process; it imports everything a run needs, then waits for commands)."""
    check_supported()
    if not IDLE_MINUTES[0] <= idle_minutes <= IDLE_MINUTES[1]:
        raise ConfigError(f"--idle-minutes {idle_minutes:g}: must be in [{IDLE_MINUTES[0]:g}, {IDLE_MINUTES[1]:g}]")
    try:
        wire.socket_path(create=True)
    except wire.WireError as exc:
        raise ConfigError(f"decodelab warm: {exc}") from None
    info = ask("status")
    if info is not None:
        diffs = wire.differences(info["identity"], wire.identity())
        if not diffs:
            say(f"a warm server already runs: pid {info['server']} on {info['socket']}")
            return
        stop_server()
        say(f"stopped a warm server that no longer matches (pid {info['server']}: {', '.join(diffs[:6])} differ)")
    pid, path = spawn(idle_minutes)
    say(f"warm server pid {pid} listening on {path}; it exits after {idle_minutes:g} idle minutes "
        "(`decodelab warm stop` ends it, DECODELAB_NO_WARM=1 bypasses it)")


def spawn(idle_minutes: float) -> tuple[int, str]:
    """Launch the server in its own session, detached from this terminal, and wait for its ready line."""
    read_end, write_end = os.pipe()
    log = open(wire.log_path(), "ab")
    env, added = server_environment(os.environ)
    args = json.dumps({"path": sys.path, "idle_minutes": idle_minutes, "ready_fd": write_end, "added": added})
    try:
        subprocess.Popen([sys.executable, *subprocess._args_from_interpreter_flags(), "-c", BOOT, args],
                         stdin=subprocess.DEVNULL, stdout=log, stderr=log, pass_fds=[write_end],
                         start_new_session=True, cwd="/", env=env)
    finally:
        os.close(write_end)
        log.close()
    line = read_line(read_end, READY_TIMEOUT_S)
    if not line.startswith("ready "):
        raise ConfigError(f"decodelab warm start: the server did not start: {line or 'no answer'} "
                          f"(its log: {wire.log_path()})")
    _, pid, path = line.split(" ", 2)
    return int(pid), path


def server_environment(environ) -> tuple[dict[str, str], list[str]]:
    """The server's environment: this one, plus OMP_NUM_THREADS=1 where it is unset, because without it the OpenMP
    runtime that torch loads starts a thread at import, and a process with a second thread cannot be forked safely.
    Its children take the client's environment, and a run with OMP_NUM_THREADS unset always sets torch's threads
    itself (--threads or the measured default: ``core.engine.models.choose_threads``), so the value reaches no run.
    The names added, left out of the server's identity."""
    env = dict(environ)
    if not env.get("OMP_NUM_THREADS"):
        env["OMP_NUM_THREADS"] = "1"
        return env, ["OMP_NUM_THREADS"]
    return env, []


def read_line(fd: int, timeout: float) -> str:
    data, deadline = b"", time.monotonic() + timeout
    try:
        while b"\n" not in data:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                break
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    return data.decode("utf-8", "replace").strip()


@warm.command()
def stop() -> None:
    """Stop the warm server (after the commands it runs have finished)."""
    check_supported()
    info = stop_server()
    say("no warm server is running" if info is None else f"stopped warm server pid {info['server']}")


@warm.command()
def status() -> None:
    """Whether a warm server runs and would serve this process (exit status 1 when none would)."""
    check_supported()
    info = ask("status")
    if info is None:
        say("no warm server is running; commands run cold (`decodelab warm start`)")
        raise typer.Exit(1)
    diffs = wire.differences(info["identity"], wire.identity())
    left = info["idle_left_s"]
    say(f"warm server pid {info['server']} on {info['socket']}: up {time.time() - info['started']:.0f} s, "
        f"{info['runs']} commands served (their CPU {info['children_cpu_s']:.2f} s), {info['running']} running, "
        + (f"exits in {left / 60:.1f} idle minutes" if left is not None else "busy"))
    if diffs:
        say(f"it would not serve this process ({', '.join(diffs[:8])} differ): commands run cold; "
            "`decodelab warm start` replaces it")
        raise typer.Exit(1)
    say("commands from this process's environment run warm")
