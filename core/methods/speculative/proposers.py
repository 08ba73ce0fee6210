"""What proposes a draft for speculative decoding: a draft model (its own cache, the same chain) or an n-gram
lookup in the sequence so far (point masses); both return the drafted ids with their processed distributions q.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from ...engine.runtime import Runtime
from ...engine.tokens import TokenBuffer
from ...kv import CacheSpec
from ...sampling.chain import Chain
from ...sampling.distribution import softmax
from ...sampling.select import Greedy, Multinomial

# ---------------------------------------------------------------------------------------------------------------
# the sequence and the proposers
# ---------------------------------------------------------------------------------------------------------------


Sequence = TokenBuffer  # the ids so far; drafts are written past its length as scratch


class Draft(NamedTuple):
    tokens: Tensor  # [g] drafted ids
    q: Tensor | None  # [g, V] processed draft distributions; None = point masses (greedy, or the n-gram)
    raw_logits: list[Tensor] | None  # g rows [1, V]: the draft model's own logits (None for the n-gram)


class Proposer(Protocol):
    name: str
    forwards: int  # draft forwards so far (prefill excluded)
    context_length: int | None

    def start(self, seq: Sequence) -> None: ...  # a new run on this prompt

    def propose(self, seq: Sequence, gamma: int) -> Draft: ...  # up to gamma tokens (may be fewer, even 0)

    def rollback(self, length: int) -> None: ...  # keep only the first `length` positions of the sequence


class ModelProposer:
    """A small model with the target's vocabulary drafts from its processed distribution q (same chain)."""

    def __init__(self, model, chain: Chain, selector: Callable[[Tensor], Tensor], name: str = "draft",
                 context_length: int | None = None, cache: CacheSpec | None = None):
        self.model, self.chain, self.selector, self.name = model, chain, selector, name
        self.context_length, self.spec = context_length, cache
        self.uses_ids = chain.uses_ids  # a stage reads the prefix: each position needs its own
        self.forwards = 0
        self.runtime: Runtime | None = None

    def start(self, seq: Sequence) -> None:
        """Prefill everything but the last prompt token (it is fed with the first round)."""
        self.runtime = Runtime.create(self.model, self.spec, capacity=seq.ids.shape[1],
                                      needs=frozenset({"truncate"}))
        self.forwards = 0
        self.runtime.prefill(seq.prefix(), hold_last=True)

    @torch.inference_mode()
    def propose(self, seq: Sequence, gamma: int) -> Draft:
        runtime, n = self.runtime, seq.length
        # 1 token behind, or 2 after a round that accepted every draft
        logits = runtime.feed(seq.ids[:, runtime.fed : n])
        greedy = isinstance(self.selector, Greedy)
        tokens, q_rows, raw_rows = [], [], []
        for i in range(gamma):
            # same chain and prefix as the target's p; unchecked: only bans (-inf biases, no-repeat n-grams of the
            # prefix) can empty a row, and the target's checked chain on the same prefix raises that in this round
            processed = self.chain.apply(seq.prefix(i), logits)
            # greedy: q is the point mass on the argmax, so the logits' argmax is the draw (no softmax needed)
            q = processed if greedy else softmax(processed)
            token = self.selector(q)
            if self.uses_ids:
                seq.ids[0, n + i] = token[0]  # the next position's prefix includes this draft
            tokens.append(token)
            q_rows.append(q)
            raw_rows.append(logits)
            if i + 1 < gamma:
                logits = runtime.feed(token.view(1, 1))
        self.forwards += gamma
        drafted = torch.cat(tokens)
        if not self.uses_ids:
            seq.ids[0, n : n + gamma] = drafted  # scratch: the target's forward reads the drafts from here
        return Draft(drafted, None if greedy else torch.cat(q_rows), raw_rows)

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` tokens of the sequence (the draft cache may already hold fewer)."""
        if self.runtime.fed > length:
            self.runtime.rollback(self.runtime.fed - length)


class NGramProposer:
    """Prompt lookup: find the most recent earlier occurrence of the last n tokens (n = size, size-1, .., 1) and
    propose the tokens that followed it (copying on through the proposal itself when the match is close to the end,
    so a repeating pattern continues). Deterministic: q is a point mass on each proposed token."""

    context_length = None

    def __init__(self, size: int = 3):
        self.size = size
        self.name = f"ngram-{size}"
        self.forwards = 0
        self.follow: list[dict[tuple[int, ...], int]] = []
        self.indexed = 0

    def start(self, seq: Sequence) -> None:
        self.follow = [{} for _ in range(self.size)]  # per n: n-gram -> where its latest continuation starts
        self.indexed = 0
        self.forwards = 0

    def _index(self, tokens: list[int]) -> None:
        """Record every n-gram that ends before the last token, i.e. that has a continuation."""
        for end in range(max(self.indexed, 1), len(tokens)):
            for n in range(1, min(self.size, end) + 1):
                self.follow[n - 1][tuple(tokens[end - n : end])] = end
        self.indexed = len(tokens)

    def lookup(self, tokens: list[int], gamma: int) -> list[int]:
        self._index(tokens)
        for n in range(min(self.size, len(tokens)), 0, -1):
            start = self.follow[n - 1].get(tuple(tokens[len(tokens) - n :]))
            if start is not None:
                out: list[int] = []
                for i in range(gamma):
                    src = start + i  # < len(tokens) + i: the copy may run on into its own output
                    out.append(tokens[src] if src < len(tokens) else out[src - len(tokens)])
                return out
        return []

    def propose(self, seq: Sequence, gamma: int) -> Draft:
        return lookup_draft(seq, self.lookup(seq.tokens, gamma))

    def rollback(self, length: int) -> None:
        return None  # the index only ever holds committed tokens


def lookup_draft(seq: Sequence, out: list[int]) -> Draft:
    """A lookup proposer's draft (n-gram, suffix): the looked-up tokens written after the sequence, with no
    probabilities (a point mass each)."""
    if out:
        seq.ids[0, seq.length : seq.length + len(out)] = torch.tensor(out, dtype=torch.long)
    return Draft(torch.tensor(out, dtype=torch.long, device=seq.ids.device), None, None)


def make_selector_for(greedy: bool, generator: torch.Generator | None):
    """The proposer's selector: argmax at temperature 0, else a draw sharing the run's generator."""
    return Greedy() if greedy else Multinomial(generator)
