"""The stage registry: every stage of the chain declared once.

An entry (:class:`Stage`) says everything the rest of decodelab derives from a stage: its name, its settings fields
(their type, CLI option, help, range check and each engine's off-value), its rank in the default order (its place in
``STAGES``), what it needs besides ``(ids, logits)``, how its settings become its constructor's value, and how each
``--semantics`` engine orders it. ``ChainSettings`` (:mod:`.settings`), the CLI options, the engine plans
(:mod:`.semantics`), ``--export`` (:mod:`.export`) and the default order all read this table. The stage's class lives
in its family module and binds itself to its entry with ``@implements("name")``; adding a stage is one class and one
entry here.

This module imports no torch, so the CLI can build its options (and ``--help``) from it without loading torch.

Default order (``DEFAULT_ORDER``), used unless ``--chain`` names another:

    allow -> constraint -> thinking-budget -> softcap -> repetition-penalty -> frequency-penalty -> presence-penalty
    -> dry -> no-repeat-ngram -> bias -> sequence-bias -> ban -> min-new-tokens -> temperature (or dynatemp)
    -> top-n-sigma -> top-k -> top-p -> min-p -> typical-p -> epsilon-cutoff -> eta-cutoff -> xtc -> mirostat

The constraint (``--regex`` / ``--json-schema`` / ``--grammar`` / ``--choice``) right after the allow-list: the two
hard restrictions of the candidate set come before any reshaping, so every later stage works on the constrained
distribution and the mass the constraint removes is measured under the model's own (as vLLM applies its
structured-output bitmask before the sampler). Soft-capping next because it reshapes the model's own output (as
Gemma 2 does inside the model); penalties and bias act on (capped) logits; temperature rescales before the
truncation filters, so the filters see the tempered distribution (as transformers does).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ..settings import _check

ENGINES = ("hf", "vllm", "llamacpp")
PANELS = {"chain": "Processor chain", "constraint": "Constraint (one per run)",
          "more": "More samplers, semantics, export"}


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@dataclass(frozen=True)
class Check:
    """A range check: ``ok(value)`` or one line ``--option VALUE: allowed``."""

    ok: Callable[[object], bool]
    allowed: str


@dataclass(frozen=True)
class Off:
    """How one engine reads a field as "stage off": ``test(value)`` for every such value, and ``value``, the one
    ``--export`` writes to switch the engine's own default off (llama.cpp's top-k 40, a server's
    generation_config)."""

    value: object
    test: Callable[[object], bool]


@dataclass(frozen=True)
class Param:
    """One settings field of a stage: ``field`` in settings and presets, ``--field-with-dashes`` on the command line.

    ``many``: repeatable, a tuple of texts; ``pairs``: repeatable ``TEXT=BIAS``; ``fallback``: decodelab's value
    when the field is unset and its stage is on (DRY's base 1.75); ``metavar``: how ``--help`` names the value
    (default its type). Per engine (a dict keyed by engine name): ``off``, the values that switch the field's stage
    off there (:class:`Off`); ``export``, the field's name there (a keyword argument or a flag; "llamacpp-server": in
    the llama.cpp server's /completion body); ``defaults``, the
    value the engine uses when the field is not given; ``checks``, the engine's own range where it accepts more than
    decodelab's ``check``."""

    field: str
    kind: type
    help: str
    short: str | None = None
    many: bool = False
    pairs: bool = False
    panel: str = "more"
    check: Check | None = None
    fallback: object = None
    off: dict[str, Off] = field(default_factory=dict)
    export: dict[str, str] = field(default_factory=dict)
    defaults: dict[str, object] = field(default_factory=dict)
    checks: dict[str, Check] = field(default_factory=dict)
    metavar: str | None = None

    @property
    def option(self) -> str:
        return "--" + self.field.replace("_", "-")

    @property
    def default(self):
        return () if (self.many or self.pairs) else None


@dataclass
class Stage:
    """One stage. ``value(settings, resolved)`` -> the constructor's value or None (off); ``make(cls, value,
    context)`` -> the processor. ``needs``: what it takes besides (ids, logits): ``ids`` (it reads the prefix),
    ``tokens`` (token ids resolved from texts), ``tokenizer`` (the model's own, and the logits width), ``generator``
    (the run's RNG), ``end_ids``, ``prompt_len``, ``state`` (it carries state from step to step). ``engines``: per
    engine, its rank in that engine's own order (absent: the engine has no such stage). ``warper``: it only acts when
    sampling (greedy engines drop it). ``any_field``: any of its fields switches it on (else the first).
    ``logits_only``: its value is defined on the raw logits, not on log-probabilities (beam runs the chain on
    log-probabilities, and refuses it). ``windowed``: a penalty on the tokens seen, whose window is
    ``--penalty-last-n`` (:attr:`StageContext.counting`); ``counts``: per engine, which tokens it counts where that
    is not prompt and output ("output": the generated tokens only). ``scales``: it divides every logit of a row by
    one number (a temperature: margins and rounding scale alike). ``replaces``: a stage it takes over when both are
    set (the dynamic temperature takes the temperature as its centre). ``notes``: per engine, what that engine does
    differently with the stage (said in the plan when the stage runs). ``alone``: per engine, the only stages that
    engine keeps once this one is on (llama.cpp's mirostat)."""

    name: str
    params: tuple[Param, ...]
    engines: dict[str, int] = field(default_factory=dict)
    needs: frozenset[str] = frozenset()
    value: Callable | None = None
    make: Callable = staticmethod(lambda cls, value, context: cls(value))
    warper: bool = False
    logits_only: bool = False
    samplers: dict[str, str] = field(default_factory=dict)  # engine -> its name in the sampler list (llama.cpp's)
    cls: type | None = None  # bound by @implements
    variants: dict[str, type] = field(default_factory=dict)  # other classes of the same stage, by role or engine
    any_field: bool = False
    windowed: bool = False
    counts: dict[str, str] = field(default_factory=dict)
    scales: bool = False
    replaces: str | None = None
    notes: dict[str, str] = field(default_factory=dict)
    alone: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self):
        if self.value is None:
            first = self.params[0].field
            self.value = lambda s, resolved, _f=first: getattr(s, _f)

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(p.field for p in self.params)

    def class_for(self, engine: str | None):
        """The class that runs this stage under ``engine``'s semantics: its variant for that engine if it has one
        (llama.cpp's exactly-k top-k), else the stage's own."""
        return self.variants.get(engine, self.cls) if engine is not None else self.cls

    @property
    def switches(self) -> tuple[str, ...]:
        """The fields that switch it on: its first (mirostat, constraint: any)."""
        return self.fields if self.any_field else self.fields[:1]

    @property
    def biases(self) -> bool:
        """It adds a bias to the tokens its TEXT=BIAS pairs name (a logit bias, a sequence bias)."""
        return any(p.pairs for p in self.params)

    def switched_on(self, s) -> bool:
        """Whether the settings switch this stage on (its first field set; mirostat, constraint: any field): what
        beam asks before refusing a sampling-only stage."""
        return any(getattr(s, f) not in (None, ()) for f in self.switches)


