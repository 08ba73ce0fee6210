"""Commands on a served engine (``--engine URL``): the connection, and ``sample``, ``score`` and ``batch`` as runs
whose every number says where it came from.

The connection (:func:`connect`) asks the server three things before any command runs: which model it serves
(``GET /v1/models``), whether its tokenizer is the local one (the same probe text tokenised on both sides, special
tokens included, so a missing or extra BOS shows), and what its generation logprobs are (vLLM: a probe,
:meth:`~decodelab.core.engine.http.client.ServedEngine.detect_logprobs_mode`; the server's ``--logprobs-mode`` is not
in any answer). What the backend cannot do is refused with one line (:func:`refuse_on_engine`).

Where each number comes from:

* a generation's own values are the server's ``--logprobs-mode``: **processed** (after its penalties, temperature
  and filters, renormalised over the kept set) or **raw** (the model's log softmax at temperature 1);
* raw values and raw ranks of generated tokens come from a **replay**: prompt + generated tokens scored by the same
  server (prompt logprobs are raw in every mode); in raw mode the generation's own raw values are kept;
* alternatives are the server's top N (**truncated**); ``tail_mass`` = 1 - the listed probabilities' sum bounds
  every unlisted token's probability.

The local recomputation the engine's numbers are held against (``check-logprobs``, ``compare --engine``) is the
replay of :mod:`decodelab.core.sampling.replay`: the local model teacher-forced, decodelab's own chain over the tokens.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace

from ..engine.backend import refuse_lacking
from ..engine.run import Run
from ..engine.http.client import ServedEngine
from ..engine.http.transport import EngineError
from ..engine.http.wire import LOGPROB_KINDS, PROCESSED, RAW, Generated, Position, Scored
from ..errors import ConfigError
from ..sampling.export import served_settings
from ..sampling.semantics import plan as semantics_plan
from ..settings import as_dict
from .batch.run import Baseline, Entry
from .score import ChunkPerplexity, TextScore, check_scorable

# tokenised by the server and locally: words, accents, CJK, an emoji (byte fallback), digits, whitespace
PROBE_TEXT = "decodelab tokenizer check: Grüße, 東京 😀 1234\n\tend"
PROBE_TOKENS = 8  # the probe prompt of the logprobs-mode check: the first ids of PROBE_TEXT
MAX_THREADS = 256  # requests sent at once by batch --engine


# ---------------------------------------------------------------------------------------------------------------
# the connection


@dataclass
class Connection:
    """A served engine checked against the local tokenizer, its logprobs mode known."""

    engine: ServedEngine
    local: object  # a LoadedModel or LocalTokenizer (encode, decode, token_text, vocab_size, name)
    logprobs_mode: str  # raw_logprobs | processed_logprobs | raw_logits | processed_logits
    mode_found_by: str  # "probe" (detected) or "adapter default" (the server kind's documented default)
    tokenizer_checked: bool  # False where the server kind has no tokenize endpoint

    @property
    def values(self) -> str:
        """What a generation's values are: raw / processed (or raw_logits / processed_logits)."""
        return self.engine.adapter.values

    @property
    def kind(self) -> str:
        return self.engine.adapter.kind

    def backend(self) -> str:
        return f"the {self.kind} server at {self.engine.url}"

    def describe(self) -> dict:
        """For the JSON document: where the numbers came from."""
        return {"url": self.engine.url, "kind": self.kind, "served_model": self.engine.model,
                "logprobs_mode": self.logprobs_mode, "mode_found_by": self.mode_found_by,
                "tokenizer_checked": self.tokenizer_checked,
                "capabilities": self.engine.capabilities.to_dict()}


