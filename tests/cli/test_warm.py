"""`decodelab warm`: a command handed to a warm server prints what a cold run prints, byte for byte (timings aside),
exits with the same status, keeps an interrupted run's lines, and falls back to a cold run whenever the server
would not run the same code on the same settings. Real processes throughout: the console script, a server in a
temporary runtime folder, signals. Every server a test starts is killed at the end."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from decodelab.cli import warm_wire

CLI = Path(sys.executable).parent / "decodelab"
pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="decodelab warm is Linux-only"),
              pytest.mark.skipif(not CLI.is_file(), reason="the decodelab console script is not installed")]
PROMPT = "Once upon a time"
TIMING = re.compile(r'("[a-z_]*(?:_s|_per_s|_ms)": )-?[0-9.e+-]+')  # wall-clock figures differ run to run
# so does the machine's load: a timed run on an oversubscribed machine has a `machine` field and a note (cli/machine.py)
MACHINE = re.compile(r'(, )?"machine": \{[^{}]*\}(,\s*)?')
MACHINE_NOTE = re.compile(r"note: load average .* the machine was oversubscribed.*\n")


def steady(text: str) -> str:
    """Output with what depends on the moment taken out: wall-clock figures and the machine's load."""
    return MACHINE_NOTE.sub("", MACHINE.sub("", TIMING.sub(r"\1T", text)))
# A buffered pipe's readline() may read lines past the first into its buffer, and communicate() then reads the fd
# itself and never sees them (a busy machine lets the child write several lines before the first readline): unbuffered,
# readline() reads exactly one line.
UNBUFFERED = 0
started: list[int] = []  # every server pid a test started, killed at the end


def environment(folder: str, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (warm_wire.OFF_ENV, warm_wire.REPORT_ENV)}
    return {**env, warm_wire.DIR_ENV: folder, "OMP_NUM_THREADS": "1", "COLUMNS": "100", **extra}


