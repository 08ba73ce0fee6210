"""`stream`'s analysis modes, each with its JSON document built here: every bounded policy side by side on one text
(``--compare-policies``), the retrieval probe under one policy (``--probe``), and the attention-sink diagnosis
(``--attention``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

from ..engine.forward import model_info
from ..engine.run import Origin
from ..methods.stream import StreamSettings, compare_policies, probe_depths
from ..sampling.chain import Chain
from ..settings import as_dict
from .attention import attention_profile
from ..engine.models import TRAINED_CONTEXT
from .policies import policy_row, rank_basis, ranked
from .probe import Prober, ProbeSettings


def origin(lm, settings: StreamSettings, chain: Chain, text: str, ids: list[int]) -> Origin:
    return Origin.of("stream", lm, as_dict(settings), chain.names, text, ids)


def make_prober(lm, settings: StreamSettings, ids: list[int]) -> Prober:
    """The probe over the text ``ids`` (fitted to the model's context), keys and depths from the settings."""
    probe = ProbeSettings(keys=settings.probe_keys, depths=probe_depths(settings), seed=settings.seed)
    return Prober(lm.model, lm.tokenizer, ids, probe, lm.context_length)


class PolicyComparison:
    """``--compare-policies``: each policy of the settings scores the text in turn (``drive(run, label)`` iterates
    one: a caller's progress and interrupt handling; an interrupted run ends the comparison), ranked against the
    full cache, probed when asked."""

    def __init__(self, lm, settings: StreamSettings, text: str, ids: list[int], chain: Chain):
        self.lm, self.settings, self.ids, self.chain = lm, settings, ids, chain
        self.origin = origin(lm, settings, chain, text, ids)
        self.prober = make_prober(lm, settings, ids) if settings.probe else None
        self.results: list[dict] = []
        self.rows: list = []
        self.by = "kl_vs_full"  # what the ranking is by (set by run)

    def run(self, drive: Callable[[object, str], None]) -> PolicyComparison:
        lm = self.lm
        for label, run in compare_policies(lm.model, self.ids, self.chain, lm.token_text, self.settings,
                                           model_info(lm.model)):
            if isinstance(run, str):
                self.results.append({"label": label, "skipped": run})
                continue
            drive(run, label)
            self.results.append({"label": label, "spec": str(run.spec), "summary": run.summary()})
            if run.interrupted:
                break
            if self.prober is not None:
                self.results[-1]["probe"] = self.prober.policy(run.spec, label)
        results = self.results
        full_bytes = next((r["summary"].kv_bytes_peak for r in results if r["label"] == "full" and "summary" in r),
                          0)
        self.by = rank_basis(len(self.ids) - 1, self.trained_context())
        self.rows = ranked([policy_row(r["label"], r["summary"], full_bytes, r.get("probe")) for r in results
                            if "summary" in r], self.by)
        for r in results:
            r["rank"] = next((row.rank for row in self.rows if row.label == r["label"]), None)
            if "probe" in r:
                r["probe"] = {k: v for k, v in asdict(r["probe"]).items() if k != "results"}
        return self

    def trained_context(self) -> int | None:
        """The context the model was trained on (the bundled models': shorter than their position table)."""
        return TRAINED_CONTEXT.get(self.lm.name, self.lm.context_length)

    def summary(self) -> dict:
        return {"tokens": len(self.ids) - 1, "context_length": self.lm.context_length}

    def document(self) -> dict:
        extra = {"probe": self.prober.report([]).document()} if self.prober is not None else {}
        return self.origin.head(mode="compare", policies=self.results, ranking=self.rows, ranked_by=self.by, **extra,
                                steps=[],
                                text="", token_ids=[], summary=self.summary())


def probe_document(lm, settings: StreamSettings, text: str, ids: list[int], chain: Chain, prober: Prober):
    """``--probe`` under ``--cache``: every trial under the full cache, the policy, and the full cache without the
    needle. Returns the document and the probe's report."""
    report = prober.report([settings.cache_spec], [settings.cache])
    summary = {**report.summary(), "policy": str(settings.cache_spec), "tokens": prober.filler_tokens}
    document = origin(lm, settings, chain, text, ids).head(mode="probe", probe=report.document(), steps=[], text="",
                                                           token_ids=[], summary=summary)
    return document, report


def attention_document(lm, settings: StreamSettings, text: str, chain: Chain) -> dict:
    """``--attention``: per layer and head, the attention the late queries give the first ``sinks`` positions;
    the summary names the strongest head (its ``tokens``, ``late_from`` and ``sinks`` say what was measured)."""
    ids = lm.encode(text)[: settings.limit]
    rows, meta = attention_profile(lm.model, ids, settings.sinks, lm.context_length)
    strongest = max(rows, key=lambda r: r.ratio)
    summary = {**meta, "max_ratio": strongest.ratio, "max_layer": strongest.layer, "max_head": strongest.head,
               "mean_ratio": sum(r.ratio for r in rows) / len(rows)}
    return origin(lm, settings, chain, text, ids[: meta["tokens"]]).head(mode="attention", attention=rows, steps=[],
                                                                         text="", token_ids=[], summary=summary)
