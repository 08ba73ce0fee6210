"""`batch`'s views: the iteration log and the requests."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text

from . import render

if TYPE_CHECKING:
    from ...core.methods.batch.run import BatchReport


LOG_ROWS = 60  # iterations shown in the table; past that only those where a sequence joined, finished or was preempted


def iterations_table(report: BatchReport, model_name: str) -> Table:
    s = report.settings
    table = Table(title=f"{model_name} · paged pool of {report.num_blocks} blocks x {s.block_size} tokens · "
                        f"max batch {s.max_batch} · {s.max_tokens_per_iteration} tokens/iteration",
                  header_style="bold")
    for col in ("iter", "running", "rows", "tokens (prefill+decode)", "joined", "finished", "waiting",
                "blocks used/free", "prefix hits", "preempted"):  # rows < running: the token budget ran out
        table.add_column(col, justify="right" if col not in ("joined", "finished", "preempted") else "left")
    shown = report.iterations
    if len(shown) > LOG_ROWS:
        shown = [i for i in shown if i.joined or i.finished or i.preempted]
        table.caption = f"{len(report.iterations)} iterations; only those where sequences joined, finished or " \
                        "were preempted are listed (--format json has every one)"
    for i in shown:
        table.add_row(str(i.index), str(i.running), str(i.rows), f"{i.tokens} ({i.prefill_tokens}+{i.decode_tokens})",
                      " ".join(i.joined), " ".join(i.finished), str(i.waiting), f"{i.blocks_used}/{i.blocks_free}",
                      str(i.prefix_hit_tokens), " ".join(i.preempted))
    return table


def requests_table(requests: list[dict]) -> Table:
    table = Table(title="requests: prompt/new tokens, prefix-hit tokens, iterations joined/ended, mean logprob "
                        "(processed: what the selector drew from; raw: the model's)", header_style="bold")
    for col in ("id", "prompt", "new", "stop", "hit", "preempt", "join", "end", "logprob", "raw", "text"):
        table.add_column(col, justify="left" if col in ("id", "stop", "text") else "right")
    for r in requests:
        nan = float("nan")
        mean = nan if r["mean_logprob"] is None else r["mean_logprob"]
        raw = nan if r["mean_raw_logprob"] is None else r["mean_raw_logprob"]
        table.add_row(r["id"], str(len(r["prompt_token_ids"])), str(len(r["token_ids"])), r["stop_reason"],
                      str(r["prefix_hit_tokens"]), str(r["preemptions"]), str(r["joined"]), str(r["finished"]),
                      f"{mean:.3f}", f"{raw:.3f}", render.cut(render.one_line(r["text"]), 60))
    return table


def noise_line(v: dict) -> Text:
    """A greedy request whose baseline parts from the run: the noise verdict there."""
    return Text(f"request {v['request']}: {v['against']} parts at step {v['step']} ({v['token_a']} vs {v['token_b']}): "
                f"{v['words']} (margin {abs(v['margin']):.3g} vs {v['dtype']} floor {v['floor']:.3g})",
                style="yellow" if v["words"].startswith("within") else "red")
