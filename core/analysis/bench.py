"""`bench`: tokens/s of decodelab against transformers' `model.generate` with the same settings and token count.

Every pair decodes the same prompt for the same number of new tokens on the same model. The runs alternate in one
process, round after round (one warm-up round first), so drift of the machine affects both sides alike; each side's
figure is the median of its rounds, and ``ratio`` is the median of the per-round paired ratios (decodelab tokens/s
/ transformers tokens/s in the same round), with the lowest and highest of them. Times are end to end: prefill,
loop and (trace on) the trace as `sample -f json` builds it (steps traced in blocks), device-synchronised.

Warm-up, reported apart and in no rate (issue 34): the models' own first-call warm-up first (engine/warmup.py:
``model_warmup_s``), then every run once, untimed by the rounds and each on the one clock: its first call's seconds
(a width, a draft or `generate`'s own first-call costs) are its row's ``decodelab_warmup_s`` /
``transformers_warmup_s``; ``warmup_s`` is all of it.

`generate` is configured as its best users would and fairly: EOS ignored with ``eos_token_id=None`` (decodelab:
``ignore_eos``), no ``min_new_tokens``; sampling with ``top_k=0`` (transformers otherwise adds a top-50 filter the
decodelab chain does not have); beam search with the same beams, length penalty and early stopping; speculative
decoding against assisted generation with the same draft model (``assistant_model``) at each draft length with a
fixed schedule and no confidence cut-off, and its default dynamic schedule too, the best of them reported; the
n-gram proposer against prompt lookup (``prompt_lookup_num_tokens``, ``max_matching_ngram_size`` = our n-gram size).
Greedy outputs of both sides are checked equal before timing (same search, not merely same length).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

from ..engine.reference import hf_generate
from ..engine.run import clock
from ..engine.warmup import rotated, warm_up
from ..engine.stopping import StopRules
from ..errors import ConfigError
from ..methods.beam import BeamSearch, BeamSettings, ModelStepper
from ..methods.sample import REPORT_BLOCK, Sampler, decode_tokens
from ..methods.speculative.proposers import (
    ModelProposer,
    NGramProposer,
    make_selector_for,
)
from ..methods.speculative.run import Speculator
from ..sampling.chain import chain_for
from ..sampling.settings import ChainSettings
from ..sampling.tokens import Tokens

SETTINGS = ("greedy", "sampling", "beam", "speculative", "prompt-lookup")
SAMPLING = {"temperature": 0.8, "top_p": 0.95}
# what each setting's runs decode with (beam scores log-probabilities with no stage)
CHAIN_SETTINGS = {"greedy": ChainSettings(temperature=0), "sampling": ChainSettings(**SAMPLING),
                  "beam": ChainSettings(), "speculative": ChainSettings(temperature=0),
                  "prompt-lookup": ChainSettings(temperature=0)}


def chain_names(setting: str) -> list[str]:
    """The stages of a setting's chain, as its runs build it."""
    return chain_for(CHAIN_SETTINGS[setting], Tokens.placeholder())[1].names


@dataclass
class BenchRow:
    setting: str
    decodelab_tokens_per_s: float  # median over rounds
    transformers_tokens_per_s: float  # median over rounds
    ratio: float  # median of the per-round ratios decodelab / transformers
    ratio_low: float  # the lowest per-round ratio
    ratio_high: float
    tokens: int  # new tokens per run (both sides)
    rounds: int
    note: str = ""
    decodelab_warmup_s: float | None = None  # its run's first, untimed call (in no rate); None: not warmed here
    transformers_warmup_s: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Pairing:
    setting: str
    ours: str  # a run's name
    theirs: str
    note: str = ""


def parse_settings(text: str | None) -> tuple[str, ...]:
    if not text:
        return SETTINGS
    items = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [s for s in items if s not in SETTINGS]
    if bad or not items:
        raise ConfigError(f"--settings {text!r}: allowed: {', '.join(SETTINGS)} (comma-separated)")
    return items


