"""Many samples of one prompt (`sample -N`): N continuations and a summary of their spread.

Sample i uses its own generator seeded with ``seed + i`` and draws one [1, V] Exp(1) vector per step, exactly as
`sample --seed seed+i` does, so a batched row and the single run with that seed see the same draws (their tokens
agree wherever the batched forward gives the same logits; floating-point batching may differ in the last bits).
Rows run batched, one forward for all N per step, when the KV policy can hold several rows; else one after another.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from ..engine.run import Origin, synchronize
from ..engine.runtime import Runtime
from ..engine.stopping import StopChecker, StopRules, trim_stop
from ..engine.tokens import check_prompt
from ..errors import ConfigError
from ..kv import CacheSpec, require
from ..sampling.chain import Chain
from ..sampling.select import make_selector
from ..sampling.step import check_selected
from ..trace.stats import chosen_logprobs
from .sample import DecodeState, decode_tokens


@dataclass
class SampleRow:
    index: int
    seed: int
    token_ids: list[int]
    text: str
    length: int
    stop_reason: str
    sum_logprob: float  # sum of the processed log-probabilities of the tokens (what the selector drew from)
    mean_logprob: float


@dataclass
class FirstToken:
    token_id: int
    token: str
    count: int
    frequency: float


@dataclass
class SpreadSummary:
    num_samples: int
    distinct_outputs: int  # different token sequences among the N
    mean_sum_logprob: float  # over the samples, of each sample's summed processed log-probability
    std_sum_logprob: float  # their standard deviation (0 for one sample)
    mean_logprob: float  # the per-token mean processed log-probability, averaged over the samples
    std_mean_logprob: float
    first_tokens: list[FirstToken] = field(default_factory=list)  # how often each first token was drawn
    batched: bool = False
    tokens_per_s: float = float("nan")  # all generated tokens / wall time (prefill included)

    def to_dict(self) -> dict:
        return asdict(self)


def can_batch(spec: CacheSpec | None) -> bool:
    """Whether the KV policy can hold several rows (else the samples run one after another)."""
    try:
        require(spec or CacheSpec(), {"rows"}, "-N")
    except ConfigError:
        return False
    return True


def row_races(generators: list[torch.Generator], vocab: int, device) -> torch.Tensor:
    """[N, V] Exp(1) draws: row i from generator i, drawn as a [1, V] vector (Multinomial's shape)."""
    return torch.cat([torch.empty(1, vocab, dtype=torch.float32, device=device).exponential_(1.0, generator=g)
                      for g in generators])


def row_tokens(processed: torch.Tensor, selector: str, selectors: list, generators: list[torch.Generator]):
    """[N] tokens, row i drawn as the single run with seed + i draws it: greedy the arg-max of all rows at once;
    the exponential race argmax_i z_i - log E_i with row i's [1, V] draws (one batched arg-max); any other selector
    row by row with its own generator (transformers' torch.multinomial)."""
    if selector == "greedy":
        return processed.float().argmax(dim=-1)
    if selector == "multinomial":
        return (processed.float() - row_races(generators, processed.shape[-1], processed.device).log()).argmax(dim=-1)
    return torch.cat([s.from_logits(processed[r : r + 1]) for r, s in enumerate(selectors)])


def sample_batched(model, prompt_ids: list[int], chain: Chain, selector: str, seed: int, n: int, rules: StopRules,
                   detok: Callable[[list[int]], str] | None = None, cache: CacheSpec | None = None):
    """N rows in one batch: -> (token ids per row, processed log-probs per row, stop reasons). ``selector``: the
    plan's (:attr:`~..sampling.semantics.Plan.selector`)."""
    check_prompt(len(prompt_ids), rules.context_length)
    chain.reset(len(prompt_ids))  # stages that count (or read) the generated tokens start after the prompt
    runtime = Runtime.create(model, cache, capacity=len(prompt_ids) + rules.max_new_tokens, needs=frozenset({"rows"}))
    device = runtime.device
    total = len(prompt_ids) + rules.max_new_tokens
    ids = torch.zeros(n, total, dtype=torch.long, device=device)
    ids[:, : len(prompt_ids)] = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    selectors = [make_selector(selector, seed + i, device) for i in range(n)]
    generators = [s.generator for s in selectors if hasattr(s, "generator")]
    logits = runtime.prefill(ids[:1, : len(prompt_ids)])
    runtime.reorder(torch.zeros(n, dtype=torch.long, device=device))  # every row starts from the one prompt
    logits = logits.expand(n, -1)
    checkers = [StopChecker(rules, detok) for _ in range(n)]
    out = [[] for _ in range(n)]
    logps = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    length = len(prompt_ids)
    while True:
        processed = chain.apply(ids[:, :length], logits)
        tokens = row_tokens(processed, selector, selectors, generators)
        logp = chosen_logprobs(processed, tokens)
        host = torch.cat([tokens.float(), logp, torch.isfinite(logp).float()]).tolist()
        ids[:, length] = tokens
        length += 1
        for r in range(n):
            if reasons[r] is not None:
                continue
            check_selected(bool(host[2 * n + r]), chain)
            out[r].append(int(host[r]))
            logps[r].append(host[n + r])
            reasons[r] = checkers[r].check(out[r], length)
        if all(reason is not None for reason in reasons):
            return out, logps, reasons
        logits = runtime.feed(tokens.view(n, 1))


def sample_many(model, prompt_ids: list[int], chain: Chain, selector: str, seed: int, n: int, rules: StopRules,
                detok: Callable[[list[int]], str] | None = None, token_text: Callable[[int], str] | None = None,
                cache: CacheSpec | None = None, batched: bool | None = None,
                trim: bool = False) -> tuple[list[SampleRow], SpreadSummary]:
    """N samples and their spread; ``selector``: the plan's (greedy, multinomial, hf-multinomial); ``batched``
    None: batched when the cache policy holds rows; ``trim``: each row's text without what stopped it (the run's
    ``trim_stop``)."""

    batched = can_batch(cache) if batched is None else batched
    device = next(model.parameters()).device
    synchronize(device)
    start = time.perf_counter()
    if batched:
        out, logps, reasons = sample_batched(model, prompt_ids, chain, selector, seed, n, rules, detok, cache)
    else:
        out, logps, reasons = [], [], []
        for i in range(n):

            state = DecodeState()
            lp = []
            for d in decode_tokens(model, prompt_ids, chain, make_selector(selector, seed + i, device),
                                   rules, detok, state=state, cache=cache):
                lp.append(d.processed_logits)
            steps = min(len(lp), len(state.new_ids))  # each drawn token with the distribution it came from
            logp = chosen_logprobs(torch.stack([z.reshape(-1) for z in lp[:steps]]),
                                   torch.tensor(state.new_ids[:steps], device=device)).tolist() if steps else []
            out.append(list(state.new_ids))
            logps.append(logp)
            reasons.append(state.stop_reason)
    synchronize(device)
    elapsed = time.perf_counter() - start
    detok = detok or (lambda ids: " ".join(map(str, ids)))
    # each row delivers as a run does: with ``trim``, without what stopped it (length: the tokens generated)
    delivered = [trim_stop(ids, reasons[i], rules, detok) if trim else (ids, detok(ids)) for i, ids in enumerate(out)]
    rows = [SampleRow(i, seed + i, kept, text, len(out[i]), reasons[i], sum(logps[i]),
                      sum(logps[i]) / len(logps[i]) if logps[i] else float("nan"))
            for i, (kept, text) in enumerate(delivered)]
    return rows, spread(rows, token_text or (lambda t: str(t)), batched,
                        sum(r.length for r in rows) / elapsed if elapsed > 0 else float("nan"))


def spread(rows: list[SampleRow], token_text: Callable[[int], str], batched: bool = False,
           tokens_per_s: float = float("nan")) -> SpreadSummary:
    """Distinct outputs, mean and standard deviation of the log-probabilities, first-token frequencies."""
    sums = [r.sum_logprob for r in rows]
    means = [r.mean_logprob for r in rows if not math.isnan(r.mean_logprob)]
    firsts = Counter(r.token_ids[0] for r in rows if r.token_ids)
    n = len(rows)
    return SpreadSummary(
        num_samples=n,
        distinct_outputs=len({tuple(r.token_ids) for r in rows}),
        mean_sum_logprob=statistics.fmean(sums) if sums else float("nan"),
        std_sum_logprob=statistics.pstdev(sums) if len(sums) > 1 else 0.0,
        mean_logprob=statistics.fmean(means) if means else float("nan"),
        std_mean_logprob=statistics.pstdev(means) if len(means) > 1 else 0.0,
        first_tokens=[FirstToken(t, token_text(t), c, c / n) for t, c in firsts.most_common()],
        batched=batched,
        tokens_per_s=tokens_per_s,
    )


def many_document(origin: Origin, rows: list[SampleRow], summary: SpreadSummary, selector: str,
                  noise: list[dict] | None = None) -> dict:
    """`sample -N`'s JSON document: the head with the selector, every sample, the spread (and where greedy samples
    part, the noise verdicts)."""
    return origin.head(selector=selector, samples=rows, summary=summary, **({"noise": noise} if noise else {}))
