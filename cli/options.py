"""Option definitions shared by the commands, defined once: Annotated aliases, grouped, and a decorator that adds
a group's options to a command's signature and hands the command their values as one ``opts`` object.

    @command(PROMPT, MODEL, OUTPUT)
    def probs(opts: Opts, own_option: OwnAlias = None) -> None: ...

Each command keeps only its own options in its signature; the shared ones are written once, here.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from enum import Enum
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Optional

import typer

from ..core.inputs import parse_float, parse_int, usable_cpus
from ..core.sampling.registry import DEFAULT_ORDER, PANELS, Param, check_range
from ..core.sampling.registry import params as stage_params
from .view.render import status

RUN = "Model and run"
ENGINE_PANEL = "Served engine"
PROC = "Processor chain"
MORE = "More samplers, semantics, export"
OUT = "Output"


class Format(str, Enum):
    table = "table"
    json = "json"
    jsonl = "jsonl"
    markdown = "markdown"
    csv = "csv"
    text = "text"
    openai = "openai"


# commands that produce a continuation `-f text` can print (the others refuse it before anything runs)
TEXT_COMMANDS = ("sample", "stream", "speculate", "beam", "batch")
# commands whose trace `-f openai` writes as an OpenAI completions response (raw logprobs, as vLLM's default)
OPENAI_COMMANDS = ("sample", "score", "stream")


Prompt = Annotated[Optional[str], typer.Argument(help="The prompt text; '-' reads stdin (one trailing newline "
                                                  "dropped, as echo adds it).", show_default=False)]
PromptFile = Annotated[Optional[Path], typer.Option("--prompt-file", help="Read the prompt from a file.",
                                                    rich_help_panel=RUN)]
Model = Annotated[str, typer.Option("--model", "-m", help="Bundled name (tiny, tiny-draft, tiny-recall), a local model folder, "
                                    "or a model id already in the local HF cache. Never downloads.",
                                    rich_help_panel=RUN)]
Preset = Annotated[Optional[str], typer.Option("--preset", "-p", help="Bundled preset name or a path to a .toml.",
                                               rich_help_panel=RUN)]
Set = Annotated[Optional[list[str]], typer.Option("--set", help="Override one setting: KEY=VALUE (repeatable).",
                                                  rich_help_panel=RUN)]
MaxNew = Annotated[Optional[int], typer.Option("--max-new-tokens", "-n", help="Tokens to generate (default 64; beam: 32).",
                                               rich_help_panel=RUN, show_default=False)]
Seed = Annotated[Optional[int], typer.Option("--seed", help="RNG seed: the same command prints the same trace "
                                             "(default 0).", rich_help_panel=RUN, show_default=False)]
Device = Annotated[str, typer.Option("--device", help="auto (cuda, then mps, then cpu), cpu, cuda, mps.",
                                     rich_help_panel=RUN)]
Dtype = Annotated[str, typer.Option("--dtype", help="auto, float32, bfloat16, float16.", rich_help_panel=RUN)]
DeviceMap = Annotated[Optional[str], typer.Option("--device-map", help="'auto' hands a model too large for one "
                                                  "device to transformers/accelerate.", rich_help_panel=RUN)]
TrustRemoteCode = Annotated[bool, typer.Option("--trust-remote-code", help="Allow a local model's own Python code "
                                               "(off by default).", rich_help_panel=RUN)]
Chat = Annotated[bool, typer.Option("--chat", help="Apply the tokenizer's chat template to the prompt.",
                                    rich_help_panel=RUN)]
Stop = Annotated[Optional[list[str]], typer.Option("--stop", help="Extra stop string (repeatable).",
                                                   rich_help_panel=RUN)]
IgnoreEos = Annotated[Optional[bool], typer.Option("--ignore-eos", help="Generate exactly -n tokens.",
                                                   rich_help_panel=RUN, show_default=False)]

Threads = Annotated[Optional[int], typer.Option(
    "--threads", help="torch CPU threads. Default: OMP_NUM_THREADS when set, else 1 on a machine of 1-2 cores, else "
    "the cores the load average leaves free; 1 when the machine is busy (load average >= cores: extra threads would "
    "wait for each other; a line says so).",
    rich_help_panel=RUN, show_default=False)]
Cache = Annotated[Optional[str], typer.Option(
    "--cache", help="KV-cache policy: NAME or NAME:key=value,... (default full; `decodelab models` lists them).",
    rich_help_panel=RUN, show_default=False)]

Engine = Annotated[Optional[str], typer.Option(
    "--engine", help="Run on a served model instead of the embedded runtime: an OpenAI-compatible server (vLLM, "
    "SGLang, llama.cpp's server) at URL, e.g. http://127.0.0.1:8000. Only that URL is contacted; -m names the "
    "local tokenizer (and model, where the command recomputes).", rich_help_panel=ENGINE_PANEL, show_default=False)]
EngineModel = Annotated[Optional[str], typer.Option(
    "--engine-model", help="The served model's name (the server's --served-model-name), when it serves several.",
    rich_help_panel=ENGINE_PANEL, show_default=False)]
EngineTimeout = Annotated[float, typer.Option("--engine-timeout", help="Seconds to wait for each answer.",
                                              rich_help_panel=ENGINE_PANEL)]

Fmt = Annotated[Format, typer.Option("--format", "-f", help="table (rich), json, jsonl (streamed), markdown, csv, "
                                     "text (the continuation alone, streamed), openai (the OpenAI completions logprobs response).",
                                     rich_help_panel=OUT)]
Top = Annotated[Optional[int], typer.Option("--top", help="Alternatives listed per step (default 5).",
                                            rich_help_panel=OUT, show_default=False)]
SaveHtml = Annotated[Optional[Path], typer.Option("--save-html", help="Also write the trace page (one HTML file, as "
                                                  "`decodelab view` draws it).", rich_help_panel=OUT)]
SaveSvg = Annotated[Optional[Path], typer.Option("--save-svg", help="Also write the rendered table as SVG.",
                                                 rich_help_panel=OUT)]

ChainOrder = Annotated[Optional[str], typer.Option(
    "--chain", help="Explicit stage order, e.g. 'bias,softcap,temperature,top-k,top-p'. Default order: "
    + ", ".join(DEFAULT_ORDER) + " (only set stages run; dynatemp takes temperature's place).", rich_help_panel=PROC)]


def _opt(name: str, kind, text: str, *aliases: str):
    return Annotated[Optional[kind], typer.Option(name, *aliases, help=text, rich_help_panel=MORE,
                                                  show_default=False)]


def stage_option(p: Param):
    """A stage field's option, as its registry entry declares it (repeatable fields take a list)."""
    kind = list[str] if (p.many or p.pairs) else p.kind
    names = [p.option] + ([p.short] if p.short else [])
    return Annotated[Optional[kind], typer.Option(*names, help=p.help, rich_help_panel=PANELS[p.panel],
                                                  show_default=False, metavar=p.metavar)]


