"""The records a served engine's answers become, and the rules that read its values.

Every number says what it is:

* ``values`` -- ``raw`` (log softmax of the model's logits at temperature 1, before any processor), ``processed``
  (log softmax after the engine's processors: allowed ids, bad words, min_tokens, logit bias, penalties,
  temperature, min-p, top-k, top-p; renormalised over the kept set), or ``raw_logits`` / ``processed_logits``
  (unnormalised logits, where a vLLM server runs with ``--logprobs-mode raw_logits|processed_logits``).
* ``top`` -- the alternatives are the engine's top N only (truncated): each listed value is exact as the
  engine computed it (float32), but the tokens outside the list are unknown; ``tail_mass`` bounds their total
  probability (1 - the listed probabilities' sum).

A prompt position's value in vLLM is always raw (prompt tokens never pass through the sampler): the raw logprob,
or the raw logit when the server runs in a logits mode. Where the facts come from: ``docs/engines.md``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

RAW = "raw"
PROCESSED = "processed"
RAW_LOGITS = "raw_logits"
PROCESSED_LOGITS = "processed_logits"
# vLLM's --logprobs-mode values -> what its numbers are (vllm/config/model.py LogprobsMode)
VLLM_MODES = {"raw_logprobs": RAW, "processed_logprobs": PROCESSED, "raw_logits": RAW_LOGITS,
              "processed_logits": PROCESSED_LOGITS}
LOGPROB_KINDS = (RAW, PROCESSED)  # values that are log-probabilities (sum of exp over the vocabulary is 1)


@dataclass(frozen=True)
class Alternative:
    """One listed candidate at a position: its id and its value (a logprob or a logit, per the result's label)."""

    token_id: int
    logprob: float


@dataclass(frozen=True)
class Position:
    """One token with its value, its rank (the number of tokens at least as likely, so 1 = the most likely; None
    where the engine gave none and the token is outside the listed top N) and the engine's top-N alternatives,
    highest first."""

    index: int  # position in the scored sequence, or step in a generation
    token_id: int
    logprob: float | None  # None: the first prompt token (nothing before it to condition on)
    rank: int | None
    top: tuple[Alternative, ...]
    defects: tuple[str, ...] = ()  # what the engine's answer got wrong here (check-logprobs reports them)

    def tail_mass(self) -> float | None:
        """Probability outside the listed tokens: 1 - sum(exp(top)). An upper bound on any unlisted token's
        probability; meaningful only when the values are logprobs."""
        if not self.top:
            return None
        return max(0.0, 1.0 - math.fsum(math.exp(a.logprob) for a in self.top))


@dataclass(frozen=True)
class Labels:
    """What a result's numbers are: ``values`` (raw / processed / raw_logits / processed_logits), the requested
    top N (truncated: tokens outside it are unknown), and the engine that computed them."""

    values: str
    top_n: int
    engine: str  # vllm, sglang, llamacpp
    exact: bool = True  # each listed number is the engine's own (float32), not an estimate

    def describe(self) -> str:
        return f"{self.values} values from {self.engine}, exact for the listed tokens, top-{self.top_n} truncated"


@dataclass(frozen=True)
class Scored:
    """A token sequence scored teacher-forced: ``positions[i]`` is token i given tokens 0..i-1 (position 0 has no
    logprob)."""

    model: str
    token_ids: tuple[int, ...]
    positions: tuple[Position, ...]
    labels: Labels
    request: dict = field(repr=False)

    @property
    def defects(self) -> tuple[str, ...]:
        return tuple(d for p in self.positions for d in p.defects)


@dataclass(frozen=True)
class Generated:
    """A continuation: each step's sampled token with its value and top-N alternatives."""

    model: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    steps: tuple[Position, ...]
    finish_reason: str | None  # "length", "stop" (EOS or a stop token), ...
    labels: Labels
    request: dict = field(repr=False)
    seconds: float = math.nan  # the request's wall time, sent to answered
    cached_tokens: int | None = None  # prompt tokens the server read from its prefix cache, where it says

    @property
    def defects(self) -> tuple[str, ...]:
        return tuple(d for p in self.steps for d in p.defects)


@dataclass(frozen=True)
class SamplingSettings:
    """Every sampling field a request writes. Defaults are the neutral values (no processor active), never the
    server's: a field left out of a request is filled from the model's generation_config by vLLM."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # divides positive logits, multiplies negative ones, of tokens seen anywhere
    presence_penalty: float = 0.0  # subtracted once from each token generated so far
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int = 5  # top N returned per step
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings (the server matches them on its own detokenised text)
    include_stop_str_in_output: bool = False
    allowed_token_ids: tuple[int, ...] = ()  # an allow-list mask (empty: every token)
    bad_words: tuple[str, ...] = ()  # texts never to produce (the server tokenises them)
    # per server kind, what its body adds to the fields above: every stage of that server's a request does not carry
    # switched off, and its order of those it carries. The sampling registry's (this layer knows no stage): whoever
    # builds the request hands it in (decodelab.core.sampling.export.served_settings, neutral_request)
    neutral: Mapping[str, Mapping[str, object]] = field(default_factory=dict)


def read_value(value: float, masked: float | None) -> float:
    """An engine's value with its stand-in for -inf turned back into -inf."""
    return -math.inf if masked is not None and value <= masked else float(value)


def sorted_top(entries: dict[int, float], n: int) -> tuple[Alternative, ...]:
    """The n highest entries, highest first (ties by token id, as torch.topk's order is not part of any API)."""
    ranked = sorted(entries.items(), key=lambda kv: (-kv[1], kv[0]))
    return tuple(Alternative(t, lp) for t, lp in ranked[:n])


def rank_in_top(token_id: int, logprob: float | None, top: tuple[Alternative, ...]) -> int | None:
    """The number of listed tokens at least as likely (vLLM's rule: ties count against; exact when every token
    tied with it is listed); None when the token is not among them."""
    if logprob is None or all(a.token_id != token_id for a in top):
        return None
    return sum(1 for a in top if a.logprob >= logprob)


def order_defect(keys: list[int], values: dict[int, float], expected_first: int | None) -> str | None:
    """vLLM lists the chosen token first and then the top N; any other order out of rank is a defect."""
    rest = [k for k in keys if k != expected_first] if expected_first is not None else keys
    if any(values[a] < values[b] for a, b in zip(rest, rest[1:])):
        return "top logprobs not sorted (the engine's top-N order is broken)"
    return None

