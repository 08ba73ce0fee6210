"""What a stage is: ``(ids [B, T], logits [B, V]) -> logits``, pure (never edits its input), removal = -inf; stateful
stages add ``reset(prompt_len)`` / ``accept(token)`` / ``state()``. Plus the checks stages share for their
parameters (one line naming the option).
"""

from __future__ import annotations

import math
from typing import Protocol

from torch import Tensor

from ..errors import ConfigError


class LogitProcessor(Protocol):
    name: str

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor: ...


def _bad(option: str, value, allowed: str) -> ConfigError:
    return ConfigError(f"{option} {value}: {allowed}")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


# --- building the stages ---------------------------------------------------------------------------------------