def connect(url: str, local, needs: dict[str, str], model: str | None = None, timeout: float = 60.0) -> Connection:
    """Reach the server: its model (``GET /v1/models``: unreachable, a timeout, several models or a wrong name end
    here), then what the command ``needs`` (capability -> option) refused before anything runs, its tokenizer
    against ``local``'s, its logprobs mode. Each failure is one line."""
    engine = ServedEngine(url, model=model, timeout=timeout)
    engine.model
    refuse_lacking(engine.capabilities, needs, f"the {engine.adapter.kind} server at {engine.url}")
    server_ids = engine.tokenize(PROBE_TEXT, add_special_tokens=True)
    checked = server_ids is not None
    if checked:
        local_ids = list(local.tokenizer.encode(PROBE_TEXT, add_special_tokens=True))
        if server_ids != local_ids:
            first = next((i for i, (a, b) in enumerate(zip(server_ids, local_ids)) if a != b),
                         min(len(server_ids), len(local_ids)))
            raise engine.transport.fail(
                f"the served model's tokenizer differs from --model {local.name}'s (the probe text is "
                f"{len(server_ids)} tokens there, {len(local_ids)} here; first difference at token {first}: "
                f"{server_ids[first:first + 3]} vs {local_ids[first:first + 3]}); point -m at the served model's "
                "folder")
    if engine.adapter.kind == "vllm":  # vLLM tokenizes: its ids, checked equal to the local ones above
        probe = server_ids[:PROBE_TOKENS]
        mode, found = engine.detect_logprobs_mode(probe), "probe"
    else:
        mode, found = engine.logprobs_mode, "adapter default"
    return Connection(engine, local, mode, found, checked)


def engine_head(command: str, conn: Connection, config: dict, chain: list[str], prompt_text: str,
                prompt_ids: list[int], **rest) -> dict:
    """The shared top level (docs/json.md) of a run on a served engine: ``device`` and ``dtype`` are the server's
    (null), ``engine`` says which server, what its numbers are and how that was found; ``rest``: the command's own
    fields that follow it."""
    return {"command": command, "model": conn.local.name, "device": None, "dtype": None, "engine": conn.describe(),
            "config": config, "chain": chain, "prompt": {"text": prompt_text, "token_ids": prompt_ids}, **rest}


def refuse_on_engine(conn: Connection, needs: dict[str, str]) -> None:
    """The first capability in ``needs`` (capability -> the option asking for it) the server lacks: one line."""
    refuse_lacking(conn.engine.capabilities, needs, conn.backend())


def require_logprobs(conn: Connection, command: str) -> None:
    """Logits modes give unnormalised numbers: nothing a command can label as a probability."""
    if conn.values not in LOGPROB_KINDS:
        raise ConfigError(f"{command} --engine {conn.engine.url}: the server runs --logprobs-mode "
                          f"{conn.logprobs_mode} (logits, not log-probabilities); restart it with raw_logprobs or "
                          "processed_logprobs")


def check_vocabulary(conn: Connection, positions) -> None:
    """Every id the server names must be one of the local model's: a larger id means another vocabulary."""
    vocab = conn.local.vocab_size
    for p in positions:
        for token in [p.token_id] + [a.token_id for a in p.top]:
            if not 0 <= token < vocab:
                raise conn.engine.transport.fail(
                    f"the server answered token id {token}, outside --model {conn.local.name}'s vocabulary of "
                    f"{vocab}: the served model's vocabulary differs; point -m at the served model's folder")


def request_of(local, settings, top: int) -> tuple[object, list[str]]:
    """The served request of ``settings`` (vLLM's reading, every field written) with ``top`` alternatives, token
    texts resolved by the local tokenizer: a stage vLLM lacks is refused here, before any server is contacted."""
    if top < 1:
        raise ConfigError(f"--top {top}: a served engine lists at least 1 alternative (each token's logprob)")
    return served_settings(settings, top, local.vocab_size, encode=lambda t: local.tokenizer.encode(
        t, add_special_tokens=False), token_id=local.token_id, eos_ids=tuple(local.eos_ids))


def request_for(conn: Connection, settings, top: int) -> tuple[object, list[str]]:
    """:func:`request_of`, within the server's limit of listed alternatives."""
    cap = conn.engine.capabilities.max_top_n
    if cap is not None and top > cap:
        raise ConfigError(f"--top {top}: the server lists 1..{cap} alternatives (vLLM's --max-logprobs)")
    return request_of(conn.local, settings, top)


def probability(logprob: float | None) -> float | None:
    return None if logprob is None else math.exp(logprob)


def finish_to_stop(finish: str | None, token_ids, eos_ids) -> str:
    """The server's finish_reason in decodelab's stop reasons: length; stop is eos when the last token is one."""
    if finish == "stop":
        return "eos" if token_ids and token_ids[-1] in tuple(eos_ids) else "stop"
    return finish or "length"


# ---------------------------------------------------------------------------------------------------------------
# sample


