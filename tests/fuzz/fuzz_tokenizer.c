/* libFuzzer target for the tokenizer. Build and run: scripts/fuzz.sh tokenizer SECONDS
 * (the fixtures' tokenizers from SPECD_FIXTURES, default ../shared/fixtures).
 * The first input byte picks a tokenizer from the fixtures; the rest is the text. Checks:
 * no crash or leak on any bytes; invalid UTF-8 gives SPECD_EUTF8 and nothing else;
 * byte-level tokenizers without a normalizer round-trip exactly; streaming equals the
 * full decode; decode of arbitrary ids (the input read as ids) is valid UTF-8.
 * The loaded tokenizers are process-wide state of this harness only. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/err.h"
#include "engine/text/tok_internal.h"
#include "engine/text/tokenizer.h"

static const char *const NAMES[] = {
    "tokenizers/gguf/ggml-vocab-gpt-2.gguf",  "tokenizers/gguf/ggml-vocab-llama-spm.gguf",
    "tokenizers/hf/qwen3",                    "tokenizers/hf/llama3_1",
    "tokenizers/gguf/ggml-vocab-phi-3.gguf",
};
#define N_TOK (sizeof NAMES / sizeof NAMES[0])
static tok_tokenizer *toks[N_TOK];
static const int exact_round_trip[N_TOK] = {1, 0, 0, 1, 0};

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    const char *dir = getenv("SPECD_FIXTURES");
    if (!dir || !*dir) dir = "../shared/fixtures";
    for (size_t i = 0; i < N_TOK; i++) {
        char path[4096], err[512];
        snprintf(path, sizeof path, "%s/%s", dir, NAMES[i]);
        toks[i] = tok_load(path, err, sizeof err);
        if (!toks[i]) {
            fprintf(stderr, "fuzz_tokenizer: %s\n", err);
            abort();
        }
    }
    return 0;
}

static void check_stream(const tok_tokenizer *t, const int32_t *ids, size_t n) {
    char *full;
    size_t flen;
    if (tok_decode(t, ids, n, 0, &full, &flen) != 0) abort();
    if (tok_utf8_check(full, flen) != flen) abort();   /* decode is always valid UTF-8 */
    tok_stream *s = tok_stream_new(t, 0);
    char piece[1 << 12];
    size_t used = 0;
    for (size_t i = 0; i <= n; i++) {
        int k = i < n ? tok_stream_push(s, ids[i], piece, sizeof piece)
                      : tok_stream_flush(s, piece, sizeof piece);
        if (k < 0) abort();
        if (tok_utf8_check(piece, (size_t)k) != (size_t)k) abort();   /* whole chars only */
        if (used + (size_t)k > flen || memcmp(full + used, piece, (size_t)k)) abort();
        used += (size_t)k;
    }
    if (used != flen) abort();
    tok_stream_free(s);
    free(full);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    size_t which = data[0] % N_TOK;
    const tok_tokenizer *t = toks[which];
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    int32_t *ids = NULL;
    char err[256];
    int n = tok_encode(t, text, len, data[0] & 0x80, &ids, err, sizeof err);
    int valid = tok_utf8_check(text, len) == len;
    if (!valid) {
        if (n != SPECD_EUTF8 || ids) abort();
    } else {
        if (n < 0) abort();
        for (int i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= tok_vocab_size(t)) abort();
        if (exact_round_trip[which] && !(data[0] & 0x80)) {
            char *back;
            size_t blen;
            if (tok_decode(t, ids, (size_t)n, 0, &back, &blen) != 0) abort();
            if (blen != len || memcmp(back, text, len)) abort();
            free(back);
        }
        check_stream(t, ids, (size_t)n);
        free(ids);
    }
    /* the raw bytes as ids: decode must cope with any id sequence */
    size_t m = len / 3;
    int32_t *raw = malloc((m ? m : 1) * sizeof *raw);
    for (size_t i = 0; i < m; i++)
        raw[i] = (int32_t)(((uint32_t)(uint8_t)text[3 * i] << 16 | (uint32_t)(uint8_t)text[3 * i + 1] << 8 |
                            (uint8_t)text[3 * i + 2]) % (uint32_t)tok_vocab_size(t));
    check_stream(t, raw, m);
    free(raw);
    return 0;
}
