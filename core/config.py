"""Settings of each command as frozen dataclasses: defaults < preset TOML < explicit options < --set overrides.

Keys are written with underscores in TOML (``top_p``) and accepted with dashes too in ``--set top-p=0.9``.
Validation messages name the option as the user typed it (``--top-p``) and say what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import typing
from dataclasses import dataclass, fields, replace
from importlib import resources
from pathlib import Path

from .errors import ConfigError

META_KEYS = ("description",)  # allowed in a preset file, not settings


@dataclass(frozen=True)
class ChainSettings:
    """The processor chain; None switches a stage off. temperature 0 means greedy."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    typical_p: float | None = None
    softcap: float | None = None
    repetition_penalty: float | None = None
    no_repeat_ngram: int | None = None
    logit_bias: tuple[tuple[str, float], ...] = ()
    chain: tuple[str, ...] | None = None
    cache: str = "full"  # the KV-cache policy, `NAME[:key=value,...]` (every command that runs a model)
    # the stages of core/samplers.py (None / empty = off)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    penalty_last_n: int | None = None  # the penalties count only the last N tokens (None: all)
    dry_multiplier: float | None = None
    dry_base: float | None = None  # default 1.75 when DRY is on
    dry_allowed_length: int | None = None  # default 2
    dry_penalty_last_n: int | None = None  # default: the whole sequence
    dry_breaker: tuple[str, ...] = ()  # default (with a tokenizer): llama.cpp's "\n", ":", "\"", "*"
    xtc_threshold: float | None = None  # default 0.1 when XTC is on
    xtc_probability: float | None = None  # XTC is on when set
    top_n_sigma: float | None = None
    mirostat_tau: float | None = None  # mirostat v2 is on when tau or eta is set; default tau 5
    mirostat_eta: float | None = None  # default 0.1
    dynatemp_range: float | None = None
    dynatemp_exponent: float | None = None  # default 1
    epsilon_cutoff: float | None = None
    eta_cutoff: float | None = None
    min_new_tokens: int | None = None
    sequence_bias: tuple[tuple[str, float], ...] = ()  # TEXT=BIAS, TEXT any number of tokens
    ban: tuple[str, ...] = ()  # multi-token bans
    allow: tuple[str, ...] = ()  # the only tokens allowed
    semantics: str | None = None  # hf | vllm | llamacpp: read the settings as that engine does

    def stage_values(self, bias_ids: dict[int, float] | None, resolved: dict | None = None) -> dict:
        """Stage name -> constructor argument, the shape build_chain takes. ``resolved`` holds the token ids of the
        text-valued settings ("sequence-bias", "ban", "allow", "dry-breakers"); without it (checking settings
        before a tokenizer exists) placeholders stand in."""
        resolved = resolved or {}
        dry = None
        if self.dry_multiplier is not None:
            dry = {"multiplier": self.dry_multiplier,
                   "base": 1.75 if self.dry_base is None else self.dry_base,
                   "allowed_length": 2 if self.dry_allowed_length is None else self.dry_allowed_length,
                   "last_n": self.dry_penalty_last_n,
                   "breakers": resolved.get("dry-breakers", ())}
        mirostat = None
        if self.mirostat_tau is not None or self.mirostat_eta is not None:
            mirostat = {"tau": 5.0 if self.mirostat_tau is None else self.mirostat_tau,
                        "eta": 0.1 if self.mirostat_eta is None else self.mirostat_eta}
        xtc = None
        if self.xtc_probability is not None:
            xtc = {"threshold": 0.1 if self.xtc_threshold is None else self.xtc_threshold,
                   "probability": self.xtc_probability}
        dynatemp = None
        if self.dynatemp_range is not None:
            dynatemp = {"temperature": 1.0 if self.temperature is None else self.temperature,
                        "range": self.dynatemp_range,
                        "exponent": 1.0 if self.dynatemp_exponent is None else self.dynatemp_exponent}

        def texts(key: str, items, placeholder):
            if not items:
                return None
            return resolved.get(key, placeholder)

        return {
            "allow": texts("allow", self.allow, (0,)),
            "softcap": self.softcap,
            "repetition-penalty": self.repetition_penalty,
            "frequency-penalty": self.frequency_penalty,
            "presence-penalty": self.presence_penalty,
            "dry": dry,
            "no-repeat-ngram": self.no_repeat_ngram,
            "bias": bias_ids or None,
            "sequence-bias": texts("sequence-bias", self.sequence_bias, (((0,), 0.0),)),
            "ban": texts("ban", self.ban, ((0,),)),
            "min-new-tokens": self.min_new_tokens,
            "temperature": self.temperature if dynatemp is None else None,
            "dynatemp": dynatemp,
            "top-n-sigma": self.top_n_sigma,
            "top-k": self.top_k,
            "top-p": self.top_p,
            "min-p": self.min_p,
            "typical-p": self.typical_p,
            "epsilon-cutoff": self.epsilon_cutoff,
            "eta-cutoff": self.eta_cutoff,
            "xtc": xtc,
            "mirostat": mirostat,
        }