@dataclass
class EngineAlternative:
    token_id: int
    token: str
    prob: float | None  # processed (the server's, in processed mode)
    raw_prob: float | None  # raw (the server's in raw mode; else the replay's, where it listed this token)


@dataclass
class EngineStep:
    """One generated token as the server gave it. ``values`` says what the generation's logprobs were."""

    index: int
    position: int
    token_id: int
    token: str
    prob: float | None  # processed probability (None: the server returned raw values)
    logprob: float | None
    raw_prob: float | None
    raw_logprob: float | None
    raw_rank: int | None  # from the replay (vLLM ranks every prompt token); None without one
    alternatives: list[EngineAlternative] = field(default_factory=list)
    tail_mass: float | None = None  # 1 - the listed probabilities' sum (of the generation's values)
    values: str = RAW
    defects: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class EngineSampleSummary:
    new_tokens: int
    mean_logprob: float | None  # processed (None when the server returned raw values)
    raw_perplexity: float | None
    tokens_per_s: float  # new tokens / the generation request's wall time
    seconds: float
    stop_reason: str
    finish_reason: str | None  # the server's own word
    values: str  # what the generation's logprobs were
    raw_from: str | None  # "generation", "replay" or None (the replay failed)
    top_n: int
    truncated: bool = True  # alternatives are the server's top N only


class ServedSample(Run):
    """``sample --engine``: one generation request, then a replay for the raw values; iterate for the steps."""

    def __init__(self, conn: Connection, prompt_ids: list[int], request, notes: list[str] | None = None,
                 settings=None, prompt_text: str = ""):
        """``settings`` and ``prompt_text``: what the run was asked (its document's config, chain and prompt)."""
        self.conn, self.prompt_ids, self.request = conn, list(prompt_ids), request
        self.notes = list(notes or [])
        self.settings, self.prompt_text = settings, prompt_text
        self.decode = conn.local.decode
        self.steps: list[EngineStep] = []
        self.generated: Generated | None = None
        self.replayed: Scored | None = None
        self.error: EngineError | None = None  # a replay that failed after the generation came back
        self.stop_reason = "length"

    @property
    def new_ids(self) -> list[int]:
        return [s.token_id for s in self.steps]

    def __iter__(self) -> Iterator[EngineStep]:
        g = self.generated = self.conn.engine.generate(self.prompt_ids, self.request)
        check_vocabulary(self.conn, g.steps)
        self.stop_reason = finish_to_stop(g.finish_reason, g.token_ids, self.conn.local.eos_ids)
        if g.token_ids and self.conn.engine.capabilities.replay:
            try:
                self.replayed = self.conn.engine.score(self.prompt_ids + list(g.token_ids), self.request.logprobs)
            except EngineError as exc:  # the tokens are kept and printed; the error ends the command after
                self.error = exc
        replay = self.replayed.positions[len(self.prompt_ids):] if self.replayed else [None] * len(g.steps)
        for i, (step, again) in enumerate(zip(g.steps, replay)):
            row = self._row(i, step, again, g.labels.values)
            self.steps.append(row)
            yield row

    def _row(self, i: int, step: Position, again: Position | None, values: str) -> EngineStep:
        text = self.conn.local.token_text
        processed = values == PROCESSED
        raw_logprob = step.logprob if not processed else (again.logprob if again else None)
        replay_raw = {a.token_id: a.logprob for a in again.top} if again else {}
        alternatives = [EngineAlternative(a.token_id, text(a.token_id), probability(a.logprob) if processed else None,
                                          probability(replay_raw.get(a.token_id)) if processed
                                          else probability(a.logprob)) for a in step.top]
        return EngineStep(i, len(self.prompt_ids) + i, step.token_id, text(step.token_id),
                          probability(step.logprob) if processed else None, step.logprob if processed else None,
                          probability(raw_logprob), raw_logprob, again.rank if again else step.rank, alternatives,
                          step.tail_mass(), values, list(step.defects))

    def summary(self) -> EngineSampleSummary:
        g, n = self.generated, len(self.steps)
        processed = [s.logprob for s in self.steps if s.logprob is not None]
        raw = [s.raw_logprob for s in self.steps if s.raw_logprob is not None]
        seconds = g.seconds if g is not None else math.nan
        values = g.labels.values if g is not None else self.conn.values
        raw_from = None
        if raw and len(raw) == n:
            raw_from = "generation" if values == RAW else "replay"
        return EngineSampleSummary(
            n, sum(processed) / n if processed and len(processed) == n else None,
            math.exp(-sum(raw) / n) if raw_from else None, n / seconds if seconds > 0 else math.nan, seconds,
            self.stop_reason, g.finish_reason if g is not None else None, values, raw_from, self.request.logprobs)

    def document(self) -> dict:
        """``sample --engine``'s JSON document: the engine's head with the chain and selector as the server reads
        the settings (vLLM's semantics), the request sent, the notes on it, the steps, the text, the summary."""
        effective = semantics_plan(replace(self.settings, semantics="vllm"))
        ids = self.new_ids
        return engine_head("sample", self.conn, as_dict(self.settings), effective.order, self.prompt_text,
                           self.prompt_ids, selector="greedy" if effective.greedy else "engine",
                           request=self.generated.request if self.generated else None, notes=self.notes,
                           steps=self.steps, text=self.conn.local.decode(ids), token_ids=ids, summary=self.summary())


