"""Start-up: from the command line to the first forward of a bundled model, against `import torch` in the same rounds.

Each variant is a fresh Python process, started in turn round after round (order rotated), timed from the parent:
wall seconds and the child's CPU seconds (user + system, from ``os.wait4``). Start-up is one thread reading files
that sit in the page cache, so on an idle machine its wall time is its CPU time; on a busy machine the wall time
also holds the time spent waiting for a core, which the CPU seconds leave out. Ratios to `import torch` (a floor
no decodelab change can lower) are the median of the per-round ratios, so a busy machine slows both alike.

Variants (``--variants``): ``python`` (an empty interpreter), ``torch`` (``import torch``), ``llama`` (``import
torch`` and transformers' Llama classes: the floor of any run on the bundled models), ``help`` (``decodelab
--help``), ``bad`` (``decodelab sample x --top-p 1.5``: reported before torch is imported), ``first`` (``decodelab
sample "Once upon a time" -n 1 -f json``: command line to the first forward and its token), ``first_warm`` (the same
command with a ``decodelab warm`` server running: the client hands the command to a child forked from a process
that has already imported everything; its CPU seconds are the client's plus the child's, which the server counts
and ``decodelab warm status`` reports), ``phases`` (the same
path in one process with a timer after each phase: the breakdown). Every variant but ``first_warm`` runs with
DECODELAB_NO_WARM=1, so a warm server the user left running changes nothing.

Goal: ``first`` <= 2 s on an idle machine (its CPU seconds here); ``bad`` without importing torch. A cold process
cannot reach it (``import torch`` and transformers' Llama modules alone take longer); ``first_warm`` does.

    python benchmarks/startup.py [--rounds 7] [--model tiny] [--variants python,torch,llama,help,bad,first,first_warm,phases]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

PROMPT = "Once upon a time"
PHASES = r"""
import json, sys, time
marks = [("interpreter", time.perf_counter(), time.process_time())]
def mark(name):
    marks.append((name, time.perf_counter(), time.process_time()))
from decodelab.cli.main import app
mark("decodelab CLI (typer, rich)")
import torch
mark("import torch")
import transformers.models.llama.modeling_llama
mark("transformers' Llama modules")
from decodelab.core.methods.sample import SampleSettings, build_sampler
mark("decodelab core")
from decodelab.core.engine.models import load_model
torch.set_num_threads(1)
lm = load_model(sys.argv[1])
mark("load tokenizer and weights")
sampler = build_sampler(lm, SampleSettings(max_new_tokens=1), lm.encode(sys.argv[2]))
next(iter(sampler))
mark("first forward and its traced token")
out = [{"phase": n, "wall_s": w - marks[i][1], "cpu_s": c - marks[i][2]} for i, (n, w, c) in enumerate(marks[1:])]
print(json.dumps(out))
"""


def commands(model: str) -> dict[str, list[str]]:
    cli = [shutil.which("decodelab", path=os.path.dirname(sys.executable)) or "decodelab"]
    return {
        "python": [sys.executable, "-c", "pass"],
        "torch": [sys.executable, "-c", "import torch"],
        "llama": [sys.executable, "-c", "import torch, transformers.models.llama.modeling_llama"],
        "help": cli + ["--help"],
        "bad": cli + ["sample", "x", "--top-p", "1.5"],
        "first": cli + ["sample", PROMPT, "-n", "1", "-m", model, "-f", "json", "--threads", "1"],
        "first_warm": cli + ["sample", PROMPT, "-n", "1", "-m", model, "-f", "json", "--threads", "1"],
        "phases": [sys.executable, "-c", PHASES, model, PROMPT],
    }


LABELS = {"first_warm": "first (warm)"}
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # the warm server is started with it too (its identity must match)


def env_of(variant: str) -> dict:
    return ENV if variant == "first_warm" else {**ENV, "DECODELAB_NO_WARM": "1"}


def timed(cmd: list[str], env: dict) -> tuple[float, float, str]:
    """Wall and CPU seconds of one child process (children run one at a time, so the growth of the children's
    rusage is this child's), and its stdout."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env).stdout
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), out


