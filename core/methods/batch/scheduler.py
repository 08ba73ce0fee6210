"""Iteration-level scheduling over the paged KV pool (``batch``), and static batching over the same requests.

Each iteration runs ONE forward over the running sequences: a sequence with one token left to compute (the newest
one) decodes; one with more (a prompt, or a preempted sequence's prompt and output) takes a chunk of them. Rows
are ordered decodes first, then prefills in the order they joined; the chunks fill what is left of
``max_tokens_per_iteration``. A row whose last pending token was just computed selects its next token with ITS OWN
chain, selector (and torch.Generator) and stop checker, so a request's output does not depend on its neighbours.
Finished sequences leave and waiting ones join in the same iteration boundary.

Pool full: the sequence that joined last is preempted (its blocks are released, it goes back to the front of the
queue and recomputes its prompt and output when it rejoins; its sampler state is kept, so its tokens are those of
a run without preemption). Every preemption is in that iteration's record.

Static batching (``static=True``): a batch of ``max_batch`` requests joins only when the previous batch has
entirely finished; the whole prompts are prefilled at once, and a finished member keeps its row and keeps
computing (as ``generate`` does with padding) until the last member finishes. No prefix sharing.

A waiting request whose next uncached full block is being computed by a running prefill waits for it (one or two
iterations) instead of computing the same block again.

Batch-invariant mode (``invariant=True``; issue 34): a request's bits do not depend on the batch it shares. One
batched forward is not: a row's numbers come out of GEMMs and attention whose shapes (rows x padded tokens, the
padded context) are set by its neighbours, and kernels pick their blocking, hence their reduction order, by shape
(measured on this CPU in float32: a request's logprobs moved by up to 7e-7 between batches). So in this mode every
row is its own forward at shapes set by the request alone: its chunk is min(pending tokens,
``max_tokens_per_iteration``) whatever else runs (the budget is per row, not shared), it is computed alone
(batch 1, its own context), and it never reads a cached block another request computed (prefix caching off). Its
bits are those of the request run alone; the cost is one forward per row instead of one per iteration. A preempted
request (``--blocks`` too small) recomputes its output as a prefill, which no lone run does: preemption is the one
thing left that can move its bits (its ``preemptions`` count says so).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ...engine.run import clock
from ...engine.runtime import Runtime
from ...engine.stopping import StopChecker, StopRules, trim_stop
from ...engine.tokens import TokenBuffer, check_prompt
from ...errors import EMPTY_CHAIN, ConfigError
from ...kv import CacheSpec
from ...kv.paged import PagedPolicy, PoolFull, blocks_for, chain_hashes
from ...sampling.chain import Chain
from ...sampling.select import Greedy
from ...sampling.step import select
from ...trace.stats import chosen_logprobs


@dataclass
class Request:
    """One request: its tokens and its own chain, selector (with its generator) and stop rules."""

    id: str
    prompt_ids: list[int]
    chain: Chain
    selector: object
    rules: StopRules
    detok: Callable[[list[int]], str] | None = None
    prompt: str | None = None
    trim_stop: bool = False  # deliver the text without what stopped it (as a run does: engine.run.Run.delivered)


@dataclass
class TokenStep:
    """One generated token: processed log-probability (what the selector drew from) and the model's raw one."""

    token_id: int
    logprob: float
    raw_logprob: float


@dataclass
class Result:
    id: str
    prompt: str | None
    prompt_ids: list[int]
    chain: list[str]  # its processor stages, in order
    new_ids: list[int]
    stop_reason: str
    steps: list[TokenStep]
    prefix_hit_tokens: int  # prompt tokens found in shared blocks when it (first) joined
    computed_tokens: int  # tokens this request fed to the model (prefills, recomputes, decodes)
    preemptions: int
    joined: int  # iteration it first joined
    finished: int  # iteration its last token was selected
    text: str | None = None  # the delivered text (trimmed when the request says so); None without a detokenizer


@dataclass
class Iteration:
    """What the scheduler did in one iteration (one forward)."""

    index: int
    running: int  # sequences in the running set (after this iteration's joins)
    rows: int  # rows in this forward (fewer than running only when the token budget ran out)
    joined: list[str]
    finished: list[str]
    waiting: int  # after this iteration
    blocks_used: int  # held by running sequences during the forward
    blocks_free: int  # on the free list then (cached blocks included: they are reusable)
    prefix_hit_tokens: int  # tokens the joining sequences found cached
    preempted: list[str]
    tokens: int  # tokens fed (all rows)
    prefill_tokens: int  # of which prompt/recompute tokens
    decode_tokens: int
    seconds: float


