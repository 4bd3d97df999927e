/* Tokenizer tests: every vector HF produced in $SPECD_FIXTURES/tokenizers (GGUF .inp/.out
 * pairs and HF golden.json), the streaming-equals-full-decode property on all of them,
 * decode(encode(s)) == s where HF round-trips, invalid UTF-8, and decoder corner cases.
 * Each fixture test prints one pass-count line per tokenizer and asserts all pass. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include <utf8proc.h>

#include "engine/core/err.h"
#include "engine/text/tok_internal.h"
#include "engine/text/tokenizer.h"
#include "tests/fixtures.h"

/* ---- helpers ---- */

static tok_tokenizer *load_fixture(const char *rel) {
    char err[512] = "";
    tok_tokenizer *t = tok_load(fixture_path(rel), err, sizeof err);
    if (!t) print_error("tok_load(%s): %s\n", rel, err);
    assert_non_null(t);
    return t;
}

/* Streams ids one at a time (small output buffer) and returns the joined text. */
static char *stream_all(const tok_tokenizer *t, const int32_t *ids, size_t n, int skip,
                        size_t *len) {
    tok_stream *s = tok_stream_new(t, skip);
    assert_non_null(s);
    size_t cap = 64, used = 0;
    char *acc = malloc(cap);
    char piece[4096];
    for (size_t i = 0; i <= n; i++) {
        int k = i < n ? tok_stream_push(s, ids[i], piece, sizeof piece)
                      : tok_stream_flush(s, piece, sizeof piece);
        assert_true(k >= 0);
        /* a piece never ends inside a UTF-8 character */
        const char *e = piece + k;
        int tail = 0;
        while (tail < k && tail < 4 && ((unsigned char)e[-1 - tail] & 0xC0) == 0x80) tail++;
        if (k > tail) {
            unsigned char lead = (unsigned char)e[-1 - tail];
            int want = lead < 0x80 ? 1 : lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : 2;
            assert_int_equal(want, tail + 1);
        }
        while (used + (size_t)k + 1 > cap) cap *= 2, acc = realloc(acc, cap);
        memcpy(acc + used, piece, (size_t)k);
        used += (size_t)k;
    }
    acc[used] = 0;
    tok_stream_free(s);
    *len = used;
    return acc;
}

typedef struct { int total, enc, stream, round; } counts;

/* Checks one string: encode == expected ids, streaming == full decode, and (when
 * `round` is set) decode(encode(s)) == s. */
static void check_case(const tok_tokenizer *t, const char *text, size_t len,
                       const int32_t *want, int nwant, int round, counts *c, const char *name,
                       int idx) {
    char err[256] = "";
    int32_t *ids = NULL;
    int n = tok_encode(t, text, len, 0, &ids, err, sizeof err);
    c->total++;
    if (n == nwant && !memcmp(ids, want, sizeof(int32_t) * (size_t)n)) c->enc++;
    else {
        print_message("  %s case %d: encode mismatch (%d ids, want %d): ", name, idx, n, nwant);
        for (int i = 0; i < n && i < 40; i++) print_message("%d ", ids[i]);
        print_message("\n");
    }
    char *full;
    size_t flen, slen;
    assert_int_equal(tok_decode(t, want, (size_t)nwant, 0, &full, &flen), 0);
    char *str = stream_all(t, want, (size_t)nwant, 0, &slen);
    if (slen == flen && !memcmp(str, full, flen)) c->stream++;
    else print_message("  %s case %d: stream != decode\n", name, idx);
    if (round) {
        char *back;
        size_t blen;
        assert_int_equal(tok_decode(t, ids, (size_t)(n > 0 ? n : 0), 0, &back, &blen), 0);
        if (blen == len && !memcmp(back, text, len)) c->round++;
        else print_message("  %s case %d: decode(encode(s)) != s: '%s'\n", name, idx, back);
        free(back);
    } else
        c->round++;
    free(str);
    free(full);
    free(ids);
}

/* llama.cpp's vocab test format: every string is followed by "\n__ggml_vocab_test__\n";
 * .out has one line of space-separated ids per string. */
