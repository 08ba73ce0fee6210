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

from decodelab.cli.view import render
from decodelab.cli.view.fit import chrome, column_widths, fit_table, panels, spread


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
    from decodelab.core.methods.many import FirstToken, SampleRow, SpreadSummary

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
    from decodelab.cli.view import live as live_module
    from decodelab.cli.view.live import LiveSteps
    from test_steps_view import STEPS

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
    from test_steps_view import table

    out = printed([table().with_part("head"), table().with_part("rows")], width)
    assert out == expected


def test_the_steps_table_styles():
    """Header lines bold, the rule dim, the token bold, the folded lines dim."""
    from decodelab.cli.view.steps_view import header_lines, plan, row_lines
    from test_steps_view import STEPS

    folded = plan(60, 151936, 100000, ["temperature", "repetition-penalty"], 3)
    assert [x.style for x in header_lines(folded)] == ["bold", "bold", "dim"]
    row, under = row_lines(folded, STEPS[0])
    assert [(s.start, s.end, s.style) for s in row.spans] == [(7, 13, "bold")] and under.style == "dim"
    wide = plan(130, 151936, 100000, ["temperature", "repetition-penalty"], 3)
    assert [x.style for x in header_lines(wide)] == ["bold", "dim"]
    (row,) = row_lines(wide, STEPS[0])
    assert [(s.start, s.end, s.style) for s in row.spans] == [(7, 19, "bold")]


def many_steps():
    from test_steps_view import STEPS, step

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
    from test_steps_view import table

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
    from test_steps_view import table

    console = Console(width=80, file=io.StringIO())
    parts = list(table().__rich_console__(console, console.options))
    assert (parts[0].plain, parts[0].style) == ("T", "bold")
    assert parts[-1].style == "dim" and parts[-1].plain.startswith("prob: the processed distribution")


def test_the_live_table_prints_its_header_then_rows_with_the_status_on_the_same_console():
    """In a terminal: the header first, then the status line (written on the console given, from the start), and a
    transient status: the display is erased when the run ends (rich ends a transient live display by moving the
    cursor up over it, "\\x1b[1A", and erasing the line, "\\x1b[2K")."""
    from decodelab.cli.view.live import LiveSteps
    from test_steps_view import STEPS, table

    terminal = Console(width=80, file=io.StringIO(), force_terminal=True, color_system=None)
    with LiveSteps(terminal, table(steps=[]), limit=3) as live:
        started = terminal.file.getvalue()
        live.add(STEPS[0])
    assert started.startswith("T\n    #  token") and "0/3 tokens ·" in started
    assert terminal.file.getvalue().endswith("\x1b[1A\x1b[2K")  # transient: the status line erased at the end


def test_fitted_splits_only_tables():
    from decodelab.cli.view.render import fitted

    console = Console(width=30, file=io.StringIO())
    parts = fitted([wide_table(), "text"], 30, console)
    assert len(parts) == 4 and parts[2:] == ["C", "text"]
    assert [c.header for c in parts[1].columns] == ["key", "c"]


def test_consoles_print_numbers_plain_and_status_goes_to_stderr(capsys, monkeypatch):
    """No highlighting: rich would colour "0.500" and "[1, 2]" in a terminal. Status lines go to stderr."""
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.delenv("NO_COLOR", raising=False)
    render.console().print("p 0.500 [1, 2]")
    render.error_console().print("q 0.25")
    out, err = capsys.readouterr()
    assert (out, err) == ("p 0.500 [1, 2]\n", "q 0.25\n")


def test_save_records_plain_numbers_splits_wide_tables_and_reports_a_write_error_in_one_line(tmp_path):
    """The recording at 160 columns: numbers not highlighted, a table of two 100-character columns split into two
    panels (the key column in each), HTML and SVG both whole. A path that is a folder: one line, the OS's reason."""
    wide = Table()
    wide.add_column("key", no_wrap=True)
    wide.add_column("a" * 100, no_wrap=True)
    wide.add_column("b" * 100, no_wrap=True)
    wide.add_row("k", "x", "y")
    html, svg = tmp_path / "t.html", tmp_path / "t.svg"
    render.save(["p 0.500 [1, 2]", wide], html, svg)
    page = html.read_text()
    assert "p 0.500 [1, 2]" in page and page.count("key") == 2
    assert "a" * 100 in page and "b" * 100 in page
    drawing = svg.read_text()
    assert drawing.count("key") == 2 and "0.500" in drawing
    with pytest.raises(render.ConfigError) as err:
        render.save(["x"], tmp_path, None)
    assert str(err.value) == "--save-html/--save-svg: cannot write the file (Is a directory)"


