"""`--semantics hf|vllm|llamacpp`: the same settings, read the way each engine reads them.

:func:`plan` turns settings into a :class:`Plan`: the effective settings (the engine's defaults filled in, its
clamps and off-values applied), the stage order, which tokens each penalty counts, which selector draws, what its
logprobs mean, and notes on everything that engine would do differently. Without ``--semantics`` the plan is
decodelab's own (the settings as given, the documented default order).

Where the facts come from (read in each engine's own code; no code is taken from them):

* transformers ``generation/utils.py`` ``_get_logits_processor`` (order: sequence_bias, repetition_penalty,
  no_repeat_ngram, bad_words, min_length, min_new_tokens, then only when ``do_sample``: temperature, top_k,
  top_p, min_p, typical_p, epsilon, eta); ``generation/configuration_utils.py`` ``_get_default_generation_params``
  (do_sample False, top_k 50, temperature 1, top_p 1); ``_sample``: ``torch.multinomial(softmax(scores), 1)``
  on the global generator; ``output_scores`` are the processed scores.
* vLLM ``vllm/v1/sample/sampler.py`` (allowed ids, bad words, min_tokens and logit_bias, then penalties, then
  temperature (< 1e-5 is greedy, taken before temperature and filters), min_p, top-k, top-p; the draw is
  argmax p / q with q ~ Exp(1)); ``vllm/model_executor/layers/utils.py`` ``apply_penalties`` (repetition counts
  prompt and output, frequency and presence the output only); logprobs default to the raw model
  (``logprobs_mode="raw_logprobs"``); a stop string is left out of the text (``include_stop_str_in_output=False``).
* llama.cpp ``common/common.h`` ``common_params_sampling`` (top_k 40, top_p 0.95, min_p 0.05, temp 0.8,
  penalty_last_n 64, dry_base 1.75, dry_allowed_length 2, xtc_threshold 0.1, mirostat tau 5 eta 0.1, and the
  sampler order penalties, dry, top_n_sigma, top_k, typ_p, top_p, min_p, xtc, temperature);
  ``common/sampling.cpp`` ``common_sampler_init`` (logit bias first; mirostat replaces the whole chain by
  temperature then mirostat); ``src/llama-sampler.cpp`` (each sampler's off-values: top_k <= 0, top_p >= 1,
  min_p <= 0, typical >= 1, temp == 1, xtc probability <= 0 or threshold > 0.5, top_n_sigma <= 0,
  penalty_last_n == 0, dry multiplier 0 or base < 1); ``tools/main`` accepts the prompt tokens into the sampler,
  so penalties count prompt and output within the last n; the server's ``n_probs`` are the raw softmax unless
  ``post_sampling_probs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..errors import ConfigError
from . import registry
from .registry import ENGINES, StageContext, engine_order, param, params, scaling_stage, stage_of, windowed
from .select import Greedy, HFMultinomial, Multinomial, make_selector
from .settings import ChainSettings

DEFAULT_DRY_BREAKERS = ("\n", ":", '"', "*")  # llama.cpp common/common.h dry_sequence_breakers
VLLM_SAMPLING_EPS = 1e-5  # vllm/v1/sample/sampler.py _SAMPLING_EPS: below it a temperature means greedy
VLLM_MIN_TEMPERATURE = 1e-2  # vllm/sampling_params.py _MAX_TEMP: a temperature in (0, 0.01) is raised to 0.01
VLLM_MAX_TEMPERATURE = 2.0  # SamplingParams._verify_args: temperature must be in [0, 2]

ENGINE_NAMES = {"hf": "transformers", "vllm": "vLLM", "llamacpp": "llama.cpp"}


def _row(name: str) -> registry.Stage:
    """The registry's row of a stage (read from its rows when asked, so a new row takes part)."""
    return next(st for st in registry.STAGES if st.name == name)


def own_order(engine: str) -> tuple[str, ...]:
    """The engine's own order of the stages it has (the registry's ranks), but a stage that replaces the engine's
    whole chain when on (each row's ``alone``: llama.cpp's mirostat); stages it lacks keep decodelab's relative
    position (merge_order)."""
    return tuple(n for n in engine_order(engine) if engine not in _row(n).alone)


# the orders as the registry's rows are now (--export reads them)
HF_ORDER = own_order("hf")
VLLM_ORDER = own_order("vllm")
LLAMACPP_ORDER = own_order("llamacpp")
ENGINE_STAGES = {engine: engine_order(engine) for engine in ENGINES}


def default_order() -> list[str]:
    """decodelab's default order: the registry's rows, in order (read when asked, so a new row takes part)."""
    return [st.name for st in registry.STAGES]


def _off(s: ChainSettings, stages) -> dict:
    """The settings that switch these stages off: each field that switches one on, unset."""
    return {f: (() if isinstance(getattr(s, f), tuple) else None) for n in stages
            for f in _row(n).switches}