static void run_gguf(const char *name) {
    char rel[256];
    snprintf(rel, sizeof rel, "tokenizers/gguf/ggml-vocab-%s.gguf", name);
    tok_tokenizer *t = load_fixture(rel);
    char inp_path[4200], out_path[4200];
    snprintf(inp_path, sizeof inp_path, "%s.inp", fixture_path(rel));
    snprintf(out_path, sizeof out_path, "%s.out", fixture_path(rel));
    size_t ilen;
    char *inp = read_all(inp_path, &ilen), *out = read_all(out_path, NULL);
    assert_non_null(inp);
    assert_non_null(out);
    static const char SEP[] = "\n__ggml_vocab_test__\n";
    counts c = {0};
    char *p = inp, *line = out;
    int idx = 0;
    for (char *q; (q = strstr(p, SEP)) != NULL; p = q + strlen(SEP), idx++) {
        char *nl = strchr(line, '\n');
        assert_non_null(nl);
        *nl = 0;
        int32_t want[2048];
        int nw = 0;
        for (char *s = line, *e; *s; s = e) {
            long v = strtol(s, &e, 10);
            if (e == s) break;
            want[nw++] = (int32_t)v;
        }
        line = nl + 1;
        check_case(t, p, (size_t)(q - p), want, nw, 1, &c, name, idx);
    }
    print_message("[tokenizer] gguf %-10s encode %d/%d, stream==decode %d/%d, "
                  "decode(encode)==s %d/%d\n", name, c.enc, c.total, c.stream, c.total,
                  c.round, c.total);
    assert_int_equal(c.total, 46);
    assert_int_equal(c.enc, c.total);
    assert_int_equal(c.stream, c.total);
    assert_int_equal(c.round, c.total);
    free(inp);
    free(out);
    tok_free(t);
}

/* golden.json: HF ids (add_special_tokens=False) and HF's decode of them. */
static void run_hf(const char *name) {
    char rel[256];
    snprintf(rel, sizeof rel, "tokenizers/hf/%s", name);
    tok_tokenizer *t = load_fixture(rel);
    snprintf(rel, sizeof rel, "tokenizers/hf/%s/golden.json", name);
    json_error_t je;
    json_t *g = json_load_file(fixture_path(rel), JSON_ALLOW_NUL, &je);   /* has "\u0000" */
    if (!g) print_error("%s: %s\n", rel, je.text);
    assert_non_null(g);
    counts c = {0};
    int dec_ok = 0;
    size_t i;
    json_t *cs;
    json_array_foreach(json_object_get(g, "cases"), i, cs) {
        const char *text = json_string_value(json_object_get(cs, "text"));
        size_t tlen = json_string_length(json_object_get(cs, "text"));
        const char *dec = json_string_value(json_object_get(cs, "decoded"));
        size_t dlen = json_string_length(json_object_get(cs, "decoded"));
        int nw;
        int32_t *want = json_ids(json_object_get(cs, "ids"), &nw);
        int round = dlen == tlen && !memcmp(dec, text, tlen);
        check_case(t, text, tlen, want, nw, round, &c, name, (int)i);
        char *got;
        size_t glen;
        assert_int_equal(tok_decode(t, want, (size_t)nw, 0, &got, &glen), 0);
        if (glen == dlen && !memcmp(got, dec, dlen)) dec_ok++;
        else print_message("  %s case %zu: decode != HF decode\n", name, i);
        free(got);
        free(want);
    }
    print_message("[tokenizer] hf   %-10s encode %d/%d, decode==HF %d/%d, stream==decode %d/%d, "
                  "decode(encode)==s %d/%d\n", name, c.enc, c.total, dec_ok, c.total, c.stream,
                  c.total, c.round, c.total);
    assert_int_equal(c.total, 68);
    assert_int_equal(c.enc, c.total);
    assert_int_equal(dec_ok, c.total);
    assert_int_equal(c.stream, c.total);
    assert_int_equal(c.round, c.total);
    json_decref(g);
    tok_free(t);
}

/* ---- fixture tests ---- */

static void test_gguf_llama_spm_matches_hf(void **st) { (void)st; run_gguf("llama-spm"); }
static void test_gguf_llama_bpe_matches_hf(void **st) { (void)st; run_gguf("llama-bpe"); }
static void test_gguf_qwen2_matches_hf(void **st) { (void)st; run_gguf("qwen2"); }
static void test_gguf_gpt2_matches_hf(void **st) { (void)st; run_gguf("gpt-2"); }
static void test_gguf_phi3_matches_hf(void **st) { (void)st; run_gguf("phi-3"); }
static void test_hf_qwen3_matches_golden(void **st) { (void)st; run_hf("qwen3"); }
static void test_hf_llama3_1_matches_golden(void **st) { (void)st; run_hf("llama3_1"); }

