"""Tables split into column panels instead of cut (cli/fit.py): rich's own widths, the packing, the sharing of the
room left, and whole numbers at any width."""

from __future__ import annotations

import io

import pytest
from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table

from decodelab.cli.view.fit import chrome, column_widths, fit_table, panels, spread


def printed(renderables, width: int) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    for r in renderables:
        console.print(r)
    return console.file.getvalue()


def numbers_table(columns: int = 8, **kwargs) -> Table:
    table = Table(title="T", caption="the caption", **kwargs)
    table.add_column("key")
    for c in range(1, columns):
        table.add_column(f"c{c}", justify="right", no_wrap=True)
    table.add_row("row-a", *[f"{c * 1111.25:.2f}" for c in range(1, columns)])
    table.add_row("row-b", *[f"-{c}.5e-07" for c in range(1, columns)])
    return table


@pytest.mark.parametrize("kwargs, expected", [
    ({}, 16), ({"box": None}, 12), ({"show_edge": False}, 14), ({"pad_edge": False}, 14), ({"padding": (0, 2)}, 22),
    ({"box": box.SIMPLE, "collapse_padding": True}, 14),
    ({"box": None, "padding": (0, 1), "collapse_padding": True, "pad_edge": False}, 8)])
def test_chrome_is_what_rich_spends_on_borders_and_padding(kwargs, expected):
    # cells "a", "bbb", "cc" = 6; heavy box: 3 x (1 + 1) padding + 2 inner lines + 2 edges = 10
    table = Table(show_header=False, **kwargs)
    for _ in range(3):
        table.add_column(no_wrap=True)
    table.add_row("a", "bbb", "cc")
    assert chrome(table, 3) + 6 == expected
    assert {cell_len(line) for line in printed([table], 200).splitlines()} == {expected}


def test_column_widths_need_and_want():
    table = Table()
    table.add_column("name")  # wraps: needs its longest word
    table.add_column("n", no_wrap=True)  # no wrap: needs its longest cell
    table.add_column("capped", max_width=4)
    table.add_row("two words", "12345", "abcdefgh")
    assert column_widths(Console(width=80), table) == [(5, 9), (5, 5), (4, 4)]


def test_panels_pack_columns_in_order_after_the_key():
    table = Table()  # heavy box: chrome(n) = 2 per column of padding + n - 1 + 2 borders = 3n + 1
    widths = [(5, 5), (10, 10), (10, 10), (10, 10), (3, 3)]
    assert chrome(table, 3) == 10
    assert panels(widths, table, 35) == [[0, 1, 2], [0, 3, 4]]  # 10 + 25 = 35 fits; a fourth column would not
    assert panels(widths, table, 34) == [[0, 1], [0, 2], [0, 3, 4]]
    assert panels([(5, 5)], table, 10) == [[0]]


def test_spread_gives_the_room_a_cell_at_a_time_up_to_each_want():
    assert spread([3, 5, 2], [3, 9, 4], 3) == [3, 7, 3]
    assert spread([3, 5, 2], [3, 9, 4], 100) == [3, 9, 4]
    assert spread([1, 1], [5, 5], 1) == [2, 1]
    assert spread([1], [5], 0) == [1]


def test_a_table_that_fits_is_returned_as_it_is():
    table = numbers_table(3)
    assert fit_table(table, 200) == [table]


@pytest.mark.parametrize("width", [80, 60, 40])
def test_a_wide_table_becomes_panels_with_every_number_whole(width):
    table = numbers_table(8)
    parts = fit_table(table, width)
    assert len(parts) > 2 and parts[-1] == "the caption"
    text = printed(parts, width)
    assert "…" not in text and max(cell_len(line) for line in text.splitlines()) <= width
    for c in range(1, 8):
        assert f"{c * 1111.25:.2f}" in text and f"-{c}.5e-07" in text
    tables = [p for p in parts if isinstance(p, Table)]
    assert all(t.columns[0].header == "key" for t in tables)  # the key column repeated in every panel
    assert [t.title for t in tables] == ["T"] + [None] * (len(tables) - 1)
    assert all(t.caption is None for t in tables) and table.caption == "the caption"  # the original untouched
    assert [c.header for t in tables for c in t.columns[1:]] == [f"c{c}" for c in range(1, 8)]  # in order, once


def test_unfitted_rich_would_cut_these_numbers():
    """The case fit_table exists for: rich alone squeezes the wrapping key column to nothing, then ellipsises no-wrap
    numbers, in a table too wide for the terminal."""
    assert "row-a" not in printed([numbers_table(8)], 80)
    assert "…" in printed([numbers_table(10)], 80)
    assert "row-a" in printed(fit_table(numbers_table(8), 80), 80)


def test_the_header_of_a_no_wrap_column_is_not_cut():
    """rich does not wrap the header of a no-wrap column either: it needs the whole header, not its longest word."""
    table = Table()
    table.add_column("key")
    for _ in range(6):
        table.add_column("sum logp", no_wrap=True, justify="right")
    table.add_row("abc", *["-1.25"] * 6)
    assert column_widths(Console(width=80), table)[1] == (8, 8)
    text = printed(fit_table(table, 34), 34)
    assert "…" not in text and text.count("sum logp") == 6
