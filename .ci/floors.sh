#!/usr/bin/env bash
# The lowest versions pyproject declares, in a fresh venv: the CLI (help, a command, bad input) and a fast subset of
# the tests (the typer hook's fallbacks, bad input, the processors against transformers', the forward and the
# runtime, greedy against `generate`, warm timing, the constraint stage). Run by .ci/run after the default
# tests; about 2 minutes of CPU (7 minutes wall on the loaded 2-core machine, 2026-12-04) once pip's cache holds
# the wheels. Keep FLOORS equal to pyproject's lower bounds
# (tests/layout/test_floors.py checks it).
set -euo pipefail
cd "$(dirname "$0")/.."
FLOORS="typer==0.16.0 rich==13.0.0 torch==2.13.0 transformers==5.24.0 numpy==1.24.0 tabulate==0.9.0 llguidance==1.9.0"
rm -rf .venv-floors
python3 -m venv .venv-floors
. .venv-floors/bin/activate
python -m pip install -q --upgrade pip
pip install -q $FLOORS 'pytest>=8' 'hypothesis>=6' 'regex>=2023.10'
pip install -q --no-deps -e .
python - <<'PY'
import importlib.metadata as md
for name in ("typer", "rich", "torch", "transformers", "numpy", "tabulate", "llguidance", "click"):
    print(f"floors: {name} {md.version(name)}")
PY
export OMP_NUM_THREADS=1 DECODELAB_NO_WARM=1
(cd /tmp && decodelab --help >/dev/null && decodelab sample --help >/dev/null)
(cd /tmp && decodelab sample "Once upon a time" -n 4 --threads 1 -f json > /tmp/decodelab-floors.json)
python -c "import json; d = json.load(open('/tmp/decodelab-floors.json')); assert len(d['token_ids']) >= 1; print('floors: sample ok')"
set +e
(cd /tmp && decodelab sample x -n nope --threads 1 2>/tmp/decodelab-floors.err); code=$?
set -e
[ "$code" = 2 ] && [ "$(wc -l < /tmp/decodelab-floors.err)" = 1 ] && echo "floors: bad input is one line, exit 2"
pytest -q -p no:cacheprovider tests/cli/test_library_hooks.py tests/cli/test_bad_input.py \
    tests/sampling/test_processors.py tests/engine/test_forward.py tests/engine/test_runtime.py \
    tests/methods/test_decode.py tests/engine/test_warm_timing.py \
    tests/sampling/test_constraint.py
deactivate
