#!/usr/bin/env bash
# Tensor-parallel benchmark on a machine with >= 2 GPUs: a Llama-3.1-8B-shaped bf16 model
# (random weights filled on the GPUs), decode at batch 1 and 64 with 512-token prompts,
# `specd bench --json` (ms per step, tokens/s):
#   - TP 1, TP 2 (lm_head split by vocabulary, the default), TP 2 with the lm_head
#     replicated (SPECD_TP_VOCAB_SPLIT=0);
#   - the share of a TP 2 step spent in collectives, by leaving them out
#     (SPECD_DEBUG_TP_SKIP_ALLREDUCE=1: wrong tokens, same shapes; a debug build's knob,
#     make DEBUG=1, so give BUILD_DIR=build/debug for that row) and taking the difference;
#   - speculative steps with a Llama-3.2-1B-shaped draft (k = 4): TP 1, TP 2 with the draft
#     replicated (default) and sharded (SPECD_TP_SHARD_DRAFT=1).
#
#   tests/gpu/tp_bench.sh [BUILD_DIR] [SHAPE] [DRAFT_SHAPE]
set -u
cd "$(dirname "$0")/../.."
BUILD=${1:-build}; SHAPE=${2:-llama-3.1-8b}; DRAFT=${3:-llama-3.2-1b}
SPECD=$BUILD/specd
. tests/gpu/gpu_env.sh
B=(--shape "$SHAPE" --device cuda --batch 1,64 --prompt-len 512 --gen ${TP_BENCH_GEN:-128} --max-seq-len 1024 --json)
S=(--shape "$SHAPE" --draft-shape "$DRAFT" --num-draft-tokens 4 --device cuda --batch 1,16 --prompt-len 512
   --gen 64 --max-seq-len 1024 --max-batch 16 --json)
mp() { echo $((29600 + RANDOM % 2000)); }
run() { echo "== $1"; shift; "$@" 2>&1 | grep -E '^\{|rror' ; }
run "TP 1" "$SPECD" bench "${B[@]}"
run "TP 2, lm_head split by vocabulary" "$SPECD" bench "${B[@]}" --tensor-parallel-size 2 --master-port "$(mp)"
run "TP 2, lm_head replicated" env SPECD_TP_VOCAB_SPLIT=0 "$SPECD" bench "${B[@]}" --tensor-parallel-size 2 --master-port "$(mp)"
run "TP 2 without collectives (timing only)" env SPECD_DEBUG_TP_SKIP_ALLREDUCE=1 "$SPECD" bench "${B[@]}" \
    --tensor-parallel-size 2 --master-port "$(mp)"
run "speculative TP 1 ($DRAFT draft, k=4)" "$SPECD" bench "${S[@]}"
run "speculative TP 2, draft replicated" "$SPECD" bench "${S[@]}" --tensor-parallel-size 2 --master-port "$(mp)"
run "speculative TP 2, draft sharded" env SPECD_TP_SHARD_DRAFT=1 "$SPECD" bench "${S[@]}" --tensor-parallel-size 2 \
    --master-port "$(mp)"