# --- value builders of the stages with several fields -------------------------------------------------------------


def effective(s, field_name: str):
    """The field's value, or its ``fallback`` when unset (the value its stage runs with)."""
    value = getattr(s, field_name)
    return param(field_name).fallback if value is None else value


def _dry(s, resolved):
    if s.dry_multiplier is None:
        return None
    return {"multiplier": s.dry_multiplier, "base": effective(s, "dry_base"),
            "allowed_length": effective(s, "dry_allowed_length"), "last_n": s.dry_penalty_last_n,
            "breakers": resolved.get("dry-breakers", ())}


def _mirostat(s, resolved):
    if s.mirostat_tau is None and s.mirostat_eta is None:
        return None
    return {"tau": effective(s, "mirostat_tau"), "eta": effective(s, "mirostat_eta")}


def _xtc(s, resolved):
    if s.xtc_probability is None:
        return None
    return {"threshold": effective(s, "xtc_threshold"), "probability": s.xtc_probability}


def _dynatemp(s, resolved):
    if s.dynatemp_range is None:
        return None
    return {"temperature": 1.0 if s.temperature is None else s.temperature, "range": s.dynatemp_range,
            "exponent": effective(s, "dynatemp_exponent")}


def _temperature(s, resolved):
    return s.temperature if s.dynatemp_range is None else None  # the dynamic temperature takes it as its centre


def _texts(key: str, field_name: str):
    """A stage named by texts: their token ids, resolved before the chain is built (:mod:`.tokens`)."""
    return lambda s, resolved: resolved[key] if getattr(s, field_name) else None


def _constraint(s, resolved):
    """The run's constraint, read (its file) and checked by token resolution (:mod:`.tokens`)."""
    return resolved.get("constraint")


