"""Context reuse: one context compressed once, then several different questions asked of the same compressed cache
(KVzip, arXiv 2505.23416: query-aware presses degrade when a compressed context is asked a question other than the
one it was compressed for; query-free ones do not depend on the question).

The context holds K facts (needles) planted at even depths of a filler text, fact i naming its own key:

    fact(i)     = " The pass key of {name_i} is {key_i}."
    question(i) = " What is the pass key of {name_i}? The pass key of {name_i} is"      answer(i) = " {key_i}"

Under a policy the context and the FIRST question are prefilled in one forward: a press compresses there, and a
query-aware one (SnapKV's observation window) sees that first question, as when a document is compressed for the
question that came with it. The compressed cache is then copied once per question (the copies are exact: the same
tensors, so every question is asked of the same compressed state), and question i is fed after it (question 1 again:
it has been read, now it is asked) and its answer teacher-forced one token a forward:

    logprob(i) = sum_t log softmax(z_t)[answer_t]        right(i) = every answer_t is the argmax of z_t

The full cache runs the same forwards (the reference). ``first`` is question 1's result (the question the
compression saw), ``others`` the mean over questions 2..K: for a query-aware press the gap between them is the cost
of reuse; for a query-free press it is noise.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch

from ..engine.runtime import Runtime
from ..errors import ConfigError
from ..kv import CacheSpec, parse_cache_spec

NAMES = ("Alice", "Bruno", "Chiara", "Dmitri", "Esther", "Farid", "Greta", "Hiro")
FACT = " The pass key of {name} is {key}."
QUESTION = " What is the pass key of {name}? The pass key of {name} is"


@dataclass(frozen=True)
class Fact:
    name: str
    key: str


@dataclass
class ReuseCase:
    """The context (filler with every fact), and per fact its question and answer ids."""

    facts: list[Fact]
    context_ids: list[int] = field(repr=False)
    question_ids: list[list[int]] = field(repr=False)
    answer_ids: list[list[int]] = field(repr=False)


def facts_for(count: int, seed: int = 0) -> list[Fact]:
    if not 2 <= count <= len(NAMES):
        raise ConfigError(f"--reuse {count}: ask between 2 and {len(NAMES)} questions of one compressed context")
    rng = torch.Generator().manual_seed(seed)
    keys = torch.randint(10_000, 100_000, (count,), generator=rng).tolist()
    return [Fact(NAMES[i], str(k)) for i, k in enumerate(keys)]


def build_case(tokenizer, filler_ids: list[int], count: int, context: int | None = None) -> ReuseCase:
    """Facts at depths (i + 1) / (K + 1) of the filler, the filler cut so that context, a question and its answer
    fit ``context`` positions."""
    facts = facts_for(count)

    def plain(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=True))

    def text_of(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    extra = sum(len(plain(FACT.format(name=f.name, key=f.key))) for f in facts)
    extra += 2 * max(len(plain(QUESTION.format(name=f.name) + " " + f.key)) for f in facts) + 8
    room = len(filler_ids) if context is None else context - extra
    filler = filler_ids[: max(room, 0)]
    if len(filler) < count + 1:
        raise ConfigError("--text-file: too short a filler to plant the facts in; give a longer text")
    cuts = [round((i + 1) * len(filler) / (count + 1)) for i in range(count)]
    pieces, last = [], 0
    for cut, fact in zip(cuts, facts):
        pieces += [text_of(filler[last:cut]), FACT.format(name=fact.name, key=fact.key)]
        last = cut
    text = "".join(pieces) + text_of(filler[last:])
    context_ids = plain(text)
    questions, answers = [], []
    for fact in facts:
        asked = plain(text + QUESTION.format(name=fact.name))
        answered = plain(text + QUESTION.format(name=fact.name) + " " + fact.key)
        if asked[: len(context_ids)] != context_ids or answered[: len(asked)] != asked:
            raise ConfigError("reuse: the tokenizer merges the text, a question and its key across their boundaries")
        questions.append(asked[len(context_ids):])
        answers.append(answered[len(asked):])
    return ReuseCase(facts, context_ids, questions, answers)


@dataclass
class Answer:
    name: str
    logprob: float
    right: bool


@dataclass
class ReuseRow:
    policy: str
    answers: list[Answer]
    stored: int  # positions the compressed cache holds after the context and the first question

    @property
    def first(self) -> Answer:
        return self.answers[0]

    def others_logprob(self) -> float:
        rest = self.answers[1:]
        return sum(a.logprob for a in rest) / len(rest)

    def others_right(self) -> float:
        rest = self.answers[1:]
        return sum(a.right for a in rest) / len(rest)

    def row(self) -> dict:
        return {"policy": self.policy, "stored": self.stored, "first_logprob": self.first.logprob,
                "first_right": self.first.right, "others_logprob": self.others_logprob(),
                "others_right": self.others_right(), "reuse_gap": self.first.logprob - self.others_logprob(),
                "answers": [{"name": a.name, "logprob": a.logprob, "right": a.right} for a in self.answers]}


def ask(runtime: Runtime, question: list[int], answer: list[int]) -> tuple[float, bool]:
    """Feed the question, then teacher-force the answer one token a forward: (sum of log-probabilities, every token
    the argmax); one transfer at the end."""
    device = runtime.device
    logits = runtime.feed(torch.tensor([question], device=device))
    rows = []
    for i, token in enumerate(answer):
        if i:
            logits = runtime.feed(torch.tensor([[answer[i - 1]]], device=device))
        lp = torch.log_softmax(logits[0].float(), dim=-1)
        rows.append(torch.stack([lp[token], (lp.argmax() == token).float()]))
    host = torch.stack(rows).tolist()
    return sum(r[0] for r in host), all(r[1] for r in host)


def reuse_row(model, case: ReuseCase, spec: CacheSpec, label: str | None = None,
              asked: list[int] | None = None) -> ReuseRow:
    """Compress once (context + first question in one forward), then each question (``asked``: their indices, all
    by default) asked of its own copy of it."""
    asked = list(range(len(case.facts))) if asked is None else asked
    longest = max(len(q) + len(a) for q, a in zip(case.question_ids, case.answer_ids))
    capacity = len(case.context_ids) + len(case.question_ids[0]) + longest
    compressed = Runtime.create(model, spec, capacity=capacity)
    compressed.feed(torch.tensor([case.context_ids + case.question_ids[0]], device=compressed.device))  # one forward
    stored = compressed.policy.stored
    answers = []
    for i in asked:
        copy_ = Runtime(model, copy.deepcopy(compressed.policy))  # the same compressed state, for this question
        logprob, right = ask(copy_, case.question_ids[i], case.answer_ids[i])
        answers.append(Answer(case.facts[i].name, logprob, right))
    return ReuseRow(label or str(spec), answers, stored)


def reuse_rows(model, case: ReuseCase, specs: dict[str, CacheSpec]) -> list[ReuseRow]:
    """The full cache first (the reference), then each policy (label -> spec)."""
    rows = [reuse_row(model, case, parse_cache_spec("full"), "full")]
    return rows + [reuse_row(model, case, spec, label) for label, spec in specs.items() if spec.name != "full"]


def ranked(rows: list[ReuseRow]) -> list[ReuseRow]:
    """Policies by the mean log-probability of the questions the compression did not see (best first), the full
    cache kept first."""
    full, rest = rows[:1], rows[1:]
    return full + sorted(rest, key=lambda r: -r.others_logprob() if math.isfinite(r.others_logprob()) else math.inf)
