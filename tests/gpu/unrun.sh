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
# MoE passes split by rows an expert (SPECD_MOE_TCV=N): the kernel test, then prefill and decode
run moe_tcv_split "$G/test_gpu_kernels" "*moe_general*"
for v in -1 16 32; do
    echo "SPECD_MOE_TCV=$v: $(SPECD_MOE_TCV=$v "$B/specd" bench --device cuda --shape qwen3-30b-a3b --batch 1,16,64,256 \
        --prompt-len 128 --gen 32 --max-batch 256 --max-seq-len 256 2>&1 | grep -E '^ +[0-9]' | tr -s ' ' | tr '\n' '|')"
done
# a one-token MoE layer in one launch (SPECD_CUDA_MOE_ONE): the kernel test, memcheck, the runner, the A/B
run moe_one "$G/test_gpu_kernels" "*moe_decode_one*"
run moe_one_memcheck timeout 300 compute-sanitizer --tool memcheck "$G/test_gpu_kernels" "*moe_decode_one*"
run moe_one_runner env SPECD_CUDA_MOE_ONE=1 "$G/test_gpu_runner"
BENCH_MOE_N=1 "$G/bench_moe"   # us a layer, forms one / dec at one token
for v in 0 1 0 1; do
    echo "MOE_ONE=$v: $(SPECD_CUDA_MOE_ONE=$v "$B/specd" bench --device cuda --shape qwen3-30b-a3b --batch 1 --prompt-len 128 \
        --gen 128 --max-batch 8 --max-seq-len 512 2>&1 | grep -E '^ +[0-9]' | tr -s ' ' | tr '\n' '|')"
done
# the L2 requests at batch 1 (SPECD_CUDA_ATTN_L2PF, SPECD_CUDA_MOE_L2PF) and the pipelined key
# loop (SPECD_ATTN_DEC_PIPE): the kernel tests (same bits with and without), then the A/B
run l2_requests "$G/test_gpu_kernels" "*rope_attention*" "*moe_decode*"
run dec_pipe "$G/test_gpu_kernels" "*decode_pipe*"
B1() { "$B/specd" bench --device cuda --batch 1 --gen 128 --max-batch 8 "$@" 2>&1 | grep -E '^ +[0-9]' | tr -s ' ' | tr '\n' '|'; }
for v in 0:0 50:0 50:1024 0:0 50:0 50:1024; do
    echo "L2PF attn:moe=$v: $(SPECD_CUDA_ATTN_L2PF=${v%:*} SPECD_CUDA_MOE_L2PF=${v#*:} B1 --shape qwen3-30b-a3b --prompt-len 128 --max-seq-len 512)"
done
for v in 0 50 0 50; do echo "8B L2PF=$v: $(SPECD_CUDA_ATTN_L2PF=$v B1 --shape llama-3.1-8b --prompt-len 128 --max-seq-len 512)"; done
for v in 0 1 0 1; do
    echo "8B 8k context pipe=$v: $(SPECD_ATTN_DEC_PIPE=$v B1 --shape llama-3.1-8b --prompt-len 8000 --max-seq-len 8192)"
done
grep -h '^    ' "$LOG"/unrun_*.log 2>/dev/null
n_gpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
if [ "${n_gpu:-0}" -ge 2 ]; then run tp_test tests/gpu/tp_test.sh "$B"
else echo "skip tp_test (needs 2 GPUs, found ${n_gpu:-0})"; fi
[ $fail -eq 0 ] && echo "unrun: all passed" || echo "unrun: FAILED"
exit $fail
