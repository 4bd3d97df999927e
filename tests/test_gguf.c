/* Tests of the GGUF reader, the ggml dequantizers and the GGUF side of the model loader.
 *
 * Most inputs are GGUF files written by a small writer in this file, so every value is
 * known: tensors are quantized here from chosen scales and integer codes following the
 * block layouts of the format, and dequantization must give back exactly d*q (+ m). The
 * default SmolLM2 model (models/SmolLM2-135M-Instruct.Q4_1.gguf, from
 * scripts/fetch-model.sh) is loaded when present; its test is reported as skipped, with a
 * printed SKIP line, when it is absent. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/core/engine.h"
#include "engine/core/runner.h"
#include "engine/core/err.h"
#include "engine/model/gguf.h"
#include "engine/text/tmpl.h"
#include "tests/fixtures.h"
#include "engine/model/model.h"

/* ---- a GGUF writer -------------------------------------------------------------------- */

typedef struct { uint8_t *p; size_t n, cap; } buf;

static void put(buf *b, const void *d, size_t n) {
    if (!n) return;
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        assert_non_null(b->p);
    }
    memcpy(b->p + b->n, d, n);
    b->n += n;
}
static void put_u32(buf *b, uint32_t v) { put(b, &v, 4); }
static void put_u64(buf *b, uint64_t v) { put(b, &v, 8); }
static void put_str(buf *b, const char *s) { put_u64(b, strlen(s)); put(b, s, strlen(s)); }

#define GW_MAX_T 128
typedef struct {
    uint32_t version, align;
    buf kv;
    uint64_t n_kv;
    struct { char name[96]; uint32_t nd, type; uint64_t ne[3]; buf data; } t[GW_MAX_T];
    int nt;
} gw;

static void gw_init(gw *w) { memset(w, 0, sizeof *w); w->version = 3; w->align = 32; }
static void gw_free(gw *w) {
    free(w->kv.p);
    for (int i = 0; i < w->nt; i++) free(w->t[i].data.p);
}
static void gw_key(gw *w, const char *k, uint32_t type) { put_str(&w->kv, k); put_u32(&w->kv, type); w->n_kv++; }
static void gw_u32(gw *w, const char *k, uint32_t v) { gw_key(w, k, GGUF_T_UINT32); put_u32(&w->kv, v); }
static void gw_i32(gw *w, const char *k, int32_t v) { gw_key(w, k, GGUF_T_INT32); put(&w->kv, &v, 4); }
static void gw_u64(gw *w, const char *k, uint64_t v) { gw_key(w, k, GGUF_T_UINT64); put_u64(&w->kv, v); }
static void gw_f32(gw *w, const char *k, float v) { gw_key(w, k, GGUF_T_FLOAT32); put(&w->kv, &v, 4); }
static void gw_f64(gw *w, const char *k, double v) { gw_key(w, k, GGUF_T_FLOAT64); put(&w->kv, &v, 8); }
static void gw_bool(gw *w, const char *k, int v) { uint8_t b = (uint8_t)v; gw_key(w, k, GGUF_T_BOOL); put(&w->kv, &b, 1); }
static void gw_str(gw *w, const char *k, const char *v) { gw_key(w, k, GGUF_T_STRING); put_str(&w->kv, v); }
static void gw_arr_str(gw *w, const char *k, int n, const char **v) {
    gw_key(w, k, GGUF_T_ARRAY);
    put_u32(&w->kv, GGUF_T_STRING);
    put_u64(&w->kv, (uint64_t)n);
    for (int i = 0; i < n; i++) put_str(&w->kv, v[i]);
}
static void gw_arr_i32(gw *w, const char *k, int n, const int32_t *v) {
    gw_key(w, k, GGUF_T_ARRAY);
    put_u32(&w->kv, GGUF_T_INT32);
    put_u64(&w->kv, (uint64_t)n);
    put(&w->kv, v, 4 * (size_t)n);
}
/* ne0 is the row length; nd 1 ignores ne1. */
static void gw_tensor(gw *w, const char *name, uint32_t type, uint32_t nd, uint64_t ne0, uint64_t ne1,
                      const void *data, size_t nbytes) {
    assert_true(w->nt < GW_MAX_T);
    snprintf(w->t[w->nt].name, sizeof w->t[w->nt].name, "%s", name);
    w->t[w->nt].nd = nd;
    w->t[w->nt].type = type;
    w->t[w->nt].ne[0] = ne0;
    w->t[w->nt].ne[1] = ne1;
    put(&w->t[w->nt].data, data, nbytes);
    w->nt++;
}

static void pad(buf *b, uint32_t align) {
    static const uint8_t zeros[64];
    while (b->n % align) put(b, zeros, 1);
}

/* Serialize. The last tensor ends exactly at the end of the file, so any cut loses data. */
static buf gw_bytes(gw *w) {
    buf b = {0};
    put(&b, "GGUF", 4);
    put_u32(&b, w->version);
    put_u64(&b, (uint64_t)w->nt);
    put_u64(&b, w->n_kv);
    put(&b, w->kv.p, w->kv.n);
    uint64_t off = 0;
    for (int i = 0; i < w->nt; i++) {
        put_str(&b, w->t[i].name);
        put_u32(&b, w->t[i].nd);
        for (uint32_t d = 0; d < w->t[i].nd; d++) put_u64(&b, d < 3 && w->t[i].ne[d] ? w->t[i].ne[d] : 1);
        put_u32(&b, w->t[i].type);
        put_u64(&b, off);
        off += w->t[i].data.n;
        off = (off + w->align - 1) / w->align * w->align;
    }
    pad(&b, w->align);
    for (int i = 0; i < w->nt; i++) {
        put(&b, w->t[i].data.p, w->t[i].data.n);
        if (i + 1 < w->nt) pad(&b, w->align);
    }
    return b;
}

static void write_file(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(p, 1, n, f), n);
    fclose(f);
}

static char tmp_path[64];
static int setup_tmp(void **state) {
    (void)state;
    strcpy(tmp_path, "/tmp/specd_gguf_XXXXXX");
    int fd = mkstemp(tmp_path);
    if (fd < 0) return -1;
    close(fd);
    return 0;
}
static int teardown_tmp(void **state) {
    (void)state;
    unlink(tmp_path);
    return 0;
}

static void gw_write(gw *w, const char *path, size_t *size) {
    buf b = gw_bytes(w);
    write_file(path, b.p, b.n);
    if (size) *size = b.n;
    free(b.p);
}

static void expect_open_error(const char *problem) {
    char err[512] = "";
    gguf *g = gguf_open(tmp_path, err, sizeof err);
    if (g) gguf_close(g);
    assert_null(g);
    if (!strstr(err, tmp_path) || !strstr(err, problem))
        fail_msg("error \"%s\" should name %s and say \"%s\"", err, tmp_path, problem);
}

static void expect_load_error(const char *problem) {
    char err[512] = "";
    model *m = model_load(tmp_path, err, sizeof err);
    if (m) model_free(m);
    assert_null(m);
    if (!strstr(err, tmp_path) || !strstr(err, problem))
        fail_msg("error \"%s\" should name %s and say \"%s\"", err, tmp_path, problem);
}

/* ---- quantizers written from the block layouts ---------------------------------------- */

/* fp32 -> fp16 bits for values that fp16 represents exactly as normals (what we choose). */
static uint16_t f16_exact(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    if (f == 0) return (uint16_t)(b >> 16);
    int e = (int)((b >> 23) & 0xff) - 127 + 15;
    assert_true(e > 0 && e < 31 && (b & 0x1fff) == 0);
    return (uint16_t)(((b >> 16) & 0x8000) | (uint32_t)e << 10 | ((b >> 13) & 0x3ff));
}

/* Q8_0: d = absmax / 127, q = round(x / d). */
static void quant_q8_0(const float *x, uint8_t *out, int n) {
    for (int b = 0; b < n / 32; b++, x += 32, out += 34) {
        float amax = 0;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
        float d = amax / 127;
        uint16_t h = f16_exact(d);
        memcpy(out, &h, 2);
        for (int j = 0; j < 32; j++) out[2 + j] = (uint8_t)(int8_t)lrintf(x[j] / d);
    }
}

/* Q4_0: d = (value of largest magnitude) / -8, q = round(x/d) + 8; element j in the low
 * nibble of byte j, element j+16 in its high nibble. */
static void quant_q4_0(const float *x, uint8_t *out, int n) {
    for (int b = 0; b < n / 32; b++, x += 32, out += 18) {
        float mx = 0;
        for (int j = 0; j < 32; j++) if (fabsf(x[j]) > fabsf(mx)) mx = x[j];
        float d = mx / -8;
        uint16_t h = f16_exact(d);
        memcpy(out, &h, 2);
        for (int j = 0; j < 16; j++) {
            int lo = (int)lrintf(x[j] / d) + 8, hi = (int)lrintf(x[j + 16] / d) + 8;
            assert_true(lo >= 0 && lo < 16 && hi >= 0 && hi < 16);
            out[2 + j] = (uint8_t)(lo | hi << 4);
        }
    }
}