@dataclass(frozen=True)
class SampleSettings(ChainSettings):
    max_new_tokens: int = 64
    seed: int = 0
    top: int = 5
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_id: tuple[int, ...] = ()  # token ids that end the run (stop_reason "stop")
    trim_stop: bool | None = None  # leave the stop string (or stop id) out of the text; None: the semantics' own
    compile: bool = False  # torch.compile the one-token decode step (needs cache=static)


@dataclass(frozen=True)
class ProbsSettings(SampleSettings):
    top: int = 10  # tokens listed per stage (a preset's `top` still wins over this default)


def option_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def _check(ok: bool, key: str, value, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{option_name(key)} {value}: {allowed}")


def validate_chain(s: ChainSettings) -> None:
    """The settings as the chosen semantics reads them (:func:`decodelab.core.semantics.plan`: an engine's defaults,
    clamps and off-values first), then the ranges, then the order: building every stage once, each checks its own
    parameters, before any model loads."""
    from .semantics import plan

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


def cache_spec(s: ChainSettings):
    """The parsed --cache policy (every key and value checked; no model needed)."""
    from .kv import parse_cache_spec

    return parse_cache_spec(s.cache)


def check_order(s: ChainSettings, context=None) -> None:
    """Check --chain against the set stages before any model loads (the bias ids are resolved later)."""
    from .processors import build_chain

    placeholder_bias = {0: 0.0} if s.logit_bias else None
    build_chain(s.stage_values(placeholder_bias), list(s.chain) if s.chain is not None else None, context)


def validate_sample(s: SampleSettings) -> None:
    validate_chain(s)
    for token_id in s.stop_id:
        _check(token_id >= 0, "stop_id", token_id, "must be a token id >= 0")
    _check(s.max_new_tokens >= 1, "max_new_tokens", s.max_new_tokens, "must be >= 1")
    _check(s.top >= 0, "top", s.top, "must be >= 0")
    _check(0 <= s.seed < 2**64, "seed", s.seed, "must be an integer in [0, 2**64)")
    for text in s.stop:
        check_text("--stop", text)
        _check(text != "", "stop", "''", "an empty stop string matches everywhere; give some text")
    if s.compile:
        from .kv import require

        require(cache_spec(s), {"compile"}, "--compile")


def check_output_file(option: str, path: Path) -> None:
    """A file written at the end of a run: not a folder, in a folder that exists and can be written."""
    import os

    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ConfigError(f"{option} {path}: is a folder; give a file name")
    if not folder.is_dir():
        raise ConfigError(f"{option} {path}: the folder {folder} does not exist")
    if not os.access(path if path.exists() else folder, os.W_OK):
        raise ConfigError(f"{option} {path}: cannot write there (permission denied)")


def check_input_file(option: str, path: Path) -> None:
    """A text file read as input: it exists, is a file, and is UTF-8."""
    read_input_text(option, path)


def read_input_text(option: str, path: str | Path) -> str:
    """The text of a file given as ``option``: one line naming the option and the file when it is missing, a folder,
    unreadable or not UTF-8."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"{option} {path}: {'is a folder' if path.is_dir() else 'no such file'}; give a text file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{option} {path}: not UTF-8 text (byte {exc.start}); give a UTF-8 file") from None
    except OSError as exc:
        raise ConfigError(f"{option} {path}: cannot read it ({exc.strerror})") from None
    check_text(option, text)
    return text


def check_text(option: str, text: str) -> None:
    """Text from the command line or a file must be valid Unicode: undecodable bytes arrive as lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(f"{option} {text.encode('utf-8', 'backslashreplace').decode()!r}: not valid UTF-8 "
                          f"(an undecodable byte at character {exc.start}); give UTF-8 text") from None


# --- parsing values from TOML and from --set strings ---------------------------------------------------------


def parse_logit_bias(items, option: str = "--logit-bias") -> tuple[tuple[str, float], ...]:
    """TOKEN=BIAS strings (or a TOML table) -> ((token, bias), ...); TOKEN is an id or a single-token text."""
    if isinstance(items, dict):
        items = [f"{k}={v}" for k, v in items.items()]
    out = []
    for item in items:
        if isinstance(item, (list, tuple)) and len(item) == 2:
            out.append((str(item[0]), float(item[1])))
            continue
        token, sep, value = str(item).rpartition("=")
        if not sep or not token:
            raise ConfigError(f"{option} {item!r}: expected TOKEN=BIAS, e.g. 42=-inf or ' the'=2.5")
        try:
            out.append((token, float(value)))
        except ValueError:
            raise ConfigError(f"{option} {item!r}: BIAS {value!r} is not a number (use -inf to ban)") from None
    return tuple(out)


def _scalar(kind, key: str, raw):
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{option_name(key)} {raw!r}: expected true or false")
    if kind is int and isinstance(raw, float) and not raw.is_integer():
        raise ConfigError(f"{option_name(key)} {raw!r}: expected an integer")
    try:
        return kind(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{option_name(key)} {raw!r}: expected {kind.__name__}") from None


def coerce(cls, key: str, raw):
    """Turn a TOML value or a --set string into the type of field ``key`` of ``cls``."""
    hint = typing.get_type_hints(cls)[key]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("none", "off")):
        if type(None) in typing.get_args(hint):
            return None
        raise ConfigError(f"{option_name(key)}: cannot be switched off")
    if key in ("logit_bias", "sequence_bias"):
        pairs = parse_logit_bias(raw if not isinstance(raw, str) else [p for p in raw.split(",") if p],
                                 option_name(key))
        return pairs if key == "logit_bias" else tuple((t, b) for t, b in pairs)
    if key == "stop_id":
        items = raw.split(",") if isinstance(raw, str) else (raw if isinstance(raw, (list, tuple)) else [raw])
        return tuple(_scalar(int, key, str(i).strip()) for i in items if str(i).strip())
    origin = typing.get_origin(hint)
    if origin is tuple or (args and typing.get_origin(args[0]) is tuple):
        if not isinstance(raw, str):  # a TOML list: items exactly as written (a stop or breaker may be "\n")
            return tuple(str(i) for i in raw if str(i) != "")
        return tuple(i.strip() for i in raw.split(",") if i.strip())
    kind = args[0] if args else hint
    return _scalar(kind, key, raw)


def field_names(cls) -> list[str]:
    return [f.name for f in fields(cls)]


def normalize_key(cls, key: str) -> str:
    name = key.strip().replace("-", "_")
    if name not in field_names(cls):
        allowed = ", ".join(field_names(cls))
        raise ConfigError(f"unknown setting {key!r}; allowed: {allowed}")
    return name


# --- presets -------------------------------------------------------------------------------------------------


def preset_dir() -> Path:
    return Path(str(resources.files("decodelab.presets")))


def bundled_presets() -> dict[str, Path]:
    return {p.stem: p for p in sorted(preset_dir().glob("*.toml"))}


def load_preset(spec: str) -> tuple[str, dict]:
    """A bundled preset name or a path to a .toml -> (name, table)."""
    presets = bundled_presets()
    if spec in presets:
        path = presets[spec]
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ConfigError(f"--preset {spec!r}: not a bundled preset ({', '.join(presets)}) nor a .toml file")
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--preset {spec!r}: invalid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--preset {spec!r}: not UTF-8 text (byte {exc.start}); TOML files are UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"--preset {spec!r}: cannot read {path} ({exc.strerror})") from None
    return path.stem, table


def resolve(cls, preset: str | None = None, options: dict | None = None, sets: list[str] | None = None):
    """Build settings: dataclass defaults, then the preset, then explicit options (None = not given), then --set."""
    values: dict = {}
    if preset is not None:
        name, table = load_preset(preset)
        for key, raw in table.items():
            if key in META_KEYS:
                continue
            try:
                field = normalize_key(cls, key)
                values[field] = coerce(cls, field, raw)
            except ConfigError as exc:  # name the file: the option the message names was never typed
                raise ConfigError(f"--preset {preset!r}: key {key!r} in the file: {exc}") from None
    for key, raw in (options or {}).items():
        if raw is not None and raw != ():
            values[key] = raw
    for item in sets or []:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        field = normalize_key(cls, key)
        values[field] = coerce(cls, field, raw.strip())
    return replace(cls(), **values)


def as_dict(settings) -> dict:
    """The resolved settings for the JSON 'config' field (None = stage off)."""
    out = dataclasses.asdict(settings)
    out["logit_bias"] = {token: bias for token, bias in settings.logit_bias}
    if "sequence_bias" in out:
        out["sequence_bias"] = {text: bias for text, bias in settings.sequence_bias}
    return out
