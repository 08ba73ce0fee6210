"""When a run stops: the rules (``-n``, EOS, stop strings, stop ids, the context) and the checker every loop asks
after each token, and how a stop string is trimmed from the text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ConfigError
from .loops import RepetitionRule, parse_repetition_stop
from .models import LoadedModel

# -n at most where no context bounds the run (stream past the context, a model that states none): the token buffer
# holds prompt + -n ids, allocated up front (8 bytes each); a huge -n with a context just runs to the context
MAX_NEW_TOKENS = 2**24

# --- stopping --------------------------------------------------------------------------------------------------


@dataclass
class StopRules:
    """When generation ends: an EOS id (unless ignored), a stop string in the generated text, -n, or the context."""

    max_new_tokens: int
    eos_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    context_length: int | None = None
    stop_ids: tuple[int, ...] = ()  # token ids that end the run like a stop string (--stop-id; not ignored)
    repetition: RepetitionRule | None = None  # --repetition-stop (vLLM's repetition_detection; engine/loops.py)

    def capacity(self, prompt_len: int) -> int:
        """Positions a run can fill: the prompt and -n new tokens, never past the context (a huge -n allocates no
        more than the context)."""
        total = prompt_len + self.max_new_tokens
        return total if self.context_length is None else max(prompt_len, min(total, self.context_length))


class StopChecker:
    """Checks one appended token at a time, in this order: eos, stop id, stop string, context, length, repetition.

    A stop string is looked for only in the text of the newest tokens: a match that does not involve the newest
    token would have stopped the run earlier. Each token is at least one byte and a character at most four, so
    the last 4 * (longest stop string) + 4 tokens cover every match that ends in the newest token; the cost per
    token is constant, not the length of the text so far.
    """

    def __init__(self, rules: StopRules, detok: Callable[[list[int]], str] | None = None):
        self.rules = rules
        self.eos = frozenset(() if rules.ignore_eos else rules.eos_ids)
        self.stop_ids = frozenset(rules.stop_ids)
        self.strings = tuple(s for s in rules.stop_strings if s) if detok is not None else ()
        self.detok = detok
        self.window = 4 * max((len(s) for s in self.strings), default=0) + 4

    def check(self, new_ids: list[int], length: int) -> str | None:
        """``new_ids``: generated so far (the newest last); ``length``: the whole sequence, prompt included."""
        if new_ids[-1] in self.eos:
            return "eos"
        if new_ids[-1] in self.stop_ids:
            return "stop"
        if self.strings:
            tail = self.detok(new_ids[-self.window :])
            if any(s in tail for s in self.strings):
                return "stop"
        if self.rules.context_length is not None and length >= self.rules.context_length:
            return "context"
        if len(new_ids) >= self.rules.max_new_tokens:
            return "length"
        if self.rules.repetition is not None and self.rules.repetition.period(new_ids) is not None:
            return "repetition"
        return None


def trim_stop(new_ids: list[int], stop_reason: str, rules: StopRules,
              detok: Callable[[list[int]], str]) -> tuple[list[int], str]:
    """``--trim-stop``: the generated ids and text without what stopped the run. A stop id is dropped from both; a
    stop string is cut from the text at its first occurrence (with whatever followed it in the last token), and
    the ids stay as generated (the string may end inside a token)."""
    if stop_reason == "stop" and new_ids and new_ids[-1] in set(rules.stop_ids):
        return new_ids[:-1], detok(new_ids[:-1])
    text = detok(new_ids)
    if stop_reason != "stop":
        return new_ids, text
    hits = [text.find(s) for s in rules.stop_strings if s and s in text]
    return new_ids, text[: min(hits)] if hits else text


def check_unbounded(max_new_tokens: int, why: str) -> None:
    """-n for a run no context bounds (``why`` says which)."""
    if max_new_tokens > MAX_NEW_TOKENS:
        raise ConfigError(f"--max-new-tokens {max_new_tokens}: {why}, so the run holds every token; at most "
                          f"{MAX_NEW_TOKENS}")


def stop_rules(lm: LoadedModel, settings, max_new_tokens: int | None = None) -> StopRules:
    if lm.context_length is None:
        check_unbounded(max_new_tokens or settings.max_new_tokens, f"{lm.name!r} states no context length")
    repetition = getattr(settings, "repetition_stop", None)
    return StopRules(max_new_tokens or settings.max_new_tokens, tuple(lm.eos_ids), tuple(getattr(settings, "stop", ())),
                     settings.ignore_eos, lm.context_length, tuple(getattr(settings, "stop_id", ())),
                     parse_repetition_stop(repetition, getattr(settings, "min_new_tokens", None) or 0)
                     if repetition else None)
