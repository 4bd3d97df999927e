#!/usr/bin/env bash
# A quantized GGUF on one GPU (issue #17): specd with the file's Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K
# projections kept in their blocks (--dtype gguf) against the same file dequantized to
# bf16 at load (--dtype bf16), and llama.cpp on the same file when its directory is given:
# weights GiB, prefill and decode tok/s at batch 1 / 8 / 64 / 256 (128 prompt, 128
# generated tokens), greedy tokens of the two specd forms and their top-5 logprobs, and
# batch-1 ms/token as a fraction of the copy roofline on the file's bytes.
#   tests/gpu/quant_bench.sh MODEL.gguf [BIN] [LLAMA_CPP_DIR]
# A file to run: tests/gpu/make_gguf.py --shape llama-3.2-1b, then llama-quantize ... Q4_K_M.
# Run build/gpu/test_gpu_gemv first (k_gemv_q / k_dequant_q / k_gemm_q against the host decode).
set -u
cd "$(dirname "$0")/../.."
M=${1:?a GGUF with quantized matrices}
S=${2:-build/specd}
Q=${3:-}
R=${OUT:-build/gpu/quant_logs}; mkdir -p "$R"
P="--prompt-ids 2,651,6037,576,9407,603,573,1546,576,10021,2351,578"
# Variants (VARIANTS, default "bf16 gguf gguf_gemv"): gguf is the build's defaults (Q4_K /
# Q5_K passes of 8..16 tokens on the tensor-core GEMV k_gemv_qtc); gguf_gemv with that off
# (SPECD_CUDA_GEMVQ_TC=0: k_gemv_q up to 8 tokens, then dequantize + cuBLAS); gguf_qtc all
# K-quant passes of 1..16 tokens on it, Q6_K too (SPECD_CUDA_GEMVQ_TC_MIN=1,
# SPECD_CUDA_GEMVQ_TC_Q6K=1); gguf_tc passes of GEMM_Q_MIN..GEMM_Q_ROWS tokens (default
# 9..256) on the tensor-core GEMM over the blocks (k_gemm_q); gguf_lmbf16 with the output
# matrix dequantized to bf16 at load (SPECD_CUDA_LM_HEAD_BF16=1; the embedding stays in
# its blocks); gguf_noi8 with the activations of Q8_0 / Q4_0 / Q4_1 passes kept in bf16
# (SPECD_CUDA_GEMVQ_I8=0 SPECD_CUDA_GEMM_QI8_ROWS=0: no k_gemv_qi8 / k_gemm_qi8, the
# build before them); gguf_i8 with GEMV passes of GEMVQ_I8 (default 1) or more tokens on
# int8 activations and Q8_0 passes of 9 .. GEMM_QI8_ROWS (default 64) tokens on the int8
# tensor-core GEMM (SPECD_CUDA_GEMVQ_I8, SPECD_CUDA_GEMM_QI8_ROWS); gguf_i8k with the
# K-quants' GEMV passes of GEMVQ_I8_K (default 1) or more tokens on int8 activations too
# (SPECD_CUDA_GEMVQ_I8_K; all three are the defaults since 2026-12-05); gguf_l2pf with the
# decode attention asking L2 for the O projection's blocks at batch 1-2
# (SPECD_CUDA_ATTN_L2PF=ATTN_L2PF, default 50% of the L2; not yet run, tests/gpu/UNRUN.md).
VARIANTS=${VARIANTS:-bf16 gguf gguf_gemv}
for v in $VARIANTS; do
    d=${v%%_*}
    env=()
    case $v in
        gguf_qtc) env=(SPECD_CUDA_GEMVQ_TC_MIN=1 SPECD_CUDA_GEMVQ_TC_Q6K=1) ;;
        gguf_gemv) env=(SPECD_CUDA_GEMVQ_TC=0) ;;
        gguf_lmbf16) env=(SPECD_CUDA_LM_HEAD_BF16=1) ;;
        gguf_i8) env=(SPECD_CUDA_GEMVQ_I8=${GEMVQ_I8:-1} SPECD_CUDA_GEMM_QI8_ROWS=${GEMM_QI8_ROWS:-64}) ;;
        gguf_noi8) env=(SPECD_CUDA_GEMVQ_I8=0 SPECD_CUDA_GEMM_QI8_ROWS=0 SPECD_CUDA_GEMVQ_I8_K=0) ;;
        gguf_i8k) env=(SPECD_CUDA_GEMVQ_I8_K=${GEMVQ_I8_K:-1}) ;;
        gguf_tc) env=(SPECD_CUDA_GEMM_Q_MIN=${GEMM_Q_MIN:-9} SPECD_CUDA_GEMM_Q_ROWS=${GEMM_Q_ROWS:-256}) ;;
        gguf_l2pf) env=(SPECD_CUDA_ATTN_L2PF=${ATTN_L2PF:-50}) ;;
    esac
    env "${env[@]}" timeout 200 "$S" bench --model "$M" --device cuda --dtype $d --batch 1,8,64,256 \
        --prompt-len 128 --gen 128 --max-batch 256 --max-seq-len 512 -v > "$R/bench_$v.log" 2>&1
    echo "== specd $v: --dtype $d ${env[*]} (rc $?): $(grep -o 'weights [0-9.]* GiB' "$R/bench_$v.log" | head -1)"
    tail -5 "$R/bench_$v.log"
    env "${env[@]}" "$S" generate --model "$M" --device cuda --dtype $d $P --max-tokens 64 --json \
        --top-logprobs 5 > "$R/gen_$v.json" 2> "$R/gen_$v.log"
    # 64 sequences at once: lm_head passes of 64 rows (k_gemm_q on the 8B shape, the
    # chunked dequantize + cuBLAS on the 1B one) where the layers of a 1B pass of 64 take
    # the same dequantize + cuBLAS path as bf16
    env "${env[@]}" "$S" generate --model "$M" --device cuda --dtype $d $P --max-tokens 64 --json --n-seqs 64 \
        --top-logprobs 5 > "$R/gen64_$v.json" 2> "$R/gen64_$v.log"
