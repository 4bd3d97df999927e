#!/usr/bin/env bash
# Run specd's tests and print one summary line. Usage: run-tests.sh unit|http|all BUILD_DIR
#   unit: every cmocka binary in BUILD_DIR/tests (unit + golden tests), then the GPU tests
#         (which report themselves skipped on a machine without a GPU);
#   http: black-box tests against a real `specd serve` (tests/http/run.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
build=${2:-build}
export SPECD_FIXTURES=${SPECD_FIXTURES:-$(cd .. && pwd)/shared/fixtures}
export SPECD_BIN=${SPECD_BIN:-$PWD/$build/specd}
passed=0 failed=0 skipped=0
failed_names=()

run_suite() {   # name, command...
    local name=$1; shift
    local log
    log=$(mktemp)
    echo "=== $name"
    if "$@" >"$log" 2>&1; then status=0; else status=$?; fi
    cat "$log"
    # cmocka: "[  PASSED  ] N test(s)." / "[  FAILED  ] N test(s), listed below:"
    local p f s
    p=$(grep -Eo '^\[  PASSED  \] [0-9]+' "$log" | grep -Eo '[0-9]+$' | awk '{s+=$1} END {print s+0}')
    f=$(grep -Eo '^\[  FAILED  \] [0-9]+ test' "$log" | grep -Eo '[0-9]+' | awk '{s+=$1} END {print s+0}')
    s=$(grep -Eo '^\[  SKIPPED \] [0-9]+' "$log" | grep -Eo '[0-9]+$' | awk '{s+=$1} END {print s+0}')
    # pytest / gpu script: "N passed", "N failed", "N skipped"
    if [ "${p:-0}" = 0 ] && [ "${f:-0}" = 0 ]; then
        p=$(grep -Eo '[0-9]+ passed' "$log" | tail -1 | grep -Eo '[0-9]+' || echo 0)
        f=$(grep -Eo '[0-9]+ (failed|error)' "$log" | tail -1 | grep -Eo '[0-9]+' || echo 0)
        s=$(grep -Eo '[0-9]+ skipped' "$log" | tail -1 | grep -Eo '[0-9]+' || echo 0)
    fi
    passed=$((passed + ${p:-0})); failed=$((failed + ${f:-0})); skipped=$((skipped + ${s:-0}))
    if [ "$status" -ne 0 ]; then
        failed_names+=("$name")
        [ "${f:-0}" = 0 ] && failed=$((failed + 1))
    fi
    rm -f "$log"
}

if [ "$what" = unit ] || [ "$what" = all ]; then
    for t in "$build"/tests/test_*; do
        [ -x "$t" ] || continue
        run_suite "$(basename "$t")" "$t"
    done
    [ -x scripts/gpu-test.sh ] && run_suite gpu bash scripts/gpu-test.sh
fi
if [ "$what" = http ] || [ "$what" = all ]; then
    if [ -x tests/http/run.sh ]; then run_suite http bash tests/http/run.sh; fi
fi

echo
echo "specd tests: $passed passed, $failed failed, $skipped skipped"
if ((${#failed_names[@]})); then
    echo "failing suites: ${failed_names[*]}"
    exit 1
fi
[ "$passed" -gt 0 ] || { echo "no tests ran"; exit 1; }
exit 0
