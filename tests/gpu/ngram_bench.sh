#!/usr/bin/env bash
# Prompt lookup on one GPU: scripts/bench.py over HTTP against `specd serve --device cuda`
# without and with --speculative ngram, on the copy and chat sets of
# scripts/workloads/copy-chat.jsonl (greedy, --no-ignore-eos), and the start-up cost model
# (ms per plain / verify step) from the server log. Extra serve options (e.g. an
# environment switch's A/B) go in SERVE_ARGS; the numbers in README.md came from this.
#   tests/gpu/ngram_bench.sh MODEL.gguf [BIN] [CONCURRENCY]
# Logs and bench.json files go to $OUT (or build/gpu/ngram_logs). Takes ~2-3 minutes on an
# H200 with SmolLM2-135M at 1,8,64,256 and 64 prompts per level.
set -u
cd "$(dirname "$0")/../.."
M=${1:?model file}
S=${2:-build/specd}
C=${3:-1,8,64,256}
R=${OUT:-build/gpu/ngram_logs}; mkdir -p "$R"
PORT=${PORT:-8301}
serve() {   # serve NAME ARGS...
    local name=$1; shift
    "$S" serve --model "$M" --device cuda --port "$PORT" --max-batch 256 --max-seq-len 2048 --log-level info \
        ${SERVE_ARGS:-} "$@" > "$R/serve_$name.log" 2>&1 &
    PID=$!
    for _ in $(seq 1 240); do curl -sf "127.0.0.1:$PORT/ready" > /dev/null && return 0; sleep 0.5; done
    echo "ngram_bench: server $name did not become ready (see $R/serve_$name.log)" >&2
    return 1
}
stop() { kill "$PID"; wait "$PID" 2> /dev/null; }
B="python3 scripts/bench.py --base-url http://127.0.0.1:$PORT --endpoint chat --workload scripts/workloads/copy-chat.jsonl --no-ignore-eos --save-text --no-plot"
for mode in plain ngram; do
    if [ $mode = ngram ]; then serve $mode --speculative ngram || exit 1; else serve $mode || exit 1; fi
    for set in copy chat; do
        timeout 200 $B --workload-set $set --concurrency "$C" --num-prompts 64 --out "$R/b_${mode}_$set" \
            > "$R/b_${mode}_$set.log" 2>&1
        echo "== $mode $set (rc $?)"
        grep -E "^concurrency" "$R/b_${mode}_$set.log"
    done
    stop
done
grep -E "speculation cost|B +[0-9]+:|never spec|verify k=" "$R/serve_ngram.log"
python3 - "$R" <<'PY'
import json, sys
r = sys.argv[1]
for s in ("copy", "chat"):
    a = json.load(open(f"{r}/b_plain_{s}/bench.json"))["results"]
    b = {lv["concurrency"]: lv for lv in json.load(open(f"{r}/b_ngram_{s}/bench.json"))["results"]}
    print(s + ": " + ", ".join(f"{lv['concurrency']}: {b[lv['concurrency']]['output_tokens_per_s'] / lv['output_tokens_per_s']:.2f}x"
                               for lv in a if lv["concurrency"] in b and lv.get("output_tokens_per_s")))
PY
