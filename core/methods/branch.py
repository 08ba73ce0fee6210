"""Branching: force a token at a step ("what if it had picked this"), and resume a saved trace.

Both keep the random draws of every other step unchanged. The sampling selector draws exactly one Exp(1) vector
of the vocabulary's size per step from its explicit generator (:class:`~decodelab.core.sampling.select.Multinomial`), so
the draws of step t are the t-th such vector whatever happened before: a forced step still consumes its own vector
(and ignores it), and a resumed run first skips one vector per already generated token.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..errors import ConfigError
from ..inputs import parse_int, parse_json, read_input_text
from ..sampling.select import Greedy, Multinomial
from ..settings import coerce
from ..trace.why import FORCED


def digits(text: str) -> bool:
    """ASCII digits alone (a step, a token id): ' 42' is, '²', '-1' and ' the' are not."""
    return text.strip().isascii() and text.strip().isdigit()


def parse_force(items: list[str] | tuple[str, ...], token_id=None) -> dict[int, int]:
    """STEP=TOKEN strings -> {step: token id}; TOKEN is an id, or a text that ``token_id`` maps to one token."""
    out: dict[int, int] = {}
    for item in items:
        step, sep, token = str(item).partition("=")
        if not sep or not digits(step) or not token:
            raise ConfigError(f"--force {item!r}: expected STEP=TOKEN with STEP an integer >= 0, e.g. 3=42 or "
                              f"'3= the'")
        step = parse_int(step, f"--force {item!r}: STEP", 0, 2**31)
        if digits(token):
            tid = parse_int(token, f"--force {item!r}: TOKEN", 0, 2**31)
        elif token_id is not None:
            try:
                tid = token_id(token)
            except ConfigError as exc:
                raise ConfigError(f"--force {item!r}: {exc}") from None
        else:
            raise ConfigError(f"--force {item!r}: TOKEN must be a token id here")
        if step in out:
            raise ConfigError(f"--force {item!r}: step {step} is forced twice")
        out[step] = tid
    return out


class Forced:
    """Wraps a selector: at the forced steps the token is replaced after the selector has drawn (so its generator
    advances exactly as without forcing); every other step is the selector's own. ``offset``: the index of the
    first step this selector sees (a resumed run)."""

    def __init__(self, selector: Greedy | Multinomial, force: dict[int, int], offset: int = 0):
        self.inner, self.force, self.step = selector, dict(force), offset
        self.name = selector.name  # forced steps say so in their decided_by

    @property
    def last_race(self) -> Tensor | None:
        return getattr(self.inner, "last_race", None)

    def from_logits(self, logits: Tensor) -> Tensor:
        token = self.inner.from_logits(logits)
        step, self.step = self.step, self.step + 1
        if step not in self.force:
            return token
        forced = self.force[step]
        if not 0 <= forced < logits.shape[-1]:
            raise ConfigError(f"--force {step}={forced}: token id out of range [0, {logits.shape[-1]})")
        if not bool(torch.isfinite(logits[0, forced])):  # one host read, at a forced step only
            raise ConfigError(f"--force {step}={forced}: the chain removed that token at step {step} "
                              "(probability 0); force a token the chain keeps")
        return torch.full_like(token, forced)

    __call__ = from_logits


def mark_forced(steps, force: dict[int, int]) -> None:
    """Label the forced steps of a trace (their decided_by is the user, not a stage)."""
    for s in steps:
        if s.index in force:
            s.decided_by, s.why = FORCED, f"forced by --force {s.index}={s.token_id}"


def skip_draws(selector, steps: int, vocab: int, device) -> None:
    """Advance a sampling selector's generator past ``steps`` steps (one [1, V] float32 Exp(1) vector each, as
    Multinomial draws them); greedy has nothing to skip."""
    gen = getattr(selector, "generator", None) or getattr(getattr(selector, "inner", None), "generator", None)
    if gen is None:
        return
    scratch = torch.empty(1, vocab, dtype=torch.float32, device=device)
    for _ in range(steps):
        scratch.exponential_(1.0, generator=gen)


@dataclass
class ResumePoint:
    """A saved `sample -f json` trace: where to continue from."""

    prompt_ids: list[int]
    generated_ids: list[int]
    prompt_text: str
    config: dict  # the run's resolved settings (its seed and chain), to continue with the same ones
    model: str | None
    stop_reason: str | None

    @property
    def context_ids(self) -> list[int]:
        return self.prompt_ids + self.generated_ids


def load_trace(path: str | Path) -> ResumePoint:
    """Read a `decodelab sample -f json` document (``prompt.token_ids``, ``token_ids``, ``config``)."""
    path = Path(path)
    text = read_input_text("--resume", path)
    try:
        doc = parse_json(f"--resume {path}", text)
    except ConfigError as exc:
        raise ConfigError(f"{exc}; save a trace with `decodelab sample ... -f json > trace.json`") from None
    usage = f"--resume {path}: expected a `sample -f json` trace with prompt.token_ids and token_ids"
    try:
        prompt_ids = [parse_int(t, f"--resume {path}: prompt.token_ids", 0) for t in doc["prompt"]["token_ids"]]
        generated = [parse_int(t, f"--resume {path}: token_ids", 0) for t in doc["token_ids"]]
        summary = doc.get("summary") or {}
        config = dict(doc.get("config") or {})
        prompt_text = str(doc["prompt"].get("text", ""))
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ConfigError(usage) from None
    if not isinstance(summary, dict):
        raise ConfigError(usage)
    return ResumePoint(prompt_ids, generated, prompt_text, config, doc.get("model"), summary.get("stop_reason"))


class Branched:
    """A traced sampling run with forced steps and/or resumed from a saved trace: the selector skips the draws of
    the ``resumed`` tokens already generated, forced steps replace the pick after the draw, and the steps are
    numbered from ``resumed`` on (step indices count from the original run's first token). Everything else (steps,
    new_ids, summary, interrupt) is the wrapped run's."""

    def __init__(self, sampler, force: dict[int, int] | None = None, resumed: list[int] | None = None,
                 vocab: int | None = None):
        self.run, self.force, self.resumed = sampler, dict(force or {}), list(resumed or [])
        sampler.resumed = self.resumed  # delivered before the new tokens (the run's text and document)
        offset = len(self.resumed)
        device = next(sampler.model.parameters()).device
        skip_draws(sampler.selector, offset, vocab or sampler.model.get_output_embeddings().weight.shape[0], device)
        if self.force:
            early = [s for s in self.force if s < offset]
            if early:
                raise ConfigError(f"--force {early[0]}=...: step {early[0]} is part of the resumed trace "
                                  f"(steps 0-{offset - 1}); force a step >= {offset}")
            sampler.selector = Forced(sampler.selector, self.force, offset)

    def __iter__(self):
        offset = len(self.resumed)
        for step in self.run:
            step.index += offset
            if step.index in self.force:
                mark_forced([step], self.force)
            yield step

    def __getattr__(self, name):
        return getattr(self.run, name)

    @property
    def all_ids(self) -> list[int]:
        """The resumed tokens and the new ones: what a saved trace of this run continues from."""
        return self.resumed + list(self.run.new_ids)


def resume_values(point: ResumePoint, cls) -> dict:
    """The saved run's settings as typed values of ``cls`` (unknown keys ignored). JSON has no infinity, so a ban
    (a -inf logit bias) was saved as null and is read back as -inf."""
    from dataclasses import fields


    names = {f.name for f in fields(cls)}
    out = {}
    for key, raw in point.config.items():
        if key not in names or raw is None:
            continue
        if key == "logit_bias" and isinstance(raw, dict):
            raw = {t: (float("-inf") if b is None else b) for t, b in raw.items()}
        out[key] = coerce(cls, key, raw)
    return out
