"""Option definitions shared by the commands, defined once: Annotated aliases, grouped, and a decorator that adds
a group's options to a command's signature and hands the command their values as one ``opts`` object.

    @command(PROMPT, MODEL, OUTPUT)
    def probs(opts: Opts, own_option: OwnAlias = None) -> None: ...

Each command keeps only its own options in its signature; the shared ones are written once, here.
"""

from __future__ import annotations

import functools
import inspect
from enum import Enum
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Optional

import typer

from .view.render import status

RUN = "Model and run"
PROC = "Processor chain"
MORE = "More samplers, semantics, export"
OUT = "Output"


class Format(str, Enum):
    table = "table"
    json = "json"
    jsonl = "jsonl"
    markdown = "markdown"
    csv = "csv"


Prompt = Annotated[Optional[str], typer.Argument(help="The prompt text; '-' reads stdin.", show_default=False)]
PromptFile = Annotated[Optional[Path], typer.Option("--prompt-file", help="Read the prompt from a file.",
                                                    rich_help_panel=RUN)]
Model = Annotated[str, typer.Option("--model", "-m", help="Bundled name (tiny, tiny-draft), a local model folder, "
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
    "--threads", help="torch CPU threads (default: torch's choice); 1 avoids OpenMP spin-waits on a busy shared CPU.",
    rich_help_panel=RUN, show_default=False)]
Cache = Annotated[Optional[str], typer.Option(
    "--cache", help="KV-cache policy: NAME or NAME:key=value,... (default full; `decodelab models` lists them).",
    rich_help_panel=RUN, show_default=False)]

Fmt = Annotated[Format, typer.Option("--format", "-f", help="table (rich), json, jsonl (streamed), markdown, csv.",
                                     rich_help_panel=OUT)]
Top = Annotated[Optional[int], typer.Option("--top", help="Alternatives listed per step (default 5).",
                                            rich_help_panel=OUT, show_default=False)]
SaveHtml = Annotated[Optional[Path], typer.Option("--save-html", help="Also write the rendered table as HTML.",
                                                  rich_help_panel=OUT)]
SaveSvg = Annotated[Optional[Path], typer.Option("--save-svg", help="Also write the rendered table as SVG.",
                                                 rich_help_panel=OUT)]

Temperature = Annotated[Optional[float], typer.Option("--temperature", "-t", help="Divide logits by T; 0 = greedy.",
                                                      rich_help_panel=PROC)]
TopK = Annotated[Optional[int], typer.Option("--top-k", help="Keep the k most likely tokens.", rich_help_panel=PROC)]
TopP = Annotated[Optional[float], typer.Option("--top-p", help="Keep the smallest set reaching this mass, (0, 1].",
                                               rich_help_panel=PROC)]
MinP = Annotated[Optional[float], typer.Option("--min-p", help="Keep tokens with p >= min_p * p_max, [0, 1].",
                                               rich_help_panel=PROC)]
TypicalP = Annotated[Optional[float], typer.Option("--typical-p", help="Locally typical sampling mass, (0, 1].",
                                                   rich_help_panel=PROC)]
Softcap = Annotated[Optional[float], typer.Option("--softcap", help="c * tanh(z / c) on the logits, c > 0.",
                                                  rich_help_panel=PROC)]
LogitBias = Annotated[Optional[list[str]], typer.Option("--logit-bias", help="TOKEN=BIAS (repeatable); TOKEN is an "
                                                        "id or a text that is one token; -inf bans it.",
                                                        rich_help_panel=PROC)]
RepetitionPenalty = Annotated[Optional[float], typer.Option("--repetition-penalty", help="Divide positive / multiply "
                                                            "negative logits of seen tokens (> 0; 1 = off).",
                                                            rich_help_panel=PROC)]
NoRepeatNgram = Annotated[Optional[int], typer.Option("--no-repeat-ngram", help="Ban tokens completing an n-gram "
                                                      "already in the text.", rich_help_panel=PROC)]
ChainOrder = Annotated[Optional[str], typer.Option(
    "--chain", help="Explicit stage order, e.g. 'bias,softcap,temperature,top-k,top-p'. Default order: allow, softcap, "
    "repetition-penalty, frequency-penalty, presence-penalty, dry, no-repeat-ngram, bias, sequence-bias, ban, "
    "min-new-tokens, temperature (or dynatemp), top-n-sigma, top-k, top-p, min-p, typical-p, epsilon-cutoff, "
    "eta-cutoff, xtc, mirostat (only set stages run).", rich_help_panel=PROC)]


