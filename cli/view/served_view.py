"""Tables for runs on a served engine and for check-logprobs: every number's column says what it is (raw or
processed, the server's or the local model's, top-N truncated)."""

from __future__ import annotations

from rich.table import Table

from .render import fmt_p, one_line, show_token

ROWS = 200  # rows a terminal table shows (json/jsonl/csv carry every one)


def _p(value) -> str:
    return "-" if value is None else fmt_p(value)


def _f(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def sample_table(steps, title: str, values: str, raw_from: str | None, top: int) -> Table:
    """sample --engine: per token the processed p (the server's, in processed mode), the raw p and rank, and the
    server's top alternatives."""
    table = Table(title=title, header_style="bold")
    for name in ("step", "token", "p (processed)", "raw p", "raw rank", f"top {top} (truncated)"):
        table.add_column(name, justify="left" if name in ("token", f"top {top} (truncated)") else "right",
                         no_wrap=name != f"top {top} (truncated)")
    for s in steps[:ROWS]:
        alts = " ".join(f"{show_token(a.token)}:{_p(a.prob if values == 'processed' else a.raw_prob)}"
                        for a in s.alternatives[:top])
        table.add_row(str(s.index), show_token(s.token), _p(s.prob), _p(s.raw_prob), _f(s.raw_rank, "d"), alts)
    table.caption = (f"the server returned {values} logprobs; raw: "
                     + {"generation": "the generation's own", "replay": "the server's replay of prompt + output "
                        "(prompt logprobs)", None: "not available"}[raw_from]
                     + f"; alternatives: the server's top {top} in its {values} values")
    return table


def score_table(steps, title: str, top: int) -> Table:
    table = Table(title=title, header_style="bold")
    for name in ("pos", "token", "raw logp", "raw rank", "tail mass", f"top {top} (truncated)"):
        table.add_column(name, justify="left" if name in ("token", f"top {top} (truncated)") else "right",
                         no_wrap=name != f"top {top} (truncated)")
    for r in steps[:ROWS]:
        table.add_row(str(r.position), show_token(r.token), f"{r.raw_logprob:.3f}", _f(r.raw_rank, "d"),
                      _f(r.tail_mass, ".3g"),
                      " ".join(f"{show_token(a.token)}:{a.raw_logprob:.2f}" for a in r.alternatives[:top]))
    table.caption = (f"first {ROWS} of {len(steps)} tokens (-f json for all)" if len(steps) > ROWS else
                     "raw: the server's prompt logprobs (raw in every --logprobs-mode); tail mass: 1 - the listed "
                     "probabilities, an upper bound on any unlisted token")
    return table


def check_table(rows, title: str) -> Table:
    """check-logprobs: the engine's number, the local raw one, the label and what is left once it explains it."""
    table = Table(title=title, header_style="bold")
    for name in ("ans", "step", "token", "engine logp", "local raw logp", "label", "|engine - label|", "how"):
        table.add_column(name, justify="left" if name in ("token", "label", "how") else "right", no_wrap=True)
    for r in rows[:ROWS]:
        label = r.label + (" (= raw)" if r.ambiguous and r.label != "raw" else "")
        table.add_row(str(r.answer), str(r.index), show_token(r.token or ""), _f(r.engine_logprob, ".4f"),
                      _f(r.local_raw_logprob, ".4f"), label, _f(r.error, ".1e"), ", ".join(r.transforms))
    table.caption = (f"first {ROWS} of {len(rows)} tokens (-f json for all)" if len(rows) > ROWS else
                     "label: what the engine's number is, recomputed here on the same model")
    return table


def figures_table(summary: dict) -> Table:
    table = Table(title="the figures trainers watch (ratio = exp(local - engine))", header_style="bold")
    for name in ("against", "tokens", "max |delta|", "mean |delta|", "mean ratio", "outside [0.9, 1.1]"):
        table.add_column(name, justify="left" if name == "against" else "right")
    for key, what in (("vs_raw", "local raw"), ("vs_label", "each token's label"),
                      ("prompt_vs_raw", "prompt: local raw")):
        f = summary[key]
        table.add_row(what, str(f["tokens"]), _f(f["max_abs_delta"], ".3g"), _f(f["mean_abs_delta"], ".3g"),
                      _f(f["mean_ratio"], ".4f"), _f(f["outside_band"], ".3f"))
    return table


def engine_pairs_table(pairs) -> Table:
    table = Table(title="engine against the local model (teacher-forced on the engine's tokens; KL(engine || "
                        "local) of the raw distributions, bounds from the top-N tail mass)", header_style="bold")
    for name in ("variant", "prompt", "seed", "tokens", "KL low", "KL high", "tail", "top-1", "|d raw logp|",
                 "|d logp|"):
        table.add_column(name, justify="left" if name in ("variant", "tokens") else "right", no_wrap=True)
    for p in pairs:
        same = "same" if p.same_tokens else ("-" if p.first_divergence is None else f"part at {p.first_divergence}")
        table.add_row(p.variant, p.prompt, str(p.seed), same + (" (greedy)" if p.greedy else ""),
                      _f(p.kl_lower_mean, ".2e"), _f(p.kl_upper_mean, ".2e"), _f(p.tail_mass_mean, ".3f"),
                      _f(p.top1_agreement, ".2f"), _f(p.max_abs_delta_raw_logprob, ".1e"),
                      _f(p.max_abs_delta_logprob, ".1e"))
    table.caption = ("sampled variants draw with different generators here and there: only greedy ones must give the "
                     "same tokens; |d logp|: the server's processed values against the local chain (processed mode)")
    return table


def defects_lines(defects: list[str]) -> list[str]:
    return [f"defect: {one_line(d)}" for d in defects]