def test_show_token_marks_spaces_only_at_the_edges_or_when_there_is_nothing_else():
    assert [render.show_token(t) for t in (" ", "  ", "a b", " a", "a ", "", "\n")] == [
        "␣", "␣␣", "a b", "␣a", "a␣", "", "\\n"]


SAMPLES_40 = """\
            tiny · 2 samples
┏━━━━┳━━━━━━┳━━━━━━━━━━━━━━━━━━━━┳━━━━━┓
┃  # ┃ seed ┃ text               ┃ len ┃
┡━━━━╇━━━━━━╇━━━━━━━━━━━━━━━━━━━━╇━━━━━┩
│  9 │    7 │ short\\ntext        │   2 │
│ 10 │    8 │ a much longer text │  12 │
│    │      │ that wraps         │     │
└────┴──────┴────────────────────┴─────┘
┏━━━━┳━━━━━━━━┳━━━━━━━━━━┳━━━━━━━━━━━┓
┃  # ┃ stop   ┃ sum logp ┃ mean logp ┃
┡━━━━╇━━━━━━━━╇━━━━━━━━━━╇━━━━━━━━━━━┩
│  9 │ length │   -1.235 │    -0.617 │
│ 10 │ eos    │  -10.500 │    -0.875 │
└────┴────────┴──────────┴───────────┘
logp: processed log-probability (the
distribution each token was drawn from)
"""


def test_samples_views_split_at_40_columns_with_bold_headers():
    """Through fitted() as show() prints it: 40 columns split the samples into two panels, each led by `#`
    (right-aligned: 9 under 10), the text wrapping in the room left (40 - 13 chrome - 2 - 4 - 3 = 18 at least);
    both tables' headers bold."""
    from decodelab.core.methods.many import FirstToken, SampleRow, SpreadSummary

    rows = [SampleRow(9, 7, [1, 2], "short\ntext", 2, "length", -1.23456, -0.61728),
            SampleRow(10, 8, [3], "a much longer text that wraps", 12, "eos", -10.5, -0.875)]
    spread = SpreadSummary(2, 2, -5.867, 4.633, -0.746, 0.129, [FirstToken(1, " a", 2, 0.5)], tokens_per_s=12.5)
    samples, firsts, summary = render.samples_views(rows, spread, "tiny · 2 samples")
    console = Console(width=40, file=io.StringIO(), color_system=None)
    out = printed(render.fitted([samples], 40, console), 40)
    assert "\n".join(line.rstrip() for line in out.splitlines()) + "\n" == SAMPLES_40
    assert (samples.header_style, firsts.header_style) == ("bold", "bold")
    assert "first_tokens" not in summary.plain and "tokens_per_s=12.5" in summary.plain


def test_column_widths_of_empty_columns_and_no_wrap_cells_with_spaces():
    """An empty column with an empty header needs nothing (0, 0). A no-wrap column needs its cells whole ("aa bb":
    5) but its header only up to the longest word ("x y": 1)."""
    t = Table()
    t.add_column("")
    t.add_column("x y", no_wrap=True)
    t.add_row("", "aa bb")
    assert column_widths(Console(width=30, file=io.StringIO()), t) == [(0, 0), (5, 5)]


def test_chrome_with_wider_padding():
    """Padding 2 each side: 4 per column; collapsed, n - 1 times 2 fewer: 4 columns 16 - 6 + 5 borders = 15."""
    assert chrome(Table(padding=(0, 2)), 4) == 16 + 5
    assert chrome(Table(padding=(0, 2), collapse_padding=True), 4) == 16 - 6 + 5


def text_table() -> Table:
    t = Table()
    t.add_column("key", no_wrap=True)
    t.add_column("text")
    t.add_column("c", no_wrap=True)
    t.add_row("k", "aaaa bbbb cccc dddd eeee", "c" * 10)
    return t