def sample_needs(settings, kept_ids: bool = False) -> dict[str, str]:
    """What ``sample --engine`` asks of the backend, by option."""
    needs = {"generate": "sample --engine"}
    if not semantics_plan(replace(settings, semantics="vllm")).greedy:  # the server reads them as vLLM does
        needs["seeded"] = "--seed"
    if settings.cache not in (None, "full"):
        needs["kv_policies"] = f"--cache {settings.cache}"
    if kept_ids:
        needs["full_logits"] = "--kept-ids"
    return needs


# ---------------------------------------------------------------------------------------------------------------
# score


@dataclass
class EngineScoredAlternative:
    token_id: int
    token: str
    raw_logprob: float


@dataclass
class EngineScoredToken:
    position: int
    token_id: int
    token: str
    raw_logprob: float
    raw_rank: int | None
    alternatives: list[EngineScoredAlternative] = field(default_factory=list)
    tail_mass: float | None = None
    defects: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class EngineScoreSummary:
    tokens: int
    perplexity: float
    mean_nll: float
    chunks: list[ChunkPerplexity] = field(default_factory=list)
    tokens_per_s: float = math.nan
    seconds: float = math.nan
    stop_reason: str = "end"
    values: str = RAW  # prompt logprobs are raw in every mode
    top_n: int = 0
    truncated: bool = True


class ServedScore(TextScore):
    """``score --engine``: the text's token ids scored by the server (prompt logprobs), one request."""

    def __init__(self, conn: Connection, token_ids: list[int], top_n: int, chunk: int | None = None,
                 settings=None, text: str = ""):
        """``settings`` and ``text``: what the run was asked (its document's config and prompt)."""
        check_scorable(token_ids)
        self.conn, self.ids, self.top_n, self.chunk = conn, list(token_ids), top_n, chunk
        self.settings, self.text_scored = settings, text
        self.steps: list[EngineScoredToken] = []
        self.seconds = math.nan
        self.stop_reason = "end"

    def __iter__(self) -> Iterator[EngineScoredToken]:
        started = time.perf_counter()
        scored = self.conn.engine.score(self.ids, self.top_n)
        self.seconds = time.perf_counter() - started
        check_vocabulary(self.conn, scored.positions[1:])
        text = self.conn.local.token_text
        for p in scored.positions[1:]:
            row = EngineScoredToken(p.index, p.token_id, text(p.token_id), p.logprob, p.rank,
                                    [EngineScoredAlternative(a.token_id, text(a.token_id), a.logprob) for a in p.top],
                                    p.tail_mass(), list(p.defects))
            self.steps.append(row)
            yield row

    def summary(self) -> EngineScoreSummary:
        steps, n = self.steps, len(self.steps)
        mean_nll = -sum(s.raw_logprob for s in steps) / n if n else math.nan
        size = self.chunk or n or 1
        chunks = [ChunkPerplexity(part[0].position, part[-1].position + 1,
                                  math.exp(-sum(s.raw_logprob for s in part) / len(part)))
                  for part in (steps[a : a + size] for a in range(0, n, size))]
        return EngineScoreSummary(n, math.exp(mean_nll) if n else math.nan, mean_nll, chunks,
                                  n / self.seconds if self.seconds > 0 else math.nan, self.seconds, self.stop_reason,
                                  RAW, self.top_n)

    def document(self) -> dict:
        """``score --engine``'s JSON document: the engine's head (no chain: the server's prompt logprobs are raw),
        a step per scored token, no generated text, the summary."""
        return engine_head("score", self.conn, as_dict(self.settings), [], self.text_scored, self.ids,
                           steps=[r.to_dict() for r in self.steps], text="", token_ids=[], summary=self.summary())


