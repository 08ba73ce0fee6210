"""The chain: stages run in the user's order, and the one builder every caller uses to get one from settings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..engine.models import LoadedModel
from ..errors import ChainError, ConfigError
from ..inputs import check_text
from ..settings import _check
from . import biases, constraint, filters, llamacpp, penalties, scaling  # noqa: F401  (each binds its classes)
from . import thinking  # noqa: F401  (binds the thinking-budget stage)
from .registry import BY_NAME, StageContext, check_range, params
from .select import make_generator
from .semantics import Plan, default_order, plan
from .settings import ChainSettings
from .tokens import Tokens, resolve


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


def build_chain(values: dict, order: list[str] | None = None, context: StageContext | None = None) -> Chain:
    """Build a chain from stage values (name -> constructor value; None or absent = stage off), each stage made by
    its registry entry.

    ``order`` is the user's ``--chain``; every configured stage must appear in it, and it may name only configured
    stages, so nothing is silently dropped or added. ``context`` hands the stages what they need besides their
    value: the run's generator, the end ids, which tokens each penalty counts.
    """
    context = context or StageContext()
    default = default_order()  # the registry's rows as they are now: a new row takes part
    active = [name for name in default if values.get(name) is not None]
    if order is None:
        order = active
    else:
        unknown = [n for n in order if n not in BY_NAME]
        if unknown:
            raise ConfigError(f"--chain: unknown stage {unknown[0]!r}; allowed: {', '.join(default)}")
        if len(set(order)) != len(order):
            raise ConfigError("--chain: a stage is named twice")
        unset = [n for n in order if n not in active]
        if unset:
            raise ConfigError(f"--chain names {unset[0]!r} but that stage has no value set; set it or drop it")
        missing = [n for n in active if n not in order]
        if missing:
            raise ConfigError(f"--chain leaves out {missing[0]!r}, which is set; add it to --chain or unset it")
    return Chain([BY_NAME[name].make(BY_NAME[name].class_for(context.engine), values[name], context)
                  for name in order])


def chain_for(settings: ChainSettings, tokens: Tokens, generator=None, eos_ids=(), stop_ids=()) -> tuple[Plan, Chain]:
    """THE chain builder: the settings as their semantics reads them (:func:`~.semantics.plan`), every token-naming
    setting resolved by ``tokens``, the stages made in the plan's order with the run's ``generator`` (XTC's coin),
    end ids (what min-new-tokens bans; where the constraint allows an end) and ``tokens`` (the constraint's tokenizer
    and logits width). Every caller (each method, compare's attribution, validation) builds here."""
    p = plan(settings)
    values = p.settings.stage_values(resolved=resolve(p.settings, tokens))
    return p, build_chain(values, p.order, p.context(generator, tuple(eos_ids), tuple(stop_ids), tokens))


def make_chain(lm: LoadedModel, settings: ChainSettings, generator=None) -> Chain:
    """The chain of ``settings`` on a loaded model. ``generator``: the run's (XTC's coin); by default one seeded by
    --seed."""
    if generator is None:
        generator = make_generator(getattr(settings, "seed", 0), lm.device)
    return chain_for(settings, Tokens.of(lm), generator, lm.eos_ids, getattr(settings, "stop_id", ()))[1]


def refuse_stepwise_stages(chain: Chain, method: str) -> None:
    """Stages whose output is not a function of the prefix alone (their own coin, or state carried from step to
    step) cannot score several continuations at once."""
    for name in chain.names:
        if "state" in BY_NAME[name].needs:
            options = "/".join(p.option for p in BY_NAME[name].params if p.field != "xtc_threshold")
            raise ConfigError(f"{options}: {method} scores several continuations per step, and {name} draws its "
                              "own coin or carries state from step to step; drop it for this command")


def build(settings: ChainSettings, vocab: int, seed: int, device, eos_ids=(), stop_ids=(), encode=None,
          token_id=None, token_text=None) -> tuple[Plan, Chain, object]:
    """The plan of ``settings``, its chain and its selector, sharing one generator (the selector's draws and XTC's
    coin come from the run's seed). Token-naming settings are resolved with the tokenizer's functions if given."""
    selector = plan(settings).make_selector(seed, device)
    generator = getattr(selector, "generator", None) or make_generator(seed, device)
    p, chain = chain_for(settings, Tokens(vocab, encode, token_id, token_text), generator, eos_ids, stop_ids)
    return p, chain, selector


def validate_chain(s: ChainSettings) -> None:
    """The settings as the chosen semantics reads them (:func:`~.semantics.plan`: an engine's defaults, clamps and
    off-values first), then the ranges, then the order: building every stage once, each checks its own parameters,
    before any model loads (token-naming settings resolved to placeholder ids: no tokenizer yet)."""
    effective = plan(s)
    validate_chain_ranges(effective.settings, effective.engine)
    chain_for(s, Tokens.placeholder())
    s.cache_spec  # parsed (and checked) once


def validate_chain_ranges(s: ChainSettings, engine: str | None = None) -> None:
    """Each field's range as its registry entry states it (the engine's own where it has one: llama.cpp's min-p
    above 1); then the rules that join two fields."""
    for p in params():
        check_range(p, getattr(s, p.field), engine)
    for p in params():  # texts that name tokens (--allow, --ban, --dry-breaker, --sequence-bias) must be UTF-8
        for item in getattr(s, p.field) if (p.many or p.pairs) and p.field != "logit_bias" else ():
            check_text(p.option, item[0] if p.pairs else item)
    for token, bias in s.logit_bias:
        check_text("--logit-bias", token)
        _check(not math.isnan(bias), "logit_bias", f"{token}={bias}", "the bias must be a number or -inf")
        _check(bias != math.inf, "logit_bias", f"{token}={bias}", "+inf cannot force a token (every other "
               "candidate would be NaN); use a large finite bias such as 100, or ban the others with -inf")
    if s.dynatemp_range is not None and engine != "llamacpp":  # llama.cpp runs T over [max(0, t - R), t + R]
        _check(s.temperature != 0, "dynatemp_range", s.dynatemp_range,
               "needs a temperature > 0 (-t 0 is greedy); the range is around -t")
