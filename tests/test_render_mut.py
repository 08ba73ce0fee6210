"""The renderers' arithmetic, pinned where the mutation run (tests/mutation/run.sh) found nothing checking it: the
column panels of cli/fit.py, `sample -N`'s tables, and the small helpers of cli/render.py. Every expected width is
worked out by hand in the docstring or comment beside it."""

from __future__ import annotations

import io
import math
from types import SimpleNamespace

import pytest
from rich import box
from rich.console import Console
from rich.table import Table

from decodelab.cli import render
from decodelab.cli.fit import chrome, column_widths, fit_table, panels, spread


def printed(renderables, width: int) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    for r in renderables:
        console.print(r)
    return console.file.getvalue()


def wide_table() -> Table:
    t = Table(title="T", caption="C")
    t.add_column("key", no_wrap=True)
    t.add_column("a", no_wrap=True)
    t.add_column("b", justify="right")
    t.add_column("c", no_wrap=True, max_width=4)
    t.add_row("k1", "aaaaaaaa", "bb bbbb", "cccccccc")
    return t


# --- cli/fit.py -------------------------------------------------------------------------------------------------


def test_column_widths_need_and_want():
    """key: header 3 > cell 2; a: a no-wrap cell needs its whole 8; b wraps: it needs its longest word (4, "bbbb")
    and wants the whole line (7); c: max_width 4 caps both. An explicit width is both; min_width raises both."""
    t = wide_table()
    console = Console(width=30, file=io.StringIO())
    assert column_widths(console, t) == [(3, 3), (8, 8), (4, 7), (4, 4)]
    t.add_column("d", width=6)
    t.add_column("e", min_width=9)
    t.columns[4]._cells = ["dd"]
    t.columns[5]._cells = ["ee"]
    assert column_widths(console, t)[4:] == [(6, 6), (9, 9)]
    t.show_header = False
    assert column_widths(console, t)[:3] == [(2, 2), (8, 8), (4, 7)]  # "k1" alone


def test_chrome_counts_padding_and_borders_as_rich_does():
    """Default table: padding 1 each side (2 per column) and n + 1 border lines: 3n + 1. No edge: n - 1 lines;
    no box: none; pad_edge off: 2 padding cells fewer; collapse_padding: n - 1 fewer."""
    assert [chrome(Table(), n) for n in (1, 2, 4)] == [4, 7, 13]
    assert chrome(Table(show_edge=False), 4) == 8 + 3
    assert chrome(Table(box=None), 4) == 8
    assert chrome(Table(pad_edge=False), 4) == 6 + 5
    assert chrome(Table(collapse_padding=True), 4) == 8 - 3 + 5
    for n in (1, 2, 4):  # the rule agrees with what rich prints
        t = Table()
        for i in range(n):
            t.add_column(str(i), width=3)
        assert len(printed([t], 80).splitlines()[0]) == chrome(t, n) + 3 * n


def test_panels_pack_columns_greedily_each_starting_with_the_key_column():
    """Needs 3, 8, 4, 4 (chrome 3n + 1): key + a + b is 10 + 15 = 25, exactly the width 25, so they share a panel;
    adding c would make 13 + 19 = 32. At width 24 b starts a panel of its own."""
    widths = [(3, 3), (8, 8), (4, 7), (4, 4)]
    assert panels(widths, Table(), 25) == [[0, 1, 2], [0, 3]]
    assert panels(widths, Table(), 24) == [[0, 1], [0, 2, 3]]
    assert panels(widths, Table(), 32) == [[0, 1, 2, 3]]
    assert panels([(3, 3)], Table(), 10) == [[0]]


def test_spread_shares_the_room_a_cell_at_a_time():
    """Each round gives one cell to every column still below its want, up to the room left."""
    assert spread([3, 5, 2], [6, 5, 3], 3) == [5, 5, 3]
    assert spread([1, 1], [2, 3], 10) == [2, 3]
    assert spread([1, 1, 1], [5, 5, 5], 2) == [2, 2, 1]
    assert spread([1, 1, 1], [5, 5, 5], 0) == [1, 1, 1]


def test_fit_table_splits_an_overwide_table_into_panels_with_fixed_widths():
    """At 30 columns the table needs 13 + 22 = 35. Panel 1 (key, a, b) has room 30 - 10 - 15 = 5, of which b takes
    3 (4 -> its want 7); panel 2 (key, c) takes its needs 3 and 4. The title stays on the first panel, the caption
    comes once after the last; nothing is wider than 30."""
    t = wide_table()
    assert fit_table(t, 40) == [t]
    first, second, caption = fit_table(t, 30, Console(width=30, file=io.StringIO()))
    assert [c.header for c in first.columns] == ["key", "a", "b"] and [c.width for c in first.columns] == [3, 8, 7]
    assert [c.header for c in second.columns] == ["key", "c"] and [c.width for c in second.columns] == [3, 4]
    assert [c._index for c in second.columns] == [0, 1] and first.columns[2].justify == "right"
    assert (first.title, second.title, first.caption, second.caption, caption) == ("T", None, None, None, "C")
    assert [c.header for c in t.columns] == ["key", "a", "b", "c"] and t.columns[2].width is None  # untouched
    out = printed([first, second, caption], 30)
    assert max(len(line) for line in out.splitlines()) <= 30
    assert "│ k1  │ aaaaaaaa │ bb bbbb │" in out and "│ k1  │ ccc… │" in out
    no_caption = wide_table()
    no_caption.caption = None
    assert len(fit_table(no_caption, 30)) == 2
    assert fit_table(Table(), 5) != [] and len(fit_table(Table(box=box.SIMPLE), 5)) == 1


# --- cli/render.py ----------------------------------------------------------------------------------------------


