"""`probs`: the next-token distribution after each stage of the chain, for a prompt on a model
(:func:`next_token_stages`) or, with ``--dist / --logits / --logits-file`` and ``--history``, on a distribution typed in
by hand with no model (:func:`dist_stages`).

Without a model token ids are 0..n-1 and a token's text is its id. A distribution P becomes the logits log P (P = 0:
-inf, a candidate already removed); given logits are used as they are. ``--history`` is the tokens before the next
one; they count as generated output (prompt length 0), so output-only penalties, DRY and minimum new tokens see
them. Settings that name tokens by text take ids there: ``3`` or a sequence ``3 4``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ..engine.models import LoadedModel
from ..engine.run import Origin, Run
from ..engine.runtime import Runtime
from ..engine.tokens import check_prompt
from ..errors import ConfigError
from ..inputs import parse_numbers, read_input_text
from ..kv import CacheSpec
from ..sampling.chain import chain_for, Chain, make_chain
from ..sampling.select import make_generator
from ..sampling.semantics import Plan
from ..sampling.semantics import plan as semantics_plan
from ..sampling.settings import ChainSettings
from ..sampling.tokens import Tokens
from ..trace.records import StageStat, StageView, TokenProb, TrackedToken
from ..trace.stats import stage_numbers
from ..settings import as_dict
from .sample import SampleSettings


@dataclass(frozen=True)
class ProbsSettings(SampleSettings):
    top: int = 10  # tokens listed per stage (a preset's `top` still wins over this default)


def next_token_stages(
    model, prompt_ids: list[int], chain: Chain, token_text: Callable[[int], str], top: int = 10,
    context_length: int | None = None, cache: CacheSpec | None = None,
) -> tuple[list[StageView], list[TrackedToken]]:
    """The next-token distribution after every stage (no generation): per stage its own top tokens, plus the
    union of those tokens followed through all stages (probability and rank after each)."""
    check_prompt(len(prompt_ids), context_length)
    runtime = Runtime.create(model, cache, capacity=len(prompt_ids))
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=runtime.device)
    raw = runtime.prefill(ids)
    chain.reset(len(prompt_ids))
    return stage_views(ids, raw, chain, token_text, top)


def stage_views(ids: Tensor, raw: Tensor, chain: Chain, token_text: Callable[[int], str],
                top: int = 10) -> tuple[list[StageView], list[TrackedToken]]:
    """The views of :func:`next_token_stages` for given raw logits [1, V] after the ids [1, T] (any source: a model,
    or a distribution typed in by hand, see :func:`decodelab.core.methods.probs.dist_stages`)."""
    _, stages = chain.run_recorded(ids, raw)
    logits = torch.stack([z[0] for _, z in stages])  # [S, V]
    probs, _, stats = stage_numbers(logits)  # [S, V] and per stage (kept, entropy, mass removed), as every trace
    S, k = probs.shape[0], min(top, probs.shape[-1])
    top_ids = probs.topk(k, dim=-1).indices  # [S, k]: each stage's own top tokens
    cols = top_ids.flatten()  # [S * k]: every such token, followed through all stages
    followed = probs[:, cols]  # [S, S * k]
    ranks = (probs[:, None, :] > followed[:, :, None]).sum(dim=-1) + 1
    # one transfer: the tokens, their logit at each stage's top, their raw logit, probabilities and ranks everywhere,
    # and each stage's statistics
    host = torch.cat([cols.float(), logits.gather(1, top_ids).flatten(), raw[0, cols], followed.flatten(),
                      ranks.float().flatten(), stats.flatten()]).tolist()
    n = S * k
    table = [StageStat(name, int(kept), h, m) for (name, _), (kept, h, m)
             in zip(stages, (host[3 * n + 2 * S * n + 3 * s : 3 * n + 2 * S * n + 3 * s + 3] for s in range(S)))]
    ids = [int(t) for t in host[:n]]
    stage_logits, raw_logits = host[n : 2 * n], host[2 * n : 3 * n]
    p_at = lambda s, c: host[3 * n + s * n + c]  # noqa: E731  probability of column c after stage s
    rank_at = lambda s, c: int(host[3 * n + S * n + s * n + c])  # noqa: E731
    views, first_col = [], {}
    for s, ((name, _), stat) in enumerate(zip(stages, table)):
        entries = []
        for c in range(s * k, (s + 1) * k):
            if p_at(s, c) > 0:
                entries.append(TokenProb(ids[c], token_text(ids[c]), stage_logits[c], p_at(s, c)))
                first_col.setdefault(ids[c], c)
        views.append(StageView(name, stat.kept, stat.entropy, stat.mass_removed, entries))
    tracked = []
    for t, c in first_col.items():
        row = TrackedToken(t, token_text(t), raw_logits[c], p_at(0, c))
        for s, (name, _) in enumerate(stages):
            row.probs[name] = p_at(s, c)
            row.ranks[name] = rank_at(s, c) if p_at(s, c) > 0 else None
        tracked.append(row)
    tracked.sort(key=lambda r: (-r.probs[stages[-1][0]], -r.raw_prob))
    return views, tracked


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
    generator = make_generator(seed, raw.device)
    effective, chain = chain_for(settings, Tokens(vocab), generator, eos_ids=(), stop_ids=stop_ids)
    ids = torch.tensor([history], dtype=torch.long, device=raw.device).reshape(1, len(history))
    chain.reset(0)  # the history counts as generated output
    views, tracked = stage_views(ids, raw, chain, str, vocab if top is None else top)
    state = {k: float(v.reshape(-1)[0]) for k, v in chain.states()}
    return DistResult(effective, chain.names, views, tracked, state, vocab)


def build_probs(lm: LoadedModel, settings: SampleSettings, prompt_ids: list[int], chain: Chain | None = None):
    chain = chain or make_chain(lm, settings)
    return next_token_stages(lm.model, prompt_ids, chain, lm.token_text, settings.top, lm.context_length,
                             cache=settings.cache_spec)


class ProbsRun(Run):
    """``probs``' run: one forward, then the next-token distribution after every stage; nothing is generated.
    Iterating it yields one step, the list of stage views (``stages``), and follows the listed tokens through every
    stage (``tokens``); ``summary()`` is the stage views (kept, entropy and mass removed per stage)."""

    stop_reason = "end"

    def __init__(self, lm: LoadedModel, settings: SampleSettings, prompt_ids: list[int], chain: Chain):
        self.lm, self.settings, self.prompt_ids, self.chain = lm, settings, list(prompt_ids), chain
        self.stages: list[StageView] = []
        self.tokens: list[TrackedToken] = []

    def __iter__(self):
        self.stages, self.tokens = next_token_stages(self.lm.model, self.prompt_ids, self.chain, self.lm.token_text,
                                                     self.settings.top, self.lm.context_length,
                                                     cache=self.settings.cache_spec)
        yield self.stages

    @property
    def new_ids(self) -> list[int]:
        return []

    def summary(self) -> list[StageView]:
        return self.stages

    def document(self) -> dict:
        """``probs``' JSON document: the head, each stage's view, the tokens followed through every stage (and the
        semantics when one was named)."""
        extra = {"semantics": semantics_plan(self.settings).describe()} if self.settings.semantics is not None else {}
        return self.origin.head(stages=self.stages, tokens=self.tokens, **extra)


def probs_run(lm: LoadedModel, settings: SampleSettings, prompt_text: str, prompt_ids: list[int],
              chain: Chain | None = None) -> ProbsRun:
    """``probs``' run with its document head (the registry's build)."""
    run = ProbsRun(lm, settings, prompt_ids, chain or make_chain(lm, settings))
    run.origin = Origin.of("probs", lm, as_dict(settings), run.chain.names, prompt_text, prompt_ids)
    return run


def given_document(settings: SampleSettings, raw: Tensor, history: list[int], result: DistResult, top: int) -> dict:
    """``probs --dist/--logits``' JSON document: no model; the given logits and history, each stage's view, the
    tokens followed, the stateful stages' numbers; every token's final probability when ``top`` lists them all."""
    doc = {"command": "probs", "model": None, "device": str(raw.device), "dtype": "float32",
           "config": as_dict(settings), "chain": result.chain, "given": {"logits": raw[0].tolist(), "history": history},
           "stages": result.stages, "tokens": result.tokens, "state": result.state}
    if top >= raw.shape[-1]:
        doc["probs"] = result.probs()  # every token's probability after the last stage, by id
    if settings.semantics is not None:
        doc["semantics"] = result.plan.describe()
    return doc
