"""`decodelab models`: the bundled models and presets."""

from __future__ import annotations

from rich.table import Table

from ...core.settings import META_KEYS, bundled_presets, load_preset
from .. import options as o
from ..view import output


def presets_listing() -> list[dict]:
    rows = []
    for name in bundled_presets():
        _, table = load_preset(name)
        rows.append({"name": name, "description": table.get("description", ""),
                     "settings": {k: v for k, v in table.items() if k not in META_KEYS}})
    return rows


def models(fmt: o.Fmt = o.Format.table) -> None:
    """List the bundled models (parameters, context, vocabulary, size), the bundled presets and the KV-cache
    policies `--cache` accepts."""
    from ...core.engine.models import describe_bundled
    from ...core.kv import listing as cache_policies
    models_rows, preset_rows, policy_rows = describe_bundled(), presets_listing(), cache_policies()
    doc = {"command": "models", "models": models_rows, "presets": preset_rows, "cache_policies": policy_rows}
    output.emit(output.Output(
        document=doc, jsonl=[doc], tables=[(None, [{k: v for k, v in r.items() if k != "path"} for r in models_rows])],
        views=lambda: listing_tables(models_rows, preset_rows, policy_rows)), fmt.value)


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
