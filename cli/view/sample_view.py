"""`sample`'s views: the per-token table's frame, what follows it (the prompt shaded by each token's probability, the
kept map, the summary), and the views of a run on a served engine. Every number comes from the run's document."""

from __future__ import annotations

from . import kept as kept_view
from . import render
from .constraint import constraint_line
from .reasoning import loop_line, reasoning_line
from .served_view import sample_table
from .steps_view import StepsTable


def steps_table(lm, settings, sampler, saved: int) -> StepsTable:
    """The table's frame, before any step: its widths depend on the vocabulary, the step count and the stages."""
    names = sampler.chain.names
    t = "1 (the default)" if settings.temperature is None else f"{settings.temperature:g}"
    title = f"{lm.name} · cache {settings.cache} · temperature {t} · " \
            f"chain: {' -> '.join(names + [sampler.selector.name])}"
    return StepsTable([], settings.top, lm.vocab_size, saved + settings.max_new_tokens, names, title)


def after_table(document: dict, steps, token_text, cache: str) -> list:
    """Below the table: the prompt shaded by each token's p (raw p when greedy: every processed p is 1), the kept map
    of a score-based cache, the summary line and the constraint's line."""
    greedy = document["selector"] == "greedy"
    summary, prompt = document["summary"], document["prompt"]
    return [render.shaded_text(prompt["text"], [(s.token, s.raw_prob if greedy else s.prob) for s in steps]),
            render.shading_legend("raw p (greedy: every processed p is 1)" if greedy else "processed p"),
            *kept_view.kept_views(document.get("kv_kept"), token_text, prompt["token_ids"],
                                  f"kept by {cache} after the run"),
            render.summary_line(summary)] + [line for line in [constraint_line(summary), reasoning_line(document),
                                                               loop_line(document)] if line is not None]


def run_views(table: StepsTable, document: dict, steps, token_text, cache: str) -> list:
    """The whole report: every step's row, then :func:`after_table`."""
    return [table.with_part("all", steps)] + after_table(document, steps, token_text, cache)


def screen_views(table: StepsTable, document: dict, steps, token_text, cache: str) -> list:
    """What the terminal still needs when the live table already printed the rows."""
    return [table.with_part("caption")] + after_table(document, steps, token_text, cache)


def many_title(model: str, n: int, names: list[str]) -> str:
    return f"{model} · {n} samples · chain: {' -> '.join(names) or '(none)'}"


def engine_views(conn, run, summary, prompt_text: str, top: int) -> list:
    """`sample --engine`: the server's tokens and numbers, labelled by what the server returns."""
    title = f"{conn.engine.model} on {conn.kind} at {conn.engine.url} · {summary.values} logprobs"
    return [sample_table(run.steps, title, summary.values, summary.raw_from, top),
            render.shaded_text(prompt_text, [(s.token, s.prob if s.prob is not None else (s.raw_prob or 0.0))
                                             for s in run.steps]),
            render.shading_legend("processed p" if summary.values == "processed" else "raw p"),
            render.summary_line(summary)]


def engine_rows(steps) -> list[dict]:
    """Flat rows for markdown and csv: no nested lists."""
    return [{**{k: v for k, v in render.clean(s).items() if k not in ("alternatives", "defects")},
             "token": render.show_token(s.token)} for s in steps]
