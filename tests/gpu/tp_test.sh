#!/usr/bin/env bash
# Tensor parallelism on a machine with >= 2 NVIDIA GPUs (build/specd built with nvcc):
#  1. greedy tokens of TP 2 equal TP 1 for golden prompts of the fixture models (llama-tiny;
#     qwen2-tiny: q/k/v bias; qwen3-tiny: q/k norm; gemma3-tiny: sandwich norms after the
#     all-reduce; qwen3moe-tiny, mixtral-tiny: every expert split like the MLP);
#  2. the same for random-weight models of real shapes (llama-3.2-1b, qwen2.5-1.5b,
#     qwen3-1.7b, llama-3.1-8b, qwen3-30b-a3b, gemma3-4b; filled on the GPU, each rank its
#     slice), a 512-token
#     prompt and 64 steps, compared up to the first low-margin step (TP 1's top-2 logprob
#     gap < $TP_MARGIN): a difference before it fails, and so does a chosen token's logprob
#     off by more than $TP_LP_TOL while the contexts agree;
#  3. speculative decoding under TP 2 (llama-tiny + llama-draft replicated, k = 4; llama-tiny
#     as a sharded draft) gives TP 1's plain greedy tokens; so does TP 2 with the lm_head
#     replicated instead of split by vocabulary;
#  4. `specd serve --tensor-parallel-size 2`: a stream in flight when rank 1 is SIGKILLed
#     ends with an error, and the server exits non-zero within 30 s.
#
#   tests/gpu/tp_test.sh [BUILD_DIR]
set -u
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
SPECD=$BUILD/specd
FIX=${SPECD_FIXTURES:-../shared/fixtures}
[ -d "$FIX/models" ] || FIX=.gpu/fixtures
# Token checks stop at TP 1's first step whose top-2 logprob gap is under TP_MARGIN: on an
# H200, TP 1 alone with and without the fused decode kernels moved a logprob by up to
# 0.025 (qwen2.5-1.5b shape, random weights), enough to flip a 0.021 gap. Where tokens
# agree, the chosen token's logprob must agree within TP_LP_TOL.
TP_MARGIN=${TP_MARGIN:-0.05}
TP_LP_TOL=${TP_LP_TOL:-0.1}
LOG=${GPU_LOG_DIR:-$BUILD/gpu/logs}
mkdir -p "$LOG"

n_gpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
if [ "${n_gpu:-0}" -lt 2 ]; then
    echo "tp_test: skipped (needs 2 GPUs, found ${n_gpu:-0})"; exit 0
fi
[ -x "$SPECD" ] || { echo "tp_test: $SPECD missing: run make first" >&2; exit 1; }
. tests/gpu/gpu_env.sh
echo "tp_test: NCCL from ${SPECD_NCCL_LIB:-libnccl.so.2 on the loader path}"

port() { echo $((29600 + RANDOM % 2000)); }
fail=0; n=0

gen() {   # out.json, args... (TP size among them)
    local out=$1; shift
    timeout 150 "$SPECD" generate --device cuda --master-port "$(port)" --temperature 0 --ignore-eos --json "$@" \
        >"$out" 2>"$out.err" || { echo "  generate failed ($*):"; tail -5 "$out.err"; return 1; }
}

# compare TP1.json TP2.json label: equal up to the first low-margin step of TP 1
compare() {
    python3 - "$1" "$2" "$3" "$TP_MARGIN" "$TP_LP_TOL" <<'PY'
import json, sys
a, b = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
label, thr, lp_tol = sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
x, y = a["output_ids"], b["output_ids"]
top = a.get("top_logprobs")
first_low = None
if top:
    for i, t in enumerate(top):
        if len(t) > 1 and t[0][1] - t[1][1] < thr:
            first_low = i; break
upto = len(x) if first_low is None else first_low   # the low-margin step itself may differ
same = 0
while same < min(len(x), len(y)) and x[same] == y[same]: same += 1
ok = len(x) == len(y) and (same == len(x) or same >= upto)
# over the steps whose context is still the same, the chosen token's logprob
tb = b.get("top_logprobs")
lp_diff = max((abs(top[i][0][1] - tb[i][0][1]) for i in range(min(same + 1, len(top), len(tb)))
               if top[i] and tb[i] and top[i][0][0] == tb[i][0][0]), default=None) if top and tb else None
if lp_diff is not None and lp_diff > lp_tol:
    ok = False
print(f"{'ok  ' if ok else 'FAIL'} {label}: {same}/{len(x)} tokens equal, first low-margin step "
      f"{'none' if first_low is None else first_low} (margin < {thr}), max logprob diff "
      f"{'n/a' if lp_diff is None else f'{lp_diff:.4f}'}")
if not ok:
    print("  TP1:", x[:80]); print("  TP2:", y[:80])
sys.exit(0 if ok else 1)
PY
}

