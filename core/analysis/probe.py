"""A retrieval probe: a fact planted in a long filler text, and the probability each cache policy leaves the answer.

Perplexity averages over every token, and most tokens of a text need nothing from far back, so a policy can evict
the one sentence that matters and keep its perplexity. The probe asks for that sentence.

One trial per (key, depth). With the filler's first F tokens as text, the needle goes in at the token boundary
a = round(depth * F), and the question follows the text:

    context  = encode(filler[:a] + needle(key) + filler[a:])
    question = encode(context text + question)[len(context):]
    answer   = encode(context text + question + " " + key)[len(context) + len(question):]   the key as it follows

Under a policy the context is prefilled in one forward through the runtime (a press compresses it there), the
question is fed in a second forward (it reads what the policy kept: the compression did not know the question, as
when a compressed document is asked about later), then the answer is teacher-forced one token a forward:

    logprob = sum_i log softmax(z_i)[answer_i]       z_i: the logits after context + question + answer[:i]
    right   = every answer_i is the argmax of z_i      (greedy decoding writes the key)

``question_in_prompt`` prefills the question with the context instead (query-aware: SnapKV's observation window
then holds the question; but the first answer token's logits come from that exact prefill forward, so only the
later ones can be hurt).

Two references, both under the full cache: the same trial (a policy is judged only on the trials the full cache
gets right: a model that cannot retrieve the key tells nothing about a policy), and the context without the needle
(``baseline_logprob``: what the model guesses with no fact; logprob - baseline_logprob is what the fact is worth).
For a policy with per-head kept positions (the presses) ``needle_kept`` is the share of (layer, KV head, needle
position) entries it still holds after the context.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field

import torch

from ..engine.runtime import Runtime
from ..errors import ConfigError
from ..kv import CacheSpec, parse_cache_spec
from ..kv.kept import kept_map

NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
DEPTHS = (0.1, 0.5, 0.9)
KEY_DIGITS = 5
MARGIN = 8  # tokens left free at the end of the context besides the answer


@dataclass(frozen=True)
class ProbeSettings:
    keys: tuple[str, ...] = ()  # passkeys; () = two random 5-digit keys from ``seed``
    depths: tuple[float, ...] = DEPTHS  # where the needle goes, as a fraction of the filler
    needle: str = NEEDLE  # {key} is replaced by the key
    question: str = QUESTION
    filler_tokens: int | None = None  # None: as much of the text as fits the context with the needle and question
    seed: int = 0
    question_in_prompt: bool = False  # prefill the question with the context (query-aware compression)


def check_probe(s: ProbeSettings) -> None:
    """Every check that needs no model (one line naming the option)."""
    if "{key}" not in s.needle:
        raise ConfigError(f"probe needle {s.needle!r}: must contain {{key}} (where the key is planted)")
    for depth in s.depths:
        if not 0 <= depth <= 1:
            raise ConfigError(f"--probe-depths {depth}: each depth must be in [0, 1] (a fraction of the filler)")
    if not s.depths:
        raise ConfigError("--probe-depths: give at least one depth in [0, 1]")
    for key in s.keys:
        if not key.strip():
            raise ConfigError("--probe-keys: a key is empty; give keys such as 71432,58210")
    if s.filler_tokens is not None and s.filler_tokens < 1:
        raise ConfigError(f"probe filler_tokens {s.filler_tokens}: the probe needs at least 1 filler token")


def probe_keys(s: ProbeSettings) -> list[str]:
    if s.keys:
        return list(s.keys)
    rng = random.Random(s.seed)
    return ["".join(str(rng.randrange(10)) for _ in range(KEY_DIGITS)) for _ in range(2)]


@dataclass
class Trial:
    key: str
    depth: float
    needle_start: int  # position of the needle's first token
    needle_end: int  # one past its last
    context_ids: list[int] = field(repr=False)  # filler and needle (and the question, with question_in_prompt)
    question_ids: list[int] = field(repr=False)  # fed after the context's compression (empty with question_in_prompt)
    answer_ids: list[int]
    baseline_ids: list[int] = field(repr=False)  # the context without the needle (fed with question_ids)

    def describe(self) -> dict:
        return {"key": self.key, "depth": self.depth, "needle_start": self.needle_start,
                "needle_end": self.needle_end, "context_tokens": len(self.context_ids),
                "question_tokens": len(self.question_ids), "answer_ids": self.answer_ids}


def _plain(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=True))


def _text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def filler_count(tokenizer, filler_ids: list[int], s: ProbeSettings, context: int | None = None) -> int:
    """Filler tokens used: all of them, at most ``filler_tokens``, and few enough that needle, question, answer and
    a margin fit in ``context`` positions."""
    extra = max(len(_plain(tokenizer, s.needle.format(key=k) + s.question + " " + k)) for k in probe_keys(s))
    room = len(filler_ids) if context is None else max(context - extra - MARGIN, 1)
    count = min(len(filler_ids), room, s.filler_tokens or len(filler_ids))
    if count < 1:
        raise ConfigError("--text-file: the probe's filler is empty; give a text to plant the key in")
    return count


def build_trials(tokenizer, filler_ids: list[int], s: ProbeSettings, context: int | None = None) -> list[Trial]:
    """The trials over ``filler_ids`` (the user's text as tokens), fitted to ``context`` positions if given."""
    keys = probe_keys(s)
    count = filler_count(tokenizer, filler_ids, s, context)
    filler = filler_ids[:count]
    trials = []
    for key in keys:
        for depth in s.depths:
            cut = round(depth * count)
            before, after = _text(tokenizer, filler[:cut]), _text(tokenizer, filler[cut:])
            needle = s.needle.format(key=key)
            text = before + needle + after
            ids = _plain(tokenizer, text)
            prompt = _plain(tokenizer, text + s.question)
            with_answer = _plain(tokenizer, text + s.question + " " + key)
            if prompt[: len(ids)] != ids or with_answer[: len(prompt)] != prompt:
                raise ConfigError("probe question: the tokenizer merges the text, the question and the key across "
                                  "their boundaries; start the question with a space and end it in a word")
            question = prompt[len(ids):]
            no_needle = _plain(tokenizer, before + after)
            if s.question_in_prompt:
                ids, question, no_needle = prompt, [], no_needle + question
            trials.append(Trial(key, depth, len(_plain(tokenizer, before)), len(_plain(tokenizer, before + needle)),
                                ids, question, with_answer[len(prompt):], no_needle))
    return trials


@dataclass
class TrialResult:
    policy: str
    key: str
    depth: float
    logprob: float  # sum over the answer's tokens of log P(token | prompt, answer so far)
    token_logprobs: list[float]
    right: bool  # every answer token is the argmax
    needle_kept: float | None = None  # share of (layer, head, needle position) entries held after the prefill


def answer_logprobs(model, context_ids: list[int], question_ids: list[int], answer_ids: list[int],
                    spec: CacheSpec | None):
    """Prefill the context under ``spec`` (one forward: a press compresses it), feed the question (one forward),
    then teacher-force the answer one token a forward. Returns per answer token its log-probability and whether it
    was the argmax (one transfer at the end), and the policy's kept map after the context (None for a policy
    without one)."""
    runtime = Runtime.create(model, spec, capacity=len(context_ids) + len(question_ids) + len(answer_ids))
    device = runtime.device
    answer = torch.tensor([answer_ids], device=device)
    logits = runtime.prefill(torch.tensor([context_ids], device=device))
    after_context = kept_map(runtime.policy, len(context_ids))
    if question_ids:
        logits = runtime.feed(torch.tensor([question_ids], device=device))
    rows = []
    for i, token in enumerate(answer_ids):
        if i:
            logits = runtime.feed(answer[:, i - 1 : i])
        lp = torch.log_softmax(logits[0].float(), dim=-1)
        rows.append(torch.stack([lp[token], (lp.argmax() == token).float()]))
    host = torch.stack(rows).tolist()  # the trial's one transfer
    return [r[0] for r in host], [bool(r[1]) for r in host], after_context


def needle_share(kept, start: int, end: int) -> float | None:
    """Share of (layer, head, needle position) entries the kept map holds."""
    if kept is None or end <= start:
        return None
    held = kept.kept_by()
    return sum(held[start:end]) / (kept.pairs() * (end - start))


def run_trial(model, trial: Trial, spec: CacheSpec, label: str | None = None) -> TrialResult:
    lps, right, kept = answer_logprobs(model, trial.context_ids, trial.question_ids, trial.answer_ids, spec)
    return TrialResult(label or str(spec), trial.key, trial.depth, sum(lps), lps, all(right),
                       needle_share(kept, trial.needle_start, trial.needle_end))


@dataclass
class PolicyProbe:
    """One policy over every trial."""

    policy: str
    trials: int
    judged: int  # trials the full cache gets right
    right: int  # of the judged trials, those this policy gets right
    accuracy: float | None  # right / judged (None: the full cache gets no trial right, nothing to judge)
    mean_logprob: float  # mean over all trials of the answer's log-probability
    mean_answer_prob: float  # mean over all trials of exp(logprob)
    needle_kept: float | None  # mean over the trials (presses only)
    results: list[TrialResult] = field(default_factory=list, repr=False)


def summarize(policy: str, results: list[TrialResult], full: list[TrialResult]) -> PolicyProbe:
    judged = [r for r, f in zip(results, full) if f.right]
    right = sum(r.right for r in judged)
    kept = [r.needle_kept for r in results if r.needle_kept is not None]
    return PolicyProbe(policy, len(results), len(judged), right, right / len(judged) if judged else None,
                       sum(r.logprob for r in results) / len(results),
                       sum(math.exp(r.logprob) for r in results) / len(results),
                       sum(kept) / len(kept) if kept else None, results)


@dataclass
class ProbeReport:
    trials: list[Trial]
    full: PolicyProbe
    baseline_logprobs: list[float]  # per trial: the answer's log-probability without the needle (full cache)
    policies: list[PolicyProbe] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        if self.full.judged == self.full.trials:
            return "the full cache retrieves every key: the policies are judged on every trial"
        if self.full.judged:
            return f"the full cache retrieves {self.full.judged} of {self.full.trials} keys: policies are judged on those"
        return ("the full cache retrieves no key: this model does not copy the key from its context, so the probe "
                "cannot judge a policy (its accuracy is null)")

    def baseline_mean(self) -> float:
        return sum(self.baseline_logprobs) / len(self.baseline_logprobs)

    def document(self) -> dict:
        """The ``probe`` object of a JSON document: the trials (with every policy's result) and each policy over
        them."""
        trials = []
        everyone = [self.full] + self.policies
        for i, trial in enumerate(self.trials):
            results = [{"policy": p.policy, "logprob": p.results[i].logprob,
                        "token_logprobs": p.results[i].token_logprobs, "right": p.results[i].right,
                        "needle_kept": p.results[i].needle_kept} for p in everyone]
            trials.append({**trial.describe(), "baseline_logprob": self.baseline_logprobs[i], "results": results})
        return {"verdict": self.verdict, "trials": trials, "policies": [without_results(p) for p in everyone]}

    def summary(self) -> dict:
        """The probe's summary for one policy (the first of ``policies``) against the full cache."""
        policy = self.policies[0]
        return {"policy": policy.policy, "trials": policy.trials, "judged": policy.judged, "right": policy.right,
                "accuracy": policy.accuracy, "full_accuracy": self.full.accuracy,
                "mean_logprob": policy.mean_logprob, "full_mean_logprob": self.full.mean_logprob,
                "baseline_mean_logprob": self.baseline_mean(), "needle_kept": policy.needle_kept}


def without_results(probe: PolicyProbe) -> dict:
    """A policy's figures over the trials, without its per-trial results (the trials list those)."""
    return {k: v for k, v in asdict(probe).items() if k != "results"}


class Prober:
    """The probe over one filler: ``full()`` first (the reference), then ``policy(spec)`` per policy."""

    def __init__(self, model, tokenizer, filler_ids: list[int], settings: ProbeSettings, context: int | None = None):
        check_probe(settings)
        self.model = model
        self.filler_tokens = filler_count(tokenizer, filler_ids, settings, context)
        self.trials = build_trials(tokenizer, filler_ids, settings, context)
        self._full: list[TrialResult] | None = None

    def full(self) -> list[TrialResult]:
        if self._full is None:
            self._full = [run_trial(self.model, t, parse_cache_spec("full")) for t in self.trials]
        return self._full

    def baseline(self) -> list[float]:
        return [sum(answer_logprobs(self.model, t.baseline_ids, t.question_ids, t.answer_ids, None)[0])
                for t in self.trials]

    def policy(self, spec: CacheSpec, label: str | None = None) -> PolicyProbe:
        if spec.name == "full":  # the reference itself, already run
            results = self.full()
        else:
            results = [run_trial(self.model, t, spec, label) for t in self.trials]
        return summarize(label or str(spec), results, self.full())

    def report(self, specs: list[CacheSpec], labels: list[str] | None = None) -> ProbeReport:
        """Every trial under the full cache, without the needle, and under each spec (labelled as given)."""
        full = summarize("full", self.full(), self.full())
        labels = labels or [str(s) for s in specs]
        return ProbeReport(self.trials, full, self.baseline(), [self.policy(s, k) for s, k in zip(specs, labels)])
