#!/usr/bin/env bash
# GEMV rows A/B (tests/gpu/BENCH.md, "GEMV rows and verify steps"): for each shape and each
# SPECD_CUDA_GEMV_ROWS value, the start-up cost model of `specd bench --speculative ngram`
# (ms per step of B rows: k0 plain decode, k2 / k4 the verify graph of 2 / 4 drafts a row)
# and decode tok/s at batch 1 / 4 / 8.
#   tests/gpu/gemv_rows_bench.sh [BIN] [SHAPES] [ROWS]
# defaults: build/specd, "llama-3.2-1b llama-3.1-8b", "2 4 8". ~20 s per run on an H200.
set -u
cd "$(dirname "$0")/../.."
S=${1:-build/specd}
SHAPES=${2:-llama-3.2-1b llama-3.1-8b}
ROWS=${3:-2 4 8}
R=${OUT:-build/gpu/gemv_rows_logs}; mkdir -p "$R"
for shape in $SHAPES; do
    for rows in $ROWS; do
        echo "== $shape SPECD_CUDA_GEMV_ROWS=$rows"
        SPECD_CUDA_GEMV_ROWS=$rows timeout 150 "$S" bench --shape "$shape" --device cuda --speculative ngram \
            --batch 1,4,8 --max-batch 64 --prompt-len 128 --gen 64 -v > "$R/${shape}_$rows.log" 2>&1
        grep -E "B +(1|4|8|64):|^ +[0-9]+ +[0-9.]+ +[0-9.]+" "$R/${shape}_$rows.log"
    done
done