def _thinking_budget(s, resolved):
    """(budget, the markers as ids) from --thinking-budget and --think-tags (:mod:`.thinking`)."""
    return None if s.thinking_budget is None else (s.thinking_budget, resolved["think-tags"])


def _bias(s, resolved):
    return resolved["bias"] or None if s.logit_bias else None


# --- the stages, in the default order -------------------------------------------------------------------------------

_gt0 = Check(lambda v: _finite(v) and v > 0, "must be > 0")
_ONE = Off(1.0, lambda v: v == 1.0)  # a factor of 1 (temperature, repetition penalty)
_ZERO = Off(0.0, lambda v: v == 0.0)  # a subtrahend or cutoff of 0
_AT_LEAST_ONE = Off(1.0, lambda v: v >= 1.0)  # a mass of 1 or more (top-p, typical-p)
_NOT_POSITIVE = Off(0, lambda v: v <= 0)  # llama.cpp's "<= 0 is off" (top-k, min-p, xtc, dynatemp, top-n-sigma)

STAGES: list[Stage] = [
    Stage("allow", (Param("allow", str, "Allow only these tokens (repeatable; a text, all its tokens).", many=True,
                          export={"vllm": "allowed_token_ids"}),),
          engines={"hf": 6, "vllm": 0}, needs=frozenset({"tokens"}), value=_texts("allow", "allow"),
          make=lambda cls, v, c: cls(tuple(v))),
    Stage("constraint",
          (Param("regex", str, "Constrain the output to a full match of this regular expression (Rust regex "
                 "syntax).", panel="constraint", export={"vllm": "structured_outputs.regex"}, metavar="REGEX"),
           Param("json_schema", str, "Constrain the output to JSON valid under the JSON Schema in this file.",
                 panel="constraint", export={"vllm": "structured_outputs.json", "llamacpp": "--json-schema"},
                 metavar="FILE"),
           Param("grammar", str, "Constrain the output to the grammar in this file: Lark (llguidance's dialect) or "
                 "GBNF (llama.cpp's).", panel="constraint",
                 export={"vllm": "structured_outputs.grammar", "llamacpp": "--grammar"}, metavar="FILE"),
           Param("choice", str, "Constrain the output to one of these comma-separated labels (spaces kept).",
                 panel="constraint", export={"vllm": "structured_outputs.choice", "llamacpp": "--grammar"},
                 metavar="A,B,..")),
          engines={"vllm": -1, "llamacpp": -1}, needs=frozenset({"ids", "tokenizer", "end_ids", "prompt_len"}),
          value=_constraint, make=lambda cls, v, c: cls.bind(v, c), any_field=True,
          notes={  # how each engine places a constraint (docs/constraints.md); transformers has no grammar stage
              "hf": "constraint: transformers has no grammar stage (a prefix_allowed_tokens_fn or a logits processor "
                    "runs where it is placed); kept at decodelab's position, first after allow",
              "vllm": "constraint: vLLM applies its structured-output bitmask to the logits before the sampler, so "
                      "before allowed_token_ids, penalties, temperature and top-k/top-p",
              "llamacpp": "constraint: llama.cpp's grammar sampler checks the token its chain drew and only if the "
                          "grammar rejects it masks the logits first and draws again; run here grammar first (exact "
                          "with temperature alone; with top-k/top-p/min-p llama.cpp's law is a mixture of the two)"}),
    Stage("thinking-budget",
          (Param("thinking_budget", int, "After N thinking tokens force the end-of-thinking marker (vLLM's "
                 "thinking_token_budget; needs --think-tags or a chat template with <think>).",
                 check=Check(lambda v: v >= 0, "must be an integer >= 0"),
                 export={"vllm": "thinking_token_budget"}),),
          engines={"vllm": 3.5},  # an argmax-changing builtin logits processor: after min-tokens and logit bias
          needs=frozenset({"ids", "tokens"}), value=lambda s, resolved: _thinking_budget(s, resolved),
          make=lambda cls, v, c: cls(*v)),
    Stage("softcap", (Param("softcap", float, "c * tanh(z / c) on the logits, c > 0.", panel="chain",
                            check=_gt0),), logits_only=True),
    Stage("repetition-penalty",
          (Param("repetition_penalty", float, "Divide positive / multiply negative logits of seen tokens (> 0; 1 = "
                 "off).", panel="chain", check=Check(lambda v: _finite(v) and v > 0, "must be > 0 (1 = off)"),
                 off={"hf": _ONE, "vllm": _ONE, "llamacpp": _ONE},
                 export={"hf": "repetition_penalty", "vllm": "repetition_penalty", "llamacpp": "--repeat-penalty"}),),
          engines={"hf": 2, "vllm": 4, "llamacpp": 1}, samplers={"llamacpp": "penalties"}, needs=frozenset({"ids"}),
          make=lambda cls, v, c: c.repetition(cls, v), windowed=True),
    Stage("frequency-penalty",
          (Param("frequency_penalty", float, "z -= A * (times the token was seen).",
                 off={"vllm": _ZERO, "llamacpp": _ZERO},
                 export={"vllm": "frequency_penalty", "llamacpp": "--frequency-penalty"}),),
          engines={"vllm": 5, "llamacpp": 2}, samplers={"llamacpp": "penalties"},
          needs=frozenset({"ids", "prompt_len"}),
          make=lambda cls, v, c: cls(value=v, **c.scope_of("frequency-penalty")), windowed=True,
          counts={"vllm": "output"}),
    Stage("presence-penalty",
          (Param("presence_penalty", float, "z -= A for every token already seen (once).",
                 off={"vllm": _ZERO, "llamacpp": _ZERO},
                 export={"vllm": "presence_penalty", "llamacpp": "--presence-penalty"}),),
          engines={"vllm": 6, "llamacpp": 3}, samplers={"llamacpp": "penalties"},
          needs=frozenset({"ids", "prompt_len"}),
          make=lambda cls, v, c: cls(value=v, **c.scope_of("presence-penalty")), windowed=True,
          counts={"vllm": "output"}),
    Stage("dry", (Param("dry_multiplier", float, "DRY: a token extending a repeat of n >= L tokens loses "
                        "M * base^(n - L) (0 < M).", off={"llamacpp": _ZERO},
                        export={"llamacpp": "--dry-multiplier", "llamacpp-server": "dry_multiplier"}),
                  Param("dry_base", float, "DRY base, >= 1 (default 1.75).", fallback=1.75,
                        export={"llamacpp": "--dry-base"}, defaults={"llamacpp": 1.75}),
                  Param("dry_allowed_length", int, "DRY: repeats up to this length are free (default 2).",
                        fallback=2, export={"llamacpp": "--dry-allowed-length"}, defaults={"llamacpp": 2}),
                  Param("dry_penalty_last_n", int, "DRY scans only the last N tokens (default all; llama.cpp: 64).",
                        off={"llamacpp": Off(0, lambda v: v == 0)}, export={"llamacpp": "--dry-penalty-last-n"},
                        defaults={"llamacpp": 64}),
                  Param("dry_breaker", str, "A DRY sequence breaker (repeatable; default llama.cpp's \\n : \" *; "
                        "without a model: token ids).", many=True, export={"llamacpp": "--dry-sequence-breaker"})),
          engines={"llamacpp": 4}, samplers={"llamacpp": "dry"}, needs=frozenset({"ids", "tokens"}), value=_dry,
          make=lambda cls, v, c: cls(**v)),
    Stage("no-repeat-ngram", (Param("no_repeat_ngram", int, "Ban tokens completing an n-gram already in the text.",
                                    panel="chain", check=Check(lambda v: v >= 1, "must be an integer >= 1"),
                                    export={"hf": "no_repeat_ngram_size"}),),
          engines={"hf": 3}, needs=frozenset({"ids"})),
    Stage("bias", (Param("logit_bias", str, "TOKEN=BIAS (repeatable); TOKEN is an id or a text that is one token; "
                         "-inf bans it.", pairs=True, panel="chain",
                         export={"hf": "sequence_bias", "vllm": "logit_bias", "llamacpp": "--logit-bias"}),),
          engines={"hf": 0, "vllm": 3, "llamacpp": 0}, needs=frozenset({"tokens"}), value=_bias),
    Stage("sequence-bias", (Param("sequence_bias", str, "TEXT=BIAS (repeatable): bias the last token of a "
                                  "multi-token text when the text so far ends with the rest of it.", pairs=True,
                                  export={"hf": "sequence_bias"}),),
          engines={"hf": 1}, needs=frozenset({"ids", "tokens"}), value=_texts("sequence-bias", "sequence_bias"),
          make=lambda cls, v, c: cls(tuple(v))),
    Stage("ban", (Param("ban", str, "A multi-token text never to produce (repeatable).", many=True,
                        export={"hf": "bad_words_ids", "vllm": "bad_words"}),),
          engines={"hf": 4, "vllm": 1}, needs=frozenset({"ids", "tokens"}), value=_texts("ban", "ban"),
          make=lambda cls, v, c: cls(sequences=tuple(v))),
    Stage("min-new-tokens", (Param("min_new_tokens", int, "Ban EOS (and --stop-id) until N tokens were generated.",
                                   export={"hf": "min_new_tokens", "vllm": "min_tokens"}),),
          engines={"hf": 5, "vllm": 2}, needs=frozenset({"end_ids", "prompt_len"}),
          make=lambda cls, v, c: cls(v, tuple(c.end_ids))),
    Stage("temperature", (Param("temperature", float, "Divide logits by T; 0 = greedy.", short="-t", panel="chain",
                                check=Check(lambda v: _finite(v) and v >= 0, "must be >= 0 (0 means greedy)"),
                                fallback=1.0, off={"hf": _ONE, "vllm": _ONE, "llamacpp": _ONE},
                                export={"hf": "temperature", "vllm": "temperature", "llamacpp": "--temp"},
                                defaults={"llamacpp": 0.8}),),
          engines={"hf": 7, "vllm": 7, "llamacpp": 11}, samplers={"llamacpp": "temperature"}, value=_temperature,
          warper=True, scales=True),
    Stage("dynatemp", (Param("dynatemp_range", float, "Dynamic temperature: t +- R by the normalized entropy.",
                             off={"llamacpp": _NOT_POSITIVE},
                             export={"llamacpp": "--dynatemp-range", "llamacpp-server": "dynatemp_range"}),
                       Param("dynatemp_exponent", float, "Dynamic temperature exponent (default 1).", fallback=1.0,
                             export={"llamacpp": "--dynatemp-exp"}, defaults={"llamacpp": 1.0})),
          engines={"llamacpp": 12}, samplers={"llamacpp": "temperature"}, value=_dynatemp,
          make=lambda cls, v, c: cls(**v), warper=True, scales=True, replaces="temperature",
          # llama_sampler_temp_ext_apply: normalized entropy = H / log(size of the array), -inf candidates counted
          notes={"llamacpp": "dynatemp: llama.cpp normalizes the entropy by log of every candidate, those already at "
                             "-inf included (a filter before it lowers T); decodelab keeps its rule (log of the "
                             "candidates left)"}),
    Stage("top-n-sigma", (Param("top_n_sigma", float, "Keep z >= max z - N * std(z).",
                                off={"llamacpp": Off(-1.0, lambda v: v <= 0)},  # since llama.cpp PR 13345
                                export={"llamacpp": "--top-nsigma", "llamacpp-server": "top_n_sigma"}),),
          engines={"llamacpp": 5}, samplers={"llamacpp": "top_n_sigma"}, warper=True),
    Stage("top-k", (Param("top_k", int, "Keep the k most likely tokens.", panel="chain",
                          check=Check(lambda v: v >= 1, "must be an integer >= 1"),
                          off={"hf": Off(0, lambda v: v == 0), "vllm": Off(0, lambda v: v in (0, -1)),
                               "llamacpp": _NOT_POSITIVE},
                          export={"hf": "top_k", "vllm": "top_k", "llamacpp": "--top-k"},
                          defaults={"hf": 50, "llamacpp": 40}),),
          engines={"hf": 8, "vllm": 9, "llamacpp": 6}, samplers={"llamacpp": "top_k"}, warper=True),
    Stage("top-p", (Param("top_p", float, "Keep the smallest set reaching this mass, (0, 1].", panel="chain",
                          check=Check(lambda v: 0 < v <= 1, "must be in (0, 1]"),
                          off={"hf": _AT_LEAST_ONE, "vllm": _AT_LEAST_ONE, "llamacpp": _AT_LEAST_ONE},
                          export={"hf": "top_p", "vllm": "top_p", "llamacpp": "--top-p"},
                          defaults={"llamacpp": 0.95}),),
          engines={"hf": 9, "vllm": 10, "llamacpp": 8}, samplers={"llamacpp": "top_p"}, warper=True),
    Stage("min-p", (Param("min_p", float, "Keep tokens with p >= min_p * p_max, [0, 1].", panel="chain",
                          check=Check(lambda v: 0 <= v <= 1, "must be in [0, 1]"),
                          off={"hf": _ZERO, "vllm": _ZERO, "llamacpp": Off(0.0, lambda v: v <= 0)},
                          export={"hf": "min_p", "vllm": "min_p", "llamacpp": "--min-p"},
                          defaults={"llamacpp": 0.05},
                          checks={"llamacpp": Check(lambda v: _finite(v), "must be a number (above 1 keeps one "
                                                    "token, <= 0 is off)")}),),
          engines={"hf": 10, "vllm": 8, "llamacpp": 9}, samplers={"llamacpp": "min_p"}, warper=True),
    Stage("typical-p", (Param("typical_p", float, "Locally typical sampling mass, (0, 1].", panel="chain",
                              check=Check(lambda v: 0 < v <= 1, "must be in (0, 1]"),
                              off={"hf": _AT_LEAST_ONE, "llamacpp": _AT_LEAST_ONE},
                              export={"hf": "typical_p", "llamacpp": "--typical", "llamacpp-server": "typical_p"}),),
          engines={"hf": 11, "llamacpp": 7}, samplers={"llamacpp": "typ_p"}, warper=True,
          # llama_sampler_typical_apply: entropy = -sum p log p over every candidate; one -inf logit (p = 0, 0 x log 0
          # = NaN) makes it NaN and no candidate passes the comparison with it, so the stage keeps everything
          notes={"llamacpp": "typical_p: llama.cpp's typical sampling does nothing once a candidate is at -inf (its "
                             "entropy takes 0 x log 0 = NaN); decodelab keeps its rule (0 log 0 = 0, removed "
                             "candidates ranked last)"}),
    Stage("epsilon-cutoff", (Param("epsilon_cutoff", float, "Remove tokens with p < E, (0, 1).",
                                   off={"hf": _ZERO}, export={"hf": "epsilon_cutoff"}),),
          engines={"hf": 12}, warper=True),
    Stage("eta-cutoff", (Param("eta_cutoff", float, "Remove tokens with p < min(E, sqrt(E) exp(-entropy)), (0, 1).",
                               off={"hf": _ZERO}, export={"hf": "eta_cutoff"}),),
          engines={"hf": 13}, warper=True),
    Stage("xtc", (Param("xtc_probability", float, "XTC: with this probability (a coin from --seed) remove every top "
                        "choice but the least likely.", off={"llamacpp": Off(0.0, lambda v: v <= 0)},
                        export={"llamacpp": "--xtc-probability", "llamacpp-server": "xtc_probability"}),
                  Param("xtc_threshold", float, "XTC: tokens with p >= T are the top choices (default 0.1).",
                        fallback=0.1, off={"llamacpp": Off(0.1, lambda v: v > 0.5)},
                        export={"llamacpp": "--xtc-threshold"},
                        defaults={"llamacpp": 0.1})),
          engines={"llamacpp": 10}, samplers={"llamacpp": "xtc"}, needs=frozenset({"generator", "state"}), value=_xtc,
          make=lambda cls, v, c: cls(v["threshold"], v["probability"], c.generator), warper=True),
    Stage("mirostat", (Param("mirostat_tau", float, "Mirostat 2.0 target surprise in bits (default 5).",
                             fallback=5.0, export={"llamacpp": "--mirostat-ent"}),
                       Param("mirostat_eta", float, "Mirostat 2.0 learning rate (default 0.1).", fallback=0.1,
                             export={"llamacpp": "--mirostat-lr"})),
          engines={"llamacpp": 13}, needs=frozenset({"state"}), value=_mirostat, make=lambda cls, v, c: cls(**v),
          warper=True, any_field=True,
          alone={"llamacpp": ("constraint", "bias", "temperature")}),  # common_sampler_init; the grammar: no chain
]
BY_NAME: dict[str, Stage] = {s.name: s for s in STAGES}
DEFAULT_ORDER: tuple[str, ...] = tuple(s.name for s in STAGES)