/* Whitespace as HF (Oniguruma: \\s is Unicode White_Space, so U+180E is not a space
 * but U+0085 is), NFC of decomposed text, Hangul jamo, zero-width chars. Expected ids
 * were produced by HF tokenizers 0.23.3 (Tokenizer.encode, add_special_tokens=False). */
typedef struct { const char *text; int n; int32_t ids[12]; } vec;

static void check_vectors(const char *dir, const vec *v, size_t nv) {
    tok_tokenizer *t = load_fixture(dir);
    for (size_t i = 0; i < nv; i++) {
        int32_t *ids;
        char err[128];
        int n = tok_encode(t, v[i].text, strlen(v[i].text), 0, &ids, err, sizeof err);
        if (n != v[i].n || memcmp(ids, v[i].ids, sizeof(int32_t) * (size_t)n))
            print_error("%s vector %zu differs\n", dir, i);
        assert_int_equal(n, v[i].n);
        assert_memory_equal(ids, v[i].ids, sizeof(int32_t) * (size_t)n);
        free(ids);
    }
    tok_free(t);
}

static void test_unicode_whitespace_and_nfc_match_hf(void **st) {
    (void)st;
    static const vec qwen[] = {
        {"a \xe1\xa0\x8e" "b", 5, {64, 86089, 254, 236, 65}},
        {" \xe2\x80\xa8\xe1\xa0\x8e!", 6, {220, 378, 101, 123970, 236, 0}},
        {"x\xc2\x85 y", 4, {87, 126, 227, 379}},
        {"e\xcc\x81 vs \xc3\xa9", 3, {963, 6165, 3958}},       /* NFC: both are é */
        {"\xe1\x84\x80\xe1\x85\xa1\xe1\x86\xa8", 1, {126317}},  /* jamo compose to 각 */
        {"A\xe2\x80\x8b B\xef\xbb\xbf" "C", 5, {32, 15692, 425, 3225, 34}},
        {"\xe3\x80\x80\xe3\x80\x80x", 3, {22441, 22441, 87}},
    };
    static const vec llama[] = {
        {"a \xe1\xa0\x8e" "b", 5, {64, 87189, 254, 236, 65}},
        {" \xe2\x80\xa8\xe1\xa0\x8e!", 7, {220, 378, 101, 157, 254, 236, 0}},
        {"x\xc2\x85 y", 3, {87, 116360, 379}},
        {"e\xcc\x81 vs \xc3\xa9", 4, {68, 54939, 6296, 4046}},  /* no normalizer */
        {"\xe1\x84\x80\xe1\x85\xa1\xe1\x86\xa8", 9, {157, 226, 222, 157, 227, 94, 157, 228, 101}},
        {"A\xe2\x80\x8b B\xef\xbb\xbf" "C", 5, {32, 16067, 426, 3305, 34}},
        {"\xe3\x80\x80\xe3\x80\x80x", 3, {23249, 23249, 87}},
    };
    check_vectors("tokenizers/hf/qwen3", qwen, sizeof qwen / sizeof qwen[0]);
    check_vectors("tokenizers/hf/llama3_1", llama, sizeof llama / sizeof llama[0]);
}

/* NFC runs on each non-ASCII run (plus the ASCII char before it) instead of the whole
 * text; on random mixes of starters, combining marks, jamo and singletons the result must
 * equal utf8proc's NFC of the whole string. */