def test_fit_table_room_is_what_the_panel_leaves_and_an_exact_fit_is_a_fit():
    """Needs 3, 4, 10 and wants 3, 24, 10: the whole table is 13 + 37 = 50. At 30, one panel of all three needs 10
    + 17 = 27, so the text column gets its need 4 plus the room 3: 7. At 27 there is no room: 4. At 50 it fits
    exactly and is returned as it is."""
    t = text_table()
    console = Console(width=80, file=io.StringIO())
    (part,) = fit_table(t, 30, console)
    assert part is not t and [c.width for c in part.columns] == [3, 7, 10]
    assert max(len(line) for line in printed([part], 30).splitlines()) <= 30
    (part,) = fit_table(t, 27, console)
    assert [c.width for c in part.columns] == [3, 4, 10]
    assert fit_table(t, 50, console) == [t]
    wide = wide_table()
    assert fit_table(wide, 35) == [wide]  # 13 + 22 = 35 exactly
    assert [c.width for c in fit_table(wide, 34)[0].columns] == [3, 8, 6, 4]  # needs 32: b gets 4 + 2


def test_fit_table_measures_on_a_console_as_wide_as_the_target_when_given_none():
    """A no-wrap cell of 85 characters with the key column: 7 + 3 + 85 = 95 columns. At 94 it does not fit, so it
    becomes one panel with fixed widths; measured on an 80-column console the cell would seem 80 wide and fit."""
    t = Table()
    t.add_column("key", no_wrap=True)
    t.add_column("v", no_wrap=True)
    t.add_row("k", "v" * 85)
    (part,) = fit_table(t, 94)
    assert part is not t and [c.width for c in part.columns] == [3, 85]


def test_a_narrowed_bar_is_drawn_at_its_planned_width():
    """At 87 columns the bar shrinks from 10 to 10 - (91 - 87) = 6 cells: p = 0.5 fills 3 of them."""
    from decodelab.cli.view.steps_view import plan, row_lines
    from test_steps_view import STEPS

    layout = plan(87, 151936, 100000, ["temperature", "repetition-penalty"], 3)
    assert layout.bar == 6
    row = row_lines(layout, STEPS[0])[0].plain
    assert row == "    0  ␣the          ███      0.500    0.250       1  151936  11.93  model"


FIRSTS_30 = """\
     first token
┏━━━━━━━┳━━━━┳━━━━━━━┓
┃ token ┃ id ┃ count ┃
┡━━━━━━━╇━━━━╇━━━━━━━┩
│ ␣a    │  1 │     2 │
│ b     │  3 │     1 │
└───────┴────┴───────┘
┏━━━━━━━┳━━━━━━━━━━━━━━━━━┓
┃ token ┃           share ┃
┡━━━━━━━╇━━━━━━━━━━━━━━━━━┩
│ ␣a    │ █████      0.50 │
│ b     │ ██▌        0.25 │
└───────┴─────────────────┘
"""


def test_first_token_shares_keep_bar_and_number_on_one_line_at_30_columns():
    """Every column of the first-token table is no-wrap, so at 30 columns the share (a 10-cell bar, a space and the
    share: 15 cells) moves to a panel of its own instead of wrapping the bar under the number."""
    from decodelab.core.methods.many import FirstToken, SpreadSummary

    spread = SpreadSummary(2, 2, -5.867, 4.633, -0.746, 0.129, [FirstToken(1, " a", 2, 0.5), FirstToken(3, "b", 1, 0.25)])
    _, firsts, _ = render.samples_views([], spread, "t")
    out = printed(render.fitted([firsts], 30, Console(width=30, file=io.StringIO())), 30)
    assert "\n".join(line.rstrip() for line in out.splitlines()) + "\n" == FIRSTS_30


def test_samples_views_keep_number_headers_whole_in_a_narrow_panel():
    """At 34 columns the samples table splits into panels; its number columns do not wrap, headers included, so
    `sum logp` and `mean logp` stay whole on one line (a wrapping column would fold them onto two)."""
    from decodelab.core.methods.many import FirstToken, SampleRow, SpreadSummary

    rows = [SampleRow(0, 7, [1, 2], "short text", 2, "length", -1.23456, -0.61728)]
    spread = SpreadSummary(1, 1, -1.23, 0.0, -0.61, 0.0, [FirstToken(1, " a", 1, 1.0)], tokens_per_s=12.5)
    samples = render.samples_views(rows, spread, "t")[0]
    console = Console(width=34, file=io.StringIO(), color_system=None)
    out = printed(render.fitted([samples], 34, console), 34)
    assert "sum logp" in out and "mean logp" in out and "…" not in out
