#!/usr/bin/env bash
# Tensor parallelism on a machine with >= 2 NVIDIA GPUs: greedy tokens of
# `specd generate --tensor-parallel-size 2` must equal TP 1, token for token, for every
# golden prompt of each fixture model (llama-tiny; qwen2-tiny: q/k/v bias; qwen3-tiny:
# q/k norm) and for a real checkpoint if one is given.
#
# NOT YET RUNNABLE: `specd generate/serve` do not parse --tensor-parallel-size and the CUDA
# runner refuses world > 1 until the integration in docs/tensor-parallel.md lands. Until
# then this script stops at its first check with exit code 2 ("not integrated"), so CI
# can tell "not ready" from "failed". Remove that guard once the integration is in.
#
#   tests/gpu/tp_test.sh [BUILD_DIR] [extra model dirs...]
set -u
cd "$(dirname "$0")/../.."
BUILD=${1:-build}; shift || true
SPECD=$BUILD/specd
FIX=${SPECD_FIXTURES:-../shared/fixtures}
MAXTOK=${TP_TEST_MAX_TOKENS:-32}

n_gpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
if [ "${n_gpu:-0}" -lt 2 ]; then
    echo "tp_test: skipped (needs 2 GPUs, found ${n_gpu:-0})"; exit 0
fi
[ -x "$SPECD" ] || { echo "tp_test: $SPECD missing: run make first" >&2; exit 1; }
if ! "$SPECD" generate --help 2>&1 | grep -q -- --tensor-parallel-size; then
    echo "tp_test: NOT INTEGRATED: specd generate has no --tensor-parallel-size (see docs/tensor-parallel.md)"
    exit 2
fi
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$d" ] && LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export LD_LIBRARY_PATH NCCL_NVLS_ENABLE=0

prompts() {   # golden.json -> one comma-separated id list per line
    python3 -c 'import json,sys; [print(",".join(map(str,p["prompt"]))) for p in json.load(open(sys.argv[1]))["prompts"]]' "$1"
}

gen() {   # model, tp, ids -> output_ids as a comma list
    timeout 300 "$SPECD" generate --model "$1" --device cuda --tensor-parallel-size "$2" \
        --master-port $((29600 + RANDOM % 1000)) --prompt-ids "$3" --max-tokens "$MAXTOK" \
        --temperature 0 --ignore-eos --json |
        python3 -c 'import json,sys; print(",".join(map(str,json.load(sys.stdin)["output_ids"])))'
}

fail=0; n=0
models=("$FIX/models/llama-tiny" "$FIX/models/qwen2-tiny" "$FIX/models/qwen3-tiny" "$@")
for m in "${models[@]}"; do
    g="$m/golden.json"
    if [ -f "$g" ]; then mapfile -t P < <(prompts "$g"); else P=("1,2,3,4,5,6,7,8"); fi
    for ids in "${P[@]}"; do
        a=$(gen "$m" 1 "$ids") || { echo "FAIL $m TP1 ($ids): generate failed"; fail=1; continue; }
        b=$(gen "$m" 2 "$ids") || { echo "FAIL $m TP2 ($ids): generate failed"; fail=1; continue; }
        n=$((n + 1))
        if [ "$a" != "$b" ]; then
            echo "FAIL $m prompt $ids"; echo "  TP1: $a"; echo "  TP2: $b"; fail=1
        fi
    done
    echo "tp_test: $m: ${#P[@]} prompts compared"
done

# A worker that dies must take the server down non-zero within a bound (no silent hang).
port=$((30700 + RANDOM % 1000))
"$SPECD" serve --model "$FIX/models/llama-tiny" --device cuda --tensor-parallel-size 2 \
    --port "$port" >"$BUILD/tp_serve.log" 2>&1 &
srv=$!
for _ in $(seq 120); do curl -sf "localhost:$port/health" >/dev/null && break; sleep 0.5; done
worker=$(pgrep -P "$srv" | head -1)
if [ -z "$worker" ]; then echo "FAIL serve: no worker process under $srv"; fail=1; kill "$srv"
else
    kill -9 "$worker"; t0=$(date +%s)
    for _ in $(seq 60); do kill -0 "$srv" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$srv" 2>/dev/null; then echo "FAIL serve: still running 30 s after rank 1 died"; kill -9 "$srv"; fail=1
    else wait "$srv"; rc=$?; echo "tp_test: serve exited rc $rc $(( $(date +%s) - t0 )) s after rank 1 died"
        [ "$rc" -ne 0 ] || { echo "FAIL serve exited 0"; fail=1; }
    fi
fi
[ $fail -eq 0 ] && echo "tp_test: ok ($n prompt pairs equal)" || echo "tp_test: FAILED"
exit $fail
