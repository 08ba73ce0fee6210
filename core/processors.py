"""Logit processors and the chain that runs them in the user's order.

A processor maps ``(ids, logits) -> logits`` for a batch: ``ids`` is ``[B, T]`` (prompt and generated tokens so
far), ``logits`` is ``[B, V]``. It is pure: it returns a new tensor and never edits its input. Filters remove a
candidate by setting its logit to ``-inf``; a removed candidate stays removed through every later stage.

Default order (``DEFAULT_ORDER``), used unless ``--chain`` names another (the stages of
:mod:`decodelab.core.samplers` in brackets):

    [allow] -> softcap -> repetition-penalty -> [frequency-penalty -> presence-penalty -> dry] -> no-repeat-ngram
    -> bias -> [sequence-bias -> ban -> min-new-tokens] -> temperature [or dynatemp] -> [top-n-sigma] -> top-k
    -> top-p -> min-p -> typical-p -> [epsilon-cutoff -> eta-cutoff -> xtc -> mirostat]

Soft-capping first because it reshapes the model's own output (as Gemma 2 does inside the model); penalties and
bias act on (capped) logits; temperature rescales before the truncation filters, so the filters see the tempered
distribution (as transformers does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from .errors import ChainError, ConfigError
from .trace import StageStat

NEG_INF = float("-inf")

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


class LogitProcessor(Protocol):
    name: str

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor: ...


def log_softmax(logits: Tensor) -> Tensor:
    """log p_i = z_i - m - log sum_j exp(z_j - m), m = max z: finite for logits of +-1e4, exactly -inf for -inf."""
    return torch.log_softmax(logits.float(), dim=-1)


def softmax(logits: Tensor) -> Tensor:
    """p_i = exp(z_i - m) / sum_j exp(z_j - m), m = max z (torch subtracts the max; -inf gives exactly 0)."""
    return torch.softmax(logits.float(), dim=-1)


def entropy(probs: Tensor) -> Tensor:
    """H = -sum p log p in nats, with 0 log 0 = 0."""
    return torch.special.entr(probs).sum(dim=-1)


@dataclass
class LogitBias:
    """z_t += b_t for each biased token t (b = -inf bans t)."""

    bias: dict[int, float]
    name: str = "bias"

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        out = logits.clone()
        for token_id, value in self.bias.items():
            out[..., token_id] += value
        return out


@dataclass
class SoftCap:
    """z -> c * tanh(z / c): every logit ends in (-c, c); removed candidates (-inf) stay removed."""

    cap: float
    name: str = "softcap"

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        capped = self.cap * torch.tanh(logits / self.cap)
        return torch.where(torch.isneginf(logits), logits, capped)


@dataclass
class RepetitionPenalty:
    """For every token already in the sequence: z / theta if z > 0, else z * theta (CTRL, Keskar et al. 2019)."""

    penalty: float
    name: str = "repetition-penalty"
    reads_ids = True

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        seen = torch.gather(logits, 1, ids)
        penalized = torch.where(seen > 0, seen / self.penalty, seen * self.penalty)
        return logits.scatter(1, ids, penalized)


@dataclass
class NoRepeatNGram:
    """Ban every token that would complete an n-gram already present in the sequence."""

    n: int
    name: str = "no-repeat-ngram"
    reads_ids = True

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        length = ids.shape[1]
        if length < self.n:  # no complete n-gram yet, so nothing to ban (n-1 tokens would give unfold nothing)
            return logits.clone()
        out = logits.clone()
        if self.n == 1:
            return out.scatter(1, ids, NEG_INF)
        grams = ids.unfold(1, self.n, 1)  # [B, G, n]: every n-gram seen so far
        tail = ids[:, length - self.n + 1 :]  # the n-1 tokens a new n-gram would start with
        matches = (grams[:, :, :-1] == tail[:, None, :]).all(dim=-1)  # [B, G]
        for row in range(ids.shape[0]):
            banned = grams[row, matches[row], -1]
            out[row, banned] = NEG_INF
        return out


@dataclass
class Temperature:
    """z -> z / T. T = 0 is greedy: only the arg-max survives, so the processed distribution is a point mass."""

    temperature: float
    name: str = "temperature"

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        if self.temperature == 0:
            best = logits.argmax(dim=-1, keepdim=True)
            return torch.full_like(logits, NEG_INF).scatter(1, best, logits.gather(1, best))
        return logits / self.temperature


@dataclass
class TopK:
    """Keep the k largest logits (and any tied with the k-th)."""

    k: int
    name: str = "top-k"

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        k = min(self.k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]
        return logits.masked_fill(logits < kth, NEG_INF)


def _keep_sorted_prefix(logits: Tensor, order: Tensor, keep_sorted: Tensor) -> Tensor:
    """Scatter a keep-mask computed over ``order`` (all or the first few ids by rank) back to vocabulary order;
    every id not kept there is masked."""
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter(1, order, keep_sorted)
    return logits.masked_fill(~keep, NEG_INF)


@dataclass
class TopP:
    """Nucleus: keep the smallest set of most likely tokens whose mass reaches p.

    Sorted by probability, token i is kept iff the mass strictly before it, sum_{j<i} p_j, is below p.
    """

    p: float
    name: str = "top-p"
    head: int = 256  # rank only the most likely `head` tokens when they already hold mass p (no full sort)

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        if self.p >= 1.0:  # the whole distribution; no float cumsum may drop underflowed tails
            return logits.clone()
        full = softmax(logits)
        probs, order = full.topk(min(self.head, full.shape[-1]), dim=-1)
        if probs.shape[-1] < full.shape[-1] and bool((probs.sum(dim=-1) < self.p).any()):
            probs, order = full.sort(dim=-1, descending=True)
        mass_before = probs.cumsum(dim=-1) - probs
        keep = mass_before < self.p
        keep[..., 0] = True
        return _keep_sorted_prefix(logits, order, keep)


@dataclass
class MinP:
    """Keep tokens with p_i >= min_p * max_j p_j."""

    min_p: float
    name: str = "min-p"

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        probs = softmax(logits)
        threshold = self.min_p * probs.amax(dim=-1, keepdim=True)
        return logits.masked_fill(probs < threshold, NEG_INF)


@dataclass
class TypicalP:
    """Locally typical sampling (Meister et al. 2022).

    Rank tokens by |(-log p_i) - H|, the distance of their surprisal from the entropy H, and keep the smallest
    prefix of that ranking whose mass reaches the given mass.
    """

    mass: float
    name: str = "typical-p"

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        logp = log_softmax(logits)
        probs = logp.exp()
        h = entropy(probs).unsqueeze(-1)
        distance = torch.where(torch.isneginf(logp), torch.inf, (-logp - h).abs())
        order = distance.argsort(dim=-1, stable=True)
        sorted_probs = probs.gather(1, order)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep = mass_before < self.mass
        keep[..., 0] = True
        return _keep_sorted_prefix(logits, order, keep)


def stage_table(stages: list[tuple[str, Tensor]]) -> list[tuple[StageStat, Tensor]]:
    """Per stage (row 0 of each [1, V] logits): candidates kept, entropy after it, and the probability mass
    (under the distribution before it) of the candidates it removed; with that stage's probabilities.
    Computed together on the device (:func:`decodelab.core.stats.stage_stats`), read in one transfer."""
    from .stats import stage_probs_and_stats

    probs, stats = stage_probs_and_stats(stages)
    host = stats.tolist()
    return [(StageStat(name, int(k), h, m), probs[i]) for i, ((name, _), (k, h, m)) in enumerate(zip(stages, host))]


@dataclass
class Chain:
    """Processors run in order; optionally records per-stage (kept, entropy, mass_removed)."""

    processors: list

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.processors]

    @property
    def uses_ids(self) -> bool:
        """Whether a stage reads the prefix ids (then each position needs its own prefix)."""
        return any(getattr(p, "reads_ids", False) for p in self.processors)

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        logits = self.apply(ids, logits)
        check_not_empty(logits, self.names)
        return logits

    def apply(self, ids: Tensor, logits: Tensor) -> Tensor:
        """The chain without the emptiness check (the decode loop checks the selected token instead)."""
        for proc in self.processors:
            logits = proc(ids, logits)
        return logits

    def reset(self, prompt_len: int) -> None:
        """Before a run: stages that count only generated tokens, or hold state, learn where the prompt ends."""
        for proc in self.processors:
            if hasattr(proc, "reset"):
                proc.reset(prompt_len)

    def accept(self, token: Tensor) -> None:
        """After each step: stages with state (mirostat's mu) see the selected token [B] (on the device)."""
        for proc in self.processors:
            if hasattr(proc, "accept"):
                proc.accept(token)

    @property
    def stateful(self) -> bool:
        """Whether some stage carries state from one step to the next (then every step must be accepted in order:
        methods that score several continuations at once refuse such a chain)."""
        return any(hasattr(proc, "accept") for proc in self.processors)

    def states(self) -> list[tuple[str, Tensor]]:
        """Per-step numbers of the stages that have them ("mirostat.mu", "xtc.coin", "dynatemp.temperature"),
        each a [B] tensor on the device: the values this step used."""
        out = []
        for proc in self.processors:
            for key, value in (proc.state() if hasattr(proc, "state") else {}).items():
                out.append((f"{proc.name}.{key}", value))
        return out

    def run_recorded(self, ids: Tensor, logits: Tensor) -> tuple[Tensor, list[tuple[str, Tensor]]]:
        """Like __call__, also returns each stage's logits (for probs) in order, starting with the raw ones."""
        stages = [("raw", logits)]
        for proc in self.processors:
            logits = proc(ids, logits)
            stages.append((proc.name, logits))
        return logits, stages


def check_not_empty(logits: Tensor, names: list[str]) -> None:
    """A chain that leaves no finite logit in a row has no distribution to draw from."""
    empty = torch.isneginf(logits).all(dim=-1) | torch.isnan(logits).any(dim=-1)
    if bool(empty.any()):
        raise empty_chain_error(names, logits)


def empty_chain_error(names: list[str], logits: Tensor | None = None) -> ChainError:
    """Why a row has no distribution: every candidate removed (-inf), or a value that overflowed float32 (+inf, or
    NaN from inf - inf), which the softmax cannot normalise."""
    chain = f"the chain [{', '.join(names)}]"
    if logits is not None and bool((torch.isnan(logits) | torch.isposinf(logits)).any()):
        return ChainError(f"{chain} made a logit overflow to +inf or NaN: a value too extreme for float32 (such as a "
                          "--temperature or --repetition-penalty near 0); use a less extreme value")
    return ChainError(f"{chain} removed every candidate token; loosen the filters or bans")


def build_chain(settings: dict, order: list[str] | None = None, context=None) -> Chain:
    """Build a chain from resolved processor settings (name -> value; None or absent = stage off).

    ``order`` is the user's ``--chain``; every configured stage must appear in it, and it may name only
    configured stages, so nothing is silently dropped or added. ``context`` (a
    :class:`decodelab.core.samplers.StageContext`) hands the stages of :mod:`decodelab.core.samplers` what they need
    besides their value: the run's generator, the end ids, which tokens each penalty counts.
    """
    from .samplers import NEW_FACTORIES, StageContext

    context = context or StageContext()
    factories = {
        "softcap": SoftCap,
        "repetition-penalty": RepetitionPenalty,
        "no-repeat-ngram": NoRepeatNGram,
        "bias": LogitBias,
        "temperature": Temperature,
        "top-k": TopK,
        "top-p": TopP,
        "min-p": MinP,
        "typical-p": TypicalP,
    }
    factories.update({name: (lambda value, _n=name: NEW_FACTORIES[_n](value, context)) for name in NEW_FACTORIES})
    if context.counts_differently("repetition-penalty"):  # a window, or the output only
        factories["repetition-penalty"] = lambda value: context.windowed_repetition(value)
    active = [name for name in DEFAULT_ORDER if settings.get(name) is not None]
    if order is None:
        order = active
    else:
        unknown = [n for n in order if n not in factories]
        if unknown:
            raise ConfigError(f"--chain: unknown stage {unknown[0]!r}; allowed: {', '.join(DEFAULT_ORDER)}")
        if len(set(order)) != len(order):
            raise ConfigError("--chain: a stage is named twice")
        unset = [n for n in order if n not in active]
        if unset:
            raise ConfigError(f"--chain names {unset[0]!r} but that stage has no value set; set it or drop it")
        missing = [n for n in active if n not in order]
        if missing:
            raise ConfigError(f"--chain leaves out {missing[0]!r}, which is set; add it to --chain or unset it")
    return Chain([factories[name](settings[name]) for name in order])
