"""Constrained decoding as one more chain stage: ``--regex``, ``--json-schema``, ``--grammar``, ``--choice``.

The matcher is llguidance (docs/constraints.md says why); decodelab writes no grammar engine. The stage is exact:
with ``g`` the bytes of the generated tokens and ``L`` the constraint's language (a set of byte strings),

    allowed(g) = { t not an end id : g + bytes(t) is a prefix of some string of L }
    an end id (EOS) is allowed  iff  g is in L

so after a complete match that nothing may extend, only the end ids remain. llguidance's own canonical-token
forcing (it bans a token that starts a non-canonical tokenization of bytes the grammar forces) is switched off
(``no_forcing``): it would remove tokens the grammar allows, which is not the constraint's to decide.

The matcher state is a function of the generated tokens ``ids[:, prompt_len:]`` alone, so the stage keeps a trie
from generated prefixes to matcher states and reads each row's state off it: beam search reordering its rows,
speculative decoding querying draft positions and rolling back a rejected draft, or ``score`` replaying given
tokens all look a prefix up, extending the longest one already there. Nothing has to be told when a row moves, so
the stage has no ``accept``: it is a pure function of ``(ids, logits)`` like every stage without state.

What the stage needs from the chain builder: the model's tokenizer (a fast Hugging Face tokenizer), the end ids
and the logits width at construction; the prompt length by ``reset(prompt_len)`` before each run. The registry
makes it with :meth:`ConstraintStage.bind` from the run's stage context; before any model exists (settings checked
up front) that gives a :class:`CheckedConstraint`, the constraint compiled and its language checked.
"""

from __future__ import annotations

import functools
import json
import math
import re
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..errors import ChainError, ConfigError
from ..inputs import check_text, read_input_text
from .registry import implements
from .thinking import answer_start

NEG_INF = float("-inf")
OPTIONS = {"regex": "--regex", "json-schema": "--json-schema", "grammar": "--grammar", "choice": "--choice"}

# Appended (not prepended) so the line numbers of a grammar file's errors stay the file's own.
EXACT_OPTIONS = '\n%llguidance {"no_forcing": true}\n'


# --- the constraint as the user gave it -------------------------------------------------------------------------


@dataclass(frozen=True)
class ConstraintSpec:
    """One constraint per run: ``kind`` (a key of OPTIONS), ``value`` as given on the command line (the regex, the
    file's path, the comma-separated labels) and ``source``, the text it stands for (the file's contents)."""

    kind: str
    value: str
    source: str
    after: object | None = None  # thinking.ThinkTags: the constraint starts after the end-of-thinking marker

    @property
    def option(self) -> str:
        return OPTIONS[self.kind]

    @property
    def labels(self) -> tuple[str, ...]:
        """--choice's labels: split on commas, spaces kept (' no' and 'no' are different texts)."""
        return tuple(self.source.split(",")) if self.kind == "choice" else ()

    def __str__(self) -> str:
        return f"{self.option} {self.value if self.kind in ('json-schema', 'grammar') else _quoted(self.value)}"

    def error(self, why: str) -> ConfigError:
        """One line naming the option and the value: a file's path as is, a regex or labels quoted."""
        shown = self.value if self.kind in ("json-schema", "grammar") else _quoted(self.value)
        return ConfigError(f"{self.option} {shown}: {why}")

    def lark(self) -> str:
        """The constraint as one Lark grammar for llguidance, with the exact (no-forcing) option."""
        from llguidance import regex_to_lark
        from llguidance.gbnf_to_lark import any_to_lark

        if self.kind == "regex":
            body = "start: /" + regex_to_lark(self.source, "") + "/"
        elif self.kind == "json-schema":
            body = "start: %json " + json.dumps(json.loads(self.source))  # on one line, as Lark reads it
        elif self.kind == "choice":
            body = "start: " + " | ".join(json.dumps(label, ensure_ascii=False) for label in self.labels)
        else:
            try:
                body = any_to_lark(self.source)  # GBNF (llama.cpp) becomes Lark; Lark passes through
            except Exception as exc:  # llguidance's converter raises its own error type
                raise self.error(f"not a Lark or GBNF grammar ({_one_line(str(exc), True)})") from None
        return body + EXACT_OPTIONS

    def grammar(self) -> str:
        """The llguidance grammar, checked without any model: the library accepts it and it matches some
        non-empty text (an empty or only-empty language is a ConfigError naming the option)."""
        from llguidance import LLMatcher

        grammar = LLMatcher.grammar_from_lark(self.lark())
        message = LLMatcher.validate_grammar(grammar, None)
        if message:
            raise self.error(_one_line(message, keep_position=self.kind == "grammar"))
        check_language(self, grammar)
        return grammar


