#!/usr/bin/env bash
# Mutation testing (mutmut 3) of all of core/ and the renderers (cli/view/render.py and the table layout of
# steps_view.py, fit.py, live.py), against the fast test suite less the tests that cannot see a mutant (EXCLUDE).
#
#   pip install -e '.[test,mutation]' && bash tests/mutation/run.sh [WORKDIR [MUTANT_PATTERN...]]
#   cd WORKDIR && mutmut results          # or: mutmut show NAME
#
# MUTATE (environment): the repository files or folders to mutate, space-separated; default: MUTATE_ALL below.
#   MUTATE="core/sampling/filters.py core/kv" bash tests/mutation/run.sh /tmp/m
# MUTANT_PATTERN: run only the mutants whose names match (fnmatch, as `mutmut run` takes them), e.g. one package:
#   bash tests/mutation/run.sh /tmp/m 'decodelab.core.kv.*'
# KEEP=1 (environment): keep WORKDIR's mutants/ (mutmut's verdicts) and refresh the sources and tests in it. mutmut
#   keeps the verdict of every mutant whose function is unchanged and tests the rest, so a run per package, or a
#   rerun after new tests, adds to one table. Name the survivors to retest them against new tests:
#   KEEP=1 bash tests/mutation/run.sh /tmp/m $(grep ': survived' /tmp/m/results.txt | cut -d: -f1)
# MUTMUT_CHILDREN (environment): parallel workers, default 1 (the development machines share 2 cores).
# MUTMUT_TIMEOUT_MULTIPLIER (environment): a mutant is stopped as a timeout after (estimated test time + 1) x this x 2
#   CPU seconds; mutmut's default 15 gives an endless loop under a file of slow tests (tests/methods/test_batch.py)
#   hours of CPU. 2 stops it after about 4 times its tests' time; a change of it reclassifies only the timeouts.
# Run it detached (`setsid bash tests/mutation/run.sh ... < /dev/null &`): a mutant that turns a pid into 0 kills its
#   process group, and with it the run, without a word; rerun with KEEP=1 and patterns that skip it.
# A test sees a constructor's mutant only if it builds the object in its body: objects built in a parametrize list
#   are built at collection, before mutmut switches a mutant on.
# The tests run against the mutants are every test file under tests/ except EXCLUDE below; mutmut runs against each
# mutant only the tests that call its function (fastest first, stopping at the first failure).
# TESTS (environment): the test files or folders to select from instead of all of tests/ (EXCLUDE still applies), for
# a run of one package against the tests that guard it (a survivor takes every selected test that calls its
# function, so a focused selection is what makes a package finish on a shared machine). A change of selection
# resets mutmut's verdicts, so give each selection its own WORKDIR:
#   MUTATE=core/kv TESTS="tests/kv tests/methods/test_batch.py" bash tests/mutation/run.sh /tmp/m-kv
#
# mutmut names a mutant after the module path of its file and compares it with the running function's __module__,
# so the sources are laid out under decodelab/ in a scratch folder (the import name; the repository keeps core/ and
# cli/ at the top level).
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
work="${1:-/tmp/decodelab-mutation}"
shift || true  # the rest: mutant name patterns

MUTATE_ALL=(
    core
    cli/view/render.py
    cli/view/steps_view.py
    cli/view/fit.py
    cli/view/live.py
)
EXCLUDE=(
    tests/mutation               # this script
    tests/layout                 # reads the source text (imports, packaging): mutmut's trampolines are not the code
    tests/cli/test_first_use.py  # runs `decodelab --help` in a subprocess, which imports the unmutated install
    tests/cli/test_interrupts.py # raises KeyboardInterrupt, which mutmut's worker takes for the user's Ctrl-C
    tests/cli/test_fuzz_cli.py   # hypothesis-drawn values: a mutant's verdict would depend on the draw
    tests/engine/test_gpu.py     # CUDA only
    tests/engine/test_vllm_real.py  # a real vLLM server in another venv
)
read -r -a mutate <<< "${MUTATE:-${MUTATE_ALL[*]}}"
files=()
for item in "${mutate[@]}"; do
    [ -e "$repo/$item" ] || { echo "MUTATE: no file or folder $item in $repo" >&2; exit 2; }
    while IFS= read -r file; do
        # an empty __init__.py has nothing to mutate
        [ -s "$repo/$file" ] && files+=("$file")
    done < <(cd "$repo" && find "$item" -name '*.py' -not -path '*/__pycache__/*' | sort)
