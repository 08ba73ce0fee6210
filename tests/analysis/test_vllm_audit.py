"""The audits against a real vLLM server on the bundled tiny model (float32): its sampler passes check-sampler (one
request with n, and seeded requests), its full prompt logprobs agree with the local model within the stated
tolerance, and as an audit-numerics condition it is within float32 rounding. Needs the vLLM venv:

    DECODELAB_VLLM_PYTHON=~/.cache/decodelab/vllm-0.32.0/bin/python pytest -m vllm tests/analysis/test_vllm_audit.py

One server (--logprobs-mode raw_logprobs), started once for the module (90-200 s on 2 cores).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))  # vllm_server.py

from vllm_server import SERVED_NAME, vllm_server  # noqa: E402

PYTHON = os.environ.get("DECODELAB_VLLM_PYTHON")
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not PYTHON or not Path(PYTHON).exists(),
                                 reason="set DECODELAB_VLLM_PYTHON to the vLLM venv's python (.ci/vllm-venv.sh)")]
TOL = 1e-4  # float32 on both sides: the client tests' tolerance (test_vllm_real.py)
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def tiny():
    from decodelab.core.engine.models import load_model

    return load_model("tiny", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def conn(tiny):
    from decodelab.core.methods.served import connect

    with vllm_server("raw_logprobs", Path(PYTHON)) as url:
        yield connect(url, tiny, {"generate": "check-sampler"}, model=SERVED_NAME, timeout=120)


@pytest.mark.parametrize("how, draws", [("n", 2000), ("seeded", 400)])
def test_vllm_s_sampler_passes_check_sampler(tiny, conn, how, draws):
    from decodelab.core.analysis.sampler_check import check_sampler
    from decodelab.core.methods.sample import SampleSettings

    settings = SampleSettings(temperature=0.7, top_k=40, top_p=0.9, seed=11, semantics="vllm")
    result = check_sampler(tiny, settings, tiny.encode(PROMPT), 3, draws, 0.01, conn, how)
    assert result.passed, result.verdict
    assert all(p.forbidden_draws == 0 for p in result.prefixes)


def test_vllm_s_full_logprobs_agree_within_the_tolerance(tiny, conn):
    from decodelab.core.analysis.full_logprobs import full_check

    s = full_check(conn.engine, tiny, tiny.encode(PROMPT), 12, 20).summary
    assert s["max_abs_delta_logprob"] < TOL and abs(s["kl_lower_mean"]) < TOL and s["tv_lower_mean"] < TOL
    assert abs(s["lse_drift_max"]) < TOL and abs(s["lse_drift_min"]) < TOL
    assert all(f["local_margin"] < TOL for f in s["argmax_flips"])  # a flip only at a tie


def test_vllm_as_an_audit_numerics_condition(tiny, conn):
    from decodelab.core.analysis.numerics import audit, greedy_text

    ids = greedy_text(tiny.model, tiny.encode(PROMPT), 12)
    c = audit(tiny, ids, [], conn.engine, "fp32", 20).conditions[0]
    assert c.kind == "engine" and c.max_abs_delta_logprob < TOL
    assert all(f.reference_margin < TOL for f in c.flips)