def constraint_spec(regex: str | None = None, json_schema: str | Path | None = None,
                    grammar: str | Path | None = None, choice: str | None = None) -> ConstraintSpec | None:
    """The run's constraint from the four options (None: unconstrained); files are read here, up front."""
    given = {k: v for k, v in (("regex", regex), ("json-schema", json_schema), ("grammar", grammar),
                               ("choice", choice)) if v is not None}
    if not given:
        return None
    if len(given) > 1:
        names = " and ".join(OPTIONS[k] for k in given)
        raise ConfigError(f"{names}: one constraint per run; choose one")
    (kind, value), = given.items()
    value = str(value)
    check_text(OPTIONS[kind], value)  # a byte that is not UTF-8 arrives as a lone surrogate
    source = _read(kind, value) if kind in ("json-schema", "grammar") else value
    spec = ConstraintSpec(kind, value, source)
    if kind == "json-schema":
        _check_json(spec)
    if kind == "choice":
        _check_labels(spec)
    return spec


def _read(kind: str, path: str) -> str:
    """The file's text, or one line naming the option: an empty path, a missing file, a folder, not UTF-8."""
    if not path.strip():
        raise ConfigError(f"{OPTIONS[kind]} '': give a file's path")
    return read_input_text(OPTIONS[kind], path)


def _check_json(spec: ConstraintSpec) -> None:
    try:
        json.loads(spec.source)
    except json.JSONDecodeError as exc:
        raise spec.error(f"not valid JSON (line {exc.lineno} column {exc.colno}: {exc.msg})") from None


def _check_labels(spec: ConstraintSpec) -> None:
    labels = spec.labels
    if any(label == "" for label in labels):
        raise spec.error("a label is empty (labels are separated by commas)")
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise spec.error(f"the label {twice[0]!r} is given twice")


def _quoted(value: str) -> str:
    """'value' as typed (backslashes kept single), or Python's repr when it holds a newline or other control."""
    return f"'{value}'" if value.isprintable() else repr(value)


def _one_line(message: str, keep_position: bool) -> str:
    """llguidance's multi-line message as one line: its first line (without the ``at L(C):`` position, which for
    a regex, a schema or a choice points into decodelab's wrapper grammar) plus the parser's own ``error:`` line."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    head = lines[0] if lines else "rejected by the matcher"
    if not keep_position:
        head = re.sub(r"^at \d+\(\d+\):\s*", "", head)
    detail = next((line[len("error:"):].strip() for line in lines[1:] if line.startswith("error:")), None)
    if detail and head.endswith(":"):
        head = f"{head} {detail}"
    return head.rstrip(":")


# --- the language without a model: a vocabulary of the 256 bytes --------------------------------------------------


class _ByteTokenizer:
    """Token i is byte i, token 256 the end: every byte string has exactly one tokenization, so the language is
    empty iff nothing is allowed at the start, and only-empty iff the start accepts and allows no byte."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<end>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


@functools.lru_cache(maxsize=1)
def _byte_tokenizer():
    from llguidance import LLTokenizer, TokenizerWrapper

    return LLTokenizer(TokenizerWrapper(_ByteTokenizer()))


def check_language(spec: ConstraintSpec, grammar: str) -> None:
    """ConfigError when the constraint matches no text, or only the empty text (nothing to generate)."""
    from llguidance import LLMatcher

    matcher = LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    words = _words(matcher.compute_bitmask())
    starts = bool(_unpack(words.unsqueeze(0), 256).any())  # the end (bit 256) is not among the first 256
    if matcher.is_error() or not starts:
        if matcher.is_accepting() and not matcher.is_error():
            raise spec.error("matches only the empty text: nothing to generate")
        raise spec.error("matches no text")


