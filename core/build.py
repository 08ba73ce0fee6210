"""Runs built from settings: the one place where a command's resolved settings and a loaded model become a chain,
a selector, a KV policy, a runtime and a run. The CLI, the benchmarks and scripts all build their runs here, so
they decode the same way.
"""

from __future__ import annotations

from dataclasses import replace

from .beam import BeamSearch, BeamSettings, ModelStepper, check_beams_fit_vocabulary
from .config import ChainSettings, SampleSettings, cache_spec
from .decode import Sampler, next_token_stages
from .errors import ConfigError, ModelLoadError
from .kv import CacheSpec
from .model import LoadedModel, load_model
from .processors import Chain, build_chain
from .runtime import Runtime
from .select import make_generator
from .semantics import plan as semantics_plan
from .semantics import resolve_token_settings
from .speculative import (BaselineTiming, ModelProposer, NGramProposer, Speculator, SpeculateSettings, SpeedupRound,
                          check_same_vocabulary, make_selector_for, speedup_round, time_plain_decoding)
from .step import StopRules


def bias_token_ids(lm: LoadedModel, logit_bias) -> dict[int, float]:
    """--logit-bias TOKEN=BIAS pairs -> {token id: bias}; TOKEN is an id or a text that is exactly one token."""
    out: dict[int, float] = {}
    for token, bias in logit_bias:
        if token.lstrip("-").isdigit():
            token_id = int(token)
            if not 0 <= token_id < lm.vocab_size:
                raise ConfigError(f"--logit-bias {token}={bias}: token id out of range [0, {lm.vocab_size})")
        else:
            try:
                token_id = lm.token_id(token)
            except ConfigError as exc:
                raise ConfigError(f"--logit-bias {token}={bias}: {exc}") from None
        out[token_id] = out.get(token_id, 0.0) + bias
    return out


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


def encode_plain(lm: LoadedModel):
    """Text -> token ids without special tokens (sequence bias, bans, allow-list, DRY breakers)."""
    return lambda text: list(lm.tokenizer.encode(text, add_special_tokens=False))


def refuse_stepwise_stages(chain: Chain, method: str) -> None:
    """Stages whose output is not a function of the prefix alone (their own coin, or state carried from step to
    step) cannot score several continuations at once."""
    options = {"xtc": "--xtc-probability", "mirostat": "--mirostat-tau/--mirostat-eta"}
    for name in chain.names:
        if name in options:
            raise ConfigError(f"{options[name]}: {method} scores several continuations per step, and {name} draws its "
                              "own coin or carries state from step to step; drop it for this command")


def stop_rules(lm: LoadedModel, settings, max_new_tokens: int | None = None) -> StopRules:
    return StopRules(max_new_tokens or settings.max_new_tokens, tuple(lm.eos_ids), tuple(getattr(settings, "stop", ())),
                     settings.ignore_eos, lm.context_length, tuple(getattr(settings, "stop_id", ())))


def runtime_for(lm: LoadedModel, spec: CacheSpec, capacity: int, needs=frozenset(), compile: bool = False) -> Runtime:
    runtime = Runtime.create(lm.model, spec, capacity, frozenset(needs))
    if compile:
        runtime.compile_decode()  # compiles lazily: a platform that cannot is refused at the first decode step
    return runtime


# --- sample and probs ----------------------------------------------------------------------------------------------


def build_sampler(lm: LoadedModel, settings: SampleSettings, prompt_ids: list[int], chain: Chain | None = None,
                  record: bool = True) -> Sampler:
    selector = semantics_plan(settings).make_selector(settings.seed, lm.device)
    chain = chain or make_chain(lm, settings, getattr(selector, "generator", None))
    rules = stop_rules(lm, settings)
    runtime = runtime_for(lm, cache_spec(settings), len(prompt_ids) + rules.max_new_tokens,
                          compile=settings.compile)
    return Sampler(lm.model, prompt_ids, chain, selector, rules, lm.token_text, lm.decode, settings.top,
                   runtime=runtime, record=record)


def build_probs(lm: LoadedModel, settings: SampleSettings, prompt_ids: list[int], chain: Chain | None = None):
    chain = chain or make_chain(lm, settings)
    return next_token_stages(lm.model, prompt_ids, chain, lm.token_text, settings.top, lm.context_length,
                             cache=cache_spec(settings))


# --- beam ------------------------------------------------------------------------------------------------------


def build_beam(lm: LoadedModel, settings: BeamSettings, prompt_ids: list[int], chain: Chain | None = None,
               record: bool = True) -> BeamSearch:
    check_beams_fit_vocabulary(settings.beams, lm.vocab_size)
    chain = chain or make_chain(lm, settings)
    refuse_stepwise_stages(chain, "beam search")
    chain.reset(len(prompt_ids))
    return BeamSearch(beam_stepper(lm, settings), prompt_ids, chain, settings, tuple(lm.eos_ids), lm.decode,
                      lm.context_length, record=record, token_text=lm.token_text)


def beam_stepper(lm: LoadedModel, settings: BeamSettings) -> ModelStepper:
    return ModelStepper(lm.model, cache_spec(settings))