/* Q4_1: m = min, d = (max - min) / 15, q = round((x - m) / d). */
static void quant_q4_1(const float *x, uint8_t *out, int n) {
    for (int b = 0; b < n / 32; b++, x += 32, out += 20) {
        float mn = x[0], mx = x[0];
        for (int j = 0; j < 32; j++) { mn = fminf(mn, x[j]); mx = fmaxf(mx, x[j]); }
        float d = (mx - mn) / 15;
        uint16_t hd = f16_exact(d), hm = f16_exact(mn);
        memcpy(out, &hd, 2);
        memcpy(out + 2, &hm, 2);
        for (int j = 0; j < 16; j++)
            out[4 + j] = (uint8_t)(lrintf((x[j] - mn) / d) | lrintf((x[j + 16] - mn) / d) << 4);
    }
}

/* Q4_K block from chosen d, dmin, eight 6-bit scales and mins and 256 4-bit codes. */
static void pack_q4_k(float d, float dmin, const int *sc, const int *mn, const int *q, uint8_t *out) {
    uint16_t h = f16_exact(d), hm = f16_exact(dmin);
    memcpy(out, &h, 2);
    memcpy(out + 2, &hm, 2);
    uint8_t *s = out + 4, *qs = out + 16;
    memset(s, 0, 12);
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            s[j] |= (uint8_t)sc[j];
            s[j + 4] |= (uint8_t)mn[j];
        } else {   /* low 4 bits in bytes 8..11, high 2 bits in the top of bytes 0..7 */
            s[j + 4] = (uint8_t)((sc[j] & 0xf) | (mn[j] & 0xf) << 4);
            s[j - 4] |= (uint8_t)((sc[j] >> 4) << 6);
            s[j] |= (uint8_t)((mn[j] >> 4) << 6);
        }
    }
    for (int k = 0; k < 4; k++)
        for (int l = 0; l < 32; l++)
            qs[32 * k + l] = (uint8_t)(q[64 * k + l] | q[64 * k + 32 + l] << 4);
}

/* Q6_K block from d, sixteen int8 scales and 256 6-bit codes (0..63, value q-32). */
static void pack_q6_k(float d, const int *sc, const int *q, uint8_t *out) {
    uint8_t *ql = out, *qh = out + 128;
    memset(out, 0, 210);
    for (int half = 0; half < 2; half++) {
        const int *qq = q + 128 * half;
        for (int l = 0; l < 32; l++) {
            ql[64 * half + l] = (uint8_t)((qq[l] & 0xf) | (qq[l + 64] & 0xf) << 4);
            ql[64 * half + l + 32] = (uint8_t)((qq[l + 32] & 0xf) | (qq[l + 96] & 0xf) << 4);
            qh[32 * half + l] = (uint8_t)((qq[l] >> 4) | (qq[l + 32] >> 4) << 2 |
                                          (qq[l + 64] >> 4) << 4 | (qq[l + 96] >> 4) << 6);
        }
    }
    for (int i = 0; i < 16; i++) out[192 + i] = (uint8_t)(int8_t)sc[i];
    uint16_t h = f16_exact(d);
    memcpy(out + 208, &h, 2);
}

/* Open tmp_path, take tensor `name` as a view and dequantize it with tensor_to_f32. */
static void dequant_file_tensor(const char *name, tensor_dtype dt, int64_t rows, int64_t cols,
                                float *out) {
    char err[256];
    gguf *g = gguf_open(tmp_path, err, sizeof err);
    if (!g) fail_msg("%s", err);
    const gguf_tensor *t = gguf_find_tensor(g, name);
    assert_non_null(t);
    assert_int_equal(t->ne[0], cols);
    assert_int_equal(t->ne[1], rows);
    tensor_view v = { .data = t->data, .dtype = dt, .ndim = 2, .shape = {rows, cols} };
    assert_int_equal(tensor_to_f32(&v, out), 0);
    gguf_close(g);
}

/* ---- reader --------------------------------------------------------------------------- */

static void write_meta_file(uint32_t version) {
    gw w;
    gw_init(&w);
    w.version = version;
    const char *toks[3] = {"<s>", "hello", ""};
    int32_t ids[4] = {-5, 0, 7, 2147483647};
    gw_str(&w, "general.architecture", "llama");
    gw_u32(&w, "u32", 4000000000u);
    gw_i32(&w, "i32", -12);
    gw_u64(&w, "u64", 1ull << 40);
    gw_f32(&w, "f32", 0.5f);
    gw_f64(&w, "f64", 1e-300);
    gw_bool(&w, "yes", 1);
    gw_arr_str(&w, "toks", 3, toks);
    gw_arr_i32(&w, "ids", 4, ids);
    float v[4] = {1, 2, 3, 4};
    gw_tensor(&w, "t", GGML_F32, 2, 2, 2, v, sizeof v);
    gw_write(&w, tmp_path, NULL);
    gw_free(&w);
}

static void test_metadata_values_and_types(void **state) {
    (void)state;
    for (uint32_t version = 2; version <= 3; version++) {
        write_meta_file(version);
        char err[256];
        gguf *g = gguf_open(tmp_path, err, sizeof err);
        if (!g) fail_msg("%s", err);
        assert_int_equal(gguf_version(g), version);
        assert_int_equal(gguf_n_kv(g), 9);
        assert_int_equal(gguf_n_tensors(g), 1);
        const char *s;
        size_t n;
        uint64_t u;
        int64_t i;
        double d;
        int b;
        gguf_type et;
        assert_int_equal(gguf_get_str(g, "general.architecture", &s, &n), 0);
        assert_int_equal(n, 5);
        assert_memory_equal(s, "llama", 5);
        assert_int_equal(gguf_get_u64(g, "u32", &u), 0);
        assert_int_equal(u, 4000000000u);
        assert_int_equal(gguf_get_i64(g, "i32", &i), 0);
        assert_int_equal(i, -12);
        assert_int_equal(gguf_get_u64(g, "i32", &u), SPECD_EFORMAT);   /* negative */
        assert_int_equal(gguf_get_u64(g, "u64", &u), 0);
        assert_int_equal(u, 1ull << 40);
        assert_int_equal(gguf_get_f64(g, "f32", &d), 0);
        assert_true(d == 0.5);
        assert_int_equal(gguf_get_f64(g, "f64", &d), 0);
        assert_true(d == 1e-300);
        assert_int_equal(gguf_get_f64(g, "i32", &d), 0);
        assert_true(d == -12.0);
        assert_int_equal(gguf_get_bool(g, "yes", &b), 0);
        assert_int_equal(b, 1);
        assert_int_equal(gguf_get_i64(g, "f32", &i), SPECD_EFORMAT);
        assert_int_equal(gguf_get_str(g, "u32", &s, &n), SPECD_EFORMAT);
        assert_int_equal(gguf_get_u64(g, "nope", &u), SPECD_ENOTFOUND);
        assert_true(gguf_find_key(g, "nope") < 0);
        assert_int_equal(gguf_key_type(g, gguf_find_key(g, "toks")), GGUF_T_ARRAY);
        assert_int_equal(gguf_get_arr(g, "toks", &et, &u), 0);
        assert_int_equal(et, GGUF_T_STRING);
        assert_int_equal(u, 3);
        assert_int_equal(gguf_arr_str(g, "toks", 1, &s, &n), 0);
        assert_int_equal(n, 5);
        assert_memory_equal(s, "hello", 5);
        assert_int_equal(gguf_arr_str(g, "toks", 2, &s, &n), 0);
        assert_int_equal(n, 0);
        assert_int_equal(gguf_arr_str(g, "toks", 3, &s, &n), SPECD_ERANGE);
        assert_int_equal(gguf_arr_i64(g, "ids", 0, &i), 0);
        assert_int_equal(i, -5);
        assert_int_equal(gguf_arr_i64(g, "ids", 3, &i), 0);
        assert_int_equal(i, 2147483647);
        assert_int_equal(gguf_arr_f64(g, "ids", 2, &d), 0);
        assert_true(d == 7.0);
        assert_int_equal(gguf_arr_i64(g, "toks", 0, &i), SPECD_EFORMAT);
        const gguf_tensor *t = gguf_find_tensor(g, "t");
        assert_non_null(t);
        assert_ptr_equal(t, gguf_tensor_at(g, 0));
        assert_null(gguf_tensor_at(g, 1));
        assert_int_equal(t->nbytes, 16);
        assert_true(((const float *)t->data)[3] == 4.0f);
        gguf_close(g);
    }
}

static void test_row_sizes_and_names(void **state) {
    (void)state;
    assert_int_equal(ggml_row_size(GGML_F32, 10), 40);
    assert_int_equal(ggml_row_size(GGML_BF16, 10), 20);
    assert_int_equal(ggml_row_size(GGML_Q8_0, 64), 68);
    assert_int_equal(ggml_row_size(GGML_Q4_0, 64), 36);
    assert_int_equal(ggml_row_size(GGML_Q4_1, 64), 40);
    assert_int_equal(ggml_row_size(GGML_Q4_K, 512), 288);
    assert_int_equal(ggml_row_size(GGML_Q6_K, 512), 420);
    assert_int_equal(ggml_row_size(GGML_Q4_K, 100), 0);   /* not a whole block */
    assert_string_equal(ggml_type_name(GGML_Q6_K), "Q6_K");
}

/* ---- dequantization of known values --------------------------------------------------- */

