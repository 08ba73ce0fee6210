"""The per-token table of `sample`: one line per token in fixed-width fields, laid out for the width it is printed
at, so it can be printed a row at a time as tokens come (a live terminal) or all at once (a pipe, a saved file).

At any width every number is printed whole. What does not fit beside the fixed fields folds onto the line under the
row: first the alternatives, then `decided by`. Only a token's text is ever shortened (with an ellipsis)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.text import Text

from .render import BAR_WIDTH, bar, fmt_p, show_token

GAP = 2  # spaces between fields
P_WIDTH = 7  # fmt_p prints "0.123" or "1.2e-05": at most 7 characters
H_WIDTH = 5  # entropy "%.2f" in nats: below 100 for any vocabulary under e^100 tokens
TOKEN_WIDTH, TOKEN_MIN = 12, 6
BAR_MIN = 3
ALTS_MIN = 28  # the alternatives go beside the row only when at least this many columns are left for them
CAPTION = ("prob: the processed distribution the token was drawn from (a list marked 'raw:' holds the model's p, "
           "where the processed one is one-hot, as when greedy); raw p / rank: the model's own softmax; "
           "kept: candidates left after the chain; H: entropy (nats) of the processed distribution; decided by: "
           "the stage that chose this token with the step's own random draws (model: none changed the model's pick)")


@dataclass(frozen=True)
class Layout:
    """Field widths in terminal cells; ``bar`` 0 = no bar; ``fold_decided``: `decided by` goes under the row."""
    width: int
    index: int
    token: int
    bar: int
    rank: int
    kept: int
    decided: int
    fold_decided: bool
    top: int

    def prob_width(self) -> int:
        return self.bar + 1 + P_WIDTH if self.bar else P_WIDTH

    def fixed_width(self) -> int:
        """The row's fixed fields and the gaps between them."""
        widths = [self.index, self.token, self.prob_width(), P_WIDTH, self.rank, self.kept, H_WIDTH]
        if not self.fold_decided:
            widths.append(self.decided)
        return sum(widths) + GAP * (len(widths) - 1)

    def alts_beside(self) -> bool:
        return self.top > 0 and self.width - self.fixed_width() - GAP >= ALTS_MIN

    def fold_indent(self) -> int:
        return self.index + GAP


def plan(width: int, vocab_size: int, max_steps: int, stage_names: list[str], top: int) -> Layout:
    """The widest layout that fits ``width``: shrink the bar, drop it, shorten tokens, then fold `decided by`."""
    digits = len(str(max(vocab_size, 1)))
    # `decided by` holds a stage name, "model" or "forced": the last two are shorter than the header
    layout = Layout(width=width, index=max(1, len(str(max(max_steps - 1, 0)))), token=TOKEN_WIDTH, bar=BAR_WIDTH,
                    rank=max(len("rank"), digits), kept=max(len("kept"), digits),
                    decided=max([len("decided by"), *(len(n) for n in stage_names)]), fold_decided=False, top=top)
    over = layout.fixed_width() - width
    if over > 0:
        layout = _replace(layout, bar=max(BAR_MIN, layout.bar - over))
        over = layout.fixed_width() - width
    if over > 0:
        layout = _replace(layout, bar=0)
        over = layout.fixed_width() - width
    if over > 0:
        layout = _replace(layout, token=max(TOKEN_MIN, layout.token - over))
        over = layout.fixed_width() - width
    if over > 0:
        layout = _replace(layout, fold_decided=True)
    return layout


def _replace(layout: Layout, **changes) -> Layout:
    return Layout(**{**layout.__dict__, **changes})


def fit_token(token: str, width: int) -> str:
    """The token as shown (spaces marked, controls escaped), cut to ``width`` cells with an ellipsis if longer."""
    text = Text(show_token(token))
    text.truncate(width, overflow="ellipsis", pad=True)  # a shorter token is padded with spaces
    return text.plain


def pack(items: list[str], width: int) -> list[str]:
    """Items joined by two spaces into lines of at most ``width`` cells, breaking only between items."""
    lines: list[str] = []
    for item in items:
        if lines and cell_len(lines[-1]) + GAP + cell_len(item) <= width:
            lines[-1] += " " * GAP + item
        else:
            lines.append(item)
    return lines


