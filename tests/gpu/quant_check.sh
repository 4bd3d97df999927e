#!/usr/bin/env bash
# Quantized weights on the GPU (issue #17, work in progress): a GGUF with Q8_0 / Q4_K / Q6_K
# projections run with them kept in their blocks (SPECD_CUDA_QUANT_WEIGHTS=1) against the
# same file dequantized to bf16 at load (today's path): the logits that chose the first token (max relative
# difference), greedy tokens, weights GiB, and decode tok/s at batch 1 / 8 / 64.
#   tests/gpu/quant_check.sh MODEL.gguf [BIN]
# Run first: build/gpu/test_gpu_gemv (test_gemv_q_matches_host_decode).
set -u
cd "$(dirname "$0")/../.."
M=${1:?a GGUF with Q4_K / Q6_K / Q8_0 matrices, e.g. models/gemma-3-270m-q4_k_m.gguf}
S=${2:-build/specd}
R=${OUT:-build/gpu/quant_logs}; mkdir -p "$R"
P="--prompt-ids 2,651,6037,576,9407,603,573,1546,576,10021,235269,578"
for q in 0 1; do
    SPECD_CUDA_QUANT_WEIGHTS=$q "$S" generate --model "$M" --device cuda $P --max-tokens 48 --logits --json -v \
        > "$R/gen_$q.json" 2> "$R/gen_$q.log"
    grep -o "weights [0-9.]* GiB" "$R/gen_$q.log" | head -1 | sed "s/^/quant $q: /"
    SPECD_CUDA_QUANT_WEIGHTS=$q timeout 200 "$S" bench --model "$M" --device cuda --batch 1,8,64 --prompt-len 128 \
        --gen 64 > "$R/bench_$q.log" 2>&1
    sed "s/^/quant $q: /" "$R/bench_$q.log" | tail -4
done
python3 - "$R" <<'PY'
import json, sys
r = sys.argv[1]
a, b = (json.load(open(f"{r}/gen_{q}.json")) for q in (0, 1))
la, lb = a.get("last_logits") or [], b.get("last_logits") or []
if la and lb:
    d = max(abs(x - y) for x, y in zip(la, lb)) / max(abs(x) for x in la)
    print(f"first-token logits: max |quantized - bf16| / max |bf16| = {d:.2e}")
ta, tb = a["output_ids"], b["output_ids"]
same = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
print(f"greedy tokens equal for the first {same} of {len(ta)}")
PY