static void test_f32_f16_bf16_tensors_exact(void **state) {
    (void)state;
    float f[4] = {1.5f, -0.0f, 3e-38f, -65504.0f};
    uint16_t h[4] = {0x3e00, 0x8000, 0x0200, 0xfbff};   /* 1.5, -0, 2^-15 (subnormal), -65504 */
    uint16_t bf[4] = {0x3fc0, 0xc2f7, 0x0001, 0x7f80};  /* 1.5, -123.5, tiny, inf */
    gw w;
    gw_init(&w);
    gw_tensor(&w, "f32", GGML_F32, 2, 2, 2, f, sizeof f);
    gw_tensor(&w, "f16", GGML_F16, 2, 2, 2, h, sizeof h);
    gw_tensor(&w, "bf16", GGML_BF16, 2, 2, 2, bf, sizeof bf);
    gw_write(&w, tmp_path, NULL);
    gw_free(&w);
    float out[4];
    dequant_file_tensor("f32", TDT_F32, 2, 2, out);
    assert_memory_equal(out, f, sizeof f);
    dequant_file_tensor("f16", TDT_F16, 2, 2, out);
    float want16[4] = {1.5f, -0.0f, 3.0517578125e-05f, -65504.0f};
    assert_memory_equal(out, want16, sizeof want16);
    dequant_file_tensor("bf16", TDT_BF16, 2, 2, out);
    for (int i = 0; i < 4; i++) {
        uint32_t bits;
        memcpy(&bits, &out[i], 4);
        assert_int_equal(bits, (uint32_t)bf[i] << 16);
    }
}

/* Values d*(q - 8) etc. with codes that hit both ends of the range in every block, so the
 * quantizers above recover d (and m) exactly. */
static void test_q8_0_q4_0_q4_1_known_values(void **state) {
    (void)state;
    enum { R = 3, C = 64 };
    float x8[R * C], x40[R * C], x41[R * C];
    for (int i = 0; i < R * C; i++) {
        int blk = i / 32, j = i % 32;
        float d = 0.25f * (float)(blk + 1);                       /* fp16-exact */
        int q8 = j == 0 ? -127 : j == 1 ? 127 : (j * 37 + blk * 11) % 255 - 127;
        x8[i] = d * (float)q8;
        int q4 = j == 5 ? 0 : (j * 7 + blk) % 15;                 /* code 0 -> -8d: the extreme */
        x40[i] = d * (float)(q4 - 8);
        int q41 = j == 3 ? 0 : j == 9 ? 15 : (j * 5 + blk) % 16;
        x41[i] = -1.0f * (float)(blk + 1) + 0.125f * (float)q41;  /* m = -(blk+1), d = 1/8 */
    }
    uint8_t b8[R * C / 32 * 34], b40[R * C / 32 * 18], b41[R * C / 32 * 20];
    quant_q8_0(x8, b8, R * C);
    quant_q4_0(x40, b40, R * C);
    quant_q4_1(x41, b41, R * C);
    gw w;
    gw_init(&w);
    gw_tensor(&w, "q8", GGML_Q8_0, 2, C, R, b8, sizeof b8);
    gw_tensor(&w, "q40", GGML_Q4_0, 2, C, R, b40, sizeof b40);
    gw_tensor(&w, "q41", GGML_Q4_1, 2, C, R, b41, sizeof b41);
    gw_write(&w, tmp_path, NULL);
    gw_free(&w);
    float out[R * C];
    dequant_file_tensor("q8", TDT_Q8_0, R, C, out);
    assert_memory_equal(out, x8, sizeof x8);
    dequant_file_tensor("q40", TDT_Q4_0, R, C, out);
    assert_memory_equal(out, x40, sizeof x40);
    dequant_file_tensor("q41", TDT_Q4_1, R, C, out);
    assert_memory_equal(out, x41, sizeof x41);
}

static void test_q4_k_known_values(void **state) {
    (void)state;
    enum { R = 2, C = 512 };
    uint8_t blocks[R * C / 256][144];
    float want[R * C];
    for (int b = 0; b < R * C / 256; b++) {
        float d = 0.5f + 0.125f * (float)b, dmin = 0.25f * (float)(b + 1);
        int sc[8], mn[8], q[256];
        for (int j = 0; j < 8; j++) {      /* all 6 bits used, so the split packing matters */
            sc[j] = (j * 13 + b * 7 + 5) % 64;
            mn[j] = 63 - (j * 11 + b * 3) % 64;
        }
        for (int e = 0; e < 256; e++) q[e] = (e * 7 + b * 3 + e / 32) % 16;
        pack_q4_k(d, dmin, sc, mn, q, blocks[b]);
        for (int e = 0; e < 256; e++)
            want[b * 256 + e] = d * (float)sc[e / 32] * (float)q[e] - dmin * (float)mn[e / 32];
    }
    gw w;
    gw_init(&w);
    gw_tensor(&w, "q4k", GGML_Q4_K, 2, C, R, blocks, sizeof blocks);
    gw_write(&w, tmp_path, NULL);
    gw_free(&w);
    float out[R * C];
    dequant_file_tensor("q4k", TDT_Q4_K, R, C, out);
    assert_memory_equal(out, want, sizeof want);
}

static void test_q6_k_known_values(void **state) {
    (void)state;
    enum { R = 2, C = 256 };
    uint8_t blocks[R][210];
    float want[R * C];
    for (int b = 0; b < R; b++) {
        float d = 0.0625f * (float)(b + 1);
        int sc[16], q[256];
        for (int i = 0; i < 16; i++) sc[i] = (i * 29 + b * 5) % 256 - 128;   /* signed */
        for (int e = 0; e < 256; e++) q[e] = (e * 11 + b + e / 64) % 64;
        pack_q6_k(d, sc, q, blocks[b]);
        for (int e = 0; e < 256; e++)
            want[b * 256 + e] = d * (float)sc[e / 16] * (float)(q[e] - 32);
    }
    gw w;
    gw_init(&w);
    gw_tensor(&w, "q6k", GGML_Q6_K, 2, C, R, blocks, sizeof blocks);
    gw_write(&w, tmp_path, NULL);
    gw_free(&w);
    float out[R * C];
    dequant_file_tensor("q6k", TDT_Q6_K, R, C, out);
    assert_memory_equal(out, want, sizeof want);
}

/* Q5_0 / Q5_1 blocks from d (and m) and 32 5-bit codes: low nibbles in qs (element j low,
 * j + 16 high), the fifth bits in the 32-bit qh (bit j for element j). */
static void pack_q5(float d, float m, int has_min, const int *q, uint8_t *out) {
    uint16_t hd = f16_exact(d), hm = f16_exact(m);
    memcpy(out, &hd, 2);
    if (has_min) memcpy(out + 2, &hm, 2);
    uint8_t *p = out + (has_min ? 4 : 2), *qs = p + 4;
    uint32_t qh = 0;
    for (int j = 0; j < 32; j++) qh |= (uint32_t)(q[j] >> 4) << j;
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(qh >> (8 * i));
    for (int j = 0; j < 16; j++) qs[j] = (uint8_t)((q[j] & 0xf) | (q[j + 16] & 0xf) << 4);
}

/* Q5_K: Q4_K's packing of scales, mins and low nibbles, plus qh[32] of fifth bits. */
static void pack_q5_k(float d, float dmin, const int *sc, const int *mn, const int *q, uint8_t *out) {
    int lo[256];
    uint8_t q4[144];
    for (int e = 0; e < 256; e++) lo[e] = q[e] & 0xf;
    pack_q4_k(d, dmin, sc, mn, lo, q4);
    memcpy(out, q4, 16);            /* d, dmin, scales */
    memcpy(out + 48, q4 + 16, 128); /* nibbles */
    uint8_t *qh = out + 16;
    memset(qh, 0, 32);
    for (int e = 0; e < 256; e++)   /* sub-block e / 32 owns bit e / 32 of qh[e % 32] */
        qh[e % 32] |= (uint8_t)((q[e] >> 4) << (e / 32));
}

