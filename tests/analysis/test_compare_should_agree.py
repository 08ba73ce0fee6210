"""compare asks the semantics plan whether two runs are greedy (never `temperature == 0`): two greedy runs of
different methods should agree, and only then get a noise verdict where they part."""

from __future__ import annotations

from decodelab.core.analysis.compare import should_agree
from decodelab.core.methods.sample import SampleSettings


def test_two_greedy_runs_of_different_methods_should_agree():
    greedy = SampleSettings(temperature=0.0)
    assert should_agree("method", greedy, greedy)
    assert not should_agree("method", greedy, SampleSettings(temperature=0.7))  # the negative control
    assert should_agree("numerics", SampleSettings(temperature=0.7), SampleSettings(temperature=0.7))


def test_a_run_the_plan_samples_is_not_greedy_at_temperature_0():
    """Under --semantics llamacpp, -t 0 --dynatemp-range 0.5 samples (T over [0, 0.5]): not two greedy runs."""
    hot = SampleSettings(temperature=0.0, dynatemp_range=0.5, semantics="llamacpp")
    assert not should_agree("method", hot, hot)
    assert should_agree("method", SampleSettings(temperature=0.0, semantics="llamacpp"),
                        SampleSettings(temperature=0.0, semantics="vllm"))
