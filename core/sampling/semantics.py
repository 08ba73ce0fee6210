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
from .registry import DEFAULT_ORDER, ENGINES, STAGES, StageContext, engine_order, param
from .select import Greedy, HFMultinomial, Multinomial, make_generator
from .settings import ChainSettings

DEFAULT_DRY_BREAKERS = ("\n", ":", '"', "*")  # llama.cpp common/common.h dry_sequence_breakers
PENALTIES = ("repetition-penalty", "frequency-penalty", "presence-penalty")
VLLM_SAMPLING_EPS = 1e-5  # vllm/v1/sample/sampler.py _SAMPLING_EPS: below it a temperature means greedy

# each engine's own order of the stages it has, from the registry; stages it lacks keep decodelab's relative
# position (merge_order). With mirostat on, llama.cpp runs only logit bias, temperature and mirostat.
HF_ORDER = engine_order("hf")
VLLM_ORDER = engine_order("vllm")
LLAMACPP_ORDER = tuple(n for n in engine_order("llamacpp") if n != "mirostat")
LLAMACPP_MIROSTAT_ORDER = ("constraint", "bias", "temperature", "mirostat")  # the grammar is not in the chain
ENGINE_NAMES = {"hf": "transformers", "vllm": "vLLM", "llamacpp": "llama.cpp"}
ENGINE_STAGES = {engine: engine_order(engine) for engine in ENGINES}

# decodelab stage -> the settings fields that switch it on; the stages that act only when sampling
STAGE_FIELDS = {s.name: (s.fields if s.any_field else s.fields[:1]) for s in STAGES}
WARPERS = tuple(s.name for s in STAGES if s.warper)


def engine_off(engine: str, s: ChainSettings, fields) -> dict:
    """The fields among ``fields`` whose value ``engine`` reads as "off" (its registry entry says which), set to
    None."""
    out = {}
    for name in fields:
        p, value = param(name), getattr(s, name)
        if value is not None and engine in p.off and p.off[engine](value):
            out[name] = None
    return out


@dataclass
class Plan:
    """How a run reads its settings. ``settings`` are effective (semantics applied, ``chain`` = the order)."""

    engine: str  # "decodelab" or one of ENGINES
    settings: ChainSettings
    counting: dict[str, tuple[str, int | None]] = field(default_factory=dict)  # penalty -> (scope, last_n)
    selector: str = "multinomial"  # greedy | multinomial (exponential race) | hf-multinomial
    logprobs: str = "processed"  # what the engine's logprobs describe: processed (after its chain) | raw
    stop_ends_min_tokens: bool = True  # min-new-tokens bans the stop ids too, not only EOS
    trim_stop: bool = False  # the engine leaves a stop string out of the text
    notes: list[str] = field(default_factory=list)

    @property
    def order(self) -> list[str]:
        return list(self.settings.chain or ())

    def context(self, generator: torch.Generator | None = None, eos_ids=(), stop_ids=(), tokens=None) -> StageContext:
        """What the stages need besides their values: ``tokens`` (:class:`~.tokens.Tokens`) for the constraint's
        tokenizer and logits width; the constraint allows exactly the model's end ids where its grammar accepts."""
        end = tuple(eos_ids) + (tuple(stop_ids) if self.stop_ends_min_tokens else ())
        return StageContext(generator=generator, end_ids=tuple(dict.fromkeys(end)), counting=dict(self.counting),
                            eos_ids=tuple(eos_ids), tokens=tokens)

    def make_selector(self, seed: int, device) -> Greedy | Multinomial | HFMultinomial:
        """The one selector, with the run's generator (hand the same generator to :meth:`context`)."""
        if self.selector == "greedy":
            return Greedy()
        if self.selector == "hf-multinomial":
            return HFMultinomial(make_generator(seed, device))
        return Multinomial(make_generator(seed, device))

    def describe(self) -> dict:
        """For the JSON document: the effective chain and what differs."""
        return {"engine": self.engine, "chain": self.order, "selector": self.selector, "logprobs": self.logprobs,
                "counting": {k: {"scope": s, "last_n": n} for k, (s, n) in self.counting.items()},
                "trim_stop": self.trim_stop, "notes": list(self.notes)}


def active_stages(s: ChainSettings) -> list[str]:
    """The stages these settings switch on, in decodelab's default order."""
    on = []
    for name in DEFAULT_ORDER:
        values = [getattr(s, f) for f in STAGE_FIELDS[name]]
        if any(v is not None and v != () for v in values):
            on.append(name)
    if "dynatemp" in on and "temperature" in on:
        on.remove("temperature")  # the dynamic temperature takes the temperature as its centre
    return on