static void test_q5_0_q5_1_q5_k_known_values(void **state) {
    (void)state;
    enum { R = 2, C = 256 };
    uint8_t b50[R * C / 32][22], b51[R * C / 32][24], b5k[R * C / 256][176];
    float w50[R * C], w51[R * C], w5k[R * C];
    for (int b = 0; b < R * C / 32; b++) {
        int q[32];
        float d = 0.125f * (float)(b + 1), m = -0.5f * (float)(b % 5);
        for (int j = 0; j < 32; j++) q[j] = j == 0 ? 0 : j == 1 ? 31 : (j * 11 + b * 5) % 32;   /* both ends */
        pack_q5(d, 0, 0, q, b50[b]);
        pack_q5(d, m, 1, q, b51[b]);
        for (int j = 0; j < 32; j++) {
            w50[b * 32 + j] = d * (float)(q[j] - 16);
            w51[b * 32 + j] = d * (float)q[j] + m;
        }
    }
    for (int b = 0; b < R * C / 256; b++) {
        float d = 0.25f + 0.125f * (float)b, dmin = 0.5f * (float)(b + 1);
        int sc[8], mn[8], q[256];
        for (int j = 0; j < 8; j++) {
            sc[j] = (j * 17 + b * 3 + 1) % 64;
            mn[j] = 63 - (j * 5 + b * 9) % 64;
        }
        for (int e = 0; e < 256; e++) q[e] = (e * 13 + b * 7 + e / 32) % 32;
        pack_q5_k(d, dmin, sc, mn, q, b5k[b]);
        for (int e = 0; e < 256; e++)
            w5k[b * 256 + e] = d * (float)sc[e / 32] * (float)q[e] - dmin * (float)mn[e / 32];
    }
    gw w;
    gw_init(&w);
    gw_tensor(&w, "q50", GGML_Q5_0, 2, C, R, b50, sizeof b50);
    gw_tensor(&w, "q51", GGML_Q5_1, 2, C, R, b51, sizeof b51);
    gw_tensor(&w, "q5k", GGML_Q5_K, 2, C, R, b5k, sizeof b5k);
    gw_write(&w, tmp_path, NULL);
    gw_free(&w);
    float out[R * C];
    dequant_file_tensor("q50", TDT_Q5_0, R, C, out);
    assert_memory_equal(out, w50, sizeof w50);
    dequant_file_tensor("q51", TDT_Q5_1, R, C, out);
    assert_memory_equal(out, w51, sizeof w51);
    dequant_file_tensor("q5k", TDT_Q5_K, R, C, out);
    assert_memory_equal(out, w5k, sizeof w5k);
}

static void test_dequantize_rejects_partial_blocks_and_unknown_types(void **state) {
    (void)state;
    uint8_t b[34] = {0};
    float y[32];
    assert_int_equal(ggml_dequantize(GGML_Q8_0, b, y, 31), SPECD_EINVAL);
    assert_int_equal(ggml_dequantize((ggml_type)11 /* Q3_K */, b, y, 256), SPECD_EUNSUPPORTED);
    assert_true(ggml_fp16_to_f32(0x7e00) != ggml_fp16_to_f32(0x7e00));   /* NaN */
    assert_true(ggml_fp16_to_f32(0x0400) == 6.103515625e-05f);            /* min normal */
    assert_true(ggml_fp16_to_f32(0x03ff) == 6.097555160522461e-05f);      /* max subnormal */
}

/* ---- GGUF models ---------------------------------------------------------------------- */

typedef struct {
    const char *arch;
    int layers, hidden, heads, kv_heads, head_dim, ffn, vocab;
    int untied, bias, qk_norm, key_length;   /* key_length: write attention.key_length */
    int skip_ffn_up, bad_ffn_up_shape, q3k_gate;
    int eot;
    int rope_dims, vocab_key;                /* write rope.dimension_count / vocab_size */
    const float *wq, *wk;                    /* stored rows as written (may be permuted) */
    int wk_q8;                               /* write wk as Q8_0 (stored rows from wk) */
    const float *rope_freqs;                 /* head_dim/2 values, or NULL */
} tiny_gguf;

static float *fill_vals(int64_t n, int seed) {
    float *x = malloc((size_t)n * sizeof *x);
    assert_non_null(x);
    for (int64_t i = 0; i < n; i++) x[i] = (float)((i * 37 + seed * 101) % 61 - 30) / 16.0f;
    return x;
}

static void add_f32(gw *w, const char *name, int64_t rows, int64_t cols, const float *data, int seed) {
    float *own = data ? NULL : fill_vals(rows * cols, seed);
    gw_tensor(w, name, GGML_F32, rows > 1 || cols == 0 ? 2 : 1, (uint64_t)cols, (uint64_t)rows,
              data ? data : own, (size_t)(rows * cols) * 4);
    free(own);
}

static void write_tiny(const tiny_gguf *t) {
    gw w;
    gw_init(&w);
    char k[128];
    int H = t->hidden, Q = t->heads * t->head_dim, KV = t->kv_heads * t->head_dim;
    gw_str(&w, "general.architecture", t->arch);
#define AK(suffix) (snprintf(k, sizeof k, "%s." suffix, t->arch), k)
    gw_u32(&w, AK("block_count"), (uint32_t)t->layers);
    gw_u32(&w, AK("embedding_length"), (uint32_t)H);
    gw_u32(&w, AK("attention.head_count"), (uint32_t)t->heads);
    gw_u32(&w, AK("attention.head_count_kv"), (uint32_t)t->kv_heads);
    gw_u32(&w, AK("feed_forward_length"), (uint32_t)t->ffn);
    gw_u32(&w, AK("context_length"), 4096);
    gw_f32(&w, AK("attention.layer_norm_rms_epsilon"), 1e-6f);
    gw_f32(&w, AK("rope.freq_base"), 500000.0f);
    if (t->key_length) gw_u32(&w, AK("attention.key_length"), (uint32_t)t->head_dim);
    if (t->rope_dims) gw_u32(&w, AK("rope.dimension_count"), (uint32_t)t->rope_dims);
    if (t->vocab_key) gw_u32(&w, AK("vocab_size"), (uint32_t)t->vocab_key);
#undef AK
    gw_u32(&w, "tokenizer.ggml.bos_token_id", 7);
    gw_u32(&w, "tokenizer.ggml.eos_token_id", 9);
    if (t->eot) gw_u32(&w, "tokenizer.ggml.eot_token_id", (uint32_t)t->eot);
    add_f32(&w, "token_embd.weight", t->vocab, H, NULL, 1);
    add_f32(&w, "output_norm.weight", 1, H, NULL, 2);
    if (t->untied) add_f32(&w, "output.weight", t->vocab, H, NULL, 3);
    if (t->rope_freqs)
        gw_tensor(&w, "rope_freqs.weight", GGML_F32, 1, (uint64_t)t->head_dim / 2, 1, t->rope_freqs,
                  (size_t)t->head_dim / 2 * 4);
    for (int l = 0; l < t->layers; l++) {
        char n[96];
#define TN(s) (snprintf(n, sizeof n, "blk.%d." s, l), n)
        add_f32(&w, TN("attn_norm.weight"), 1, H, NULL, 10 + l);
        add_f32(&w, TN("attn_q.weight"), Q, H, t->wq, 11 + l);
        if (t->wk_q8) {
            uint8_t *qb = malloc((size_t)KV * H / 32 * 34);
            quant_q8_0(t->wk, qb, KV * H);
            gw_tensor(&w, TN("attn_k.weight"), GGML_Q8_0, 2, (uint64_t)H, (uint64_t)KV, qb,
                      (size_t)KV * H / 32 * 34);
            free(qb);
        } else {
            add_f32(&w, TN("attn_k.weight"), KV, H, t->wk, 12 + l);
        }
        add_f32(&w, TN("attn_v.weight"), KV, H, NULL, 13 + l);
        add_f32(&w, TN("attn_output.weight"), H, Q, NULL, 14 + l);
        if (t->bias) {
            add_f32(&w, TN("attn_q.bias"), 1, Q, NULL, 15 + l);
            add_f32(&w, TN("attn_k.bias"), 1, KV, NULL, 16 + l);
            add_f32(&w, TN("attn_v.bias"), 1, KV, NULL, 17 + l);
        }
        if (t->qk_norm) {
            add_f32(&w, TN("attn_q_norm.weight"), 1, t->head_dim, NULL, 18 + l);
            add_f32(&w, TN("attn_k_norm.weight"), 1, t->head_dim, NULL, 19 + l);
        }
        add_f32(&w, TN("ffn_norm.weight"), 1, H, NULL, 20 + l);
        if (t->q3k_gate) {
            size_t nb = (size_t)t->ffn * (size_t)H / 256 * 110;
            uint8_t *z = calloc(1, nb);
            gw_tensor(&w, TN("ffn_gate.weight"), 11 /* Q3_K */, 2, (uint64_t)H, (uint64_t)t->ffn, z, nb);
            free(z);
        } else {
            add_f32(&w, TN("ffn_gate.weight"), t->ffn, H, NULL, 21 + l);
        }
        if (!t->skip_ffn_up)
            add_f32(&w, TN("ffn_up.weight"), t->bad_ffn_up_shape ? t->ffn + 1 : t->ffn, H, NULL, 22 + l);
        add_f32(&w, TN("ffn_down.weight"), H, t->ffn, NULL, 23 + l);
#undef TN
    }
    gw_write(&w, tmp_path, NULL);
    gw_free(&w);
}

static tiny_gguf tiny_llama(void) {
    return (tiny_gguf){ .arch = "llama", .layers = 2, .hidden = 32, .heads = 4, .kv_heads = 2,
                        .head_dim = 8, .ffn = 48, .vocab = 16 };
}

static model *load_tmp(void) {
    char err[512] = "";
    model *m = model_load(tmp_path, err, sizeof err);
    if (!m) fail_msg("%s", err);
    return m;
}

