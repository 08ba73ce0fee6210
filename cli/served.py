"""``--engine URL`` on the commands: the local tokenizer, the connection (made once, before anything runs), and the
refusal of options with no meaning there (the JSON document's top level is core's: core/methods/served.py
engine_head)."""

from __future__ import annotations

from .options import Opts
from .view.render import status


def local_tokenizer(opts: Opts):
    """The -m model's tokenizer and config, without its weights (the server holds them)."""
    from ..core.engine.models import load_tokenizer

    with status(f"loading the tokenizer of {opts.model}"):
        return load_tokenizer(opts.model, trust_remote_code=opts.trust_remote_code)


def connect(opts: Opts, local, needs: dict[str, str]):
    """The served engine of --engine, checked: what the command needs, the tokenizer, the logprobs mode."""
    from ..core.methods.served import connect as reach

    with status(f"contacting {opts.engine}"):
        return reach(opts.engine, local, needs, model=opts.engine_model, timeout=opts.engine_timeout)


def refuse_options(command: str, given: dict[str, object]) -> None:
    """Options that have no meaning on a served engine, given with --engine: one line for the first."""
    from ..core.errors import ConfigError

    for option, value in given.items():
        if value not in (None, False, (), []):
            raise ConfigError(f"{option}: not on a served engine ({command} --engine); run without --engine")