# fields of the chain that belong to no single stage
CHAIN_PARAMS: tuple[Param, ...] = (
    Param("penalty_last_n", int, "The penalties count only the last N tokens (llama.cpp's last-n; 0 = none).",
          check=Check(lambda v: v >= 0, "must be an integer >= 0"), export={"llamacpp": "--repeat-last-n"},
          defaults={"llamacpp": 64}),
    Param("think_tags", str, "The thinking markers START,END (e.g. '<think>,</think>'); default: those of the "
          "tokenizer's chat template when it writes <think>. Traces split reasoning from answer by them.",
          panel="constraint", metavar="START,END"),
    Param("constraint_after_think", bool, "The constraint starts after the end-of-thinking marker (inactive while "
          "the model thinks).", panel="constraint"),
)


def params() -> list[Param]:
    """Every settings field a stage reads, in stage order (a field two stages read, once)."""
    out, seen = [], set()
    for p in [p for s in STAGES for p in s.params] + list(CHAIN_PARAMS):
        if p.field not in seen:
            seen.add(p.field)
            out.append(p)
    return out


def param(field_name: str) -> Param:
    return next(p for p in params() if p.field == field_name)


def stage_of(field_name: str) -> Stage | None:
    """The stage a settings field belongs to (None: a field of the chain, such as penalty_last_n)."""
    return next((s for s in STAGES if field_name in s.fields), None)