done
python3 - "$R" "$VARIANTS" <<'PY'
import json, os, sys
r = sys.argv[1]
for g in ("gen", "gen64"):
    try:
        a = json.load(open(f"{r}/{g}_bf16.json"))
    except (OSError, ValueError):
        continue
    for v in sys.argv[2].split():
        try:
            b = json.load(open(f"{r}/{g}_{v}.json"))
        except (OSError, ValueError):
            continue
        if v == "bf16":
            continue
        ta, tb = a["output_ids"], b["output_ids"]
        same = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        tag = f"{v} ({'batch 1' if g == 'gen' else 'first of 64 sequences'})"
        print(f"{tag}: greedy tokens equal to bf16's for the first {same} of {len(ta)}")
        la, lb = a.get("top_logprobs"), b.get("top_logprobs")
        if la and lb:
            d = max(abs(x[j][1] - y[j][1]) for x, y in zip(la[:same + 1], lb[:same + 1]) for j in range(min(len(x), len(y))))
            print(f"{tag}: top-5 logprobs up to the first difference: max |{v} - bf16| = {d:.3e}")
PY
# Batch-1 decode against the copy roofline on the file's quantized bytes: bytes a token
# reads (every tensor but the token embedding table, unless the output reuses it; needs the
# gguf package) over the measured device-to-device copy bandwidth (torch, read + write).
python3 - "$M" "$R" "$VARIANTS" <<'PY' || echo "roofline: not computed (needs torch and gguf)"
import re, sys
import gguf, torch
m, r, variants = sys.argv[1], sys.argv[2], sys.argv[3].split()
rd = gguf.GGUFReader(m)
names = {t.name for t in rd.tensors}
read = sum(int(t.n_bytes) for t in rd.tensors
           if not (t.name == "token_embd.weight" and "output.weight" in names))
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
y = torch.empty_like(x)
for _ in range(3):
    y.copy_(x)
a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
a.record()
for _ in range(20):
    y.copy_(x)
b.record()
torch.cuda.synchronize()
bw = 2 * 20 * x.numel() / (a.elapsed_time(b) / 1e3)
roof_ms = read / bw * 1e3
print(f"roofline: {read / 1e9:.3f} GB read per token, copy bandwidth {bw / 1e9:.0f} GB/s: {roof_ms:.3f} ms/token")
for v in variants:
    for line in open(f"{r}/bench_{v}.log"):
        f = line.split()
        if len(f) >= 4 and f[0] == "1" and re.match(r"^[0-9.]+$", f[3]):
            ms = float(f[3])
            print(f"roofline: {v} batch 1 {ms:.3f} ms/token = {roof_ms / ms:.1%} of the roofline")
            break
PY
if [ -n "$Q" ]; then
    timeout 200 "$Q/llama-batched-bench" -m "$M" -c 70000 -b 2048 -ub 512 -npp 128 -ntg 128 -npl 1,8,64,256 \
        -fa on -ngl 99 > "$R/llama_cpp.log" 2>&1
    echo "== llama.cpp (rc $?)"
    grep -E "^\|" "$R/llama_cpp.log"
    grep -E "CUDA0 model buffer size" "$R/llama_cpp.log" | head -1
fi
