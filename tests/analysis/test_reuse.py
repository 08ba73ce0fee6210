"""Context reuse (core/analysis/reuse.py): one compressed context, several questions. The copies are exact (the
full cache's answers equal a run from scratch), questions do not leak into each other, and a query-aware press's
choice depends on the question it saw while a query-free one's choice of the context does not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decodelab.core.analysis.reuse import build_case, ranked, reuse_row, reuse_rows
from decodelab.core.engine.runtime import Runtime
from decodelab.core.errors import ConfigError
from decodelab.core.kv import parse_cache_spec

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny():
    from decodelab.core.engine.models import load_model

    return load_model("tiny", device="cpu")


@pytest.fixture(scope="module")
def case(tiny):
    filler = tiny.encode((ROOT / "presets" / "models" / "validation.txt").read_text())[:160]
    return build_case(tiny.tokenizer, filler, 3)


def from_scratch(model, ids: list[int], answer: list[int]) -> float:
    logits = Runtime.create(model, parse_cache_spec("full")).feed(torch.tensor([ids + answer]), keep="all")[0]
    lp = torch.log_softmax(logits.float(), -1)
    return sum(lp[len(ids) - 1 + i, t].item() for i, t in enumerate(answer))


def test_the_case_plants_every_fact_and_asks_for_each(tiny, case):
    text = tiny.tokenizer.decode(case.context_ids)
    assert all(f"The pass key of {f.name} is {f.key}." in text for f in case.facts)
    assert [tiny.tokenizer.decode(a).strip() for a in case.answer_ids] == [f.key for f in case.facts]
    with pytest.raises(ConfigError, match="between 2 and"):
        build_case(tiny.tokenizer, list(range(50)), 1)


def test_the_full_cache_answers_as_a_run_from_scratch(tiny, case):
    """The copy of the compressed (here: full) state is exact: each question's answer log-probability equals one
    forward over context + first question + that question + its answer."""
    row = reuse_row(tiny.model, case, parse_cache_spec("full"))
    for answer, question, ids in zip(row.answers, case.question_ids, case.answer_ids):
        want = from_scratch(tiny.model, case.context_ids + case.question_ids[0] + question, ids)
        assert answer.logprob == pytest.approx(want, abs=1e-4)


def test_questions_do_not_leak_into_each_other(tiny, case):
    """Asking only the last question gives the answer it got after the others (each question has its own copy)."""
    spec = parse_cache_spec("snapkv:ratio=0.5,window=4,kernel=3")
    every = reuse_row(tiny.model, case, spec)
    alone = reuse_row(tiny.model, case, spec, asked=[len(case.facts) - 1])
    assert alone.answers[0].logprob == every.answers[-1].logprob


def kept_after_prime(model, case, spec: str, prime: int) -> list[set[int]]:
    """Per (layer, KV head): the context positions kept after the context and question ``prime``."""
    rt = Runtime.create(model, parse_cache_spec(spec))
    rt.feed(torch.tensor([case.context_ids + case.question_ids[prime]]))
    n = len(case.context_ids)
    return [{p for p in head.tolist() if p < n} for layer in rt.policy.kept() for head in layer[0]]


def test_a_query_aware_press_keeps_what_its_question_points_at_and_a_query_free_one_does_not_look(tiny, case):
    """SnapKV scores the context by the attention of its observation window (the question it was compressed
    with): another question, another choice of the context. knorm reads key norms only: a context token's score is
    the same whatever question follows, so the context positions kept under two questions differ only by where
    the cut falls (the question's own tokens compete for the budget): per head, one set holds the other."""
    aware = [kept_after_prime(tiny.model, case, "snapkv:size=64,window=8,kernel=3", p) for p in (0, 1)]
    assert any(a != b for a, b in zip(*aware))
    assert any(not (a <= b or b <= a) for a, b in zip(*aware))  # not only the cut moved: the choice changed
    free = [kept_after_prime(tiny.model, case, "knorm:size=64", p) for p in (0, 1)]
    assert all(a <= b or b <= a for a, b in zip(*free))


def test_rows_rank_the_policies_by_the_questions_the_compression_did_not_see(tiny, case):
    specs = {"snapkv": parse_cache_spec("snapkv:ratio=0.5,window=8,kernel=3"),
             "keydiff": parse_cache_spec("keydiff:ratio=0.5")}
    rows = ranked(reuse_rows(tiny.model, case, specs))
    assert rows[0].policy == "full"
    assert sorted(r.policy for r in rows[1:]) == ["keydiff", "snapkv"]
    assert rows[1].others_logprob() >= rows[2].others_logprob()
    doc = rows[1].row()
    assert set(doc) == {"policy", "stored", "first_logprob", "first_right", "others_logprob", "others_right",
                        "reuse_gap", "answers"}
    assert rows[0].stored > rows[1].stored


def test_the_verdict_says_when_the_full_cache_answers_nothing():
    from decodelab.cli.view.reuse import bar, reuse_verdict

    nothing = [{"first_right": False, "others_right": 0}]
    assert reuse_verdict(nothing).startswith("the full cache answers no question")
    assert reuse_verdict([{"first_right": True, "others_right": 0.5}]).startswith("policies ranked")
    assert bar(0.0) == "█" * 10 and bar(float("-inf")) == "·" * 10 and bar(-0.6931471805599453) == "█" * 5 + "·" * 5


def test_the_plot_shows_the_mean_probability_of_the_other_questions():
    """The plot's second bar is the mean of exp(logprob) over questions 2..K (here (0.5 + 0) / 2 = 0.25: 6 of 24
    characters), not exp of the mean log-probability (which would be 0)."""
    from rich.console import Console

    from decodelab.cli.view.reuse import PLOT, reuse_plot

    answers = [{"name": n, "logprob": lp, "right": lp == 0.0}
               for n, lp in (("A", 0.0), ("B", -0.6931471805599453), ("C", float("-inf")))]
    rows = [{"policy": "some-press", "first_logprob": 0.0, "first_right": True, "others_right": 0.0,
             "answers": answers}]
    console = Console(width=200, record=True)
    console.print(reuse_plot(rows))
    line = next(t for t in console.export_text().splitlines() if "some-press" in t)
    assert "█" * PLOT + " 1.00" in line
    assert "█" * 6 + "·" * 18 + " 0.25" in line
    assert "yes / 0%" in line