static void test_gguf_llama_config_from_metadata(void **state) {
    (void)state;
    tiny_gguf t = tiny_llama();
    t.eot = 11;
    write_tiny(&t);
    model *m = load_tmp();
    const model_config *c = &m->cfg;
    assert_int_equal(m->is_gguf, 1);
    assert_int_equal(c->arch, MODEL_ARCH_LLAMA);
    assert_string_equal(c->arch_name, "llama");
    assert_int_equal(c->n_layers, 2);
    assert_int_equal(c->hidden, 32);
    assert_int_equal(c->n_heads, 4);
    assert_int_equal(c->n_kv_heads, 2);
    assert_int_equal(c->head_dim, 8);   /* no key_length: hidden / heads */
    assert_int_equal(c->ffn, 48);
    assert_int_equal(c->vocab, 16);
    assert_int_equal(c->max_pos, 4096);
    assert_float_equal(c->rms_eps, 1e-6f, 0);
    assert_float_equal(c->rope_theta, 500000.0f, 0);
    assert_int_equal(c->rope_type, ROPE_DEFAULT);
    assert_int_equal(c->bos_id, 7);
    assert_int_equal(c->n_eos, 2);
    assert_int_equal(c->eos_ids[0], 9);
    assert_int_equal(c->eos_ids[1], 11);
    assert_int_equal(c->tied_embeddings, 1);
    assert_ptr_equal(m->lm_head.data, m->tok_embd.data);
    assert_int_equal(c->qkv_bias, 0);
    assert_int_equal(m->layers[1].wq.unpermute_heads, 4);
    assert_int_equal(m->layers[1].wk.unpermute_heads, 2);
    assert_int_equal(m->layers[1].wv.unpermute_heads, 0);
    assert_int_equal(m->layers[1].wo.shape[0], 32);
    assert_int_equal(m->layers[1].w_down.shape[1], 48);
    /* [in, out] ggml order becomes [out, in]: element (r, c) is stored at r*in + c. */
    float *x = malloc(48 * 32 * 4);
    assert_int_equal(tensor_to_f32(&m->layers[0].w_gate, x), 0);
    float *want = fill_vals(48 * 32, 21);
    assert_memory_equal(x, want, 48 * 32 * 4);
    free(x);
    free(want);
    model_free(m);

    t.untied = 1;
    write_tiny(&t);
    m = load_tmp();
    assert_int_equal(m->cfg.tied_embeddings, 0);
    assert_ptr_not_equal(m->lm_head.data, m->tok_embd.data);
    assert_int_equal(m->lm_head.shape[0], 16);
    model_free(m);
}

static void test_gguf_qwen_variants(void **state) {
    (void)state;
    tiny_gguf t = tiny_llama();
    t.arch = "qwen2";
    t.bias = 1;
    write_tiny(&t);
    model *m = load_tmp();
    assert_int_equal(m->cfg.arch, MODEL_ARCH_QWEN2);
    assert_int_equal(m->cfg.qkv_bias, 1);
    assert_int_equal(m->layers[0].bk.shape[0], 16);
    assert_int_equal(m->layers[0].wq.unpermute_heads, 0);   /* only llama is permuted */
    model_free(m);

    t = tiny_llama();
    t.arch = "qwen3";
    t.qk_norm = 1;
    t.head_dim = 16;      /* != hidden / heads */
    t.key_length = 1;
    write_tiny(&t);
    m = load_tmp();
    assert_int_equal(m->cfg.arch, MODEL_ARCH_QWEN3);
    assert_int_equal(m->cfg.head_dim, 16);
    assert_int_equal(m->cfg.qk_norm, 1);
    assert_int_equal(m->layers[1].wq.shape[0], 64);
    assert_int_equal(m->layers[1].wo.shape[1], 64);
    assert_int_equal(m->layers[1].q_norm.shape[0], 16);
    assert_int_equal(m->layers[1].wk.unpermute_heads, 0);
    model_free(m);
}

/* llama.cpp's converter: w.reshape(n_head, 2, rows/n_head/2, in).swapaxes(1, 2). */
static void llama_cpp_permute(const float *w, float *out, int rows, int cols, int n_head) {
    int half = rows / n_head / 2;
    for (int h = 0; h < n_head; h++)
        for (int a = 0; a < 2; a++)          /* source index (h, a, b) */
            for (int b = 0; b < half; b++) { /* destination index (h, b, a) */
                int src = (h * 2 + a) * half + b, dst = (h * half + b) * 2 + a;
                memcpy(out + (size_t)dst * cols, w + (size_t)src * cols, (size_t)cols * 4);
            }
}

static void test_gguf_unpermute_restores_hf_row_order(void **state) {
    (void)state;
    tiny_gguf t = tiny_llama();
    int H = 32, Q = 4 * 8, KV = 2 * 8;
    float *q_hf = malloc((size_t)Q * H * 4), *k_hf = malloc((size_t)KV * H * 4);
    float *q_st = malloc((size_t)Q * H * 4), *k_st = malloc((size_t)KV * H * 4);
    for (int r = 0; r < Q; r++)
        for (int c = 0; c < H; c++) q_hf[r * H + c] = (float)(r * 4 + c % 4);  /* bf16-exact, row id visible */
    for (int r = 0; r < KV; r++)   /* Q8_0-exact: integer codes, +127 in every block */
        for (int c = 0; c < H; c++) k_hf[r * H + c] = c == 0 ? 127.0f : (float)((r * 31 + c * 17) % 255 - 127);
    llama_cpp_permute(q_hf, q_st, Q, H, 4);
    llama_cpp_permute(k_hf, k_st, KV, H, 2);
    assert_memory_not_equal(q_hf, q_st, (size_t)Q * H * 4);   /* the permutation does something */
    t.wq = q_st;
    t.wk = k_st;
    t.wk_q8 = 1;
    write_tiny(&t);
    model *m = load_tmp();
    float *out = malloc((size_t)Q * H * 4);
    uint16_t *bf = malloc((size_t)Q * H * 2);
    assert_int_equal(tensor_to_f32(&m->layers[0].wq, out), 0);
    assert_memory_equal(out, q_hf, (size_t)Q * H * 4);
    assert_int_equal(tensor_to_bf16(&m->layers[0].wq, bf), 0);
    for (int i = 0; i < Q * H; i++) {
        uint32_t bits = (uint32_t)bf[i] << 16;
        float f;
        memcpy(&f, &bits, 4);
        assert_true(f == q_hf[i]);
    }
    assert_int_equal(m->layers[0].wk.dtype, TDT_Q8_0);
    assert_int_equal(tensor_to_f32(&m->layers[0].wk, out), 0);
    assert_memory_equal(out, k_hf, (size_t)KV * H * 4);
    assert_int_equal(tensor_to_bf16(&m->layers[0].wk, bf), 0);
    for (int i = 0; i < KV * H; i++) {   /* |k| <= 127: exact in bf16 */
        uint32_t bits = (uint32_t)bf[i] << 16;
        float f;
        memcpy(&f, &bits, 4);
        assert_true(f == k_hf[i]);
    }
    /* the stored blocks in logical row order (what the CUDA runner keeps quantized): each
     * row dequantizes to HF's row; a slice of rows is those rows' bytes */
    size_t rb = 0;
    uint8_t *raw = malloc((size_t)KV * 64), *part = malloc((size_t)2 * 64);
    assert_int_equal(tensor_ggml_type(&m->layers[0].wk), GGML_Q8_0);
    assert_int_equal(tensor_rows_raw(&m->layers[0].wk, 0, KV, raw, &rb), 0);
    assert_int_equal(rb, (size_t)(H / 32) * 34);
    for (int r = 0; r < KV; r++) assert_int_equal(ggml_dequantize(GGML_Q8_0, raw + (size_t)r * rb, out + (size_t)r * H, H), 0);
    assert_memory_equal(out, k_hf, (size_t)KV * H * 4);
    assert_int_equal(tensor_rows_raw(&m->layers[0].wk, 3, 2, part, NULL), 0);
    assert_memory_equal(part, raw + 3 * rb, 2 * rb);
    assert_int_equal(tensor_rows_raw(&m->layers[0].wk, KV - 1, 2, part, NULL), SPECD_EINVAL);
    free(raw);
    free(part);
    model_free(m);

    /* qwen2 keeps HF order in GGUF: the same stored rows come back as stored. */
    t.arch = "qwen2";
    t.bias = 1;
    write_tiny(&t);
    m = load_tmp();
    assert_int_equal(tensor_to_f32(&m->layers[0].wq, out), 0);
    assert_memory_equal(out, q_st, (size_t)Q * H * 4);
    model_free(m);
    free(q_hf); free(k_hf); free(q_st); free(k_st); free(out); free(bf);
}

/* llama3 scaling factors as llama.cpp's converter computes them into rope_freqs. */
static void llama3_factors(float *f, int head_dim, double theta, double factor) {
    for (int i = 0; i < head_dim / 2; i++) {
        double freq = 1.0 / pow(theta, 2.0 * i / head_dim), wl = 2 * M_PI / freq;
        if (wl < 8192 / 4.0) f[i] = 1;
        else if (wl > 8192 / 1.0) f[i] = (float)factor;
        else {
            double s = (8192 / wl - 1) / 3;
            f[i] = (float)(1 / ((1 - s) / factor + s));
        }
    }
}

