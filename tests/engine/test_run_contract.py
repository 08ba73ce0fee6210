"""The run contract (core/engine/run.py) and the lazy public API (core/__init__.py), on a clock and runs made by
hand (the method registry: tests/methods/test_method_registry.py).

mutation run of the small files of core/ (2026-12-02, second round): before it these were reached only through
whole runs, whose timings are never the same twice and whose runs never end in every way.
"""

from __future__ import annotations

import math

import pytest
import torch

import decodelab.core as core
from decodelab.core.engine import run as run_module
from decodelab.core.engine.run import Run, Stopwatch, Timing, drain, synchronize
from decodelab.core.errors import EMPTY_CHAIN, ChainError


class Clock:
    def __init__(self, *times: float):
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def test_the_stopwatch_adds_each_lap_to_its_bucket_and_drops_paused_time(monkeypatch):
    """start at 10; prefill lap at 11 (1 s); loop lap at 13.5 (2.5 s); trace lap at 14 (0.5 s); paused, resumed at
    20 (the 6 s between are the consumer's); loop lap at 21 (1 s more)."""
    monkeypatch.setattr(run_module.time, "perf_counter", Clock(10.0, 11.0, 13.5, 14.0, 20.0, 21.0))
    watch = Stopwatch(torch.device("cpu"))
    watch.start()
    watch.lap("prefill")
    watch.lap("loop")
    watch.lap("trace")
    watch.pause()
    watch.resume()
    watch.lap("loop")
    t = watch.timing
    assert (t.prefill_s, t.loop_s, t.trace_s, t.total_s) == (1.0, 3.5, 0.5, 5.0)
    assert t.tokens_per_s(10) == 2.0 and t.decode_tokens_per_s(7) == 2.0


def test_a_lap_after_a_pause_counts_nothing_until_the_next_start(monkeypatch):
    monkeypatch.setattr(run_module.time, "perf_counter", Clock(1.0, 2.0, 50.0, 51.0))
    watch = Stopwatch("cpu")  # a device given by name works as well
    watch.start()
    watch.pause()
    watch.lap("loop")  # at 2.0: nothing counted, the clock restarts here
    watch.lap("loop")  # at 50.0: 48 s since the lap before
    assert watch.timing.loop_s == 48.0 and watch.timing.prefill_s == 0.0


def test_rates_of_an_unmeasured_timing_are_nan():
    assert math.isnan(Timing().tokens_per_s(5)) and math.isnan(Timing(prefill_s=1.0).decode_tokens_per_s(5))
    assert Timing(prefill_s=1.0).tokens_per_s(5) == 5.0


def test_synchronize_waits_only_for_an_accelerator(monkeypatch):
    called = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: called.append(("cuda", device)))
    monkeypatch.setattr(torch.mps, "synchronize", lambda: called.append(("mps", None)))
    synchronize(torch.device("cpu"))
    synchronize("cpu")
    assert called == []
    synchronize("cuda:1")
    synchronize(torch.device("mps"))
    assert called == [("cuda", "cuda:1"), ("mps", None)]


class Steps(Run):
    def __init__(self, items, fail_after=None):
        self.items, self.fail_after = items, fail_after

    def __iter__(self):
        for i, item in enumerate(self.items):
            if i == self.fail_after:
                raise ChainError("no candidate left")
            yield item


def test_a_run_ends_by_length_interrupt_or_an_empty_chain_and_keeps_its_steps():
    done = Steps([1, 2, 3])
    assert drain(done) == [1, 2, 3] and done.stop_reason == "length" and not done.interrupted
    cut = Steps([1, 2, 3], fail_after=2)
    assert drain(cut) == [1, 2] and cut.stop_reason == EMPTY_CHAIN == "empty_chain"
    stopped = Steps([])
    stopped.interrupt()
    assert stopped.interrupted and stopped.stop_reason == "interrupted"
    assert Run.stop_reason == "length" and Run.interrupted is False  # the class defaults stay


def test_the_public_api_loads_each_name_from_its_module_on_first_use(monkeypatch):
    from decodelab.core.analysis.policies import ranked
    from decodelab.core.kv import parse_cache_spec
    from decodelab.core.sampling.chain import make_chain
    for name in ("ranked", "make_chain"):  # not yet loaded, whatever ran before
        monkeypatch.delitem(vars(core), name, raising=False)
    assert core.ranked is ranked and core.make_chain is make_chain and vars(core)["ranked"] is ranked
    from decodelab.core.methods.registry import METHODS
    assert core.parse_cache_spec is parse_cache_spec and core.METHODS is METHODS
    assert "parse_cache_spec" in vars(core)  # cached after the first use
    assert core.__all__ == sorted(core.__all__) and "Prober" in core.__all__
    with pytest.raises(AttributeError, match="^module 'decodelab.core' has no attribute 'nothing_here'$"):
        core.nothing_here


def test_read_selected_reads_row_zero_and_a_removed_token_as_not_finite():
    """mutation run of core/sampling/step.py (2026-12-02, second round): a batch of two, where only row 0 counts."""
    from decodelab.core.sampling.step import Selected, read_selected
    logits = torch.zeros(2, 8)
    assert read_selected(Selected(torch.tensor([3, 5]), logits, None, torch.tensor([True, False]))) == (3, True)
    assert read_selected(Selected(torch.tensor([3, 5]), logits, None, torch.tensor([False, True]))) == (0, False)
    assert read_selected(Selected(torch.tensor([0]), logits[:1], None, torch.tensor([True]))) == (0, True)


def test_a_lap_before_any_start_counts_nothing(monkeypatch):
    monkeypatch.setattr(run_module.time, "perf_counter", Clock(5.0, 7.0))
    watch = Stopwatch("cpu")
    watch.lap("prefill")  # at 5.0: nothing to measure from yet
    watch.lap("prefill")  # at 7.0: 2 s
    assert watch.timing.prefill_s == 2.0
