#!/usr/bin/env bash
# The tests of tests/gpu/UNRUN.md in one go (what is built for the GPU but has not run on
# one), each reported ok / FAIL with its log under $LOG; tp_test.sh only with two GPUs.
#
#   tests/gpu/unrun.sh [GPU_BUILD_DIR [SPECD_BUILD_DIR]]     (defaults: build/gpu, build)
set -u
cd "$(dirname "$0")/../.."
G=${1:-build/gpu}
B=${2:-build}
LOG=${GPU_LOG_DIR:-$G/logs}
mkdir -p "$LOG"
export LD_LIBRARY_PATH="$G/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fail=0
run() {   # name, command...
    local name=$1; shift
    if "$@" >"$LOG/unrun_$name.log" 2>&1; then echo "ok   $name"
    else echo "FAIL $name (rc $?): $LOG/unrun_$name.log"; tail -15 "$LOG/unrun_$name.log"; fail=1; fi
}
run spec_chain "$G/test_gpu_runner" "*spec*"
run attn_dec_tc "$G/test_gpu_kernels" "*decode*"
run attn_dec_tc_fp8 "$G/test_gpu_kernels" "*kv_fp8*"
# decode attention: 0 (the default) against 6 (the O^T tensor-core form, 4 blocks per SM),
# at small batches and at long contexts (64 / 256 rows: tests/gpu/BENCH.md, twenty-eighth session)
for d in 0 6; do
    for s in "llama-3.1-8b" "llama-3.2-1b" "llama-3.1-8b --kv-cache-dtype fp8"; do
        echo "SPECD_ATTN_DEC=$d $s: $(SPECD_ATTN_DEC=$d "$B/specd" bench --device cuda --shape $s --batch 1,8,16 \
            --prompt-len 128 --gen 64 --max-batch 16 --max-seq-len 512 2>&1 | grep -E '^ +[0-9]' | tr -s ' ' | tr '\n' ';')"
        echo "SPECD_ATTN_DEC=$d $s, 4096-token prompts: $(SPECD_ATTN_DEC=$d "$B/specd" bench --device cuda --shape $s \
            --batch 1,16 --prompt-len 4096 --gen 64 --max-batch 16 --max-seq-len 8192 2>&1 | grep -E '^ +[0-9]' | tr -s ' ' | tr '\n' ';')"
    done
done
# speculative steps in flight (SPECD_CUDA_SPEC_ASYNC): a draft of the target's first 4 layers
# (rarely right) and of 15 of its 16, every step speculating
for a in 0 1; do
    for dl in 4 15; do
        echo "SPECD_CUDA_SPEC_ASYNC=$a --draft-layers $dl: $(SPECD_CUDA_SPEC_ASYNC=$a "$B/specd" bench --device cuda \
            --shape llama-3.2-1b --draft-layers $dl --spec-always --batch 1,8,32 --prompt-len 128 --gen 128 \
            --max-batch 32 --max-seq-len 512 2>&1 | grep -E '^ +[0-9]' | tr -s ' ' | tr '\n' ';')"
    done
done
grep -h '^    ' "$LOG"/unrun_*.log 2>/dev/null
n_gpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
if [ "${n_gpu:-0}" -ge 2 ]; then run tp_test tests/gpu/tp_test.sh "$B"
else echo "skip tp_test (needs 2 GPUs, found ${n_gpu:-0})"; fi
[ $fail -eq 0 ] && echo "unrun: all passed" || echo "unrun: FAILED"
exit $fail
