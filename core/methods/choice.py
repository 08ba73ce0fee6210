"""`score --choice A,B,C` after a prompt: each label's exact probability beside the two estimates people use.

For a prompt x and a label whose listed tokenizations are t^(1), t^(2), .. (the tokenizer's own first,
:func:`~decodelab.core.sampling.constraint.label_encodings`):

    exact(label)  = sum_j prod_i p(t^(j)_i | x, t^(j)_<i)      the model's own conditionals, temperature 1
    share(label)  = exact(label) / sum_labels exact             what both estimates estimate

beside ``first_token`` (p of the first token of the tokenizer's own encoding, renormalized over the labels) and
``sampler`` (the probability that sampling under the --choice constraint alone ends on the label, every token path
the constraint allows walked), each with its error against ``share``. The arithmetic is
:func:`~decodelab.core.sampling.constraint.choice_probabilities`; this module gives it the model: one forward per
distinct token prefix, on top of the prompt's KV cache (each prefix fed, then rolled back).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..engine.models import LoadedModel
from ..engine.runtime import Runtime
from ..engine.tokens import check_prompt
from ..errors import ConfigError
from ..kv import CacheSpec
from ..sampling.chain import Chain
from ..sampling.constraint import (
    ChoiceScores,
    ConstraintStage,
    choice_probabilities,
    label_encodings,
    stage_allowed_next,
)
from ..sampling.registry import constraint_stage
from ..sampling.semantics import active_stages
from ..sampling.tokens import encode_plain

# options of teacher-forced scoring that mean nothing for labels
NOT_FOR_CHOICES = ("limit", "chunk", "feed", "against", "against_cache")


def check_choice_settings(s) -> None:
    """--choice in score: the label probabilities are the model's own, so no other stage may be set, nor the options
    of teacher-forced scoring (one line naming the first offender)."""
    others = [n for n in active_stages(s) if n != constraint_stage()]
    if others:
        raise ConfigError(f"--choice {s.choice!r}: score gives the labels' probabilities under the model alone "
                          f"(temperature 1); drop the {others[0]} stage")
    for key in NOT_FOR_CHOICES:
        if getattr(s, key, None) is not None:
            raise ConfigError(f"--{key.replace('_', '-')}: applies to teacher-forced scoring of TEXT, not to "
                              "--choice (which scores the labels after TEXT)")
    if not (isinstance(s.min_mass, (int, float)) and 0 <= s.min_mass < 1):
        raise ConfigError(f"--min-mass {s.min_mass}: must be a number in [0, 1) (0 walks every token path)")


class PrefixScorer:
    """log P(tokens | prompt) for token tuples: the conditionals after each distinct prefix come from one forward
    (the prefix fed on top of the prompt's cache, then rolled back), kept as a log-softmax row; the log-probability
    of a tuple is summed from its prefix's (memoized, float64):

        log P(t_1..t_n | x) = log P(t_1..t_{n-1} | x) + log p(t_n | x, t_1..t_{n-1})"""

    def __init__(self, model, prompt_ids: Sequence[int], capacity: int, cache: CacheSpec | None = None):
        device = next(model.parameters()).device
        self.runtime = Runtime.create(model, cache, capacity=capacity, needs=frozenset({"truncate"}))
        self.device, self.prompt_len = device, len(prompt_ids)
        first = self.runtime.prefill(torch.tensor([list(prompt_ids)], dtype=torch.long, device=device))
        self.rows: dict[tuple[int, ...], Tensor] = {(): torch.log_softmax(first[0].float(), dim=-1)}
        self.logp: dict[tuple[int, ...], float] = {(): 0.0}

    @property
    def forwards(self) -> int:
        """Prefixes scored after the prompt (each one forward of its tokens)."""
        return len(self.rows) - 1

    def conditionals(self, prefix: tuple[int, ...]) -> Tensor:
        """[V] log p(. | prompt, prefix)."""
        row = self.rows.get(prefix)
        if row is None:
            ids = torch.tensor([list(prefix)], dtype=torch.long, device=self.device)
            logits = self.runtime.feed(ids)  # [1, V]: after the prompt and the whole prefix
            self.runtime.truncate(self.prompt_len)
            row = self.rows[prefix] = torch.log_softmax(logits[0].float(), dim=-1)
        return row

    def __call__(self, tokens: tuple[int, ...]) -> float:
        tokens = tuple(int(t) for t in tokens)
        if tokens not in self.logp:
            head = self(tokens[:-1])
            self.logp[tokens] = head + float(self.conditionals(tokens[:-1])[tokens[-1]])
        return self.logp[tokens]


@dataclass
class ChoiceReport:
    """The labels' numbers (:class:`~decodelab.core.sampling.constraint.ChoiceScores`) and what it took."""

    scores: ChoiceScores
    token_texts: dict[int, str]  # the text of every token in a listed tokenization
    min_mass: float
    forwards: int  # prefixes scored after the prompt
    seconds: float
    thinking: dict | None = None  # --empty-think: the block closed after the prompt (choice_thinking.py)

    def summary(self) -> dict:
        labels = self.scores.labels
        return {"labels": len(labels), "exact_total": sum(lab.exact for lab in labels),
                "all_paths_total": sum(lab.all_paths for lab in labels), "sampler_lost": self.scores.sampler_lost,
                "sampler_unexplored": self.scores.sampler_unexplored, "min_mass": self.min_mass,
                "forwards": self.forwards, "seconds": self.seconds,
                **({"thinking": self.thinking} if self.thinking is not None else {})}

    def document(self, origin) -> dict:
        """``score --choice``'s JSON document: the head (an :class:`~decodelab.core.engine.run.Origin`), a row per
        label, the summary."""
        return origin.head(choices=self.rows(), summary=self.summary())

    def rows(self) -> list[dict]:
        out = []
        for lab in self.scores.labels:
            out.append({"label": lab.label, "exact": lab.exact, "share": lab.share, "first_token": lab.first_token,
                        "first_token_error": lab.first_token_error, "sampler": lab.sampler,
                        "sampler_error": lab.sampler_error, "all_paths": lab.all_paths,
                        "tokenizations": [{"token_ids": list(t), "tokens": [self.token_texts[i] for i in t],
                                           "probability": p} for t, p in lab.tokenizations]})
        return out


def score_choices(lm: LoadedModel, settings, prompt_text: str, prompt_ids: list[int], chain: Chain,
                  cache: CacheSpec | None = None, thinking: dict | None = None) -> ChoiceReport:
    """The labels of ``settings.choice`` after the prompt (``chain`` is the --choice constraint alone, built by the
    chain builder: its stage gives the allowed tokens of every prefix the sampler walks); ``thinking``: with
    ``--empty-think``, what closed the thinking block (:func:`~.choice_thinking.empty_block`), in the summary."""
    check_prompt(len(prompt_ids), lm.context_length)
    stage = chain.processors[0]
    if not isinstance(stage, ConstraintStage) or stage.spec.kind != "choice":
        raise ConfigError("--choice: score --choice needs the --choice constraint as its only stage")
    start = time.perf_counter()
    encodings = label_encodings(stage.spec.labels, encode_plain(lm), stage.vocabulary.text, prompt=prompt_text)
    longest = max(len(label.encode("utf-8")) for label in stage.spec.labels)  # a token spells >= 1 byte
    scorer = PrefixScorer(lm.model, prompt_ids, len(prompt_ids) + longest + 1, cache)
    with torch.inference_mode():
        scores = choice_probabilities(scorer, encodings, eos_ids=stage.eos_ids, allowed_next=stage_allowed_next(stage),
                                      min_mass=settings.min_mass)
    texts = {t: lm.token_text(t) for toks in encodings.values() for tok in toks for t in tok}
    return ChoiceReport(scores, texts, settings.min_mass, scorer.forwards, time.perf_counter() - start, thinking)

