"""`decodelab models`: the bundled models and presets."""

from __future__ import annotations

from ...core.settings import META_KEYS, bundled_presets, load_preset
from .. import options as o
from ..view import models_view, output


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
        views=lambda: models_view.listing_tables(models_rows, preset_rows, policy_rows)), fmt.value)