# --- the model's vocabulary as the matcher sees it ---------------------------------------------------------------


def _words(bitmask: bytes) -> Tensor:
    """llguidance's mask, one bit per token, as int32 words: token 32 w + j is bit j of word w."""
    return torch.frombuffer(bytearray(bitmask), dtype=torch.int32)


_BIT = torch.arange(32, dtype=torch.int32)


def _unpack(words: Tensor, size: int) -> Tensor:
    """[B, W] int32 words -> [B, size] bool: allowed[b, 32 w + j] = (words[b, w] >> j) & 1 (an arithmetic shift
    copies the sign bit leftwards, which the & 1 discards)."""
    bits = (words.unsqueeze(-1) >> _BIT.to(words.device)) & 1
    return bits.flatten(1)[:, :size].bool()


def _whitespace_only(text: bytes) -> bool:
    """Non-empty text made of whitespace alone (after UTF-8 decoding; a split character is not whitespace)."""
    try:
        return text.decode("utf-8").isspace()
    except UnicodeDecodeError:
        return False


@dataclass(frozen=True, eq=False)
class ConstraintVocabulary:
    """The model's tokenizer as llguidance reads it (token bytes from ``tokenizer.json``), the logits width, the end
    ids, and which tokens are whitespace-only text. Building it reads the whole vocabulary once (50 ms for the bundled
    4096 tokens, growing with the vocabulary): a chain builder that makes several chains for one model can build it
    once and hand it in. Its ConfigErrors say what is wrong; the stage prefixes the option."""

    tokenizer: object  # llguidance.LLTokenizer
    size: int
    eos_ids: tuple[int, ...]
    whitespace: Tensor  # [size] bool

    @classmethod
    def from_tokenizer(cls, tokenizer, eos_ids: Sequence[int] = (), vocab_size: int | None = None):
        import llguidance.hf

        eos = tuple(int(e) for e in eos_ids)
        try:
            lt = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos) or None)
        except ValueError as exc:
            raise ConfigError(f"this tokenizer cannot drive the matcher ({exc})") from None
        size = lt.vocab_size  # llguidance has refused an end id outside [0, size) above
        ws = [not lt.is_special_token(i) and _whitespace_only(lt.decode_bytes([i])) for i in range(size)]
        return cls(lt, size, eos, torch.tensor(ws, dtype=torch.bool))

    @classmethod
    def cached(cls, tokenizer, eos_ids: Sequence[int] = (), vocab_size: int | None = None):
        """:meth:`from_tokenizer`, read once per tokenizer, end ids and width (the chains of one model share it)."""
        key = (tuple(int(e) for e in eos_ids), vocab_size)
        try:
            table = _VOCABULARIES.setdefault(tokenizer, {})
        except TypeError:  # a tokenizer that takes no weak reference: read it every time
            return cls.from_tokenizer(tokenizer, eos_ids, vocab_size)
        if key not in table:
            table[key] = cls.from_tokenizer(tokenizer, eos_ids, vocab_size)
        return table[key]

    def text(self, tokens: Sequence[int]) -> bytes:
        return self.tokenizer.decode_bytes(list(tokens))


_VOCABULARIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {(eos, width): vocabulary}


# --- the prefix trie of matcher states ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ends:
    """What every node of one stage shares: the vocabulary size, the mask width in words, the end ids, and the
    columns the stage decides itself (its end ids and any end llguidance took from the tokenizer)."""

    size: int
    width: int
    eos: frozenset[int]
    columns: tuple[int, ...]

    def fix(self, words: Tensor, accepting: bool) -> Tensor:
        """The words with the end columns decided here: set for the end ids iff the grammar accepts, clear for the
        rest. Token e is bit e % 8 of byte e // 8 of the little-endian words."""
        octets = words.view(torch.uint8)
        for e in self.columns:
            octets[e >> 3] &= ~(1 << (e & 7)) & 0xFF
        if accepting:
            for e in self.eos:
                octets[e >> 3] |= 1 << (e & 7)
        return words


