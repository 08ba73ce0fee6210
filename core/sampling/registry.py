"""The stage registry: every stage of the chain declared once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .biases import AllowList, Ban, MinNewTokens, SequenceBias
from .filters import XTC, EpsilonCutoff, EtaCutoff, MirostatV2, TopNSigma
from .penalties import DRY, FrequencyPenalty, PresencePenalty, WindowedRepetitionPenalty
from .scaling import DynamicTemperature

DEFAULT_ORDER = (
    "allow",
    "softcap",
    "repetition-penalty",
    "frequency-penalty",
    "presence-penalty",
    "dry",
    "no-repeat-ngram",
    "bias",
    "sequence-bias",
    "ban",
    "min-new-tokens",
    "temperature",
    "dynatemp",
    "top-n-sigma",
    "top-k",
    "top-p",
    "min-p",
    "typical-p",
    "epsilon-cutoff",
    "eta-cutoff",
    "xtc",
    "mirostat",
)


# stage name -> factory(value, context); multi-parameter stages take a dict of their fields
NEW_FACTORIES = {
    "allow": lambda v, c: AllowList(tuple(v)),
    "frequency-penalty": lambda v, c: FrequencyPenalty(value=v, **c.scope_of("frequency-penalty")),
    "presence-penalty": lambda v, c: PresencePenalty(value=v, **c.scope_of("presence-penalty")),
    "dry": lambda v, c: DRY(**v),
    "sequence-bias": lambda v, c: SequenceBias(tuple(v)),
    "ban": lambda v, c: Ban(sequences=tuple(v)),
    "min-new-tokens": lambda v, c: MinNewTokens(v, tuple(c.end_ids)),
    "dynatemp": lambda v, c: DynamicTemperature(**v),
    "top-n-sigma": lambda v, c: TopNSigma(v),
    "epsilon-cutoff": lambda v, c: EpsilonCutoff(v),
    "eta-cutoff": lambda v, c: EtaCutoff(v),
    "xtc": lambda v, c: XTC(v["threshold"], v["probability"], c.generator),
    "mirostat": lambda v, c: MirostatV2(**v),
}


@dataclass
class StageContext:
    """What the stages need besides their value, handed in when the chain is built."""

    generator: torch.Generator | None = None  # the run's generator (the selector's): XTC's coin
    end_ids: tuple[int, ...] = ()  # what min-new-tokens bans: EOS (and stop ids where the engine does)
    counting: dict[str, tuple[str, int | None]] = field(default_factory=dict)  # penalty -> (scope, last_n)

    def scope_of(self, name: str) -> dict:
        scope, last_n = self.counting.get(name, ("all", None))
        return {"scope": scope, "last_n": last_n}

    def counts_differently(self, name: str) -> bool:
        return self.counting.get(name, ("all", None)) != ("all", None)

    def windowed_repetition(self, penalty: float) -> WindowedRepetitionPenalty:
        return WindowedRepetitionPenalty(penalty=penalty, **self.scope_of("repetition-penalty"))
