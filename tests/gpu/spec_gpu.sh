#!/usr/bin/env bash
# Speculative decoding on one GPU (the captured spec graph of engine/cuda/cuda_spec.c): checks and
# benchmarks in one go, since device time is scarce. Runs binaries built elsewhere and
# carried (build/specd, build/gpu/test_gpu_runner) against the fixture models in
# .gpu/fixtures/models and, when given, the SmolLM2 GGUF.
#   tests/gpu/spec_gpu.sh unit              GPU unit tests (test_gpu_runner), then lossless
#                                           and AL checks on the fixture models
#   tests/gpu/spec_gpu.sh smol SMOL.gguf    SmolLM2: lossless / AL at 1/3/5/7 rows, the
#                                           dummy-reset experiment, --draft-layers, then
#                                           the benchmarks (8B shape, SmolLM2)
# (two modes because the GGUF travels in two device calls). The dummy-reset experiment needs
# a debug build (make DEBUG=1 -> build/debug/specd, or SPECD_DEBUG_BIN): the knob exists
# only there. Timing seen on one H200: unit
# mode ~20 s; smol mode's checks ~2 min, then each 8B-shape bench run takes about a minute
# (mostly start-up), so give smol mode ~7 minutes for everything.
# Logs go to $OUT (or build/gpu/spec_logs); a summary table is printed last.
set -u
cd "$(dirname "$0")/../.."
MODE=${1:-unit}
SMOL=${2:-}
R=${OUT:-build/gpu/spec_logs}; mkdir -p "$R"
L=$(mktemp -d)   # many small logs; only a few files may come back, so they go in one tarball
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
S=build/specd; M=.gpu/fixtures/models; T=$M/llama-tiny; D=$M/llama-draft
SUM=$R/summary_$MODE.txt; : > "$SUM"   # written as it goes: survives a timeout
row() { printf '%-58s %s\n' "$1" "$2" | tee -a "$SUM"; }
# cmp A.json B.json: "same" or the first differing (seq, index) of all_output_ids
cmpj() { python3 - "$1" "$2" <<'PY'
import json, sys
def ids(f):
    j = json.loads(open(f).read().strip().splitlines()[-1])
    return j.get("all_output_ids") or [j["output_ids"]]
try:
    a, b = ids(sys.argv[1]), ids(sys.argv[2])
except Exception as e:
    print("ERR", type(e).__name__); sys.exit()
d = []
for x, y in zip(a, b):
    i = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None)
    if i is None and len(x) != len(y): i = min(len(x), len(y))
    d.append(i)
print("same" if all(i is None for i in d) and len(a) == len(b) else
      "DIFF first index per seq %s of %d" % (d, len(a[0])))
PY
}
# info X.json: AL, verify steps, tok/s
info() { python3 - "$1" <<'PY'
import json, sys
try:
    j = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
except Exception as e:
    print("ERR", type(e).__name__); sys.exit()
sd = j.get("spec_decode", {})
print("AL %s steps %s tok/s %.1f" % (sd.get("acceptance_length"), sd.get("verify_steps"), j.get("tokens_per_s", 0)))
PY
}
nvidia-smi -L > "$L/nvidia-smi.txt" 2>&1

if [ "$MODE" = unit ]; then
  (cd build/gpu && SPECD_FIXTURES=$PWD/../../.gpu/fixtures timeout 100 ./test_gpu_runner) > "$L/unit.log" 2>&1
  row "test_gpu_runner rc" "$?"
  grep -E "^\s+(llama|dummy)|PASSED|FAILED|OK|ERROR|spec" "$L/unit.log" | tee -a "$SUM"
