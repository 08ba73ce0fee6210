"""The per-token table of `sample` (cli/steps_view.py, cli/live.py): widths planned for the terminal, numbers never
cut, alternatives beside the row or folded under it, the same lines whether printed live or at the end."""

from __future__ import annotations

import io
import math
import re

import pytest
from rich.cells import cell_len
from rich.console import Console

from decodelab.cli.view import render
from decodelab.cli.view.live import LiveSteps
from decodelab.cli.view.steps_view import StepsTable, fit_token, pack, plan
from decodelab.core.trace.records import Alternative, Step


def step(i: int, token: str, prob: float, raw: float, rank: int, kept: int, entropy: float, decided: str | None,
         alts=()) -> Step:
    return Step(index=i, position=10 + i, token_id=i, token=token, prob=prob, logprob=math.log(prob), raw_prob=raw,
                raw_logprob=math.log(raw), raw_rank=rank, entropy=entropy, raw_entropy=1.0, kept=kept,
                alternatives=[Alternative(k, t, p, p) for k, (t, p) in enumerate(alts)], decided_by=decided)


STEPS = [
    step(0, " the", 0.5, 0.25, 1, 151936, 11.93, "model", [(" the", 0.5), (" a", 0.125), ("\n", 1.3e-05)]),
    step(1, "\n", 1.3e-05, 2.5e-07, 150000, 3, 0.07, "repetition-penalty", [(" x", 0.75)]),
    step(99999, "a-very-long-token-indeed", 1.0, 0.999, 2, 1, 0.0, None, [(" y", 1.0)]),
]


def printed(renderable, width: int) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def table(top: int = 3, steps=STEPS, part: str = "all") -> StepsTable:
    return StepsTable(list(steps), top, vocab_size=151936, max_steps=100000,
                      stage_names=["temperature", "repetition-penalty"], title="T", part=part)


def test_plan_shrinks_bar_then_token_then_folds_decided_by():
    # vocab 4096, 32 steps, stage names <= 10: index 2, token 12, prob bar 10 + 1 + 7, raw p 7, rank 4, kept 4, H 5,
    # decided by 10, 7 gaps of 2 = 76
    def at(width):
        return plan(width, 4096, 32, ["top-p"], top=5)

    assert at(76).fixed_width() == 76 and at(76).bar == 10
    assert at(75).bar == 9 and at(75).fixed_width() == 75
    assert at(69).bar == 3 and at(68).bar == 0 and at(68).fixed_width() == 65
    assert at(64).bar == 0 and at(64).token == 11 and not at(64).fold_decided
    assert at(59).token == 6 and not at(59).fold_decided
    assert at(58).fold_decided and at(58).fixed_width() == 47
    assert not at(105).alts_beside() and at(106).alts_beside()  # 76 + 2 + 28
    assert not plan(200, 4096, 32, ["top-p"], top=0).alts_beside()
    wide = plan(200, 151936, 100001, ["repetition-penalty"], top=5)
    assert (wide.index, wide.rank, wide.kept, wide.decided) == (6, 6, 6, 18)


@pytest.mark.parametrize("width", [200, 120, 80, 60, 54])
def test_every_number_whole_and_no_line_wider_than_the_terminal(width):
    text = printed(table(), width)
    lines = text.splitlines()
    words = text.split()
    assert max(cell_len(line) for line in lines[1:]) <= width  # the title line may wrap, it is rich Text
    for s in STEPS:
        for number in (render.fmt_p(s.prob), render.fmt_p(s.raw_prob), str(s.raw_rank), str(s.kept),
                       f"{s.entropy:.2f}", str(s.index)):
            assert number in words, (width, number)
        row = next(line for line in lines if line.split()[:1] == [str(s.index)])
        assert render.fmt_p(s.raw_prob) in row.split() and str(s.kept) in row.split()  # on the token's own line
        assert (s.decided_by or "-") in words or f"{s.decided_by}" in text
        for a in s.alternatives:  # an alternative and its p on one line, never split
            assert f"{render.show_token(a.token)} {render.fmt_p(a.prob)}" in text
    assert not re.search(r"[0-9.eE+\-]…|…[0-9.]", text)  # only a token's text is ever shortened
    assert ("a-very-long…" if width >= 80 else "a-ver…") in text  # 12 cells, fewer when the bar is gone


