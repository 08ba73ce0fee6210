"""Token resolution for settings that name tokens (logit bias, sequence bias, bans, the allow-list, DRY breakers):
texts through the model's tokenizer, or ids where there is no model.
"""

from __future__ import annotations

from collections.abc import Callable

from ..engine.models import LoadedModel
from ..errors import ConfigError
from .semantics import DEFAULT_DRY_BREAKERS
from .settings import ChainSettings

# --- building what a plan describes -----------------------------------------------------------------------------


def token_sequence(text: str, option: str, vocab: int, encode: Callable[[str], list[int]] | None) -> tuple[int, ...]:
    """A token sequence named on the command line: with a tokenizer its text's tokens, without one ids ('3 4')."""
    if encode is not None:
        ids = tuple(encode(text))
        if not ids:
            raise ConfigError(f"{option} {text!r}: encodes to no tokens")
        return ids
    try:
        ids = tuple(int(t) for t in text.replace(",", " ").split())
    except ValueError:
        raise ConfigError(f"{option} {text!r}: without a model give token ids, e.g. '3' or '3 4'") from None
    if not ids:
        raise ConfigError(f"{option} {text!r}: give at least one token id")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ConfigError(f"{option} {text!r}: token id {bad[0]} out of range [0, {vocab})")
    return ids


def dry_breakers(texts, vocab: int, encode=None, token_text: Callable[[int], str] | None = None):
    """DRY breakers as token sequences. With a tokenizer each text is its tokens, and every token whose own text
    contains the breaker is a one-token breaker too (as llama.cpp's get_overlapping_token_sequences does for whole
    tokens; its partial-overlap sequences are not reproduced). Default with a tokenizer: llama.cpp's."""
    if encode is not None and not texts:
        texts = DEFAULT_DRY_BREAKERS
    out = [token_sequence(t, "--dry-breaker", vocab, encode) for t in texts]
    if encode is not None and token_text is not None:
        for t in texts:
            out += [(i,) for i in range(vocab) if t in token_text(i)]
    return tuple(dict.fromkeys(out))


def resolve_token_settings(s: ChainSettings, vocab: int, encode=None, token_id=None, token_text=None):
    """-> (logit bias {id: bias}, {"sequence-bias", "ban", "allow", "dry-breakers"} as token ids).

    ``encode`` (text -> ids) and ``token_id`` (a text that is one token -> its id) come from a tokenizer; without
    them every token is given by id."""
    bias: dict[int, float] = {}
    for token, value in s.logit_bias:
        if token.lstrip("-").isdigit():
            t = int(token)
        elif token_id is not None:
            t = token_id(token)
        else:
            raise ConfigError(f"--logit-bias {token}={value}: without a model TOKEN must be a token id")
        if not 0 <= t < vocab:
            raise ConfigError(f"--logit-bias {token}={value}: token id out of range [0, {vocab})")
        bias[t] = bias.get(t, 0.0) + value
    resolved = {
        "sequence-bias": tuple((token_sequence(t, "--sequence-bias", vocab, encode), b) for t, b in s.sequence_bias),
        "ban": tuple(token_sequence(t, "--ban", vocab, encode) for t in s.ban),
        "allow": tuple(i for t in s.allow for i in token_sequence(t, "--allow", vocab, encode)),
    }
    if s.dry_multiplier is not None:
        resolved["dry-breakers"] = dry_breakers(s.dry_breaker, vocab, encode, token_text)
    return bias, resolved


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


def encode_plain(lm: LoadedModel):
    """Text -> token ids without special tokens (sequence bias, bans, allow-list, DRY breakers)."""
    return lambda text: list(lm.tokenizer.encode(text, add_special_tokens=False))
