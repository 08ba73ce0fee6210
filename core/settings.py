"""Settings of each command as frozen dataclasses: defaults < preset TOML < explicit options < --set overrides.

Keys are written with underscores in TOML (``top_p``) and accepted with dashes too in ``--set top-p=0.9``.
Validation messages name the option as the user typed it (``--top-p``) and say what is allowed. The settings
classes themselves live with what they configure (``ChainSettings`` in :mod:`.sampling.settings`, each method's in
its module); this module is how any of them is built from a preset, options and overrides.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import fields, replace
from importlib import resources
from pathlib import Path

from .errors import ConfigError
from .inputs import parse_float, parse_int, parse_toml, read_input_text

META_KEYS = ("description",)  # allowed in a preset file, not settings
PRESET_BYTES = 2**20  # a preset is a few lines of settings: at most 1 MiB


def option_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def _check(ok: bool, key: str, value, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{option_name(key)} {value}: {allowed}")


# --- parsing values from TOML and from --set strings ---------------------------------------------------------


PAIRS = tuple[tuple[str, float], ...]  # the type of a pair-valued setting (TEXT=BIAS, repeatable): the registry's


def parse_logit_bias(items, option: str = "--logit-bias") -> tuple[tuple[str, float], ...]:
    """TOKEN=BIAS strings (or a TOML table) -> ((token, bias), ...); TOKEN is an id or a single-token text."""
    if isinstance(items, dict):
        items = [f"{k}={v}" for k, v in items.items()]
    out = []
    for item in items:
        if isinstance(item, (list, tuple)) and len(item) == 2:
            out.append((str(item[0]), parse_float(item[1], f"{option} {item[0]!r}=")))
            continue
        token, sep, value = str(item).rpartition("=")
        if not sep or not token:
            raise ConfigError(f"{option} {item!r}: expected TOKEN=BIAS, e.g. 42=-inf or ' the'=2.5")
        try:
            out.append((token, parse_float(value, option)))
        except ConfigError:
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
    if kind is int:
        if isinstance(raw, float) and raw.is_integer() and abs(raw) < 2**63:  # TOML 5.0 for 5
            raw = int(raw)
        return parse_int(raw, option_name(key))
    if kind is float:
        return parse_float(raw, option_name(key))
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
    if hint == PAIRS:
        return parse_logit_bias(raw if not isinstance(raw, str) else [p for p in raw.split(",") if p],
                                option_name(key))
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
        text = read_input_text("--preset", path, limit=PRESET_BYTES)
    except ConfigError as exc:  # name the preset as typed, and say TOML files are UTF-8
        raise ConfigError(str(exc).replace(f"--preset {path}", f"--preset {spec!r}", 1)
                          .replace("give a UTF-8 file", "TOML files are UTF-8")) from None
    return path.stem, parse_toml(f"--preset {spec!r}", text)


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
    hints = typing.get_type_hints(type(settings))
    for f in fields(settings):
        if hints[f.name] == PAIRS:  # TEXT=BIAS settings as a table
            out[f.name] = {text: bias for text, bias in getattr(settings, f.name)}
    return out