static void test_nfc_by_runs_equals_whole_string_nfc(void **st) {
    (void)st;
    tok_tokenizer *t = load_fixture("tokenizers/hf/qwen3");
    static const uint32_t pool[] = {'a', 'e', 'A', ' ', '.', 0x301, 0x308, 0x323, 0x327,
                                    0x344, 0x1100, 0x1161, 0x11A8, 0xAC00, 0x212B, 0x2126,
                                    0xE9, 0x1E0B, 0x0F73, 0x65E5, 0x5B57, 0x1D15E, 0x300};
    uint64_t x = 12345;
    tok_buf got = {0};
    int mismatches = 0;
    for (int iter = 0; iter < 3000; iter++) {
        char s[256];
        size_t n = 0;
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        int len = 1 + (int)((x >> 33) % 24);
        for (int k = 0; k < len; k++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            n += tok_utf8_encode(pool[(x >> 33) % (sizeof pool / sizeof pool[0])], s + n);
        }
        s[n] = 0;
        assert_int_equal(tok_normalize(t, s, n, &got), 0);
        utf8proc_uint8_t *want = utf8proc_NFC((const utf8proc_uint8_t *)s);
        if (got.len != strlen((char *)want) || memcmp(got.p, want, got.len)) mismatches++;
        free(want);
    }
    tok_buf_free(&got);
    assert_int_equal(mismatches, 0);
    tok_free(t);
}

/* ---- config, specials, templates ---- */

static void test_hf_config_gives_specials_and_template(void **st) {
    (void)st;
    tok_tokenizer *q = load_fixture("tokenizers/hf/qwen3");
    assert_int_equal(tok_eos_id(q), 151645);
    assert_int_equal(tok_pad_id(q), 151643);   /* pad_token <|endoftext|> */
    assert_string_equal(tok_eos_token(q), "<|im_end|>");
    assert_int_equal(tok_bos_id(q), -1);
    assert_string_equal(tok_bos_token(q), "");
    assert_int_equal(tok_add_bos(q), 0);
    assert_int_equal(tok_vocab_size(q), 151669);
    assert_non_null(tok_chat_template(q));
    assert_memory_equal(tok_chat_template(q), "{%- if tools %}", 15);
    assert_int_equal(tok_token_id(q, "<|im_start|>", 12), 151644);
    assert_int_equal(tok_token_id(q, "<think>", 7), 151667);
    assert_int_equal(tok_is_special(q, 151644), 1);
    assert_int_equal(tok_is_special(q, 151667), 0);   /* <think> is added, not special */
    assert_int_equal(tok_is_special(q, 9707), 0);
    tok_free(q);

    /* a tokenizer.json path finds tokenizer_config.json beside it */
    tok_tokenizer *l = load_fixture("tokenizers/hf/llama3_1/tokenizer.json");
    assert_int_equal(tok_bos_id(l), 128000);
    assert_string_equal(tok_bos_token(l), "<|begin_of_text|>");
    assert_int_equal(tok_eos_id(l), 128009);
    assert_string_equal(tok_eos_token(l), "<|eot_id|>");
    assert_int_equal(tok_add_bos(l), 1);
    int32_t *ids;
    char err[128];
    assert_int_equal(tok_encode(l, "Hello world", 11, 1, &ids, err, sizeof err), 3);
    assert_int_equal(ids[0], 128000);
    assert_int_equal(ids[1], 9906);
    assert_int_equal(ids[2], 1917);
    free(ids);
    assert_int_equal(tok_encode(l, "Hello world", 11, 0, &ids, err, sizeof err), 2);
    assert_int_equal(ids[0], 9906);
    free(ids);
    tok_free(l);
}

/* A checkpoint dir whose tokenizer_config.json gives bos/eos as AddedToken objects and a
 * Llama tokenizer class with add_bos_token=false, add_eos_token=true: transformers
 * rebuilds the post-processor from these flags, so must we. */
