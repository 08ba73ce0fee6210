"""benchmarks/gpu.py's code on the CPU (its --small mode; .ci/run runs the whole script): the parts that need no
timing run here, and on the CPU greedy equals `generate` on every architecture and dtype it checks."""

from __future__ import annotations

import importlib.util
import json
import sys

from conftest import ROOT


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "benchmarks" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_bench"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_small_run_writes_its_json_and_greedy_equals_generate(tmp_path):
    script = load_script()
    assert script.main(["--small", "--only", "exactness,transfers", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "gpu.json").read_text())
    assert {(r["arch"], r["dtype"]) for r in doc["exactness"]} == \
        {(a, d) for a in script.ARCHS for d in ("bfloat16", "float32")}
    assert all(r["equal"] and r["first_divergence"] is None for r in doc["exactness"]), doc["exactness"]
    reads = doc["transfers"]
    # the CPU budgets (tests/engine/test_runtime.py): at most about one host read per traced token
    assert reads["sample greedy (traced)"]["host_reads"] <= 1.5 and reads["cuda_syncs_counted"] is False
    assert (tmp_path / "gpu.md").is_file()


def test_the_markdown_lists_every_ratio_with_its_goal():
    script = load_script()
    doc = {"mode": "x", "started": "t", "device": "d", "versions": {"torch": "1", "transformers": "2"}, "seconds": 1.0,
           "batch1": {"ratios": {"sample/generate greedy (eager)": 1.25}, "tokens_per_s": {"a": 10.0},
                      "warmup_s": {"a": 0.5}, "roofline_tokens_per_s": 100.0, "weight_bytes": 2e9,
                      "copy_bandwidth_bytes_per_s": 2e11, "compiled": "measured", "profile": []},
           "batch": {"ratios": {"batch/continuous batching": 2.0}, "tokens_per_s": {}, "warmup_s": {}},
           "exactness": [{"arch": "llama", "dtype": "bfloat16", "equal": False, "first_divergence": 3,
                          "top2_margin_there": 0.0625}],
           "transfers": {"cuda_syncs_counted": True, "sample greedy (traced)": {"host_reads": 1.0,
                                                                                "cuda_syncs": 1.0}}}
    text = script.markdown(doc)
    assert "| sample/generate greedy (eager) | 1.25x | >= 1.0x |" in text
    assert "| batch/continuous batching | 2.00x | >= 1.5x |" in text
    assert "| llama | bfloat16 | False | 3 | 0.0625 |" in text
    assert "roofline: 100.0 tokens/s (2.000 GB of weights at 0.200 TB/s" in text
    assert "| sample greedy (traced) | 1.00 | 1.00 |" in text
