"""`batch` times every variant warm (issue 34, item 1): the run is warmed at its own batch size before its timing,
transformers' continuous batching (kernels of its own) just before its own; each warm-up is reported apart."""

from __future__ import annotations

import pytest
from conftest import ROOT

from decodelab.core.methods.batch import run as run_module
from decodelab.core.methods.batch.run import BatchSettings, Entry, run_batch, warm_work

TINY = ROOT / "presets" / "models" / "tiny"
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def lm():
    if not (TINY / "model.safetensors").is_file():
        pytest.skip("the bundled tiny model's weights are not installed")
    from decodelab.core.engine.models import load_model

    return load_model("tiny", device="cpu")


def test_the_warm_work_has_the_runs_batch_size():
    assert len(warm_work(BatchSettings(max_batch=32), 40)) == 32
    assert len(warm_work(BatchSettings(max_batch=32), 5)) == 5
    assert len(warm_work(BatchSettings(max_batch=1), 5)) == 2  # two rows at the least
    assert all(n == run_module.WARM_NEW for _, n in warm_work(BatchSettings(max_batch=4), 9))


def test_each_variant_is_warmed_before_it_is_timed_and_the_warm_up_is_reported(lm, monkeypatch):
    events = []
    real_warm_up = run_module.warm_up

    def warm_up(lm_, settings, count=2, static=False):
        events.append(("warm", count, static))
        return real_warm_up(lm_, settings, count, static)

    def fake_cb(model, work, max_batch, tokens, page):
        events.append(("cb", len(work), [n for _, n in work]))
        return [[0] * n for _, n in work], 0.5

    monkeypatch.setattr(run_module, "warm_up", warm_up)
    monkeypatch.setattr(run_module, "continuous_batching_generate", fake_cb)
    settings = BatchSettings(max_new_tokens=3, max_batch=3, block_size=4, baselines=("static", "transformers"),
                             **GREEDY)
    entries = [Entry(str(i), "Once upon a time", settings) for i in range(4)]
    report = run_batch(lm, settings, entries)
    assert events == [("warm", 4, False), ("cb", 3, [2, 2, 2]), ("cb", 4, [3, 3, 3, 3])]
    summary = report.summary()
    assert summary["warmup_s"] > 0 and summary["transformers_warmup_s"] >= 0
    assert summary["warmup_s"] == report.warmup_s and summary["seconds"] == report.seconds
