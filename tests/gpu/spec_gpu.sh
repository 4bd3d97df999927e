#!/usr/bin/env bash
# Speculative decoding checks and benchmarks on one GPU, in one go (device time is scarce).
# Runs build/specd (built elsewhere, carried) against the fixture models in .gpu/fixtures.
# Logs go to $OUT (or build/gpu/spec_logs); a summary table is printed last.
# Note: the CUDA runner has no spec_step yet, so speculation runs the composed path
# (forward calls); these checks still prove greedy losslessness and AL on CUDA.
set -u
cd "$(dirname "$0")/../.."
R=${OUT:-build/gpu/spec_logs}; mkdir -p "$R"
L=$(mktemp -d)   # many small logs; only a few files may come back, so they go in one tarball
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$d" ] && LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
pyblas=$(python3 -c 'import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], "lib"))' 2>/dev/null || true)
[ -n "$pyblas" ] && LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:$pyblas"
export LD_LIBRARY_PATH
S=build/specd; M=.gpu/fixtures/models; T=$M/llama-tiny; D=$M/llama-draft
SUM=$L/summary.txt; : > "$SUM"
row() { printf '%-60s %s\n' "$1" "$2" | tee -a "$SUM"; }
ids() { python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print(j.get("all_output_ids", j.get("output_ids")))' "$1" 2>/dev/null; }
al() { python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print(j.get("spec_decode",{}).get("acceptance_length"), j.get("spec_decode",{}).get("verify_steps"))' "$1" 2>/dev/null; }
nvidia-smi -L > "$L/nvidia-smi.txt" 2>&1
P=1,45,120,35,77,912,3,64,200
G() { timeout 120 $S generate --json --ignore-eos --prompt-ids $P "$@"; }
{
for n in 1 3 5 7; do
  for pair in "tiny+draft:$D" "tiny+self:$T"; do
    name=${pair%%:*}; dm=${pair#*:}
    G --model $T --device cuda --max-tokens 64 --n-seqs $n > "$L/base_$n.json" 2>>"$L/err.log"
    G --model $T --device cpu --max-tokens 64 --n-seqs $n > "$L/cpu_$n.json" 2>>"$L/err.log"
    G --model $T --device cuda --max-tokens 64 --n-seqs $n --draft-model $dm > "$L/spec_${name}_$n.json" 2>>"$L/err.log"
    a=$(ids "$L/base_$n.json"); b=$(ids "$L/spec_${name}_$n.json"); c=$(ids "$L/cpu_$n.json")
    if [ -n "$a" ] && [ "$a" = "$b" ]; then r=PASS; else r=FAIL; fi
    [ "$a" = "$c" ] && r="$r (cuda==cpu)" || r="$r (cuda!=cpu)"
    row "lossless $name n=$n" "$r al=$(al "$L/spec_${name}_$n.json")"
  done
done
for n in 1 3 5 7; do
  G --model $T --device cuda --max-tokens 1000 --max-seq-len 1100 --n-seqs $n --draft-model $T --num-draft-tokens 4 > "$L/al_$n.json" 2>>"$L/err.log"
  row "AL tiny self k=4 n=$n (need>=4.5) al,steps" "$(al "$L/al_$n.json")"
done
} 2>&1 | tee "$L/tests.log"
B() { timeout 150 $S bench --device cuda --json "$@"; }
{
B --shape llama-3.2-1b --batch 1,8,32 --prompt-len 128 --gen 64 > "$L/bench_1b_plain.json" 2>>"$L/err.log"
row "bench 1b plain" "$(python3 -c 'import json,sys
for l in open(sys.argv[1]): j=json.loads(l); print(j.get("batch"), j.get("decode_tok_s", j.get("tok_s")), end="; ")' "$L/bench_1b_plain.json" 2>/dev/null)"
for k in 2 4 6; do
  B --shape llama-3.2-1b --draft-layers 4 --num-draft-tokens $k --batch 1,8,32 --prompt-len 128 --gen 64 > "$L/bench_1b_k$k.json" 2>>"$L/err.log"
  row "bench 1b draft-layers 4 k=$k" "see bench_1b_k$k.json"
done
B --shape llama-3.1-8b --batch 1,8,32 --prompt-len 128 --gen 32 > "$L/bench_8b_plain.json" 2>>"$L/err.log"
row "bench 8b plain" "rc=$? see bench_8b_plain.json"
B --shape llama-3.1-8b --draft-layers 4 --num-draft-tokens 4 --batch 1,8,32 --prompt-len 128 --gen 32 > "$L/bench_8b_k4.json" 2>>"$L/err.log"
row "bench 8b draft-layers 4 k=4" "rc=$?"
} 2>&1 | tee "$L/bench.log"
cat "$L"/bench_*.json > "$L/bench_all.json" 2>/dev/null
row "---" "summary above; raw json in tests.log/bench_all.json"
tar czf "$R/spec_logs.tgz" -C "$L" .
cp "$SUM" "$L/tests.log" "$L/bench.log" "$L/err.log" "$L/bench_all.json" "$R/" 2>/dev/null
cat "$L/bench_all.json"
cat "$SUM"