def torch_imported_by_bad(model: str) -> bool:
    """Does ``sample --top-p 1.5`` import torch before it reports? (-X importtime lists every module imported.)"""
    cmd = [sys.executable, "-X", "importtime", "-m", "decodelab.cli.main", "sample", "x", "--top-p", "1.5"]
    err = subprocess.run(cmd, capture_output=True, text=True).stderr
    return any(line.split("|")[-1].strip() == "torch" for line in err.splitlines())


def warm_server(cli: list[str], on: bool):
    """Start (on) or stop a warm server in a private temporary runtime folder; checks that it serves ``first``."""
    if on:
        ENV["DECODELAB_WARM_DIR"] = tempfile.mkdtemp(prefix="dlbench-")
        subprocess.run(cli + ["warm", "start", "--idle-minutes", "30"], env=ENV, check=True, capture_output=True)
        probe = subprocess.run(cli + ["--debug", "sample", "x", "-n", "1", "--threads", "1"], env=ENV,
                               capture_output=True, text=True)
        assert "warm run" in probe.stderr, probe.stderr
    else:
        subprocess.run(cli + ["warm", "stop"], env=ENV, check=True, capture_output=True)
        shutil.rmtree(ENV.pop("DECODELAB_WARM_DIR"), ignore_errors=True)


def served_cpu(cli: list[str]) -> float:
    """CPU seconds of every command the warm server has run so far (`decodelab warm status`)."""
    out = subprocess.run(cli + ["warm", "status"], env=ENV, capture_output=True, text=True).stdout
    return float(re.search(r"their CPU ([0-9.]+) s", out).group(1))


def spread(xs: list[float]) -> str:
    if any(x != x for x in xs):
        return "-"
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--variants", default="python,torch,llama,help,bad,first,first_warm,phases")
    args = ap.parse_args()
    cmds = {k: v for k, v in commands(args.model).items() if k in args.variants.split(",")}
    wall: dict[str, list[float]] = {k: [] for k in cmds}
    cpu: dict[str, list[float]] = {k: [] for k in cmds}
    phases: list[list[dict]] = []
    print(f"load average at the start: {os.getloadavg()[0]:.1f}")
    warm = "first_warm" in cmds
    if warm:
        warm_server(cmds["first_warm"][:1], True)
    try:
        rounds(args, cmds, wall, cpu, phases)
    finally:
        if warm:
            warm_server(cmds["first_warm"][:1], False)
    report(args, cmds, wall, cpu, phases)


def rounds(args, cmds, wall, cpu, phases) -> None:
    for r in range(args.rounds):
        names = list(cmds)
        names = names[r % len(names):] + names[:r % len(names)]
        for name in names:
            before = served_cpu(cmds[name][:1]) if name == "first_warm" else 0.0
            w, c, out = timed(cmds[name], env_of(name))
            wall[name].append(w)
            # warm: the client's CPU and its forked child's (the server's child: counted by the server)
            cpu[name].append(c + served_cpu(cmds[name][:1]) - before if name == "first_warm" else c)
            if name == "phases":
                phases.append(json.loads(out.strip().splitlines()[-1]))


def report(args, cmds, wall, cpu, phases) -> None:
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} logical cores; "
          f"{args.rounds} rounds")
    print("| variant | wall s, median (min-max) | CPU s, median (min-max) | wall / `import torch` | CPU / `import torch` |")
    print("|---|---:|---:|---:|---:|")
    for name in cmds:
        ratio = (lambda d: spread([a / b for a, b in zip(d[name], d["torch"])])) if "torch" in cmds else None
        print(f"| {LABELS.get(name, name)} | {spread(wall[name])} | {spread(cpu[name])} | "
              f"{ratio(wall) if ratio else '-'} | {ratio(cpu) if ratio else '-'} |")
    if phases:
        print("\n| phase (one process, in order) | wall s, median | CPU s, median (min-max) |")
        print("|---|---:|---:|")
        for i, row in enumerate(phases[0]):
            ws = [p[i]["wall_s"] for p in phases]
            cs = [p[i]["cpu_s"] for p in phases]
            print(f"| {row['phase']} | {statistics.median(ws):.2f} | {spread(cs)} |")
    if "bad" in cmds:
        print(f"\n`sample x --top-p 1.5` imports torch before reporting: {torch_imported_by_bad(args.model)}")


if __name__ == "__main__":
    main()
