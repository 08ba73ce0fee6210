"""The run contract (:class:`Run`, declared as a protocol), the document head every run's JSON shares
(:class:`Origin`), and one meaning of each timing figure.

A run is an iterator of steps (tokens, beam steps, verification rounds, scored chunks). Time is split three ways by one :class:`Stopwatch`, which
waits for the device before it reads the clock (queued GPU work counts where it was queued), and never counts the
time a consumer spends between two steps (printing, say):

* ``prefill_s``: the forward over the prompt;
* ``loop_s``: everything else the method does to produce tokens (chain, selector, decode forwards, stop checks);
* ``trace_s``: building the trace (statistics, their transfer to the host, token texts).

``tokens_per_s`` = new tokens / (prefill_s + loop_s + trace_s): end to end. ``decode_tokens_per_s`` = new tokens /
loop_s: the decoding loop alone, what a benchmark against another loop compares.

Neither counts warm-up: ``warmup_s`` (first-call costs of a model in this process, paid before the stopwatch
starts: :func:`decodelab.core.engine.warmup.warm_up`) and ``compile_s`` (the first call of a ``--compile``d step:
tracing, code generation, autotuning) are reported on their own. :func:`clock` is the one clock every timing in
core reads: it waits for the device first, so on CUDA a reading counts the work queued before it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..errors import EMPTY_CHAIN, ChainError
from .stopping import trim_stop


def synchronize(device) -> None:
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type  # no new device per lap
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "mps":
        torch.mps.synchronize()


def clock(device) -> float:
    """Seconds on the one clock of every timing: ``time.perf_counter`` after the device's queued work is done."""
    synchronize(device)
    return time.perf_counter()


class Stopwatch:
    """Accumulates device-synchronised laps into named buckets; ``pause()`` drops the time since the last lap."""

    def __init__(self, device):
        self.device = device
        self.timing = Timing()
        self._last = None

    def start(self) -> None:
        self._last = clock(self.device)

    def lap(self, bucket: str) -> None:
        """Add the time since the previous lap (or start) to ``bucket``: prefill, loop or trace."""
        now = clock(self.device)
        if self._last is not None:
            setattr(self.timing, bucket + "_s", getattr(self.timing, bucket + "_s") + now - self._last)
        self._last = now

    def set_aside(self, bucket: str, seconds: float, into: str) -> None:
        """Move ``seconds`` measured inside ``bucket``'s running lap (a first compiled call, say) to ``into``
        (``warmup`` or ``compile``): the next lap of ``bucket`` still adds the whole time, less this."""
        setattr(self.timing, bucket + "_s", getattr(self.timing, bucket + "_s") - seconds)
        setattr(self.timing, into + "_s", (getattr(self.timing, into + "_s") or 0.0) + seconds)

    def pause(self) -> None:
        """Stop counting (before a step is handed to the consumer)."""
        self._last = None

    resume = start


@dataclass
class Timing:
    prefill_s: float = 0.0
    loop_s: float = 0.0
    trace_s: float = 0.0
    warmup_s: float = 0.0  # first-call costs paid before the timed part (in no other bucket)
    compile_s: float | None = None  # the first compiled call (--compile; None: nothing compiled), in no other bucket

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.loop_s + self.trace_s

    def tokens_per_s(self, tokens: int) -> float:
        return tokens / self.total_s if self.total_s > 0 else float("nan")

    def decode_tokens_per_s(self, tokens: int) -> float:
        return tokens / self.loop_s if self.loop_s > 0 else float("nan")


