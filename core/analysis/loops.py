"""Why a run looped: the loop's period and count (the repetition stop's rule, :mod:`..engine.loops`), and at each
position that repeated the loop, whether the model itself continued it or a stage of the chain did.

At a repeated position i (a token of the second copy or later), with c the loop's token, the breakers are the tokens
the model ranks above c (raw logit z_t > z_c): any of them would have broken the loop, and the model preferred each.
Replaying the chain on the position's prefix (one forward of the whole sequence, then the chain per position; a
pure function of the prefix, as every stage is) gives, per breaker, the first stage that removed it (logit -inf).
The position's keeper is:

* ``model``: c is the model's own most likely token (no breaker; no stage needed to keep the loop);
* a stage name: the first stage after which c outranks the model's most likely token, by removing it (a mask, a
  filter) or by re-scoring (a penalty, a bias);
* ``draw``: no stage put c first; the sampler's draw picked it below the most likely token.

A constraint mask that keeps a loop shows as keeper ``constraint`` with the breakers it removed (vllm#40080); a
penalty cannot keep a loop by removal, only by re-scoring. For a sampled run the keeper is read against the model's
most likely token, not the draw (the draw's noise is not replayed).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import torch

from ..engine.forward import forward
from ..engine.loops import RepetitionRule, copies
from ..methods.branch import Branched
from ..sampling.chain import make_chain
from ..sampling.registry import BY_NAME

BREAKERS_LISTED = 5  # per position, the strongest breakers named in the report


@dataclass
class LoopPosition:
    index: int  # among generated tokens
    token_id: int  # the loop's token c
    raw_top: int  # the model's most likely token
    kept_by: str  # "model" or the stage (module doc)
    breakers: int  # tokens the model ranked above c
    removed_by: dict[str, int] = field(default_factory=dict)  # stage -> breakers it removed
    strongest: list[tuple[int, str | None]] = field(default_factory=list)  # (breaker, stage that removed it)


@dataclass
class LoopReport:
    period: int
    count: int  # whole copies ending the output
    start: int  # index (among generated tokens) of the first copy
    pattern: list[int]
    positions: list[LoopPosition]
    kept_by: dict[str, int]  # keeper -> repeated positions it kept
    stages_acted: dict[str, int]  # stage -> repeated positions where it changed any logit
    note: str | None = None  # why the replay may differ from the run (a stage with its own state or coin)

    def to_dict(self) -> dict:
        return asdict(self)


def loop_of(generated: list[int], rule: RepetitionRule) -> tuple[int, int] | None:
    """(period, whole copies) of the loop the rule finds at the end of ``generated``, or None."""
    period = rule.period(generated)
    return None if period is None else (period, copies(generated, period))


def attribute(lm, settings, prompt_ids: list[int], generated: list[int], rule: RepetitionRule) -> LoopReport | None:
    """The loop at the end of ``generated`` and who kept it (module doc); None when the rule finds no loop."""
    found = loop_of(generated, rule)
    if found is None:
        return None
    period, count = found
    start = len(generated) - period * count
    row = list(prompt_ids) + list(generated)
    ids = torch.tensor([row], device=lm.device)
    logits = forward(lm.model, ids, logits_to_keep=0)[0]  # [T, V]; position t predicts token t + 1
    chain = make_chain(lm, settings)
    chain.reset(len(prompt_ids))
    positions, acted = [], Counter()
    for i in range(start + period, len(generated)):
        at = len(prompt_ids) + i
        _, stages = chain.run_recorded(ids[:, :at], logits[at - 1].unsqueeze(0))
        positions.append(_position(i, generated[i], stages, acted))
    kept = Counter(p.kept_by for p in positions)
    stateful = [n for n in chain.names if "state" in BY_NAME[n].needs]
    note = (f"stages with state or a coin of their own ({', '.join(stateful)}) are replayed fresh: their numbers at "
            "the repeated positions are not the run's") if stateful else None
    return LoopReport(period, count, start, list(generated[-period:]), positions, dict(kept), dict(acted), note)


def explain(run, lm) -> dict:
    """A ``sample`` run (:class:`~..methods.sample.Sampler`) that the repetition stop ended: its loop and who kept
    it (:func:`attribute`; null when the rule finds none) as ``{"loop": ...}``, kept on the run (``loop_part``, part
    of its document: a forced or resumed run's is the wrapped run's); ``{}`` for a run that ended otherwise."""
    part = {}
    if run.stop_reason == "repetition":
        report = attribute(lm, run.settings, run.prompt_ids, run.new_ids, run.rules.repetition)
        part = {"loop": report.to_dict() if report is not None else None}
    (run.run if isinstance(run, Branched) else run).loop_part = part
    return part


def _position(index: int, c: int, stages: list, acted: Counter) -> LoopPosition:
    raw = stages[0][1][0].float()
    top = int(raw.argmax())
    breakers = (raw > raw[c]).nonzero().flatten()
    removed_by: Counter = Counter()
    first_removal = {}
    for (name, z), (_, before) in zip(stages[1:], stages[:-1]):
        z, before = z[0].float(), before[0].float()
        if not torch.equal(z, before):
            acted[name] += 1
        gone = torch.isneginf(z[breakers]) & ~torch.isneginf(before[breakers])
        for b in breakers[gone].tolist():
            first_removal.setdefault(b, name)
            removed_by[name] += 1
    kept_by = "model"
    if top != c:
        kept_by = next((name for name, z in stages[1:] if bool(torch.isneginf(z[0][top])) or z[0][c] > z[0][top]),
                       "draw")
    order = breakers[raw[breakers].argsort(descending=True)][:BREAKERS_LISTED].tolist()
    return LoopPosition(index, c, top, kept_by, int(breakers.numel()), dict(removed_by),
                        [(b, first_removal.get(b)) for b in order])
