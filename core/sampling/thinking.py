"""Thinking markers: where a reasoning model thinks and where it answers, as a pure function of the token ids.

A thinking model writes ``START reasoning END answer`` (``<think> ... </think> ...``); a chat template may put START
(or a whole empty block) in the prompt. The markers are token sequences (the texts of ``--think-tags START,END``
through the model's tokenizer; one token each for a model that has them as special tokens, several for the bundled
tiny model). Everything here reads a whole row ``prompt + generated`` and nothing else, so the answer it gives at a
position is the same whether the position is reached by sampling, by a beam's reordered rows, or inside a
speculative round's draft (what vLLM PR #36138 fixed for its grammar: a reasoning end inside speculated tokens).

The rules (``i`` an absolute position in the row, ``P`` the prompt length):

* thinking at the end of a row (vLLM's ``thinking_token_budget`` processor, ``_init_state_entry``): the last START
  occurrence begins after the last END occurrence; the thinking count is the number of tokens after that START
  (prompt tokens included, as vLLM counts them).
* the answer's start ``a`` (where ``--constraint-after-think`` begins its text): ``P`` when the prompt's last marker
  is END (a template that closed the block, or an empty ``<think></think>``); else the end of the first END
  occurrence that ends after ``P``; None while neither exists. From ``a`` on it is the answer for good: a marker's
  text inside the answer (a JSON string holding ``</think>``) does not reopen anything.
* each generated token's part (:func:`parts`): ``marker`` (inside a START or END occurrence before ``a``),
  ``reasoning`` (inside an open block before ``a``), ``answer`` (from ``a`` on), ``outside`` (before ``a`` and in no
  block: a model that has not thought, or the question before a block in a scored text).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import ConfigError
from .registry import implements

PARTS = ("reasoning", "answer", "marker", "outside")
DEFAULT_TAGS = ("<think>", "</think>")


@dataclass(frozen=True)
class ThinkTags:
    """The two markers as token sequences."""

    start: tuple[int, ...]
    end: tuple[int, ...]

    def __post_init__(self):
        if not self.start or not self.end:
            raise ConfigError("--think-tags: a marker encodes to no tokens")


def parse_think_tags(text: str) -> tuple[str, str]:
    """``'START,END'`` -> (START, END): two non-empty, different texts."""
    parts = text.split(",")
    if len(parts) != 2 or not all(parts) or parts[0] == parts[1]:
        raise ConfigError(f"--think-tags {text!r}: give two different non-empty markers as START,END "
                          "(e.g. '<think>,</think>')")
    return parts[0], parts[1]


def tags_from_template(template: str | None) -> tuple[str, str] | None:
    """The default markers when the tokenizer's chat template writes both (``<think>`` and ``</think>``)."""
    if template and all(tag in template for tag in DEFAULT_TAGS):
        return DEFAULT_TAGS
    return None


def occurrences(row: Sequence[int], marker: tuple[int, ...]) -> list[int]:
    """Every index i with row[i : i + len(marker)] == marker (overlapping ones too)."""
    n = len(marker)
    first = marker[0]
    return [i for i in range(len(row) - n + 1) if row[i] == first and tuple(row[i:i + n]) == marker]


def answer_start(row: Sequence[int], prompt_len: int, tags: ThinkTags) -> int | None:
    """Where the answer begins (module doc), or None while the model has not ended its thinking."""
    starts, ends = occurrences(row, tags.start), occurrences(row, tags.end)
    n_end = len(tags.end)
    in_prompt = [(i + len(tags.start), "start") for i in starts if i + len(tags.start) <= prompt_len]
    in_prompt += [(i + n_end, "end") for i in ends if i + n_end <= prompt_len]
    if in_prompt and max(in_prompt)[1] == "end":
        return prompt_len
    after = [i + n_end for i in ends if i + n_end > prompt_len]
    return min(after) if after else None


def thinking_count(row: Sequence[int], tags: ThinkTags) -> int | None:
    """Tokens since the START of the open block (None: no block open), as vLLM's budget counts them."""
    starts, ends = occurrences(row, tags.start), occurrences(row, tags.end)
    last_start, last_end = (starts[-1] if starts else -1), (ends[-1] if ends else -1)
    if last_start < 0 or last_start <= last_end:
        return None
    return len(row) - (last_start + len(tags.start))


def parts(row: Sequence[int], prompt_len: int, tags: ThinkTags) -> list[str]:
    """The part of each generated token row[prompt_len:] (module doc)."""
    a = answer_start(row, prompt_len, tags)
    limit = len(row) if a is None else a
    label = ["outside"] * limit + ["answer"] * (len(row) - limit)
    open_block = False
    i = 0
    while i < limit:
        for marker, opens in ((tags.end, False), (tags.start, True)):
            if tuple(row[i:i + len(marker)]) == marker and (opens or open_block):
                for j in range(i, min(i + len(marker), len(row))):
                    label[j] = "marker"
                open_block, i = opens, i + len(marker)
                break
        else:
            if open_block:
                label[i] = "reasoning"
            i += 1
    return label[prompt_len:]


# --- the thinking budget stage --------------------------------------------------------------------------------------


@implements("thinking-budget")
class ThinkingBudget:
    """After ``budget`` thinking tokens, force END, one token a step: with c = :func:`thinking_count` of the row
    (tokens since the open block's START), c >= budget forces END[c - budget] (every other logit -inf), so the
    k-th forced token is END's k-th and the block closes after exactly budget + len(END) tokens. vLLM adds 1e9 to
    the forced logit instead (the same token unless a later stage bans it; here that empties the chain, an error).
    A pure function of the row: exact in speculation and beam search. ``state()``: ``forced`` per row."""

    name = "thinking-budget"
    reads_ids = True

    def __init__(self, budget: int, tags: ThinkTags):
        if not isinstance(budget, int) or budget < 0:
            raise ConfigError(f"--thinking-budget {budget}: must be an integer >= 0")
        self.budget, self.tags = budget, tags
        self._forced: Tensor | None = None

    def forced_token(self, row: Sequence[int]) -> int | None:
        count = thinking_count(row, self.tags)
        if count is None or count < self.budget:
            return None
        k = count - self.budget
        return self.tags.end[k] if k < len(self.tags.end) else None

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        forced = [self.forced_token(row) for row in ids.tolist()]
        self._forced = torch.tensor([f is not None for f in forced], device=logits.device)
        if not any(f is not None for f in forced):
            return logits
        keep = torch.zeros_like(logits, dtype=torch.bool)
        for b, f in enumerate(forced):
            if f is None:
                keep[b] = True
            else:
                keep[b, f] = True
        return logits.masked_fill(~keep, float("-inf"))

    def state(self) -> dict[str, Tensor]:
        return {} if self._forced is None else {"forced": self._forced.float()}
