"""From parsed options to core objects: the prompt, the model, the resolved settings and the processor chain."""

from __future__ import annotations

import sys
from pathlib import Path

from ..core.config import ChainSettings
from ..core.errors import ConfigError
from ..core.model import LoadedModel, load_model
from ..core.processors import Chain, build_chain


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    if prompt is not None and prompt_file is not None:
        raise ConfigError("PROMPT and --prompt-file: give one of them, not both")
    if prompt_file is not None:
        try:
            return prompt_file.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"--prompt-file {prompt_file}: cannot read it ({exc.strerror})") from None
    if prompt == "-":
        return sys.stdin.read()
    if prompt is None:
        raise ConfigError("PROMPT: missing; give the prompt text, '-' for stdin, or --prompt-file")
    return prompt


def load(model: str, device: str, dtype: str, device_map: str | None, trust_remote_code: bool) -> LoadedModel:
    if device_map is not None and device_map != "auto":
        raise ConfigError(f"--device-map {device_map!r}: allowed: auto")
    return load_model(model, device=device, dtype=dtype, trust_remote_code=trust_remote_code, device_map=device_map)


def chain_options(temperature, top_k, top_p, min_p, typical_p, softcap, logit_bias, repetition_penalty,
                  no_repeat_ngram, chain) -> dict:
    """Explicit processor options as settings fields (None = not given on the command line)."""
    from ..core.config import parse_logit_bias

    return {
        "temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p, "typical_p": typical_p,
        "softcap": softcap, "repetition_penalty": repetition_penalty, "no_repeat_ngram": no_repeat_ngram,
        "logit_bias": parse_logit_bias(logit_bias) if logit_bias else None,
        "chain": tuple(s.strip() for s in chain.split(",") if s.strip()) if chain else None,
    }


def bias_token_ids(lm: LoadedModel, logit_bias) -> dict[int, float]:
    """--logit-bias TOKEN=BIAS pairs -> {token id: bias}; TOKEN is an id or a text that is exactly one token."""
    out: dict[int, float] = {}
    for token, bias in logit_bias:
        if token.lstrip("-").isdigit():
            token_id = int(token)
            if not 0 <= token_id < lm.vocab_size:
                raise ConfigError(f"--logit-bias {token}={bias}: token id out of range [0, {lm.vocab_size})")
        else:
            try:
                token_id = lm.token_id(token)
            except ConfigError as exc:
                raise ConfigError(f"--logit-bias {token}={bias}: {exc}") from None
        out[token_id] = out.get(token_id, 0.0) + bias
    return out


def make_chain(lm: LoadedModel, settings: ChainSettings) -> Chain:
    bias = bias_token_ids(lm, settings.logit_bias)
    order = list(settings.chain) if settings.chain is not None else None
    return build_chain(settings.stage_values(bias), order)
