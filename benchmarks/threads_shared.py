"""The default thread count on a shared machine (issue 40): the same decodelab command run back to back with the
default, with ``--threads 1`` and with ``--threads N`` (N = the physical cores), each under a second job that keeps
cores busy, and with OpenMP's waiting passive (the CLI's default, ``OMP_WAIT_POLICY=PASSIVE``) and active.

Goal: whatever the load, the default is never more than 10% slower than the best of 1 and N threads:
``default / min(1 thread, N threads) <= 1.10`` in wall time, in every row.

The second job is ``--jobs`` busy Python processes (a pure loop: one runnable thread each, as a test suite or
another decode would be), started before the rounds and kept running through them; ``--jobs 0`` measures the free
machine. Each round runs the three settings in a rotated order; the figure is the median over rounds of the
per-round wall times (the command's own start-up included: it is what a user waits for), with the load average
before and after printed beside it (a row measured with load >= cores at either end says ``oversubscribed``).

    python benchmarks/threads_shared.py [--rounds 3] [--jobs 0,1,2] [--policy passive,active] [--small]

``--small`` runs one short command, one round, no second job: a check that the script runs, not a figure.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

from decodelab.core.engine.machine_load import load_average, oversubscribed
from decodelab.core.engine.models import physical_cores

# the examples, shortened to a few seconds at one thread on the 2-core machine
COMMANDS = {
    "sample": ["sample", "Once upon a time", "-n", "64", "--ignore-eos", "-f", "json"],
    "beam": ["beam", "Once upon a time", "-n", "24", "-b", "4", "-f", "json"],
    "quantize-kv": ["quantize-kv", "--text-file", "{text}", "--limit", "64", "--grid", "-f", "json"],
}
SMALL = {"sample": ["sample", "Once", "-n", "4", "-f", "json"]}
BUSY = "while True: pass"


def decodelab() -> list[str]:
    found = shutil.which("decodelab")
    return [found] if found else [sys.executable, "-m", "decodelab.cli.main"]


def run(args: list[str], threads: int | None, policy: str) -> float:
    """Wall seconds of one cold command; ``threads`` None: the default."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["OMP_WAIT_POLICY"] = policy.upper()
    env["DECODELAB_NO_WARM"] = "1"  # never a warm server: every run pays the same start-up
    extra = [] if threads is None else ["--threads", str(threads)]
    start = time.perf_counter()
    done = subprocess.run(decodelab() + args + extra, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)}: exit {done.returncode}: {done.stderr.strip()[-300:]}")
    return time.perf_counter() - start


def measure(args: list[str], rounds: int, policy: str, cores: int) -> dict[str, float]:
    settings = {"default": None, "1 thread": 1, f"{cores} threads": cores}
    times: dict[str, list[float]] = {name: [] for name in settings}
    names = list(settings)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(run(args, settings[name], policy))
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--jobs", default="0,1,2", help="busy processes beside the runs, one measurement per count")
    ap.add_argument("--policy", default="passive,active", help="OMP_WAIT_POLICY values to measure")
    ap.add_argument("--commands", default=",".join(COMMANDS))
    ap.add_argument("--small", action="store_true", help="a check that the script runs (no figure)")
    args = ap.parse_args()
    text = os.path.join(os.path.dirname(__file__), "..", "presets", "models", "validation.txt")
    commands = SMALL if args.small else {k: COMMANDS[k] for k in args.commands.split(",")}
    jobs = [0] if args.small else [int(j) for j in args.jobs.split(",")]
    rounds = 1 if args.small else args.rounds
    policies = ["passive"] if args.small else args.policy.split(",")
    cores = physical_cores()
    print(f"{os.cpu_count()} logical / {cores} physical cores; {rounds} rounds; wall seconds, median over rounds")
    print("| command | second job | OMP_WAIT_POLICY | default | 1 thread | N threads | default / best | load before-after |")
    print("|---|---:|---|---:|---:|---:|---:|---|")
    worst = 0.0
    for n_jobs in jobs:
        busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(n_jobs)]
        try:
            time.sleep(5 if n_jobs else 0)
            for name, cmd in commands.items():
                cmd = [a.replace("{text}", text) for a in cmd]
                for policy in policies:
                    before = load_average()
                    t = measure(cmd, rounds, policy, cores)
                    after = load_average()
                    values = list(t.values())
                    ratio = values[0] / min(values[1:])
                    worst = max(worst, ratio)
                    flag = " (oversubscribed)" if oversubscribed(before, after, cores) else ""
                    print(f"| {name} | {n_jobs} busy | {policy} | {values[0]:.2f} | {values[1]:.2f} | {values[2]:.2f} | "
                          f"{ratio:.2f}x | {before:.1f}-{after:.1f}{flag} |", flush=True)
        finally:
            for p in busy:
                p.kill()
                p.wait()
    print(f"worst default / best: {worst:.2f}x (goal <= 1.10x)" + (" -- --small: not a figure" if args.small else ""))


if __name__ == "__main__":
    main()
