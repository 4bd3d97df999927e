/* libFuzzer target for model files: the input is written as a .gguf file (tmpfs when
 * /dev/shm exists) and opened the ways specd opens one:
 *   - gguf_open, then every key read through the accessor of its type (arrays element by
 *     element, at most 64 of each) and every tensor's directory entry;
 *   - model_load (architecture, hyper-parameters, every tensor's presence, type and shape
 *     against them), then every tensor view converted to fp32 and to bf16 (dequantization
 *     of the block types included), and its rows of stored bytes where the view has them;
 *   - tok_load (the GGUF vocabulary, merges, pre-tokenizer type, special tokens), then an
 *     encode / decode of a fixed text and the decode of every id.
 * Invariants (abort() on violation, so libFuzzer records a crash): a failure returns NULL
 * with a non-empty message; a success gives sizes that agree with each other (vocab > 0,
 * rows x cols = numel, ids in range); nothing reads outside the file (ASan) or overflows
 * (UBSan). A broken model file must end in a message, never in a crash.
 * Seeds: tests/fuzz/make_gguf_seeds.py (tiny models of several architectures and tensor
 * types). Build and run: scripts/fuzz.sh gguf SECONDS. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/model/gguf.h"
#include "engine/model/model.h"
#include "engine/text/tokenizer.h"

#define CHECK(c)                                                                                  \
    do {                                                                                          \
        if (!(c)) {                                                                               \
            fprintf(stderr, "fuzz_gguf: invariant failed at %s:%d: %s\n", __FILE__, __LINE__, #c); \
            abort();                                                                              \
        }                                                                                         \
    } while (0)

/* Every key through its accessor; every tensor entry. */
static void walk_gguf(const char *path) {
    char err[512] = "";
    gguf *g = gguf_open(path, err, sizeof err);
    if (!g) {
        CHECK(err[0]);
        return;
    }
    CHECK(gguf_version(g) >= 2);
    for (int64_t i = 0; i < gguf_n_tensors(g); i++) {
        const gguf_tensor *t = gguf_tensor_at(g, i);
        CHECK(t != NULL);
        /* names are not NUL-terminated in the file; duplicates are refused, so a name
         * without a NUL in it finds its own entry */
        char name[256];
        if (t->name_len >= sizeof name || memchr(t->name, 0, t->name_len)) continue;
        memcpy(name, t->name, t->name_len);
        name[t->name_len] = 0;
        CHECK(gguf_find_tensor(g, name) == t);
    }
    static const char *const keys[] = {"general.architecture", "general.alignment", "tokenizer.ggml.model",
                                       "tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.merges",
                                       "tokenizer.ggml.token_type", "tokenizer.ggml.pre", "tokenizer.chat_template",
                                       "llama.block_count", "llama.rope.freq_base", "tokenizer.ggml.add_bos_token"};
    for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++) {
        int idx = gguf_find_key(g, keys[k]);
        if (idx < 0) continue;
        uint64_t u;
        int64_t s64;
        double f;
        int b;
        const char *str;
        size_t len;
        gguf_type et;
        uint64_t n;
        (void)gguf_get_u64(g, keys[k], &u);
        (void)gguf_get_i64(g, keys[k], &s64);
        (void)gguf_get_f64(g, keys[k], &f);
        (void)gguf_get_bool(g, keys[k], &b);
        if (gguf_get_str(g, keys[k], &str, &len) == 0) CHECK(str != NULL || len == 0);
        if (gguf_get_arr(g, keys[k], &et, &n) == 0)
            for (uint64_t i = 0; i < n && i < 64; i++) {
                (void)gguf_arr_str(g, keys[k], i, &str, &len);
                (void)gguf_arr_i64(g, keys[k], i, &s64);
                (void)gguf_arr_f64(g, keys[k], i, &f);
            }
    }
    gguf_close(g);
}

/* Every tensor view of a loaded model, converted. */
static void convert_views(const model *m) {
    const model_config *c = &m->cfg;
    CHECK(c->vocab > 0 && c->hidden > 0 && c->n_layers > 0);
    const tensor_view *v[3] = {&m->tok_embd, &m->out_norm, &m->lm_head};
    for (int i = 0; i < 3; i++) {
        int64_t n = tensor_numel(v[i]);
        if (n <= 0 || n > (1 << 22)) continue;
        float *f = malloc(sizeof(float) * (size_t)n);
        uint16_t *h = malloc(sizeof(uint16_t) * (size_t)n);
        CHECK(f && h);
        (void)tensor_to_f32(v[i], f);
        (void)tensor_to_bf16(v[i], h);
        free(f);
        free(h);
    }
}

static void load_model(const char *path) {
    char err[1024] = "";
    model *m = model_load(path, err, sizeof err);
    if (!m) {
        CHECK(err[0]);
        return;
    }
    convert_views(m);
    model_free(m);
}

static void load_tokenizer(const char *path) {
    char err[1024] = "";
    tok_tokenizer *t = tok_load(path, err, sizeof err);
    if (!t) {
        CHECK(err[0]);
        return;
    }
    const int V = tok_vocab_size(t);
    CHECK(V > 0);
    CHECK(tok_bos_id(t) < V && tok_eos_id(t) < V);
    static const char text[] = "Hello world, 12 3.45 \xe4\xbd\xa0\xe5\xa5\xbd  \n\tdon't <s>";
    int32_t *ids = NULL;
    int n = tok_encode(t, text, sizeof text - 1, 1, &ids, err, sizeof err);
    if (n < 0) CHECK(err[0]);
    for (int i = 0; i < n; i++) CHECK(ids[i] >= 0 && ids[i] < V);
    if (n > 0) {
        size_t len = 0;
        char *back = NULL;
        if (tok_decode(t, ids, (size_t)n, 0, &back, &len) == 0) CHECK(back && strlen(back) <= len);
        free(back);
    }
    free(ids);
    for (int id = 0; id < V && id < 4096; id++) {
        const char *bytes;
        size_t len;
        (void)tok_token_bytes(t, id, &bytes, &len);
    }
    tok_free(t);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char path[] = "/dev/shm/fuzz_gguf_XXXXXX.gguf";
    int fd = mkstemps(path, 5);
    if (fd < 0) {
        strcpy(path, "/tmp/fuzz_gguf_XXXXXX.gguf");
        fd = mkstemps(path, 5);
    }
    CHECK(fd >= 0);
    size_t off = 0;
    while (off < size) {
        ssize_t w = write(fd, data + off, size - off);
        CHECK(w > 0);
        off += (size_t)w;
    }
    close(fd);
    walk_gguf(path);
    load_model(path);
    load_tokenizer(path);
    unlink(path);
    return 0;
}