Semantics = _opt("--semantics", str, "Read the settings as hf, vllm or llamacpp does (order, defaults, clamps, "
                 "penalty counting, draw).")
Export = _opt("--export", str, "Print the settings for hf (generate kwargs), vllm (SamplingParams) or llamacpp "
              "(llama-cli flags) instead of running.")
StopId = Annotated[Optional[list[int]], typer.Option("--stop-id", help="A token id that ends the run (repeatable).",
                                                     rich_help_panel=RUN)]
RepetitionStop = Annotated[Optional[str], typer.Option(
    "--repetition-stop", help="Stop when the output ends in min_count copies of a pattern of up to max_pattern_size "
    "tokens (vLLM's repetition_detection): 'max_pattern_size=P,min_count=C[,min_pattern_size=M]'; stop reason "
    "repetition, with the loop's attribution.", rich_help_panel=RUN, show_default=False)]
TrimStop = Annotated[Optional[bool], typer.Option("--trim-stop", help="Leave the stop string (or stop id) out of "
                                                  "the text.", rich_help_panel=RUN, show_default=False)]


# --- groups ----------------------------------------------------------------------------------------------------

DEFINITIONS: dict[str, tuple[object, object]] = {
    "prompt": (Prompt, None), "prompt_file": (PromptFile, None), "chat": (Chat, False),
    "model": (Model, "tiny"), "device": (Device, "auto"), "dtype": (Dtype, "auto"), "device_map": (DeviceMap, None),
    "trust_remote_code": (TrustRemoteCode, False), "cache": (Cache, None), "threads": (Threads, None),
    "preset": (Preset, None), "set_": (Set, None), "max_new_tokens": (MaxNew, None), "seed": (Seed, None),
    "stop": (Stop, None), "ignore_eos": (IgnoreEos, None),
    "fmt": (Fmt, Format.table), "top": (Top, None), "save_html": (SaveHtml, None), "save_svg": (SaveSvg, None),
    "chain": (ChainOrder, None), "semantics": (Semantics, None), "export": (Export, None),
    "stop_id": (StopId, None), "trim_stop": (TrimStop, None), "repetition_stop": (RepetitionStop, None),
    "engine": (Engine, None), "engine_model": (EngineModel, None), "engine_timeout": (EngineTimeout, 60.0),
    **{p.field: (stage_option(p), None) for p in stage_params()},
}

