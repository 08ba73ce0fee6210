"""The reasoning / answer split of a trace: each generated token's part (:func:`~..sampling.thinking.parts`: the one
rule the constraint and the thinking budget also read) and per-part summaries, for every method that traces tokens.

A part's summary over its tokens i: ``tokens`` (how many), ``mean_logprob`` = mean log p_i (what the method's own
distribution gave the token: processed for sample, the model's for score), ``mean_raw_logprob`` (the model's own,
where the method has both), ``mean_entropy`` = mean H_i in nats of the same distributions, ``mean_raw_entropy`` the
model's. Markers are their own part (``marker``), so neither the reasoning's nor the answer's numbers include them;
``outside`` is text in no block before the answer. A part with no tokens has null means.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..sampling.thinking import PARTS, ThinkTags, answer_start, parse_think_tags, parts, tags_from_template
from ..sampling.tokens import Tokens, think_tags


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite and len(finite) == len(values) else None


@dataclass(frozen=True)
class PartSummary:
    tokens: int
    mean_logprob: float | None
    mean_raw_logprob: float | None
    mean_entropy: float | None
    mean_raw_entropy: float | None = None


@dataclass(frozen=True)
class Reasoning:
    """``parts``: one label per generated token; ``answer_starts_at``: the index (among generated tokens) where the
    answer begins (None: the thinking never ended; 0: the prompt closed it); ``summary``: per part."""

    tags: tuple[str, str]
    parts: list[str]
    answer_starts_at: int | None
    summary: dict[str, PartSummary]

    def to_dict(self) -> dict:
        return {"tags": list(self.tags), "parts": self.parts, "answer_starts_at": self.answer_starts_at,
                "summary": {k: vars(v) for k, v in self.summary.items()}}


def split(prompt_ids: Sequence[int], token_ids: Sequence[int], tags: ThinkTags, tag_texts: tuple[str, str],
          logprobs: Sequence[float | None], entropies: Sequence[float | None] | None = None,
          raw_logprobs: Sequence[float | None] | None = None,
          raw_entropies: Sequence[float | None] | None = None) -> Reasoning:
    """The split of ``token_ids`` generated after ``prompt_ids``; the numbers are per generated token."""
    row = list(prompt_ids) + list(token_ids)
    labels = parts(row, len(prompt_ids), tags)
    a = answer_start(row, len(prompt_ids), tags)

    def pick(values, part):
        return [values[i] for i, lab in enumerate(labels) if lab == part] if values is not None else None

    summary = {}
    for part in PARTS:
        lp, raw, ent, raw_ent = (pick(v, part) for v in (logprobs, raw_logprobs, entropies, raw_entropies))
        summary[part] = PartSummary(sum(lab == part for lab in labels), *(_mean(v) if v else None
                                                                          for v in (lp, raw, ent, raw_ent)))
    return Reasoning(tag_texts, labels, None if a is None else a - len(prompt_ids), summary)


def of_steps(prompt_ids: Sequence[int], steps, tags: ThinkTags, tag_texts: tuple[str, str]) -> Reasoning:
    """The split of a traced run (sample, speculate, stream: steps with logprob, raw_logprob and entropy)."""
    return split(prompt_ids, [s.token_id for s in steps], tags, tag_texts, [s.logprob for s in steps],
                 [s.entropy for s in steps], [s.raw_logprob for s in steps], [s.raw_entropy for s in steps])


def tag_texts(settings, tokenizer) -> tuple[str, str] | None:
    """The marker texts a run uses: --think-tags, else the chat template's (None: no markers)."""
    if getattr(settings, "think_tags", None):
        return parse_think_tags(settings.think_tags)
    return tags_from_template(getattr(tokenizer, "chat_template", None))


def for_run(settings, lm, prompt_ids: Sequence[int], steps) -> dict:
    """``{"reasoning": ...}`` for a run's JSON document when it has markers, else ``{}``."""
    texts = tag_texts(settings, lm.tokenizer)
    if texts is None or not steps:
        return {}
    return {"reasoning": of_steps(prompt_ids, steps, think_tags(settings, Tokens.of(lm)), texts).to_dict()}


def for_score(settings, lm, ids: Sequence[int], steps) -> dict:
    """``{"reasoning": ...}`` for teacher-forced scoring (``score``): the scored tokens are the row after the
    first scored position; log-probabilities are the chain's (processed) and the model's, entropy the model's."""
    texts = tag_texts(settings, lm.tokenizer)
    if texts is None or not steps:
        return {}
    first = steps[0].position
    tokens = [s.token_id for s in steps]
    r = split(ids[:first], tokens, think_tags(settings, Tokens.of(lm)), texts, [s.logprob for s in steps],
              None, [s.raw_logprob for s in steps], [s.raw_entropy for s in steps])
    return {"reasoning": r.to_dict()}


def for_answers(settings, lm, answers) -> list[dict]:
    """check-logprobs: per engine answer whose prompt and tokens have local ids, its split; ``mean_logprob`` is the
    mean of the engine's returned numbers (whatever its logprobs mode made them), the rest null."""
    texts = tag_texts(settings, lm.tokenizer)
    if texts is None:
        return []
    tags = think_tags(settings, Tokens.of(lm))
    out = []
    for n, a in enumerate(answers):
        ids = [t.token_id for t in a.tokens]
        if a.prompt_ids is None or not ids or any(i is None for i in ids):
            continue
        r = split(a.prompt_ids, ids, tags, texts, [t.value for t in a.tokens])
        out.append({"answer": n, **r.to_dict()})
    return out


def for_tokens(settings, lm, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> dict:
    """``{"reasoning": ...}`` for a method whose output has no per-token numbers in one list (speculate's rounds, a
    beam hypothesis): the parts and their token counts; the means are null, never made up."""
    texts = tag_texts(settings, lm.tokenizer)
    if texts is None or not token_ids:
        return {}
    none = [None] * len(token_ids)
    return {"reasoning": split(prompt_ids, token_ids, think_tags(settings, Tokens.of(lm)), texts, none).to_dict()}