static void test_gguf_llama3_rope_from_rope_freqs(void **state) {
    (void)state;
    tiny_gguf t = tiny_llama();
    float f[4];
    llama3_factors(f, 8, 500000.0, 32.0);
    assert_true(f[0] == 1.0f && f[3] == 32.0f && f[2] > 1.0f && f[2] < 32.0f);   /* all 3 regimes */
    t.rope_freqs = f;
    write_tiny(&t);
    model *m = load_tmp();
    assert_int_equal(m->cfg.rope_type, ROPE_LLAMA3);
    assert_float_equal(m->cfg.rope_factor, 32.0f, 0);
    assert_float_equal(m->cfg.rope_low_freq_factor, 1.0f, 0);
    assert_float_equal(m->cfg.rope_high_freq_factor, 4.0f, 0);
    assert_int_equal(m->cfg.rope_orig_max_pos, 8192);
    model_free(m);
    f[2] *= 1.5f;
    write_tiny(&t);
    expect_load_error("rope_freqs.weight[2]");
}

static void test_gguf_model_errors_name_file_and_problem(void **state) {
    (void)state;
    tiny_gguf t = tiny_llama();
    t.arch = "gpt2";
    write_tiny(&t);
    expect_load_error("unknown architecture \"gpt2\"");
    t = tiny_llama();
    t.skip_ffn_up = 1;
    write_tiny(&t);
    expect_load_error("missing tensor blk.0.ffn_up.weight");
    t = tiny_llama();
    t.bad_ffn_up_shape = 1;
    write_tiny(&t);
    expect_load_error("blk.0.ffn_up.weight has shape [49, 32], the config implies [48, 32]");
    t = tiny_llama();
    t.hidden = 256;
    t.head_dim = 64;
    t.q3k_gate = 1;
    write_tiny(&t);
    expect_load_error("tensor blk.0.ffn_gate.weight has type Q3_K");
    t = tiny_llama();
    t.kv_heads = 3;
    write_tiny(&t);
    expect_load_error("not a multiple of num_key_value_heads");

    t = tiny_llama();
    t.rope_dims = 4;
    write_tiny(&t);
    expect_load_error("partial rotary (llama.rope.dimension_count 4 < head_dim 8)");
    t = tiny_llama();
    t.vocab_key = 17;
    write_tiny(&t);
    expect_load_error("llama.vocab_size 17 disagrees with token_embd.weight rows 16");

    gw w;   /* metadata missing */
    gw_init(&w);
    gw_str(&w, "general.architecture", "llama");
    gw_write(&w, tmp_path, NULL);
    gw_free(&w);
    expect_load_error("missing metadata llama.block_count");
}

/* ---- truncated and corrupted files ---------------------------------------------------- */

static void test_truncated_gguf_every_header_offset(void **state) {
    (void)state;
    tiny_gguf t = tiny_llama();
    t.layers = 1;
    write_tiny(&t);
    size_t len;
    FILE *f = fopen(tmp_path, "rb");
    fseek(f, 0, SEEK_END);
    len = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc(len);
    assert_int_equal(fread(b, 1, len, f), len);
    fclose(f);
    /* Every cut in the first 1.5 KB (magic, counts, keys, tensor directory), then every
     * 61 bytes through the data, and the last byte. */
    for (size_t cut = 0; cut < len; cut += cut < 1536 ? 1 : 61) {
        write_file(tmp_path, b, cut);
        expect_open_error("truncated");
        expect_load_error("truncated");
    }
    write_file(tmp_path, b, len - 1);
    expect_open_error("truncated");
    write_file(tmp_path, b, len);
    model_free(load_tmp());
    free(b);
}

/* Build a one-tensor file with a byte-level edit applied at the directory. */
static void corrupt_and_expect(void (*edit)(gw *), const char *problem) {
    gw w;
    gw_init(&w);
    gw_str(&w, "general.architecture", "llama");
    float v[32] = {0};
    gw_tensor(&w, "a", GGML_F32, 2, 8, 4, v, sizeof v);
    edit(&w);
    gw_write(&w, tmp_path, NULL);
    gw_free(&w);
    expect_open_error(problem);
}

static void e_version1(gw *w) { w->version = 1; }
static void e_version4(gw *w) { w->version = 4; }
static void e_blockpartial(gw *w) { w->t[0].type = GGML_Q8_0; w->t[0].ne[0] = 40; w->t[0].ne[1] = 1; }
static void e_dims(gw *w) { w->t[0].nd = 5; }
static void e_unknown_type(gw *w) { w->t[0].type = 99; }
static void e_align(gw *w) { gw_u32(w, "general.alignment", 48); }
static void e_align_type(gw *w) { gw_u64(w, "general.alignment", 64); }
static void e_kvtype(gw *w) { gw_key(w, "weird", 13); put_u32(&w->kv, 0); }
static void e_dup_tensor(gw *w) { float v[32] = {0}; gw_tensor(w, "a", GGML_F32, 2, 8, 4, v, sizeof v); }
static void e_dup_key(gw *w) { gw_str(w, "general.architecture", "qwen2"); }
static void e_huge_ne(gw *w) { w->t[0].ne[1] = 1ull << 62; }
static void e_big_tensor(gw *w) { w->t[0].ne[1] = 5; }

static void test_corrupted_gguf_headers(void **state) {
    (void)state;
    corrupt_and_expect(e_version1, "GGUF version 1 not supported");
    corrupt_and_expect(e_version4, "GGUF version 4 not supported");
    corrupt_and_expect(e_blockpartial, "not a multiple of the Q8_0 block");
    corrupt_and_expect(e_dims, "5 dimensions");
    corrupt_and_expect(e_unknown_type, "unknown ggml type 99");
    corrupt_and_expect(e_align, "general.alignment 48 is not a power of two");
    corrupt_and_expect(e_align_type, "general.alignment must be uint32");
    corrupt_and_expect(e_kvtype, "key weird: unknown value type 13");
    corrupt_and_expect(e_dup_tensor, "duplicate tensor a");
    corrupt_and_expect(e_dup_key, "duplicate key general.architecture");
    corrupt_and_expect(e_huge_ne, "size overflows");
    corrupt_and_expect(e_big_tensor, "needs bytes [0, 160)");

    /* Byte edits the writer cannot express: bad magic, absurd counts and lengths. */
    gw w;
    gw_init(&w);
    gw_str(&w, "general.architecture", "llama");
    gw_write(&w, tmp_path, NULL);
    buf b = gw_bytes(&w);
    gw_free(&w);
    uint8_t *p = b.p;
    memcpy(p, "GGUX", 4);
    write_file(tmp_path, p, b.n);
    expect_open_error("bad magic");
    memcpy(p, "GGUF", 4);
    uint64_t huge = UINT64_MAX;
    memcpy(p + 8, &huge, 8);   /* tensor count */
    write_file(tmp_path, p, b.n);
    expect_open_error("header claims");
    uint64_t zero = 0;
    memcpy(p + 8, &zero, 8);
    memcpy(p + 24, &huge, 8);  /* length of the first key */
    write_file(tmp_path, p, b.n);
    expect_open_error("truncated");
    free(b.p);

    /* A tensor offset that is not a multiple of general.alignment. */
    gw_init(&w);
    float v[32] = {0};
    gw_tensor(&w, "a", GGML_F32, 1, 8, 1, v, 32);
    gw_tensor(&w, "b", GGML_F32, 1, 8, 1, v, 32);
    b = gw_bytes(&w);
    gw_free(&w);
    /* the second tensor's offset (32) sits 8 bytes before the end of the directory */
    size_t dir_end = 24 + (8 + 1 + 4 + 8 + 4 + 8) * 2;
    uint64_t off;
    memcpy(&off, b.p + dir_end - 8, 8);
    assert_int_equal(off, 32);
    off = 36;
    memcpy(b.p + dir_end - 8, &off, 8);
    write_file(tmp_path, b.p, b.n);
    expect_open_error("offset 36 is not aligned to 32");
    free(b.p);
}

/* ---- the default model ---------------------------------------------------------------- */

#define SMOL "models/SmolLM2-135M-Instruct.Q4_1.gguf"

static void test_smollm2_q4_1_gguf_loads(void **state) {
    (void)state;
    if (access(SMOL, R_OK) != 0) {
        printf("SKIP: %s absent (run scripts/fetch-model.sh)\n", SMOL);
        skip();
    }
    char err[512];
    model *m = model_load(SMOL, err, sizeof err);
    if (!m) fail_msg("%s", err);
    const model_config *c = &m->cfg;
    assert_int_equal(c->arch, MODEL_ARCH_LLAMA);
    assert_int_equal(c->n_layers, 30);
    assert_int_equal(c->hidden, 576);
    assert_int_equal(c->n_heads, 9);
    assert_int_equal(c->n_kv_heads, 3);
    assert_int_equal(c->head_dim, 64);
    assert_int_equal(c->ffn, 1536);
    assert_int_equal(c->vocab, 49152);
    assert_float_equal(c->rope_theta, 100000.0f, 0);
    assert_float_equal(c->rms_eps, 1e-5f, 0);
    assert_int_equal(c->max_pos, 8192);
    assert_int_equal(c->tied_embeddings, 1);
    assert_int_equal(c->bos_id, 1);
    assert_int_equal(c->eos_ids[0], 2);
    assert_int_equal(m->tok_embd.dtype, TDT_Q8_0);
    assert_int_equal(m->layers[29].wq.dtype, TDT_Q4_1);
    assert_int_equal(m->layers[29].wq.unpermute_heads, 9);
    assert_int_equal(m->layers[29].wk.unpermute_heads, 3);

    /* Logical row r of wk is stored row 2*(r%32) + (r%64)/32 of its head, dequantized. */
    const tensor_view *wk = &m->layers[5].wk;
    float *all = malloc(192 * 576 * 4), row[576];
    assert_int_equal(tensor_to_f32(wk, all), 0);
    size_t rb = ggml_row_size(GGML_Q4_1, 576);
    int rows[] = {0, 1, 31, 32, 33, 63, 64, 100, 191};
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        int r = rows[i], h = r / 64, k = r % 64;
        int s = h * 64 + 2 * (k % 32) + k / 32;
        assert_int_equal(ggml_dequantize(GGML_Q4_1, (const uint8_t *)wk->data + (size_t)s * rb, row, 576), 0);
        assert_memory_equal(all + (size_t)r * 576, row, sizeof row);
    }
    free(all);
    float *norm = malloc(576 * 4);
    assert_int_equal(tensor_to_f32(&m->out_norm, norm), 0);
    assert_memory_equal(norm, m->out_norm.data, 576 * 4);   /* F32 is copied as is */
    free(norm);
    model_free(m);
}

