"""Proposers named by ``--draft``: a model (bundled name or folder), ``ngram``, ``suffix``, or a comma-separated
chain of them (``--draft ngram,tiny-draft``): each round the members are asked in order and the first that proposes
at least one token drafts it (as llama.cpp's ``--spec-type a,b``); the round's ``source`` names it. A model always
proposes, so members after a model are never asked. Every member keeps its own state up to date: a model that sat
out rounds catches its cache up with the next round's feed (it feeds every committed token it has not seen).
"""

from __future__ import annotations

from .names import members, model_member  # the names of --draft live there, torch-free
from .proposers import Draft, ModelProposer, NGramProposer, Sequence, make_selector_for
from .suffix import SuffixProposer

class ChainedProposer:
    """The first member that proposes drafts the round; ``source`` is its name."""

    def __init__(self, chain: list):
        self.chain = chain
        self.name = ",".join(p.name for p in chain)
        limits = [p.context_length for p in chain if p.context_length is not None]
        self.context_length = min(limits) if limits else None
        self.source: str | None = None

    @property
    def forwards(self) -> int:
        return sum(p.forwards for p in self.chain)

    def start(self, seq: Sequence) -> None:
        for p in self.chain:
            p.start(seq)

    def propose(self, seq: Sequence, gamma: int) -> Draft:
        draft = None
        for p in self.chain:
            draft = p.propose(seq, gamma)
            self.source = p.name
            if int(draft.tokens.shape[0]) > 0:
                return draft
        return draft

    def rollback(self, length: int) -> None:
        for p in self.chain:
            p.rollback(length)


def proposer_spec(draft_spec: str, draft_model) -> str:
    """What to build: ``draft_spec``, except that a caller that loaded no model for a plain model name means the
    n-gram proposer (as before chains: ``build_speculator(lm, None, ...)``)."""
    if draft_model is None and model_member(draft_spec) is not None and "," not in draft_spec:
        return "ngram"
    return draft_spec


def make_proposer(draft_spec: str, draft_model, chain, greedy: bool, generator, ngram_size: int, cache=None):
    """The proposer ``--draft`` names; ``draft_model`` the loaded model of the chain (None if it has none)."""
    built = []
    for name in members(draft_spec):
        if name == "ngram":
            built.append(NGramProposer(ngram_size))
        elif name == "suffix":
            built.append(SuffixProposer())
        else:
            built.append(ModelProposer(draft_model.model, chain, make_selector_for(greedy, generator), draft_model.name,
                                       draft_model.context_length, cache=cache))
    return built[0] if len(built) == 1 else ChainedProposer(built)