class _Node:
    """One generated prefix: its matcher (None once ended or dead), its mask words with the end columns decided
    (computed on first use), whether the grammar accepts here, and the prefixes one token longer seen so far."""

    __slots__ = ("matcher", "ended", "children", "_words", "_accepting")

    def __init__(self, matcher=None, ended: bool = False):
        self.matcher, self.ended, self.children = matcher, ended, {}
        self._words: Tensor | None = None
        self._accepting = ended

    def mask(self, ends: _Ends) -> tuple[Tensor, bool]:
        """(words [width] int32 of the allowed tokens, accepting). An ended prefix (an end id after an accepted
        text) allows only the end ids again; a dead one (a token the grammar rejects) allows nothing."""
        if self._words is None:
            words = torch.zeros(ends.width, dtype=torch.int32)
            if self.matcher is not None:
                words = _words(self.matcher.compute_bitmask())
                if self.matcher.is_error():  # llguidance's error-state mask would let EOS through; nothing does
                    self.matcher, words = None, torch.zeros(ends.width, dtype=torch.int32)
                self._accepting = self.matcher is not None and self.matcher.is_accepting()
            self._words = ends.fix(words, self._accepting)
        return self._words, self._accepting

    def child(self, token: int, ends: _Ends) -> _Node:
        node = self.children.get(token)
        if node is None:
            node = self.children[token] = self._extend(token, ends)
        return node

    def _extend(self, token: int, ends: _Ends) -> _Node:
        accepting = self.mask(ends)[1]
        if token in ends.eos:
            return _Node(ended=accepting)  # an end id ends an accepted text (and pads an ended one); else dead
        if self.matcher is None or not 0 <= token < ends.size:
            return _Node()
        matcher = self.matcher.deep_copy()  # this prefix keeps its own state for its other continuations
        return _Node(matcher if matcher.consume_token(token) else None)


# --- the stage ---------------------------------------------------------------------------------------------------

END, SPACE, TEXT = 0, 1, 2  # token classes for the trace: an end id, whitespace-only text, other text
STATE_KEYS = ("allowed", "forced", "top1_banned", "whitespace_only", "accepting", "log_mass_kept")


