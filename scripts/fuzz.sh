#!/usr/bin/env bash
# libFuzzer targets for the OpenAI request parser (server/api.c) and the SSE writer
# (server/sse.c + api_sse_event).
#
#   scripts/fuzz.sh api 600          build fuzz_api, fuzz it for 600 s on tests/fuzz/corpus_api
#   scripts/fuzz.sh sse 600          same for fuzz_sse
#   scripts/fuzz.sh build            build both, run nothing
#   scripts/fuzz.sh merge api|sse    minimise the corpus in place (-merge=1)
#
# Environment: FUZZ_OUT (build + artifacts dir, default build/fuzz), CC (default clang),
# FUZZ_ARGS (extra libFuzzer flags, e.g. "-fork=4").
# Crashes land in $FUZZ_OUT/artifacts/<target>/; new corpus entries are found in a scratch
# directory and merged (minimised) back into tests/fuzz/corpus_<target>/ at the end.
# If -fsanitize=fuzzer does not link: apt-get install -y libclang-rt-14-dev.
set -euo pipefail
cd "$(dirname "$0")/.."

CC=${CC:-clang}
OUT=${FUZZ_OUT:-build/fuzz}
SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
CFLAGS="-std=c11 -D_GNU_SOURCE -g -O1 -I. -pthread -Wall -Wextra"
LIBS="-ljansson -lpcre2-8 -lutf8proc -lm -ldl -pthread"

build_one() {  # target
    local t=$1 objs=() src
    mkdir -p "$OUT/obj/server" "$OUT/artifacts/$t"
    # The code under test gets coverage instrumentation; the engine objects it links
    # against (api.c needs engine_sampling_defaults from engine/core/engine.c, which pulls in
    # the rest of the engine) get only the sanitizers.
    for src in server/api.c server/sse.c; do
        local o="$OUT/obj/${src%.c}.fuzz.o"
        if [[ ! -f $o || $src -nt $o ]]; then
            $CC $CFLAGS -fsanitize=fuzzer-no-link $SAN -c "$src" -o "$o"
        fi
        objs+=("$o")
    done
    for src in engine/*/*.c; do
        [[ $src == engine/cuda/* ]] && continue
        local o="$OUT/obj/${src%.c}.o"
        mkdir -p "$(dirname "$o")"
        if [[ ! -f $o || $src -nt $o ]]; then
            $CC $CFLAGS $SAN -c "$src" -o "$o" &
        fi
        objs+=("$o")
    done
    wait
    local bin="$OUT/fuzz_$t" stale=0
    for src in "tests/fuzz/fuzz_$t.c" "${objs[@]}"; do [[ -f $bin && ! $src -nt $bin ]] || stale=1; done
    if (( stale )); then
        $CC $CFLAGS -fsanitize=fuzzer $SAN "tests/fuzz/fuzz_$t.c" "${objs[@]}" $LIBS -o "$bin"
    fi
}

run_one() {  # target seconds
    local t=$1 secs=$2 corpus="tests/fuzz/corpus_$1" scratch="$OUT/corpus_$1"
    mkdir -p "$corpus" "$scratch" "$OUT/artifacts/$t"
    echo "== fuzz_$t for ${secs}s (corpus $corpus, scratch $scratch)"
    set +e
    "$OUT/fuzz_$t" "$scratch" "$corpus" -max_total_time="$secs" -print_final_stats=1 \
        -max_len=8192 -timeout=10 -rss_limit_mb=2048 \
        -artifact_prefix="$OUT/artifacts/$t/" ${FUZZ_ARGS:-}
    local rc=$?
    set -e
    merge_one "$t"
    echo "== fuzz_$t exit $rc; artifacts: $(ls "$OUT/artifacts/$t" | wc -l)"
    return $rc
}

merge_one() {  # target: minimise tests/fuzz/corpus_<t> + scratch into tests/fuzz/corpus_<t>
    local t=$1 corpus="tests/fuzz/corpus_$1" scratch="$OUT/corpus_$1" tmp
    tmp=$(mktemp -d)
    "$OUT/fuzz_$t" -merge=1 -max_len=8192 "$tmp" "$corpus" "$scratch" 2>&1 | grep -E "MERGE-OUTER: [0-9]+ new files" || true
    rm -f "$corpus"/*
    cp "$tmp"/* "$corpus"/ 2>/dev/null || true
    rm -rf "$tmp"
    echo "== corpus_$t: $(ls "$corpus" | wc -l) files, $(cat "$corpus"/* 2>/dev/null | wc -c) bytes"
}

case "${1:-}" in
    api|sse) build_one "$1"; run_one "$1" "${2:-600}" ;;
    build) build_one api; build_one sse ;;
    merge) build_one "$2"; merge_one "$2" ;;
    *) echo "usage: $0 api|sse [SECONDS] | build | merge api|sse" >&2; exit 2 ;;
esac