# Experts and Gemma 3's layers under TP are refused on GPUs until this script has passed
# with them: SPECD_CUDA_TP_UNRUN_LAYERS=1 lets these checks run them.
export SPECD_CUDA_TP_UNRUN_LAYERS=1

# 1. fixtures: their first three golden prompts
for m in llama-tiny qwen2-tiny qwen3-tiny gemma3-tiny qwen3moe-tiny mixtral-tiny; do
    mapfile -t P < <(python3 -c 'import json,sys; [print(",".join(map(str,p["prompt"]))) for p in json.load(open(sys.argv[1]))["prompts"][:3]]' "$FIX/models/$m/golden.json")
    for i in "${!P[@]}"; do
        gen "$LOG/tp_${m}_$i.tp1.json" --model "$FIX/models/$m" --prompt-ids "${P[$i]}" --max-tokens 32 \
            --max-seq-len 512 --max-batch 8 --top-logprobs 2 || { fail=1; continue; }
        gen "$LOG/tp_${m}_$i.tp2.json" --model "$FIX/models/$m" --prompt-ids "${P[$i]}" --max-tokens 32 \
            --max-seq-len 512 --max-batch 8 --tensor-parallel-size 2 --top-logprobs 2 || { fail=1; continue; }
        compare "$LOG/tp_${m}_$i.tp1.json" "$LOG/tp_${m}_$i.tp2.json" "$m prompt $i (${#P[$i]} chars of ids)" || fail=1
        n=$((n + 1))
    done
done

# 2. real shapes, random weights, 512-token prompt, 64 steps
ids=$(python3 -c 'import random; r=random.Random(7); print(",".join(str(r.randrange(1000, 30000)) for _ in range(512)))')
for shape in llama-3.2-1b qwen2.5-1.5b qwen3-1.7b llama-3.1-8b qwen3-30b-a3b gemma3-4b; do
    common=(--shape "$shape" --prompt-ids "$ids" --max-tokens 64 --max-seq-len 1024 --max-batch 8)
    gen "$LOG/tp_$shape.tp1.json" "${common[@]}" --top-logprobs 2 || { fail=1; continue; }
    gen "$LOG/tp_$shape.tp2.json" "${common[@]}" --tensor-parallel-size 2 --top-logprobs 2 -v || { fail=1; continue; }
    compare "$LOG/tp_$shape.tp1.json" "$LOG/tp_$shape.tp2.json" "$shape 512+64" || fail=1
    n=$((n + 1))
done
grep -h "tensor parallel over\|cuda runner:" "$LOG/tp_llama-3.1-8b.tp2.json.err" 2>/dev/null | head -3

# 3. speculative decoding under TP 2 is lossless (draft replicated on both GPUs)
p=$(python3 -c 'import json,sys; print(",".join(map(str,json.load(open(sys.argv[1]))["prompts"][2]["prompt"])))' "$FIX/models/llama-tiny/golden.json")
gen "$LOG/tp_spec.tp1.json" --model "$FIX/models/llama-tiny" --prompt-ids "$p" --max-tokens 48 --max-seq-len 512 --top-logprobs 2 &&
gen "$LOG/tp_spec.tp2.json" --model "$FIX/models/llama-tiny" --draft-model "$FIX/models/llama-draft" \
    --num-draft-tokens 4 --prompt-ids "$p" --max-tokens 48 --max-seq-len 512 --tensor-parallel-size 2 &&