@implements("constraint")
class ConstraintStage:
    """Mask every token the constraint does not allow to -inf (module doc: the rule, the prefix trie).

    ``tokenizer``: the model's fast Hugging Face tokenizer, or a :class:`ConstraintVocabulary` built from one;
    ``eos_ids``: the end ids (allowed exactly where the grammar accepts; ignored when a vocabulary is given, which
    has its own); ``vocab_size``: the logits width, when the model pads its vocabulary beyond the tokenizer's.

    ``state()`` after a call gives, per row, as [B] float tensors: ``allowed`` (how many tokens the constraint
    allows, end ids included), ``forced`` (1 if exactly one), ``top1_banned`` (1 if every token of the input's
    maximal logit is removed, so a tie with an allowed token does not count), ``whitespace_only`` (1 if there are
    allowed tokens besides the end ids and all of them are whitespace-only text), ``accepting`` (1 if the
    grammar accepts the generated text, so the end ids are allowed) and ``log_mass_kept`` (:func:`removed_log_mass`:
    log of the probability mass it kept under its input's distribution, <= 0, precise where the kept mass is tiny;
    a run's total is the sum). They are computed when asked (a run that records no trace pays nothing for them).
    The mass removed itself is the chain's stage statistic.
    """

    name = "constraint"
    reads_ids = True  # each position needs its own prefix (Chain.uses_ids)

    def __init__(self, spec: ConstraintSpec, tokenizer, eos_ids: Sequence[int] = (), vocab_size: int | None = None):
        from llguidance import LLMatcher

        self.spec = spec
        if isinstance(tokenizer, ConstraintVocabulary):
            self.vocabulary = tokenizer
        else:
            try:
                self.vocabulary = ConstraintVocabulary.from_tokenizer(tokenizer, eos_ids, vocab_size)
            except ConfigError as exc:
                raise spec.error(str(exc)) from None
        self.eos_ids = self.vocabulary.eos_ids
        self.prompt_len: int | None = None
        matcher = LLMatcher(self.vocabulary.tokenizer, spec.grammar(), log_level=0)
        if matcher.is_error():
            raise spec.error(_one_line(matcher.get_error(), keep_position=spec.kind == "grammar"))
        size, eos = self.vocabulary.size, frozenset(self.eos_ids)
        # llguidance's masks may carry a word more than size / 32 needs: a dead prefix's empty mask takes their width
        width = len(matcher.compute_bitmask()) // 4
        self._ends = _Ends(size, width, eos, tuple(sorted(eos | set(self.vocabulary.tokenizer.eos_tokens))))
        classes = torch.where(self.vocabulary.whitespace, SPACE, TEXT)
        classes[list(eos)] = END
        self._classes = torch.nn.functional.one_hot(classes, 3).float()  # [V, 3]: counts per class by one matmul
        self._root = _Node(matcher)
        self._last: tuple | None = None
        if not self.next_tokens(())[0]:
            raise spec.error("no token of the model's vocabulary can start it")

    @classmethod
    def bind(cls, spec: ConstraintSpec, context) -> ConstraintStage | CheckedConstraint:
        """The registry's maker, from a :class:`~.registry.StageContext`: its ``tokens`` (the model's tokenizer and
        logits width) and ``eos_ids``. Settings checked before a model exists (``tokens.checking``, or no tokens at
        all) give a :class:`CheckedConstraint`; tokens without a tokenizer (``probs --dist``) are an error."""
        tokens = getattr(context, "tokens", None)
        if tokens is None or tokens.checking:
            return CheckedConstraint(spec)
        if tokens.tokenizer is None:
            raise spec.error("needs a model's tokenizer (a distribution typed in by hand has no token texts)")
        try:
            vocabulary = ConstraintVocabulary.cached(tokens.tokenizer, context.eos_ids, tokens.vocab)
        except ConfigError as exc:
            raise spec.error(str(exc)) from None
        return cls(spec, vocabulary)

    def reset(self, prompt_len: int) -> None:
        """Before a run: where the prompt ends. The trie of the previous run is dropped (its states stay valid, as
        they depend on generated tokens only, but would only grow); the start state is kept."""
        if not isinstance(prompt_len, int) or prompt_len < 0:
            raise ChainError(f"constraint: prompt length {prompt_len!r} must be an integer >= 0")
        self.prompt_len = prompt_len
        self._root.children.clear()

    def node(self, generated: Sequence[int]) -> _Node:
        """The trie node of a generated prefix: walk the longest prefix already there, extend by the rest. The walk
        costs one dict lookup per generated token; states are shared, never edited."""
        node = self._root
        for token in generated:
            node = node.child(int(token), self._ends)
        return node

    def masks(self, rows: list[list[int]], device) -> tuple[Tensor, list[bool]]:
        """allowed [B, V] bool on ``device`` and accepting per row, for generated prefixes ``rows``: the packed
        words travel (V / 32 int32 per row) and are unpacked there."""
        found = [self.node(row).mask(self._ends) for row in rows]
        words = torch.stack([w for w, _ in found]).to(device)
        return _unpack(words, self._ends.size), [a for _, a in found]

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        if self.prompt_len is None:
            raise ChainError("constraint: the run never said where the prompt ends (Chain.reset(prompt_len))")
        if logits.shape[-1] != self._ends.size:
            raise ChainError(f"constraint: the logits have {logits.shape[-1]} entries, the constraint's "
                             f"vocabulary {self._ends.size}")
        if ids.shape[1] < self.prompt_len:
            raise ChainError(f"constraint: {ids.shape[1]} ids are fewer than the prompt's {self.prompt_len}")
        if self.spec.after is None:
            rows = ids[:, self.prompt_len:].tolist()  # the matcher runs on the host: one transfer of the new ids
            allowed, accepting = self.masks(rows, logits.device)
        else:
            allowed, accepting = self._after_thinking(ids.tolist(), logits.device)
        out = logits.masked_fill(~allowed, NEG_INF)
        self._last = (logits, out, allowed, accepting)
        return out

    def _after_thinking(self, rows: list[list[int]], device) -> tuple[Tensor, list[bool]]:
        """--constraint-after-think: each row's constraint text starts at its answer's start
        (:func:`.thinking.answer_start`); a row still thinking has every token allowed (``active`` 0 in the trace)."""
        starts = [answer_start(row, self.prompt_len, self.spec.after) for row in rows]
        allowed, accepting = self.masks([row[a:] if a is not None else [] for row, a in zip(rows, starts)], device)
        thinking = torch.tensor([a is None for a in starts], device=device)
        self._active = ~thinking
        return allowed | thinking.unsqueeze(-1), [acc and a is not None for acc, a in zip(accepting, starts)]

    def state(self) -> dict[str, Tensor]:
        """The trace numbers of the last call (class doc), [B] float tensors on the logits' device."""
        if self._last is None:
            return {}
        before, after, allowed, accepting = self._last
        per_class = allowed.float() @ self._classes.to(allowed.device)  # [B, 3]: end ids, whitespace, other text
        count = per_class.sum(dim=-1)
        whitespace_only = (per_class[:, SPACE] > 0) & (per_class[:, TEXT] == 0)
        top1_banned = after.amax(dim=-1) < before.amax(dim=-1)  # every arg-max removed (-inf < -inf is False)
        flags = torch.stack([count, count == 1, top1_banned, whitespace_only,
                             torch.tensor(accepting, device=allowed.device), removed_log_mass(before, after)]).float()
        out = dict(zip(STATE_KEYS, flags))
        if self.spec.after is not None:
            out["active"] = self._active.float()
        return out

    def next_tokens(self, generated: Sequence[int]) -> tuple[list[int], bool]:
        """The allowed tokens after ``generated`` other than the end ids, and whether the grammar accepts there."""
        allowed, accepting = self.masks([list(generated)], "cpu")
        allowed[0, list(self._ends.columns)] = False
        return allowed[0].nonzero().flatten().tolist(), accepting[0]