def _opt(name: str, kind, text: str, *aliases: str):
    return Annotated[Optional[kind], typer.Option(name, *aliases, help=text, rich_help_panel=MORE,
                                                  show_default=False)]


PresencePenalty = _opt("--presence-penalty", float, "z -= A for every token already seen (once).")
FrequencyPenalty = _opt("--frequency-penalty", float, "z -= A * (times the token was seen).")
PenaltyLastN = _opt("--penalty-last-n", int, "The penalties count only the last N tokens (llama.cpp's last-n; "
                    "0 = none).")
DryMultiplier = _opt("--dry-multiplier", float, "DRY: a token extending a repeat of n >= L tokens loses "
                     "M * base^(n - L) (0 < M).")
DryBase = _opt("--dry-base", float, "DRY base, >= 1 (default 1.75).")
DryAllowedLength = _opt("--dry-allowed-length", int, "DRY: repeats up to this length are free (default 2).")
DryPenaltyLastN = _opt("--dry-penalty-last-n", int, "DRY scans only the last N tokens (default all).")
DryBreaker = Annotated[Optional[list[str]], typer.Option(
    "--dry-breaker", help="A DRY sequence breaker (repeatable; default llama.cpp's \\n : \" *; without a model: "
    "token ids).", rich_help_panel=MORE)]
XtcThreshold = _opt("--xtc-threshold", float, "XTC: tokens with p >= T are the top choices (default 0.1).")
XtcProbability = _opt("--xtc-probability", float, "XTC: with this probability (a coin from --seed) remove every "
                      "top choice but the least likely.")
TopNSigma = _opt("--top-n-sigma", float, "Keep z >= max z - N * std(z).")
MirostatTau = _opt("--mirostat-tau", float, "Mirostat 2.0 target surprise in bits (default 5).")
MirostatEta = _opt("--mirostat-eta", float, "Mirostat 2.0 learning rate (default 0.1).")
DynatempRange = _opt("--dynatemp-range", float, "Dynamic temperature: t +- R by the normalized entropy.")
DynatempExponent = _opt("--dynatemp-exponent", float, "Dynamic temperature exponent (default 1).")
EpsilonCutoff = _opt("--epsilon-cutoff", float, "Remove tokens with p < E, (0, 1).")
EtaCutoff = _opt("--eta-cutoff", float, "Remove tokens with p < min(E, sqrt(E) exp(-entropy)), (0, 1).")
MinNewTokens = _opt("--min-new-tokens", int, "Ban EOS (and --stop-id) until N tokens were generated.")
SequenceBias = Annotated[Optional[list[str]], typer.Option(
    "--sequence-bias", help="TEXT=BIAS (repeatable): bias the last token of a multi-token text when the text so far "
    "ends with the rest of it.", rich_help_panel=MORE)]
Ban = Annotated[Optional[list[str]], typer.Option("--ban", help="A multi-token text never to produce (repeatable).",
                                                  rich_help_panel=MORE)]
Allow = Annotated[Optional[list[str]], typer.Option("--allow", help="Allow only these tokens (repeatable; a text, "
                                                    "all its tokens).", rich_help_panel=MORE)]
Semantics = _opt("--semantics", str, "Read the settings as hf, vllm or llamacpp does (order, defaults, clamps, "
                 "penalty counting, draw).")
Export = _opt("--export", str, "Print the settings for hf (generate kwargs), vllm (SamplingParams) or llamacpp "
              "(llama-cli flags) instead of running.")
