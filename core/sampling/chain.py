"""The chain: stages run in the user's order, and the one builder every caller uses to get one from settings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..engine.models import LoadedModel
from ..errors import ChainError, ConfigError
from ..inputs import check_text
from ..kv import parse_cache_spec
from ..settings import _check
from .biases import LogitBias
from .filters import MinP, TopK, TopP, TypicalP
from .penalties import NoRepeatNGram, RepetitionPenalty
from .registry import DEFAULT_ORDER, NEW_FACTORIES, StageContext
from .scaling import SoftCap, Temperature
from .select import make_generator
from .semantics import Plan, plan
from .semantics import plan as semantics_plan
from .settings import ChainSettings
from .tokens import bias_token_ids, encode_plain, resolve_token_settings


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


def make_chain(lm: LoadedModel, settings: ChainSettings, generator=None) -> Chain:
    """The chain as the settings' semantics reads it (core/semantics.py), token-naming settings resolved with the
    model's tokenizer. ``generator``: the run's (XTC's coin); by default one seeded by --seed."""
    p = semantics_plan(settings)
    bias = bias_token_ids(lm, p.settings.logit_bias)
    _, resolved = resolve_token_settings(replace(p.settings, logit_bias=()), lm.vocab_size, encode=encode_plain(lm),
                                         token_text=lm.token_text)
    if generator is None:
        generator = make_generator(getattr(settings, "seed", 0), lm.device)
    context = p.context(generator, tuple(lm.eos_ids), tuple(getattr(settings, "stop_id", ())))
    return build_chain(p.settings.stage_values(bias, resolved), p.order, context)


def refuse_stepwise_stages(chain: Chain, method: str) -> None:
    """Stages whose output is not a function of the prefix alone (their own coin, or state carried from step to
    step) cannot score several continuations at once."""
    options = {"xtc": "--xtc-probability", "mirostat": "--mirostat-tau/--mirostat-eta"}
    for name in chain.names:
        if name in options:
            raise ConfigError(f"{options[name]}: {method} scores several continuations per step, and {name} draws its "
                              "own coin or carries state from step to step; drop it for this command")


def build(settings: ChainSettings, vocab: int, seed: int, device, eos_ids=(), stop_ids=(), encode=None,
          token_id=None, token_text=None) -> tuple[Plan, Chain, object]:
    """The plan of ``settings``, its chain and its selector, sharing one generator (the selector's draws and XTC's
    coin come from the run's seed). Token-naming settings are resolved with the tokenizer's functions if given."""
    p = plan(settings)
    selector = p.make_selector(seed, device)
    generator = getattr(selector, "generator", None) or make_generator(seed, device)
    bias, resolved = resolve_token_settings(p.settings, vocab, encode, token_id, token_text)
    chain = build_chain(p.settings.stage_values(bias, resolved), p.order, p.context(generator, eos_ids, stop_ids))
    return p, chain, selector


def validate_chain(s: ChainSettings) -> None:
    """The settings as the chosen semantics reads them (:func:`decodelab.core.semantics.plan`: an engine's defaults,
    clamps and off-values first), then the ranges, then the order: building every stage once, each checks its own
    parameters, before any model loads."""

    effective = plan(s)
    validate_chain_ranges(effective.settings)
    check_order(effective.settings, effective.context())
    cache_spec(s)


def validate_chain_ranges(s: ChainSettings) -> None:
    t = s.temperature
    if t is not None:
        _check(math.isfinite(t) and t >= 0, "temperature", t, "must be >= 0 (0 means greedy)")
    if s.top_k is not None:
        _check(s.top_k >= 1, "top_k", s.top_k, "must be an integer >= 1")
    if s.top_p is not None:
        _check(0 < s.top_p <= 1, "top_p", s.top_p, "must be in (0, 1]")
    if s.min_p is not None:
        _check(0 <= s.min_p <= 1, "min_p", s.min_p, "must be in [0, 1]")
    if s.typical_p is not None:
        _check(0 < s.typical_p <= 1, "typical_p", s.typical_p, "must be in (0, 1]")
    if s.softcap is not None:
        _check(math.isfinite(s.softcap) and s.softcap > 0, "softcap", s.softcap, "must be > 0")
    if s.repetition_penalty is not None:
        rp = s.repetition_penalty
        _check(math.isfinite(rp) and rp > 0, "repetition_penalty", rp, "must be > 0 (1 = off)")
    if s.no_repeat_ngram is not None:
        _check(s.no_repeat_ngram >= 1, "no_repeat_ngram", s.no_repeat_ngram, "must be an integer >= 1")
    for token, bias in s.logit_bias:
        check_text("--logit-bias", token)
        _check(not math.isnan(bias), "logit_bias", f"{token}={bias}", "the bias must be a number or -inf")
        _check(bias != math.inf, "logit_bias", f"{token}={bias}", "+inf cannot force a token (every other "
               "candidate would be NaN); use a large finite bias such as 100, or ban the others with -inf")
    if s.penalty_last_n is not None:
        _check(s.penalty_last_n >= 0, "penalty_last_n", s.penalty_last_n, "must be an integer >= 0")
    if s.dynatemp_range is not None:
        _check(s.temperature != 0, "dynatemp_range", s.dynatemp_range,
               "needs a temperature > 0 (-t 0 is greedy); the range is around -t")


def check_order(s: ChainSettings, context=None) -> None:
    """Check --chain against the set stages before any model loads (the bias ids are resolved later)."""

    placeholder_bias = {0: 0.0} if s.logit_bias else None
    build_chain(s.stage_values(placeholder_bias), list(s.chain) if s.chain is not None else None, context)


def cache_spec(s: ChainSettings):
    """The parsed --cache policy (every key and value checked; no model needed)."""

    return parse_cache_spec(s.cache)
