"""The attention-sink diagnosis (core/analysis/attention.py) on hand-built weights and through one real forward.

mutation run of core/analysis/attention.py (2026-12-02, second round): before it, only a uniform/one-sink pair on
one row and one layer (tests/methods/test_stream.py) and the CLI table reached these lines.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from conftest import random_model

from decodelab.core.analysis.attention import HeadSinkMass, attention_profile, sink_profile
from decodelab.core.engine.forward import attention_weights
from decodelab.core.errors import ConfigError


def causal(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def test_sink_profile_worked_by_hand_over_rows_heads_and_layers():
    """T = 4, late queries 2 and 3. Head 0: q2 = [.5 .25 .25 0], q3 = [.4 .2 .2 .2]. With one sink: on it .5 and .4
    (mean .45); one other key gets (1 - .5) / 2 = .25 and .6 / 3 = .2 (mean .225): ratio 2. With two sinks: .75
    and .6 (mean .675); one other key .25 / 1 and .4 / 2, times 2 sinks: .45; ratio 1.5. Head 1 is uniform: ratio 1.
    A second batch row equal to the first leaves the means; a second layer (the heads swapped) gets its own rows."""
    head0 = causal([[1, 0, 0, 0], [.5, .5, 0, 0], [.5, .25, .25, 0], [.4, .2, .2, .2]])
    head1 = causal([[1, 0, 0, 0], [.5, .5, 0, 0], [1 / 3, 1 / 3, 1 / 3, 0], [.25, .25, .25, .25]])
    layer0 = torch.stack([head0, head1]).unsqueeze(0).expand(2, -1, -1, -1)  # [B=2, H=2, 4, 4]
    layer1 = torch.stack([head1, head0]).unsqueeze(0)
    rows = sink_profile([layer0, layer1], sinks=1, late_from=2)
    assert [(r.layer, r.head) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert rows[0].sink_mass == pytest.approx(.45) and rows[0].average_mass == pytest.approx(.225)
    assert rows[0].ratio == pytest.approx(2.0)
    assert rows[1].sink_mass == pytest.approx((1 / 3 + 1 / 4) / 2) and rows[1].ratio == pytest.approx(1.0)
    assert rows[3].ratio == pytest.approx(2.0) and rows[2].ratio == pytest.approx(1.0)
    two = sink_profile([layer0], sinks=2, late_from=2)
    assert two[0].sink_mass == pytest.approx(.675) and two[0].average_mass == pytest.approx(.45)
    assert two[0].ratio == pytest.approx(1.5)
    assert two[0].as_dict() == {"layer": 0, "head": 0, "sink_mass": two[0].sink_mass,
                                "average_mass": two[0].average_mass, "ratio": two[0].ratio}


def test_the_late_queries_are_the_ones_from_late_from_and_rows_are_averaged():
    """Only queries >= late_from count: an early query with all its weight elsewhere changes nothing. Two batch rows
    with sink weights .5 and .3 on the one late query (q = 2) average to .4."""
    a = causal([[1, 0, 0], [0, 1, 0], [.5, .25, .25]])
    b = causal([[1, 0, 0], [0, 1, 0], [.3, .35, .35]])
    rows = sink_profile([torch.stack([a.unsqueeze(0), b.unsqueeze(0)])], sinks=1, late_from=2)
    assert rows[0].sink_mass == pytest.approx(.4)
    assert rows[0].average_mass == pytest.approx((.25 + .35) / 2)  # (1 - on sinks) / (3 - 1) per row


def test_attention_profile_measures_the_first_context_tokens_of_one_forward():
    model = random_model("llama", seed=3)
    ids = list(range(1, 41))
    rows, meta = attention_profile(model, ids, sinks=2, context=24)
    assert meta == {"tokens": 24, "late_from": 12, "sinks": 2}
    expected = sink_profile(attention_weights(model, torch.tensor([ids[:24]])), 2, 12)
    assert [(r.layer, r.head) for r in rows] == [(r.layer, r.head) for r in expected] and len(rows) == 2 * 4
    for got, want in zip(rows, expected):
        assert isinstance(got, HeadSinkMass)
        assert got.ratio == pytest.approx(want.ratio) and got.sink_mass == pytest.approx(want.sink_mass)
    _, meta = attention_profile(model, ids[:9], sinks=1, context=None)
    assert meta == {"tokens": 9, "late_from": 4, "sinks": 1}
    # exactly 2 * sinks + 2 tokens is enough
    _, meta = attention_profile(model, ids, sinks=3, context=8)
    assert meta["tokens"] == 8 and math.isfinite(rows[0].sink_mass)


def test_attention_profile_refuses_no_sinks_and_too_short_a_text_in_one_line():
    model = random_model("llama", seed=3)
    with pytest.raises(ConfigError, match="^" + re.escape("--sinks 0: --attention needs the first S >= 1 positions "
                                                          "to measure") + "$"):
        attention_profile(model, list(range(1, 20)), sinks=0, context=None)
    with pytest.raises(ConfigError, match="^" + re.escape("--attention: 7 tokens; needs at least 8") + "$"):
        attention_profile(model, list(range(1, 20)), sinks=3, context=7)


def test_rotary_models_are_told_from_absolute_position_ones():
    from decodelab.core.analysis.attention import _has_rotary
    assert _has_rotary(random_model("llama")) and not _has_rotary(random_model("gpt2"))


def test_a_head_with_nothing_beyond_its_sinks_has_an_infinite_ratio():
    """All weight on key 0 from every query: the other keys get 0, so the ratio is inf, not a division error; a
    head with a little weight elsewhere has a finite one."""
    sink = causal([[1, 0, 0], [1, 0, 0], [1, 0, 0]])
    near = causal([[1, 0, 0], [1, 0, 0], [.8, .1, .1]])
    rows = sink_profile([torch.stack([sink, near]).unsqueeze(0)], sinks=1, late_from=2)
    assert rows[0].average_mass == 0.0 and rows[0].ratio == float("inf")
    assert rows[1].ratio == pytest.approx(.8 / .1)
