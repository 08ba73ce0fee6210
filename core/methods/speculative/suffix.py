"""A suffix proposer over the prompt and the output so far, in the manner of suffix decoding (Oliaro et al., 2024;
vLLM's and SGLang's `suffix` method): every context of up to ``depth`` tokens that occurred in the sequence is
counted with the tokens that followed it (a suffix trie of bounded depth, stored as context -> next-token counts).
A draft extends the sequence one token at a time: match the longest suffix of (sequence + draft so far) that has a
recorded continuation, take its most frequent next token (ties: the one seen last), and stop when that token's
share of the context's continuations falls below ``min_share`` or nothing matches. Deterministic: q is a point mass
on each proposed token, so verification is exact as for the n-gram proposer.

What is not here: suffix decoding's candidate tree (several branches verified at once, which needs tree attention)
and its cache of earlier requests' outputs; this proposes one path, from this sequence only.
"""

from __future__ import annotations

from collections import Counter

from .proposers import Draft, Sequence, lookup_draft

DEPTH = 8  # the longest context matched
MIN_SHARE = 0.1  # a continuation proposed only while it is at least this share of its context's continuations


class SuffixProposer:
    context_length = None

    def __init__(self, depth: int = DEPTH, min_share: float = MIN_SHARE):
        self.depth, self.min_share = depth, min_share
        self.name = f"suffix-{depth}"
        self.forwards = 0
        self.counts: dict[tuple[int, ...], Counter] = {}
        self.last_seen: dict[tuple[tuple[int, ...], int], int] = {}
        self.indexed = 0

    def start(self, seq: Sequence) -> None:
        self.counts, self.last_seen, self.indexed, self.forwards = {}, {}, 0, 0

    def _index(self, tokens: list[int]) -> None:
        """Count, for each new position ``end``, the token there after each context of 1..depth tokens before it."""
        for end in range(max(self.indexed, 1), len(tokens)):
            nxt = tokens[end]
            for m in range(1, min(self.depth, end) + 1):
                ctx = tuple(tokens[end - m : end])
                self.counts.setdefault(ctx, Counter())[nxt] += 1
                self.last_seen[(ctx, nxt)] = end
        self.indexed = len(tokens)

    def next_token(self, tokens: list[int]) -> int | None:
        """The most frequent continuation of the longest matched suffix, if its share is at least min_share."""
        for m in range(min(self.depth, len(tokens)), 0, -1):
            seen = self.counts.get(tuple(tokens[len(tokens) - m :]))
            if seen:
                best = max(seen, key=lambda t: (seen[t], self.last_seen[(tuple(tokens[len(tokens) - m :]), t)]))
                return best if seen[best] >= self.min_share * sum(seen.values()) else None
        return None

    def lookup(self, tokens: list[int], gamma: int) -> list[int]:
        self._index(tokens)
        out: list[int] = []
        while len(out) < gamma:
            t = self.next_token(tokens + out)
            if t is None:
                break
            out.append(t)
        return out

    def propose(self, seq: Sequence, gamma: int) -> Draft:
        return lookup_draft(seq, self.lookup(seq.tokens, gamma))

    def rollback(self, length: int) -> None:
        return None  # the counts only ever hold committed tokens
