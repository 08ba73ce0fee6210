"""From parsed options to a prompt and a loaded model (everything else is built in core: decodelab.core.methods)."""

from __future__ import annotations

import sys
from pathlib import Path

from ..core.engine.models import LoadedModel, choose_threads, load_model, set_threads
from ..core.errors import ConfigError
from ..core.inputs import read_input_text, read_stdin
from .options import Opts
from .view.render import status


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    if prompt is not None and prompt_file is not None:
        raise ConfigError("PROMPT and --prompt-file: give one of them, not both")
    if prompt_file is not None:
        return read_input_text("--prompt-file", prompt_file)
    if prompt == "-":
        return read_stdin("PROMPT")
    if prompt is None:
        raise ConfigError("PROMPT: missing; give the prompt text, '-' for stdin, or --prompt-file")
    return prompt


def load(opts: Opts) -> LoadedModel:
    device_map = getattr(opts, "device_map", None)
    if device_map is not None and device_map != "auto":
        raise ConfigError(f"--device-map {device_map!r}: allowed: auto")
    use_threads(getattr(opts, "threads", None))
    with status(f"loading model {opts.model}"):
        return load_model(opts.model, device=opts.device, dtype=opts.dtype,
                          trust_remote_code=opts.trust_remote_code, device_map=device_map)


def use_threads(given: int | None) -> None:
    """torch's CPU threads: --threads, OMP_NUM_THREADS or the measured default; one line on stderr when the machine
    looks oversubscribed."""
    choice = choose_threads(given)
    if choice.threads is not None:
        set_threads(choice.threads)
    if choice.note is not None:
        sys.stderr.write(choice.note + "\n")


def export_instead(opts: Opts, settings, lm: LoadedModel | None = None, vocab: int | None = None) -> bool:
    """``--export``: print the settings for the other engine and return True (the command then runs nothing).
    hf and vllm: their keyword arguments as one JSON object; llamacpp: the llama-cli command line; what has no
    equivalent goes to stderr. With ``-f json`` everything is one object on stdout."""
    target = getattr(opts, "export", None)
    if target is None:
        return False
    from ..core.sampling.export import export
    from ..core.sampling.tokens import encode_plain
    from .options import Format
    from .view import render

    if lm is not None:
        result = export(settings, target, lm.vocab_size, encode=encode_plain(lm), token_id=lm.token_id,
                        eos_ids=tuple(lm.eos_ids), context=lm.context_length)
    else:
        result = export(settings, target, vocab)
    if opts.fmt in (Format.json, Format.jsonl):
        render.print_json(result.to_dict())
        return True
    if target == "llamacpp":
        render.write_record(result.command() + "\n")
    else:
        render.print_json(result.arguments)
    for line in [f"no equivalent: {u}" for u in result.unsupported] + [f"note: {n}" for n in result.notes]:
        sys.stderr.write(f"# {line}\n")
    return True