static void test_config_flags_and_token_objects(void **st) {
    (void)st;
    char dir[] = "/tmp/specd_tok_XXXXXX", path[4200], target[8192];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    const char *fx = fixture_path("tokenizers/hf/llama3_1/tokenizer.json");
    if (fx[0] != '/') {   /* make the symlink target absolute */
        char cwd[2048];
        assert_non_null(getcwd(cwd, sizeof cwd));
        snprintf(target, sizeof target, "%s/%s", cwd, fx);
    } else
        snprintf(target, sizeof target, "%s", fx);
    assert_int_equal(symlink(target, path), 0);
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs("{\"tokenizer_class\": \"LlamaTokenizerFast\", \"add_bos_token\": false,"
          " \"add_eos_token\": true, \"model_max_length\": 1000000000000000019884624838656,"
          " \"bos_token\": {\"content\": \"<|begin_of_text|>\", \"special\": true},"
          " \"eos_token\": {\"__type\": \"AddedToken\", \"content\": \"<|eot_id|>\"},"
          " \"chat_template\": [{\"name\": \"tool_use\", \"template\": \"T\"},"
          " {\"name\": \"default\", \"template\": \"D\"}]}", f);
    fclose(f);
    char err[512] = "";
    tok_tokenizer *t = tok_load(dir, err, sizeof err);
    if (!t) print_error("%s\n", err);
    assert_non_null(t);
    assert_string_equal(tok_bos_token(t), "<|begin_of_text|>");
    assert_int_equal(tok_bos_id(t), 128000);
    assert_int_equal(tok_eos_id(t), 128009);
    assert_int_equal(tok_add_bos(t), 0);
    assert_string_equal(tok_chat_template(t), "D");
    int32_t *ids;
    assert_int_equal(tok_encode(t, "Hello world", 11, 1, &ids, err, sizeof err), 3);
    assert_int_equal(ids[0], 9906);
    assert_int_equal(ids[1], 1917);
    assert_int_equal(ids[2], 128009);
    free(ids);
    tok_free(t);
    unlink(path);
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    unlink(path);
    rmdir(dir);
}

static void test_gguf_metadata_specials(void **st) {
    (void)st;
    tok_tokenizer *t = load_fixture("tokenizers/gguf/ggml-vocab-llama-spm.gguf");
    assert_int_equal(tok_vocab_size(t), 32000);
    assert_int_equal(tok_bos_id(t), 1);
    assert_int_equal(tok_eos_id(t), 2);
    assert_int_equal(tok_pad_id(t), -1);
    assert_string_equal(tok_bos_token(t), "<s>");
    assert_int_equal(tok_add_bos(t), 1);
    assert_int_equal(tok_is_special(t, 1), 1);
    assert_int_equal(tok_is_special(t, 15043), 0);
    assert_null(tok_chat_template(t));
    int32_t *ids;
    char err[128];
    assert_int_equal(tok_encode(t, "Hello world", 11, 1, &ids, err, sizeof err), 3);
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[1], 15043);
    assert_int_equal(ids[2], 3186);
    free(ids);
    /* the special token written in text is matched, as HF does by default */
    assert_int_equal(tok_encode(t, "<s>Hello", 8, 0, &ids, err, sizeof err), 2);
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[1], 15043);
    free(ids);
    tok_free(t);

    tok_tokenizer *p = load_fixture("tokenizers/gguf/ggml-vocab-phi-3.gguf");
    assert_int_equal(tok_eos_id(p), 32000);
    assert_int_equal(tok_pad_id(p), 32000);
    assert_non_null(tok_chat_template(p));
    assert_memory_equal(tok_chat_template(p), "{{ bos_token }}", 15);
    tok_free(p);
}

static void test_decode_skip_special_drops_control_tokens(void **st) {
    (void)st;
    tok_tokenizer *q = load_fixture("tokenizers/hf/qwen3");
    int32_t ids[] = {151644, 9707, 151645};
    char *s;
    size_t n;
    assert_int_equal(tok_decode(q, ids, 3, 1, &s, &n), 0);
    assert_string_equal(s, "Hello");
    free(s);
    assert_int_equal(tok_decode(q, ids, 3, 0, &s, &n), 0);
    assert_string_equal(s, "<|im_start|>Hello<|im_end|>");
    assert_int_equal(n, 27);
    free(s);
    tok_free(q);
}

/* ---- UTF-8 ---- */

static void expect_eutf8(const tok_tokenizer *t, const char *s, size_t n, size_t off) {
    int32_t *ids = (int32_t *)1;
    char err[128] = "", want[64];
    assert_int_equal(tok_encode(t, s, n, 0, &ids, err, sizeof err), SPECD_EUTF8);
    assert_null(ids);
    snprintf(want, sizeof want, "byte offset %zu", off);
    assert_non_null(strstr(err, want));
}

static void test_invalid_utf8_is_rejected_with_offset(void **st) {
    (void)st;
    tok_tokenizer *t = load_fixture("tokenizers/gguf/ggml-vocab-gpt-2.gguf");
    expect_eutf8(t, "ab\xff", 3, 2);
    expect_eutf8(t, "\xc0\xaf", 2, 0);              /* overlong */
    expect_eutf8(t, "x\xed\xa0\x80", 4, 1);         /* surrogate */
    expect_eutf8(t, "abc\xe2\x82", 5, 3);           /* cut short */
    expect_eutf8(t, "\xf4\x90\x80\x80", 4, 0);      /* above U+10FFFF */
    expect_eutf8(t, "ok \x80", 4, 3);               /* stray continuation */
    int32_t *ids;
    char err[64];
    assert_int_equal(tok_encode(t, "\xe2\x82\xac", 3, 0, &ids, err, sizeof err), 1);   /* € */
    free(ids);
    tok_free(t);
}