# --- speculate -------------------------------------------------------------------------------------------------


def load_draft(spec: str, target: LoadedModel, dtype: str, trust_remote_code: bool,
               option: str = "--draft") -> LoadedModel:
    """A second model sharing the target's vocabulary, on its device (a draft, or a reference to score against);
    its messages name ``option``."""
    try:
        draft = load_model(spec, device=str(target.device), dtype=dtype, trust_remote_code=trust_remote_code)
    except ModelLoadError as exc:
        raise ModelLoadError(str(exc).replace(f"--model {spec}", f"{option} {spec}", 1)) from None
    try:
        check_same_vocabulary(target, draft, spec)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("--draft", option, 1).replace("the draft", option)) from None
    return draft


def build_speculator(lm: LoadedModel, draft: LoadedModel | None, settings: SpeculateSettings,
                     prompt_ids: list[int], gamma: int, chain: Chain | None = None, record: bool = True,
                     max_new_tokens: int | None = None) -> Speculator:
    """A speculative run: the proposer (draft model or n-gram) and the target share the chain and, when sampling,
    one generator seeded by --seed. Both caches follow --cache."""
    chain = chain or make_chain(lm, settings)
    refuse_stepwise_stages(chain, "speculative decoding")
    chain.reset(len(prompt_ids))
    greedy = semantics_plan(settings).selector == "greedy"
    gen = None if greedy else make_generator(settings.seed, lm.device)
    spec = cache_spec(settings)
    if draft is None:
        proposer = NGramProposer(settings.ngram_size)
    else:
        proposer = ModelProposer(draft.model, chain, make_selector_for(greedy, gen), draft.name,
                                 draft.context_length, cache=spec)
    return Speculator(lm.model, proposer, prompt_ids, chain, stop_rules(lm, settings, max_new_tokens), gamma, gen,
                      lm.token_text, lm.decode, settings.top, record, cache=spec)


def warm_up_speculate(lm: LoadedModel, draft: LoadedModel | None, settings: SpeculateSettings,
                      prompt_ids: list[int], chain: Chain) -> None:
    """A few untimed rounds: the first forwards of each model are slow."""
    for _ in build_speculator(lm, draft, settings, prompt_ids, settings.gamma, chain, record=False,
                              max_new_tokens=min(4, settings.max_new_tokens)):
        pass


def plain_baseline(lm: LoadedModel, settings: SpeculateSettings, prompt_ids: list[int], chain: Chain,
                   tokens: int) -> BaselineTiming:
    """Plain target decoding of the same length, same chain and cache policy, timed in the same run."""
    return time_plain_decoding(lm.model, prompt_ids, chain, semantics_plan(settings).make_selector(settings.seed,
                                                                                                    lm.device),
                               tokens, lm.context_length, cache=cache_spec(settings))


class SpeedupRounds:
    """The measured speedup of one gamma over ``settings.speedup_rounds`` timing rounds. Each round pairs a
    speculative run with plain decoding of as many tokens (same prompt, settings, seed and chain, so every
    speculative run emits the same tokens); the order alternates, speculative first in rounds 1, 3, .. and plain
    first in rounds 2, 4, .., so a machine that slows down or speeds up during the measurement weighs on both sides
    alike. ``first``: the speculative run of round 1 when it has already run (the traced run a command shows; its
    loop time excludes the trace, like the untraced later runs). ``run()`` may be cut by Ctrl-C: ``rounds`` keeps
    the rounds completed, ``first`` the first speculative run once it is complete."""

    def __init__(self, lm: LoadedModel, draft: LoadedModel | None, settings: SpeculateSettings,
                 prompt_ids: list[int], chain: Chain, gamma: int, first: Speculator | None = None):
        self.lm, self.draft, self.settings, self.prompt_ids = lm, draft, settings, prompt_ids
        self.chain, self.gamma, self.first = chain, gamma, first
        self.rounds: list[SpeedupRound] = []

    def speculative(self) -> Speculator:
        run = build_speculator(self.lm, self.draft, self.settings, self.prompt_ids, self.gamma, self.chain,
                               record=False)
        for _ in run:
            pass
        return run

    def plain(self, tokens: int) -> BaselineTiming:
        return plain_baseline(self.lm, self.settings, self.prompt_ids, self.chain, tokens)

    def run(self) -> list[SpeedupRound]:
        for i in range(len(self.rounds), self.settings.speedup_rounds):
            if i == 0:
                if self.first is None:
                    self.first = self.speculative()
                run, baseline = self.first, self.plain(len(self.first.new_ids))
            elif i % 2:
                baseline = self.plain(len(self.first.new_ids))
                run = self.speculative()
            else:
                run = self.speculative()
                baseline = self.plain(len(run.new_ids))
            paired = speedup_round(run, baseline)
            if paired is None:
                break  # nothing to time (a run of no tokens)
            self.rounds.append(paired)
        return self.rounds


def with_gamma(settings: SpeculateSettings, gamma: int) -> SpeculateSettings:
    return replace(settings, gamma=gamma)
