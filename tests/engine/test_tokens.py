"""The token buffer (core/engine/tokens.py): the committed ids, scratch room, one token per row, reordering rows."""

from __future__ import annotations

import torch


# --- exact edges: the cases mutation testing (tests/mutation/run.sh) showed no other test pinned down -------------


def test_token_buffer_views_the_committed_ids_and_follows_parents():
    """Prompt (5, 6) in a [2, 5] buffer: prefix() is the committed ids, prefix(1) adds one scratch id, new_ids only
    the generated ones; push writes one token per row, reorder makes both rows copies of row 1."""
    from decodelab.core.engine.tokens import TokenBuffer

    buf = TokenBuffer([5, 6], 5, "cpu", rows=2)
    assert buf.prefix().tolist() == [[5, 6], [5, 6]] and buf.new_ids == []
    buf.append([7])
    assert buf.prefix().tolist() == [[5, 6, 7]] * 2 and buf.prefix(1).tolist() == [[5, 6, 7, 0]] * 2
    assert buf.new_ids == [7] and buf.length == 3 and buf.last().tolist() == [[7], [7]]
    buf.push(torch.tensor([[8], [9]]))
    assert buf.prefix().tolist() == [[5, 6, 7, 8], [5, 6, 7, 9]] and buf.length == 4
    buf.reorder(torch.tensor([1, 1]))
    assert buf.prefix().tolist() == [[5, 6, 7, 9], [5, 6, 7, 9]]
    assert buf.ids.dtype == torch.long and TokenBuffer([], 2, "cpu").prefix().tolist() == [[]]