@dataclass(eq=False)  # a sequence is itself: `in` and `remove` on the running list compare identities
class Seq:
    req: Request
    order: int  # arrival order (the queue's)
    tokens: list[int]  # prompt + generated (+ padding steps of a finished static row)
    buf: TokenBuffer
    stopper: StopChecker
    names: list[bytes] = field(default_factory=list)  # prompt's full-block names
    new_ids: list[int] = field(default_factory=list)
    steps: list[TokenStep] = field(default_factory=list)
    computed: int = 0
    joined_at: int = -1
    join_seq: int = 0  # when it (re)joined the running set: the last to join is preempted first
    hits: int | None = None
    fed: int = 0
    preemptions: int = 0
    stop_reason: str | None = None
    finished_at: int = -1

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.computed

    @property
    def key(self) -> str:
        return self.req.id


class Scheduler:
    """Iterate for :class:`Iteration` records; afterwards ``results`` (in request order) and ``seconds``."""

    def __init__(self, model, requests: list[Request], max_batch: int = 8, max_tokens_per_iteration: int = 512,
                 block_size: int = 16, num_blocks: int | None = None, static: bool = False,
                 prefix_caching: bool | None = None, invariant: bool = False):
        if max_batch < 1:
            raise ConfigError(f"--max-batch {max_batch}: must be an integer >= 1")
        if max_tokens_per_iteration < 1:
            raise ConfigError(f"--max-tokens-per-iteration {max_tokens_per_iteration}: must be an integer >= 1")
        ids = [r.id for r in requests]
        if len(set(ids)) != len(ids):
            raise ConfigError("--prompts-file: request ids must be unique")
        for r in requests:
            check_prompt(len(r.prompt_ids), r.rules.context_length)
        if invariant and (static or prefix_caching):
            raise ConfigError("batch-invariant mode: not with static batching or prefix caching (a shared block was "
                              "computed in another request's forward)")
        self.model, self.requests = model, list(requests)
        self.max_batch, self.static, self.invariant = max_batch, static, invariant
        self.budget = float("inf") if static or invariant else max_tokens_per_iteration
        self.chunk = max_tokens_per_iteration if invariant else float("inf")  # a row's own cap (invariant: per row)
        self.prefix_caching = (not static and not invariant) if prefix_caching is None else prefix_caching
        longest = max((len(r.prompt_ids) + r.rules.max_new_tokens for r in requests), default=1)
        if static:  # a finished row keeps growing until its batch's longest output is done
            longest = max((len(r.prompt_ids) for r in requests), default=1) + \
                max((r.rules.max_new_tokens for r in requests), default=0)
        need = blocks_for(longest, block_size)
        if num_blocks is None:
            num_blocks = min(max_batch, max(len(requests), 1)) * need
        if num_blocks < need:
            raise ConfigError(f"--blocks {num_blocks}: the longest request needs {need} blocks of {block_size} "
                              "tokens; give more")
        spec = CacheSpec("paged", (("block", block_size), ("blocks", num_blocks)))
        self.runtime = Runtime.create(model, spec)
        self.policy: PagedPolicy = self.runtime.policy
        self.results: list[Result] = []
        self.iterations: list[Iteration] = []
        self.seconds = 0.0
        self.peak_blocks = 0

    # --- the loop ---

    def __iter__(self) -> Iterator[Iteration]:
        device = self.runtime.device
        self.waiting: deque[Seq] = deque(self._seq(i, r, device) for i, r in enumerate(self.requests))
        self.running: list[Seq] = []
        self._joins = 0
        done = self._done = {}
        index = 0
        while self.waiting or self.running:
            start = clock(device)  # the consumer's time between two iterations is no iteration's
            schedule, budget, preempted = self._schedule_running()
            joined, hit_tokens = ([], 0) if preempted else self._admit(schedule, budget, index)
            if not schedule:
                raise ConfigError("--max-tokens-per-iteration / --blocks: nothing could be scheduled")
            used = self.policy.blocks_used
            finished, decodes = self._forward(schedule, index)
            in_set = len(self.running)
            done.update((s.key, s) for s in finished)
            self._retire(finished)
            self.peak_blocks = max(self.peak_blocks, used)
            seconds = clock(device) - start
            self.seconds += seconds
            fed = sum(n for _, n in schedule)
            record = Iteration(index, in_set, len(schedule), joined, [s.key for s in finished], len(self.waiting),
                               used, self.policy.num_blocks - used, hit_tokens, preempted, fed, fed - decodes,
                               decodes, seconds)
            self.iterations.append(record)
            index += 1
            yield record
        self.results = [self._result(done[r.id]) for r in self.requests]

    def interrupt(self, reason: str = "interrupted") -> None:
        """Ctrl-C (or another cause that ends them all, ``reason``): every request not finished (running or still
        waiting) ends where it is, with that stop_reason and what it produced; ``results`` then holds every
        request, in request order."""
        done = getattr(self, "_done", {})
        for s in [*getattr(self, "running", []), *getattr(self, "waiting", [])]:
            if s.stop_reason is None:
                s.stop_reason = reason
            done.setdefault(s.key, s)
        self.results = [self._result(done[r.id]) for r in self.requests if r.id in done]

    def _schedule_running(self) -> tuple[list[tuple[Seq, int]], float, list[str]]:
        """Decodes first, then prefill chunks in join order, within the token budget; blocks reserved for each,
        preempting the last to join while the pool is short. Returns (schedule, budget left, preempted ids)."""
        running, budget = self.running, self.budget
        schedule: list[tuple[Seq, int]] = []
        preempted: list[str] = []
        for seq in sorted(running, key=lambda s: (s.pending > 1, s.join_seq)):
            n = min(seq.pending, budget, self.chunk)
            if n <= 0 or seq not in running:
                continue
            while seq in running:
                try:
                    self.policy.reserve(seq.key, n)
                    break
                except PoolFull:
                    victim = max(running, key=lambda s: s.join_seq)
                    if self.static or (victim is seq and len(running) == 1):
                        raise ConfigError("--blocks: the pool is too small for this batch") from None
                    budget += self._preempt(victim, schedule)
                    preempted.append(victim.key)
            if seq in running:
                schedule.append((seq, n))
                budget -= n
        return schedule, budget, preempted

    def _admit(self, schedule: list[tuple[Seq, int]], budget: float, index: int) -> tuple[list[str], int]:
        """Waiting sequences join while there is a free row, token budget and blocks for their first chunk; each
        shares its cached prefix. Returns (joined ids, prefix-hit tokens)."""
        joined, hit_tokens = [], 0
        for seq in self._admissible():
            if len(self.running) >= self.max_batch or budget <= 0:
                break
            hit = self.policy.admit(seq.key, seq.tokens, share=self.prefix_caching)
            n = min(len(seq.tokens) - hit, budget, self.chunk)
            try:
                self.policy.reserve(seq.key, n)
            except PoolFull:
                self.policy.free(seq.key)
                break
            seq.computed = hit
            if seq.hits is None:
                seq.hits, seq.joined_at = hit, index
            self._joins += 1
            seq.join_seq = self._joins
            self.waiting.remove(seq)
            self.running.append(seq)
            schedule.append((seq, n))
            joined.append(seq.key)
            hit_tokens += hit
            budget -= n
        return joined, hit_tokens

    def _retire(self, finished: list[Seq]) -> None:
        """Finished sequences leave and release their blocks (static batching: only once the whole batch is done)."""
        if self.static:
            if all(s.stop_reason is not None for s in self.running):
                for s in self.running:
                    self.policy.free(s.key)
                self.running.clear()
            return
        for seq in finished:
            self.running.remove(seq)
            self.policy.free(seq.key)

    def run(self) -> list[Result]:
        for _ in self:
            pass
        return self.results

    # --- pieces ---

    def _seq(self, order: int, req: Request, device) -> Seq:
        buf = TokenBuffer(req.prompt_ids, len(req.prompt_ids) + req.rules.max_new_tokens, device)
        names = chain_hashes(req.prompt_ids, self.policy.block, self.policy.salt) if self.prefix_caching else []
        return Seq(req, order, list(req.prompt_ids), buf, StopChecker(req.rules, req.detok), names)

    def _admissible(self) -> list[Seq]:
        """Waiting sequences in queue order; static batching admits only into an empty batch. A sequence waits
        while the next full block it would compute is being computed by a running prefill (then it hits)."""
        if self.static and self.running:
            return []
        if not self.prefix_caching:
            return list(self.waiting)
        in_flight = {name for s in self.running for name in s.names[s.computed // self.policy.block :]}
        out = []
        for seq in self.waiting:
            hit_blocks = self.policy.match(seq.tokens) // self.policy.block
            if hit_blocks < len(seq.names) and seq.names[hit_blocks] in in_flight:
                continue
            out.append(seq)
            in_flight.update(seq.names[hit_blocks:])
        return out

    def _preempt(self, victim: Seq, schedule: list[tuple[Seq, int]]) -> int:
        """Release the victim's blocks and requeue it at the front; returns the budget it had been given."""
        self.policy.free(victim.key)
        self.running.remove(victim)
        victim.computed = 0
        victim.preemptions += 1
        self.waiting.appendleft(victim)
        given = 0
        for item in list(schedule):
            if item[0] is victim:
                schedule.remove(item)
                given += item[1]
        return given

    def _forward(self, schedule: list[tuple[Seq, int]], index: int) -> tuple[list[Seq], int]:
        """One forward over the scheduled rows; rows that computed their last pending token select the next one.
        Returns the sequences that finished and the number of decode rows."""
        rows = [(s.key, s.tokens[s.computed : s.computed + n]) for s, n in schedule]
        # a decode feeds the newest generated token, everything before it computed (else: prompt or recompute)
        decodes = sum(1 for s, _ in schedule if s.pending == 1 and len(s.tokens) > len(s.req.prompt_ids))
        logits = self._feed_rows(rows)
        for s, n in schedule:
            s.computed += n
            s.fed += n
        picks, host = self._select(schedule, logits)
        finished = []
        for (s, tok), (token_id, finite, logprob, raw_logprob) in zip(picks, host):
            if not finite:  # this request's chain left no candidate: it ends here, the others go on
                s.stop_reason, s.finished_at = EMPTY_CHAIN, index
                finished.append(s)
                continue
            token_id = int(token_id)
            s.new_ids.append(token_id)
            s.steps.append(TokenStep(token_id, logprob, raw_logprob))
            s.tokens.append(token_id)
            s.buf.append([token_id], tok.view(1, 1))
            reason = s.stopper.check(s.new_ids, s.buf.length)
            if reason is not None:
                s.stop_reason, s.finished_at = reason, index
                finished.append(s)
        if self.static:  # a finished row keeps computing (its own last token again) until the batch ends
            for s, _ in schedule:
                if s.stop_reason is not None and not s.pending:
                    s.tokens.append(s.tokens[-1])
        return finished, decodes

    def _feed_rows(self, rows: list[tuple[str, list[int]]]) -> Tensor:
        """[B, V]: every row's last new token. One forward over all rows (left-padded), or, batch-invariant, one
        forward per row at its own shapes (the rows' logits stacked)."""
        if not self.invariant:
            return self.runtime.feed(self.policy.plan(rows))
        return torch.cat([self.runtime.feed(self.policy.plan([row])) for row in rows])

    def _select(self, schedule: list[tuple[Seq, int]], logits: Tensor) -> tuple[list[tuple[Seq, Tensor]], list]:
        """Each row whose last pending token was computed selects its next token with its own chain and selector;
        rows with no stage and a greedy selector (the chain leaves the raw logits as they are) are selected together,
        one argmax and one log-softmax over all of them (row by row these give the same bits: each row is reduced
        on its own). Returns the rows with their token tensors [1], and per row (token, finite, logprob,
        raw_logprob) read in the iteration's one transfer."""
        rows = [(b, s) for b, (s, _) in enumerate(schedule) if not s.pending and s.stop_reason is None]
        if not rows:
            return [], []
        index = torch.tensor([b for b, _ in rows], device=logits.device)
        picked = logits.index_select(0, index)  # [R, V]
        plain = [isinstance(s.req.selector, Greedy) and not s.req.chain.processors for _, s in rows]
        tokens = picked.argmax(dim=-1) if any(plain) else None  # the greedy rows' picks (the others: below)
        processed = picked if all(plain) else picked.to(torch.float32, copy=True)  # a plain row's: its raw logits
        columns, own = [], []
        for i, ((_, s), simple) in enumerate(zip(rows, plain)):
            if simple:
                columns.append(tokens[i : i + 1])
                continue
            sel = select(s.req.chain, s.req.selector, s.buf.prefix(), picked[i : i + 1])
            processed[i] = sel.processed[0]
            columns.append(sel.token[:1])
            own.append((i, sel.finite[:1]))
        token = torch.cat(columns)  # [R]
        finite = torch.isfinite(picked.gather(1, token[:, None])[:, 0])  # a plain row's processed logits are raw
        for i, fin in own:
            finite[i : i + 1] = fin
        raw_logp = chosen_logprobs(picked, token)  # the model's own log-probabilities, every picked row at once
        processed_logp = raw_logp if all(plain) else chosen_logprobs(processed, token)
        host = torch.stack([token.float(), finite.float(), processed_logp, raw_logp],
                           dim=-1).tolist()  # the iteration's one transfer
        return [(s, token[i : i + 1]) for i, (_, s) in enumerate(rows)], host

    def _result(self, s: Seq) -> Result:
        reason, ids = s.stop_reason or "length", list(s.new_ids)
        text = None
        if s.req.detok is not None:
            text = trim_stop(ids, reason, s.req.rules, s.req.detok)[1] if s.req.trim_stop else s.req.detok(ids)
        return Result(s.req.id, s.req.prompt, list(s.req.prompt_ids), list(s.req.chain.names), ids, reason,
                      s.steps, s.hits or 0, s.fed, s.preemptions, s.joined_at, s.finished_at, text)
