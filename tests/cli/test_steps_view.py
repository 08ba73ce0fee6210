"""The per-token table of `sample` (cli/steps_view.py, cli/live.py): widths planned for the terminal, numbers never
cut, alternatives beside the row or folded under it, the same lines whether printed live or at the end."""

from __future__ import annotations

import io
import math
import re
from types import SimpleNamespace

import pytest
from rich.cells import cell_len
from rich.console import Console

from decodelab.cli.view import render
from decodelab.cli.view.live import LiveSteps
from decodelab.cli.view.steps_view import StepsTable, fit_token, pack, plan
from decodelab.core.trace.records import Alternative, Step

from test_fit import printed


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
    text = printed([table()], width)
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
    wide = printed([table()], 200).splitlines()
    row = next(line for line in wide if line.startswith("    0"))
    assert "␣the 0.500  ␣a 0.125  \\n 1.3e-05" in row
    narrow = printed([table()], 80).splitlines()
    i = next(k for k, line in enumerate(narrow) if line.startswith("    0"))
    assert "␣a 0.125" not in narrow[i] and narrow[i + 1].strip().startswith("␣the 0.500  ␣a 0.125")
    assert narrow[i + 1].startswith(" " * 7 + "␣")  # indented past the index column (5 digits + gap)
    assert "top 3 alternatives (p)" in printed([table()], 80) and "alternatives" not in printed([table(top=0)], 80)


def test_decided_by_folds_under_the_row_when_nothing_else_fits():
    text = printed([table()], 60)
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
    whole = printed([table()], 80)
    parts = printed([table(part="head")], 80) + "".join(printed([table(steps=[s], part="rows")], 80) for s in STEPS) \
        + printed([table(part="caption")], 80)
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


# --- the arithmetic the mutation run (tests/mutation/run.sh) found nothing checking; every expected width is
# worked out by hand in the docstring or comment beside it ---------------------------------------------------------


def test_a_tables_parts_keep_its_settings_and_together_print_the_whole():
    """with_part keeps the steps, widths, stage names (which size `decided by`) and title: head + rows + caption
    printed one after the other are the whole table; rows of other steps print those steps."""
    whole = table()
    parts = [whole.with_part(part) for part in ("head", "rows", "caption")]
    assert "".join(printed([p], 80) for p in parts) == printed([whole], 80)
    assert printed([whole.with_part("rows", STEPS[1:2])], 80) == printed([table(steps=STEPS[1:2], part="rows")], 80)


def test_the_live_status_line_counts_tokens_and_their_rate(monkeypatch):
    """5 tokens in 0.5 s: 10.0 tok/s (the 1e-9 floor only guards a zero elapsed time); the spinner is cyan, and
    each add() puts a fresh status under the rows."""
    from decodelab.cli.view import live as live_module
    from decodelab.cli.view.live import LiveSteps

    monkeypatch.setattr(live_module, "time", SimpleNamespace(perf_counter=lambda: 100.5))
    terminal = Console(width=80, file=io.StringIO(), force_terminal=True, color_system=None)
    steps = LiveSteps(terminal, None, limit=9)
    steps.start, steps.count = 100.0, 5
    spinner = steps.status()
    assert spinner.text.plain == "5/9 tokens · 10.0/s · Ctrl-C stops and keeps them" and spinner.style == "cyan"
    open_ended = LiveSteps(terminal, None, unit="rounds")  # no limit: the count alone
    open_ended.start, open_ended.count = 100.0, 5
    assert open_ended.status().text.plain == "5 rounds · 10.0/s · Ctrl-C stops and keeps them"
    with LiveSteps(terminal, None, limit=9) as live:
        live.add(STEPS[0])
        assert live.live._renderable.text.plain.startswith("1/9 tokens")


STEPS_130 = """\
T
    #  token         prob                  raw p    rank    kept      H  decided by          top 3 alternatives (p)
───────────────────────────────────────────────────────────────────────────────────────────────────────────────────
    0  ␣the          █████        0.500    0.250       1  151936  11.93  model               ␣the 0.500  ␣a 0.125  \\n 1.3e-05
    1  \\n                       1.3e-05  2.5e-07  150000       3   0.07  repetition-penalty  ␣x 0.750
99999  a-very-long…  ██████████   1.000    0.999       2       1   0.00  -                   ␣y 1.000
"""

