"""The ``batch`` run: requests read from a prompts file, each with its own settings, scheduled iteration by
iteration over the paged pool; the same requests under static batching (and, where asked, transformers' own
continuous batching) timed in the same run for the ratios.

Prompts file: one prompt a line (blank lines skipped), or JSONL: one object a line with ``prompt`` and optionally
``id`` and any sample setting (``temperature``, ``top_p``, ``seed``, ``max_new_tokens``, ``stop``, ...), which
overrides the command's settings for that request only.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from ...engine.models import LoadedModel
from ...engine.reference import continuous_batching_generate
from ...engine.run import Run, clock
from ...engine.stopping import StopRules, stop_rules
from ...errors import ConfigError
from ...inputs import parse_json, read_input_text
from ...sampling.chain import build_chain, chain_for, make_chain
from ...sampling.select import make_selector
from ...sampling.semantics import plan as semantics_plan, trims_stop
from ...sampling.tokens import Tokens
from ...settings import as_dict, coerce, normalize_key
from ..sample import SampleSettings, validate_sample
from .scheduler import Iteration, Request, Result, Scheduler

BASELINES = ("static", "transformers", "batched")  # batched: the ordinary mode, beside --batch-invariant (its cost)


@dataclass(frozen=True)
class BatchSettings(SampleSettings):
    max_batch: int = 8
    max_tokens_per_iteration: int = 512
    block_size: int = 16
    blocks: int | None = None  # pool size; None: max_batch x the longest request's blocks
    baselines: tuple[str, ...] = ("static",)
    batch_invariant: bool = False  # one forward per row at its own shapes: its bits those of a lone run (scheduler)


NOT_PER_REQUEST = ("cache", "compile", "top")  # the pool, the forward and the trace are shared by every request


# sanity bounds, far above any useful value: past them a pool or a mask would not fit in any machine's memory
LIMITS = {"max_batch": 4096, "max_tokens_per_iteration": 1 << 20, "block_size": 4096, "blocks": 1 << 20}


def validate_batch(s: BatchSettings) -> None:
    validate_sample(s)
    for key, most in LIMITS.items():
        value = getattr(s, key)
        if value is not None and not 1 <= value <= most:
            raise ConfigError(f"--{key.replace('_', '-')} {value}: must be an integer in [1, {most}]")
    for name in s.baselines:
        if name not in BASELINES:
            raise ConfigError(f"--baselines {name!r}: allowed: {', '.join(BASELINES)} (comma-separated), or none")
    if "batched" in s.baselines and not s.batch_invariant:
        raise ConfigError("--baselines batched: the ordinary batched mode is the run itself without "
                          "--batch-invariant; give --batch-invariant to time one against the other")


@dataclass
class Entry:
    """One line of the prompts file."""

    id: str
    prompt: str
    settings: BatchSettings


def read_prompts(path: str | Path, base: BatchSettings) -> list[Entry]:
    """Parse and check the prompts file before the model loads (every error names the line)."""
    text = read_input_text("--prompts-file", path)
    lines = [(i + 1, line) for i, line in enumerate(text.splitlines()) if line.strip()]
    if not lines:
        raise ConfigError(f"--prompts-file {path}: no prompts in it")
    jsonl = all(line.lstrip().startswith("{") for _, line in lines)
    entries = []
    for number, line in lines:
        where = f"--prompts-file {path} line {number}"
        if not jsonl:
            entries.append(Entry(str(len(entries)), line, base))
            continue
        obj = parse_json(where, line)
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
            raise ConfigError(f"{where}: needs a non-empty \"prompt\" string")
        settings = replace(base, **request_settings(where, obj))
        try:
            validate_sample(settings)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        entries.append(Entry(str(obj.get("id", len(entries))), obj["prompt"], settings))
    ids = [e.id for e in entries]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"--prompts-file {path}: request ids must be unique")
    return entries


def request_settings(where: str, obj: dict, skip: tuple[str, ...] = ("prompt", "id")) -> dict:
    """A JSONL line's own settings: every key but ``skip``, named and typed as sample's settings (the line's
    overrides of the command's settings for that request); what every request shares (NOT_PER_REQUEST) refused."""
    overrides = {}
    for key, raw in obj.items():
        if key in skip:
            continue
        try:
            name = normalize_key(SampleSettings, key)
            overrides[name] = coerce(SampleSettings, name, raw)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        if name in NOT_PER_REQUEST:
            raise ConfigError(f"{where}: {key!r} is not a per-request setting (allowed: the chain's, seed, "
                              "max_new_tokens, stop, ignore_eos)")
    return overrides


def build_requests(lm: LoadedModel, entries: list[Entry], chat: bool = False) -> list[Request]:
    """Fresh requests (each its own chain, selector with its own generator, stop checker)."""

    out = []
    for e in entries:
        s = e.settings
        prompt_ids = lm.encode(e.prompt, chat=chat)
        selector = semantics_plan(s).make_selector(s.seed, lm.device)
        chain = make_chain(lm, s, getattr(selector, "generator", None))  # XTC's coin from the selector's generator
        chain.reset(len(prompt_ids))  # stages that count generated tokens (or read them: a constraint) start here
        out.append(Request(e.id, prompt_ids, chain, selector, stop_rules(lm, s), lm.decode, e.prompt, trims_stop(s)))
    return out


@dataclass
class Baseline:
    name: str
    tokens_per_s: float | None
    seconds: float | None
    same_tokens: int | None = None  # requests whose tokens equal the iteration-level run's
    reason: str | None = None  # why it did not run (or, for the engine, the first request that failed)
    details: dict = field(default_factory=dict)  # more figures (the engine's prefix-cache counters), in the summary
    requests: list[dict] = field(default_factory=list)  # per request, where the baseline reports them (the engine)
    outputs: list[list[int]] = field(default_factory=list, repr=False)  # its tokens per request, the reference's order


@dataclass
class BatchReport:
    settings: BatchSettings
    results: list[Result]
    iterations: list[Iteration]
    seconds: float
    peak_blocks: int
    num_blocks: int
    baselines: list[Baseline] = field(default_factory=list)
    stop_reason: str = "end"  # "interrupted": Ctrl-C ended the run (the requests it cut say so too)
    warmup_s: float = 0.0  # the untimed warm-up before the run (engine/warmup.py's rule), in no rate

    @property
    def tokens(self) -> int:
        return sum(len(r.new_ids) for r in self.results)

    def summary(self) -> dict:
        prompt_tokens = sum(len(r.prompt_ids) for r in self.results)
        hits = sum(r.prefix_hit_tokens for r in self.results)
        rows = sum(i.rows for i in self.iterations)
        out = {
            "requests": len(self.results),
            "tokens": self.tokens,
            "iterations": len(self.iterations),
            "seconds": self.seconds,
            "tokens_per_s": self.tokens / self.seconds if self.seconds > 0 else None,
            "prompt_tokens": prompt_tokens,
            "prefill_tokens_computed": sum(i.prefill_tokens for i in self.iterations),
            "prefix_hit_tokens": hits,
            "prefix_hit_rate": hits / prompt_tokens if prompt_tokens else 0.0,
            "preemptions": sum(len(i.preempted) for i in self.iterations),
            "peak_blocks": self.peak_blocks,
            "blocks": self.num_blocks,
            "block_size": self.settings.block_size,
            "max_batch": self.settings.max_batch,
            "slot_utilisation": rows / (len(self.iterations) * self.settings.max_batch) if self.iterations else 0.0,
            "stop_reason": self.stop_reason,
            "warmup_s": self.warmup_s,
        }
        for b in self.baselines:
            out[f"{b.name}_tokens_per_s"] = b.tokens_per_s
            out[f"speedup_vs_{b.name}"] = (out["tokens_per_s"] / b.tokens_per_s
                                           if b.tokens_per_s and out["tokens_per_s"] else None)
            out[f"{b.name}_same_tokens"] = b.same_tokens
            if b.reason:
                out[f"{b.name}_skipped"] = b.reason
            out.update({f"{b.name}_{k}": v for k, v in b.details.items()})
        return out


def scheduler_for(lm: LoadedModel, settings: BatchSettings, requests: list[Request], static: bool) -> Scheduler:
    return Scheduler(lm.model, requests, max_batch=settings.max_batch,
                     max_tokens_per_iteration=settings.max_tokens_per_iteration, block_size=settings.block_size,
                     num_blocks=settings.blocks, static=static, invariant=settings.batch_invariant and not static)


def batched_baseline(lm: LoadedModel, settings: BatchSettings, entries: list[Entry], reference: list[Result],
                     chat: bool = False) -> Baseline:
    """The same requests in the ordinary batched mode (one forward per iteration over every row), warmed at its
    batch size first (its ``warmup_s``): beside a --batch-invariant run, ``speedup_vs_batched`` is that mode's cost
    and ``batched_same_tokens`` how many requests the batch moved."""
    ordinary = replace(settings, batch_invariant=False)
    warm = warm_up(lm, ordinary, len(entries))
    sched = scheduler_for(lm, ordinary, build_requests(lm, entries, chat), static=False)
    results = sched.run()
    tokens = sum(len(r.new_ids) for r in results)
    same = sum(a.new_ids == b.new_ids for a, b in zip(results, reference))
    return Baseline("batched", tokens / sched.seconds, sched.seconds, same, details={"warmup_s": warm},
                    outputs=[list(r.new_ids) for r in results])


def static_baseline(lm: LoadedModel, settings: BatchSettings, entries: list[Entry], reference: list[Result],
                    chat: bool = False) -> Baseline:
    """The same requests (fresh generators) in fixed batches of max_batch that run until every member ends."""
    # its own pool, sized for whole batches (a --blocks small enough to preempt would stop static batching)
    sched = scheduler_for(lm, replace(settings, blocks=None), build_requests(lm, entries, chat), static=True)
    results = sched.run()
    tokens = sum(len(r.new_ids) for r in results)
    same = sum(a.new_ids == b.new_ids for a, b in zip(results, reference))
    return Baseline("static", tokens / sched.seconds, sched.seconds, same, outputs=[list(r.new_ids) for r in results])


def transformers_baseline(lm: LoadedModel, settings: BatchSettings, reference: list[Result]) -> Baseline:
    """transformers' continuous batching on the same prompts and output lengths (greedy, EOS off: the same work;
    the tokens equal ours only for greedy requests)."""

    work = [(r.prompt_ids, len(r.new_ids)) for r in reference]
    try:
        outputs, seconds = continuous_batching_generate(lm.model, work, settings.max_batch,
                                                        settings.max_tokens_per_iteration, settings.block_size)
    except Exception as exc:  # its API varies between versions and devices: report why, do not fail the run
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return Baseline("transformers", None, None, reason=f"{type(exc).__name__}: {first}")
    tokens = sum(len(r.new_ids) for r in reference)
    same = sum(list(o) == r.new_ids for o, r in zip(outputs, reference))
    return Baseline("transformers", tokens / seconds, seconds, same, outputs=[list(o) for o in outputs])


def mean_logprobs(steps) -> dict:
    """A request's mean log-probability per generated token, processed (what its selector drew from) and raw (the
    model's own softmax): the table's two columns, in JSON and CSV too (None for a request with no token)."""
    n = len(steps)
    return {"mean_logprob": sum(s.logprob for s in steps) / n if n else None,
            "mean_raw_logprob": sum(s.raw_logprob for s in steps) / n if n else None}


class BatchRun(Run):
    """The iteration-level run: iterate it for :class:`Iteration` records (``interrupt()`` ends it where it is), then
    ``report()``, then ``run_baselines(report)`` for the baselines in ``settings.baselines`` on the same requests.
    (A chain that empties ends only its own request, inside the scheduler; ``end`` is the contract's, for a cause
    that ends them all.)"""

    def __init__(self, lm: LoadedModel, settings: BatchSettings, entries: list[Entry], chat: bool = False):
        self.lm, self.settings, self.entries, self.chat = lm, settings, entries, chat
        self.warmup_s = warm_up(lm, settings, len(entries))
        self.scheduler = scheduler_for(lm, settings, build_requests(lm, entries, chat), static=False)
        self.stop_reason = "end"
        self.baselines: list[Baseline] = []  # shared by every report of the run: a baseline run once stays
        self.conn = None  # a served engine the same requests also run on (batch --engine: methods/served.py)
        self.noise: list[dict] = []  # where a greedy request's baseline parts from it (analysis/agreement.py)

    def __iter__(self) -> Iterator[Iteration]:
        return iter(self.scheduler)

    def interrupt(self) -> None:
        self.scheduler.interrupt()
        super().interrupt()

    def end(self, reason: str) -> None:
        self.scheduler.interrupt(reason)
        super().end(reason)

    def report(self) -> BatchReport:
        """The run's report as it stands (the baselines run so far included)."""
        sched = self.scheduler
        return BatchReport(self.settings, sched.results, sched.iterations, sched.seconds, sched.peak_blocks,
                           sched.policy.num_blocks, self.baselines, stop_reason=self.stop_reason,
                           warmup_s=self.warmup_s)

    @property
    def new_ids(self) -> list[int]:
        """None of its own: each request's tokens are in ``requests()``."""
        return []

    def text(self) -> str:
        """The requests' texts, one a line."""
        return "\n".join(r["text"] for r in self.requests())

    def summary(self) -> dict:
        return self.report().summary()

    def requests(self) -> list[dict]:
        """Per request: its prompt, chain, tokens, text, how it was served (prefix hits, preemptions) and its
        steps."""
        lm = self.lm
        return [{"id": r.id, "prompt": r.prompt, "prompt_token_ids": r.prompt_ids, "chain": r.chain,
                 "token_ids": r.new_ids, "text": r.text, "stop_reason": r.stop_reason,
                 "prefix_hit_tokens": r.prefix_hit_tokens, "computed_tokens": r.computed_tokens,
                 "preemptions": r.preemptions, "joined": r.joined, "finished": r.finished, **mean_logprobs(r.steps),
                 "steps": [{"index": i, "token_id": s.token_id, "token": lm.token_text(s.token_id),
                            "logprob": s.logprob, "raw_logprob": s.raw_logprob} for i, s in enumerate(r.steps)]}
                for r in self.report().results]

    def document(self) -> dict:
        """``batch``'s JSON document: the model and settings, the command-level chain, every request, every
        iteration, the summary (with the baselines run), the engine's part when the requests also ran on one, and
        the noise verdicts where a greedy request's baseline parted from it."""
        lm, report = self.lm, self.report()
        return {"command": "batch", "model": lm.name, "device": str(lm.device),
                "dtype": str(lm.dtype).replace("torch.", ""), "config": as_dict(self.settings),
                "chain": chain_names(self.settings), "requests": self.requests(), "iterations": report.iterations,
                "summary": report.summary(), **self.engine_part(report),
                **({"noise": self.noise} if self.noise else {})}

    def engine_part(self, report: BatchReport) -> dict:
        """With a served engine: which server, what its numbers are (``engine``), and its answer per request
        (``engine_requests``: none until its baseline ran)."""
        if self.conn is None:
            return {}
        rows = next((b.requests for b in report.baselines if b.name == "engine"), [])
        return {"engine": self.conn.describe(), "engine_requests": rows}

    def run_baselines(self, report: BatchReport) -> None:
        """Every baseline timed warm: static batching runs the run's own kernels at the run's batch size, warmed by
        the run's warm-up; transformers' continuous batching has kernels of its own and is warmed up just before it
        is timed (reported as its ``warmup_s``). So whichever is timed first pays no more than the others."""
        lm, settings, count = self.lm, self.settings, len(self.entries)
        for name in settings.baselines:
            if name == "static":
                base = static_baseline(lm, settings, self.entries, report.results, self.chat)
            elif name == "batched":
                base = batched_baseline(lm, settings, self.entries, report.results, self.chat)
            else:
                try:
                    warm = warm_transformers(lm, settings, count)
                except Exception:  # noqa: BLE001  the timed call below reports why it cannot run
                    warm = None
                base = transformers_baseline(lm, settings, report.results)
                if base.reason is None:
                    base.details["warmup_s"] = warm
            report.baselines.append(base)


def chain_names(settings: BatchSettings) -> list[str]:
    """The command-level chain (a JSONL request may set its own: requests[].chain)."""
    return chain_for(settings, Tokens.placeholder())[1].names


def batch_run(lm: LoadedModel, settings: BatchSettings, entries: list[Entry], chat: bool = False) -> BatchRun:
    """``batch``'s run (the registry's build): many requests, each with its own prompt and settings."""
    return BatchRun(lm, settings, entries, chat)


def run_batch(lm: LoadedModel, settings: BatchSettings, entries: list[Entry], chat: bool = False,
              on_iteration=None) -> BatchReport:
    """The whole run at once (each iteration record handed to ``on_iteration`` as it ends), then the baselines."""
    run = BatchRun(lm, settings, entries, chat)
    for record in run:
        if on_iteration is not None:
            on_iteration(record)
    report = run.report()
    run.run_baselines(report)
    return report


WARM_PROMPT = 3  # tokens of the first warm-up row's prompt (then 4, 5, 6, 3, ...)
WARM_NEW = 2  # tokens each warm-up row generates


def warm_work(settings: BatchSettings, count: int) -> list[tuple[list[int], int]]:
    """The warm-up workload: as many rows as the timed run batches (its decode kernels are per batch size), short
    prompts of distinct lengths, a couple of new tokens each: first-call costs at a small fraction of the run's."""
    rows = max(2, min(settings.max_batch, count))
    return [([0] * (WARM_PROMPT + i % 4), WARM_NEW) for i in range(rows)]


def warm_up(lm: LoadedModel, settings: BatchSettings, count: int = 2, static: bool = False) -> float:
    """Untimed iterations of :func:`warm_work` under the scheduler (``static``: its static batching), before the
    timed run: a cold first run would otherwise pay CUDA's first-call costs alone and lose every ratio. Seconds."""
    device = lm.device
    start = clock(device)
    requests = [Request(f"warm{i}", p, build_chain({}), make_selector("greedy", 0, device),
                        StopRules(n, ignore_eos=True))
                for i, (p, n) in enumerate(warm_work(settings, count))]
    Scheduler(lm.model, requests, max_batch=len(requests), block_size=settings.block_size,
              **({"static": True} if static else {"invariant": True} if settings.batch_invariant else {})).run()
    return clock(device) - start


def warm_transformers(lm: LoadedModel, settings: BatchSettings, count: int) -> float:
    """transformers' continuous batching on :func:`warm_work`, untimed by its baseline. Seconds."""
    start = clock(lm.device)
    continuous_batching_generate(lm.model, warm_work(settings, count), settings.max_batch,
                                 settings.max_tokens_per_iteration, settings.block_size)
    return clock(lm.device) - start
