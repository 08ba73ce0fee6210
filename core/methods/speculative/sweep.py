"""`speculate --sweep-gamma`: each gamma timed against plain decoding on the same prompt, the best one named, and the
run a command shows made with it (the sweep runs first, so the shown run is the gamma the sweep names best, and its
timing rounds are the sweep's own for that gamma)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ...engine.models import LoadedModel
from ...sampling.chain import Chain
from .run import SpeculateSettings, SpeculativeSummary, SpeedupRounds, best_gamma
from .timing import SpeedupRound


def call(fn: Callable[[], object]):
    return fn()


def never() -> bool:
    return False


def quiet(message: str) -> None:
    pass


@dataclass
class GammaSweep:
    """The sweep's rows (one summary per gamma timed), the timing rounds of each, and the best gamma (the highest
    measured speedup; None without a row)."""

    rows: list[SpeculativeSummary] = field(default_factory=list)
    measured: dict[int, list[SpeedupRound]] = field(default_factory=dict)

    @property
    def best(self) -> int | None:
        return best_gamma(self.rows) if self.rows else None

    def shown_gamma(self, settings: SpeculateSettings) -> int:
        """The gamma of the run to show: the best of the sweep, else the settings' own."""
        return self.best if self.best is not None else settings.gamma

    def document_part(self) -> dict:
        """``sweep`` and ``best_gamma`` of the JSON document (absent without a sweep row)."""
        return {"sweep": [r.to_dict() for r in self.rows], "best_gamma": self.best} if self.rows else {}


def sweep_gammas(lm: LoadedModel, draft: LoadedModel | None, settings: SpeculateSettings, prompt_ids: list[int],
                 chain: Chain, guard: Callable[[Callable[[], object]], object] = call,
                 stopped: Callable[[], bool] = never, progress: Callable[[str], None] = quiet) -> GammaSweep:
    """Time every gamma of ``settings.sweep_gamma`` (``settings.speedup_rounds`` rounds each). ``guard(fn)`` runs
    one gamma's timing (a caller's interrupt handling: a Ctrl-C keeps the rounds completed); once ``stopped()``, no
    further gamma starts; a gamma cut before its first round completed has no row."""
    out = GammaSweep()
    gammas = [int(x) for x in settings.sweep_gamma]
    for k, g in enumerate(gammas):
        if stopped():
            break  # the rows measured so far are kept
        progress(f"speculate: timing gamma {g} ({k + 1}/{len(gammas)}, {settings.speedup_rounds} rounds each)")
        row = SpeedupRounds(lm, draft, settings, prompt_ids, chain, g)
        guard(row.run)
        if row.rounds:
            out.rows.append(row.first.summary(row.rounds))
            out.measured[g] = row.rounds
    return out
