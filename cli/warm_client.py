"""The client side of `decodelab warm`: hand this command line to a warm server, if one runs with this process's
identity, and wait for its exit status. Standard library only: it runs before anything heavy is imported.

The server forks a child that takes over this process's stdin, stdout and stderr (passed over the socket), its
working folder, environment, umask and ignored signals, and runs the same command line; this process forwards
SIGINT, SIGTERM and SIGHUP to it (through the server, which knows whether the child still runs) and exits with the
child's status (dying of the same signal if the child did). Any failure before the server accepts (no server, a
different identity, a folder or socket that is not private) returns None: the caller runs the command itself.
"""

from __future__ import annotations

import os
import signal
import socket
import sys

from . import warm_wire as wire

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
OTHER_SIGNALS = ("SIGQUIT", "SIGPIPE", "SIGXFSZ", "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGUSR1", "SIGUSR2", "SIGALRM")


def wanted(args: list[str]) -> bool:
    """Hand off unless turned off, unless this is `decodelab warm ...`, and only from a process's own stdio (an
    in-process caller that swapped sys.stdout, as tests do, runs in-process)."""
    if os.environ.get(wire.OFF_ENV, "") not in ("", "0"):
        return False
    words = [a for a in args if not a.startswith("-")]
    if words[:1] == ["warm"]:
        return False
    return sys.stdout is sys.__stdout__ and sys.stderr is sys.__stderr__ and sys.stdin is sys.__stdin__


def report(args: list[str], line: str) -> None:
    """--debug (before ``--``) or DECODELAB_WARM_REPORT=1: which path ran, on stderr."""
    cut = args.index("--") if "--" in args else len(args)
    if "--debug" in args[:cut] or os.environ.get(wire.REPORT_ENV, "") not in ("", "0"):
        try:
            sys.stderr.write(f"decodelab: {line}\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass


attempted = False  # one hand-off per process: at the console script's import of cli.main, else in main()


def from_the_console_script() -> None:
    """Called first thing in cli/main.py: when the `decodelab` console script is importing it (its __main__ has not
    bound ``main`` yet), hand the command to a warm server before typer and rich are imported, and exit with its
    status. Anything else that imports cli.main (tests, ``python -m``, a program) goes on as before."""
    entry = sys.modules.get("__main__")
    script = getattr(entry, "__file__", None) or ""
    if os.path.basename(script) != "decodelab" or os.path.basename(sys.argv[0]) != "decodelab" \
            or hasattr(entry, "main"):
        return
    try:
        code = hand_off(sys.argv[1:])
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        raise SystemExit(130) from None
    if code is not None:
        raise SystemExit(code)


def hand_off(args: list[str]) -> int | None:
    """The exit status of the command run by a warm server, or None when it must run here."""
    global attempted
    if attempted or not wanted(args):
        return None
    attempted = True
    try:
        sock = wire.connect()
    except wire.WireError as exc:
        report(args, f"cold run ({exc})")
        return None
    with sock:
        try:
            answer = request(sock, args)
        except (OSError, ValueError, wire.WireError) as exc:
            report(args, f"cold run (handshake failed: {exc})")
            return None
        if not answer.get("ok"):
            report(args, f"cold run ({answer.get('why', 'refused')})")
            return None
        return commit(sock, args, answer["server"])


def stdio_settings() -> dict:
    """How this interpreter opened its standard streams (encoding, errors, buffering), for the child to do the same."""
    out = {}
    for name in ("stdin", "stdout", "stderr"):
        s = getattr(sys, name)
        out[name] = {"encoding": s.encoding, "errors": s.errors, "line_buffering": s.line_buffering,
                     "write_through": getattr(s, "write_through", False)}
    return out


def ignored_signals() -> list[int]:
    """Signals this process ignores (inherited, as from nohup or a background job): a cold run would ignore them."""
    names = [s.name for s in FORWARDED] + list(OTHER_SIGNALS)
    return [int(getattr(signal, n)) for n in names if hasattr(signal, n) and signal.getsignal(getattr(signal, n))
            is signal.SIG_IGN]


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def request(sock: socket.socket, args: list[str]) -> dict:
    """Send the command line, this process's state and its fds 0, 1, 2; the server's answer."""
    for fd in (0, 1, 2):
        os.fstat(fd)  # a closed standard fd: run cold (OSError)
    message = {"kind": "run", "identity": wire.identity(), "argv": [sys.argv[0], *args], "cwd": os.getcwd(),
               "environ": dict(os.environ), "umask": current_umask(), "stdio": stdio_settings(),
               "ignored": ignored_signals()}
    socket.send_fds(sock, [b"F"], [0, 1, 2])
    wire.send(sock, message)
    answer = wire.receive(sock)
    if answer is None:
        raise wire.WireError("the server closed the connection")
    return answer


def commit(sock: socket.socket, args: list[str], server: int) -> int:
    """From "go" on the command is the server's (no cold fallback, so it never runs twice): forward signals until
    the child's status arrives, and exit with it (a child killed by a signal: the same signal here, as a cold run
    would have died)."""
    sock.settimeout(None)
    previous = {}

    def forward(signum, frame):
        try:
            wire.send(sock, {"kind": "signal", "signal": int(signum)})
        except OSError:
            pass

    for sig in FORWARDED:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            previous[sig] = signal.signal(sig, forward)
    try:
        wire.send(sock, {"kind": "go"})
        message = wire.receive(sock)
        if message is not None and "pid" in message:
            report(args, f"warm run: server {server} forked child {message['pid']}")
            message = wire.receive(sock)
    except (OSError, ValueError, wire.WireError):
        message = None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if message is None or "exit" not in message:
        sys.stderr.write("error: the warm server went away during the run\n")
        return 1
    code = int(message["exit"])
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    return code