done
tests=()
while IFS= read -r file; do
    skip=0
    for excluded in "${EXCLUDE[@]}"; do
        [[ "$file" == "$excluded" || "$file" == "$excluded"/* ]] && skip=1
    done
    [ "$skip" = 0 ] && tests+=("$file")
done < <(cd "$repo" && find ${TESTS:-tests} -name 'test_*.py' -not -path '*/__pycache__/*' | sort)
toml_list() { local item; for item in "$@"; do printf '    "%s",\n' "$item"; done; }
if [ "${KEEP:-0}" = 1 ] && [ -d "$work/mutants" ]; then
    rm -rf "$work/decodelab" "$work/tests" "$work/presets" "$work/docs" "$work/README.md"
else
    rm -rf "$work"
fi
mkdir -p "$work/decodelab"
touch "$work/decodelab/__init__.py"
for part in core cli presets; do
    cp -r "$repo/$part" "$work/decodelab/$part"
done
cp -r "$repo/presets" "$work/presets"  # tests find the bundled tokenizer and weights at the repository root
cp -r "$repo/docs" "$work/docs"  # and read docs/json.md and README.md against real output
cp "$repo/README.md" "$work/README.md"
cp -r "$repo/tests" "$work/tests"
rm -rf "$work/tests/mutation"
find "$work" -path "$work/mutants" -prune -o -name __pycache__ -prune -exec rm -rf {} +
git -C "$repo" rev-parse --short HEAD > "$work/commit.txt" 2>/dev/null || true

cat > "$work/pyproject.toml" <<TOML
[tool.mutmut]
source_paths = ["decodelab/"]
only_mutate = [
$(toml_list "${files[@]/#/decodelab/}")
]
also_copy = ["tests/", "presets/", "docs/", "README.md"]
timeout_multiplier = ${MUTMUT_TIMEOUT_MULTIPLIER:-15.0}
pytest_add_cli_args = ["-p", "no:cacheprovider", "-m", "not slow and not gpu and not vllm and not browser"]
pytest_add_cli_args_test_selection = [
$(toml_list "${tests[@]}")
]

[tool.pytest.ini_options]
testpaths = ["tests"]
markers = ["slow: heavier checks", "gpu: needs CUDA", "vllm: a real vLLM server", "browser: headless Chromium"]
TOML
cd "$work"
export OMP_NUM_THREADS=1
mutmut run --max-children "${MUTMUT_CHILDREN:-1}" "$@"
mutmut results --all true > results.txt || true
# per file: mutants, killed, and the rest by status
python3 - results.txt <<'PY'
import collections, sys
counts = collections.defaultdict(collections.Counter)
for line in open(sys.argv[1]):
    if ": " in line:
        name, status = line.strip().rsplit(": ", 1)
        counts[name.split(".x_")[0].split(".x\u01c1")[0]][status] += 1
total = collections.Counter()
for module, c in sorted(counts.items()):
    total.update(c)
    n = sum(c.values())
    print(f"{module}: {n} mutants, {c['killed']} killed ({100 * c['killed'] / n:.1f}%), "
          + ", ".join(f"{v} {k}" for k, v in sorted(c.items()) if k != "killed"))
n = sum(total.values())
if n:
    print(f"all: {n} mutants, {total['killed']} killed ({100 * total['killed'] / n:.1f}%)")
PY
echo "every mutant and its status: $work/results.txt"