def test_exp_of_a_logprob():
    assert render.exp(math.log(0.25)) == pytest.approx(0.25) and render.exp(float("-inf")) == 0.0
    assert render.exp(0.0) == 1.0


SAMPLES_64 = """\
                        tiny · 2 samples
┏━━━┳━━━━━━┳━━━━━━━━━━━━━┳━━━━━┳━━━━━━━━┳━━━━━━━━━━┳━━━━━━━━━━━┓
┃ # ┃ seed ┃ text        ┃ len ┃ stop   ┃ sum logp ┃ mean logp ┃
┡━━━╇━━━━━━╇━━━━━━━━━━━━━╇━━━━━╇━━━━━━━━╇━━━━━━━━━━╇━━━━━━━━━━━┩
│ 0 │    7 │ short\\ntext │   2 │ length │   -1.235 │    -0.617 │
│ 1 │    8 │ a much      │  12 │ eos    │  -10.500 │    -0.875 │
│   │      │ longer text │     │        │          │           │
│   │      │ that wraps  │     │        │          │           │
└───┴──────┴─────────────┴─────┴────────┴──────────┴───────────┘
logp: processed log-probability (the distribution each token was
                          drawn from)
              first token
┏━━━━━━━┳━━━━┳━━━━━━━┳━━━━━━━━━━━━━━━━━┓
┃ token ┃ id ┃ count ┃           share ┃
┡━━━━━━━╇━━━━╇━━━━━━━╇━━━━━━━━━━━━━━━━━┩
│ ␣a    │  1 │     2 │ █████      0.50 │
│ b     │  3 │     1 │ ██▌        0.25 │
└───────┴────┴───────┴─────────────────┘
summary: num_samples=2  distinct_outputs=2
mean_sum_logprob=-5.867  std_sum_logprob=4.633
mean_logprob=-0.746  std_mean_logprob=0.129  batched=False
tokens_per_s=12.5
"""


def test_samples_views_at_64_columns():
    """`sample -N`'s three views, exactly: numbers right-aligned with 3 decimals, names and the stop reason
    left-aligned, only the text column wraps (at word boundaries, newlines escaped), the first-token shares as a bar
    of 10 cells (0.5 -> 5 cells, 0.25 -> 2.5) and two decimals, the summary without first_tokens."""
    from decodelab.core.many import FirstToken, SampleRow, SpreadSummary

    rows = [SampleRow(0, 7, [1, 2], "short\ntext", 2, "length", -1.23456, -0.61728),
            SampleRow(1, 8, [3], "a much longer text that wraps", 12, "eos", -10.5, -0.875)]
    spread = SpreadSummary(2, 2, -5.867, 4.633, -0.746, 0.129, [FirstToken(1, " a", 2, 0.5), FirstToken(3, "b", 1, 0.25)],
                           tokens_per_s=12.5)
    out = printed(render.samples_views(rows, spread, "tiny · 2 samples"), 64)
    assert "\n".join(line.rstrip() for line in out.splitlines()) + "\n" == SAMPLES_64


def test_the_shading_legend_is_dim():
    assert render.shading_legend("raw p").style == "dim"


# --- cli/steps_view.py and cli/live.py ----------------------------------------------------------------------------


def test_a_tables_parts_keep_its_settings_and_together_print_the_whole():
    """with_part keeps the steps, widths, stage names (which size `decided by`) and title: head + rows + caption
    printed one after the other are the whole table; rows of other steps print those steps."""
    from test_steps_view import STEPS, table

    whole = table()
    parts = [whole.with_part(part) for part in ("head", "rows", "caption")]
    assert "".join(printed([p], 80) for p in parts) == printed([whole], 80)
    assert printed([whole.with_part("rows", STEPS[1:2])], 80) == printed([table(steps=STEPS[1:2], part="rows")], 80)


def test_the_live_status_line_counts_tokens_and_their_rate(monkeypatch):
    """5 tokens in 0.5 s: 10.0 tok/s (the 1e-9 floor only guards a zero elapsed time); the spinner is cyan, and
    each add() puts a fresh status under the rows."""
    from decodelab.cli import live as live_module
    from decodelab.cli.live import LiveSteps
    from test_steps_view import STEPS

    monkeypatch.setattr(live_module, "time", SimpleNamespace(perf_counter=lambda: 100.5))
    terminal = Console(width=80, file=io.StringIO(), force_terminal=True, color_system=None)
    steps = LiveSteps(terminal, None, limit=9)
    steps.start, steps.count = 100.0, 5
    spinner = steps.status()
    assert spinner.text.plain == "5/9 tokens · 10.0 tok/s · Ctrl-C stops and keeps them" and spinner.style == "cyan"
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
    from test_steps_view import table

    out = printed([table().with_part("head"), table().with_part("rows")], width)
    assert out == expected


def test_the_steps_table_styles():
    """Header lines bold, the rule dim, the token bold, the folded lines dim."""
    from decodelab.cli.steps_view import header_lines, plan, row_lines
    from test_steps_view import STEPS

    folded = plan(60, 151936, 100000, ["temperature", "repetition-penalty"], 3)
    assert [x.style for x in header_lines(folded)] == ["bold", "bold", "dim"]
    row, under = row_lines(folded, STEPS[0])
    assert [(s.start, s.end, s.style) for s in row.spans] == [(7, 13, "bold")] and under.style == "dim"
    wide = plan(130, 151936, 100000, ["temperature", "repetition-penalty"], 3)
    assert [x.style for x in header_lines(wide)] == ["bold", "dim"]
    (row,) = row_lines(wide, STEPS[0])
    assert [(s.start, s.end, s.style) for s in row.spans] == [(7, 19, "bold")]
