#!/usr/bin/env bash
# Mutation testing (mutmut 3) of the processors, selector, stop rules, trace statistics, the speculative acceptance
# rule and the renderers (render.py and the table layout of steps_view.py, fit.py, live.py), against the fast tests
# that guard them.
#
#   pip install -e '.[test,mutation]' && bash tests/mutation/run.sh [WORKDIR [MUTANT_PATTERN...]]
#   cd WORKDIR && mutmut results          # or: mutmut show NAME
#
# MUTATE (environment): the repository files to mutate, space-separated; default: every file in MUTATE_ALL below.
#   MUTATE="core/sampling/filters.py core/sampling/select.py" bash tests/mutation/run.sh /tmp/m
# MUTANT_PATTERN: run only the mutants whose names match (fnmatch, as `mutmut run` takes them), e.g.
#   bash tests/mutation/run.sh /tmp/m 'decodelab.core.processors.xǁTopPǁ__call____mutmut_*'
# MUTMUT_CHILDREN (environment): parallel workers, default 1 (the development machines share 2 cores).
# The tests run against every mutant are TESTS below, the one place the selection lives.
#
# mutmut names a mutant after the module path of its file and compares it with the running function's __module__,
# so the sources are laid out under decodelab/ in a scratch folder (the import name; the repository keeps core/ and
# cli/ at the top level). Of speculative decoding only the rule is mutated (core/methods/speculative/rule.py; formerly fenced off with
# mutmut's "no mutate" pragmas in the scratch copy, never in the repository).
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
work="${1:-/tmp/decodelab-mutation}"
shift || true  # the rest: mutant name patterns

MUTATE_ALL=(
    core/sampling/chain.py
    core/sampling/scaling.py
    core/sampling/penalties.py
    core/sampling/filters.py
    core/sampling/biases.py
    core/sampling/select.py
    core/sampling/step.py
    core/engine/stopping.py
    core/engine/tokens.py
    core/trace/stats.py
    core/methods/speculative/rule.py
    cli/view/render.py
    cli/view/steps_view.py
    cli/view/fit.py
    cli/view/live.py
)
TESTS=(
    tests/sampling/test_processors.py
    tests/sampling/test_chain.py
    tests/sampling/test_select.py
    tests/engine/test_stopping.py
    tests/engine/test_tokens.py
    tests/trace/test_stats.py
    tests/cli/test_render.py
    tests/cli/test_steps_view.py
    tests/cli/test_fit.py
    tests/methods/test_decode.py::test_step_numbers_are_labelled_consistently
    tests/methods/test_decode.py::test_same_seed_same_trace_other_seed_other_trace
    tests/methods/test_decode.py::test_stop_strings_and_context_limit
    tests/methods/test_decode.py::test_multinomial_selector_follows_the_distribution
    tests/methods/test_decode.py::test_the_chi_square_check_rejects_a_biased_sampler
    tests/methods/test_decode.py::test_multinomial_never_draws_a_removed_token
    tests/methods/test_decode.py::test_greedy_with_eos_stops_where_generate_stops
    tests/methods/test_speculative.py::test_accept_probability_and_residual_on_hand_vectors
    tests/methods/test_speculative.py::test_verify_sampled_hand_block
    tests/methods/test_speculative.py::test_verify_greedy_hand_block
    tests/methods/test_speculative.py::test_predicted_speedup_formula
    tests/methods/test_speculative.py::test_first_two_tokens_follow_the_target_distribution
    tests/methods/test_speculative.py::test_final_kind
    tests/methods/test_speculative.py::test_speculative_draws_come_from_the_runs_generator
    tests/methods/test_speculative.py::test_point_masses_are_float_distributions
    tests/methods/test_speculative.py::test_residual_is_normalised_per_row
    tests/methods/test_speculative.py::test_a_draft_the_target_gives_probability_zero_is_never_accepted
    tests/cli/test_cli.py
    tests/sampling/test_samplers.py::test_stop_ids_and_trim_stop
)
read -r -a mutate <<< "${MUTATE:-${MUTATE_ALL[*]}}"
for file in "${mutate[@]}"; do
    [ -f "$repo/$file" ] || { echo "MUTATE: no file $file in $repo" >&2; exit 2; }
done
toml_list() { local item; for item in "$@"; do printf '    "%s",\n' "$item"; done; }
rm -rf "$work"
mkdir -p "$work/decodelab"
touch "$work/decodelab/__init__.py"
for part in core cli presets; do
    cp -r "$repo/$part" "$work/decodelab/$part"
done
cp -r "$repo/presets" "$work/presets"  # tests find the bundled tokenizer and weights at the repository root
cp -r "$repo/tests" "$work/tests"
rm -rf "$work/tests/mutation"
find "$work" -name __pycache__ -prune -exec rm -rf {} +

# the speculative rule is its own module (core/methods/speculative/rule.py): no fence needed

cat > "$work/pyproject.toml" <<TOML
[tool.mutmut]
source_paths = ["decodelab/"]
only_mutate = [
$(toml_list "${mutate[@]/#/decodelab/}")
]
also_copy = ["tests/", "presets/"]
pytest_add_cli_args = ["-p", "no:cacheprovider", "-m", "not slow and not gpu"]
pytest_add_cli_args_test_selection = [
$(toml_list "${TESTS[@]}")
]

[tool.pytest.ini_options]
testpaths = ["tests"]
markers = ["slow: heavier checks", "gpu: needs CUDA"]
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
        counts[name.split(".x")[0].split(".x\u01c1")[0]][status] += 1
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
