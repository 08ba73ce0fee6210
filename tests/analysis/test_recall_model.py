"""The bundled `tiny-recall` (presets/train_recall.py) copies a planted key from its context, so the retrieval probe
(core/analysis/probe.py) and the reuse test (core/analysis/reuse.py) can judge a cache policy on it.

Both are asked with the full cache on held-out text (presets/models/validation.txt), with the names and keys the
tools use by default (never trained on). The negative control is `tiny`, trained without planted facts: it
retrieves nothing, so the same bound fails on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from decodelab.core.analysis.probe import ProbeSettings, Prober
from decodelab.core.analysis.reuse import build_case, reuse_row
from decodelab.core.kv import parse_cache_spec

ROOT = Path(__file__).resolve().parents[2]
VALIDATION = ROOT / "presets" / "models" / "validation.txt"
CONTEXT = 256  # the window tiny-recall was trained on


@pytest.fixture(scope="module")
def loaded():
    from decodelab.core.engine.models import load_model

    return {name: load_model(name, device="cpu") for name in ("tiny-recall", "tiny")}


def filler(lm, start: int = 0) -> list[int]:
    return lm.encode(VALIDATION.read_text(encoding="utf-8"))[start: start + CONTEXT]


def probe_right(lm) -> tuple[int, int]:
    """Full-cache probe trials greedy-right, over two keys (seed 0) at three depths."""
    full = Prober(lm.model, lm.tokenizer, filler(lm), ProbeSettings(seed=0), CONTEXT).full()
    return sum(r.right for r in full), len(full)


def reuse_right(lm) -> tuple[int, int]:
    """Full-cache reuse questions greedy-right: 4 facts in one context, every question asked of it."""
    case = build_case(lm.tokenizer, filler(lm, CONTEXT), 4, CONTEXT)
    row = reuse_row(lm.model, case, parse_cache_spec("full"))
    return sum(a.right for a in row.answers), len(row.answers)


def test_tiny_recall_retrieves_the_probes_key_with_the_full_cache(loaded):
    right, trials = probe_right(loaded["tiny-recall"])
    assert right >= trials - 1, f"{right} of {trials} probe trials right"


def test_tiny_recall_answers_the_reuse_questions_with_the_full_cache(loaded):
    right, asked = reuse_right(loaded["tiny-recall"])
    assert right >= asked - 1, f"{right} of {asked} reuse questions right"


def test_negative_control_tiny_retrieves_nothing(loaded):
    """The bound above is not vacuous: a model without the skill fails it."""
    assert probe_right(loaded["tiny"])[0] == 0
    assert reuse_right(loaded["tiny"])[0] == 0


@pytest.mark.parametrize("start", [0, CONTEXT])
def test_on_tiny_recall_the_query_aware_press_degrades_on_reuse_and_keydiff_does_not(loaded, start):
    """docs/kv-policies.md's ranking, on two pieces of held-out text (8 facts, the documented --limit 120): SnapKV,
    compressed with question 1, loses the other questions (mean log-probability far below the full cache's, a gap
    of many nats); KeyDiff (query-free) stays within 1 nat of the full cache on them and ahead of SnapKV."""
    lm = loaded["tiny-recall"]
    case = build_case(lm.tokenizer, filler(lm, start)[:120], 8, 512)
    full, snap, keydiff = (reuse_row(lm.model, case, parse_cache_spec(s), s)
                           for s in ("full", "snapkv:ratio=0.5", "keydiff:ratio=0.5"))
    assert full.others_right() >= 0.5
    assert keydiff.others_logprob() > full.others_logprob() - 1.0
    assert snap.others_logprob() < keydiff.others_logprob() - 10.0
    assert snap.first.logprob - snap.others_logprob() > 10.0 > keydiff.first.logprob - keydiff.others_logprob()