def _warpers() -> list[str]:
    """The stages that act only when sampling (each row's ``warper``): a greedy engine drops them."""
    return [st.name for st in registry.STAGES if st.warper]


def possessive(name: str) -> str:
    """transformers' (a name ending in s takes the apostrophe alone), vLLM's, llama.cpp's."""
    return name + ("'" if name.endswith("s") else "'s")


def engine_off(engine: str, s: ChainSettings) -> ChainSettings:
    """Switch off every stage one of whose fields holds a value ``engine`` reads as "off" (the registry's
    ``Param.off``: llama.cpp's top-k 0, vLLM's top-p 1, an XTC threshold above 0.5, ...)."""
    off = {}
    for p in params():
        value, rule = getattr(s, p.field), p.off.get(engine)
        stage = stage_of(p.field)
        if stage is not None and rule is not None and value is not None and rule.test(value):
            off.update(_off(s, [stage.name]))
    return replace(s, **off)


def engine_defaults(engine: str, s: ChainSettings, notes: list[str]) -> ChainSettings:
    """Fill every unset field the engine has a default for (the registry's ``Param.defaults``); the defaults of
    the stages these settings switch on are noted."""
    filled = {p.field: p.defaults[engine] for p in params() if engine in p.defaults and getattr(s, p.field) is None}
    shown = [f for f in filled if stage_of(f) is None or stage_of(f).name in active_stages(replace(s, **filled))]
    if shown:
        notes.append(f"{ENGINE_NAMES[engine]} defaults: " + ", ".join(f"{f}={filled[f]}" for f in shown))
    return replace(s, **filled)


@dataclass
class Plan:
    """How a run reads its settings. ``settings`` are effective (semantics applied, ``chain`` = the order)."""

    engine: str  # "decodelab" or one of ENGINES
    settings: ChainSettings
    counting: dict[str, tuple[str, int | None]] = field(default_factory=dict)  # penalty -> (scope, last_n)
    selector: str = "multinomial"  # greedy | multinomial (exponential race) | hf-multinomial
    logprobs: str = "processed"  # what the engine's logprobs describe: processed (after its chain) | raw
    trim_stop: bool = False  # the engine leaves a stop string out of the text
    notes: list[str] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        """Whether the run takes the arg-max (no draw, no generator)."""
        return self.selector == "greedy"

    @property
    def order(self) -> list[str]:
        return list(self.settings.chain or ())

    def context(self, generator: torch.Generator | None = None, eos_ids=(), stop_ids=(), tokens=None) -> StageContext:
        """What the stages need besides their values: ``tokens`` (:class:`~.tokens.Tokens`) for the constraint's
        tokenizer and logits width; the constraint allows exactly the model's end ids where its grammar accepts.
        Under an engine's semantics a stage with a variant for that engine runs it (llama.cpp's top-k and min-p)."""
        # min-new-tokens bans the stop ids as well as EOS in every engine: vLLM's min_tokens holds back EOS and
        # stop_token_ids; transformers' min_new_tokens bans every eos_token_id, and --export hf writes the stop ids
        # there (the only way generate stops on a token id)
        end = tuple(eos_ids) + tuple(stop_ids)
        return StageContext(generator=generator, end_ids=tuple(dict.fromkeys(end)), counting=dict(self.counting),
                            eos_ids=tuple(eos_ids), tokens=tokens,
                            engine=self.engine if self.engine in ENGINES else None)

    def make_selector(self, seed: int, device) -> Greedy | Multinomial | HFMultinomial:
        """The one selector, with the run's generator (hand the same generator to :meth:`context`)."""
        return make_selector(self.selector, seed, device)

    def describe(self) -> dict:
        """For the JSON document: the effective chain and what differs."""
        return {"engine": self.engine, "chain": self.order, "selector": self.selector, "logprobs": self.logprobs,
                "counting": {k: {"scope": s, "last_n": n} for k, (s, n) in self.counting.items()},
                "trim_stop": self.trim_stop, "notes": list(self.notes)}


def trims_stop(s) -> bool:
    """Whether a run of ``s`` delivers its text without what stopped it: ``trim_stop`` when set, else what the
    engine whose semantics apply does (vLLM and llama.cpp leave a stop string out; transformers and decodelab keep
    it)."""
    given = getattr(s, "trim_stop", None)
    return plan(s).trim_stop if given is None else bool(given)


def active_stages(s: ChainSettings) -> list[str]:
    """The stages these settings switch on, in decodelab's default order; a stage another one on takes over is not
    (``replaces``: the dynamic temperature takes the temperature as its centre)."""
    on = [st for st in registry.STAGES if st.switched_on(s)]
    taken = {st.replaces for st in on}
    return [st.name for st in on if st.name not in taken]