static void test_stream_holds_partial_utf8_char(void **st) {
    (void)st;
    tok_tokenizer *t = load_fixture("tokenizers/gguf/ggml-vocab-gpt-2.gguf");
    /* € = E2 82 AC; byte-level tokens for the three bytes: â, Ĥ, ¬ */
    int32_t ids[3] = {tok_token_id(t, "\xc3\xa2", 2), tok_token_id(t, "\xc4\xa4", 2),
                      tok_token_id(t, "\xc2\xac", 2)};
    for (int i = 0; i < 3; i++) assert_true(ids[i] >= 0);
    tok_stream *s = tok_stream_new(t, 0);
    char out[16];
    assert_int_equal(tok_stream_push(s, ids[0], out, sizeof out), 0);
    assert_int_equal(tok_stream_push(s, ids[1], out, sizeof out), 0);
    assert_int_equal(tok_stream_push(s, ids[2], out, sizeof out), 3);
    assert_memory_equal(out, "\xe2\x82\xac", 3);
    assert_int_equal(tok_stream_flush(s, out, sizeof out), 0);
    tok_stream_free(s);

    /* a cut-short character at the end becomes U+FFFD on flush, as HF's lossy decode */
    s = tok_stream_new(t, 0);
    assert_int_equal(tok_stream_push(s, ids[0], out, sizeof out), 0);
    assert_int_equal(tok_stream_flush(s, out, sizeof out), 3);
    assert_memory_equal(out, "\xef\xbf\xbd", 3);
    tok_stream_free(s);
    char *full;
    size_t n;
    assert_int_equal(tok_decode(t, ids, 1, 0, &full, &n), 0);
    assert_string_equal(full, "\xef\xbf\xbd");
    free(full);
    tok_free(t);
}

static void test_stream_small_buffer_keeps_text(void **st) {
    (void)st;
    tok_tokenizer *t = load_fixture("tokenizers/hf/qwen3");
    int32_t *ids;
    char err[64], out[64];
    int n = tok_encode(t, "Hello, world!", 13, 0, &ids, err, sizeof err);
    assert_int_equal(n, 4);
    tok_stream *s = tok_stream_new(t, 0);
    assert_int_equal(tok_stream_push(s, ids[0], out, 2), SPECD_ERANGE);   /* "Hello" > 2 */
    assert_int_equal(tok_stream_push(s, ids[1], out, sizeof out), 6);   /* kept + "," */
    assert_memory_equal(out, "Hello,", 6);
    tok_stream_free(s);
    free(ids);
    tok_free(t);
}

static void test_byte_fallback_invalid_run_is_one_fffd_per_byte(void **st) {
    (void)st;
    tok_tokenizer *t = load_fixture("tokenizers/gguf/ggml-vocab-llama-spm.gguf");
    int e2 = tok_token_id(t, "<0xE2>", 6), x82 = tok_token_id(t, "<0x82>", 6);
    int xac = tok_token_id(t, "<0xAC>", 6), a = tok_token_id(t, "a", 1);
    assert_true(e2 >= 0 && x82 >= 0 && xac >= 0 && a >= 0);
    char *s;
    size_t n;
    int32_t bad[] = {e2, x82, a};
    assert_int_equal(tok_decode(t, bad, 3, 0, &s, &n), 0);
    assert_string_equal(s, "\xef\xbf\xbd\xef\xbf\xbd" "a");
    free(s);
    int32_t good[] = {a, e2, x82, xac};
    assert_int_equal(tok_decode(t, good, 4, 0, &s, &n), 0);
    assert_string_equal(s, "a\xe2\x82\xac");
    free(s);
    /* streamed, the run is held until it is known valid */
    size_t sl;
    char *sv = stream_all(t, good, 4, 0, &sl);
    assert_string_equal(sv, "a\xe2\x82\xac");
    free(sv);
    tok_free(t);
}