class Bench:
    """Build the runs, check greedy equality, time them interleaved; ``rows()`` pairs them up."""

    def __init__(self, model, prompt_ids: list[int], tokens: int, settings=SETTINGS, draft=None,
                 gammas: tuple[int, ...] = (1, 2, 4, 8), beams: int = 4, ngram_size: int = 3, seed: int = 0):
        if tokens < 2:
            raise ConfigError(f"--max-new-tokens {tokens}: bench needs at least 2 tokens")
        if "speculative" in settings and draft is None:
            raise ConfigError("--draft: the speculative setting needs a draft model (or leave it out of --settings)")
        self.model, self.prompt_ids, self.n, self.settings = model, list(prompt_ids), tokens, settings
        self.draft, self.gammas, self.beams, self.ngram_size, self.seed = draft, gammas, beams, ngram_size, seed
        self.device = next(model.parameters()).device
        self.runs: dict[str, Callable[[], list[int]]] = {}
        self.pairings: list[Pairing] = []
        self.times: dict[str, list[float]] = {}
        self.warmups: dict[str, float] = {}  # run name -> seconds of its first, untimed call (warm)
        self.model_warmup_s = 0.0  # the models' own first-call warm-up (engine/warmup.py), before any run
        self.warmup_s = 0.0  # all of it: the models' and every run's first call
        self.best: dict[str, tuple[str, str]] = {}  # setting -> (our best run, their best run), set after timing
        self.groups: dict[str, tuple[list[str], list[str]]] = {}
        self._build()

    # --- the runs -----------------------------------------------------------------------------------------------

    def _rules(self) -> StopRules:
        return StopRules(self.n, ignore_eos=True)

    def _sampler(self, settings: ChainSettings, trace: bool) -> Callable[[], list[int]]:
        """Our decoding of ``settings``: the chain and the selector as their plan reads them."""
        plan, chain = chain_for(settings, Tokens.placeholder())

        def run():
            selector = plan.make_selector(self.seed, self.device)
            if trace:
                return [s.token_id for s in Sampler(self.model, self.prompt_ids, chain, selector, self._rules(),
                                                    str, None, top=5, block=REPORT_BLOCK)]
            return [d.token_id for d in decode_tokens(self.model, self.prompt_ids, chain, selector, self._rules())]
        return run

    def _generate(self, **kwargs) -> Callable[[], list[int]]:
        return lambda: hf_generate(self.model, self.prompt_ids, self.n, **kwargs)

    def _beam(self, trace: bool) -> Callable[[], list[int]]:
        s = BeamSettings(beams=self.beams, max_new_tokens=self.n, ignore_eos=True, length_penalty=1.0,
                         early_stopping="false")
        chain = chain_for(CHAIN_SETTINGS["beam"], Tokens.placeholder())[1]

        def run():
            search = BeamSearch(ModelStepper(self.model), self.prompt_ids, chain, s, (), record=trace)
            return search.run()[0].token_ids
        return run

    def _speculate(self, proposer_factory, gamma: int, trace: bool) -> Callable[[], list[int]]:
        chain = chain_for(CHAIN_SETTINGS["speculative"], Tokens.placeholder())[1]  # greedy, as prompt-lookup's

        def run():
            spec = Speculator(self.model, proposer_factory(chain), self.prompt_ids, chain, self._rules(), gamma, None,
                              str, None, top=5, record=trace)
            for _ in spec:
                pass
            return list(spec.new_ids)
        return run

    def _add(self, setting: str, ours: str, ours_fn, theirs: str, theirs_fn, note: str = "") -> None:
        self.runs.setdefault(ours, ours_fn)
        self.runs.setdefault(theirs, theirs_fn)
        self.pairings.append(Pairing(setting, ours, theirs, note))

    def _build(self) -> None:
        if "greedy" in self.settings:
            gen = self._generate(do_sample=False)
            self._add("greedy, trace on", "ours greedy trace", self._sampler(CHAIN_SETTINGS["greedy"], True),
                      "generate greedy", gen)
            self._add("greedy, trace off", "ours greedy", self._sampler(CHAIN_SETTINGS["greedy"], False),
                      "generate greedy", gen)
        if "sampling" in self.settings:
            gen = self._generate(do_sample=True, top_k=0, **SAMPLING)
            sampling = CHAIN_SETTINGS["sampling"]
            self._add("sampling t=0.8 top-p=0.95, trace on", "ours sampling trace", self._sampler(sampling, True),
                      "generate sampling", gen)
            self._add("sampling t=0.8 top-p=0.95, trace off", "ours sampling", self._sampler(sampling, False),
                      "generate sampling", gen)
        if "beam" in self.settings:
            gen = self._generate(num_beams=self.beams, do_sample=False, length_penalty=1.0, early_stopping=False)
            self._add(f"beam {self.beams}, trace on", "ours beam trace", self._beam(True), "generate beam", gen)
            self._add(f"beam {self.beams}, trace off", "ours beam", self._beam(False), "generate beam", gen)
        if "speculative" in self.settings:
            ours, theirs = [], []
            draft = self.draft
            factory = lambda chain: ModelProposer(draft, chain, make_selector_for(True, None))  # noqa: E731
            for g in self.gammas:
                gen = self._generate(do_sample=False, assistant_model=draft, num_assistant_tokens=g,
                                     num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)
                self._add(f"speculative draft gamma={g}, trace off", f"ours draft g={g}",
                          self._speculate(factory, g, False), f"assisted g={g}", gen)
                ours.append(f"ours draft g={g}")
                theirs.append(f"assisted g={g}")
            self.runs["assisted default"] = self._generate(do_sample=False, assistant_model=draft)
            theirs.append("assisted default")
            self.groups["speculative draft: best vs best"] = (ours, theirs)
        if "prompt-lookup" in self.settings:
            ours, theirs = [], []
            factory = lambda chain: NGramProposer(self.ngram_size)  # noqa: E731
            for g in self.gammas:
                gen = self._generate(do_sample=False, prompt_lookup_num_tokens=g,
                                     max_matching_ngram_size=self.ngram_size)
                self._add(f"prompt lookup gamma={g}, trace off", f"ours ngram g={g}",
                          self._speculate(factory, g, False), f"lookup g={g}", gen)
                ours.append(f"ours ngram g={g}")
                theirs.append(f"lookup g={g}")
            self.groups["prompt lookup: best vs best"] = (ours, theirs)

    # --- checking and timing -------------------------------------------------------------------------------------

    def check(self) -> dict[str, list[int]]:
        """Every run once (the warm-up): the right token count, and every greedy run (everything but sampling)
        equal to `generate`'s greedy output and to each other (beam: to `generate(num_beams)`)."""
        return self.verify({name: fn() for name, fn in self.runs.items()})

    def warm(self) -> dict[str, list[int]]:
        """The models' own warm-up (``model_warmup_s``), then every run once, each call on the one clock (its
        seconds in ``warmups``); the outputs, for :meth:`verify`."""
        self.model_warmup_s = sum(warm_up(m) for m in (self.model, self.draft) if m is not None)
        outputs = {}
        for name, fn in self.runs.items():
            start = clock(self.device)
            outputs[name] = fn()
            self.warmups[name] = clock(self.device) - start
        self.warmup_s = self.model_warmup_s + sum(self.warmups.values())
        return outputs

    def verify(self, outputs: dict[str, list[int]]) -> dict[str, list[int]]:
        """The checks of :meth:`check` on every run's output."""
        for name, ids in outputs.items():
            if len(ids) != self.n:
                raise RuntimeError(f"bench: {name} produced {len(ids)} tokens, not {self.n}")
        greedy = [n for n in outputs if "sampling" not in n and "beam" not in n]
        if greedy:
            ref = outputs[greedy[0]]
            for name in greedy:
                if outputs[name] != ref:
                    raise RuntimeError(f"bench: greedy outputs differ ({name} vs {greedy[0]}); not the same search")
        if "ours beam" in outputs and outputs["ours beam"] != outputs["generate beam"]:
            raise RuntimeError("bench: decodelab's beam search and generate(num_beams) disagree")
        return outputs

    def time(self, rounds: int, on_round: Callable[[int], None] | None = None) -> None:
        """:meth:`warm` (every run's untimed warm-up, each timed apart) and :meth:`verify`; then ``rounds`` rounds,
        the order rotated each round (engine/warmup.py's rule: whichever runs first pays no more than the others),
        each run timed on the one clock."""
        self.verify(self.warm())
        self.times = {name: [] for name in self.runs}
        names = list(self.runs)
        for r in range(rounds):
            for name in rotated(names, r):
                start = clock(self.device)
                self.runs[name]()
                self.times[name].append(clock(self.device) - start)
            if on_round is not None:
                on_round(r)

    def keep_whole_rounds(self) -> int:
        """After an interrupt: drop the times of a round cut half-way; returns how many whole rounds are left."""
        times = getattr(self, "times", {})
        done = min((len(t) for t in times.values()), default=0)
        for t in times.values():
            del t[done:]
        return done

    def tps(self, name: str) -> float:
        return self.n / statistics.median(self.times[name])

    def _row(self, setting: str, ours: str, theirs: str, note: str = "") -> BenchRow:
        ratios = [t / o for o, t in zip(self.times[ours], self.times[theirs])]  # time ratio = tokens/s ratio
        return BenchRow(setting, self.tps(ours), self.tps(theirs), statistics.median(ratios), min(ratios),
                        max(ratios), self.n, len(ratios), note, self.warmups.get(ours), self.warmups.get(theirs))

    def rows(self) -> list[BenchRow]:
        out = [self._row(p.setting, p.ours, p.theirs, p.note) for p in self.pairings]
        for setting, (ours, theirs) in self.groups.items():
            best_ours = max(ours, key=self.tps)
            best_theirs = max(theirs, key=self.tps)
            out.append(self._row(setting, best_ours, best_theirs, f"{best_ours} vs {best_theirs}"))
        return out