@dataclass(frozen=True)
class Origin:
    """What a run was made of: the top level every command's JSON document shares (docs/json.md, the shared top level)."""

    command: str
    model: str
    device: str
    dtype: str
    config: dict  # the resolved settings
    chain: list[str]  # the stage names, in order
    prompt_text: str
    prompt_ids: list[int]

    @classmethod
    def of(cls, command: str, lm, config: dict, chain: list[str], prompt_text: str, prompt_ids: list[int]) -> Origin:
        """From a loaded model (anything with ``name``, ``device`` and ``dtype``)."""
        return cls(command, lm.name, str(lm.device), str(lm.dtype).replace("torch.", ""), config, chain, prompt_text,
                   prompt_ids)

    def head(self, **rest) -> dict:
        """The document's shared top level, in its order; ``rest``: the command's own fields that follow it."""
        return {"command": self.command, "model": self.model, "device": self.device, "dtype": self.dtype,
                "config": self.config, "chain": self.chain,
                "prompt": {"text": self.prompt_text, "token_ids": self.prompt_ids}, **rest}


def head(command: str, lm, config: dict, chain: list[str], prompt_text: str, prompt_ids: list[int], **rest) -> dict:
    """The document head of a run made of these parts (commands whose report is not a run yet use it alone)."""
    return Origin.of(command, lm, config, chain, prompt_text, prompt_ids).head(**rest)


@runtime_checkable
class Run(Protocol):
    """The contract of every method's run, and the base its runs inherit the shared parts from.

    * iterate it for its steps (a generator: a consumer streams them; an interrupted run keeps what it produced);
    * ``stop_reason`` (why it ended) and ``interrupted``;
    * ``new_ids``: the token ids it generated (none for a run that scores given text);
    * ``text()``: the text it delivers (what a command prints and ``compare`` sets side by side);
    * ``summary()``: its summary record;
    * ``document()``: its whole JSON document (:class:`Origin`'s head, then the method's own fields), built in core
      so that every caller (the CLI, a script) reports the same run the same way.

    ``interrupt()``, ``end(reason)`` and ``delivered()`` are inherited. A method's build sets ``origin`` (the
    head), ``decode`` (ids -> text) and ``trim_stop`` from the settings; a run that trims has ``rules`` (its
    :class:`~.stopping.StopRules`)."""

    stop_reason: str = "length"
    interrupted: bool = False
    trim_stop: bool = False  # deliver the text without what stopped the run (--trim-stop, or the engine's reading)
    origin: Origin | None = None
    decode: Callable[[list[int]], str] | None = None

    def __iter__(self) -> Iterator: ...

    @property
    def new_ids(self) -> list[int]: ...

    def text(self) -> str:
        """The text it delivers (:meth:`delivered`; a method that picks among outputs says so in its own)."""
        return self.delivered(self.decode)[1] if self.decode is not None else ""

    def delivered(self, decode: Callable[[list[int]], str], ids: list[int] | None = None) -> tuple[list[int], str]:
        """The ids and text this run delivers: ``ids`` (default ``new_ids``) decoded; with ``trim_stop``, a stop id
        dropped from both and a stop string cut from the text (:func:`~.stopping.trim_stop`)."""
        ids = list(self.new_ids if ids is None else ids)
        if self.trim_stop:
            return trim_stop(ids, self.stop_reason, self.rules, decode)
        return ids, decode(ids)

    def summary(self): ...

    def document(self) -> dict:
        """Each method's own: ``origin.head(...)``, then its steps, text, token_ids, summary and its own fields."""
        raise NotImplementedError(f"{type(self).__name__} has no document()")

    def interrupt(self) -> None:
        """Called when the consumer was interrupted (Ctrl-C): what was produced stays, the reason says why."""
        self.interrupted = True
        self.stop_reason = "interrupted"

    def end(self, reason: str) -> None:
        """The run was cut short for ``reason`` (EMPTY_CHAIN): what was produced stays, the reason says why."""
        self.stop_reason = reason


def drain(run) -> list:
    """Iterate ``run`` to its end; a chain that leaves no candidate ends it early with stop_reason EMPTY_CHAIN,
    keeping the steps produced (for callers that report many runs, where one empty chain must not lose the others)."""
    steps = []
    try:
        for step in run:
            steps.append(step)
    except ChainError:
        run.end(EMPTY_CHAIN)
    return steps
