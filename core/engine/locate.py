"""Finding a model's folder without torch: a bundled name, a local folder, or a hub id already in the local Hugging
Face cache (by path: no request). :mod:`.models` loads from it; the CLI checks ``-m`` and ``--draft`` with it before
torch and transformers are imported, so a wrong name costs no import."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from ..errors import ModelLoadError

BUNDLED = ("tiny", "tiny-draft", "tiny-recall")


def bundled_dir(name: str) -> Path:
    """The packaged folder of a bundled model (installed with the wheel, under decodelab/presets/models)."""
    return Path(str(resources.files("decodelab.presets") / "models" / name))


def hub_offline() -> None:
    """No hub lookup leaves the machine: huggingface_hub's offline switch, set for this process (the module constant
    it consults on every request) and for any child process (the environment it reads at import)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    import huggingface_hub.constants as hub

    hub.HF_HUB_OFFLINE = True
    hub.HF_HUB_DISABLE_TELEMETRY = True


def model_folder(spec: str, bundled=None) -> Path:
    """Where to load from: a bundled folder, a local folder, or a hub id's snapshot in the local HF cache (by path:
    no request). ``bundled``: the function giving a bundled name's folder (default :func:`bundled_dir`)."""
    if spec in BUNDLED:
        folder = (bundled or bundled_dir)(spec)
        if not (folder / "config.json").is_file():
            raise ModelLoadError(f"--model {spec}: the bundled model's files are missing from {folder}")
        return folder
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.exists() or spec.startswith((".", "/", "~")):
        raise ModelLoadError(f"--model {spec}: no model folder there; give a bundled name ({', '.join(BUNDLED)}), "
                             "a local model folder or a model id in the local Hugging Face cache")
    return cached_snapshot(spec)


def cached_snapshot(spec: str) -> Path:
    """The snapshot folder of hub id ``spec`` (revision main) in the local Hugging Face cache."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found, reason = try_to_load_from_cache(spec, "config.json"), ""
    except ValueError as exc:  # HFValidationError: not a valid repo id
        found, reason = None, ": " + str(exc).strip().splitlines()[0]
    if not isinstance(found, str):
        raise ModelLoadError(f"--model {spec}: not a bundled name ({', '.join(BUNDLED)}), a local folder, or a model "
                             f"in the local Hugging Face cache (decodelab never downloads){reason}")
    return Path(found).parent