PROMPT = ("prompt", "prompt_file", "chat")
MODEL = ("model", "device", "dtype", "device_map", "trust_remote_code", "cache", "threads")
SETTINGS = ("preset", "set_")
GENERATE = ("max_new_tokens", "seed", "stop", "ignore_eos")
OUTPUT = ("fmt", "top", "save_html", "save_svg")
CONSTRAINT = tuple(p.field for p in stage_params() if p.panel == "constraint")  # --regex, --json-schema, ...
# what beam search applies
PENALTIES = ("logit_bias", "repetition_penalty", "no_repeat_ngram", "thinking_budget", "chain") + CONSTRAINT
CHAIN = tuple(p.field for p in stage_params() if p.panel == "chain") + CONSTRAINT + ("chain",)
SAMPLERS = tuple(p.field for p in stage_params() if p.panel == "more") + ("semantics", "export")  # sample, probs, ...
SCALAR_KEYS = tuple(p.field for p in stage_params() if not (p.many or p.pairs)) + ("semantics",)
STOPS = ("stop_id", "trim_stop", "repetition_stop")
ENGINE = ("engine", "engine_model", "engine_timeout")


Opts = SimpleNamespace  # the shared options' values, by name


# command name -> the parameters it takes (the groups' and its own), recorded by `command` as each command module
# is imported: what a view needs to know of a command (the branch command of a trace page) without importing it
PARAMETERS: dict[str, tuple[str, ...]] = {}


def command(*groups: tuple[str, ...], without: tuple[str, ...] = ()):
    """Add the groups' options (less ``without``) to a command whose first parameter is ``opts``; record its
    parameters in ``PARAMETERS``."""
    names = [n for g in groups for n in g if n not in without]

    def wrap(fn):
        own = [p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.name != "opts"]
        shared = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=DEFINITIONS[n][1],
                                    annotation=DEFINITIONS[n][0]) for n in names]
        # the prompt argument first, then the command's own options, then the shared ones
        params = [p for p in shared if p.name == "prompt"] + [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
                                                             for p in own] + [p for p in shared if p.name != "prompt"]

        @functools.wraps(fn)
        def wrapper(**kwargs):
            opts = Opts(**{n: kwargs.pop(n) for n in names})
            check_paths(opts)
            from .early import check_empty_prompt, check_models

            check_models(opts, kwargs)
            check_empty_prompt(opts)
            check_format(fn.__name__, opts)
            check_ranges_early(opts)
            with status("starting: importing torch and transformers"):
                pass
            return fn(opts, **kwargs)

        for p in params:
            read_numbers_once(p)
        wrapper.__signature__ = inspect.Signature(params)
        PARAMETERS[fn.__name__] = tuple(p.name for p in params)
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper

    return wrap


def read_numbers_once(param: inspect.Parameter) -> None:
    """An int or float option (or a list of them) reads its text through core's one number reader (ASCII digits
    only: '²', '١', '1_0' and, for an int, '3.0' are refused; the message names the option), not typer's own."""
    if typing.get_origin(param.annotation) is not Annotated:
        return
    kind, *extras = typing.get_args(param.annotation)
    info = next((e for e in extras if isinstance(e, (typer.models.OptionInfo, typer.models.ArgumentInfo))), None)
    while typing.get_origin(kind) in (typing.Union, types.UnionType, list):
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    if info is None or kind not in (int, float) or info.parser is not None:
        return
    names = [d for d in (info.default, *(info.param_decls or ())) if isinstance(d, str) and d.startswith("--")]
    option = names[0] if names else "--" + param.name.rstrip("_").replace("_", "-")
    info.parser = (lambda text: parse_int(text, option)) if kind is int else (lambda text: parse_float(text, option))