/* Render `msgs` (JSON) with an engine's template; caller frees. */
static char *render_with(const tmpl_template *t, const char *msgs, int agp, const char *bos, const char *eos) {
    json_t *m = json_loads(msgs, 0, NULL);
    assert_non_null(m);
    json_t *ctx = tmpl_chat_context(m, NULL, agp, bos, eos, NULL);
    char *out = NULL, err[512];
    size_t len = 0;
    if (tmpl_render(t, ctx, &out, &len, err, sizeof err)) fail_msg("render: %s", err);
    json_decref(ctx);
    json_decref(m);
    return out;
}

/* --chat-template FILE replaces the model's template: SmolLM2 with the Phi-3.5 template of
 * the fixtures renders what HF transformers rendered with that template; a missing or
 * broken file is an error naming the option. */
static void test_chat_template_option_replaces_the_models(void **state) {
    (void)state;
    if (access(SMOL, R_OK) != 0) {
        printf("SKIP: %s absent (run scripts/fetch-model.sh)\n", SMOL);
        skip();
    }
    json_t *g = fixture_json("chat-templates/golden.json");
    assert_non_null(g);
    json_t *want = NULL, *r;
    size_t i;
    json_array_foreach(json_object_get(g, "renders"), i, r) {
        if (!strcmp(json_string_value(json_object_get(r, "template")), "microsoft-Phi-3.5-mini-instruct") &&
            json_object_get(r, "text") && !json_is_true(json_object_get(r, "tools")) &&
            json_is_true(json_object_get(r, "add_generation_prompt"))) {
            want = r;
            break;
        }
    }
    assert_non_null(want);
    char *msgs = json_dumps(json_object_get(json_object_get(g, "conversations"),
                                            json_string_value(json_object_get(want, "conversation"))), 0);
    char err[1024] = "";
    engine_config c = {.model_path = SMOL, .max_seq_len = 256, .max_batch = 1, .kv_bytes = 32u << 20, .threads = 1,
                       .chat_template_path = fixture_path("chat-templates/templates/microsoft-Phi-3.5-mini-instruct.jinja")};
    engine *e = engine_create(&c, err, sizeof err);
    if (!e) fail_msg("%s", err);
    char *out = render_with(engine_template(e), msgs, 1, json_string_value(json_object_get(want, "bos_token")),
                            json_string_value(json_object_get(want, "eos_token")));
    assert_string_equal(out, json_string_value(json_object_get(want, "text")));
    free(out);
    engine_destroy(e);
    c.chat_template_path = "/nonexistent/template.jinja";
    assert_null(engine_create(&c, err, sizeof err));
    assert_non_null(strstr(err, "--chat-template /nonexistent/template.jinja"));
    char bad[] = "/tmp/specd-bad-template-XXXXXX";
    int fd = mkstemp(bad);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, "{% for x in %}", 14), 14);
    close(fd);
    c.chat_template_path = bad;
    assert_null(engine_create(&c, err, sizeof err));
    assert_non_null(strstr(err, "--chat-template"));
    unlink(bad);
    free(msgs);
    json_decref(g);
}

/* config/templates/gemma3.jinja, for Gemma GGUF files without a template: turns as Gemma
 * formats them, the system message folded into the first user turn. */
static void test_gemma3_template_file(void **state) {
    (void)state;
    size_t len = 0;
    FILE *f = fopen("config/templates/gemma3.jinja", "rb");
    assert_non_null(f);
    char *src = malloc(1 << 16);
    len = fread(src, 1, 1 << 16, f);
    fclose(f);
    char err[512];
    tmpl_template *t = tmpl_parse(src, len, err, sizeof err);
    free(src);
    if (!t) fail_msg("%s", err);
    char *out = render_with(t,
                            "[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":\"Hi\"},"
                            "{\"role\":\"assistant\",\"content\":\"Hello!\"},"
                            "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Why?\"}]}]",
                            1, "<bos>", "<eos>");
    assert_string_equal(out, "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                             "<start_of_turn>model\nHello!<end_of_turn>\n"
                             "<start_of_turn>user\nWhy?<end_of_turn>\n<start_of_turn>model\n");
    free(out);
    json_t *m = json_loads("[{\"role\":\"tool\",\"content\":\"x\"}]", 0, NULL);
    json_t *ctx = tmpl_chat_context(m, NULL, 1, "<bos>", "<eos>", NULL);
    char *o2 = NULL;
    assert_int_equal(tmpl_render(t, ctx, &o2, &len, err, sizeof err), SPECD_ETEMPLATE);
    assert_non_null(strstr(err, "user or assistant"));
    free(o2);
    json_decref(ctx);
    json_decref(m);
    tmpl_free(t);
}

/* ---- the fixture families written as GGUF ----------------------------------------------- */

/* A view as fp32, rows permuted as llama.cpp's converter stores Q and K (heads > 0: the
 * inverse of what the loader undoes), + `add` to every element (Gemma's norms). */
static float *view_f32(const tensor_view *v, int heads, float add) {
    int64_t n = tensor_numel(v), rows = v->ndim == 2 ? v->shape[0] : 1, cols = n / rows;
    float *x = malloc((size_t)n * sizeof(float)), *y = malloc((size_t)n * sizeof(float));
    assert_int_equal(tensor_to_f32(v, x), 0);
    for (int64_t i = 0; i < n; i++) x[i] += add;
    if (heads <= 0) {
        free(y);
        return x;
    }
    int64_t hd = rows / heads, half = hd / 2;
    for (int64_t r = 0; r < rows; r++) {   /* logical row j*half + i of a head is stored at 2i + j */
        int64_t h = r / hd, k = r % hd, st = h * hd + 2 * (k % half) + k / half;
        memcpy(y + st * cols, x + r * cols, (size_t)cols * sizeof(float));
    }
    free(x);
    return y;
}

static void put_view(gw *w, const char *name, const tensor_view *v, int heads, float add) {
    float *x = view_f32(v, heads, add);
    int64_t n = tensor_numel(v);
    if (v->ndim == 2) gw_tensor(w, name, GGML_F32, 2, (uint64_t)v->shape[1], (uint64_t)v->shape[0], x, (size_t)n * 4);
    else gw_tensor(w, name, GGML_F32, 1, (uint64_t)n, 1, x, (size_t)n * 4);
    free(x);
}

/* Rows of several views of one width, one tensor (fused qkv / gate_up, stacked experts). */
static void put_concat(gw *w, const char *name, const tensor_view *const *vs, int n, int stack) {
    buf b = {0};
    int64_t rows = 0, cols = vs[0]->shape[1];
    for (int i = 0; i < n; i++) {
        float *x = view_f32(vs[i], 0, 0);
        put(&b, x, (size_t)tensor_numel(vs[i]) * 4);
        rows += vs[i]->shape[0];
        free(x);
    }
    gw_tensor(w, name, GGML_F32, stack ? 3 : 2, (uint64_t)cols, (uint64_t)(stack ? vs[0]->shape[0] : rows), b.p, b.n);
    if (stack) w->t[w->nt - 1].ne[2] = (uint64_t)n;
    free(b.p);
}

/* Write fixture model `name` (HF) as a GGUF file the way llama.cpp's converter lays it out,
 * then check the GGUF load gives HF's logits: tensor names, fused and stacked layouts,
 * Gemma's stored 1 + w norms, Mixtral's permuted Q/K and the metadata of each family. */
