#!/usr/bin/env bash
# libFuzzer targets: the OpenAI request parser (server/api.c), the SSE writer
# (server/sse.c + api_sse_event), model files (GGUF reader, model loader, GGUF
# tokenizer), chat templates (engine/text/tmpl*.c) and the tokenizers.
#
#   scripts/fuzz.sh api 600          build fuzz_api, fuzz it for 600 s on tests/fuzz/corpus_api
#   scripts/fuzz.sh sse|gguf|tmpl|tokenizer 600     the same for the other targets
#   scripts/fuzz.sh build            build every target, run nothing
#   scripts/fuzz.sh merge TARGET     minimise the corpus in place (-merge=1)
# fuzz_tokenizer reads the fixtures' tokenizers (SPECD_FIXTURES, default ../shared/fixtures);
# seeds of fuzz_gguf come from tests/fuzz/make_gguf_seeds.py.
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

# Sources each target instruments for coverage (-fsanitize=fuzzer-no-link); every other
# engine object is linked with the sanitizers only.
instrumented() {  # target
    case $1 in
        api|sse) echo server/api.c server/api_constraint.c server/api_messages.c server/api_responses.c server/sbuf.c server/sse.c ;;
        gguf) echo engine/model/gguf.c engine/model/model.c engine/text/tok_gguf.c ;;
        tmpl) echo engine/text/tmpl*.c ;;
        tokenizer) echo engine/text/tokenizer.c engine/text/tok_*.c ;;
    esac
}

# An object to rebuild: missing, older than its source, or older than any header (a struct
# that grew would otherwise be read past its end by objects built before).
stale() {  # source object
    [[ ! -f $2 || $1 -nt $2 || -n $(find server engine kernels -name '*.h' -newer "$2" -print -quit) ]]
}

build_one() {  # target
    local t=$1 objs=() src
    local -a inst
    read -r -a inst <<< "$(instrumented "$t")"
    mkdir -p "$OUT/obj/$t" "$OUT/artifacts/$t"
    for src in "${inst[@]}"; do
        local o="$OUT/obj/$t/${src%.c}.fuzz.o"
        mkdir -p "$(dirname "$o")"
        if stale "$src" "$o"; then
            $CC $CFLAGS -fsanitize=fuzzer-no-link $SAN -c "$src" -o "$o"
        fi
        objs+=("$o")
    done
    for src in engine/*/*.c; do
        [[ $src == engine/cuda/* || " ${inst[*]} " == *" $src "* ]] && continue
        local o="$OUT/obj/${src%.c}.o"
        mkdir -p "$(dirname "$o")"
        if stale "$src" "$o"; then
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

max_len() {  # target: the largest input it is given (model files need room for tensors)
    case $1 in gguf) echo 327680 ;; *) echo 8192 ;; esac
}

# The corpus a target keeps: tests/fuzz/corpus_<t> in the repository, except fuzz_gguf's
# (model files: hundreds of KB each) and fuzz_tmpl's (grown from the fixtures' templates,
# which stay in the fixtures), which live under $OUT.
corpus_of() {  # target
    case $1 in gguf|tmpl) echo "$OUT/corpus_kept_$1" ;; *) echo "tests/fuzz/corpus_$1" ;; esac
}

# Seeds made at run time into $OUT/seeds_<t>: fuzz_gguf's tiny models
# (tests/fuzz/make_gguf_seeds.py); fuzz_tmpl's tests/fuzz/seeds_tmpl (templates written
# for it) and the fixture models' chat templates, read from the fixtures (SPECD_FIXTURES)
# rather than copied into the repository.
make_seeds() {  # target
    local t=$1 dir="$OUT/seeds_$1"
    mkdir -p "$dir"
    case $t in
        gguf) [[ -n $(ls "$dir") ]] || python3 tests/fuzz/make_gguf_seeds.py "$dir" >/dev/null ;;
        tmpl) cp tests/fuzz/seeds_tmpl/* "$dir"/
              python3 - "${SPECD_FIXTURES:-../shared/fixtures}" "$dir" <<'PY'
import glob, json, os, sys
fx, out = sys.argv[1], sys.argv[2]
for i, f in enumerate(sorted(glob.glob(os.path.join(fx, "**", "tokenizer_config.json"), recursive=True))):
    t = json.load(open(f)).get("chat_template")
    for j, src in enumerate(t if isinstance(t, list) else [t] if t else []):
        src = src["template"] if isinstance(src, dict) else src
        open(os.path.join(out, f"fixture_{i}_{j}.jinja"), "w").write(src)
PY
        ;;
    esac
    echo "$dir"
}

run_one() {  # target seconds
    local t=$1 secs=$2 corpus scratch="$OUT/corpus_$1" seeds
    corpus=$(corpus_of "$t")
    seeds=$(make_seeds "$t")
    mkdir -p "$corpus" "$scratch" "$OUT/artifacts/$t"
    echo "== fuzz_$t for ${secs}s (corpus $corpus, seeds $seeds, scratch $scratch)"
    set +e
    "$OUT/fuzz_$t" "$scratch" "$corpus" "$seeds" -max_total_time="$secs" -print_final_stats=1 \
        -max_len="$(max_len "$t")" -timeout=10 -rss_limit_mb=2048 \
        -artifact_prefix="$OUT/artifacts/$t/" ${FUZZ_ARGS:-}
    local rc=$?
    set -e
    merge_one "$t"
    echo "== fuzz_$t exit $rc; artifacts: $(ls "$OUT/artifacts/$t" | wc -l)"
    return $rc
}

merge_one() {  # target: minimise its corpus + scratch into its corpus
    local t=$1 corpus scratch="$OUT/corpus_$1" tmp
    corpus=$(corpus_of "$t")
    mkdir -p "$corpus" "$scratch"
    tmp=$(mktemp -d)
    "$OUT/fuzz_$t" -merge=1 -max_len="$(max_len "$t")" "$tmp" "$corpus" "$scratch" 2>&1 | grep -E "MERGE-OUTER: [0-9]+ new files" || true
    rm -f "$corpus"/*
    cp "$tmp"/* "$corpus"/ 2>/dev/null || true
    rm -rf "$tmp"
    echo "== corpus of $t ($corpus): $(ls "$corpus" | wc -l) files, $(cat "$corpus"/* 2>/dev/null | wc -c) bytes"
}

TARGETS="api sse gguf tmpl tokenizer"
case "${1:-}" in
    api|sse|gguf|tmpl|tokenizer) build_one "$1"; run_one "$1" "${2:-600}" ;;
    build) for t in $TARGETS; do build_one "$t"; done ;;
    merge) build_one "$2"; merge_one "$2" ;;
    *) echo "usage: $0 api|sse|gguf|tmpl|tokenizer [SECONDS] | build | merge TARGET" >&2; exit 2 ;;
esac
