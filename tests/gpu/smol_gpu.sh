#!/usr/bin/env bash
# The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) on the GPU: `specd serve
# --device cuda` answering chat requests (transcript), greedy output with a draft equal to
# the target vs without (lossless up to bf16 near-ties, and the acceptance length), self-
# speculation with --draft-layers N, and the decode benchmark.
#   tests/gpu/smol_gpu.sh MODEL.gguf OUTDIR        (SPECD_BIN overrides build/specd)
set -u
M=$1
O=$2
B=${SPECD_BIN:-build/specd}
mkdir -p "$O"

echo "== serve"
$B serve --device cuda --model "$M" --port 8011 >"$O/serve.log" 2>&1 &
pid=$!
for _ in $(seq 1 240); do curl -sf localhost:8011/ready >/dev/null && break; sleep 0.25; done
curl -s localhost:8011/v1/chat/completions -H 'Content-Type: application/json' \
  -d '{"messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":40,"temperature":0}' \
  >"$O/chat.json"
curl -sN localhost:8011/v1/chat/completions -H 'Content-Type: application/json' \
  -d '{"messages":[{"role":"user","content":"Write one sentence about the sea."}],"max_tokens":40,"stream":true,"stream_options":{"include_usage":true}}' \
  >"$O/chat_stream.txt"
curl -s localhost:8011/metrics >"$O/metrics.txt"
kill -TERM $pid
wait $pid
echo "serve exit $?" >>"$O/serve.log"
cat "$O/chat.json"; echo; head -c 1500 "$O/chat_stream.txt"; echo

P="Once upon a time, in a small village by the sea, there lived"
echo "== draft == target (k=4) vs no draft"
for n in 1 5; do
    $B generate --device cuda --model "$M" --prompt "$P" --max-tokens 300 --ignore-eos --n-seqs $n --json >"$O/plain_$n.json"
    $B generate --device cuda --model "$M" --draft-model "$M" --num-draft-tokens 4 --prompt "$P" \
        --max-tokens 300 --ignore-eos --n-seqs $n --json >"$O/spec_$n.json"
done
echo "== --draft-layers"
for L in 4 8 15 24; do
    $B generate --device cuda --model "$M" --draft-layers $L --num-draft-tokens 4 --prompt "$P" \
        --max-tokens 300 --ignore-eos --json >"$O/layers_$L.json"
done
echo "== bench"
$B bench --device cuda --model "$M" --batch 1,8,32 --prompt-len 128 --gen 128 >"$O/bench.txt" 2>&1
cat "$O/bench.txt"

python3 - "$O" <<'PY'
import json, sys, os
o = sys.argv[1]
def load(f):
    with open(os.path.join(o, f)) as fh:
        return json.loads(fh.read().strip().splitlines()[-1])
def first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))
for n in (1, 5):
    p, s = load(f"plain_{n}.json"), load(f"spec_{n}.json")
    pa = p.get("all_output_ids", [p["output_ids"]])
    sa = s.get("all_output_ids", [s["output_ids"]])
    d = [first_diff(x, y) for x, y in zip(pa, sa)]
    sd = s.get("spec_decode", {})
    print(f"draft==target n-seqs {n}: identical prefix per seq {d} of {len(pa[0])}; "
          f"AL {sd.get('acceptance_length')} over {sd.get('verify_steps')} verify steps; "
          f"plain {p['tokens_per_s']:.1f} tok/s, spec {s['tokens_per_s']:.1f} tok/s")
base = load("plain_1.json")
for L in (4, 8, 15, 24):
    s = load(f"layers_{L}.json")
    sd = s.get("spec_decode", {})
    print(f"--draft-layers {L}: AL {sd.get('acceptance_length')}, {s['tokens_per_s']:.1f} tok/s "
          f"(no draft {base['tokens_per_s']:.1f}); same tokens as no draft for the first "
          f"{first_diff(base['output_ids'], s['output_ids'])}")
PY