STEPS_80 = """\
T
    #  token         prob       raw p    rank    kept      H  decided by
       top 3 alternatives (p)
────────────────────────────────────────────────────────────────────────
    0  ␣the            0.500    0.250       1  151936  11.93  model
       ␣the 0.500  ␣a 0.125  \\n 1.3e-05
    1  \\n            1.3e-05  2.5e-07  150000       3   0.07  repetition-penalty
       ␣x 0.750
99999  a-very-long…    1.000    0.999       2       1   0.00  -
       ␣y 1.000
"""

STEPS_60 = """\
T
    #  token   prob       raw p    rank    kept      H
       decided by · top 3 alternatives (p)
──────────────────────────────────────────────────────
    0  ␣the      0.500    0.250       1  151936  11.93
       by model  ␣the 0.500  ␣a 0.125  \\n 1.3e-05
    1  \\n      1.3e-05  2.5e-07  150000       3   0.07
       by repetition-penalty  ␣x 0.750
99999  a-ver…    1.000    0.999       2       1   0.00
       by -  ␣y 1.000
"""


@pytest.mark.parametrize("width, expected", [(130, STEPS_130), (80, STEPS_80), (60, STEPS_60)])
def test_the_steps_table_line_for_line(width, expected):
    """The steps of test_steps_view at three widths, exactly. 130: bar of 10 cells (0.5 -> 5), alternatives beside
    the row. 80: no bar, alternatives folded under the row at indent 5 + 2. 60: tokens cut to 6 cells and `decided by`
    folded too ("by model" first). Numbers right-aligned, names left-aligned, no line ends in spaces."""
    out = printed([table().with_part("head"), table().with_part("rows")], width)
    assert out == expected


def test_the_steps_table_styles():
    """Header lines bold, the rule dim, the token bold, the folded lines dim."""
    from decodelab.cli.view.steps_view import header_lines, plan, row_lines

    folded = plan(60, 151936, 100000, ["temperature", "repetition-penalty"], 3)
    assert [x.style for x in header_lines(folded)] == ["bold", "bold", "dim"]
    row, under = row_lines(folded, STEPS[0])
    assert [(s.start, s.end, s.style) for s in row.spans] == [(7, 13, "bold")] and under.style == "dim"
    wide = plan(130, 151936, 100000, ["temperature", "repetition-penalty"], 3)
    assert [x.style for x in header_lines(wide)] == ["bold", "dim"]
    (row,) = row_lines(wide, STEPS[0])
    assert [(s.start, s.end, s.style) for s in row.spans] == [(7, 19, "bold")]


def many_steps():
    return STEPS[:1] + [step(7, " many", 0.25, 0.25, 3, 9, 2.0, "top-k", [
        (" a", 0.25), (" bb", 0.125), (" ccc", 0.0625), (" dddd", 0.03125), (" e", 0.015625), (" f", 0.0078125)])]


ROWS_121 = """\
    0  ␣the          █████        0.500    0.250       1  151936  11.93  model               ␣the 0.500  ␣a 0.125
                                                                                             \\n 1.3e-05
    7  ␣many         ██▌          0.250    0.250       3       9   2.00  top-k               ␣a 0.250  ␣bb 0.125
                                                                                             ␣ccc 0.062  ␣dddd 0.031
                                                                                             ␣e 0.016  ␣f 0.008
"""

ROWS_60 = """\
    0  ␣the      0.500    0.250       1  151936  11.93
       by model  ␣the 0.500  ␣a 0.125  \\n 1.3e-05
    7  ␣many     0.250    0.250       3       9   2.00
       by top-k  ␣a 0.250  ␣bb 0.125  ␣ccc 0.062
       ␣dddd 0.031  ␣e 0.016  ␣f 0.008
"""

NO_ALTERNATIVES_80 = """\
T
    #  token         prob       raw p    rank    kept      H  decided by
────────────────────────────────────────────────────────────────────────
    0  ␣the            0.500    0.250       1  151936  11.93  model
    1  \\n            1.3e-05  2.5e-07  150000       3   0.07  repetition-penalty
99999  a-very-long…    1.000    0.999       2       1   0.00  -
"""


def test_alternatives_wrap_beside_the_row_or_under_it():
    """121 columns: the alternatives start at column 91 + 2 = 93 and wrap there within the 28 columns left; 60
    columns: folded under the row after `by ...`, wrapped at 60 - 7. With --top 0 there are none, and no header for
    them; --top 1 still has room beside the row at 130 columns."""
    assert printed([table(steps=many_steps()).with_part("rows")], 121) == ROWS_121
    assert printed([table(steps=many_steps()).with_part("rows")], 60) == ROWS_60
    no_alternatives = table(top=0)
    assert printed([no_alternatives.with_part("head"), no_alternatives.with_part("rows")], 80) == NO_ALTERNATIVES_80
    assert table(top=1).layout(130).alts_beside() and not table(top=0).layout(130).alts_beside()


