"""The kept map of a score-based cache policy on the terminal: one strip of the prompt per layer, marking the tokens
its KV heads still hold, and the prompt text shaded by how many (layer, head) pairs kept each token.

A strip has at most ``STRIP`` cells (80 columns hold the table); cell c covers the prompt positions
[c T / W, (c + 1) T / W) and shows f = kept (head, position) entries / (heads x positions in the cell):
``█`` f = 1, ``▓`` f >= 2/3, ``▒`` f >= 1/3, ``░`` f > 0, ``·`` f = 0.
"""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from . import render

STRIP = 44  # cells: layer, slots and prompt-kept columns plus borders leave this much of 80 columns
SHOWN_TEXT = 600  # prompt tokens shaded in the text view (more: the count line only)
MARKS = (("█", 1.0), ("▓", 2 / 3), ("▒", 1 / 3), ("░", 1e-12))


def mark(fraction: float) -> str:
    return next((m for m, low in MARKS if fraction >= low), "·")


def cells(prompt_tokens: int, width: int = STRIP) -> list[tuple[int, int]]:
    """The [start, end) prompt positions of each strip cell: one token a cell up to ``width`` tokens."""
    w = max(min(width, prompt_tokens), 1)
    return [(c * prompt_tokens // w, (c + 1) * prompt_tokens // w) for c in range(w)]


def strip(counts: list[int], heads: int, prompt_tokens: int, width: int = STRIP) -> str:
    """One layer's strip from ``counts[p]`` = heads of the layer holding position p."""
    out = []
    for start, end in cells(prompt_tokens, width):
        out.append(mark(sum(counts[start:end]) / (heads * (end - start))) if end > start else " ")
    return "".join(out)


def kept_table(kept, title: str) -> Table:
    """Per layer: slots per KV head, prompt tokens held (summed over heads, out of heads x T) and the strip."""
    T = kept.prompt_tokens
    span = cells(T)
    per_cell = f"{span[0][1] - span[0][0]} tokens a cell" if len(span) < T else "one token a cell"
    table = Table(title=title, header_style="bold")
    for name in ("layer", "slots", "prompt kept"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column(f"prompt 0..{T - 1} ({per_cell})", no_wrap=True)
    for layer in kept.layers:
        counts = kept.kept_by([layer.layer])
        heads = len(layer.heads)
        held = sum(counts[:T])
        table.add_row(str(layer.layer), str(layer.slots), f"{held / (heads * T):.0%}" if T else "-",
                      strip(counts, heads, T))
    later = kept.seen - T
    table.caption = (f"{kept.policy}: slots = positions each KV head holds; a cell is █ when every head of the layer "
                     "holds all its tokens, ▓ >= 2/3, ▒ >= 1/3, ░ some, · none"
                     + (f"; plus up to {later} tokens after the prompt" if later > 0 else "")
                     + f"; {kept.kv_bytes:,} bytes held (real tensors), {kept.evicted:,} (layer, head, token) "
                     "entries evicted")
    return table


def kept_text(kept, token_text, prompt_ids: list[int]) -> Text:
    """The prompt, each token styled by the share of (layer, head) pairs that kept it."""
    counts = kept.kept_by()
    pairs = kept.pairs()
    T = kept.prompt_tokens
    everywhere = sum(c == pairs for c in counts[:T])
    nowhere = sum(c == 0 for c in counts[:T])
    head = Text(f"prompt tokens kept by every layer and head: {everywhere} of {T}; by none: {nowhere}", style="bold")
    if T > SHOWN_TEXT:
        return head
    text = Text()
    for position, token_id in enumerate(prompt_ids[:T]):
        share = counts[position] / pairs if pairs else 0.0
        style = "bold black on green" if share == 1 else "dim strike" if share == 0 else "black on yellow" \
            if share >= 0.5 else "underline"
        text.append(token_text(token_id), style=style)
    legend = Text("kept by every (layer, head): green; by half or more: yellow; by fewer: underlined; by none: dim "
                  "struck through", style="dim")
    return Group(head, text, legend)


def kept_views(kept, token_text, prompt_ids: list[int], title: str) -> list:
    """Both views, or none for a policy without a kept map."""
    if kept is None:
        return []
    return [kept_table(kept, title), kept_text(kept, token_text, prompt_ids)]


def kept_rows(kept) -> list[dict]:
    """Flat rows for markdown: one per layer and KV head."""
    if kept is None:
        return []
    return [{"layer": layer.layer, "head": h, "slots": layer.slots, "kv_bytes": layer.kv_bytes,
             "prompt_kept": sum(p < kept.prompt_tokens for p in positions),
             "positions": render.one_line(" ".join(map(str, positions)))}
            for layer in kept.layers for h, positions in enumerate(layer.heads)]


def kept_after(runtime, prompt_tokens: int):
    """The kept map of a finished run's cache (core/kv/kept.py owns it)."""
    from ...core.kv.kept import kept_after as after
    return after(runtime, prompt_tokens)


def document_part(kept) -> dict:
    """The ``kv_kept`` field of a command's JSON (core/kv/kept.py owns it)."""
    from ...core.kv.kept import document_part as part
    return part(kept)


def table_part(kept) -> list[tuple[str, list[dict]]]:
    """The markdown section of the kept map (none without one)."""
    return [] if kept is None else [("kept positions per layer and KV head", kept_rows(kept))]