def score_needs(settings, active_stages: list[str], kept: bool = False) -> dict[str, str]:
    """What ``score --engine`` asks of the backend, by option: the chain's processed log-probability, a
    reference's KL and a kept set all need the full distribution."""
    needs = {"score": "score --engine"}
    if active_stages:
        needs["full_logits"] = f"the chain ({', '.join(active_stages)}: its processed log-probability)"
    if settings.against is not None or settings.against_cache is not None:
        needs["full_logits"] = "--against/--against-cache (KL against a reference)"
    if kept:
        needs["full_logits"] = "--kept-ids/--renormalize"
    if settings.cache not in (None, "full") or settings.feed is not None:
        needs["kv_policies"] = "--cache/--feed"
    return needs


# ---------------------------------------------------------------------------------------------------------------
# batch: the engine's own continuous batching on the same requests


def batch_on_engine(run, chat: bool = False) -> Baseline:
    """``batch --engine``: the requests of the batch ``run`` (:class:`~.batch.run.BatchRun`, its ``conn`` set) on
    the server, all at once (:func:`engine_baseline`); the baseline joins the run's, so its figures are in the
    summary and its answers per request in the run's document (``engine_requests``)."""
    entries = run.entries
    base = engine_baseline(run.conn, entries, [run.lm.encode(e.prompt, chat=chat) for e in entries],
                           run.report().results)
    run.baselines.append(base)
    return base


def engine_baseline(conn: Connection, entries: list[Entry], prompt_ids: list[list[int]], reference) -> Baseline:
    """Every request sent at once (one thread each, up to MAX_THREADS) so the server batches them itself;
    wall time from the first sent to the last answered. Prefix-cache hits: the server's own counters before and
    after (vLLM's /metrics, server-wide), and per request where the server reports cached tokens. A request that
    fails ends the baseline with its reason; the answers already in are kept."""
    requests = [request_for(conn, e.settings, 1)[0] for e in entries]
    before = conn.engine.prefix_cache_counters()
    answers: list[Generated | EngineError] = []

    def one(pair) -> Generated | EngineError:
        try:
            return conn.engine.generate(*pair)
        except EngineError as exc:
            return exc

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=min(MAX_THREADS, len(entries))) as pool:
        answers = list(pool.map(one, zip(prompt_ids, requests)))
    seconds = time.perf_counter() - started
    after = conn.engine.prefix_cache_counters()
    done = [(e, a) for e, a in zip(entries, answers) if isinstance(a, Generated)]
    failed = [a for a in answers if isinstance(a, EngineError)]
    tokens = sum(len(a.token_ids) for _, a in done)
    by_id = {r.id: r for r in reference}
    same = sum(tuple(by_id[e.id].new_ids) == a.token_ids for e, a in done if e.id in by_id)
    details: dict = {"prompt_tokens": sum(len(ids) for ids in prompt_ids), "tokens": tokens,
                     "requests_done": len(done)}
    if before is not None and after is not None:
        hits, queries = after["hits"] - before["hits"], after["queries"] - before["queries"]
        details.update(prefix_hit_tokens=int(hits), prefix_query_tokens=int(queries),
                       prefix_hit_rate=hits / queries if queries else 0.0)
    cached = [a.cached_tokens for _, a in done if a.cached_tokens is not None]
    if cached and len(cached) == len(done):
        details["cached_tokens"] = sum(cached)
    rows = [{"id": e.id, "token_ids": list(a.token_ids), "finish_reason": a.finish_reason,
             "cached_tokens": a.cached_tokens, "seconds": a.seconds} for e, a in done]
    return Baseline("engine", tokens / seconds if seconds > 0 and tokens else None, seconds, same,
                    reason=str(failed[0]) if failed else None, details=details, requests=rows)