def bench_summary(rows: list[BenchRow], stop_reason: str, warm: dict | None = None) -> dict:
    """The ratios over every row: decodelab's tokens/s over transformers' (median per row), least and most; and
    ``warm``, the warm-up's seconds (:func:`warm_summary`)."""
    ratios = [r.ratio for r in rows]
    return {"rows": len(rows), "stop_reason": stop_reason, **(warm or {}),
            "min_ratio": min(ratios) if ratios else None, "max_ratio": max(ratios) if ratios else None,
            "geomean_ratio": math.exp(sum(math.log(x) for x in ratios) / len(ratios)) if ratios else None}


def warm_summary(bench: Bench) -> dict:
    """The warm-up apart from every rate: the models' own first calls and all of it (theirs and every run's)."""
    return {"warmup_s": bench.warmup_s, "model_warmup_s": bench.model_warmup_s}


def bench_document(lm, config: dict, chosen: tuple[str, ...], text: str, prompt_ids: list[int], rows: list[BenchRow],
                   stop_reason: str, warm: dict | None = None) -> dict:
    """``bench``'s JSON document: the model, the run's options (``config``), each setting's stages, the rows and
    their summary (with ``warm``: :func:`warm_summary`)."""
    return {"command": "bench", "model": lm.name, "device": str(lm.device),
            "dtype": str(lm.dtype).replace("torch.", ""), "config": config,
            "chain": list(dict.fromkeys(stage for name in chosen for stage in chain_names(name))),
            "chains": {name: chain_names(name) for name in chosen},
            "prompt": {"text": text, "token_ids": prompt_ids}, "rows": rows, "stop_reason": stop_reason,
            "summary": bench_summary(rows, stop_reason, warm)}
