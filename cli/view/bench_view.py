"""`bench`'s view: decodelab against transformers `generate`, per setting."""

from __future__ import annotations

from rich.table import Table


def bench_table(lm, n: int, rows) -> Table:
    t = Table(title=f"{lm.name} on {lm.device} · {n} new tokens · median of "
              f"{rows[0].rounds if rows else 0} interleaved rounds",
              header_style="bold")
    for name in ("setting", "decodelab tok/s", "generate tok/s", "ratio", "low-high"):
        t.add_column(name, justify="left" if name == "setting" else "right", no_wrap=name != "setting")
    for r in rows:
        t.add_row(r.setting + (f" ({r.note})" if r.note else ""), f"{r.decodelab_tokens_per_s:.1f}",
                  f"{r.transformers_tokens_per_s:.1f}", f"{r.ratio:.2f}x", f"{r.ratio_low:.2f}-{r.ratio_high:.2f}")
    t.caption = ("ratio: median over rounds of decodelab tok/s / generate tok/s in the same round; generate with "
                 "eos_token_id=None, top_k=0 when sampling; speculative rows against assisted generation with "
                 "the same draft (assistant_model), prompt lookup rows against prompt_lookup_num_tokens")
    return t