def decodelab(env: dict, *args: str, report: bool = False, cold: bool = False, timeout: float = 120):
    env = {**env, **({warm_wire.REPORT_ENV: "1"} if report else {}), **({warm_wire.OFF_ENV: "1"} if cold else {})}
    proc = subprocess.run([str(CLI), *args], capture_output=True, text=True, env=env, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def start(env: dict, *args: str) -> int:
    code, out, err = decodelab(env, "warm", "start", *args, timeout=300)
    assert code == 0, err
    pid = int(re.search(r"pid (\d+)", out).group(1))
    started.append(pid)
    return pid


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


@pytest.fixture(scope="module", autouse=True)
def no_server_survives():
    yield
    for pid in started:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def folder():
    path = tempfile.mkdtemp(prefix="dlwarm-")  # short: a Unix socket's path holds 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def base_env(folder):
    """Taken once: an in-process run sets HF_HUB_OFFLINE in this process's environment, and a server started before
    would then (rightly) not serve a client started after."""
    return environment(folder)


@pytest.fixture
def env(base_env):
    """The environment of every client, with a warm server running for it (started once, restarted if stopped)."""
    env = dict(base_env)
    if decodelab(env, "warm", "status")[0] != 0:
        start(env, "--idle-minutes", "10")
    return env


def warm_and_cold(cli, env: dict, *args: str):
    """(code, stdout, stderr) warm, with the report line taken out of stderr (asserted there), and of the same
    command run cold in this process (the entry point a cold process runs, without paying its imports again)."""
    code, out, err = decodelab(env, *args, report=True)
    lines = err.splitlines(keepends=True)
    reports = [line for line in lines if line.startswith("decodelab: ")]
    assert len(reports) == 1 and reports[0].startswith("decodelab: warm run"), err
    warm = (code, out, "".join(line for line in lines if line not in reports))
    return warm, cli(*args)


def test_sample_json_is_the_cold_output(cli, env):
    warm, cold = warm_and_cold(cli, env, "sample", PROMPT, "-n", "8", "-m", "tiny", "-f", "json", "--threads", "1",
                               "--top-p", "0.9", "--temperature", "0.8", "--seed", "3")
    assert warm[0] == cold[0] == 0, warm[2] + cold[2]
    assert steady(warm[1]) == steady(cold[1])
    assert json.loads(warm[1])["token_ids"] == json.loads(cold[1])["token_ids"]
    assert steady(warm[2]) == steady(cold[2])


def test_probs_json_is_the_cold_output(cli, env):
    warm, cold = warm_and_cold(cli, env, "probs", PROMPT, "-m", "tiny", "-f", "json", "--threads", "1",
                               "--top-k", "20")
    assert warm == cold


def test_bad_input_is_the_same_one_line_and_exit_2(cli, env):
    warm, cold = warm_and_cold(cli, env, "sample", PROMPT, "--top-p", "1.5")
    assert warm == cold
    assert warm[0] == 2 and warm[2].count("\n") == 1 and "--top-p" in warm[2]


def run_on_a_terminal(env: dict, *args: str, cold: bool = False) -> tuple[int, bytes, bytes]:
    """Exit status, what the terminal on stdout received, and stderr (a pipe: on a terminal it would show a spinner
    whose frames depend on timing)."""
    master, slave = pty.openpty()
    env = {**env, **({warm_wire.OFF_ENV: "1"} if cold else {})}
    proc = subprocess.Popen([str(CLI), *args], stdin=subprocess.DEVNULL, stdout=slave, stderr=subprocess.PIPE, env=env)
    os.close(slave)
    data = b""
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        try:
            chunk = os.read(master, 65536) if ready else b""
        except OSError:  # EIO: the last writer closed the terminal
            chunk = b""
        if not chunk:
            break
        data += chunk
    os.close(master)
    return proc.wait(timeout=60), data, proc.stderr.read()


def test_a_table_on_a_terminal_is_the_cold_one(env):
    """rich sees a terminal on the passed fd (colours, width from COLUMNS) exactly as a cold process does."""
    args = ("probs", PROMPT, "-m", "tiny", "--threads", "1", "--top-k", "5")
    warm, cold = run_on_a_terminal(env, *args), run_on_a_terminal(env, *args, cold=True)
    assert warm == cold and warm[0] == 0
    assert b"\x1b[" in warm[1], "a terminal gets colours"


def sigint_as_in_a_terminal() -> None:
    """A terminal's foreground command has SIGINT at its default; a background job of a script (as the test run may
    be: `cmd &` ignores SIGINT) passes SIGINT ignored to its children, and then Ctrl-C does nothing, warm or cold."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_sigint_keeps_the_lines_written_and_exits_130(env):
    cmd = [str(CLI), "sample", PROMPT, "-n", "400", "--ignore-eos", "-m", "tiny", "-f", "jsonl", "--threads", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=UNBUFFERED,
                            env={**env, warm_wire.REPORT_ENV: "1"}, preexec_fn=sigint_as_in_a_terminal)
    first = proc.stdout.readline()
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert b"warm run" in err and err.endswith(b"interrupted\n")
    docs = [json.loads(line) for line in [first, *rest.splitlines()]]
    assert [d["type"] for d in docs[:-1]] == ["step"] * (len(docs) - 1) and docs[-1]["type"] == "summary"
    assert len(docs) < 400, "the run was cut short"


def test_sigint_ignored_by_the_client_is_ignored_by_its_child(env):
    """A client started with SIGINT ignored (a script's background job): its child ignores it too, as the cold
    process would have, and the run ends by itself."""
    cmd = [str(CLI), "sample", PROMPT, "-n", "40", "--ignore-eos", "-m", "tiny", "-f", "jsonl", "--threads", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=UNBUFFERED,
                            env={**env, warm_wire.REPORT_ENV: "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    first = proc.stdout.readline()
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and b"warm run" in err, err
    docs = [json.loads(line) for line in [first, *rest.splitlines()]]
    assert len(docs) == 41 and docs[-1]["stop_reason"] == "length"


def test_a_child_whose_client_died_is_killed(env):
    cmd = [str(CLI), "sample", PROMPT, "-n", "400", "--ignore-eos", "-m", "tiny", "-f", "jsonl", "--threads", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=UNBUFFERED,
                            env={**env, warm_wire.REPORT_ENV: "1"})
    proc.stdout.readline()
    child = int(re.search(rb"forked child (\d+)", proc.stderr.readline()).group(1))
    proc.kill()
    proc.wait(timeout=10)
    assert wait_gone(child, 10), "the child outlived its client"


def test_a_server_with_another_identity_is_not_used(env):
    """An import-time variable the server was not started with (torch reads TORCH_* at import): run cold."""
    other = {**env, "TORCH_WARM_TEST_MARK": "1"}
    code, out, err = decodelab(other, "probs", PROMPT, "-m", "tiny", "-f", "json", "--threads", "1", report=True)
    assert code == 0 and "cold run (the warm server's identity differs: $TORCH_WARM_TEST_MARK)" in err
    assert (code, out) == decodelab(env, "probs", PROMPT, "-m", "tiny", "-f", "json", "--threads", "1")[:2], \
        "the same as warm"


def served(env: dict) -> tuple[str, int]:
    """The socket of the running server and how many commands it has forked, from `warm status`."""
    code, out, err = decodelab(env, "warm", "status")
    assert code == 0, out + err
    return re.search(r" on (\S+):", out).group(1), int(re.search(r"(\d+) commands served \(", out).group(1))


def test_a_client_that_gives_up_before_go_runs_nothing(env):
    """The server forks only once the client has said "go": a client that timed out waiting for the answer (and
    ran the command cold) is never also run warm."""
    path, before = served(env)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(path)
    socket.send_fds(sock, [b"F"], [])
    warm_wire.send(sock, {"kind": "status"})
    ident = warm_wire.receive(sock)["identity"]
    sock.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(path)
    devnull = os.open(os.devnull, os.O_RDWR)
    socket.send_fds(sock, [b"F"], [devnull] * 3)
    os.close(devnull)
    warm_wire.send(sock, {"kind": "run", "identity": ident, "argv": ["decodelab", "models"], "cwd": "/",
                          "environ": {}, "umask": 0o022, "stdio": {}, "ignored": []})
    assert warm_wire.receive(sock)["ok"] is True, "accepted: the identity is the server's own"
    sock.close()  # gone without "go"
    assert served(env)[1] == before


def test_identity_differences_are_named():
    ident = warm_wire.identity()
    other = {**ident, "source": "0" * 64, "environment": {**ident["environment"], "HF_HOME": "/elsewhere"}}
    assert warm_wire.differences(ident, ident) == []
    assert warm_wire.differences(ident, other) == ["source", "$HF_HOME"]


def test_no_warm_disables_it(env):
    code, _, err = decodelab(env, "sample", PROMPT, "--top-p", "1.5", report=True, cold=True)
    assert code == 2 and "decodelab: " not in err


def test_status_and_stop(env):
    code, out, _ = decodelab(env, "warm", "status")
    assert code == 0 and "run warm" in out
    pid = int(re.search(r"pid (\d+)", out).group(1))
    code, out, err = decodelab(env, "warm", "stop")
    assert code == 0 and f"stopped warm server pid {pid}" in out, err
    assert wait_gone(pid, 10)
    assert decodelab(env, "warm", "status")[0] == 1
    assert decodelab(env, "warm", "stop")[1] == "no warm server is running\n"


def test_an_idle_server_exits(tmp_path_factory):
    folder = tempfile.mkdtemp(prefix="dlidle-")
    try:
        env = environment(folder)
        pid = start(env, "--idle-minutes", "0.02")  # 1.2 s
        assert wait_gone(pid, 30)
        assert not [f for f in os.listdir(folder) if f.endswith(".sock")], "the socket is removed"
        assert decodelab(env, "warm", "status")[0] == 1
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_idle_minutes_out_of_range_is_one_line(base_env):
    code, out, err = decodelab(base_env, "warm", "start", "--idle-minutes", "0")
    assert code == 2 and err.startswith("error: --idle-minutes 0:") and err.count("\n") == 1


def test_a_shell_without_omp_num_threads_gets_a_server_and_its_runs_choose_their_threads(cli):
    """Without OMP_NUM_THREADS the OpenMP runtime torch loads starts a thread at import, and a process with two
    threads is refused as a fork server: `warm start` gives the server OMP_NUM_THREADS=1 (out of its identity), so a
    shell that never set it is served, and the run sets its threads itself, as a cold run does: the same output."""
    folder = tempfile.mkdtemp(prefix="dlomp-")
    try:
        env = {k: v for k, v in environment(folder).items() if k != "OMP_NUM_THREADS"}
        pid = start(env, "--idle-minutes", "5")
        args = ("sample", PROMPT, "-n", "6", "-m", "tiny", "-f", "json", "--threads", "1", "--seed", "3")
        code, out, err = decodelab(env, *args, report=True)
        assert code == 0 and "decodelab: warm run" in err, err
        cold = decodelab(env, *args, cold=True)
        assert cold[0] == 0 and steady(out) == steady(cold[1])
        assert decodelab(env, "warm", "stop")[0] == 0 and wait_gone(pid, 30)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
