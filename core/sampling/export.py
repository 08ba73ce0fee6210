"""`--export hf|vllm|llamacpp`: the current settings, as decodelab reads them (``--semantics`` included), written for
another engine: transformers ``generate`` keyword arguments, vLLM ``SamplingParams`` arguments, llama.cpp command-line
flags. What the engine cannot express is listed in ``unsupported``; what it would do differently in ``notes``.

The exported values reproduce decodelab's reading, not the engine's defaults. Every field an engine could fill
from elsewhere is written: transformers and a vLLM server fill a missing sampling field from the model's
generation_config, and llama.cpp has its own defaults (top_k 40, top_p 0.95, min_p 0.05, temp 0.8), so a stage
decodelab leaves off is written with the engine's off-value (the registry's ``Param.off``), and llama.cpp gets
decodelab's stage order in ``--samplers``. Names and flags come from the registry (``Param.export``); what is
engine-wide (do_sample, greedy as temperature 0, mirostat's chain, stop rules, bans as bad words) is here.
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass, field, replace

from ..engine.http.llamacpp import LlamacppAdapter
from ..engine.http.wire import SamplingSettings
from ..engine.loops import parse_repetition_stop
from ..errors import ConfigError
from . import registry
from .registry import BY_NAME, STAGES, constraint_stage, effective, param, params, sampler_names, stage_of, windowed
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
from .tokens import resolve_token_settings

TARGETS = ("hf", "vllm", "llamacpp")
# what a vLLM server fills from the model's generation_config when a request lacks it
# (vllm/config/model.py get_diff_sampling_param; max_new_tokens is -n's)
VLLM_SERVER_FILLED = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p",
                      "min_p")
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


def export(settings: ChainSettings, target: str, vocab: int, encode=None, token_id=None, eos_ids=(),
           context: int | None = None) -> Export:
    """``settings``: ChainSettings or SampleSettings (then -n, --seed, --stop, --stop-id, --ignore-eos and
    --trim-stop are exported too). Token-naming settings are resolved with ``encode`` / ``token_id`` if given,
    else they must be ids. ``context``: the most tokens a run holds (the model's context), the window llama.cpp is
    given for "every token"."""
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
    {"hf": _hf, "vllm": _vllm, "llamacpp": _llamacpp}[target](s, p, bias, resolved, settings, eos_ids, out,
                                                                 context)
    _thinking_and_loops(s, settings, target, out)
    return out


def _thinking_and_loops(s, settings, target: str, out: Export) -> None:
    """--thinking-budget, --constraint-after-think and --repetition-stop (docs/reasoning.md): vLLM's request fields
    where it has them, with what the server must provide; refused for the engines without them."""
    repetition = getattr(settings, "repetition_stop", None)
    if target != "vllm":
        for given, what in ((s.constraint_after_think, "constraint-after-think"), (repetition, "repetition-stop")):
            if given:
                out.unsupported.append(f"{what}: {ENGINE_NAMES[target]} has no such option")
        return
    if s.thinking_budget is not None:
        out.arguments["thinking_token_budget"] = s.thinking_budget
        out.notes.append("thinking_token_budget acts only on a server started with a reasoning config naming the "
                         "markers (think_start_str / think_end_str); decodelab's --think-tags are not sent")
    if s.constraint_after_think:
        out.notes.append("constraint after thinking: vLLM starts structured outputs at the end of reasoning only when "
                         "served with a --reasoning-parser for the model; the markers are the server's")
    if repetition:
        rule = parse_repetition_stop(repetition)
        out.arguments["repetition_detection"] = {"max_pattern_size": rule.max_pattern_size,
                                                 "min_count": rule.min_count,
                                                 "min_pattern_size": rule.min_pattern_size}


def _sampling(p) -> bool:
    """Whether decodelab draws (vs greedy) under this plan."""
    return p.selector != "greedy"


def _counted(s: ChainSettings, p) -> list[tuple[str, int | None]]:
    """(scope, window) of each penalty that runs: what the plan counts ("all" and None when it names none)."""
    return [p.counting.get(name, ("all", None)) for name in windowed() if name in (s.chain or ())]


def _sample_fields(settings) -> dict:
    return {k: getattr(settings, k, None) for k in ("max_new_tokens", "seed", "stop", "stop_id", "ignore_eos",
                                                     "trim_stop")}


def stage_fields(target: str, s: ChainSettings, sampling: bool) -> dict:
    """Registry field -> value for every one-value field the target names (``Param.export``) of a stage it has:
    decodelab's value, or the target's off-value (``Param.off``) where the stage is off here but the target could
    switch it on from its own defaults. Stages that act only when sampling are left out of a greedy export."""
    out = {}
    for stage in STAGES:
        # the constraint is written whole, once (_vllm_structured, _llamacpp_constraint)
        if target not in stage.engines or (stage.warper and not sampling) or stage.name == constraint_stage():
            continue
        for i, p in enumerate(stage.params):
            if target not in p.export or p.many or p.pairs:
                continue
            value = getattr(s, p.field)
            if value is None and target in p.off and i == 0:  # the field that switches the stage on
                value = p.off[target].value
            if value is not None:
                out[p.field] = value
    return out


def _hf(s, p, bias, resolved, settings, eos_ids, out: Export, context) -> None:
    kw: dict = {}
    sample = _sample_fields(settings)
    sampling = _sampling(p)
    kw["do_sample"] = sampling
    for name, value in stage_fields("hf", s, sampling).items():
        kw[param(name).export["hf"]] = value
    # a -inf bias is a ban: bad_words_ids (JSON has no -inf; NoBadWordsLogitsProcessor masks exactly the same)
    pairs = [((t,), b) for t, b in bias.items()] + list(resolved[stage_of("sequence_bias").name])
    seq = [[list(ids), b] for ids, b in pairs if b != float("-inf")]
    bans = [list(ids) for ids, b in pairs if b == float("-inf")] + [list(ids) for ids in resolved[stage_of("ban").name]]
    if seq:
        kw[param("sequence_bias").export["hf"]] = seq
    if bans:
        kw[param("ban").export["hf"]] = bans
    if sample["max_new_tokens"] is not None:
        kw["max_new_tokens"] = sample["max_new_tokens"]
        if sample["ignore_eos"]:
            kw["min_new_tokens"] = sample["max_new_tokens"]
            out.notes.append("ignore_eos: transformers has no such flag; min_new_tokens = max_new_tokens bans EOS")
    ends = list(eos_ids) + list(sample["stop_id"] or ())
    if sample["stop_id"]:
        kw["eos_token_id"] = ends  # every id in the list ends generation (and min_new_tokens bans them all)
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
    if any(scope == "output" or window is not None for scope, window in _counted(s, p)):
        out.unsupported.append("penalty window / output-only counting: transformers counts the whole sequence")
    out.arguments = kw


def _vllm(s, p, bias, resolved, settings, eos_ids, out: Export, context) -> None:
    kw: dict = {}
    sample = _sample_fields(settings)
    sampling = _sampling(p)
    values = stage_fields("vllm", s, sampling)
    if not sampling:  # greedy: temperature 0 (vLLM then ignores top-p, top-k and min-p)
        values.update({f: param(f).off["vllm"].value for f in ("top_p", "top_k", "min_p")}, temperature=0.0)
    for name, value in values.items():
        kw[param(name).export["vllm"]] = value
    missing = [f for f in VLLM_SERVER_FILLED if param(f).export["vllm"] not in kw]
    assert not missing, missing  # each of the seven has an off-value in the registry
    if (s.presence_penalty is not None or s.frequency_penalty is not None) and p.engine != "vllm":
        out.notes.append("vLLM's presence and frequency penalties count generated tokens only; decodelab counted "
                         "the prompt too")
    if bias:
        kw[param("logit_bias").export["vllm"]] = {t: (b if math.isfinite(b) else -100.0) for t, b in bias.items()}
        if any(not math.isfinite(b) for b in bias.values()):
            out.notes.append("logit_bias -inf written as -100 (the OpenAI-compatible range is [-100, 100])")
    allow = resolved[stage_of("allow").name]
    if allow:
        kw[param("allow").export["vllm"]] = sorted(set(allow))
    if s.ban:
        kw[param("ban").export["vllm"]] = list(s.ban)
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
    if any(window is not None for _, window in _counted(s, p)):
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


def _flag_number(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _window(last_n: int | None, what: str, context: int | None, out: Export) -> str | None:
    """A window for llama-cli: N, or for "every token" the context (llama-cli refuses -1); None when unknown."""
    if last_n is not None:
        return str(last_n)
    if context is not None:
        out.notes.append(f"{what} over every token: written as the model's context, {context} (llama-cli refuses -1)")
        return str(context)
    out.unsupported.append(f"{what} over every token: llama-cli refuses -1; give a window of at least the prompt "
                           "plus -n tokens")
    return None


# llama.cpp's defaults first, so that the line shows them switched off (then the other stages in registry order):
# the stages llama.cpp runs unless told (a default for the field that switches them on: temp, top-k, top-p, min-p)
LLAMACPP_FIRST = tuple(s.params[0].field for s in STAGES if "llamacpp" in s.params[0].defaults)


def _llamacpp(s, p, bias, resolved, settings, eos_ids, out: Export, context) -> None:
    flags: list[str] = []
    sample = _sample_fields(settings)
    sampling = _sampling(p)
    values = stage_fields("llamacpp", s, True)
    values.pop("dry_penalty_last_n", None)  # DRY's window is written with the stage below (every token: the context)
    values["temperature"] = effective(s, "temperature") if sampling else 0.0
    values.update({f: effective(s, f) for f in ("dry_base", "dry_allowed_length", "xtc_threshold",
                                                  "dynatemp_exponent", "mirostat_tau", "mirostat_eta")
                   if stage_is_on(s, f)})
    order = list(LLAMACPP_FIRST) + [p.field for p in params() if p.field not in LLAMACPP_FIRST]
    for name in order:
        if name in values and stage_is_on(s, name, values):
            flags += [param(name).export["llamacpp"], _flag_number(values[name])]
    counted = _counted(s, p)  # one window for all (semantics._penalty_window, _llamacpp; None: every token)
    if counted:
        text = _window(counted[0][1], "penalties", context, out)
        if text is not None:
            flags += [param("penalty_last_n").export["llamacpp"], text]
        if any(scope == "output" for scope, _ in counted):
            out.notes.append("llama.cpp's penalties count prompt and output; decodelab counted the output only")
    if s.dry_multiplier is not None:
        text = _window(s.dry_penalty_last_n, "DRY", context, out)
        if text is not None:
            flags += [param("dry_penalty_last_n").export["llamacpp"], text]
        for breaker in s.dry_breaker or ():
            flags += [param("dry_breaker").export["llamacpp"], breaker]
    if s.mirostat_tau is not None or s.mirostat_eta is not None:
        flags += ["--mirostat", "2"]
        out.notes.append("with --mirostat llama.cpp runs only logit bias, temperature and mirostat")
    for t, b in bias.items():
        flags += [param("logit_bias").export["llamacpp"],
                  f"{t}{'+' if b >= 0 else '-'}{'inf' if math.isinf(b) else _flag_number(abs(b))}"]
    names = sampler_names("llamacpp")
    order = [names[n] for n in (s.chain or ()) if n in names]
    if not sampling:  # llama.cpp runs only the listed samplers, then draws: --temp 0 is greedy only as one of them
        order.append(names[stage_of("temperature").name])
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


def stage_is_on(s: ChainSettings, field_name: str, values: dict | None = None) -> bool:
    """Whether the field's stage runs (a field of a stage that is off is not written), or the field switches one of
    llama.cpp's defaulted stages off (LLAMACPP_FIRST: the temperature among them, dynatemp's centre)."""
    if values is not None and field_name in LLAMACPP_FIRST:
        return True
    stage = next(st for st in STAGES if field_name in st.fields)
    return stage.name in (s.chain or ())


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


def llamacpp_server_neutral() -> dict:
    """What a request to llama.cpp's server (/completion) adds to the fields it carries: every stage llama.cpp has
    and the request does not carry (a request carries what vLLM reads, :func:`served_settings`) switched off, its
    switching field at llama.cpp's off-value (each row's ``export["llamacpp-server"]`` and ``off["llamacpp"]``); and
    ``samplers``, llama.cpp's own order of the stages a request carries (its names from each row's ``samplers``),
    written out so that the server's --samplers cannot reorder the chain."""
    carried = set(registry.engine_order("vllm"))
    body = {}
    for stage in registry.STAGES:
        if "llamacpp" not in stage.engines or stage.name in carried:
            continue
        for p in stage.params:
            if "llamacpp-server" in p.export and "llamacpp" in p.off:
                body[p.export["llamacpp-server"]] = p.off["llamacpp"].value
    names = registry.sampler_names("llamacpp")
    order = [names[n] for n in registry.engine_order("llamacpp") if n in carried and n in names]
    return {**body, "samplers": list(dict.fromkeys(order))}


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
    return neutral_request(logprobs=top, **kw), list(out.notes)


def neutral_request(**fields) -> SamplingSettings:
    """A served request with these fields (the rest at their neutral values), handed each server kind's
    neutral body from the registry (llama.cpp's: :func:`llamacpp_server_neutral`), so that no server's own
    defaults switch a stage on."""
    return SamplingSettings(**fields, neutral={LlamacppAdapter.kind: llamacpp_server_neutral()})
