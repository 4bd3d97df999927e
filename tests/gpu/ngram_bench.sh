#!/usr/bin/env bash
# Prompt lookup on one GPU: scripts/bench.py over HTTP against `specd serve --device cuda`
# without and with --speculative ngram, on the copy and chat sets of
# scripts/workloads/copy-chat.jsonl (greedy, --no-ignore-eos), and the start-up cost model
# (ms per plain / verify step) from the server log. Extra serve options (e.g. an
# environment switch's A/B) go in SERVE_ARGS; the numbers in README.md came from this.
#   [EXTRA_BODY=JSON] tests/gpu/ngram_bench.sh MODEL.gguf [BIN] [CONCURRENCY]
# Logs and bench.json files go to $OUT (or build/gpu/ngram_logs), one run per level with
# 16 requests per stream up to 1,024 (at least 4 per stream and 64 in all; until
# 2026-12-06 four per stream, until 2026-12-02 64 in all, so its 256-stream level ran 64
# at once).
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
# EXTRA_BODY: request fields for every request, as JSON without spaces, e.g.
# '{"logprobs":true,"top_logprobs":2}'
# (rows the verify graphs do not take: they speculate through the composed path)
[ -n "${EXTRA_BODY:-}" ] && B="$B --extra-body $EXTRA_BODY"
# PLAIN_TWICE=1: a second plain server after the first (plain2), whose texts against the
# first's say how repeatable plain decoding itself is at each level
MODES="plain ngram"; [ "${PLAIN_TWICE:-0}" = 1 ] && MODES="plain plain2 ngram"
for mode in $MODES; do
    if [ $mode = ngram ]; then serve $mode --speculative ngram || exit 1; else serve $mode || exit 1; fi
    for set in copy chat; do
        # each level on its own, with at least four requests per stream and 64 in all (a
        # level of more streams than requests would run fewer at once than it says), and
        # up to 16 per stream below 1,024 (a 64-stream level of 256 requests lasts about a
        # second: plain against plain moved 6% between such runs, on an H100)
        for c in ${C//,/ }; do
            n=$((16 * c)); [ $n -gt 1024 ] && n=1024; [ $n -lt $((4 * c)) ] && n=$((4 * c)); [ $n -lt 64 ] && n=64
            # one Python client process parses about 30k streamed tokens/s: from 64
            # streams the level runs in c/16 processes (8 at most), or the client is the limit
            p=$((c / 16)); [ $p -lt 1 ] && p=1; [ $p -gt 8 ] && p=8
            curl -s "127.0.0.1:$PORT/metrics" > "$R/m0_${mode}_${set}_$c.txt"
            timeout 200 $B --workload-set $set --concurrency "$c" --num-prompts $n --processes $p --out "$R/b_${mode}_${set}_$c" \
                > "$R/b_${mode}_${set}_$c.log" 2>&1
            curl -s "127.0.0.1:$PORT/metrics" > "$R/m1_${mode}_${set}_$c.txt"
            echo "== $mode $set $c streams, $n requests (rc $?)"
            grep -E "^concurrency" "$R/b_${mode}_${set}_$c.log"
        done
    done
    stop
done
grep -E "speculation cost|B +[0-9]+:|never spec|verify k=" "$R/serve_ngram.log"
python3 - "$R" "$C" <<'PY'
import json, sys
r, levels = sys.argv[1], [int(c) for c in sys.argv[2].split(",")]
def res(mode, s, c):
    """A level's result row from its bench.json, {} if it did not run."""
    try:
        return json.load(open(f"{r}/b_{mode}_{s}_{c}/bench.json"))["results"][0]
    except (OSError, KeyError, IndexError, ValueError):
        return {}
def rate(mode, s, c, key="output_tokens_per_s"):
    return res(mode, s, c).get(key)
def steps(mode, s, c):
    """The engine's steps during a level (/metrics before and after): all, queued in
    flight, verified by the runner, with drafts."""
    def read(w):
        m = {}
        try:
            for line in open(f"{r}/m{w}_{mode}_{s}_{c}.txt"):
                if line.startswith("specd:") and " " in line:
                    k, v = line.rsplit(" ", 1)
                    m[k.split("{")[0] + ("{" + k.split("{")[1].split(",")[0] + "}" if "{path" in k else "")] = float(v)
        except OSError:
            pass
        return m
    a, b = read(0), read(1)
    d = lambda k: b.get(k, 0) - a.get(k, 0)
    total = sum(d(k) for k in b if k.startswith("specd:engine_steps_total"))
    return total, d("specd:engine_async_steps_total"), d('specd:engine_steps_total{path="verify"}'), \
        d("specd:spec_decode_num_speculated_steps_total"), d("specd:spec_decode_num_composed_steps_total")
for s in ("copy", "chat"):
    for c in levels:
        for mode in ("plain", "ngram"):
            t, a_, v, sp, cp = steps(mode, s, c)
            if t:
                print(f"{s} {c} {mode}: {t:.0f} steps, {a_ / t:.2f} in flight, {v / t:.2f} verify, {sp / t:.2f} with drafts"
                      f" ({cp / t:.2f} composed)")
# out tok/s ratios, and TPOT p50 plain / ngram (open chat's outputs differ in length
# between the servers, near-ties, so its token rates move with them; TPOT does not)
for s in ("copy", "chat"):
    parts = []
    for c in levels:
        a, b = rate("plain", s, c), rate("ngram", s, c)
        ta, tb = rate("plain", s, c, "tpot_p50_ms"), rate("ngram", s, c, "tpot_p50_ms")
        tp = f" (TPOT {ta:.2f} / {tb:.2f} ms)" if ta and tb else ""
        parts.append(f"{c}: {b / a:.2f}x{tp}" if a and b else f"{c}: -")
    print(s + ": " + ", ".join(parts))
# acceptance length and the share of a request's decode steps that verified drafts (the
# ngram runs' usage.spec_decode), and greedy texts equal to plain's
for s in ("copy", "chat"):
    parts = []
    for c in levels:
        a, b = res("plain", s, c), res("ngram", s, c)
        if not a or not b:
            parts.append(f"{c}: -")
            continue
        ta, tb, t2 = a.get("texts") or [], b.get("texts") or [], res("plain2", s, c).get("texts")
        same = sum(1 for x, y in zip(ta, tb) if x == y)
        same2 = f" (plain against plain {sum(1 for x, y in zip(ta, t2) if x == y)})" if t2 else ""
        al, sh = b.get("acceptance_length"), b.get("speculated_share")
        parts.append(f"{c}: AL {al:.2f}, {100 * sh:.0f}% of steps verified, {same} of {len(tb)} texts equal{same2}"
                     if al and sh is not None else f"{c}: {same} of {len(tb)} texts equal{same2}")
    print(s + ": " + "; ".join(parts))
PY
