"""`models`' view: the bundled models, the presets and the KV-cache policies, one table each."""

from __future__ import annotations

from rich.table import Table


def listing_tables(models_rows, preset_rows, policy_rows) -> list:
    table = Table(title="bundled models", header_style="bold")
    for col in ("name", "architecture", "parameters", "layers", "heads/kv", "context", "trained", "vocab", "size"):
        table.add_column(col, justify="left" if col in ("name", "architecture") else "right", no_wrap=True)
    for r in models_rows:
        if not r["installed"]:
            table.add_row(r["name"], "[red]missing[/red]", "", "", "", "", "", "", "")
            continue
        table.add_row(r["name"], r["architecture"], f"{r['parameters']:,}", str(r["layers"]),
                      f"{r['heads']} / {r['kv_heads']}", str(r["context_length"]),
                      "?" if r["trained_context"] is None else str(r["trained_context"]), str(r["vocab_size"]),
                      f"{r['file_bytes'] / 1e6:.1f} MB")
    presets = Table(title="bundled presets", header_style="bold")
    presets.add_column("name")
    presets.add_column("settings")
    presets.add_column("description")
    for p in preset_rows:
        presets.add_row(p["name"], ", ".join(f"{k}={v}" for k, v in p["settings"].items()), p["description"])
    policies = Table(title="KV-cache policies (--cache NAME[:key=value,...])", header_style="bold")
    for col in ("name", "keys", "can", "what it keeps"):
        policies.add_column(col)
    for p in policy_rows:
        policies.add_row(p["name"], ", ".join(p["keys"]), ", ".join(p["capabilities"]), p["summary"])
    return [table, presets, policies]
