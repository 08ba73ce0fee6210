"""The load average when a run loaded its model (:func:`started`), and at its output, the ``machine`` field and the
one-line note (cli/notes.py: written when the run exits 0) of a run timed on an oversubscribed machine
(core/engine/machine_load.py says when)."""

from __future__ import annotations

import dataclasses

from . import notes
from ..core.engine.machine_load import load_average, machine_note, machine_record

start: dict = {}  # {"load": the load average when the model was loaded, "cores": the physical cores}: one run a process


def started(load: float, cores: int) -> None:
    start.update(load=load, cores=cores)


def record() -> dict | None:
    """The ``machine`` field for this run's output (None: not oversubscribed, or no local model was loaded)."""
    if not start:
        return None
    return machine_record(start["load"], load_average(), start["cores"])


def timed(obj) -> bool:
    """Whether a document carries a speed figure: a key ending in ``_per_s`` (tokens/s) or naming a speedup."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # rows and summaries not yet made dicts
        obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return any(str(k).endswith("_per_s") or "speedup" in str(k) or timed(v) for k, v in obj.items())
    if isinstance(obj, list):
        return any(timed(v) for v in obj)
    return False


def mark(document: dict, jsonl: list[dict]) -> tuple[dict, list[dict]]:
    """The document and the JSONL summary lines with the ``machine`` field, and the note on stderr, when the run
    printed speed figures and was oversubscribed; unchanged otherwise."""
    found = record()
    found = found if found is not None and (timed(document) or timed(jsonl)) else None  # scan only when busy
    start.clear()  # the next command of this process (tests run many) measures its own
    if found is None:
        return document, jsonl
    notes.add(machine_note(found))
    lines = [{**line, "machine": found} if line.get("type") == "summary" else line for line in jsonl]
    return {**document, "machine": found}, lines