def scaling_stage() -> str:
    """The name of the stage that divides the logits by the temperature (whose temperature 0 is greedy)."""
    return stage_of("temperature").name


def constraint_stage() -> str:
    """The name of the stage that restricts the output to a language (--regex, --json-schema, --grammar, --choice)."""
    return stage_of("regex").name


def windowed() -> tuple[str, ...]:
    """The penalties on the tokens seen whose window is --penalty-last-n (each row's ``windowed``)."""
    return tuple(s.name for s in STAGES if s.windowed)


def check_range(p: Param, value, engine: str | None = None) -> None:
    """A field's value against its entry's range (None: not set), the engine's own where it has one (``checks``:
    llama.cpp's min-p above 1); a value outside it is one line naming the option. Torch-free, so the CLI can report
    ``--top-p 1.5`` before torch is imported."""
    check = p.checks.get(engine, p.check)
    if check is not None and value is not None:
        _check(check.ok(value), p.field, value, check.allowed)


def stateful(names) -> list[str]:
    """The stages among ``names`` whose output is not a function of the prefix alone (``needs`` "state": their own
    coin, or state carried from step to step)."""
    return [n for n in names if "state" in BY_NAME[n].needs]


def sampler_names(engine: str) -> dict[str, str]:
    """Stage -> the engine's name for it in a sampler list, from each row's ``samplers`` (llama.cpp's --samplers:
    common/sampling.cpp common_sampler_type_to_str)."""
    return {s.name: s.samplers[engine] for s in STAGES if engine in s.samplers}