class CheckedConstraint:
    """The constraint as the chain builder makes it before any model exists: compiled and its language checked
    (:meth:`ConstraintSpec.grammar`, every error one line naming the option), so bad input fails before a model
    loads. It has no vocabulary and cannot run."""

    name = "constraint"
    reads_ids = True

    def __init__(self, spec: ConstraintSpec):
        spec.grammar()
        self.spec = spec

    def reset(self, prompt_len: int) -> None:
        return None

    def __call__(self, ids: Tensor, logits: Tensor) -> Tensor:
        raise ChainError("constraint: checked without a model's tokenizer; build the chain with the model's Tokens")


def removed_log_mass(logits_before: Tensor, logits_after: Tensor) -> Tensor:
    """[B] log of the probability mass the stage kept, under the distribution before it:

        log sum_{i kept} p_i = logsumexp(z_kept) - logsumexp(z),   kept = {i : after_i > -inf}

    (<= 0; -inf when nothing is kept). Summed over a run's steps it is log prod_t m_t, where m_t is the mass kept at
    step t: how much less likely the model found the constrained output than under its own conditionals, since each
    constrained probability is the model's divided by m_t. Computed as a difference of log-sum-exps, not as
    log(1 - removed), so a tiny kept mass keeps its precision."""
    z = logits_before.float()
    kept = ~torch.isneginf(logits_after)
    total = torch.logsumexp(z, dim=-1)
    kept_total = torch.logsumexp(z.masked_fill(~kept, NEG_INF), dim=-1)
    return torch.where(torch.isneginf(kept_total), NEG_INF, kept_total - total)


# --- exact choice scoring ----------------------------------------------------------------------------------------

Scorer = Callable[[tuple[int, ...]], float]  # log P(tokens | prompt) = sum of the tokens' conditional log-probs
AllowedNext = Callable[[tuple[int, ...]], tuple[Sequence[int], "str | None"]]


