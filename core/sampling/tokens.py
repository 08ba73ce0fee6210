"""Token resolution for settings that name tokens (logit bias, sequence bias, bans, the allow-list, DRY breakers):
texts through the model's tokenizer, or ids where there is no model; and the constraint, read from its options
(its file) and checked, which the constraint stage binds to the model's tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ..engine.models import LoadedModel
from ..errors import ConfigError
from ..inputs import is_int_text, parse_int
from .constraint import constraint_spec
from .registry import constraint_stage, stage_of
from .thinking import ThinkTags, parse_think_tags, tags_from_template
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
    items = text.replace(",", " ").split()
    if not all(is_int_text(t) for t in items):
        raise ConfigError(f"{option} {text!r}: without a model give token ids, e.g. '3' or '3 4'")
    ids = tuple(parse_int(t, option) for t in items)
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


@dataclass(frozen=True)
class Tokens:
    """How settings that name tokens become ids: with a model's tokenizer (``encode`` a text without special
    tokens, ``token_id`` a text that is one token, ``token_text`` an id's text, ``tokenizer`` the tokenizer itself,
    which the constraint stage reads whole), or ids only (no model: ``probs --dist``), or :meth:`placeholder` when
    settings are checked before any tokenizer exists (``checking``). ``vocab`` is the logits width."""

    vocab: int
    encode: Callable[[str], list[int]] | None = None
    token_id: Callable[[str], int] | None = None
    token_text: Callable[[int], str] | None = None
    tokenizer: object | None = None
    checking: bool = False

    @classmethod
    def of(cls, lm: LoadedModel) -> Tokens:
        return cls(lm.vocab_size, encode_plain(lm), lm.token_id, lm.token_text, lm.tokenizer)

    @classmethod
    def placeholder(cls) -> Tokens:
        """Every text is token 0: the shapes are checked, the ids come when a model is loaded (a constraint is
        compiled and checked without a vocabulary)."""
        return cls(2**31, lambda text: [0], lambda text: 0, None, None, checking=True)


def resolve_token_settings(s: ChainSettings, vocab: int, encode=None, token_id=None, token_text=None):
    """-> (logit bias {id: bias}, {"sequence-bias", "ban", "allow", "dry-breakers"} as token ids).

    ``encode`` (text -> ids) and ``token_id`` (a text that is one token -> its id) come from a tokenizer; without
    them every token is given by id."""
    bias: dict[int, float] = {}
    for token, value in s.logit_bias:
        if is_int_text(token):
            t = parse_int(token, f"--logit-bias {token}={value}: TOKEN")
        elif token_id is not None:
            try:
                t = token_id(token)
            except ConfigError as exc:
                raise ConfigError(f"--logit-bias {token}={value}: {exc}") from None
        else:
            raise ConfigError(f"--logit-bias {token}={value}: without a model TOKEN must be a token id")
        if not 0 <= t < vocab:
            raise ConfigError(f"--logit-bias {token}={value}: token id out of range [0, {vocab})")
        bias[t] = bias.get(t, 0.0) + value
    resolved = {  # keyed by the stage each setting belongs to (the key its row's value builder reads)
        stage_of("sequence_bias").name: tuple((token_sequence(t, "--sequence-bias", vocab, encode), b)
                                              for t, b in s.sequence_bias),
        stage_of("ban").name: tuple(token_sequence(t, "--ban", vocab, encode) for t in s.ban),
        stage_of("allow").name: tuple(i for t in s.allow for i in token_sequence(t, "--allow", vocab, encode)),
    }
    if s.dry_multiplier is not None:
        resolved["dry-breakers"] = dry_breakers(s.dry_breaker, vocab, encode, token_text)
    return bias, resolved


def resolve(s: ChainSettings, tokens: Tokens) -> dict:
    """Every token-naming setting of ``s`` as ids: {"bias", "sequence-bias", "ban", "allow", "dry-breakers"}; and
    "constraint", the :class:`~.constraint.ConstraintSpec` of --regex/--json-schema/--grammar/--choice (None: none)."""
    bias, resolved = resolve_token_settings(s, tokens.vocab, tokens.encode, tokens.token_id, tokens.token_text)
    spec = constraint_spec(regex=s.regex, json_schema=s.json_schema, grammar=s.grammar, choice=s.choice)
    tags = think_tags(s, tokens)
    if tags is None and tokens.checking:  # before the model loads: its chat template may name the markers
        tags = ThinkTags((0,), (1,))
    if getattr(s, "constraint_after_think", None):
        if spec is None:
            raise ConfigError("--constraint-after-think: give a constraint (--regex, --json-schema, --grammar or "
                              "--choice) to start after the thinking")
        spec = replace(spec, after=_needed(tags, "--constraint-after-think"))
    if getattr(s, "thinking_budget", None) is not None:
        _needed(tags, f"--thinking-budget {s.thinking_budget}")
    return {stage_of("logit_bias").name: bias, **resolved, constraint_stage(): spec, "think-tags": tags}


def think_tags(s: ChainSettings, tokens: Tokens) -> ThinkTags | None:
    """The thinking markers as ids: --think-tags, else the chat template's <think> (:mod:`.thinking`), else None."""
    texts = parse_think_tags(s.think_tags) if getattr(s, "think_tags", None) else None
    if texts is None and tokens.tokenizer is not None:
        texts = tags_from_template(getattr(tokens.tokenizer, "chat_template", None))
    if texts is None:
        return None
    start, end = (token_sequence(t, "--think-tags", tokens.vocab, tokens.encode) for t in texts)
    if start == end and not tokens.checking:
        raise ConfigError(f"--think-tags {s.think_tags!r}: both markers are the same tokens {list(start)}")
    return ThinkTags(start, end)


def _needed(tags: ThinkTags | None, option: str) -> ThinkTags:
    if tags is None:
        raise ConfigError(f"{option}: needs thinking markers: give --think-tags START,END (the tokenizer's chat "
                          "template has no <think>)")
    return tags


def encode_plain(lm: LoadedModel):
    """Text -> token ids without special tokens (sequence bias, bans, allow-list, DRY breakers)."""
    return lambda text: list(lm.tokenizer.encode(text, add_special_tokens=False))
