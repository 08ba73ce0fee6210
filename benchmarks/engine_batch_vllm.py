"""vLLM's own continuous batching on the workload `decodelab batch` will be compared with: 32 requests, each the
same 200-token prefix of the bundled validation text plus 8 tokens of its own, 64 new tokens each (greedy,
ignore_eos), all sent at once on 32 threads through decodelab's client to a vLLM server on loopback serving
presets/models/tiny in float32 (tests/engine/vllm_server.py; the vLLM venv of .ci/vllm-venv.sh).

Reported: wall seconds from the first request sent to the last answer, generated tokens / wall second, for two
rounds: round 1 with the prefix not yet in vLLM's prefix cache (a warm-up request on other tokens compiles
first), round 2 with it cached. The server and this client share the machine's cores, so the wall time depends on
what else runs: the script measures the CPU time other processes took during each round (/proc/stat minus this
process and the server's process tree) and says whether the machine was busy.

    python benchmarks/engine_batch_vllm.py [--requests 32] [--new-tokens 64] [--prefix 200]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))

from vllm_server import ROOT, SERVED_NAME, TINY, vllm_python, vllm_server  # noqa: E402

from decodelab.core.engine.http.client import ServedEngine  # noqa: E402
from decodelab.core.engine.http.wire import SamplingSettings  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
BUSY_SHARE = 0.10  # other processes using more than 10% of all cores during a round: the machine was busy


def machine_busy_s() -> float:
    """CPU seconds all cores spent busy since boot (/proc/stat: user nice system irq softirq steal)."""
    fields = open("/proc/stat").readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / TICK


def tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) of a process and all its live descendants."""
    parent, cpu = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        parent[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / TICK
    members, frontier = {root}, [root]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier and p not in members]
        members.update(kids)
        frontier = kids
    return sum(cpu.get(p, 0.0) for p in members)


def prompts(n: int, prefix_len: int) -> tuple[list[list[int]], list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY)
    ids = tok.encode((ROOT / "presets" / "models" / "validation.txt").read_text(), add_special_tokens=False)
    prefix = ids[:prefix_len]
    own = [ids[1000 + 8 * i: 1008 + 8 * i] for i in range(n)]
    return [prefix + o for o in own], ids[5000:5000 + prefix_len]


def server_pid(url: str) -> int:
    """The pid listening on the server's port (the api_server process; the engine core is its child)."""
    port = int(url.rsplit(":", 1)[1])
    inodes = set()
    for line in open("/proc/net/tcp").readlines()[1:]:
        parts = line.split()
        if int(parts[1].split(":")[1], 16) == port and parts[3] == "0A":  # 0A = LISTEN
            inodes.add(parts[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}").strip("socket:[]") in inodes:
                    return int(pid)
        except OSError:
            continue
    raise RuntimeError(f"no process listens on port {port}")


def one_round(engine: ServedEngine, batch: list[list[int]], settings: SamplingSettings, server: int) -> dict:
    busy0, tree0, self0 = machine_busy_s(), tree_cpu_s(server), sum(os.times()[:2])
    start = time.perf_counter()
    with ThreadPoolExecutor(len(batch)) as pool:
        results = list(pool.map(lambda p: engine.generate(p, settings), batch))
    wall = time.perf_counter() - start
    other = (machine_busy_s() - busy0) - (tree_cpu_s(server) - tree0) - (sum(os.times()[:2]) - self0)
    tokens = sum(len(r.token_ids) for r in results)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "other_cpu_s": max(0.0, other),
            "other_share": max(0.0, other) / (wall * os.cpu_count()), "ids": [r.token_ids for r in results]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=200)
    args = ap.parse_args()
    if vllm_python() is None:
        print("no vLLM venv: run .ci/vllm-venv.sh or set DECODELAB_VLLM_PYTHON", file=sys.stderr)
        return 2
    batch, warmup = prompts(args.requests, args.prefix)
    settings = SamplingSettings(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True, logprobs=1)
    print(f"load average before start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
    with vllm_server("raw_logprobs") as url:
        engine = ServedEngine(url, model=SERVED_NAME, timeout=600)
        engine.generate(warmup, settings)
        server = server_pid(url)
        rounds = [one_round(engine, batch, settings, server) for _ in range(2)]
    assert rounds[0]["ids"] == rounds[1]["ids"], "greedy rounds disagree"
    for i, r in enumerate(rounds, 1):
        cache = "prefix not cached" if i == 1 else "prefix cached"
        state = "BUSY" if r["other_share"] > BUSY_SHARE else "quiet"
        print(f"round {i} ({cache}): {args.requests} requests x {args.new_tokens} tokens, shared prefix "
              f"{args.prefix}: wall {r['wall_s']:.2f} s, {r['tokens_per_s']:.0f} tokens/s; other processes used "
              f"{r['other_cpu_s']:.1f} CPU s ({100 * r['other_share']:.0f}% of the machine): machine {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