P=1,45,120,35,77,912,3,64,200
G() { timeout 120 $S generate --json --ignore-eos --prompt-ids $P "$@"; }
{
for n in 1 3 5 7; do
  G --model $T --device cuda --max-tokens 64 --n-seqs $n > "$L/base_$n.json" 2>>"$L/err.log"
  for pair in "tiny+draft:$D" "tiny+self:$T"; do
    name=${pair%%:*}; dm=${pair#*:}
    G --model $T --device cuda --max-tokens 64 --n-seqs $n --draft-model $dm -v > "$L/spec_${name}_$n.json" 2>>"$L/err_spec.log"
    row "lossless cuda $name n=$n vs cuda plain" "$(cmpj "$L/base_$n.json" "$L/spec_${name}_$n.json") $(info "$L/spec_${name}_$n.json")"
  done
done
for n in 1 3; do
  G --model $T --device cpu --max-tokens 64 --n-seqs $n > "$L/cpu_$n.json" 2>>"$L/err.log"
  row "tiny cuda plain vs cpu plain n=$n" "$(cmpj "$L/base_$n.json" "$L/cpu_$n.json")"
  row "tiny cuda spec+draft vs cpu plain n=$n" "$(cmpj "$L/spec_tiny+draft_$n.json" "$L/cpu_$n.json")"
done
for n in 1 3 5 7; do
  G --model $T --device cuda --max-tokens 1000 --max-seq-len 1100 --n-seqs $n --draft-model $T --num-draft-tokens 4 > "$L/al_$n.json" 2>>"$L/err.log"
  row "AL tiny self k=4 n=$n (need>=4.5)" "$(info "$L/al_$n.json")"
done
row "runner start-up (spec graphs)" "$(grep -m1 -o 'captured decode sizes.*' "$L/err_spec.log" 2>/dev/null)"
} 2>&1 | tee "$L/tests.log"
fi

if [ "$MODE" = smol ]; then
{
if [ -n "$SMOL" ]; then
  SP="Once upon a time, in a small village by the sea, there lived"
  SG() { timeout 120 $S generate --json --ignore-eos --device cuda --model "$SMOL" --prompt "$SP" --max-seq-len 1400 "$@"; }
  for n in 1 3 5 7; do
    SG --max-tokens 1100 --n-seqs $n > "$L/smol_plain_$n.json" 2>>"$L/err.log"
    SG --max-tokens 1100 --n-seqs $n --draft-model "$SMOL" --num-draft-tokens 4 > "$L/smol_spec_$n.json" 2>>"$L/err.log"
    row "smol plain n=$n" "$(info "$L/smol_plain_$n.json")"
    row "smol draft==target k=4 n=$n (AL>=4.5)" "$(info "$L/smol_spec_$n.json") | vs plain: $(cmpj "$L/smol_plain_$n.json" "$L/smol_spec_$n.json")"
  done
  for n in 3 5; do
    SPECD_DEBUG_SKIP_DUMMY_RESET=1 S=${SPECD_DEBUG_BIN:-build/debug/specd} SG --max-tokens 1100 --n-seqs $n --draft-model "$SMOL" --num-draft-tokens 4 > "$L/smol_noreset_$n.json" 2>>"$L/err.log"
    row "smol k=4 n=$n WITHOUT dummy reset (debug)" "$(info "$L/smol_noreset_$n.json") | vs plain: $(cmpj "$L/smol_plain_$n.json" "$L/smol_noreset_$n.json")"
  done
  for dl in 4 8 15; do
    SG --max-tokens 300 --draft-layers $dl --num-draft-tokens 4 > "$L/smol_layers_$dl.json" 2>>"$L/err.log"
    row "smol --draft-layers $dl k=4 n=1" "$(info "$L/smol_layers_$dl.json") | vs plain: $(cmpj "$L/smol_plain_1.json" "$L/smol_layers_$dl.json")"
  done
fi
} 2>&1 | tee "$L/tests.log"
B() { timeout 150 $S bench --device cuda --json --max-batch 32 "$@"; }
bl() { python3 -c 'import json,sys
for l in open(sys.argv[1]):
    l = l.strip()
    if l.startswith("{"): j = json.loads(l); print("b%d %.3fms AL%.2f" % (j["batch"], j["ms_per_step"], j["acceptance_length"]), end="; ")' "$1" 2>/dev/null; }
{
B --shape llama-3.1-8b --batch 1,8,32 --prompt-len 128 --gen 32 > "$L/bench_8b_plain.json" 2>>"$L/err.log"
row "bench 8b plain (ms per decode step)" "$(bl "$L/bench_8b_plain.json")"
for k in 2 4 6; do
  B --shape llama-3.1-8b --draft-layers 4 --num-draft-tokens $k --batch 1,8,32 --prompt-len 128 --gen 32 > "$L/bench_8b_k$k.json" 2>>"$L/err.log"
  row "bench 8b draft-layers 4 k=$k (ms per spec step)" "$(bl "$L/bench_8b_k$k.json")"
done
if [ -n "$SMOL" ]; then
  timeout 120 $S bench --device cuda --json --model "$SMOL" --batch 1,8,32 --prompt-len 128 --gen 128 > "$L/bench_smol_plain.json" 2>>"$L/err.log"
  row "bench smol plain" "$(bl "$L/bench_smol_plain.json")"
  timeout 120 $S bench --device cuda --json --model "$SMOL" --draft-model "$SMOL" --num-draft-tokens 4 --batch 1,8,32 --prompt-len 128 --gen 128 > "$L/bench_smol_self4.json" 2>>"$L/err.log"
  row "bench smol draft==target k=4" "$(bl "$L/bench_smol_self4.json")"
fi
} 2>&1 | tee "$L/bench.log"
cat "$L"/bench_*.json > "$L/bench_all.json" 2>/dev/null
fi
tail -c 20000 "$L/err.log" > "$L/err_tail.log" 2>/dev/null
tar czf "$R/spec_logs.tgz" -C "$L" .

[ -f "$L/unit.log" ] && cp "$L/unit.log" "$R/"
echo "=== summary ($MODE)"
cat "$SUM"
