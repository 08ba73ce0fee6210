"""The noise floor of a dtype on a model, and the noise verdict where two runs that should agree part (``compare``,
``batch``, ``sample -N``, ``audit-numerics``).

**The floor** is measured, not assumed: the model runs the text once more with every element of the embeddings and
of each layer's output multiplied by (1 + eps u), u uniform in [-1, 1], eps the machine epsilon of the dtype (a
rounding errs by at most eps / 2 relative: eps is the margin); :data:`FLOOR_FACTOR` times that run's relative error
at each layer is the layer's floor, and :data:`FLOOR_FACTOR` times its largest logit change is the logit floor delta.

**The verdict.** Two runs part at a step: one chose token a, the other b. Rounding moves each logit by at most
delta, so it can swap a and b only if their margin m = z_a - z_b (after the run's chain, when it has one: the
processed logits decide a greedy step) is at most 2 delta: m <= 2 delta is "within numeric noise", m > 2 delta "not
explained by numerics". The margin is in logit units before temperature (a temperature divides margin and rounding
alike; temperature 0 is greedy's argmax). The top-2 margin there is reported beside it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from ..engine import numerics as engine_numerics
from ..engine.numerics import Forced
from ..sampling import registry

FLOOR_FACTOR = 4.0  # the margin over the measured rounding envelope (bf16 against fp32 reaches about 2x of it)
WITHIN = "within numeric noise"
NOT_EXPLAINED = "not explained by numerics"
VERDICT_LIMIT = 8  # divergences given a verdict per command (each costs two forwards of its prefix)


@dataclass
class Floor:
    """The measured rounding envelope of one dtype on this model and text, times FLOOR_FACTOR."""

    dtype: str
    eps: float
    layers: list[float]  # per hidden-state row (0 = embeddings)
    logit: float  # delta: the largest logit change

    @property
    def logprob(self) -> float:
        """What delta can move a log-probability z - logsumexp z (or a margin z_a - z_b) by: 2 delta."""
        return 2 * self.logit


def coarser(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return a if torch.finfo(a).eps >= torch.finfo(b).eps else b


def relative_errors(a: Tensor, b: Tensor) -> list[float]:
    """Per layer row: max over positions of ||a - b||_2 / ||b||_2 (hidden [L + 1, T, H])."""
    num = (a.double() - b.double()).norm(dim=-1)
    den = b.double().norm(dim=-1).clamp_min(1e-30)
    return (num / den).amax(dim=-1).tolist()


def measure_floor(model, ids: list[int], reference: Forced, dtype: torch.dtype) -> Floor:
    """The model with eps-sized noise after every layer (eps of ``dtype``), against ``reference`` (its own forward)."""
    eps = torch.finfo(dtype).eps
    noisy = engine_numerics.perturbed(model, ids, eps)
    layers = [FLOOR_FACTOR * e for e in relative_errors(noisy.hidden, reference.hidden)]
    logit = FLOOR_FACTOR * float((noisy.logits.double() - reference.logits.double()).abs().max())
    return Floor(str(dtype).replace("torch.", ""), eps, layers, logit)


class Floors:
    """Floors measured once per dtype, for one model and text."""

    def __init__(self, model, ids: list[int], reference: Forced):
        self.model, self.ids, self.reference = model, ids, reference
        self._by: dict[torch.dtype, Floor] = {}

    def of(self, dtype: torch.dtype) -> Floor:
        if dtype not in self._by:
            self._by[dtype] = measure_floor(self.model, self.ids, self.reference, dtype)
        return self._by[dtype]

    def measured(self) -> list[Floor]:
        return list(self._by.values())


def top2_margins(logp: Tensor) -> tuple[Tensor, Tensor]:
    """(argmax [T], top-1 minus top-2 [T]) of rows of log-probabilities (or logits)."""
    top = logp.topk(2, dim=-1)
    return top.indices[:, 0], top.values[:, 0] - top.values[:, 1]


@dataclass
class NoiseVerdict:
    step: int  # the generated step where the two runs part
    token_a: int  # the first run's token there
    token_b: int  # the other run's
    margin: float  # z_a - z_b on the first run's prefix (processed by its chain where given)
    top2_margin: float  # top-1 minus top-2 there
    floor: float  # 2 delta: what rounding of this dtype can move a margin by
    dtype: str
    words: str  # "within numeric noise" | "not explained by numerics"

    def to_dict(self) -> dict:
        return asdict(self)


def verdict_words(margin: float, floor: float) -> str:
    """A margin rounding could close is within noise; a larger one is not explained by it."""
    return WITHIN if abs(margin) <= floor else NOT_EXPLAINED


def noise_verdict(lm, prompt_ids: list[int], generated: list[int], step: int, token_b: int, chain=None
                  ) -> NoiseVerdict:
    """Two runs on ``prompt_ids`` agree on ``generated[:step]`` and part at ``step``: the first chose
    ``generated[step]``, the other ``token_b``. The margin between the two on the model's logits after the shared
    prefix (through ``chain``, reset to the prompt, where given) against the floor measured for the model's dtype
    on that prefix."""
    model = lm.model
    prefix = list(prompt_ids) + list(generated[:step])
    reference = engine_numerics.whole(model, prefix)
    floor = measure_floor(model, prefix, reference, next(model.parameters()).dtype)
    z = reference.logits[-1:].float()
    if chain is not None:  # the stages that shift logits; a temperature scales margin and noise alike: left out
        chain.reset(len(prompt_ids))
        ids = torch.tensor([prefix], device=z.device)
        scaling = {st.name for st in registry.STAGES if st.scales}  # temperature 0: greedy, an argmax
        with torch.inference_mode():
            for proc in chain.processors:
                z = z if proc.name in scaling else proc(ids, z)
    z = z[0].double()
    a = int(generated[step])
    _, top2 = top2_margins(z[None])
    margin = float(z[a] - z[token_b])
    return NoiseVerdict(step, a, int(token_b), margin, float(top2[0]), floor.logprob, floor.dtype,
                        verdict_words(margin, floor.logprob))


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first step where two token lists differ at a token both have (None: no such step)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def divergence_verdicts(lm, prompt_ids: list[int], reference: list[int], others: list[tuple[str, list[int]]],
                        chain=None, limit: int = VERDICT_LIMIT) -> list[dict]:
    """For each (label, tokens) that parts from ``reference`` at a token: its noise verdict (the first ``limit``)."""
    out = []
    for label, ids in others:
        d = first_divergence(reference, ids)
        if d is None:
            continue
        if len(out) == limit:
            break
        out.append({"against": label, **noise_verdict(lm, prompt_ids, reference, d, ids[d], chain).to_dict()})
    return out