StopId = Annotated[Optional[list[int]], typer.Option("--stop-id", help="A token id that ends the run (repeatable).",
                                                     rich_help_panel=RUN)]
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
    "temperature": (Temperature, None), "top_k": (TopK, None), "top_p": (TopP, None), "min_p": (MinP, None),
    "typical_p": (TypicalP, None), "softcap": (Softcap, None), "logit_bias": (LogitBias, None),
    "repetition_penalty": (RepetitionPenalty, None), "no_repeat_ngram": (NoRepeatNgram, None),
    "chain": (ChainOrder, None),
    "presence_penalty": (PresencePenalty, None), "frequency_penalty": (FrequencyPenalty, None),
    "penalty_last_n": (PenaltyLastN, None), "dry_multiplier": (DryMultiplier, None), "dry_base": (DryBase, None),
    "dry_allowed_length": (DryAllowedLength, None), "dry_penalty_last_n": (DryPenaltyLastN, None),
    "dry_breaker": (DryBreaker, None), "xtc_threshold": (XtcThreshold, None),
    "xtc_probability": (XtcProbability, None), "top_n_sigma": (TopNSigma, None), "mirostat_tau": (MirostatTau, None),
    "mirostat_eta": (MirostatEta, None), "dynatemp_range": (DynatempRange, None),
    "dynatemp_exponent": (DynatempExponent, None), "epsilon_cutoff": (EpsilonCutoff, None),
    "eta_cutoff": (EtaCutoff, None), "min_new_tokens": (MinNewTokens, None), "sequence_bias": (SequenceBias, None),
    "ban": (Ban, None), "allow": (Allow, None), "semantics": (Semantics, None), "export": (Export, None),
    "stop_id": (StopId, None), "trim_stop": (TrimStop, None),
}

PROMPT = ("prompt", "prompt_file", "chat")
MODEL = ("model", "device", "dtype", "device_map", "trust_remote_code", "cache", "threads")
SETTINGS = ("preset", "set_")
GENERATE = ("max_new_tokens", "seed", "stop", "ignore_eos")
OUTPUT = ("fmt", "top", "save_html", "save_svg")
PENALTIES = ("logit_bias", "repetition_penalty", "no_repeat_ngram", "chain")  # what beam search applies
CHAIN = ("temperature", "top_k", "top_p", "min_p", "typical_p", "softcap") + PENALTIES
CHAIN_KEYS = ("temperature", "top_k", "top_p", "min_p", "typical_p", "softcap", "repetition_penalty",
              "no_repeat_ngram")
SAMPLER_KEYS = ("presence_penalty", "frequency_penalty", "penalty_last_n", "dry_multiplier", "dry_base",
                "dry_allowed_length", "dry_penalty_last_n", "xtc_threshold", "xtc_probability", "top_n_sigma",
                "mirostat_tau", "mirostat_eta", "dynatemp_range", "dynatemp_exponent", "epsilon_cutoff", "eta_cutoff",
                "min_new_tokens", "semantics")
SAMPLERS = SAMPLER_KEYS + ("dry_breaker", "sequence_bias", "ban", "allow", "export")  # sample, probs, speculate
STOPS = ("stop_id", "trim_stop")


Opts = SimpleNamespace  # the shared options' values, by name


def command(*groups: tuple[str, ...], without: tuple[str, ...] = ()):
    """Add the groups' options (less ``without``) to a command whose first parameter is ``opts``."""
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
            with status("starting: importing torch and transformers"):
                pass
            return fn(opts, **kwargs)

        wrapper.__signature__ = inspect.Signature(params)
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper

    return wrap


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
    if threads is not None and not 1 <= threads <= 1024:
        raise ConfigError(f"--threads {threads}: must be an integer in [1, 1024]")


def explicit(opts: Opts, *keys: str) -> dict:
    """Options given on the command line as settings fields (None = not given), for config.resolve."""
    from ..core.errors import ConfigError
    from ..core.settings import parse_logit_bias

    out = {key: getattr(opts, key, None) for key in CHAIN_KEYS + SAMPLER_KEYS + ("cache", "trim_stop") + keys}
    bias, chain = getattr(opts, "logit_bias", None), getattr(opts, "chain", None)
    out["logit_bias"] = parse_logit_bias(bias) if bias else None
    out["chain"] = tuple(s.strip() for s in chain.split(",") if s.strip()) if chain else None
    if chain is not None and not out["chain"]:  # "" or "," would read as no --chain at all
        raise ConfigError(f"--chain {chain!r}: names no stage; give the stages in order, e.g. temperature,top-p")
    if out.get("stop"):
        out["stop"] = tuple(out["stop"])
    sequence_bias = getattr(opts, "sequence_bias", None)
    out["sequence_bias"] = parse_logit_bias(sequence_bias, "--sequence-bias") if sequence_bias else None
    for key in ("dry_breaker", "ban", "allow", "stop_id"):
        value = getattr(opts, key, None)
        out[key] = tuple(value) if value else None
    return out
