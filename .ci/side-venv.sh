# Sourced by .ci/vllm-venv.sh and .ci/kvpress-venv.sh: a venv of its own for a package whose pins cannot share
# decodelab's (an engine, a reference implementation), built once per machine at a fixed path outside any clone.
# A marker file written last says the install finished and the import worked; with the marker present nothing is done.
#
#   side_venv_ready NAME VENV MARKER   with the marker present: says so, prints the venv's python, ends the script
#   side_venv_fresh VENV VARIABLE      an empty venv at VENV with an upgraded pip (VARIABLE: the setting that moves it)
#   side_venv_done NAME VENV MARKER STARTED WHAT   writes the marker (WHAT, the build's date and seconds), prints the python

side_venv_ready() {
    local name=$1 venv=$2 marker=$3
    if [[ -f "$marker" ]]; then
        echo "$name venv ready (marker $marker)"
        echo "$venv/bin/python"
        exit 0
    fi
}

side_venv_fresh() {
    local venv=$1 variable=$2
    mkdir -p "$(dirname "$venv")"
    # A half-built venv from an interrupted run is rebuilt from scratch, not patched; anything at that path that
    # is not a venv (no pyvenv.cfg) is left alone and refused.
    if [[ -e "$venv" ]]; then
        if [[ ! -f "$venv/pyvenv.cfg" ]]; then
            echo "error: $venv exists and is not a venv; set $variable elsewhere" >&2
            exit 2
        fi
        rm -rf "$venv"
    fi
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
}

side_venv_done() {
    local name=$1 venv=$2 marker=$3 started=$4 what=$5
    local seconds=$(( $(date +%s) - started ))
    {
        echo "$what"
        echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) in $seconds s"
    } > "$marker"
    echo "$name venv built in $seconds s"
    echo "$venv/bin/python"
}
