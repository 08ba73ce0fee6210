"""`compare --engine`: every variant run on a served engine and on the local model (read as vLLM reads it), side by
side, and compared token by token (greedy: they must agree) and distribution by distribution.

The distribution-level comparison is teacher-forced on the engine's own tokens: the engine scores prompt + its
output (prompt logprobs: raw, its top N per position), the local model gives the whole raw distribution Q at the
same positions. With P the engine's distribution, S its listed top N and tail mass t_P = 1 - sum_S p, t_Q =
1 - sum_S q (exact, Q is whole):

    KL(P || Q) = sum_S p_i log(p_i / q_i) + sum_{j not in S} p_j log(p_j / q_j)

The unlisted part is unknown, but bounded. Below, by the log-sum inequality (the tail as one bucket):
    sum_{j not in S} p_j log(p_j / q_j) >= t_P log(t_P / t_Q).
Above, every unlisted p_j <= c = min(min_S p, t_P) (the list is the top N) and they sum to t_P; the sum is convex
in p, so its largest value over that set is at a vertex: c on each of the k = floor(t_P / c) unlisted tokens with
the smallest q, the rest r = t_P - k c on the next one:
    sum_{j not in S} p_j log(p_j / q_j) <= sum_{i <= k} c log(c / q_(i)) + r log(r / q_(k+1)),
the tightest bound these facts allow (it stays loose when Q gives some unlisted tokens almost nothing: the engine
could have put its tail there).
So ``kl_lower`` <= KL(P || Q) <= ``kl_upper``, both exact when the tail is empty; this direction is the one with
two finite bounds (KL(Q || P) has no upper bound: an unlisted p_j may be 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
from torch import Tensor

from ..engine.run import drain
from ..engine.http.transport import EngineError
from ..engine.http.wire import PROCESSED
from ..errors import ConfigError
from ..methods.sample import REPORT_BLOCK, build_sampler
from ..engine.backend import Capabilities, refuse_lacking
from ..methods.served import Connection, engine_head, finish_to_stop, request_for, request_of
from ..sampling import replay
from ..sampling.chain import make_chain
from ..sampling.registry import scaling_stage
from ..sampling.semantics import plan as semantics_plan
from ..settings import as_dict
from .compare import (
    Prompt,
    Row,
    Variant,
    distinct_n,
    first_divergence,
    mean_or_none,
    repetition_rate,
    settings_for,
)


def truncated_kl(listed: list[tuple[int, float]], local: Tensor) -> tuple[float, float, float]:
    """(lower, upper, tail_P) of KL(P || Q) in nats: P known on its listed (id, log p) top N, Q = exp(local), a
    full log-distribution [V] (float64 advised). See the module doc for the bounds."""
    ids = [t for t, _ in listed]
    logp = torch.tensor([v for _, v in listed], dtype=torch.float64)
    logq = local.double()[ids]
    p = logp.exp()
    head = float(torch.where(p > 0, p * (logp - logq), 0.0).sum())  # 0 log 0 = 0 for a listed token at -inf
    tail_p = max(0.0, 1.0 - float(p.sum()))
    unlisted = torch.ones(local.shape[-1], dtype=torch.bool)
    unlisted[ids] = False
    if tail_p == 0.0 or not bool(unlisted.any()):  # nothing unlisted (what is left of 1 is rounding)
        return head, head, tail_p
    q_unlisted = local.double()[unlisted].exp()
    tail_q = float(q_unlisted.sum())
    lower = head + tail_p * (math.log(tail_p) - math.log(tail_q)) if tail_q > 0 else math.inf
    # every unlisted p is at most the least listed one; a listed p of 0 (a value of -inf, with a tail left) would
    # make that cap 0 and the tail nowhere to go: the least positive listed p caps instead (looser, still a bound)
    positive = p[p > 0]
    cap = min(float(positive.min()), tail_p) if positive.numel() else tail_p
    return lower, head + tail_bound(tail_p, cap, q_unlisted), tail_p


def tail_bound(tail: float, cap: float, q: Tensor) -> float:
    """max sum_j p_j log(p_j / q_j) over 0 <= p_j <= cap, sum_j p_j = tail: cap on the smallest q's, the rest on
    the next (the vertex of the set that maximises a convex sum)."""
    smallest = q.sort().values
    k = min(int(tail // cap), smallest.shape[0] - 1)  # all of them at cap can only happen through rounding
    full = smallest[:k]
    if bool((full <= 0).any()) or float(smallest[k]) <= 0:
        return math.inf
    rest = tail - k * cap
    total = float((cap * (math.log(cap) - full.log())).sum())
    return total + (rest * (math.log(rest) - math.log(float(smallest[k]))) if rest > 0 else 0.0)


@dataclass
class EnginePair:
    """One variant on one prompt and seed: the engine against the local model."""

    variant: str
    prompt: str
    seed: int
    greedy: bool  # greedy variants must give the same tokens
    same_tokens: bool
    first_divergence: int | None  # the first step where the two outputs part (None: identical)
    positions: int  # generated positions compared teacher-forced (the engine's tokens)
    top_n: int  # the engine's listed alternatives per position: KL is top-N truncated
    kl_lower_mean: float | None  # KL(engine || local), raw distributions, nats: bounds from the tail mass
    kl_upper_mean: float | None
    kl_upper_max: float | None
    tail_mass_mean: float | None  # the engine's unlisted probability per position
    top1_agreement: float | None  # the engine's most likely token is the local argmax
    max_abs_delta_raw_logprob: float | None  # the engine's tokens: its raw logprob (replay) against the local one
    mean_abs_delta_raw_logprob: float | None
    max_abs_delta_logprob: float | None  # processed (server in processed mode) against the local chain's
    engine_error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


# what every served engine lacks, for refusals made before one is contacted
REQUESTS_ONLY = Capabilities(score=True, generate=True, seeded=True, prompt_ranks=False, full_logits=False,
                             max_top_n=None)


def engine_rows_name(name: str, backend: str) -> str:
    return f"{name}@{backend}"


class EngineComparison:
    """Each (prompt, seed, variant) on the engine and locally (``--semantics vllm``); rows for both, one
    :class:`EnginePair` each. An engine failure ends that variant's pair with its reason; the rest go on."""

    def __init__(self, lm, conn: Connection | None, variants: list[Variant], prompts: list[Prompt],
                 seeds: list[int], base: dict | None = None, top_n: int | None = None,
                 on_row: Callable[[Row], None] | None = None):
        """``conn`` may be set later (``self.conn``): every variant's settings are checked here, before the
        server is contacted."""
        self.lm, self.conn, self.variants, self.prompts, self.seeds = lm, conn, variants, prompts, seeds
        self.base, self.on_row, self._top_n = base or {}, on_row, top_n
        self.rows: list[Row] = []
        self.pairs: list[EnginePair] = []
        self.settings = {}
        if own := next((p for p in prompts if p.settings), None):  # the server gets each variant's settings only
            raise ConfigError(f"--prompts-file: prompt {own.id} sets its own settings ({', '.join(own.settings)}); "
                              "compare --engine sends each variant's settings only: remove them from the line")
        for v in variants:
            if v.method != "sample":
                raise ConfigError(f"variant {v.name}: method={v.method}: compare --engine runs sample variants "
                                  "only (the engine's beam search and speculation are its own)")
            if any(k == "semantics" and str(val) != "vllm" for k, val in v.values):
                raise ConfigError(f"variant {v.name}: semantics: the local side is read as vLLM reads it")
            for s in seeds:
                settings = replace(settings_for(v, {**self.base, "top": 0}, s), semantics="vllm")
                if settings.cache not in (None, "full"):
                    refuse_lacking(REQUESTS_ONLY, {"kv_policies": f"variant {v.name}: cache={settings.cache}"},
                                   "a served engine")
                self.settings[v.name, s] = settings
                request_of(lm, settings, 1)  # a stage vLLM lacks is refused before anything runs

    @property
    def top_n(self) -> int:
        return self._top_n or self.conn.engine.capabilities.max_top_n or 20

    @property
    def total(self) -> int:
        return len(self.prompts) * len(self.seeds) * len(self.variants)

    def run(self) -> EngineComparison:
        for prompt in self.prompts:
            prompt_ids = self.lm.encode(prompt.text)
            for seed in self.seeds:
                for v in self.variants:
                    self.pairs.append(self.run_one(v, self.settings[v.name, seed], prompt, prompt_ids, seed))
        return self

    def document(self) -> dict:
        """``compare --engine``'s JSON document: the engine's head (the local model's device and dtype: the local
        side ran here), the command's options and seeds, the variants (first seed's settings) and prompts, every
        row (engine and local) and every engine pair."""
        lm, first = self.lm, self.prompts[0]
        config = {"seeds": self.seeds, **{k: v for k, v in self.base.items() if v is not None}}
        doc = engine_head("compare", self.conn, config, [], first.text, lm.encode(first.text))
        doc.update(device=str(lm.device), dtype=str(lm.dtype).replace("torch.", ""),
                   variants=[{"name": v.name, "method": v.method, "spec": v.describe(),
                              "settings": as_dict(self.settings[v.name, self.seeds[0]])} for v in self.variants],
                   prompts=[{"id": p.id, "text": p.text} for p in self.prompts], rows=self.rows,
                   engine_pairs=self.pairs)
        return doc

    def _emit(self, row: Row) -> None:
        self.rows.append(row)
        if self.on_row is not None:
            self.on_row(row)

    def run_one(self, v: Variant, settings, prompt: Prompt, prompt_ids: list[int], seed: int) -> EnginePair:
        local = self.local_row(v, settings, prompt, prompt_ids, seed)
        greedy = semantics_plan(settings).greedy
        request, _ = request_for(self.conn, settings, 1)
        try:
            g = self.conn.engine.generate(prompt_ids, request)
        except EngineError as exc:
            return self._failed(v, prompt, seed, greedy, exc)
        ids = list(g.token_ids)
        try:
            replay = self.conn.engine.score(prompt_ids + ids, self.top_n) if ids else None
        except EngineError as exc:
            replay, failure = None, exc
        else:
            failure = None
        positions = replay.positions[len(prompt_ids):] if replay is not None else []
        raw = [p.logprob for p in positions]
        processed = [p.logprob for p in g.steps] if g.labels.values == PROCESSED else []
        self._emit(Row(engine_rows_name(v.name, "engine"), v.method, prompt.id, seed, self.lm.decode(ids), ids,
                       len(ids), finish_to_stop(g.finish_reason, ids, self.lm.eos_ids), mean_or_none(processed),
                       math.exp(-mean_or_none(raw)) if raw else None, distinct_n(ids, 1), distinct_n(ids, 2),
                       repetition_rate(ids), None, None, len(ids) / g.seconds if g.seconds > 0 else math.nan))
        pair = self.distributions(v, settings, prompt, seed, prompt_ids, ids, positions, processed)
        pair.same_tokens, pair.first_divergence = ids == local.token_ids, first_divergence(ids, local.token_ids)
        pair.engine_error = str(failure) if failure is not None else None
        return pair

    def local_row(self, v: Variant, settings, prompt: Prompt, prompt_ids: list[int], seed: int) -> Row:
        sampler = build_sampler(self.lm, settings, prompt_ids, block=REPORT_BLOCK)
        drain(sampler)
        steps = sampler.steps  # every traced step, the block pending at an early end included
        ids = sampler.new_ids
        row = Row(engine_rows_name(v.name, "local"), v.method, prompt.id, seed, sampler.delivered(self.lm.decode)[1],
                  ids, len(ids), sampler.stop_reason, mean_or_none([s.logprob for s in steps]),
                  math.exp(-mean_or_none([s.raw_logprob for s in steps])) if steps else None,
                  distinct_n(ids, 1), distinct_n(ids, 2), repetition_rate(ids),
                  mean_or_none([s.kept for s in steps]), mean_or_none([s.entropy for s in steps]),
                  sampler.summary().tokens_per_s, [s.decided_by for s in steps])
        self._emit(row)
        return row

    @torch.inference_mode()
    def distributions(self, v: Variant, settings, prompt: Prompt, seed: int, prompt_ids: list[int],
                      ids: list[int], positions, processed: list[float]) -> EnginePair:
        """Teacher-forced on the engine's tokens: truncated KL, top-1 agreement, raw and processed deltas."""
        pair = EnginePair(v.name, prompt.id, seed, semantics_plan(settings).greedy, False, None, len(positions),
                          self.top_n, None, None, None, None, None, None, None, None)
        if not positions:
            return pair
        logits = replay.forced_logits(self.lm.model, prompt_ids, ids)
        local = torch.log_softmax(logits.double(), dim=-1)
        bounds = [truncated_kl([(a.token_id, a.logprob) for a in p.top], local[i]) for i, p in enumerate(positions)]
        pair.kl_lower_mean = sum(b[0] for b in bounds) / len(bounds)
        pair.kl_upper_mean = sum(b[1] for b in bounds) / len(bounds)
        pair.kl_upper_max = max(b[1] for b in bounds)
        pair.tail_mass_mean = sum(b[2] for b in bounds) / len(bounds)
        argmax = local.argmax(dim=-1).tolist()
        pair.top1_agreement = sum(p.top[0].token_id == argmax[i] for i, p in enumerate(positions)) / len(positions)
        deltas = [abs(p.logprob - float(local[i, p.token_id])) for i, p in enumerate(positions)]
        pair.max_abs_delta_raw_logprob, pair.mean_abs_delta_raw_logprob = max(deltas), sum(deltas) / len(deltas)
        if processed:
            chain = make_chain(self.lm, settings)
            rows = replay.along(chain, prompt_ids, ids, logits, record=True)
            greedy = semantics_plan(settings).greedy
            local_processed = []
            for i, stages in enumerate(rows):  # vLLM's processed values of a greedy row stop before temperature 0
                z = [s for name, s in stages if not (greedy and name == scaling_stage())][-1]
                local_processed.append(float(torch.log_softmax(z.double(), dim=-1)[ids[i]]))
            pair.max_abs_delta_logprob = max(abs(a - b) for a, b in zip(processed, local_processed)
                                             if math.isfinite(a) and math.isfinite(b))
        return pair

    def _failed(self, v, prompt, seed, greedy, exc) -> EnginePair:
        return EnginePair(v.name, prompt.id, seed, greedy, False, None, 0, self.top_n, None, None, None, None, None,
                          None, None, None, str(exc))
