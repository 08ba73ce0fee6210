"""The warm server's child becoming the client's command (:mod:`.warm_server` forks it): the client's fds 0, 1, 2,
folder, umask, environment, argv, standard streams and ignored signals, a fresh interpreter's signal dispositions,
then the command line run as the console script runs it and the interpreter's exit."""

from __future__ import annotations

import atexit
import io
import os
import signal
import sys

PYTHON_IGNORES = ("SIGPIPE", "SIGXFSZ")  # what CPython ignores at start-up


def die_with_server() -> None:
    """PR_SET_PDEATHSIG: if the server dies, the kernel kills this child (its client would never learn its status)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def reset_signals(ignored: list[int]) -> None:
    """A fresh interpreter's dispositions: default everywhere, SIGINT raising KeyboardInterrupt, SIGPIPE and SIGXFSZ
    ignored, and ignored what the client ignored; nothing blocked."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError, RuntimeError):
            pass
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in PYTHON_IGNORES:
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    for sig in ignored:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def take_over(message: dict, fds: list[int]) -> None:
    """The client's fds 0, 1, 2, folder, umask, environment, argv and standard streams."""
    reset_signals(message.get("ignored", []))
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.chdir(message["cwd"])
    os.umask(message["umask"])
    os.environ.clear()
    os.environ.update(message["environ"])
    sys.argv = list(message["argv"])
    reopen_stdio(message["stdio"])
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # its global generator was seeded once, in the server: a fresh process draws anew


def reopen_stdio(settings: dict) -> None:
    """sys.stdin, stdout and stderr on fds 0, 1, 2, opened as the client's interpreter opened its own."""
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        s = settings[name]
        binary = io.open(fd, "rb" if fd == 0 else "wb", buffering=0 if s["write_through"] and fd else -1,
                         closefd=False)
        stream = io.TextIOWrapper(binary, encoding=s["encoding"], errors=s["errors"], newline="\n",
                                  line_buffering=s["line_buffering"], write_through=s["write_through"])
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def run(argv: list[str]) -> int:
    """The command as the console script runs it (``sys.exit(main())``), then the interpreter's exit: atexit
    handlers, flushed streams."""
    from . import main as cli

    try:
        code = cli.main(list(argv[1:]))
    except SystemExit as exc:
        code = exit_code(exc)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = 120 if code == 0 else code
    return code if isinstance(code, int) else 0


def exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1
