#!/usr/bin/env bash
# Run specd's GPU tests (tests/gpu/) on a machine with an NVIDIA GPU. Builds nothing:
# build first with `make -f tests/gpu/Makefile` (here or on the GPU machine).
#
#   scripts/gpu-test.sh [tests|sanitize|hf|bench|all] [BUILD_DIR]
#
# tests    : kernel tests + runner tests on the golden fixtures (default)
# sanitize : the same under compute-sanitizer memcheck and racecheck
# hf       : live comparison with HF transformers on random models of real shapes
# bench    : decode / prefill benchmarks (specd and HF transformers)
# Without a GPU it prints "gpu tests: N skipped (no GPU)" and exits 0 (make test calls it).
# Logs go to $GPU_LOG_DIR (default build/gpu/logs).
set -u
mode=${1:-tests}
BUILD=${2:-build}
G=$BUILD/gpu
cd "$(dirname "$0")/.."

count_tests() { cat tests/gpu/test_gpu_*.c 2>/dev/null | grep -c 'cmocka_unit_test(' ; }
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu tests: $(count_tests) skipped (no GPU)"
    exit 0
fi
for b in test_gpu_kernels test_gpu_gemv test_gpu_runner; do
    if [ ! -x "$G/$b" ]; then
        echo "gpu tests: $G/$b missing: build with 'make -f tests/gpu/Makefile'" >&2
        exit 1
    fi
done

# cuBLAS: the toolkit's, else the copy that ships with PyTorch's wheels.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$d" ] && LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
pyblas=$(python3 -c 'import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], "lib"))' 2>/dev/null || true)
[ -n "$pyblas" ] && LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:$pyblas"
export LD_LIBRARY_PATH
export SPECD_FIXTURES=${SPECD_FIXTURES:-../shared/fixtures}
[ -d "$SPECD_FIXTURES/models" ] || { [ -d .gpu/fixtures/models ] && export SPECD_FIXTURES=.gpu/fixtures; }
LOG=${GPU_LOG_DIR:-$G/logs}
mkdir -p "$LOG"
fail=0

run() {   # name, command...
    local name=$1; shift
    echo "== $name"
    if "$@" >"$LOG/$name.log" 2>&1; then
        tail -n 40 "$LOG/$name.log"; echo "== $name: ok"
    else
        local rc=$?
        tail -n 60 "$LOG/$name.log"; echo "== $name: FAILED (rc $rc)"; fail=1
    fi
}

if [ "$mode" = tests ] || [ "$mode" = all ]; then
    run kernels "$G/test_gpu_kernels"
    run gemv "$G/test_gpu_gemv"
    run runner "$G/test_gpu_runner"
fi
if [ "$mode" = sanitize ] || [ "$mode" = all ]; then
    CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    run memcheck_kernels "$CS" --tool memcheck --error-exitcode 9 "$G/test_gpu_kernels"
    run racecheck_kernels "$CS" --tool racecheck --error-exitcode 9 "$G/test_gpu_kernels"
    run memcheck_gemv "$CS" --tool memcheck --error-exitcode 9 "$G/test_gpu_gemv"
    run racecheck_gemv "$CS" --tool racecheck --error-exitcode 9 "$G/test_gpu_gemv"
    run racecheck_runner "$CS" --tool racecheck --error-exitcode 9 "$G/test_gpu_runner"
    run memcheck_runner "$CS" --tool memcheck --error-exitcode 9 "$G/test_gpu_runner"
fi
if [ "$mode" = hf ] || [ "$mode" = all ]; then
    run hf_compare env PYTHONUNBUFFERED=1 python3 tests/gpu/hf_compare.py --bin "$G/gpu_generate"
fi
if [ "$mode" = bench ] || [ "$mode" = all ]; then
    run bench_specd "$G/bench_decode"
    run bench_hf env PYTHONUNBUFFERED=1 python3 tests/gpu/bench_hf.py --specd "$LOG/bench_specd.log"
fi
[ $fail = 0 ] && echo "gpu tests: all passed ($mode)" || echo "gpu tests: FAILURES ($mode)"
exit $fail
