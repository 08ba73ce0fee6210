"""Tables that fit the terminal without cutting a number.

rich narrows an over-wide table by shrinking its wrapping columns, then every column evenly, which cuts numbers
short with an ellipsis (`1.3e-…`) or folds them across lines. Here a table too wide for the terminal is split into
panels of columns, each repeating the table's key columns (``table.key_columns``, default 1: the first), and each
column gets at least what it needs: a no-wrap
column its longest cell, a wrapping column its longest word. Tables of one view that share a ``SameLayout`` are
measured together, so they split alike."""

from __future__ import annotations

import copy

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table


def column_widths(console: Console, table: Table) -> list[tuple[int, int]]:
    """(need, want) per column, in cells without padding: need = the least that cuts nothing (a no-wrap column: its
    longest cell, header included; a wrapping one: its longest word), want = its longest line (an explicit width
    or max_width is the column's own choice and is kept)."""
    out = []
    for column in table.columns:
        cells = list(column.cells)
        if table.show_header:
            cells.append(column.header)
        need = want = 0
        for cell in cells:
            m = Measurement.get(console, console.options, cell)
            want = max(want, m.maximum)
            need = max(need, m.maximum if column.no_wrap else m.minimum)  # rich wraps no header of a no-wrap column
        if column.width is not None:
            need = want = column.width
        if column.max_width is not None:
            need, want = min(need, column.max_width), min(want, column.max_width)
        if column.min_width is not None:
            need, want = max(need, column.min_width), max(want, column.min_width)
        out.append((need, want))
    return out


class SameLayout:
    """Tables of one view with the same columns (compare's block per prompt and seed) laid out alike: each column's
    (need, want) is the widest over all of them, so at a given width every one fits or splits into the same panels
    with the same widths, and no column moves between panels from one table to the next."""

    def __init__(self, tables: list[Table]):
        self.tables, self._widths = list(tables), {}
        for t in tables:
            t.same_layout = self

    def widths(self, console: Console) -> list[tuple[int, int]]:
        key = console.options.max_width
        if key not in self._widths:  # measured once per width for all the tables
            each = [column_widths(console, t) for t in self.tables]
            self._widths[key] = [(max(w[i][0] for w in each), max(w[i][1] for w in each))
                                 for i in range(len(each[0]))]
        return self._widths[key]


def chrome(table: Table, count: int) -> int:
    """Cells a table of ``count`` columns spends on borders and padding (rich's own rules)."""
    _, right, _, left = table.padding
    pad = count * (left + right) - (0 if table.pad_edge else left + right)
    if table.collapse_padding:
        pad -= (count - 1) * min(left, right)
    lines = (count - 1 + (2 if table.show_edge else 0)) if table.box else 0
    return pad + lines


def key_columns(table: Table) -> list[int]:
    """The columns that name a row (every panel repeats them): the first ``table.key_columns`` (default 1)."""
    return list(range(min(max(getattr(table, "key_columns", 1), 1), len(table.columns) or 1)))


def panels(widths: list[tuple[int, int]], table: Table, width: int) -> list[list[int]]:
    """Columns in order, packed greedily into panels that fit ``width``, each starting with the key columns."""
    keys = key_columns(table)
    groups: list[list[int]] = []
    for i in range(len(keys), len(widths)):
        group = groups[-1] if groups else None
        if group is not None and chrome(table, len(group) + 1) + sum(widths[j][0] for j in group + [i]) <= width:
            group.append(i)
        else:
            groups.append(keys + [i])
    return groups or [keys]


def spread(needs: list[int], wants: list[int], room: int) -> list[int]:
    """Each column its need, then the room left shared a cell at a time among the columns still below their want."""
    widths = list(needs)
    while room > 0:
        growing = [i for i, w in enumerate(widths) if w < wants[i]]
        if not growing:
            break
        for i in growing[:room]:
            widths[i] += 1
        room -= min(room, len(growing))
    return widths


def fit_table(table: Table, width: int, console: Console | None = None) -> list:
    """The table itself when it fits ``width`` (at its peers' widths where it shares a SameLayout); else panels of its
    columns that each fit, with fixed widths, and the caption after the last one at the full width."""
    console = console or Console(width=width)
    shared = getattr(table, "same_layout", None)
    widths = shared.widths(console) if shared is not None else column_widths(console, table)
    whole = not widths or chrome(table, len(widths)) + sum(w for _, w in widths) <= width
    if whole and (shared is None or not widths):
        return [table]
    groups = [list(range(len(widths)))] if whole else panels(widths, table, width)  # whole: at the shared widths
    out = []
    for k, group in enumerate(groups):
        part = copy.copy(table)
        part.columns = [copy.copy(table.columns[i]) for i in group]
        room = width - chrome(table, len(group)) - sum(widths[i][0] for i in group)
        sizes = spread([widths[i][0] for i in group], [widths[i][1] for i in group], max(room, 0))
        for j, (column, size) in enumerate(zip(part.columns, sizes)):
            column.width = size
            if hasattr(column, "_index"):  # rich's private position of a column in its table (rich 13-15)
                column._index = j
        part.title = table.title if k == 0 else None
        part.caption = table.caption if whole else None
        out.append(part)
    return out + ([table.caption] if table.caption and not whole else [])
