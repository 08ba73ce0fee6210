#!/usr/bin/env bash
# Build (once per machine) the venv that holds NVIDIA's kvpress, for the comparison of its presses with decodelab's
# (tests/kv/test_presses.py's kvpress cases, benchmarks/kvpress_compare.py).
#
# kvpress pins transformers < 5.3, so it cannot share decodelab's venv. The venv lives at a fixed path outside any
# clone; a marker file written last says the install finished and `import kvpress` worked. Run it again: with the
# marker present it does nothing.
#
#   DECODELAB_KVPRESS_VENV   where the venv lives (default ~/.cache/decodelab/kvpress-0.5.5)
#
# Prints the venv's python on the last line (for DECODELAB_KVPRESS_PYTHON).
set -euo pipefail
. "$(dirname "$0")/side-venv.sh"

KVPRESS_VERSION=0.5.5
TORCH_VERSION=2.13.0   # the CPU build decodelab runs on
VENV="${DECODELAB_KVPRESS_VENV:-$HOME/.cache/decodelab/kvpress-$KVPRESS_VERSION}"
MARKER="$VENV/.decodelab-kvpress-ready"
PY="$VENV/bin/python"

side_venv_ready kvpress "$VENV" "$MARKER"

started=$(date +%s)
side_venv_fresh "$VENV" DECODELAB_KVPRESS_VENV
# torch first, so kvpress's resolver keeps it (its own pin is torch < 3); safetensors to read the bundled models
"$PY" -m pip install -q "torch==$TORCH_VERSION" safetensors
"$PY" -m pip install -q "kvpress==$KVPRESS_VERSION" "torch==$TORCH_VERSION"
"$PY" -c 'import kvpress, torch, transformers; print("kvpress", "'"$KVPRESS_VERSION"'", "torch", torch.__version__, "transformers", transformers.__version__)'

side_venv_done kvpress "$VENV" "$MARKER" "$started" "kvpress==$KVPRESS_VERSION torch==$TORCH_VERSION"