def merge_order(engine_order: tuple[str, ...], active: list[str]) -> list[str]:
    """The engine's order for the stages it has; every other active stage right after the last stage that comes
    before it in decodelab's default order (or first)."""
    out = [n for n in engine_order if n in active]
    default = default_order()
    for name in active:
        if name in out:
            continue
        at = 0
        for i, other in enumerate(out):
            if default.index(other) < default.index(name):
                at = i + 1
        out.insert(at, name)
    return out


def plan(s: ChainSettings) -> Plan:
    """Apply ``s.semantics`` (None: decodelab's own reading)."""
    if s.semantics is None:
        return _native(s)
    engine = str(s.semantics).strip().lower()
    if engine not in ENGINES:
        raise ConfigError(f"--semantics {s.semantics!r}: allowed: {', '.join(ENGINES)}")
    return {"hf": _hf, "vllm": _vllm, "llamacpp": _llamacpp}[engine](replace(s, semantics=None))


def _penalty_window(s: ChainSettings) -> dict[str, tuple[str, int | None]]:
    if s.penalty_last_n is None:
        return {}
    return {name: ("all", s.penalty_last_n) for name in windowed()}


def _native(s: ChainSettings) -> Plan:
    order = list(s.chain) if s.chain is not None else active_stages(s)
    return Plan("decodelab", replace(s, chain=tuple(order)), _penalty_window(s),
                "greedy" if s.temperature == 0 else "multinomial")


def _finish(engine: str, s: ChainSettings, user_chain, notes: list[str], engine_order) -> ChainSettings:
    """The order: the user's --chain if given (noted), else the engine's; note the stages the engine lacks (but
    those whose row says how the engine takes them: the constraint) and, for each stage that runs, what its row
    says the engine does differently (``notes``)."""
    active = active_stages(s)
    said = [n for n in active if engine in _row(n).notes]
    lacking = [n for n in active if n not in registry.engine_order(engine) and n not in said]
    if lacking:
        notes.append(f"{ENGINE_NAMES[engine]} has no {', '.join(lacking)}: kept at decodelab's position")
    if user_chain is not None:
        order = [n for n in user_chain if n in active]
        notes.append(f"order from --chain, not {possessive(ENGINE_NAMES[engine])}")
    else:
        order = merge_order(engine_order, active)
    notes += [_row(n).notes[engine] for n in order if n in said]
    return replace(s, chain=tuple(order))


def _dropped(s: ChainSettings, stages, why: str, notes: list[str]) -> ChainSettings:
    """Switch these stages off, noting which were set."""
    set_ = [n for n in stages if _row(n).switched_on(s)]  # a stage another one took over, too
    if set_:
        notes.append(f"{', '.join(set_)}: {why}")
    return replace(s, **_off(s, stages))


def _hf(s: ChainSettings) -> Plan:
    notes: list[str] = []
    user_chain = s.chain
    sampling = s.temperature is not None and s.temperature > 0  # do_sample; transformers' default is greedy
    if s.temperature is None:
        notes.append("no temperature: transformers decodes greedily unless do_sample=True (give -t T > 0)")
    if sampling:
        if s.top_k is None:
            s = replace(s, top_k=param("top_k").defaults["hf"])
            notes.append(f"top_k={s.top_k}: transformers' default when sampling")
        selector = "hf-multinomial"
    else:
        s = _dropped(s, _warpers(), "not applied by transformers when do_sample=False", notes)
        selector = "greedy"
    s = engine_off("hf", s)
    if s.penalty_last_n is not None:
        notes.append("penalty_last_n: transformers' penalties count the whole sequence; window ignored")
        s = replace(s, penalty_last_n=None)
    if s.softcap is not None:
        notes.append("softcap: in transformers a model property (final_logit_softcapping), not a processor")
    s = _finish("hf", s, user_chain, notes, own_order("hf"))
    return Plan("hf", s, {}, selector, "processed", trim_stop=False, notes=notes)


