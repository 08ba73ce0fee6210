"""`--export hf|vllm|llamacpp`: the current settings, as decodelab reads them (``--semantics`` included), written for
another engine: transformers ``generate`` keyword arguments, vLLM ``SamplingParams`` arguments, llama.cpp command-line
flags. What the engine cannot express is listed in ``unsupported``; what it would do differently in ``notes``.

The exported values reproduce decodelab's reading, not the engine's defaults: a stage decodelab leaves off is
switched off explicitly where the engine has it on by default (transformers' top_k=50 when sampling, llama.cpp's
top_k 40 / top_p 0.95 / min_p 0.05 / temp 0.8), and llama.cpp gets decodelab's stage order in ``--samplers``.
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass, field, replace

from ..engine.served import SamplingSettings
from ..errors import ConfigError
from .semantics import (
    ENGINE_NAMES,
    ENGINE_STAGES,
    HF_ORDER,
    LLAMACPP_ORDER,
    VLLM_ORDER,
    merge_order,
    plan,
)
from .constraint import ConstraintSpec, constraint_spec
from .settings import ChainSettings
from .registry import BY_NAME
from .tokens import resolve_token_settings

TARGETS = ("hf", "vllm", "llamacpp")
LLAMACPP_SAMPLER_NAMES = {  # common/sampling.cpp common_sampler_type_to_str
    "repetition-penalty": "penalties", "frequency-penalty": "penalties", "presence-penalty": "penalties",
    "dry": "dry", "top-n-sigma": "top_n_sigma", "top-k": "top_k", "typical-p": "typ_p", "top-p": "top_p",
    "min-p": "min_p", "xtc": "xtc", "temperature": "temperature", "dynatemp": "temperature",
}


@dataclass
class Export:
    target: str
    arguments: dict | list[str]  # generate kwargs / SamplingParams kwargs / llama.cpp flags
    unsupported: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def command(self) -> str | None:
        """llama.cpp: one shell line."""
        if self.target != "llamacpp":
            return None
        return "llama-cli " + " ".join(shlex.quote(a) for a in self.arguments)

    def to_dict(self) -> dict:
        out = {"export": self.target, "arguments": self.arguments, "unsupported": self.unsupported,
               "notes": self.notes}
        if self.target == "llamacpp":
            out["command"] = self.command()
        return out


def export(settings: ChainSettings, target: str, vocab: int, encode=None, token_id=None, eos_ids=()) -> Export:
    """``settings``: ChainSettings or SampleSettings (then -n, --seed, --stop, --stop-id, --ignore-eos and
    --trim-stop are exported too). Token-naming settings are resolved with ``encode`` / ``token_id`` if given,
    else they must be ids."""
    if target not in TARGETS:
        raise ConfigError(f"--export {target!r}: allowed: {', '.join(TARGETS)}")
    p = plan(settings)
    s = p.settings
    bias, resolved = resolve_token_settings(s, vocab, encode, token_id)
    active = list(s.chain or ())
    out = Export(target, {})
    lacking = [n for n in active if n not in ENGINE_STAGES[target]]
    if lacking:
        out.unsupported += [f"{n}: {ENGINE_NAMES[target]} has no such stage" for n in lacking]
    engine_order = merge_order({"hf": HF_ORDER, "vllm": VLLM_ORDER, "llamacpp": LLAMACPP_ORDER}[target],
                               [n for n in active if n not in lacking])
    ours = [n for n in active if n not in lacking]
    if target != "llamacpp" and ours != engine_order:
        first = next(i for i, (a, b) in enumerate(zip(ours, engine_order)) if a != b)
        out.notes.append(f"order differs: decodelab runs {ours[first]} before {engine_order[first]}, "
                         f"{ENGINE_NAMES[target]} the other way round (results differ when both change logits)")
    {"hf": _hf, "vllm": _vllm, "llamacpp": _llamacpp}[target](s, p, bias, resolved, settings, eos_ids, out)
    return out


def _sampling(s: ChainSettings, p) -> bool:
    """Whether decodelab draws (vs greedy) under this plan."""
    return p.selector != "greedy"


def _sample_fields(settings) -> dict:
    return {k: getattr(settings, k, None) for k in ("max_new_tokens", "seed", "stop", "stop_id", "ignore_eos",
                                                     "trim_stop")}


def _hf(s, p, bias, resolved, settings, eos_ids, out: Export) -> None:
    kw: dict = {}
    sample = _sample_fields(settings)
    sampling = _sampling(s, p)
    kw["do_sample"] = sampling
    if sampling:
        kw["temperature"] = 1.0 if s.temperature is None else s.temperature
        kw["top_k"] = 0 if s.top_k is None else s.top_k  # 0: off (transformers would use 50)
        for key, value in (("top_p", s.top_p), ("min_p", s.min_p), ("typical_p", s.typical_p),
                           ("epsilon_cutoff", s.epsilon_cutoff), ("eta_cutoff", s.eta_cutoff)):
            if value is not None:
                kw[key] = value
    if s.repetition_penalty is not None:
        kw["repetition_penalty"] = s.repetition_penalty
    if s.no_repeat_ngram is not None:
        kw["no_repeat_ngram_size"] = s.no_repeat_ngram
    # a -inf bias is a ban: bad_words_ids (JSON has no -inf; NoBadWordsLogitsProcessor masks exactly the same)
    pairs = [((t,), b) for t, b in bias.items()] + list(resolved["sequence-bias"])
    seq = [[list(ids), b] for ids, b in pairs if b != float("-inf")]
    bans = [list(ids) for ids, b in pairs if b == float("-inf")] + [list(ids) for ids in resolved["ban"]]
    if seq:
        kw["sequence_bias"] = seq
    if bans:
        kw["bad_words_ids"] = bans
    if s.min_new_tokens is not None:
        kw["min_new_tokens"] = s.min_new_tokens
    if sample["max_new_tokens"] is not None:
        kw["max_new_tokens"] = sample["max_new_tokens"]
        if sample["ignore_eos"]:
            kw["min_new_tokens"] = sample["max_new_tokens"]
            out.notes.append("ignore_eos: transformers has no such flag; min_new_tokens = max_new_tokens bans EOS")
    ends = list(eos_ids) + list(sample["stop_id"] or ())
    if sample["stop_id"]:
        kw["eos_token_id"] = ends  # every id in the list ends generation
    if sample["stop"]:
        kw["stop_strings"] = list(sample["stop"])
        out.notes.append("stop_strings needs generate(..., tokenizer=tokenizer); the stop string stays in the text")
    if s.allow:
        out.unsupported.append("allow: transformers takes a prefix_allowed_tokens_fn callable, not a list")
    if sample["seed"] is not None and sampling:
        out.notes.append(f"call torch.manual_seed({sample['seed']}) right before generate; with --semantics hf "
                         "decodelab then draws the same tokens")
    if sampling and p.selector != "hf-multinomial":
        out.notes.append("decodelab's draw (exponential race) follows the same law as torch.multinomial but not "
                         "the same stream: use --semantics hf for the same tokens")
    if s.penalty_last_n is not None or p.counting:
        out.unsupported.append("penalty window / output-only counting: transformers counts the whole sequence")
    out.arguments = kw


def _vllm(s, p, bias, resolved, settings, eos_ids, out: Export) -> None:
    kw: dict = {}
    sample = _sample_fields(settings)
    kw["temperature"] = (1.0 if s.temperature is None else s.temperature) if _sampling(s, p) else 0.0
    if _sampling(s, p):
        for key, value in (("top_p", s.top_p), ("top_k", s.top_k), ("min_p", s.min_p)):
            if value is not None:
                kw[key] = value
    for key, value in (("repetition_penalty", s.repetition_penalty), ("presence_penalty", s.presence_penalty),
                       ("frequency_penalty", s.frequency_penalty), ("min_tokens", s.min_new_tokens)):
        if value is not None:
            kw[key] = value
    if (s.presence_penalty is not None or s.frequency_penalty is not None) and p.engine != "vllm":
        out.notes.append("vLLM's presence and frequency penalties count generated tokens only; decodelab counted "
                         "the prompt too")
    if bias:
        kw["logit_bias"] = {t: (b if math.isfinite(b) else -100.0) for t, b in bias.items()}
        if any(not math.isfinite(b) for b in bias.values()):
            out.notes.append("logit_bias -inf written as -100 (the OpenAI-compatible range is [-100, 100])")
    if resolved["allow"]:
        kw["allowed_token_ids"] = sorted(set(resolved["allow"]))
    if s.ban:
        kw["bad_words"] = list(s.ban)
    if sample["seed"] is not None:
        kw["seed"] = sample["seed"]
    if sample["max_new_tokens"] is not None:
        kw["max_tokens"] = sample["max_new_tokens"]
    if sample["stop"]:
        kw["stop"] = list(sample["stop"])
        trim = p.trim_stop if sample["trim_stop"] is None else sample["trim_stop"]
        kw["include_stop_str_in_output"] = not trim
    if sample["stop_id"]:
        kw["stop_token_ids"] = list(sample["stop_id"])
    if sample["ignore_eos"]:
        kw["ignore_eos"] = True
    if s.penalty_last_n is not None:
        out.unsupported.append("penalty_last_n: vLLM's penalties count the whole sequence")
    spec = _spec(s)
    if spec is not None:
        kw["structured_outputs"] = _vllm_structured(spec)
        if spec.kind == "grammar":
            out.notes.append("structured_outputs grammar: vLLM's xgrammar backend reads GBNF/EBNF, its guidance "
                             "backend Lark; decodelab read it with llguidance")
    out.arguments = kw


def _spec(s: ChainSettings) -> ConstraintSpec | None:
    return constraint_spec(regex=s.regex, json_schema=s.json_schema, grammar=s.grammar, choice=s.choice)


def _vllm_structured(spec: ConstraintSpec) -> dict:
    """vLLM's StructuredOutputsParams: one of regex, json (the schema itself), grammar (its text), choice."""
    if spec.kind == "json-schema":
        return {"json": json.loads(spec.source)}
    if spec.kind == "choice":
        return {"choice": list(spec.labels)}
    return {spec.kind: spec.source}


