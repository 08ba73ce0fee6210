"""Runs that should agree: where one parts from the other, the noise verdict there (:mod:`.noise`), as a part of
the run's own document. Greedy samples of one prompt (``sample -N`` at a greedy plan) should all be sample 0; a
greedy request's baseline tokens (``batch --baselines``) should be the iteration-level run's. Where they part, the
verdict says whether the two top logits there are within the dtype's rounding floor (noise) or not (a bug).

Whether a run is greedy is the semantics plan's decision (:func:`~..sampling.semantics.plan`), never re-derived.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.run import Origin
from ..engine.stopping import stop_rules
from ..methods import many
from ..methods.many import SampleRow, SpreadSummary, many_document
from ..sampling.chain import Chain, make_chain, refuse_stepwise_stages
from ..sampling.semantics import plan, trims_stop
from ..settings import as_dict
from .noise import VERDICT_LIMIT, divergence_verdicts


def greedy_noise(lm, settings, prompt_ids: list[int], rows: list[SampleRow], chain: Chain) -> list[dict]:
    """Greedy samples should all be sample 0: where one parts from it, the noise verdict there (none for a plan
    that samples, or when every sample agrees)."""
    if not plan(settings).greedy or len({tuple(r.token_ids) for r in rows}) < 2:
        return []
    return divergence_verdicts(lm, prompt_ids, rows[0].token_ids, [(f"sample {r.index}", r.token_ids)
                                                                   for r in rows[1:]], chain)


@dataclass
class ManySamples:
    """``sample -N``'s report: N samples of one prompt (sample i with seed + i), their spread, and where greedy
    samples part, the noise verdicts; ``document()`` is the command's JSON document."""

    origin: Origin
    rows: list[SampleRow]
    spread: SpreadSummary
    selector: str
    chain: list[str]  # the stage names, in order
    noise: list[dict]

    def document(self) -> dict:
        return many_document(self.origin, self.rows, self.spread, self.selector, self.noise)


def sample_many_report(lm, settings, prompt_text: str, prompt_ids: list[int], n: int) -> ManySamples:
    """Draw the N samples (batched when the cache holds rows) with the plan's selector and the settings' chain
    (a stage that keeps state across steps is refused), then the noise verdicts where greedy samples part."""
    chain = make_chain(lm, settings)
    refuse_stepwise_stages(chain, "sample -N")
    selector = plan(settings).selector
    rows, spread = many.sample_many(lm.model, prompt_ids, chain, selector, settings.seed, n, stop_rules(lm, settings),
                                    lm.decode, lm.token_text, settings.cache_spec, trim=trims_stop(settings))
    origin = Origin.of("sample", lm, as_dict(settings), chain.names, prompt_text, prompt_ids)
    return ManySamples(origin, rows, spread, selector, chain.names,
                       greedy_noise(lm, settings, prompt_ids, rows, chain))


def baseline_noise(run) -> list[dict]:
    """A batch run (:class:`~..methods.batch.run.BatchRun`) whose baselines ran: each greedy request whose baseline
    tokens part from the iteration-level run's gets the noise verdict at the first step they part, for the first
    few (``VERDICT_LIMIT``). Kept on the run (``run.noise``), part of its document."""
    report = run.report()
    out: list[dict] = []
    for b in report.baselines:
        for e, r, ids in zip(run.entries, report.results, b.outputs):
            if plan(e.settings).greedy and list(ids) != r.new_ids and len(out) < VERDICT_LIMIT:
                out += [{"request": r.id, **v} for v in divergence_verdicts(
                    run.lm, r.prompt_ids, r.new_ids, [(b.name, list(ids))], make_chain(run.lm, e.settings))]
    run.noise = out
    return out