def engine_order(engine: str) -> tuple[str, ...]:
    """The stages an engine has, in its own order."""
    return tuple(s.name for s in sorted((s for s in STAGES if engine in s.engines), key=lambda s: s.engines[engine]))


def implements(name: str, variant: str | None = None):
    """Bind a stage class to its registry entry (its family module says ``@implements("top-p")``); a ``variant`` is
    another form of the same stage (the windowed repetition penalty)."""

    def bind(cls):
        if variant is None:
            BY_NAME[name].cls = cls
        else:
            BY_NAME[name].variants[variant] = cls
        return cls

    return bind


@dataclass
class StageContext:
    """What the stages need besides their value, handed in when the chain is built."""

    generator: object | None = None  # the run's torch.Generator (the selector's): XTC's coin
    engine: str | None = None  # whose reading the chain follows: a stage with a variant for it runs that variant
    end_ids: tuple[int, ...] = ()  # what min-new-tokens bans: EOS (and stop ids where the engine does)
    eos_ids: tuple[int, ...] = ()  # the model's end ids: the constraint allows them exactly where its grammar accepts
    tokens: object | None = None  # the run's sampling.tokens.Tokens: the constraint reads its tokenizer and width
    counting: dict[str, tuple[str, int | None]] = field(default_factory=dict)  # penalty -> (scope, last_n)

    def scope_of(self, name: str) -> dict:
        scope, last_n = self.counting.get(name, ("all", None))
        return {"scope": scope, "last_n": last_n}

    def counts_differently(self, name: str) -> bool:
        return self.counting.get(name, ("all", None)) != ("all", None)

    def repetition(self, cls, penalty: float):
        """The CTRL penalty over the whole sequence, or its windowed / output-only form when counting says so."""
        if self.counts_differently("repetition-penalty"):
            return BY_NAME["repetition-penalty"].variants["windowed"](penalty=penalty, **self.scope_of("repetition-penalty"))
        return cls(penalty)