def header_lines(layout: Layout) -> list[Text]:
    cells = ["#".rjust(layout.index), "token".ljust(layout.token), "prob".ljust(layout.prob_width()),
             "raw p".rjust(P_WIDTH), "rank".rjust(layout.rank), "kept".rjust(layout.kept), "H".rjust(H_WIDTH)]
    if not layout.fold_decided:
        cells.append("decided by".ljust(layout.decided))
    line = (" " * GAP).join(cells)
    alts = f"top {layout.top} alternatives (p)"
    folded = ["decided by"] if layout.fold_decided else []
    if layout.alts_beside():
        line += " " * GAP + alts
    elif layout.top:
        folded.append(alts)
    lines = [Text(line.rstrip(), style="bold")]
    if folded:
        lines.append(Text(" " * layout.fold_indent() + " · ".join(folded), style="bold"))
    rule = max(cell_len(line.rstrip()), *(cell_len(x.plain) for x in lines))
    return lines + [Text("─" * min(rule, layout.width), style="dim")]


def row_lines(layout: Layout, step) -> list[Text]:
    """One step: its fixed fields, then the alternatives beside them or folded under them."""
    line = Text()
    line.append(str(step.index).rjust(layout.index) + " " * GAP)
    line.append(fit_token(step.token, layout.token), style="bold")
    prob = fmt_p(step.prob).rjust(P_WIDTH)
    cells = [f"{bar(step.prob, layout.bar)} {prob}" if layout.bar else prob, fmt_p(step.raw_prob).rjust(P_WIDTH),
             str(step.raw_rank).rjust(layout.rank), str(step.kept).rjust(layout.kept),
             f"{step.entropy:.2f}".rjust(H_WIDTH)]
    if not layout.fold_decided:
        cells.append((step.decided_by or "-").ljust(layout.decided))
    line.append(" " * GAP + (" " * GAP).join(cells))
    alts = alternatives_shown(step) if layout.top else []
    under = [f"by {step.decided_by or '-'}"] if layout.fold_decided else []
    lines = [line]
    if alts and layout.alts_beside():
        start = layout.fixed_width() + GAP
        first, *rest = pack(alts, layout.width - start)
        line.append(" " * GAP + first)
        lines += [Text(" " * start + more) for more in rest]
    else:
        under += alts
    if under:
        indent = layout.fold_indent()
        lines += [Text(" " * indent + x, style="dim") for x in pack(under, max(1, layout.width - indent))]
    for x in lines:
        x.rstrip()
    return lines


def one_hot(step) -> bool:
    """The processed distribution put all its mass on the token (greedy, top-k 1): every other alternative has p 0,
    so the processed numbers say nothing about them."""
    return is_one_hot(step.prob, [a.prob for a in step.alternatives])


def is_one_hot(prob, alternative_probs) -> bool:
    """:func:`one_hot` on the numbers (a step record's ``prob`` and its alternatives' ``prob``), for the HTML page."""
    return prob == 1.0 and any(p == 0.0 for p in alternative_probs)


def alternatives_shown(step) -> list[str]:
    """``token p`` per alternative; where the processed distribution is one-hot, the model's raw p instead (where the
    information is), the first marked ``raw:``."""
    if not one_hot(step):
        return [f"{show_token(a.token)} {fmt_p(a.prob)}" for a in step.alternatives]
    shown = [f"{show_token(a.token)} {fmt_p(a.raw_prob)}" for a in step.alternatives]
    return ["raw: " + shown[0], *shown[1:]] if shown else shown


@dataclass
class StepsTable:
    """A rich renderable that lays itself out for the width it is printed at. ``part`` picks what to print:
    "all" (title, header, rows, caption), "head" (title and header), "rows" or "caption" (for printing live)."""
    steps: list
    top: int
    vocab_size: int
    max_steps: int
    stage_names: list[str] = field(default_factory=list)
    title: str | None = None
    part: str = "all"

    def layout(self, width: int) -> Layout:
        return plan(width, self.vocab_size, self.max_steps, self.stage_names, self.top)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        layout = self.layout(options.max_width)
        if self.part in ("all", "head"):
            if self.title:
                yield Text(self.title, style="bold", overflow="fold")
            yield from header_lines(layout)
        if self.part in ("all", "rows"):
            for step in self.steps:
                yield from row_lines(layout, step)
        if self.part in ("all", "caption"):
            yield Text(CAPTION, style="dim")

    def with_part(self, part: str, steps: list | None = None) -> "StepsTable":
        return StepsTable(self.steps if steps is None else steps, self.top, self.vocab_size, self.max_steps,
                          self.stage_names, self.title, part)
