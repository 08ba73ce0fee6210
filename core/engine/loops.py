"""The repetition-detection stop: vLLM's rule (``SamplingParams.repetition_detection``, PR #35451; read in
``vllm/v1/core/sched/utils.py`` ``check_sequence_repetition``; no code taken).

Over the generated tokens g (the prompt is not read), after each new token: with P_min = max(min_pattern_size, 1),
the run stops when some period p in [P_min, max_pattern_size] has p * min_count <= len(g) and the last p * min_count
tokens are min_count copies of the last p tokens:

    g[-(p m + n)] == g[-n]   for n in 1..p, m in 1..min_count-1.

vLLM tries p upwards and returns at the first match, so the period reported is the smallest that repeats. The rule
is off when max_pattern_size <= 0 or min_count < 2 (vLLM's own off values); vLLM refuses min_pattern_size >
max_pattern_size (so does decodelab). vLLM checks it only once min_tokens are generated (decodelab: once
--min-new-tokens are, ``after``) and after the EOS, stop-id and length checks; decodelab checks it last too, after
EOS, stop ids, stop strings, the context and -n, and its stop reason is ``repetition`` (vLLM: finish status
FINISHED_REPETITION, stop_reason "repetition_detected").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ConfigError

KEYS = ("max_pattern_size", "min_count", "min_pattern_size")


@dataclass(frozen=True)
class RepetitionRule:
    max_pattern_size: int
    min_count: int
    min_pattern_size: int = 0
    after: int = 0  # checked once this many tokens are generated (vLLM's min_tokens gates every stop check)

    @property
    def off(self) -> bool:
        return self.max_pattern_size <= 0 or self.min_count < 2

    def period(self, generated: Sequence[int]) -> int | None:
        """The smallest period p whose min_count copies end ``generated`` (module doc), or None."""
        if self.off or len(generated) < self.after:
            return None
        for p in range(max(self.min_pattern_size, 1), self.max_pattern_size + 1):
            if p * self.min_count > len(generated):
                return None
            tail = list(generated[-p:])
            if all(list(generated[len(generated) - p * (m + 1): len(generated) - p * m]) == tail
                   for m in range(1, self.min_count)):
                return p
        return None


def copies(generated: Sequence[int], period: int) -> int:
    """How many whole consecutive copies of the last ``period`` tokens end ``generated`` (>= 1)."""
    tail, n, count = list(generated[-period:]), len(generated), 1
    while n - period * (count + 1) >= 0 and list(generated[n - period * (count + 1): n - period * count]) == tail:
        count += 1
    return count


def parse_repetition_stop(text: str, after: int = 0) -> RepetitionRule:
    """``--repetition-stop max_pattern_size=P,min_count=C[,min_pattern_size=M]`` (vLLM's names); ``after``: the
    run's --min-new-tokens."""
    option = f"--repetition-stop {text!r}"
    values = {}
    for item in text.split(","):
        key, eq, value = item.strip().partition("=")
        if not eq or key.strip() not in KEYS or key.strip() in values:
            raise ConfigError(f"{option}: give max_pattern_size=P,min_count=C (and optionally min_pattern_size=M), "
                              "each once")
        try:
            values[key.strip()] = int(value)
        except ValueError:
            raise ConfigError(f"{option}: {key.strip()} must be an integer") from None
    if "max_pattern_size" not in values or "min_count" not in values:
        raise ConfigError(f"{option}: needs both max_pattern_size and min_count")
    rule = RepetitionRule(**values, after=after)
    if rule.max_pattern_size < 1 or rule.min_count < 2:
        raise ConfigError(f"{option}: max_pattern_size must be >= 1 and min_count >= 2 (vLLM reads smaller values "
                          "as off; leave the option out instead)")
    if rule.min_pattern_size < 0 or rule.min_pattern_size > rule.max_pattern_size:
        raise ConfigError(f"{option}: min_pattern_size must be in [0, max_pattern_size] (0 means 1)")
    return rule
