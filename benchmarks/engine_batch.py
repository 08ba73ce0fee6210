"""`decodelab batch --engine`: decodelab's iteration-level batching and vLLM's own continuous batching on the same
requests, in one command: 32 requests, each the same 200-token prefix of the bundled validation text plus 8 tokens
of its own (written as text, tokenised by decodelab and sent as token ids to both), 64 greedy tokens each with
ignore_eos, decodelab with --max-batch 32; vLLM 0.32 CPU serving presets/models/tiny in float32 on loopback
(tests/engine/vllm_server.py; the vLLM venv of .ci/vllm-venv.sh).

Two rounds against one server: round 1 with the prefix not yet in vLLM's prefix cache (a warm-up request on other
tokens compiles first), round 2 with it cached. Each round reports both sides' tokens/s, the requests whose tokens
agree, the prefix-cache hits of both (decodelab's shared blocks; vLLM's /metrics counters, server-wide), and the
CPU time other processes took (/proc/stat less this process and the server's tree): above 10% of the machine it
says BUSY.

    python benchmarks/engine_batch.py [--requests 32] [--new-tokens 64] [--prefix 200] [--max-batch 32]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests" / "engine")]

from engine_batch_vllm import BUSY_SHARE, machine_busy_s, prompts, server_pid, tree_cpu_s  # noqa: E402
from vllm_server import SERVED_NAME, TINY, vllm_python, vllm_server  # noqa: E402

from decodelab.cli.main import main as decodelab  # noqa: E402
from decodelab.core.engine.http.client import ServedEngine  # noqa: E402
from decodelab.core.engine.http.wire import SamplingSettings  # noqa: E402


def prompts_file(folder: Path, n: int, prefix: int) -> Path:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY)
    batch, _ = prompts(n, prefix)
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "prompt": tok.decode(ids)}) + "\n" for i, ids in enumerate(batch)))
    return path


def one_round(url: str, path: Path, new_tokens: int, max_batch: int, server: int) -> dict:
    busy0, tree0, self0 = machine_busy_s(), tree_cpu_s(server), sum(os.times()[:2])
    start = time.perf_counter()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = decodelab(["batch", "--prompts-file", str(path), "-n", str(new_tokens), "-t", "0", "--ignore-eos",
                          "--max-batch", str(max_batch), "--baselines", "none", "--engine", url,
                          "--engine-timeout", "600", "-f", "json"])
    wall = time.perf_counter() - start
    assert code == 0, f"decodelab batch exited {code}"
    other = (machine_busy_s() - busy0) - (tree_cpu_s(server) - tree0) - (sum(os.times()[:2]) - self0)
    doc = json.loads(out.getvalue())
    return {"summary": doc["summary"], "other_share": max(0.0, other) / (wall * os.cpu_count()), "wall_s": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=200)
    ap.add_argument("--max-batch", type=int, default=32)
    args = ap.parse_args()
    if vllm_python() is None:
        print("no vLLM venv: run .ci/vllm-venv.sh or set DECODELAB_VLLM_PYTHON", file=sys.stderr)
        return 2
    print(f"load average before start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
    with tempfile.TemporaryDirectory() as folder, vllm_server("raw_logprobs") as url:
        path = prompts_file(Path(folder), args.requests, args.prefix)
        _, warmup = prompts(args.requests, args.prefix)
        ServedEngine(url, model=SERVED_NAME, timeout=600).generate(
            warmup, SamplingSettings(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True, logprobs=1))
        server = server_pid(url)
        rounds = [one_round(url, path, args.new_tokens, args.max_batch, server) for _ in range(2)]
    for i, r in enumerate(rounds, 1):
        s = r["summary"]
        cache = "prefix not cached in vLLM" if i == 1 else "prefix cached in vLLM"
        state = "BUSY" if r["other_share"] > BUSY_SHARE else "quiet"
        print(f"round {i} ({cache}): {s['requests']} requests x {args.new_tokens} tokens, shared prefix "
              f"{args.prefix}: decodelab batch {s['seconds']:.2f} s, {s['tokens_per_s']:.0f} tokens/s, prefix hits "
              f"{s['prefix_hit_tokens']}/{s['prompt_tokens']}; vLLM {s['tokens'] / s['engine_tokens_per_s']:.2f} s, "
              f"{s['engine_tokens_per_s']:.0f} tokens/s, prefix hits {s['engine_prefix_hit_tokens']}/"
              f"{s['engine_prefix_query_tokens']}; same tokens {s['engine_same_tokens']}/{s['requests']}; other "
              f"processes used {100 * r['other_share']:.0f}% of the machine: {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