def test_alternatives_beside_when_wide_and_folded_under_when_narrow():
    wide = printed(table(), 200).splitlines()
    row = next(line for line in wide if line.startswith("    0"))
    assert "␣the 0.500  ␣a 0.125  \\n 1.3e-05" in row
    narrow = printed(table(), 80).splitlines()
    i = next(k for k, line in enumerate(narrow) if line.startswith("    0"))
    assert "␣a 0.125" not in narrow[i] and narrow[i + 1].strip().startswith("␣the 0.500  ␣a 0.125")
    assert narrow[i + 1].startswith(" " * 7 + "␣")  # indented past the index column (5 digits + gap)
    assert "top 3 alternatives (p)" in printed(table(), 80) and "alternatives" not in printed(table(top=0), 80)


def test_decided_by_folds_under_the_row_when_nothing_else_fits():
    text = printed(table(), 60)
    row = next(k for k, line in enumerate(text.splitlines()) if line.split()[:1] == ["1"])
    assert "repetition-penalty" not in text.splitlines()[row]
    assert text.splitlines()[row + 1].split()[:2] == ["by", "repetition-penalty"]


def test_fit_token_and_pack():
    assert fit_token(" hi", 5) == "␣hi  "
    assert fit_token("abcdefgh", 5) == "abcd…"
    assert fit_token("\n", 3) == "\\n "
    assert pack(["aa", "bb", "cc"], 6) == ["aa  bb", "cc"]
    assert pack(["aa", "bb", "cc"], 5) == ["aa", "bb", "cc"]
    assert pack(["toolongitem", "b"], 4) == ["toolongitem", "b"]  # an item is never broken


def test_parts_printed_one_by_one_equal_the_whole_table():
    whole = printed(table(), 80)
    parts = printed(table(part="head"), 80) + "".join(printed(table(steps=[s], part="rows"), 80) for s in STEPS) \
        + printed(table(part="caption"), 80)
    assert parts == whole


def test_live_prints_rows_as_they_come_in_a_terminal_and_nothing_elsewhere():
    terminal = Console(width=80, file=io.StringIO(), force_terminal=True, color_system=None)
    with LiveSteps(terminal, table(steps=[]), limit=3) as live:
        live.add(STEPS[0])
        first = terminal.file.getvalue()
        live.add(STEPS[1])
    assert live.shown and "␣the" in first and "150000" not in first  # row 0 on screen before row 1 exists
    assert "150000" in terminal.file.getvalue()
    pipe = Console(width=80, file=io.StringIO())
    with LiveSteps(pipe, table(steps=[]), limit=3) as live:
        live.add(STEPS[0])
    assert not live.shown and pipe.file.getvalue() == ""  # the caller prints the finished table instead


def test_sample_prints_the_finished_table_once_when_not_a_terminal(cli, toy_model_dir, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = cli("sample", "Hello", "-m", toy_model_dir, "-n", "5", "--ignore-eos", "--top", "2", "-t", "0")
    assert code == 0, err
    assert out.count("decided by") == 2  # the header once, the caption once
    assert "shaded by its raw p" in out  # greedy: every processed p is 1, so the shading follows the raw p
    rows = [line for line in out.splitlines() if line[:1].isdigit()]
    assert [line.split()[0] for line in rows] == ["0", "1", "2", "3", "4"]


def test_status_alone_prints_no_rows_and_leaves_nothing_behind():
    terminal = Console(width=80, file=io.StringIO(), force_terminal=True, color_system=None)
    with LiveSteps(terminal, None, limit=3) as live:
        live.add(STEPS[0])
        live.add(STEPS[1])
    assert live.count == 2 and not live.shown
    assert "150000" not in terminal.file.getvalue() and "0.500" not in terminal.file.getvalue()