compare "$LOG/tp_spec.tp1.json" "$LOG/tp_spec.tp2.json" "speculative TP2 (llama-draft, k=4) vs plain TP1" || fail=1
python3 -c 'import json,sys; print("  spec_decode:", json.load(open(sys.argv[1])).get("spec_decode"))' "$LOG/tp_spec.tp2.json" 2>/dev/null
# ... and with the draft sharded like the target (SPECD_TP_SHARD_DRAFT=1; llama-tiny as its own draft,
# since llama-draft's single KV head does not split), and with the lm_head replicated
SPECD_TP_SHARD_DRAFT=1 gen "$LOG/tp_spec_sharded.tp2.json" --model "$FIX/models/llama-tiny" \
    --draft-model "$FIX/models/llama-tiny" --num-draft-tokens 4 --prompt-ids "$p" --max-tokens 48 --max-seq-len 512 \
    --tensor-parallel-size 2 &&
compare "$LOG/tp_spec.tp1.json" "$LOG/tp_spec_sharded.tp2.json" "speculative TP2, sharded draft (llama-tiny, k=4) vs plain TP1" || fail=1
python3 -c 'import json,sys; print("  spec_decode:", json.load(open(sys.argv[1])).get("spec_decode"))' "$LOG/tp_spec_sharded.tp2.json" 2>/dev/null
SPECD_TP_VOCAB_SPLIT=0 gen "$LOG/tp_novsplit.tp2.json" --model "$FIX/models/llama-tiny" --prompt-ids "$p" --max-tokens 48 \
    --max-seq-len 512 --tensor-parallel-size 2 &&
compare "$LOG/tp_spec.tp1.json" "$LOG/tp_novsplit.tp2.json" "TP2 with the lm_head replicated vs TP1" || fail=1

# 4. a rank that dies mid-stream takes the server down non-zero, the client gets an error
pt=$(port); mp=$(port)
"$SPECD" serve --model "$FIX/models/llama-tiny" --device cuda --tensor-parallel-size 2 --master-port "$mp" \
    --port "$pt" --max-seq-len 4096 >"$LOG/tp_serve.log" 2>&1 &
srv=$!
for _ in $(seq 240); do curl -sf "localhost:$pt/ready" >/dev/null && break; sleep 0.5; done
curl -sN "localhost:$pt/v1/completions" -H 'content-type: application/json' \
    -d '{"model":"llama-tiny","prompt":[1,2,3,4],"max_tokens":4000,"ignore_eos":true,"stream":true}' >"$LOG/tp_stream.txt" 2>&1 &
cl=$!
sleep 0.5
worker=$(pgrep -P "$srv" | head -1)
if [ -z "$worker" ]; then echo "FAIL serve: no worker process under $srv"; fail=1; kill "$srv"
else
    kill -9 "$worker"; t0=$(date +%s%N)
    for _ in $(seq 300); do kill -0 "$srv" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$srv" 2>/dev/null; then echo "FAIL serve: still running 30 s after rank 1 died"; kill -9 "$srv"; fail=1
    else
        wait "$srv"; rc=$?
        echo "tp_test: serve exited rc $rc $(( ($(date +%s%N) - t0) / 1000000 )) ms after rank 1 was killed"
        [ "$rc" -ne 0 ] || { echo "FAIL serve exited 0"; fail=1; }
    fi
    wait "$cl" 2>/dev/null
    chunks=$(grep -c '"choices"' "$LOG/tp_stream.txt" || true)
    if [ "$chunks" -gt 0 ] && grep -q '"error"' "$LOG/tp_stream.txt"; then echo "ok   client: $chunks chunks, then an error event"
    else echo "FAIL client: wanted chunks then an error event, got $chunks chunks:"; tail -c 300 "$LOG/tp_stream.txt"; fail=1; fi
fi
tail -3 "$LOG/tp_serve.log"
[ $fail -eq 0 ] && echo "tp_test: ok ($n comparisons)" || echo "tp_test: FAILED"
exit $fail
