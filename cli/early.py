"""Checks that need no torch, run when a command starts (cli/options.py ``command``): a model name that names no
model (``-m``, ``--draft``, ``--against``; a path is left to the loader) and an empty prompt for a bundled model fail in one line before the
10-second import of torch and transformers, instead of after it."""

from __future__ import annotations

from . import notes
from ..core.engine.locate import BUNDLED, hub_offline, model_folder
from ..core.errors import ConfigError, ModelLoadError
from ..core.methods.speculative.names import model_member

# the commands' own options that name a second model, and how each reads its value into the model it names (None:
# no model; --draft's lookup proposers and chains are read by the speculative names' owner)
MODEL_OPTIONS = {"draft": ("--draft", model_member), "against": ("--against", lambda spec: spec)}


def is_name(spec) -> bool:
    """A model given by name (bundled, or a hub id), not by path: a path ('/', '.', '~') is checked when the model
    loads, after the command's own values, so that a bad value is still the line a run with a missing folder gives."""
    return isinstance(spec, str) and not spec.startswith(("/", ".", "~"))


def check_models(opts, own: dict) -> None:
    """``-m`` and the model-naming options given by name, found the same way and with the same message as loading
    would give."""
    hub_offline()
    model = getattr(opts, "model", None)
    if is_name(model):
        model_folder(model)
    for name, (option, model_of) in MODEL_OPTIONS.items():
        spec = own.get(name)
        spec = model_of(spec) if isinstance(spec, str) else None
        if is_name(spec):
            try:
                model_folder(spec)
            except ModelLoadError as exc:
                raise ModelLoadError(str(exc).replace(f"--model {spec}", f"{option} {spec}", 1)) from None


def check_empty_prompt(opts) -> None:
    """An empty PROMPT with a bundled model: its tokenizer adds no token, so the prompt would be 0 tokens (the error
    core gives after loading, core/engine/tokens.py ``check_prompt``). Other models may add a BOS token and are left
    to that check; ``--chat`` wraps even an empty prompt."""
    if getattr(opts, "prompt", None) == "" and getattr(opts, "model", None) in BUNDLED \
            and not getattr(opts, "chat", False) and getattr(opts, "prompt_file", None) is None:
        raise ConfigError("PROMPT: the prompt is empty (0 tokens); give some text")


HOT = 2.0  # above this a temperature flattens the distribution towards uniform: likely -t meant as threads


def temperature_note(opts) -> None:
    """``-t 4`` is the thread count to a llama-cli user and the temperature here: a temperature above 2 gets one
    note on stderr when the run succeeds (cli/notes.py)."""
    t = getattr(opts, "temperature", None)
    if isinstance(t, (int, float)) and t > HOT:
        shown = f"{t:g}"
        notes.add(f"note: temperature {shown} samples nearly uniformly (did you mean --threads {shown}? "
                  "-t is --temperature here)")