static void check_family_gguf(const char *name, const char *arch) {
    char dir[4096], err[512], key[160];
    snprintf(dir, sizeof dir, "%s/models/%s", fixtures_dir(), name);
    model *hf = model_load(dir, err, sizeof err);
    if (!hf) fail_msg("%s", err);
    const model_config *c = &hf->cfg;
    int gemma = c->arch == MODEL_ARCH_GEMMA3, llama = !strcmp(arch, "llama");
    float n1 = gemma ? 1.0f : 0.0f;
    gw w;
    gw_init(&w);
    gw_str(&w, "general.architecture", arch);
#define AK(s) (snprintf(key, sizeof key, "%s." s, arch), key)
    gw_u32(&w, AK("block_count"), (uint32_t)c->n_layers);
    gw_u32(&w, AK("embedding_length"), (uint32_t)c->hidden);
    gw_u32(&w, AK("attention.head_count"), (uint32_t)c->n_heads);
    gw_u32(&w, AK("attention.head_count_kv"), (uint32_t)c->n_kv_heads);
    gw_u32(&w, AK("attention.key_length"), (uint32_t)c->head_dim);
    gw_u32(&w, AK("feed_forward_length"), (uint32_t)c->ffn);
    gw_f32(&w, AK("attention.layer_norm_rms_epsilon"), c->rms_eps);
    gw_f32(&w, AK("rope.freq_base"), c->rope_theta);
    if (c->n_experts) {
        gw_u32(&w, AK("expert_count"), (uint32_t)c->n_experts);
        gw_u32(&w, AK("expert_used_count"), (uint32_t)c->n_experts_used);
        if (!llama) gw_u32(&w, AK("expert_feed_forward_length"), (uint32_t)c->moe_ffn);
    }
    if (c->sliding_window) gw_u32(&w, AK("attention.sliding_window"), (uint32_t)c->sliding_window);
    if (gemma) {
        int pat = 0;
        while (pat < c->n_layers && c->layer_swa[pat]) pat++;
        gw_u32(&w, AK("attention.sliding_window_pattern"), (uint32_t)(pat + 1));
    }
#undef AK
    put_view(&w, "token_embd.weight", &hf->tok_embd, 0, 0);
    put_view(&w, "output_norm.weight", &hf->out_norm, 0, n1);
    if (!c->tied_embeddings) put_view(&w, "output.weight", &hf->lm_head, 0, 0);
    for (int l = 0; l < c->n_layers; l++) {
        const model_layer *L = &hf->layers[l];
        char t[96];
#define TN(s) (snprintf(t, sizeof t, "blk.%d." s, l), t)
        put_view(&w, TN("attn_norm.weight"), &L->attn_norm, 0, n1);
        put_view(&w, TN("ffn_norm.weight"), &L->ffn_norm, 0, n1);
        put_view(&w, TN("attn_output.weight"), &L->wo, 0, 0);
        if (c->arch == MODEL_ARCH_PHI3) {
            const tensor_view *qkv[] = {&L->wq, &L->wk, &L->wv}, *gu[] = {&L->w_gate, &L->w_up};
            put_concat(&w, TN("attn_qkv.weight"), qkv, 3, 0);
            put_concat(&w, TN("ffn_up.weight"), gu, 2, 0);
        } else {
            put_view(&w, TN("attn_q.weight"), &L->wq, llama ? c->n_heads : 0, 0);
            put_view(&w, TN("attn_k.weight"), &L->wk, llama ? c->n_kv_heads : 0, 0);
            put_view(&w, TN("attn_v.weight"), &L->wv, 0, 0);
            if (!c->n_experts) put_view(&w, TN("ffn_gate.weight"), &L->w_gate, 0, 0);
            if (!c->n_experts) put_view(&w, TN("ffn_up.weight"), &L->w_up, 0, 0);
        }
        if (!c->n_experts) put_view(&w, TN("ffn_down.weight"), &L->w_down, 0, 0);
        if (c->qk_norm) {
            put_view(&w, TN("attn_q_norm.weight"), &L->q_norm, 0, n1);
            put_view(&w, TN("attn_k_norm.weight"), &L->k_norm, 0, n1);
        }
        if (c->sandwich_norms) {
            put_view(&w, TN("post_attention_norm.weight"), &L->post_attn_norm, 0, n1);
            put_view(&w, TN("post_ffw_norm.weight"), &L->post_ffn_norm, 0, n1);
        }
        if (c->n_experts) {
            const tensor_view *g[MODEL_MAX_EXPERTS], *u[MODEL_MAX_EXPERTS], *d[MODEL_MAX_EXPERTS];
            for (int e = 0; e < c->n_experts; e++) {
                g[e] = &L->exp_gate[e];
                u[e] = &L->exp_up[e];
                d[e] = &L->exp_down[e];
            }
            put_view(&w, TN("ffn_gate_inp.weight"), &L->router, 0, 0);
            put_concat(&w, TN("ffn_gate_exps.weight"), g, c->n_experts, 1);
            put_concat(&w, TN("ffn_up_exps.weight"), u, c->n_experts, 1);
            put_concat(&w, TN("ffn_down_exps.weight"), d, c->n_experts, 1);
        }
#undef TN
    }
    gw_write(&w, tmp_path, NULL);
    gw_free(&w);
    model *gm = model_load(tmp_path, err, sizeof err);
    if (!gm) fail_msg("%s as GGUF: %s", name, err);
    assert_int_equal(gm->cfg.arch, c->arch);
    assert_int_equal(gm->cfg.n_experts, c->n_experts);
    assert_int_equal(gm->cfg.norm_plus_one, 0);   /* stored as 1 + w */
    assert_memory_equal(gm->cfg.layer_swa, c->layer_swa, (size_t)c->n_layers);
    /* last-position logits of the 100-token golden prompt (past Gemma's window of 64) */
    snprintf(key, sizeof key, "models/%s/golden.json", name);
    json_t *g = fixture_json(key), *cs = NULL, *p;
    size_t i;
    json_array_foreach(json_object_get(g, "prompts"), i, p)
        if (json_array_size(json_object_get(p, "prompt")) == 100) cs = p;
    assert_non_null(cs);
    int n, V = c->vocab;
    int32_t *ids = json_ids(json_object_get(cs, "prompt"), &n);
    runner_config rc = {.num_blocks = 16, .block_size = 16, .max_batch = 1, .max_seq_len = 128,
                        .max_tokens_per_step = 128, .threads = 2};
    runner *r = runner_cpu_create(gm, NULL, &rc, err, sizeof err);
    if (!r) fail_msg("%s", err);
    int32_t blocks[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    assert_int_equal(r->ops->slot_write_blocks(r, 0, 0, blocks, 8), 0);
    float *lg = malloc(sizeof(float) * (size_t)V);
    runner_row row = {.slot = 0, .n_new = n, .tok_off = 0, .n_logits = 1, .logits_off = 0};
    runner_batch b = {.which = RUNNER_TARGET, .n_rows = 1, .rows = &row, .tokens = ids, .n_tokens = n, .logits = lg};
    assert_int_equal(runner_forward(r, &b), 0);
    double rel = rel_err_json(lg, json_object_get(cs, "last_logits"), V);
    printf("  %-14s as GGUF (%s): 100-token prompt, last logits rel err %.2e\n", name, arch, rel);
    assert_true(rel < 1e-4);
    free(lg);
    free(ids);
    runner_destroy(r);
    json_decref(g);
    model_free(gm);
    model_free(hf);
}

static void test_fixture_families_as_gguf(void **state) {
    (void)state;
    check_family_gguf("gemma3-tiny", "gemma3");
    check_family_gguf("qwen3moe-tiny", "qwen3moe");
    check_family_gguf("mixtral-tiny", "llama");
    check_family_gguf("phi3-tiny", "phi3");
    check_family_gguf("mistral-swa-tiny", "llama");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_metadata_values_and_types, setup_tmp, teardown_tmp),
        cmocka_unit_test(test_row_sizes_and_names),
        cmocka_unit_test_setup_teardown(test_f32_f16_bf16_tensors_exact, setup_tmp, teardown_tmp),
        cmocka_unit_test_setup_teardown(test_q8_0_q4_0_q4_1_known_values, setup_tmp, teardown_tmp),
        cmocka_unit_test_setup_teardown(test_q4_k_known_values, setup_tmp, teardown_tmp),
        cmocka_unit_test_setup_teardown(test_q6_k_known_values, setup_tmp, teardown_tmp),
        cmocka_unit_test_setup_teardown(test_q5_0_q5_1_q5_k_known_values, setup_tmp, teardown_tmp),
        cmocka_unit_test(test_dequantize_rejects_partial_blocks_and_unknown_types),
        cmocka_unit_test_setup_teardown(test_gguf_llama_config_from_metadata, setup_tmp, teardown_tmp),
        cmocka_unit_test_setup_teardown(test_gguf_qwen_variants, setup_tmp, teardown_tmp),
        cmocka_unit_test_setup_teardown(test_gguf_unpermute_restores_hf_row_order, setup_tmp, teardown_tmp),
        cmocka_unit_test_setup_teardown(test_gguf_llama3_rope_from_rope_freqs, setup_tmp, teardown_tmp),
        cmocka_unit_test_setup_teardown(test_gguf_model_errors_name_file_and_problem, setup_tmp, teardown_tmp),
        cmocka_unit_test_setup_teardown(test_truncated_gguf_every_header_offset, setup_tmp, teardown_tmp),
        cmocka_unit_test_setup_teardown(test_corrupted_gguf_headers, setup_tmp, teardown_tmp),
        cmocka_unit_test(test_smollm2_q4_1_gguf_loads),
        cmocka_unit_test(test_chat_template_option_replaces_the_models),
        cmocka_unit_test(test_gemma3_template_file),
        cmocka_unit_test_setup_teardown(test_fixture_families_as_gguf, setup_tmp, teardown_tmp),
    };
    return cmocka_run_group_tests_name("gguf", tests, NULL, NULL);
}