static void test_spm_decode_strips_one_leading_space(void **st) {
    (void)st;
    tok_tokenizer *t = load_fixture("tokenizers/gguf/ggml-vocab-llama-spm.gguf");
    int32_t ids[] = {29871, 15043};   /* "▁", "▁Hello" */
    char *s;
    size_t n;
    assert_int_equal(tok_decode(t, ids, 2, 0, &s, &n), 0);
    assert_string_equal(s, " Hello");
    free(s);
    tok_stream *st2 = tok_stream_new(t, 0);
    char out[32];
    assert_int_equal(tok_stream_push(st2, 29871, out, sizeof out), 0);   /* stripped */
    assert_int_equal(tok_stream_push(st2, 15043, out, sizeof out), 6);
    assert_memory_equal(out, " Hello", 6);
    tok_stream_free(st2);
    tok_free(t);
}

/* A 300k-byte word with no pre-tokenizer split (SentencePiece: the whole text is one
 * piece) must come back exact; the heap keeps it O(n log n). */
static void test_long_single_piece_round_trips(void **st) {
    (void)st;
    tok_tokenizer *t = load_fixture("tokenizers/gguf/ggml-vocab-llama-spm.gguf");
    size_t n = 300000;
    char *s = malloc(n + 1);
    const char *alpha = "abcdefghijklmnopqrstuvwxyz\xc3\xa9";
    for (size_t i = 0; i < n;) {
        size_t k = (i * 7919u) % 27;
        if (k == 26 && i + 2 <= n) { memcpy(s + i, alpha + 26, 2); i += 2; }
        else s[i++] = alpha[k % 26];
    }
    int32_t *ids;
    char err[64];
    int k = tok_encode(t, s, n, 0, &ids, err, sizeof err);
    assert_true(k > 0 && (size_t)k < n);
    char *back;
    size_t bl;
    assert_int_equal(tok_decode(t, ids, (size_t)k, 0, &back, &bl), 0);
    assert_int_equal(bl, n);
    assert_memory_equal(back, s, n);
    free(back);
    free(ids);
    free(s);
    tok_free(t);
}

static void test_load_errors_name_the_file(void **st) {
    (void)st;
    char err[512] = "";
    assert_null(tok_load("/nonexistent/tok.json", err, sizeof err));
    assert_non_null(strstr(err, "/nonexistent/tok.json"));
    err[0] = 0;
    /* a directory without tokenizer.json */
    assert_null(tok_load(fixture_path("tokenizers/gguf"), err, sizeof err));
    assert_non_null(strstr(err, "tokenizer.json"));
    /* a golden.json is JSON but not a tokenizer */
    err[0] = 0;
    assert_null(tok_load(fixture_path("tokenizers/hf/qwen3/golden.json"), err, sizeof err));
    assert_non_null(strstr(err, "golden.json"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gguf_llama_spm_matches_hf),
        cmocka_unit_test(test_gguf_llama_bpe_matches_hf),
        cmocka_unit_test(test_gguf_qwen2_matches_hf),
        cmocka_unit_test(test_gguf_gpt2_matches_hf),
        cmocka_unit_test(test_gguf_phi3_matches_hf),
        cmocka_unit_test(test_hf_qwen3_matches_golden),
        cmocka_unit_test(test_hf_llama3_1_matches_golden),
        cmocka_unit_test(test_unicode_whitespace_and_nfc_match_hf),
        cmocka_unit_test(test_nfc_by_runs_equals_whole_string_nfc),
        cmocka_unit_test(test_hf_config_gives_specials_and_template),
        cmocka_unit_test(test_config_flags_and_token_objects),
        cmocka_unit_test(test_gguf_metadata_specials),
        cmocka_unit_test(test_decode_skip_special_drops_control_tokens),
        cmocka_unit_test(test_invalid_utf8_is_rejected_with_offset),
        cmocka_unit_test(test_stream_holds_partial_utf8_char),
        cmocka_unit_test(test_stream_small_buffer_keeps_text),
        cmocka_unit_test(test_byte_fallback_invalid_run_is_one_fffd_per_byte),
        cmocka_unit_test(test_spm_decode_strips_one_leading_space),
        cmocka_unit_test(test_long_single_piece_round_trips),
        cmocka_unit_test(test_load_errors_name_the_file),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
