"""The run contract: what every method's run reports, and one meaning of each timing figure.

A run is an iterator of steps (tokens, beam steps, verification rounds, scored chunks); afterwards ``stop_reason``,
``interrupted``, ``new_ids`` and ``summary()`` describe it. Time is split three ways by one :class:`Stopwatch`, which
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
from collections.abc import Callable
from dataclasses import dataclass

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


class Run:
    """Base of every method's run: the stop reason, the interrupt and the delivered text. Each method's run also has
    ``new_ids`` (the generated ids, an attribute or a property), ``rules`` (its :class:`~.stopping.StopRules`) and
    ``summary()`` (its summary record); its builder sets ``trim_stop`` from the settings."""

    stop_reason: str = "length"
    interrupted: bool = False
    trim_stop: bool = False  # deliver the text without what stopped the run (--trim-stop, or the engine's reading)

    def delivered(self, decode: Callable[[list[int]], str], ids: list[int] | None = None) -> tuple[list[int], str]:
        """The ids and text this run delivers: ``ids`` (default ``new_ids``) decoded; with ``trim_stop``, a stop id
        dropped from both and a stop string cut from the text (:func:`~.stopping.trim_stop`)."""
        ids = list(self.new_ids if ids is None else ids)
        if self.trim_stop:
            return trim_stop(ids, self.stop_reason, self.rules, decode)
        return ids, decode(ids)

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
