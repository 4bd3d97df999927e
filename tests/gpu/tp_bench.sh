#!/usr/bin/env bash
# Tensor-parallel benchmark on a machine with >= 2 GPUs: a Llama-3.1-8B-shaped bf16 model
# (random weights filled on the GPUs), decode at batch 1 and 64 with 512-token prompts,
# TP 1 vs TP 2: ms per step and tokens/s (`specd bench --json`), and the share of a TP 2
# step spent in the all-reduces, measured by leaving them out
# (SPECD_DEBUG_TP_SKIP_ALLREDUCE=1: wrong tokens, same shapes) and taking the difference.
#
#   tests/gpu/tp_bench.sh [BUILD_DIR] [SHAPE]
set -u
cd "$(dirname "$0")/../.."
BUILD=${1:-build}; SHAPE=${2:-llama-3.1-8b}
SPECD=$BUILD/specd
. tests/gpu/gpu_env.sh
B=(--shape "$SHAPE" --device cuda --batch 1,64 --prompt-len 512 --gen ${TP_BENCH_GEN:-128} --max-seq-len 1024 --json)
run() { echo "== $1"; shift; "$@" 2>&1 | grep -E '^\{|error|cuda runner:|tensor parallel' ; }
run "TP 1" "$SPECD" bench "${B[@]}"
run "TP 2" "$SPECD" bench "${B[@]}" --tensor-parallel-size 2 --master-port $((29600 + RANDOM % 2000)) -v
run "TP 2 without all-reduce (timing only)" env SPECD_DEBUG_TP_SKIP_ALLREDUCE=1 "$SPECD" bench "${B[@]}" \
    --tensor-parallel-size 2 --master-port $((29600 + RANDOM % 2000))