def check_format(command: str, opts: Opts) -> None:
    """``-f text`` only where there is a continuation to print."""
    from ..core.errors import ConfigError

    if getattr(opts, "fmt", None) == Format.text and command not in TEXT_COMMANDS:
        raise ConfigError(f"--format text: {command} produces no continuation; allowed with "
                          f"{', '.join(TEXT_COMMANDS)} (use -f json or jsonl here)")
    if getattr(opts, "fmt", None) == Format.openai and command not in OPENAI_COMMANDS:
        raise ConfigError(f"--format openai: {command} has no per-token trace in that shape; allowed with "
                          f"{', '.join(OPENAI_COMMANDS)} (use -f json here)")


def check_paths(opts: Opts) -> None:
    """Files the command reads or writes are checked when it starts, before a model loads or a run is spent."""
    from ..core.errors import ConfigError
    from ..core.inputs import check_input_file, check_output_file

    for name, option in (("save_html", "--save-html"), ("save_svg", "--save-svg")):
        if getattr(opts, name, None) is not None:
            check_output_file(option, getattr(opts, name))
    if getattr(opts, "prompt_file", None) is not None:
        check_input_file("--prompt-file", opts.prompt_file)
    threads = getattr(opts, "threads", None)
    if threads is not None and not 1 <= threads <= usable_cpus():
        raise ConfigError(f"--threads {threads}: must be an integer in [1, {usable_cpus()}] (the CPUs this process "
                          "may run on; more threads only wait for each other)")
    check_engine(opts)


def check_ranges_early(opts: Opts) -> None:
    """Stage values typed as options, checked against the stage registry's ranges before torch is imported (core
    checks the built settings again, the same way). Skipped where an engine's reading may change what a value means
    (``--semantics``, or a preset or ``--set`` that names one), and for a field that ``--set`` overrides."""
    from ..core.settings import load_preset

    sets = {item.partition("=")[0].strip().replace("-", "_") for item in getattr(opts, "set_", None) or []}
    preset = getattr(opts, "preset", None)
    if getattr(opts, "semantics", None) is not None or "semantics" in sets or (
            preset is not None and "semantics" in load_preset(preset)[1]):
        return
    for p in stage_params():
        if p.field not in sets and not (p.many or p.pairs):
            check_range(p, getattr(opts, p.field, None))


def check_engine(opts: Opts) -> None:
    """--engine URL is an http(s) URL; --engine-model and --engine-timeout only with it (no server contacted yet)."""
    from ..core.engine.http.transport import base_url
    from ..core.errors import ConfigError

    if getattr(opts, "engine", None) is None:
        for name, option in (("engine_model", "--engine-model"),):
            if getattr(opts, name, None) is not None:
                raise ConfigError(f"{option}: only with --engine URL")
        return
    base_url(opts.engine)
    timeout = getattr(opts, "engine_timeout", 60.0)
    if not (timeout > 0 and timeout < 1e6):
        raise ConfigError(f"--engine-timeout {timeout}: must be a number of seconds > 0")


def explicit(opts: Opts, *keys: str) -> dict:
    """Options given on the command line as settings fields (None = not given), for config.resolve."""
    from ..core.errors import ConfigError
    from ..core.settings import parse_logit_bias

    out = {key: getattr(opts, key, None) for key in SCALAR_KEYS + ("cache", "trim_stop", "repetition_stop") + keys}
    for p in stage_params():
        value = getattr(opts, p.field, None)
        if p.pairs:
            out[p.field] = parse_logit_bias(value, p.option) if value else None
        elif p.many:
            out[p.field] = tuple(value) if value else None
    chain = getattr(opts, "chain", None)
    out["chain"] = tuple(s.strip() for s in chain.split(",") if s.strip()) if chain else None
    if chain is not None and not out["chain"]:  # "" or "," would read as no --chain at all
        raise ConfigError(f"--chain {chain!r}: names no stage; give the stages in order, e.g. temperature,top-p")
    if out.get("stop"):
        out["stop"] = tuple(out["stop"])
    stop_id = getattr(opts, "stop_id", None)
    out["stop_id"] = tuple(stop_id) if stop_id else None
    return out