def label_encodings(labels: Sequence[str], encode: Callable[[str], list[int]], spell: Callable[[list[int]], bytes],
                    prompt: str | None = None) -> dict[str, list[tuple[int, ...]]]:
    """The tokenizations of each label that matter, the tokenizer's own first.

    1. ``encode(label)``: the label's tokens on their own.
    2. With a prompt: ``encode(prompt + label)[n:]``, n = len(encode(prompt)), the tokens the tokenizer gives the
       label after the prompt's text, kept only when ``encode(prompt + label)`` begins with ``encode(prompt)``.
       Otherwise the joint tokenization rewrites the prompt's own last tokens (a prompt ending in a space that the
       label's first word absorbs, as ' yes' in byte-level BPE) and is no continuation of the prompt ids the model
       is given. A prompt ending without a space is where this can differ from 1: a SentencePiece tokenizer that
       adds a word-start marker to a text on its own gives '▁yes' for 'yes', yet 'yes' after 'Answer:'.

    A tokenization that does not spell exactly the label's bytes (the marker above: '▁yes' spells ' yes') is
    dropped, and a label left with none is a ConfigError: the label probability is of that exact text.
    ``encode`` must add no special tokens; ``spell`` gives a token list's bytes."""
    out = {}
    base = encode(prompt) if prompt else []
    for label in labels:
        found = [tuple(encode(label))]
        if prompt:
            joint = encode(prompt + label)
            if joint[: len(base)] == base:
                found.append(tuple(joint[len(base):]))
        spelled = [t for t in dict.fromkeys(found) if t and spell(list(t)) == label.encode("utf-8")]
        if not spelled:
            raise ConfigError(f"--choice: the tokenizer does not spell the label {label!r} exactly")
        out[label] = spelled
    return out


@dataclass(frozen=True)
class LabelScore:
    """One label's probability three ways. ``exact``: sum over its listed tokenizations of the product of their
    tokens' conditionals; ``share``: exact / sum of exact over the labels (what the estimates estimate);
    ``first_token``: p(first token of the tokenizer's own encoding), renormalized over the labels; ``sampler``:
    the probability that the constrained sampler (the constraint alone, temperature 1) ends on this label;
    ``all_paths``: the model's mass over every token path the sampler's tree allows for this label text (exact
    over all tokenizations, the listed ones included)."""

    label: str
    tokenizations: tuple[tuple[tuple[int, ...], float], ...]  # (tokens, probability)
    exact: float
    share: float
    first_token: float
    sampler: float
    all_paths: float

    @property
    def first_token_error(self) -> float:
        return self.first_token - self.share

    @property
    def sampler_error(self) -> float:
        return self.sampler - self.share


@dataclass(frozen=True)
class ChoiceScores:
    labels: tuple[LabelScore, ...]
    sampler_lost: float  # sampler mass that reached a prefix with nothing allowed (not a label)
    sampler_unexplored: float  # sampler mass below min_mass, not walked (bounds the sampler's error from pruning)


def _logsumexp(values: Sequence[float]) -> float:
    """log sum exp v_i, with the max taken out (-inf for an empty or all -inf list)."""
    m = max(values, default=NEG_INF)
    if m == NEG_INF:
        return NEG_INF
    return m + math.log(sum(math.exp(v - m) for v in values))


def choice_probabilities(logprob_of_continuation: Scorer, encodings: dict[str, list[tuple[int, ...]]], *,
                         eos_ids: Sequence[int] = (), allowed_next: AllowedNext | None = None,
                         min_mass: float = 0.0) -> ChoiceScores:
    """Each label's exact probability beside the two estimates people use, with their errors (module doc).

    ``logprob_of_continuation(tokens)`` is log P(tokens | prompt) (0 for no tokens); it must score end ids too
    when ``eos_ids`` are given. ``encodings[label]``: its tokenizations (:func:`label_encodings`), the tokenizer's
    own first. ``allowed_next(prefix)`` gives the constraint's allowed tokens after a generated prefix (end ids
    excluded) and the label that prefix completes, or None (:func:`stage_allowed_next` builds it from a
    ConstraintStage); without it the sampler walks the trie of the listed tokenizations, i.e. a constraint that
    allows only those. Subtrees whose model and sampler mass are both below ``min_mass`` are not walked."""
    score = logprob_of_continuation
    labels = list(encodings)
    log_exact = {lab: _logsumexp([score(tuple(t)) for t in dict.fromkeys(encodings[lab])]) for lab in labels}
    total = _logsumexp(list(log_exact.values()))
    log_first = {lab: score(tuple(encodings[lab][0][:1])) for lab in labels}
    first_total = _logsumexp(list(log_first.values()))
    walk = _SamplerWalk(score, tuple(eos_ids), allowed_next or _trie_allowed_next(encodings), min_mass)
    walk.run()
    out = []
    for lab in labels:
        toks = tuple((tuple(t), math.exp(score(tuple(t)))) for t in dict.fromkeys(encodings[lab]))
        out.append(LabelScore(
            label=lab, tokenizations=toks, exact=math.exp(log_exact[lab]),
            share=math.exp(log_exact[lab] - total) if total > NEG_INF else 0.0,
            first_token=math.exp(log_first[lab] - first_total) if first_total > NEG_INF else 0.0,
            sampler=walk.sampler.get(lab, 0.0), all_paths=walk.model.get(lab, 0.0)))
    return ChoiceScores(tuple(out), walk.lost, walk.unexplored)