def _gbnf_string(text: str) -> str:
    """A GBNF string literal: double quotes, with backslash, quote and the control characters escaped."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return '"' + escaped.replace("\t", "\\t") + '"'


def _flag_number(x: float) -> str:
    return f"{x:g}"


def _llamacpp(s, p, bias, resolved, settings, eos_ids, out: Export) -> None:
    flags: list[str] = []
    sample = _sample_fields(settings)
    sampling = _sampling(s, p)
    # switch llama.cpp's defaults off where decodelab has the stage off
    flags += ["--temp", _flag_number((1.0 if s.temperature is None else s.temperature) if sampling else 0.0)]
    flags += ["--top-k", str(s.top_k or 0), "--top-p", _flag_number(1.0 if s.top_p is None else s.top_p),
              "--min-p", _flag_number(0.0 if s.min_p is None else s.min_p)]
    if s.typical_p is not None:
        flags += ["--typical", _flag_number(s.typical_p)]
    penalties = [s.repetition_penalty, s.frequency_penalty, s.presence_penalty]
    if any(v is not None for v in penalties):
        window = p.counting.get("repetition-penalty", ("all", None))[1]
        window = p.counting.get("frequency-penalty", ("all", window))[1] if window is None else window
        flags += ["--repeat-last-n", str(-1 if window is None else window)]
        if any(scope == "output" for scope, _ in p.counting.values()):
            out.notes.append("llama.cpp's penalties count prompt and output; decodelab counted the output only")
    if s.repetition_penalty is not None:
        flags += ["--repeat-penalty", _flag_number(s.repetition_penalty)]
    if s.frequency_penalty is not None:
        flags += ["--frequency-penalty", _flag_number(s.frequency_penalty)]
    if s.presence_penalty is not None:
        flags += ["--presence-penalty", _flag_number(s.presence_penalty)]
    if s.dry_multiplier is not None:
        dry = BY_NAME["dry"].value(s, {})
        flags += ["--dry-multiplier", _flag_number(dry["multiplier"]), "--dry-base", _flag_number(dry["base"]),
                  "--dry-allowed-length", str(dry["allowed_length"]),
                  "--dry-penalty-last-n", str(-1 if dry["last_n"] is None else dry["last_n"])]
        for text in s.dry_breaker or ():
            flags += ["--dry-sequence-breaker", text]
    if s.xtc_probability is not None:
        xtc = BY_NAME["xtc"].value(s, {})
        flags += ["--xtc-probability", _flag_number(xtc["probability"]), "--xtc-threshold",
                  _flag_number(xtc["threshold"])]
    if s.top_n_sigma is not None:
        flags += ["--top-nsigma", _flag_number(s.top_n_sigma)]
    if s.dynatemp_range is not None:
        flags += ["--dynatemp-range", _flag_number(s.dynatemp_range), "--dynatemp-exp",
                  _flag_number(1.0 if s.dynatemp_exponent is None else s.dynatemp_exponent)]
    if s.mirostat_tau is not None or s.mirostat_eta is not None:
        m = BY_NAME["mirostat"].value(s, {})
        flags += ["--mirostat", "2", "--mirostat-ent", _flag_number(m["tau"]), "--mirostat-lr", _flag_number(m["eta"])]
        out.notes.append("with --mirostat llama.cpp runs only logit bias, temperature and mirostat")
    for t, b in bias.items():
        flags += ["--logit-bias", f"{t}{'+' if b >= 0 else '-'}{'inf' if math.isinf(b) else _flag_number(abs(b))}"]
    order = [LLAMACPP_SAMPLER_NAMES[n] for n in (s.chain or ()) if n in LLAMACPP_SAMPLER_NAMES]
    flags += ["--samplers", ";".join(dict.fromkeys(order))]
    if sample["seed"] is not None:
        flags += ["--seed", str(sample["seed"])]
    if sample["max_new_tokens"] is not None:
        flags += ["-n", str(sample["max_new_tokens"])]
    for text in sample["stop"] or ():
        flags += ["--reverse-prompt", text]
    if sample["ignore_eos"]:
        flags += ["--ignore-eos"]
    if sample["stop_id"]:
        out.unsupported.append("stop-id: llama.cpp stops on the model's end-of-generation tokens only")
    if sampling:
        out.notes.append("llama.cpp draws with its own RNG (std::mt19937): the same law, not the same tokens")
    flags += _llamacpp_constraint(_spec(s), out)
    out.arguments = flags


def _llamacpp_constraint(spec: ConstraintSpec | None, out: Export) -> list[str]:
    """llama.cpp takes a JSON schema and GBNF: --json-schema, --grammar-file, and --choice written as GBNF."""
    if spec is None:
        return []
    if spec.kind == "json-schema":
        return ["--json-schema", json.dumps(json.loads(spec.source), separators=(",", ":"))]
    if spec.kind == "choice":
        return ["--grammar", "root ::= " + " | ".join(_gbnf_string(label) for label in spec.labels)]
    if spec.kind == "grammar" and "::=" in spec.source:  # GBNF (a Lark rule is written `name: ...`)
        return ["--grammar-file", spec.value]
    what = "a Lark grammar (llama.cpp reads GBNF)" if spec.kind == "grammar" else "a regex (llama.cpp has none)"
    out.unsupported.append(f"{spec}: {what}")
    return []


# --- a served engine's request ------------------------------------------------------------------------------------

# vLLM export keyword -> the served client's field (every other field keeps its neutral value: stage off)
SERVED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "min_tokens", "seed", "max_tokens", "stop", "include_stop_str_in_output",
                 "stop_token_ids", "ignore_eos", "logit_bias", "allowed_token_ids", "bad_words")


def served_settings(settings, top: int, vocab: int, encode=None, token_id=None,
                    eos_ids=()) -> tuple[SamplingSettings, list[str]]:
    """The request a served engine gets for ``settings`` (SampleSettings): the settings read as vLLM reads them
    (``--semantics vllm``: its order, off-values, output-only penalty counting), exported as vLLM's sampling
    parameters (:func:`export`), every field of the request then written out (a field left out would be filled
    from the model's generation_config by the server). A stage vLLM has no equivalent for is refused with one
    line; ``top``: alternatives per step. Returns the request's settings and the export's notes."""
    if settings.semantics not in (None, "vllm"):
        raise ConfigError(f"--semantics {settings.semantics}: a served engine reads the settings as vLLM does; "
                          "drop --semantics or give vllm")
    if settings.penalty_last_n is not None:  # vLLM's reading would drop it with a note: refused, not ignored
        raise ConfigError("--penalty-last-n: vLLM's penalties count the whole sequence (a served engine has no "
                          "window); drop it or run without --engine")
    out = export(replace(settings, semantics="vllm"), "vllm", vocab, encode, token_id, eos_ids)
    if out.unsupported:
        name, _, why = out.unsupported[0].partition(": ")
        option = BY_NAME[name].params[0].option if name in BY_NAME else "--" + name.replace("_", "-")
        raise ConfigError(f"{option}: {why} (a served engine has no equivalent); drop it or run without --engine")
    unsent = [k for k in out.arguments if k not in SERVED_FIELDS]
    if unsent:  # written by the export but not by the client (vLLM's structured_outputs): refused, never dropped
        raise ConfigError(f"--engine: {unsent[0]} (a constraint stage) is not sent to a served engine; drop "
                          "--regex/--json-schema/--grammar/--choice or run without --engine")
    kw = dict(out.arguments)
    for key in ("stop", "stop_token_ids", "allowed_token_ids", "bad_words"):
        if key in kw:
            kw[key] = tuple(kw[key])
    if "logit_bias" in kw:
        kw["logit_bias"] = {int(t): float(b) for t, b in kw["logit_bias"].items()}
    if "top_k" in kw and kw["top_k"] is None:
        kw.pop("top_k")
    return SamplingSettings(logprobs=top, **kw), list(out.notes)
