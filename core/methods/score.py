"""Teacher-forced scoring: a given text, no generation.

The text's tokens t_0 .. t_{T-1} are fed through the runtime in blocks of ``feed`` tokens (the first ``prefill``
tokens in one forward when given); token t_i (i >= 1) is scored from the logits after t_0 .. t_{i-1}. The default
feed (:func:`score_feed`) is the whole text in one forward when every cache policy is feed-invariant (full, static,
recompute: the same logits at any split), and one token a forward otherwise: a bounded, quantized or compressing
policy acts between forwards, so a token is scored from what the policy kept of the tokens before it, as in
decoding. A press that compresses once, after the prompt (``compress=prefill``), needs ``--prefill N`` or
``--feed N``: the first N tokens are its prompt.

    raw_logprob_i = log softmax(z_i)[t_i]                the model's own log-probability
    logprob_i     = log softmax(chain(t_<i, z_i))[t_i]   what these decoding settings would have given it
                                                         (-inf where a filter removed it)
    perplexity    = exp(-mean_i raw_logprob_i)

With a reference (another model, or the same model under another cache policy), fed the same blocks in lockstep:

    kl_i    = KL(ref || cand) = sum_v p_ref(v) (log p_ref(v) - log p_cand(v))   (raw distributions, nats)
    agree_i = argmax p_ref == argmax p_cand

Every number of a block is computed on the device and read in one transfer.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

from ..engine.run import Origin, Run, Stopwatch
from ..engine.runtime import Runtime
from ..errors import ConfigError
from ..kv import CacheSpec, compresses_once, feed_invariant, parse_cache_spec
from ..kv.kept import document_part, kept_after
from ..sampling import replay
from ..sampling.chain import Chain, make_chain, validate_chain
from ..sampling.semantics import plan
from ..sampling.settings import ChainSettings
from ..settings import _check, as_dict
from ..trace import reasoning
from ..trace.stats import COLUMN, kept_ids, scored_rows
from .choice import check_choice_settings


@dataclass(frozen=True)
class ScoreSettings(ChainSettings):
    limit: int | None = None  # score only the first N tokens of the text
    chunk: int | None = None  # perplexity per chunk of N scored tokens
    feed: int | None = None  # tokens per forward (default: score_feed)
    prefill: int | None = None  # the first forward's tokens (the prompt a press compresses); then `feed` a forward
    against: str | None = None  # a reference model (same tokenizer)
    against_cache: str | None = None  # a reference cache policy (the same model unless --against)
    top: int = 10  # tokens listed in `most_different`
    renormalize: bool = False  # also each token's raw log-probability renormalized over the chain's kept set
    kept_ids: bool = False  # also, per position, the ids that survive each stage of the chain
    min_mass: float = 1e-6  # --choice: token paths whose model and sampler mass are both below it are not walked


def validate_score(s: ScoreSettings) -> None:
    validate_chain(s)
    replay.refuse_stateful_settings(plan(s).order, "score")
    for key in ("limit", "chunk", "feed", "prefill"):
        value = getattr(s, key)
        if value is not None:
            _check(value >= 1, key, value, "must be an integer >= 1")
    _check(s.top >= 0, "top", s.top, "must be >= 0")
    for option, spec in policies(s).items():
        if compresses_once(spec) and s.feed is None and s.prefill is None:
            raise ConfigError(f"{option} {spec}: it compresses once, after the prompt, and a scored text has no "
                              "prompt; give --feed N or --prefill N (the first N tokens are the prompt it "
                              "compresses, the rest are scored as decoded) or compress=decode where the press has it")
    if s.choice is not None:
        check_choice_settings(s)


def policies(s: ScoreSettings) -> dict[str, CacheSpec]:
    """The cache policies a score run uses, by option: --cache, and --against-cache when given (or implied by
    --against: the reference model under the full cache)."""
    out = {"--cache": s.cache_spec}
    if s.against_cache is not None or s.against is not None:
        out["--against-cache"] = parse_cache_spec("full" if s.against_cache is None else s.against_cache,
                                                  "--against-cache")
    return out


def score_feed(feed: int | None, specs: list[CacheSpec | None], tokens: int) -> int:
    """Tokens per forward for a text of ``tokens`` tokens under the cache ``specs`` (None: full): ``feed`` if given;
    else the text minus its last token in one forward when every policy is feed-invariant; else 1, so that each
    token is scored from what the policy kept of the tokens before it, as the decoding step that produced it."""
    if feed is not None:
        return feed
    if all(spec is None or feed_invariant(spec) for spec in specs):
        return max(tokens - 1, 1)
    return 1


@dataclass
class ScoredToken:
    position: int  # absolute position in the text (the first token, never scored, is position 0)
    token_id: int
    token: str
    raw_logprob: float
    raw_rank: int  # 1 = the model's own most likely token
    raw_entropy: float
    logprob: float  # under the chain's processed distribution; -inf (JSON null) where a filter removed it
    reference_logprob: float | None = None
    kl: float | None = None  # KL(reference || candidate), nats
    agree: bool | None = None  # same argmax as the reference
    kept_mass: float | None = None  # sum of the raw probabilities of the tokens the chain keeps (--renormalize)
    kept_logprob: float | None = None  # raw_logprob - log kept_mass: renormalized over the kept set (-inf: removed)
    kept_sets: list[dict] | None = None  # per stage {name, kept, ids} (--kept-ids; ids None: every token)

    def logprob_difference(self) -> float:
        """raw_logprob - reference_logprob: how much more (> 0) or less likely the candidate found this token."""
        return self.raw_logprob - self.reference_logprob

    def to_dict(self) -> dict:
        out = asdict(self)
        if self.kl is None:
            for key in ("reference_logprob", "kl", "agree"):
                out.pop(key)
        if self.kept_mass is None:
            for key in ("kept_mass", "kept_logprob"):
                out.pop(key)
        if self.kept_sets is None:
            out.pop("kept_sets")
        return out


@dataclass
class ChunkPerplexity:
    start: int  # first scored position of the chunk
    end: int  # one past its last
    perplexity: float


@dataclass
class ScoreSummary:
    tokens: int  # scored tokens (the text's tokens minus the first)
    perplexity: float
    mean_nll: float
    processed_mean_logprob: float  # -inf when the chain removed some token of the text
    chunks: list[ChunkPerplexity] = field(default_factory=list)
    feed: int = 0  # tokens per forward (score_feed: 1 under a policy that acts between forwards)
    tokens_per_s: float = float("nan")
    stop_reason: str = "end"  # end | interrupted
    reference: str | None = None
    reference_perplexity: float | None = None
    kl_mean: float | None = None
    top1_agreement: float | None = None
    most_different: list[dict] = field(default_factory=list)  # largest |logprob - reference_logprob|
    # --renormalize, over tokens the chain keeps: the importance ratio p_raw / p_processed a trainer sees when the
    # text was sampled under the chain, before and after renormalizing p_raw over the kept set
    importance_ratio_mean: float | None = None
    importance_ratio_kept_mean: float | None = None


def blocks(tokens: int, feed: int, prefill: int | None = None) -> list[tuple[int, int]]:
    """[start, end) of each forward over positions 0 .. tokens - 2 (the last token is never fed): the first
    ``prefill`` tokens in one forward (the prompt a press that compresses once compresses), then ``feed`` a forward."""
    first = min(prefill or feed, tokens - 1)
    out = [(0, first)] if first > 0 else []
    out += [(a, min(a + feed, tokens - 1)) for a in range(first, tokens - 1, feed)]
    return out


def check_scorable(token_ids: list[int], where: str = "TEXT") -> None:
    """Scoring needs the first token as context and at least one token after it to score."""
    if len(token_ids) < 2:
        raise ConfigError(f"{where}: {len(token_ids)} token(s); scoring needs at least 2 (the first is context)")


class TextScore(Run):
    """A teacher-forced run over ``self.ids``: every token after the first is scored, none is generated."""

    ids: list[int]

    @property
    def total(self) -> int:
        return len(self.ids) - 1

    @property
    def new_ids(self) -> list[int]:
        return []


class Scorer(TextScore):
    """Iterate for one :class:`ScoredToken` per scored position; ``summary()`` afterwards."""

    lm = None  # the model it scored with (set by score_run): its thinking markers for the split

    def __init__(self, model, token_ids: list[int], chain: Chain, token_text, settings: ScoreSettings,
                 cache: CacheSpec | None = None, reference=None, reference_cache: CacheSpec | None = None,
                 reference_name: str | None = None):
        check_scorable(token_ids)
        self.model, self.ids, self.chain, self.token_text, self.s = model, list(token_ids), chain, token_text, settings
        self.spec = cache
        self.reference, self.reference_cache, self.reference_name = reference, reference_cache, reference_name
        self.steps: list[ScoredToken] = []
        self.stop_reason = "end"
        self.watch: Stopwatch | None = None
        self.feed = score_feed(settings.feed, [cache, reference_cache], len(self.ids))

    def __iter__(self) -> Iterator[ScoredToken]:
        device = next(self.model.parameters()).device
        runtime = self.runtime = Runtime.create(self.model, self.spec, capacity=len(self.ids))
        ref = None
        if self.reference is not None:
            ref = Runtime.create(self.reference, self.reference_cache, capacity=len(self.ids))
        ids = torch.tensor([self.ids], dtype=torch.long, device=device)
        T = len(self.ids)
        feed = self.feed
        replay.start(self.chain, 1)  # the first token is context; stages that count generated tokens count from the second
        self.watch = Stopwatch(device)
        self.watch.start()
        # logits after positions [start, end) score tokens start+1 .. end; the last token is never fed
        for start, end in blocks(T, feed, self.s.prefill):
            logits = runtime.feed(ids[:, start:end], keep="all")[0]
            ref_logits = ref.feed(ids[:, start:end].to(ref.device), keep="all")[0].to(device) if ref else None
            rows = self._block(ids, logits, ref_logits, start, end)
            self.watch.lap("loop")
            self.watch.pause()
            for row in rows:
                self.steps.append(row)
                yield row
            self.watch.resume()

    def _block(self, ids: Tensor, logits: Tensor, ref_logits: Tensor | None, start: int, end: int):
        targets = ids[0, start + 1 : end + 1]
        processed = replay.processed(self.chain, ids, logits, start + 1) if self.chain.processors else logits
        head = scored_rows(logits, processed, targets).T  # [HEAD, n]: the per-step statistics of every method
        chosen, proc = head[COLUMN["raw_logprob"]], head[COLUMN["logprob"]]
        cols = [head[COLUMN["token_id"]], chosen, head[COLUMN["raw_rank"]], head[COLUMN["raw_entropy"]], proc]
        if self.s.renormalize or ref_logits is not None:
            raw = torch.log_softmax(logits.float(), dim=-1)
        if self.s.renormalize:  # log sum_{k kept} p_raw(k); kept_logprob = raw_logprob - that (the token removed: -inf)
            log_mass = torch.logsumexp(raw.masked_fill(~torch.isfinite(processed), float("-inf")), dim=-1)
            cols += [log_mass.exp(), torch.where(torch.isfinite(proc), chosen - log_mass, float("-inf"))]
        if ref_logits is not None:
            ref_raw = torch.log_softmax(ref_logits.float(), dim=-1)
            p_ref = ref_raw.exp()
            kl = (p_ref * (ref_raw - raw)).nan_to_num(0.0).sum(dim=-1)  # 0 log 0 = 0 where p_ref underflows
            agree = (ref_raw.argmax(dim=-1) == raw.argmax(dim=-1)).float()
            cols += [ref_raw.gather(-1, targets[:, None])[:, 0], kl, agree]
        host = torch.stack(cols).tolist()  # the block's one transfer
        out = []
        for i in range(end - start):
            t = int(host[0][i])
            row = ScoredToken(start + 1 + i, t, self.token_text(t), host[1][i], int(host[2][i]), host[3][i],
                              host[4][i])
            if self.s.renormalize:
                row.kept_mass, row.kept_logprob = host[5][i], host[6][i]
            if ref_logits is not None:
                k = 7 if self.s.renormalize else 5
                row.reference_logprob, row.kl, row.agree = host[k][i], host[k + 1][i], bool(host[k + 2][i])
            out.append(row)
        if self.s.kept_ids:
            for row, stages in zip(out, replay.recorded(self.chain, ids, logits, start + 1)):
                row.kept_sets = kept_ids(stages)
        return out

    def document(self) -> dict:
        """``score``'s JSON document: a step per scored token, no generated text, the summary, the kept map of a
        score-based cache, the reasoning / answer split when the settings or the model name thinking markers."""
        kept = kept_after(getattr(self, "runtime", None), len(self.ids))
        return self.origin.head(steps=[r.to_dict() for r in self.steps], text="", token_ids=[],
                                summary=self.summary(), **document_part(kept), **self.reasoning_part())

    def reasoning_part(self) -> dict:
        """``{"reasoning": ...}``: the split of the scored tokens (core/trace/reasoning.py); ``{}`` without
        markers."""
        return {} if self.lm is None else reasoning.for_score(self.s, self.lm, self.ids, self.steps)

    def summary(self) -> ScoreSummary:
        steps = self.steps
        n = len(steps)
        mean_nll = -sum(s.raw_logprob for s in steps) / n if n else float("nan")
        chunk = self.s.chunk or n or 1
        chunks = []
        for a in range(0, n, chunk):
            part = steps[a : a + chunk]
            nll = -sum(s.raw_logprob for s in part) / len(part)
            chunks.append(ChunkPerplexity(part[0].position, part[-1].position + 1, math.exp(nll)))
        summary = ScoreSummary(
            tokens=n, perplexity=math.exp(mean_nll) if n else float("nan"), mean_nll=mean_nll,
            processed_mean_logprob=sum(s.logprob for s in steps) / n if n else float("nan"), chunks=chunks,
            feed=self.feed, tokens_per_s=self.watch.timing.tokens_per_s(n) if self.watch else float("nan"),
            stop_reason=self.stop_reason)
        if self.s.renormalize:
            kept = [s for s in steps if math.isfinite(s.logprob)]
            if kept:
                summary.importance_ratio_mean = sum(math.exp(s.raw_logprob - s.logprob) for s in kept) / len(kept)
                summary.importance_ratio_kept_mean = sum(math.exp(s.kept_logprob - s.logprob)
                                                         for s in kept) / len(kept)
        if self.reference is not None and n:
            summary.reference = self.reference_name
            summary.reference_perplexity = math.exp(-sum(s.reference_logprob for s in steps) / n)
            summary.kl_mean = sum(s.kl for s in steps) / n
            summary.top1_agreement = sum(s.agree for s in steps) / n
            ranked = sorted(steps, key=lambda s: -abs(s.logprob_difference()))[: self.s.top]
            summary.most_different = [{"position": s.position, "token_id": s.token_id, "token": s.token,
                                       "raw_logprob": s.raw_logprob, "reference_logprob": s.reference_logprob,
                                       "difference": s.logprob_difference(), "kl": s.kl} for s in ranked]
        return summary


UNKNOWN_CONTEXT_TOKENS = 2**16  # what score takes without --limit from a model that states no context length


def scored_ids(lm, text: str, settings: ScoreSettings, option: str = "TEXT") -> list[int]:
    """The text's tokens to score: the first --limit of them. Without --limit a text longer than the model's context
    is refused before any forward (all of it in one forward would be scored past the positions the model was trained
    on, with memory growing with its square): the message gives the numbers to pass."""
    ids = lm.encode(text)
    if settings.limit is not None:
        return ids[: settings.limit]
    context = lm.context_length or UNKNOWN_CONTEXT_TOKENS
    if len(ids) > context:
        where = f"the context of {lm.name!r}" if lm.context_length else "what score takes without --limit"
        raise ConfigError(f"{option}: {len(ids)} tokens, more than {where} ({context}); pass --limit {context} to "
                          f"score the first {context}, or --limit {len(ids)} for all of them (memory grows with it), "
                          "or score it under a bounded cache with `decodelab stream --text-file`")
    return ids


def score_run(lm, settings: ScoreSettings, text: str, token_ids: list[int], chain: Chain | None = None,
              reference=None) -> Scorer:
    """``score``'s run with its document head (the registry's build): ``text`` scored as ``token_ids``;
    ``reference``: the --against model."""
    chain = chain or make_chain(lm, settings)
    run = build_scorer(lm, settings, token_ids, chain, reference)
    run.origin = Origin.of("score", lm, as_dict(settings), chain.names, text, token_ids)
    run.lm = lm
    return run


def build_scorer(lm, settings: ScoreSettings, token_ids: list[int], chain: Chain, reference=None) -> Scorer:
    """``reference``: a LoadedModel for --against (None: the same model when --against-cache is given)."""
    ref_model, ref_name, ref_cache = None, None, None
    if settings.against is not None or settings.against_cache is not None:
        ref_cache = policies(settings)["--against-cache"]
        ref_model = (reference or lm).model
        ref_name = f"{(reference or lm).name} (cache {ref_cache})"
    return Scorer(lm.model, token_ids, chain, lm.token_text, settings, settings.cache_spec, ref_model, ref_cache,
                  ref_name)