def _trie_allowed_next(encodings: dict[str, list[tuple[int, ...]]]) -> AllowedNext:
    """allowed_next over the listed tokenizations only: a prefix's children in their trie, and its label."""
    children: dict[tuple[int, ...], list[int]] = {}
    ends: dict[tuple[int, ...], str] = {}
    for label, toks in encodings.items():
        for t in toks:
            t = tuple(t)
            ends[t] = label
            for i in range(len(t)):
                kids = children.setdefault(t[:i], [])
                if t[i] not in kids:
                    kids.append(t[i])
    return lambda prefix: (children.get(prefix, []), ends.get(prefix))


class _SamplerWalk:
    """Every path of the constrained sampler from the empty prefix. At a prefix x with allowed tokens A(x) (plus the
    end ids when x completes a label), the sampler draws t with q(t | x) = p(t | x) / sum_{u in A(x)} p(u | x);
    a path's sampler probability is the product of its q, its model probability the product of its p. Drawing an
    end id ends the path on x's label; a complete label with nothing allowed after it (no end ids) ends there too."""

    def __init__(self, score: Scorer, eos_ids: tuple[int, ...], allowed_next: AllowedNext, min_mass: float):
        self.score, self.eos, self.allowed_next, self.min_mass = score, eos_ids, allowed_next, min_mass
        self.sampler: dict[str, float] = {}
        self.model: dict[str, float] = {}
        self.lost = self.unexplored = 0.0

    def run(self) -> None:
        stack = [((), 0.0, 0.0)]  # (prefix, log p(prefix), log q(prefix))
        while stack:
            prefix, log_p, log_q = stack.pop()
            stack.extend(self._visit(prefix, log_p, log_q))

    def _visit(self, prefix, log_p: float, log_q: float) -> list:
        tokens, label = self.allowed_next(prefix)
        if label is not None:
            self.model[label] = self.model.get(label, 0.0) + math.exp(log_p)
        candidates = [int(t) for t in tokens] + (list(self.eos) if label is not None else [])
        if not candidates:
            if label is not None:
                self._add(label, log_q)
            else:
                self.lost += math.exp(log_q)
            return []
        # log p(t | x) = log P(x + t) - log P(x), log q(t | x) = log p(t | x) - log sum_u p(u | x). A lone candidate
        # has q(t | x) = 1 whatever p, p = 0 included (where the difference would be -inf - -inf), and a lone end id
        # needs no score at all.
        single = len(candidates) == 1
        conditional = [0.0 if single and t in self.eos else self.score(prefix + (t,)) - log_p for t in candidates]
        norm = None if single else _logsumexp(conditional)
        todo = []
        for t, lp in zip(candidates, conditional):
            q = log_q if single else log_q + lp - norm
            if t in self.eos:
                self._add(label, q)
            elif self._pruned(log_p + lp, q):
                self.unexplored += math.exp(q)
            else:
                todo.append((prefix + (t,), log_p + lp, q))
        return todo

    def _pruned(self, log_p: float, log_q: float) -> bool:
        return self.min_mass > 0 and max(log_p, log_q) < math.log(self.min_mass)

    def _add(self, label: str, log_q: float) -> None:
        self.sampler[label] = self.sampler.get(label, 0.0) + math.exp(log_q)


def stage_allowed_next(stage: ConstraintStage) -> AllowedNext:
    """allowed_next for :func:`choice_probabilities` from a --choice ConstraintStage: its allowed tokens, and the
    prefix's text as the label where the grammar accepts (a choice grammar accepts exactly its labels)."""

    def allowed_next(prefix: tuple[int, ...]):
        tokens, accepting = stage.next_tokens(prefix)
        label = stage.vocabulary.text(prefix).decode("utf-8") if accepting else None
        return tokens, label

    return allowed_next