def merge_order(engine_order: tuple[str, ...], active: list[str]) -> list[str]:
    """The engine's order for the stages it has; every other active stage right after the last stage that comes
    before it in decodelab's default order (or first)."""
    out = [n for n in engine_order if n in active]
    for name in active:
        if name in out:
            continue
        at = 0
        for i, other in enumerate(out):
            if DEFAULT_ORDER.index(other) < DEFAULT_ORDER.index(name):
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
    return {name: ("all", s.penalty_last_n) for name in PENALTIES}


def _native(s: ChainSettings) -> Plan:
    order = list(s.chain) if s.chain is not None else active_stages(s)
    return Plan("decodelab", replace(s, chain=tuple(order)), _penalty_window(s),
                "greedy" if s.temperature == 0 else "multinomial")


# how each engine places a constraint (docs/constraints.md); transformers has no grammar stage at all
CONSTRAINT_NOTES = {
    "hf": "constraint: transformers has no grammar stage (a prefix_allowed_tokens_fn or a logits processor runs "
          "where it is placed); kept at decodelab's position, first after allow",
    "vllm": "constraint: vLLM applies its structured-output bitmask to the logits before the sampler, so before "
            "allowed_token_ids, penalties, temperature and top-k/top-p",
    "llamacpp": "constraint: llama.cpp's grammar sampler checks the token its chain drew and only if the grammar "
                "rejects it masks the logits first and draws again; run here grammar first (exact with temperature "
                "alone; with top-k/top-p/min-p llama.cpp's law is a mixture of the two)",
}


def _finish(engine: str, s: ChainSettings, user_chain, notes: list[str], engine_order) -> ChainSettings:
    """The order: the user's --chain if given (noted), else the engine's; note the stages the engine lacks."""
    active = active_stages(s)
    if "constraint" in active:
        notes.append(CONSTRAINT_NOTES[engine])
    lacking = [n for n in active if n not in ENGINE_STAGES[engine] and n != "constraint"]  # noted above
    if lacking:
        notes.append(f"{ENGINE_NAMES[engine]} has no {', '.join(lacking)}: kept at decodelab's position")
    if user_chain is not None:
        order = [n for n in user_chain if n in active]
        notes.append(f"order from --chain, not {ENGINE_NAMES[engine]}'s")
    else:
        order = merge_order(engine_order, active)
    return replace(s, chain=tuple(order))


def _dropped(s: ChainSettings, stages, why: str, notes: list[str]) -> ChainSettings:
    """Switch these stages off, noting which were set."""
    set_ = [n for n in stages if n in active_stages(s) or (n == "temperature" and s.temperature is not None)]
    if set_:
        notes.append(f"{', '.join(set_)}: {why}")
    off = {f: (() if isinstance(getattr(s, f), tuple) else None) for n in stages for f in STAGE_FIELDS[n]}
    return replace(s, **off)


def _hf(s: ChainSettings) -> Plan:
    notes: list[str] = []
    user_chain = s.chain
    sampling = s.temperature is not None and s.temperature > 0  # do_sample; transformers' default is greedy
    if s.temperature is None:
        notes.append("no temperature: transformers decodes greedily unless do_sample=True (give -t T > 0)")
    if sampling:
        if s.top_k is None:
            s = replace(s, top_k=50)
            notes.append("top_k=50: transformers' default when sampling")
        s = replace(s, **engine_off("hf", s, ("temperature", "top_k", "top_p", "typical_p", "epsilon_cutoff",
                                              "eta_cutoff")))
        selector = "hf-multinomial"
    else:
        s = _dropped(s, WARPERS, "not applied by transformers when do_sample=False", notes)
        selector = "greedy"
    if s.repetition_penalty == 1.0:
        s = replace(s, repetition_penalty=None)
    if s.penalty_last_n is not None:
        notes.append("penalty_last_n: transformers' penalties count the whole sequence; window ignored")
        s = replace(s, penalty_last_n=None)
    if s.softcap is not None:
        notes.append("softcap: in transformers a model property (final_logit_softcapping), not a processor")
    s = _finish("hf", s, user_chain, notes, HF_ORDER)
    return Plan("hf", s, {}, selector, "processed", stop_ends_min_tokens=False, trim_stop=False, notes=notes)