def _vllm(s: ChainSettings) -> Plan:
    notes: list[str] = []
    user_chain = s.chain
    _check_vllm_ranges(s)
    if s.temperature is not None and 0 < s.temperature < VLLM_MIN_TEMPERATURE:
        notes.append(f"temperature {s.temperature}: vLLM raises a temperature in (0, {VLLM_MIN_TEMPERATURE}) to "
                     f"{VLLM_MIN_TEMPERATURE} (only 0 is greedy)")
        s = replace(s, temperature=VLLM_MIN_TEMPERATURE)
    temperature = 1.0 if s.temperature is None else s.temperature
    if temperature < VLLM_SAMPLING_EPS:
        s = _dropped(s, _warpers(), "vLLM's greedy takes the arg-max before temperature and the filters", notes)
        s = engine_off("vllm", replace(s, temperature=0.0))
        selector = "greedy"
        s = _finish("vllm", s, user_chain, notes, own_order("vllm"))
        scaling = scaling_stage()  # last: at temperature 0 the arg-max
        s = replace(s, chain=tuple(n for n in s.chain if n != scaling) + (scaling,))
    else:
        s = engine_off("vllm", s)
        selector = "multinomial"  # vLLM's random_sample: argmax p / q, q ~ Exp(1), the same race
        s = _finish("vllm", s, user_chain, notes, own_order("vllm"))
    if s.penalty_last_n is not None:
        notes.append("penalty_last_n: vLLM's penalties count the whole sequence; window ignored")
        s = replace(s, penalty_last_n=None)
    counting = {n: (_row(n).counts["vllm"], None) for n in windowed()
                if "vllm" in _row(n).counts}
    notes.append("frequency and presence penalties count generated tokens only; repetition counts the prompt too")
    return Plan("vllm", s, counting, selector, "raw", trim_stop=True, notes=notes)


def _check_vllm_ranges(s: ChainSettings) -> None:
    """What vLLM's SamplingParams refuses (``_verify_args``), refused here with its range."""
    for key in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, key)
        if value is not None and not -2.0 <= value <= 2.0:
            raise ConfigError(f"--{key.replace('_', '-')} {value}: vLLM allows [-2, 2]")
    if s.temperature is not None and not 0 <= s.temperature <= VLLM_MAX_TEMPERATURE:
        raise ConfigError(f"--temperature {s.temperature}: vLLM allows [0, {VLLM_MAX_TEMPERATURE:g}]")
    if s.top_k is not None and s.top_k < -1:
        raise ConfigError(f"--top-k {s.top_k}: vLLM allows -1, 0 (off) or >= 1")


def _check_llamacpp_windows(s: ChainSettings) -> None:
    """llama-cli refuses a negative --repeat-last-n or --dry-penalty-last-n (common/arg.cpp; its library would read
    -1 as 0, off)."""
    for key in ("penalty_last_n", "dry_penalty_last_n"):
        value = getattr(s, key)
        if value is not None and value < 0:
            raise ConfigError(f"--{key.replace('_', '-')} {value}: llama-cli refuses a negative window (its "
                              "library reads -1 as 0, off); give 0 (off) or N >= 1 tokens")


def _llamacpp(s: ChainSettings) -> Plan:
    notes: list[str] = []
    user_chain = s.chain
    _check_llamacpp_windows(s)
    s = engine_defaults("llamacpp", s, notes)
    # llama-cli's own input rules (common/arg.cpp): a negative temperature is 0, a DRY base below 1 is ignored (the
    # server substitutes its default); top-p <= 0 keeps the most likely token (llama_sampler_top_p_apply)
    changes: dict = {}
    if s.temperature < 0:
        changes["temperature"] = 0.0
    if s.dry_multiplier is not None and s.dry_base < 1:
        changes["dry_base"] = param("dry_base").defaults["llamacpp"]
        notes.append(f"dry_base {s.dry_base}: llama.cpp ignores a DRY base below 1 and keeps "
                     f"{changes['dry_base']}")
    if s.top_p <= 0:
        changes["top_p"] = None
        changes["top_k"] = 1
        notes.append("top_p <= 0: llama.cpp keeps the most likely token (as top-k 1)")
    s = engine_off("llamacpp", replace(s, **changes))
    window = s.penalty_last_n  # 0: every penalty off (llama_sampler_init_penalties)
    if window == 0:
        s = replace(s, **_off(s, windowed()))
    counting = {name: ("all", window) for name in windowed()}
    alone = next((st for st in registry.STAGES if "llamacpp" in st.alone and st.switched_on(s)), None)
    if alone is not None:  # mirostat: llama.cpp's chain is logit bias, temperature, mirostat (the grammar apart)
        kept = alone.alone["llamacpp"] + (alone.name,)
        s = _dropped(s, [n for n in default_order() if n not in kept],
                     f"ignored by llama.cpp when {alone.name} is on (its chain is logit bias, temperature, "
                     f"{alone.name})", notes)
        engine_order = tuple(n for n in registry.engine_order("llamacpp") if n in kept)
    else:
        engine_order = own_order("llamacpp")
    if any(_row(n).switched_on(s) for n in windowed()):
        notes.append(f"penalties count prompt and output, the last {window} tokens")  # those mirostat left
    temperature = s.temperature
    s = replace(s, penalty_last_n=None)
    s = _finish("llamacpp", s, user_chain, notes, engine_order)
    selector = "greedy" if temperature == 0 and s.dynatemp_range is None else "multinomial"
    return Plan("llamacpp", s, counting, selector, "raw", trim_stop=True, notes=notes)
