"""`probs --dist / --logits / --logits-file` with `--history`: the chain on a distribution typed in by hand, no model.

Token ids are 0..n-1 and a token's text is its id. A distribution P becomes the logits log P (P = 0: -inf, a
candidate already removed); given logits are used as they are. ``--history`` is the tokens before the next one; they
count as generated output (prompt length 0), so output-only penalties, DRY and minimum new tokens see them. Settings
that name tokens by text (logit bias, sequence bias, bans, the allow-list, DRY breakers) take ids here: ``3`` or a
sequence ``3 4``. The result has the same per-stage views as :func:`decodelab.core.decode.next_token_stages`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from .config import ChainSettings, read_input_text
from .decode import stage_views
from .errors import ConfigError
from .processors import build_chain
from .select import make_generator
from .semantics import Plan, plan, resolve_token_settings
from .trace import StageView, TrackedToken

def parse_numbers(text: str, option: str) -> list[float]:
    """'0.1,0.2 0.3' -> [0.1, 0.2, 0.3]: commas or whitespace between values; -inf allowed, nan is not."""
    items = [t for t in text.replace(",", " ").split() if t]
    if not items:
        raise ConfigError(f"{option}: no values; give numbers separated by commas, e.g. 0.1,0.2,0.7")
    out = []
    for item in items:
        try:
            value = float(item)
        except ValueError:
            raise ConfigError(f"{option} {item!r}: not a number") from None
        if math.isnan(value):
            raise ConfigError(f"{option} {item!r}: not a number")
        out.append(value)
    return out


def given_logits(dist: str | None = None, logits: str | None = None, logits_file: Path | None = None) -> Tensor:
    """Exactly one source -> raw logits [1, V] (float32)."""
    given = [name for name, v in (("--dist", dist), ("--logits", logits), ("--logits-file", logits_file))
             if v is not None]
    if len(given) != 1:
        raise ConfigError(f"{' and '.join(given) or '--dist'}: give exactly one of --dist, --logits, --logits-file")
    if dist is not None:
        probs = parse_numbers(dist, "--dist")
        bad = [p for p in probs if not (math.isfinite(p) and p >= 0)]
        if bad:
            raise ConfigError(f"--dist {bad[0]}: probabilities must be finite and >= 0")
        if sum(probs) <= 0:
            raise ConfigError("--dist: the probabilities sum to 0; give at least one positive value")
        return torch.tensor(probs, dtype=torch.float32).log().unsqueeze(0)  # log 0 = -inf
    if logits_file is not None:
        text = read_input_text("--logits-file", logits_file)
        values, option = parse_numbers(text, f"--logits-file {logits_file}"), f"--logits-file {logits_file}"
    else:
        values, option = parse_numbers(logits, "--logits"), "--logits"
    if any(v == math.inf for v in values):
        raise ConfigError(f"{option}: +inf is not a logit (use -inf to remove a candidate)")
    if all(v == -math.inf for v in values):
        raise ConfigError(f"{option}: every logit is -inf; give at least one finite value")
    return torch.tensor(values, dtype=torch.float32).unsqueeze(0)


@dataclass
class DistResult:
    plan: Plan
    chain: list[str]
    stages: list[StageView]
    tokens: list[TrackedToken]
    state: dict[str, float] = field(default_factory=dict)  # stateful stages at this step (mirostat.mu, xtc.coin)
    vocab: int = 0

    def probs(self, stage: int = -1) -> list[float]:
        """The probability of every token id after a stage (-1: the last), zero where removed (needs the views of
        every token: ``top`` >= the vocabulary, the default)."""
        out = [0.0] * self.vocab
        for t in self.stages[stage].top:
            out[t.token_id] = t.prob
        return out


def dist_stages(settings: ChainSettings, raw: Tensor, history: list[int] | None = None, seed: int = 0,
                top: int | None = None, stop_ids: tuple[int, ...] = ()) -> DistResult:
    """The chain (order and semantics from ``settings``) on given raw logits [1, V]; ``history`` the earlier ids."""
    vocab = raw.shape[-1]
    history = list(history or [])
    bad = [t for t in history if not 0 <= t < vocab]
    if bad:
        raise ConfigError(f"--history {bad[0]}: token id out of range [0, {vocab})")
    effective = plan(settings)
    bias, resolved = resolve_token_settings(effective.settings, vocab)
    generator = make_generator(seed, raw.device)
    context = effective.context(generator=generator, eos_ids=(), stop_ids=stop_ids)
    chain = build_chain(effective.settings.stage_values(bias, resolved), effective.order, context)
    ids = torch.tensor([history], dtype=torch.long, device=raw.device).reshape(1, len(history))
    chain.reset(0)  # the history counts as generated output
    views, tracked = stage_views(ids, raw, chain, str, vocab if top is None else top)
    state = {k: float(v.reshape(-1)[0]) for k, v in chain.states()}
    return DistResult(effective, chain.names, views, tracked, state, vocab)