def _vllm(s: ChainSettings) -> Plan:
    notes: list[str] = []
    user_chain = s.chain
    for key in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, key)
        if value is not None and not -2.0 <= value <= 2.0:
            raise ConfigError(f"--{key.replace('_', '-')} {value}: vLLM allows [-2, 2]")
    if s.top_k is not None and s.top_k in (0, -1):
        s = replace(s, top_k=None)  # vLLM: 0 or -1 = all tokens
    if s.top_k is not None and s.top_k < -1:
        raise ConfigError(f"--top-k {s.top_k}: vLLM allows -1, 0 (off) or >= 1")
    temperature = 1.0 if s.temperature is None else s.temperature
    if temperature < VLLM_SAMPLING_EPS:
        s = _dropped(s, WARPERS, "vLLM's greedy takes the arg-max before temperature and the filters", notes)
        s = replace(s, temperature=0.0)
        selector = "greedy"
        s = _finish("vllm", s, user_chain, notes, VLLM_ORDER)
        s = replace(s, chain=tuple(n for n in s.chain if n != "temperature") + ("temperature",))
    else:
        s = replace(s, **engine_off("vllm", s, ("temperature", "top_p", "min_p", "presence_penalty",
                                                "frequency_penalty", "repetition_penalty")))
        selector = "multinomial"  # vLLM's random_sample: argmax p / q, q ~ Exp(1), the same race
        s = _finish("vllm", s, user_chain, notes, VLLM_ORDER)
    if s.penalty_last_n is not None:
        notes.append("penalty_last_n: vLLM's penalties count the whole sequence; window ignored")
        s = replace(s, penalty_last_n=None)
    counting = {"frequency-penalty": ("output", None), "presence-penalty": ("output", None)}
    notes.append("frequency and presence penalties count generated tokens only; repetition counts the prompt too")
    return Plan("vllm", s, counting, selector, "raw", stop_ends_min_tokens=True, trim_stop=True, notes=notes)


def _llamacpp(s: ChainSettings) -> Plan:
    notes: list[str] = []
    user_chain = s.chain
    defaults = {"top_k": 40, "top_p": 0.95, "min_p": 0.05, "temperature": 0.8}
    filled = [k for k in defaults if getattr(s, k) is None]
    if filled:
        notes.append("llama.cpp defaults: " + ", ".join(f"{k}={defaults[k]}" for k in filled))
        s = replace(s, **{k: defaults[k] for k in filled})
    changes: dict = {}
    if s.temperature < 0:
        changes["temperature"] = 0.0  # common/arg.cpp: temp = max(temp, 0)
    if s.top_k <= 0:
        changes["top_k"] = None
    if s.top_p >= 1.0:
        changes["top_p"] = None
    elif s.top_p <= 0:  # llama_sampler_top_p_apply keeps the first token whatever p
        changes["top_p"] = None
        changes["top_k"] = 1
        notes.append("top_p <= 0: llama.cpp keeps the most likely token (as top-k 1)")
    if s.min_p <= 0:
        changes["min_p"] = None
    elif s.min_p > 1:
        changes["min_p"] = 1.0  # keeps p >= p_max: only the most likely token(s)
    if s.typical_p is not None and s.typical_p >= 1.0:
        changes["typical_p"] = None
    if s.top_n_sigma is not None and s.top_n_sigma <= 0:
        changes["top_n_sigma"] = None  # since llama.cpp PR 13345, <= 0 is off
    if s.xtc_probability is not None and (s.xtc_probability <= 0 or (s.xtc_threshold or 0.1) > 0.5):
        changes["xtc_probability"] = None
    if s.dynatemp_range is not None and s.dynatemp_range <= 0:
        changes["dynatemp_range"] = None
    last_n = 64 if s.penalty_last_n is None else s.penalty_last_n
    penalties_off = last_n == 0
    if s.repetition_penalty == 1.0 or penalties_off:
        changes["repetition_penalty"] = None
    if s.frequency_penalty == 0.0 or penalties_off:
        changes["frequency_penalty"] = None
    if s.presence_penalty == 0.0 or penalties_off:
        changes["presence_penalty"] = None
    if s.dry_multiplier is not None and (s.dry_multiplier == 0 or (s.dry_base is not None and s.dry_base < 1)
                                         or s.dry_penalty_last_n == 0):
        changes["dry_multiplier"] = None
    if s.dry_penalty_last_n == -1:
        changes["dry_penalty_last_n"] = None  # -1: the context size, i.e. every token
    s = replace(s, **changes)
    if s.temperature == 1.0 and s.dynatemp_range is None:
        s = replace(s, temperature=None)  # llama_sampler_init_temp(1.0) is the empty sampler
    window = None if last_n == -1 else last_n
    counting = {name: ("all", window) for name in PENALTIES}
    if any(getattr(s, f) is not None for f in ("repetition_penalty", "frequency_penalty", "presence_penalty")):
        notes.append(f"penalties count prompt and output, the last {'all' if window is None else window} tokens")
    if s.mirostat_tau is not None or s.mirostat_eta is not None:
        s = _dropped(s, [n for n in DEFAULT_ORDER if n not in LLAMACPP_MIROSTAT_ORDER],
                     "ignored by llama.cpp when mirostat is on (its chain is logit bias, temperature, mirostat)",
                     notes)
        engine_order = LLAMACPP_MIROSTAT_ORDER
    else:
        engine_order = LLAMACPP_ORDER
    temperature = s.temperature
    s = replace(s, penalty_last_n=None)
    s = _finish("llamacpp", s, user_chain, notes, engine_order)
    selector = "greedy" if temperature == 0 and s.dynatemp_range is None else "multinomial"
    return Plan("llamacpp", s, counting, selector, "raw", stop_ends_min_tokens=True, trim_stop=True, notes=notes)
