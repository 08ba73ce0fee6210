#!/usr/bin/env bash
# The lowest versions pyproject declares, in a venv of their own: the CLI (help, a command, bad input) and a fast
# subset of the tests that uses every pinned dependency (typer: the hook's fallbacks and bad input; rich and tabulate:
# the renderers; torch and transformers: the processors against transformers', the forward and the runtime, greedy
# and beam search against `generate`, warm timing; numpy: beam's host transfer and llama.cpp's buckets; llguidance:
# the constraint stage). Run by .ci/run after the default tests. Keep FLOORS equal to pyproject's lower bounds
# (tests/layout/test_floors.py checks it).
#
# The venv lives outside the clone, keyed on the pins, the test tools and the Python, and is reused while the
# distributions in it are exactly the ones it was built with (any other set, a pin moved or a package added by hand,
# rebuilds it). Where: $DECODELAB_FLOORS_CACHE, else ~/.cache/decodelab. Wall times on the shared 2-core machine,
# 2026-12-05, under other jobs' load (noisy figures): the former script (a fresh venv in the clone each run) 133 s
# at load 4.7, of which venv and pins 59 s, the editable install 5 s, the CLI checks 10 s, the tests 59 s (the
# 7 minutes noted before were under heavier load); this one 73 s building the venv (load 2.6), 49 s reusing it
# (load 3), with the wider test subset.
set -euo pipefail
cd "$(dirname "$0")/.."
FLOORS="typer==0.16.0 rich==13.0.0 torch==2.13.0 transformers==5.24.0 numpy==1.24.0 tabulate==0.10.0 llguidance==1.9.0"
TOOLS="pytest>=8 hypothesis>=6 regex>=2023.10 setuptools>=77"  # setuptools: the editable install without isolation
KEY=$( (echo "$FLOORS"; echo "$TOOLS"; python3 -c 'import sys; print(sys.version)') | sha256sum | cut -c1-16)
CACHE="${DECODELAB_FLOORS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/decodelab}"
VENV="$CACHE/venv-floors-$KEY"
LOG=/tmp/decodelab-floors-pip.log
mkdir -p "$CACHE"
if command -v flock >/dev/null 2>&1; then  # one run at a time per venv: the editable install points it at this clone
    exec 9>"$VENV.lock"
    flock 9
fi

# name==version of every distribution in the venv but decodelab, sorted: what the stamp holds
installed() {
    "$VENV/bin/python" - <<'PY'
import importlib.metadata as md
print("\n".join(sorted({f"{d.metadata['Name'].lower()}=={d.version}" for d in md.distributions()
                        if d.metadata["Name"].lower() != "decodelab"})))
PY
}

if [ -f "$VENV/.stamp" ] && [ "$(installed 2>/dev/null)" = "$(cat "$VENV/.stamp")" ]; then
    echo "floors: reusing $VENV"
else
    echo "floors: building $VENV"
    rm -rf "$VENV"
    for old in "$CACHE"/venv-floors-*; do  # other pins' venvs (1.2 GB each), unless a run holds one now
        case "$old" in "$VENV"*|*.lock) continue ;; esac
        if command -v flock >/dev/null 2>&1; then
            (flock -n 8 && rm -rf "$old") 8>"$old.lock" && rm -f "$old.lock" || true
        else
            rm -rf "$old"
        fi
    done
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q $FLOORS $TOOLS
    installed > "$VENV/.stamp"
fi
. "$VENV/bin/activate"
pip install -q --no-deps --no-build-isolation -e . >"$LOG" 2>&1 || { cat "$LOG"; exit 1; }
python - "$FLOORS" <<'PY'
import importlib.metadata as md
import sys
for pin in sys.argv[1].split():  # exactly the pins (a local label such as torch's +cpu aside), or the run stops
    name, want = pin.split("==")
    assert md.version(name).split("+")[0] == want, f"floors: {name} {md.version(name)} installed, {want} pinned"
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
# pyproject's addopts already say -q: no second one, so pytest's closing line ("N passed") is printed
pytest -p no:cacheprovider tests/cli/test_library_hooks.py tests/cli/test_bad_input.py \
    tests/sampling/test_processors.py tests/engine/test_forward.py tests/engine/test_runtime.py \
    tests/methods/test_decode.py tests/engine/test_warm_timing.py \
    tests/sampling/test_constraint.py tests/cli/test_render.py tests/sampling/test_llamacpp_ties.py \
    tests/methods/test_beam.py::test_beam_equals_generate tests/methods/test_beam.py::test_beam_with_processors_equals_generate
deactivate