def test_plan_at_the_exact_widths_where_each_step_is_needed():
    """Fixed fields at full size: 5 + 12 + 18 + 7 + 6 + 6 + 5 + 18 + 7 gaps of 2 = 91. At 84 a 3-cell bar fits
    exactly (prob 3 + 1 + 7); at 83 the bar goes; without it 80, so at 74 the token shrinks to exactly 6; at 73
    `decided by` folds. A stage name longer than the header widens `decided by`; with none the header sets it."""
    from decodelab.cli.view.steps_view import plan

    names = ["temperature", "repetition-penalty"]
    at = {w: plan(w, 151936, 100000, names, 3) for w in (91, 84, 83, 74, 73)}
    assert [(at[w].bar, at[w].token, at[w].fold_decided) for w in (91, 84, 83, 74, 73)] == [
        (10, 12, False), (3, 12, False), (0, 12, False), (0, 6, False), (0, 6, True)]
    assert [at[w].fixed_width() for w in (91, 84, 83, 74)] == [91, 84, 80, 74]
    assert plan(200, 10, 5, [], 0).decided == len("decided by") and plan(200, 10, 5, names, 0).decided == 18


def test_a_cut_token_fills_its_width_exactly_even_with_wide_characters():
    """Two-cell characters cannot always fill an odd remainder: the cut is padded to the field's width."""
    from rich.cells import cell_len

    from decodelab.cli.view.steps_view import fit_token

    for width in (3, 4, 5):
        cut = fit_token("你好你好", width)
        assert cell_len(cut) == width and "…" in cut


def test_the_title_is_bold_and_the_caption_dim():
    console = Console(width=80, file=io.StringIO())
    parts = list(table().__rich_console__(console, console.options))
    assert (parts[0].plain, parts[0].style) == ("T", "bold")
    assert parts[-1].style == "dim" and parts[-1].plain.startswith("prob: the processed distribution")


def test_the_live_table_prints_its_header_then_rows_with_the_status_on_the_same_console():
    """In a terminal: the header first, then the status line (written on the console given, from the start), and a
    transient status: the display is erased when the run ends (rich ends a transient live display by moving the
    cursor up over it, "\\x1b[1A", and erasing the line, "\\x1b[2K")."""
    from decodelab.cli.view.live import LiveSteps

    terminal = Console(width=80, file=io.StringIO(), force_terminal=True, color_system=None)
    with LiveSteps(terminal, table(steps=[]), limit=3) as live:
        started = terminal.file.getvalue()
        live.add(STEPS[0])
    assert started.startswith("T\n    #  token") and "0/3 tokens ·" in started
    assert terminal.file.getvalue().endswith("\x1b[1A\x1b[2K")  # transient: the status line erased at the end


def test_a_narrowed_bar_is_drawn_at_its_planned_width():
    """At 87 columns the bar shrinks from 10 to 10 - (91 - 87) = 6 cells: p = 0.5 fills 3 of them."""
    from decodelab.cli.view.steps_view import plan, row_lines

    layout = plan(87, 151936, 100000, ["temperature", "repetition-penalty"], 3)
    assert layout.bar == 6
    row = row_lines(layout, STEPS[0])[0].plain
    assert row == "    0  ␣the          ███      0.500    0.250       1  151936  11.93  model"


def test_a_one_hot_step_shows_the_raw_alternatives_marked():
    """Issue 40: greedy rows showed every alternative at 0.000 (the processed distribution is one-hot). There the
    alternatives show the model's raw p, the first marked "raw:"; a step whose processed p carries information (and
    the pinned layouts above, whose lone alternative is the token itself at 1.0) is unchanged."""
    greedy = Step(index=0, position=3, token_id=5, token=" the", prob=1.0, logprob=0.0, raw_prob=0.309,
                  raw_logprob=math.log(0.309), raw_rank=1, entropy=0.0, raw_entropy=4.4, kept=1,
                  alternatives=[Alternative(5, " the", 1.0, 0.309), Alternative(6, " them", 0.0, 0.041)],
                  decided_by="model")
    text = printed([table(steps=[greedy])], 130)
    assert "raw: ␣the 0.309  ␣them 0.041" in text and "0.000" not in text
    assert "raw: ␣" not in printed([table()], 130)
