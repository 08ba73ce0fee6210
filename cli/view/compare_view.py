"""`compare`'s views: the variants side by side per (prompt, seed), the per-variant measures, where each pair parts,
and the flat rows for markdown and csv."""

from __future__ import annotations

import sys

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from . import render
from .fit import SameLayout

ROW_COLUMNS = ("variant", "prompt", "seed", "text", "length", "stop_reason", "mean_logprob", "raw_perplexity",
               "distinct_1", "distinct_2", "repetition_rate", "mean_kept", "mean_entropy", "tokens_per_s")


def flat_row(row) -> dict:
    d = render.clean(row)
    return {k: d[k] for k in ROW_COLUMNS}


def setting_keys(run) -> list[str]:
    """The settings any variant sets (``method``, ``preset`` and its own keys), in the order first given."""
    keys: list[str] = []
    for v in run.variants:
        named = (["method"] if v.method != "sample" else []) + (["preset"] if v.preset else []) + [k for k, _ in v.values]
        keys += [k for k in named if k not in keys]
    for p in run.prompts:  # a prompt's own settings (they override the variants' for that prompt)
        keys += [k for k in getattr(p, "settings", {}) if k not in keys]
    return keys


PAIR_COLUMNS = ("vs", "first_divergence", "token_text", "vs_token_text", "after", "vs_after")


def pair_cells(row, first: str, pairs: list[dict]) -> dict:
    """A row's columns against the first variant on its prompt and seed, read from that pair (the document's, texts
    by Comparison.pair_texts): ``vs`` the first variant, the step where they part (empty: identical), this row's and
    the first's token there as text, and each output's text from there on; empty on the first variant's own rows."""
    cells = dict.fromkeys(PAIR_COLUMNS)
    pair = next((p for p in pairs if (p["a"], p["b"], p["prompt"], p["seed"]) == (first, row.variant, row.prompt,
                                                                                  row.seed)), None)
    if pair is not None:
        cells.update(vs=first, first_divergence=pair["first_divergence"], token_text=pair["b_token_text"],
                     vs_token_text=pair["a_token_text"], after=pair["b_after"], vs_after=pair["a_after"])
    return cells


def settings_row(run, row, pairs: list[dict] | None = None) -> dict:
    """A row of the markdown/CSV table: the row's columns, its texts against the first variant where ``pairs`` (the
    document's) are given (pair_cells), then one column per setting a variant sets, holding this row's resolved value
    (the variant's method and preset; the others from its settings for the row's seed)."""
    from ...core.settings import as_dict

    flat = flat_row(row)
    v = next(x for x in run.variants if x.name == row.variant)
    resolved = render.clean(as_dict(run.settings_of(v.name, row.prompt, row.seed)))
    values = {"method": v.method, "preset": v.preset or ""}
    cells = {k: values[k] if k in values else resolved.get(k) for k in setting_keys(run)}
    cells = {k: (",".join(map(str, c)) if isinstance(c, (list, tuple)) else c) for k, c in cells.items()}
    if pairs is not None:
        flat.update(pair_cells(row, run.variants[0].name, pairs))
    return {**flat, **{k: c for k, c in cells.items() if k not in flat}}


def from_there(text: str | None, width: int = 40) -> str:
    """An output's text from the divergence on, quoted (its leading space shows), cut to ``width``; empty when the
    pair is identical, "(ended)" when that output had no more tokens."""
    if text is None:
        return ""
    return render.cut(repr(text), width) if text else "(ended)"


def own_note(prompt) -> str:
    """The table's note where the prompt has its own settings (a --prompts-file line's): they ran instead of the
    variants' values for those keys."""
    own = getattr(prompt, "settings", None)
    if not own:
        return ""
    values = ", ".join(f"{k}={','.join(map(str, v)) if isinstance(v, (list, tuple)) else v}" for k, v in own.items())
    return f"prompt {prompt.id} sets its own {values}: every variant ran with these here, over its own values. "


def fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def summary_table(summary: list[dict]) -> Table:
    """Per variant over its prompts and seeds: mean (min-max) of each measure."""
    t = Table(title="per variant: mean (min-max) over prompts and seeds", header_style="bold")
    t.add_column("variant", no_wrap=True)
    t.add_column("runs", justify="right")
    for name in ("logp", "ppl", "d-2", "rep", "H", "tok/s"):
        t.add_column(name, justify="right", no_wrap=True)
    for v in summary:
        cells = []
        for key, spec in (("mean_logprob", ".3f"), ("raw_perplexity", ".2f"), ("distinct_2", ".2f"),
                          ("repetition_rate", ".2f"), ("mean_entropy", ".2f"), ("tokens_per_s", ".1f")):
            m = v["measures"][key]
            cells.append("-" if m is None else f"{m['mean']:{spec}} ({m['min']:{spec}}-{m['max']:{spec}})")
        t.add_row(Text(v["variant"], style="bold"), str(v["runs"]), *cells)
    return t


def tables(lm, run, pairs: list[dict] | None = None) -> list:
    """Per (prompt, seed): the variants side by side; then every pair's first divergence."""
    out = []
    for prompt in run.prompts:
        for seed in run.seeds:
            rows = [r for r in run.rows if r.prompt == prompt.id and r.seed == seed]
            if not rows:
                continue
            t = Table(title=f"{lm.name} · prompt {prompt.id}: {render.cut(render.one_line(prompt.text), 60)} · seed {seed}",
                      header_style="bold")
            t.add_column("variant", no_wrap=True)
            t.add_column("text", ratio=1)
            for name in ("len", "stop", "logp", "ppl", "d-1", "d-2", "rep", "kept", "H", "tok/s"):
                t.add_column(name, justify="right", no_wrap=True)
            for r in rows:
                t.add_row(Text(r.variant, style="bold"), render.one_line(r.text), str(r.length), r.stop_reason,
                          fmt(r.mean_logprob), fmt(r.raw_perplexity, ".2f"), fmt(r.distinct_1, ".2f"),
                          fmt(r.distinct_2, ".2f"), fmt(r.repetition_rate, ".2f"), fmt(r.mean_kept, ".1f"),
                          fmt(r.mean_entropy, ".2f"), fmt(r.tokens_per_s, ".1f"))
            t.caption = (own_note(prompt) + "logp: mean processed log-prob; ppl: the model's own perplexity of the "
                         "output; d-1/d-2: distinct uni/bigrams; rep: repeated 4-grams; kept: candidates per step; H: "
                         "processed entropy (nats)")
            out.append(t)
    SameLayout(out)  # one layout for every block: no column moves between panels from one to the next
    from ...core.analysis.compare import variant_summary

    out.append(summary_table(variant_summary(run.rows)))
    if pairs:
        t = Table(title="where the variants part (same seed = same random draws)", header_style="bold")
        t.key_columns = 4  # a, b, prompt and seed name a pair: a split panel repeats them
        for name in ("a", "b", "prompt", "seed", "first divergence", "deciding stage", "why", "a from there",
                     "b from there"):
            t.add_column(name, no_wrap=name not in ("why", "a from there", "b from there"))
        for p in pairs:
            t.add_row(p["a"], p["b"], p["prompt"], str(p["seed"]), "identical" if p["first_divergence"] is None
                      else f"step {p['first_divergence']}", p["deciding_stage"] or "-",
                      (p["why"] or "") + noise_words(p.get("noise")), from_there(p["a_after"]),
                      from_there(p["b_after"]))
        out.append(t)
    return out


class progress:
    """A progress bar on stderr (a terminal only, so piped output and tests stay clean)."""

    def __init__(self, total: int, fmt):
        self.bar = None
        if sys.stderr.isatty() and fmt != "jsonl":
            self.bar = Progress(TextColumn("compare"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                TextColumn("{task.description}"), console=render.error_console(), transient=True)
        self.total = total

    def __enter__(self):
        if self.bar is None:
            return lambda row: None
        self.bar.start()
        task = self.bar.add_task("", total=self.total)
        return lambda row: self.bar.update(task, advance=1, description=f"{row.variant} · prompt {row.prompt} · "
                                                                        f"seed {row.seed}")

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
        return False


def noise_words(noise: dict | None) -> str:
    """The noise verdict after a pair's why: its words, the margin of the two tokens and the dtype's floor."""
    if not noise:
        return ""
    return (f"; {noise['words']} (margin {abs(noise['margin']):.3g} vs {noise['dtype']} floor "
            f"{noise['floor']:.3g})")
