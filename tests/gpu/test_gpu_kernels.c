/* GPU kernel tests: every launcher in kernels/specd_kernels.h against a double-precision
 * CPU reference on fresh random inputs (seed printed; SPECD_TEST_SEED repeats a run),
 * with outputs poisoned by NaN first so an element the kernel fails to write fails the
 * test. Each test prints its max relative error (max abs error / max abs reference). */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include "engine/core/sample.h"
#include "engine/model/fp8.h"
#include "kernels/specd_kernels.h"
#include "tests/gpu/gpu_util.h"

static uint64_t g_rng;

static void report(const char *what, double err) { printf("    %-44s max rel err %.3e\n", what, err); }

static void test_embed_copies_exact_rows(void **state) {
    (void)state;
    int vocab = 1000, hidden = 320, n = 37;
    uint16_t *tab = malloc((size_t)vocab * hidden * 2);
    int32_t tok[37];
    for (size_t i = 0; i < (size_t)vocab * hidden; i++) tab[i] = gu_f2bf(gu_uniform(&g_rng, -2, 2));
    for (int t = 0; t < n; t++) tok[t] = (int32_t)(gu_next(&g_rng) % vocab);
    uint16_t *d_tab = gu_upload(tab, (size_t)vocab * hidden * 2);
    int32_t *d_tok = gu_upload(tok, sizeof tok);
    float *d_out = gu_dev((size_t)n * hidden * 4);
    assert_int_equal(k_embed(d_tab, d_tok, d_out, n, hidden, vocab, 0), 0);
    float *out = malloc((size_t)n * hidden * 4);
    gu_download(out, d_out, (size_t)n * hidden * 4);
    for (int t = 0; t < n; t++)
        for (int j = 0; j < hidden; j++)
            assert_true(out[(size_t)t * hidden + j] == gu_bf2f(tab[(size_t)tok[t] * hidden + j]));
    report("embed", 0.0);
    cudaFree(d_tab); cudaFree(d_tok); cudaFree(d_out);
    free(tab); free(out);
}

static void test_rmsnorm_gathered_rows_match_reference(void **state) {
    (void)state;
    int rows_all = 50, hidden = 1000, n = 13;
    float *x = malloc((size_t)rows_all * hidden * 4), w[1000];
    int32_t rows[13];
    for (size_t i = 0; i < (size_t)rows_all * hidden; i++) x[i] = gu_uniform(&g_rng, -3, 3);
    for (int j = 0; j < hidden; j++) w[j] = gu_uniform(&g_rng, 0.5f, 1.5f);
    for (int i = 0; i < n; i++) rows[i] = (int32_t)(gu_next(&g_rng) % rows_all);
    float *d_x = gu_upload(x, (size_t)rows_all * hidden * 4), *d_w = gu_upload(w, sizeof w);
    int32_t *d_rows = gu_upload(rows, sizeof rows);
    uint16_t *d_out = gu_dev((size_t)n * hidden * 2);
    assert_int_equal(k_rmsnorm(d_x, d_rows, d_w, d_out, n, hidden, 1e-5f, 0), 0);
    uint16_t *o = malloc((size_t)n * hidden * 2);
    gu_download(o, d_out, (size_t)n * hidden * 2);
    float *of = malloc((size_t)n * hidden * 4);
    double *ref = malloc((size_t)n * hidden * 8);
    for (int i = 0; i < n; i++) {
        const float *xr = x + (size_t)rows[i] * hidden;
        double ss = 0;
        for (int j = 0; j < hidden; j++) ss += (double)xr[j] * xr[j];
        double inv = 1.0 / sqrt(ss / hidden + 1e-5);
        for (int j = 0; j < hidden; j++) {
            ref[(size_t)i * hidden + j] = xr[j] * inv * w[j];
            of[(size_t)i * hidden + j] = gu_bf2f(o[(size_t)i * hidden + j]);
        }
    }
    double e = gu_rel_err(of, ref, (size_t)n * hidden);
    report("rmsnorm (gathered rows)", e);
    assert_true(e < 4e-3);
    cudaFree(d_x); cudaFree(d_w); cudaFree(d_rows); cudaFree(d_out);
    free(x); free(o); free(of); free(ref);
}

/* A producer that rounds as it writes (d_b, d_sb) against the plain producer followed by
 * k_quant_x8 (d_a, d_sa): bf16 outputs [tot], then the int8 codes and the (scale, sum)
 * pairs of the scratch layout (kernels/kutil.h k_x8_codes_bytes: codes padded to 16 bytes,
 * then one 8-byte pair per 32 elements). Prints and returns how many differ. */
static long x8_differences(const uint16_t *d_a, const uint16_t *d_b, const uint8_t *d_sa, const uint8_t *d_sb,
                           size_t tot, size_t sb, const char *what) {
    const size_t o = (tot + 15) / 16 * 16;
    uint16_t *a = malloc(tot * 2), *b = malloc(tot * 2);
    uint8_t *qa = malloc(sb), *qb = malloc(sb);
    gu_download(a, d_a, tot * 2);
    gu_download(b, d_b, tot * 2);
    gu_download(qa, d_sa, sb);
    gu_download(qb, d_sb, sb);
    long bad_out = 0, bad_codes = 0, bad_scales = 0;
    for (size_t i = 0; i < tot; i++) bad_out += a[i] != b[i], bad_codes += qa[i] != qb[i];
    for (size_t g = 0; g < tot / 32; g++) bad_scales += memcmp(qa + o + 8 * g, qb + o + 8 * g, 8) != 0;
    printf("    %s: %ld outputs, %ld codes, %ld group scales differ\n", what, bad_out, bad_codes, bad_scales);
    free(a), free(b), free(qa), free(qb);
    return bad_out + bad_codes + bad_scales;
}

/* k_rmsnorm_q8: its bf16 output equals k_rmsnorm's, and its int8 codes and (scale, code
 * sum) pairs equal what k_quant_x8 makes of that output, bit for bit (the GEMV after it
 * then computes exactly what it did with the rounding launch); hidden sizes with one and
 * several passes of the block, some with idle threads in the last; a group of zeros; the
 * shapes it refuses. */
static void test_rmsnorm_q8_equals_rmsnorm_then_quant_x8(void **state) {
    (void)state;
    const int sizes[5] = {576, 2048, 3072, 4096, 5120}, n = 3;
    for (int si = 0; si < 5; si++) {
        const int hidden = sizes[si];
        const size_t tot = (size_t)n * hidden, sb = k_gemv_qi8_scratch(hidden, n);
        float *x = malloc(tot * 4), *w = malloc((size_t)hidden * 4);
        for (size_t i = 0; i < tot; i++) x[i] = gu_uniform(&g_rng, -3, 3) * (i % 997 == 0 ? 40.f : 1.f);
        for (int k = 0; k < 32; k++) x[(size_t)hidden + 64 + k] = 0.f;   /* row 1: one all-zero group */
        for (int j = 0; j < hidden; j++) w[j] = gu_uniform(&g_rng, 0.5f, 1.5f);
        float *d_x = gu_upload(x, tot * 4), *d_w = gu_upload(w, (size_t)hidden * 4);
        uint16_t *d_a = gu_dev(tot * 2), *d_b = gu_dev(tot * 2);
        uint8_t *d_sa = gu_dev(sb), *d_sb = gu_dev(sb);
        assert_int_equal(k_rmsnorm(d_x, NULL, d_w, d_a, n, hidden, 1e-5f, 0), 0);
        assert_int_equal(k_quant_x8(d_a, n, hidden, d_sa, 0), 0);
        assert_int_equal(k_rmsnorm_q8(d_x, d_w, d_b, n, hidden, 1e-5f, d_sb, 0), 0);
        char what[64];
        snprintf(what, sizeof what, "rmsnorm_q8 hidden %d", hidden);
        assert_int_equal(x8_differences(d_a, d_b, d_sa, d_sb, tot, sb, what), 0);
        cudaFree(d_x), cudaFree(d_w), cudaFree(d_a), cudaFree(d_b), cudaFree(d_sa), cudaFree(d_sb);
        free(x), free(w);
    }
    float *d = gu_dev(1 << 20);
    assert_int_equal(k_rmsnorm_q8(d, d, (uint16_t *)d, 1, 1000, 1e-5f, d, 0), -1);        /* not whole groups */
    assert_int_equal(k_rmsnorm_q8(d, d, (uint16_t *)d, 1, 1024, 1e-5f, NULL, 0), -1);
    assert_int_equal(k_rmsnorm_q8(d + 1, d, (uint16_t *)d, 1, 1024, 1e-5f, d, 0), -1);   /* unaligned x */
    cudaFree(d);
}

/* k_gated_mul_q8 (SiLU and GELU): its bf16 output equals k_silu_mul's / k_gelu_tanh_mul's
 * and its codes and pairs what k_quant_x8 makes of that output, bit for bit; an FFN width
 * with a partial last block; widths that are not whole groups refused. */
static void test_gated_mul_q8_equals_gated_mul_then_quant_x8(void **state) {
    (void)state;
    const int n = 3, widths[2] = {14336, 8160};
    for (int wi = 0; wi < 2; wi++)
        for (int gelu = 0; gelu < 2; gelu++) {
            const int ffn = widths[wi];
            const size_t tot = (size_t)n * ffn, sb = k_gemv_qi8_scratch(ffn, n);
            float *gu = malloc(tot * 2 * 4);
            for (size_t i = 0; i < tot * 2; i++) gu[i] = gu_uniform(&g_rng, -6, 6);
            for (int k = 0; k < 32; k++) gu[(size_t)2 * ffn + 32 + k] = 0.f;   /* row 1: a group of zeros */
            float *d_gu = gu_upload(gu, tot * 2 * 4);
            uint16_t *d_a = gu_dev(tot * 2), *d_b = gu_dev(tot * 2);
            uint8_t *d_sa = gu_dev(sb), *d_sb = gu_dev(sb);
            assert_int_equal(gelu ? k_gelu_tanh_mul(d_gu, d_a, n, ffn, 0) : k_silu_mul(d_gu, d_a, n, ffn, 0), 0);
            assert_int_equal(k_quant_x8(d_a, n, ffn, d_sa, 0), 0);
            assert_int_equal(k_gated_mul_q8(d_gu, d_b, n, ffn, gelu, d_sb, 0), 0);
            char what[64];
            snprintf(what, sizeof what, "gated_mul_q8 ffn %d %s", ffn, gelu ? "gelu" : "silu");
            assert_int_equal(x8_differences(d_a, d_b, d_sa, d_sb, tot, sb, what), 0);
            cudaFree(d_gu), cudaFree(d_a), cudaFree(d_b), cudaFree(d_sa), cudaFree(d_sb);
            free(gu);
        }
    float *d = gu_dev(1 << 20);
    assert_int_equal(k_gated_mul_q8(d, (uint16_t *)d, 1, 1000, 0, d, 0), -1);
    assert_int_equal(k_gated_mul_q8(d, (uint16_t *)d, 1, 1024, 0, NULL, 0), -1);
    cudaFree(d);
}

/* Bytes of two device buffers that differ (0: equal). */
static long dev_bytes_differ(const void *a, const void *b, size_t bytes) {
    uint8_t *x = malloc(bytes), *y = malloc(bytes);
    gu_download(x, a, bytes);
    gu_download(y, b, bytes);
    long d = 0;
    for (size_t i = 0; i < bytes; i++) d += x[i] != y[i];
    free(x), free(y);
    return d;
}

/* k_rmsnorm_fp8 against the launches it replaces, bit for bit: k_fp8_scale_rows adding an
 * unscaled GEMM's products into the residual (or none), k_rmsnorm, k_quant_fp8_rows -- the
 * residual after, the E4M3 bytes and the row scales; with the token scales in their own
 * buffer and in the scale buffer itself (as the runner passes them); widths with one and
 * several passes of the block; an all-zero row (scale 1). */
static void test_rmsnorm_fp8_equals_rescale_norm_then_quant(void **state) {
    (void)state;
    const int sizes[4] = {576, 2048, 4096, 5120}, n = 5;
    for (int si = 0; si < 4; si++)
        for (int add = 0; add < 2; add++) {
            const int hidden = sizes[si];
            const size_t tot = (size_t)n * hidden;
            float *x = malloc(tot * 4), *t = malloc(tot * 4), *w = malloc((size_t)hidden * 4), *sw = malloc((size_t)hidden * 4), sx[5];
            for (size_t i = 0; i < tot; i++) x[i] = gu_uniform(&g_rng, -3, 3), t[i] = gu_uniform(&g_rng, -900, 900);
            for (int j = 0; j < hidden; j++) {
                w[j] = gu_uniform(&g_rng, 0.5f, 1.5f);
                sw[j] = gu_uniform(&g_rng, 1e-4f, 1e-3f);
                x[(size_t)2 * hidden + j] = t[(size_t)2 * hidden + j] = 0.f;   /* row 2: zeros */
            }
            for (int i = 0; i < n; i++) sx[i] = gu_uniform(&g_rng, 0.002f, 0.02f);
            float *d_ra = gu_upload(x, tot * 4), *d_rb = gu_upload(x, tot * 4), *d_t = gu_upload(t, tot * 4);
            float *d_w = gu_upload(w, (size_t)hidden * 4), *d_sw = gu_upload(sw, (size_t)hidden * 4);
            float *d_sx = gu_upload(sx, sizeof sx), *d_sa = gu_dev(n * 4), *d_sb = gu_upload(sx, sizeof sx);
            uint16_t *d_h = gu_dev(tot * 2);
            uint8_t *d_qa = gu_dev(tot), *d_qb = gu_dev(tot);
            if (add) assert_int_equal(k_fp8_scale_rows(d_t, d_sw, d_sx, d_ra, n, hidden, 1, 0), 0);
            assert_int_equal(k_rmsnorm(d_ra, NULL, d_w, d_h, n, hidden, 1e-5f, 0), 0);
            assert_int_equal(k_quant_fp8_rows(d_h, n, hidden, d_qa, d_sa, 0), 0);
            /* the token scales read from the buffer the new row scales go to */
            assert_int_equal(k_rmsnorm_fp8(add ? d_t : NULL, add ? d_sw : NULL, add ? d_sb : NULL, d_rb, d_w, n, hidden,
                                           1e-5f, d_qb, d_sb, 0), 0);
            const long dr = dev_bytes_differ(d_ra, d_rb, tot * 4), dq = dev_bytes_differ(d_qa, d_qb, tot),
                       ds = dev_bytes_differ(d_sa, d_sb, n * 4);
            print_message("  rmsnorm_fp8 hidden %d add %d: %ld residual, %ld code, %ld scale bytes differ\n", hidden,
                          add, dr, dq, ds);
            assert_int_equal(dr + dq + ds, 0);
            float s2;
            gu_download(&s2, d_sb + 2, 4);
            assert_true(s2 == 1.f);   /* the zero row */
            cudaFree(d_ra), cudaFree(d_rb), cudaFree(d_t), cudaFree(d_w), cudaFree(d_sw), cudaFree(d_sx);
            cudaFree(d_sa), cudaFree(d_sb), cudaFree(d_h), cudaFree(d_qa), cudaFree(d_qb);
            free(x), free(t), free(w), free(sw);
        }
    float *d = gu_dev(1 << 16);
    assert_int_equal(k_rmsnorm_fp8(NULL, NULL, NULL, d, d, 1, 1002, 1e-5f, (uint8_t *)d, d, 0), -1);   /* % 4 */
    assert_int_equal(k_rmsnorm_fp8(d, NULL, d, d, d, 1, 1024, 1e-5f, (uint8_t *)d, d, 0), -1);          /* no sw */
    assert_int_equal(k_rmsnorm_fp8(NULL, NULL, NULL, d + 1, d, 1, 1024, 1e-5f, (uint8_t *)d, d, 0), -1); /* align */
    cudaFree(d);
}

/* k_gated_mul_fp8q against k_gated_mul_fp8 then k_quant_fp8_rows, bit for bit (bytes and
 * row scales), SiLU and GELU, with the token scales in the scale buffer itself; a width
 * past 48 KB of shared memory; widths over the cap refused. */
static void test_gated_mul_fp8q_equals_gated_mul_then_quant(void **state) {
    (void)state;
    const int n = 4, widths[3] = {14336, 8160, 28672};
    for (int wi = 0; wi < 3; wi++)
        for (int gelu = 0; gelu < 2; gelu++) {
            const int ffn = widths[wi];
            const size_t tot = (size_t)n * ffn;
            float *gu = malloc(tot * 2 * 4), *sw = malloc((size_t)ffn * 2 * 4), sx[4];
            for (size_t i = 0; i < tot * 2; i++) gu[i] = gu_uniform(&g_rng, -400, 400);
            for (int j = 0; j < 2 * ffn; j++) sw[j] = gu_uniform(&g_rng, 1e-4f, 1e-3f);
            for (int i = 0; i < n; i++) sx[i] = gu_uniform(&g_rng, 0.002f, 0.05f);
            float *d_gu = gu_upload(gu, tot * 2 * 4), *d_sw = gu_upload(sw, (size_t)ffn * 2 * 4);
            float *d_sx = gu_upload(sx, sizeof sx), *d_sa = gu_dev(n * 4), *d_sb = gu_upload(sx, sizeof sx);
            uint16_t *d_act = gu_dev(tot * 2);
            uint8_t *d_qa = gu_dev(tot), *d_qb = gu_dev(tot);
            assert_int_equal(k_gated_mul_fp8(d_gu, d_sw, d_sx, d_act, n, ffn, gelu, 0), 0);
            assert_int_equal(k_quant_fp8_rows(d_act, n, ffn, d_qa, d_sa, 0), 0);
            assert_int_equal(k_gated_mul_fp8q(d_gu, d_sw, d_sb, n, ffn, gelu, d_qb, d_sb, 0), 0);
            const long dq = dev_bytes_differ(d_qa, d_qb, tot), ds = dev_bytes_differ(d_sa, d_sb, n * 4);
            print_message("  gated_mul_fp8q ffn %d %s: %ld code, %ld scale bytes differ\n", ffn, gelu ? "gelu" : "silu",
                          dq, ds);
            assert_int_equal(dq + ds, 0);
            cudaFree(d_gu), cudaFree(d_sw), cudaFree(d_sx), cudaFree(d_sa), cudaFree(d_sb), cudaFree(d_act);
            cudaFree(d_qa), cudaFree(d_qb);
            free(gu), free(sw);
        }
    float *d = gu_dev(1 << 16);
    assert_int_equal(k_gated_mul_fp8q(d, d, d, 1, K_GATED_FP8Q_MAX_SMEM / 2 + 8, 0, (uint8_t *)d, d, 0), -1);
    assert_int_equal(k_gated_mul_fp8q(d, NULL, d, 1, 1024, 0, (uint8_t *)d, d, 0), -1);
    cudaFree(d);
}

static void test_silu_mul_matches_reference(void **state) {
    (void)state;
    int n = 9, ffn = 777;
    size_t tot = (size_t)n * 2 * ffn;
    float *gu = malloc(tot * 4);
    for (size_t i = 0; i < tot; i++) gu[i] = gu_uniform(&g_rng, -6, 6);
    float *d_gu = gu_upload(gu, tot * 4);
    uint16_t *d_out = gu_dev((size_t)n * ffn * 2);
    assert_int_equal(k_silu_mul(d_gu, d_out, n, ffn, 0), 0);
    uint16_t *o = malloc((size_t)n * ffn * 2);
    gu_download(o, d_out, (size_t)n * ffn * 2);
    float *of = malloc((size_t)n * ffn * 4);
    double *ref = malloc((size_t)n * ffn * 8);
    for (int t = 0; t < n; t++)
        for (int j = 0; j < ffn; j++) {
            double g = gu[(size_t)t * 2 * ffn + j], u = gu[(size_t)t * 2 * ffn + ffn + j];
            ref[(size_t)t * ffn + j] = g / (1 + exp(-g)) * u;
            of[(size_t)t * ffn + j] = gu_bf2f(o[(size_t)t * ffn + j]);
        }
    double e = gu_rel_err(of, ref, (size_t)n * ffn);
    report("silu_mul", e);
    assert_true(e < 4e-3);
    cudaFree(d_gu); cudaFree(d_out);
    free(gu); free(o); free(of); free(ref);
}

/* Grammar masks before on-device sampling: rows with a mask keep exactly the ids whose
 * bit is set (the rest -inf), rows without one are untouched, bit for bit. A vocabulary
 * that is not a multiple of 32 checks the last word. */
static void test_mask_logits_keeps_exactly_the_masked_ids(void **state) {
    (void)state;
    const int n = 5, V = 1000, W = (V + 31) / 32;
    float *lg = malloc((size_t)n * V * 4), *got = malloc((size_t)n * V * 4);
    uint32_t *mask = malloc((size_t)n * W * 4);
    int32_t has[5] = {1, 0, 1, 1, 0};
    for (int i = 0; i < n * V; i++) lg[i] = gu_uniform(&g_rng, -8, 8);
    for (int i = 0; i < n * W; i++) mask[i] = (uint32_t)gu_next(&g_rng);
    mask[2 * W] = 0;                 /* a row may allow a single id: row 2 keeps only 33 */
    for (int w = 1; w < W; w++) mask[2 * W + w] = w == 1 ? 2u : 0u;
    float *d_lg = gu_upload(lg, (size_t)n * V * 4);
    uint32_t *d_mask = gu_upload(mask, (size_t)n * W * 4);
    int32_t *d_has = gu_upload(has, sizeof has);
    assert_int_equal(k_mask_logits(d_lg, n, V, d_mask, d_has, 0), 0);
    gu_download(got, d_lg, (size_t)n * V * 4);
    size_t bad = 0, kept2 = 0;
    for (int r = 0; r < n; r++)
        for (int i = 0; i < V; i++) {
            float want = has[r] && !((mask[(size_t)r * W + i / 32] >> (i % 32)) & 1u) ? -INFINITY : lg[(size_t)r * V + i];
            bad += memcmp(&want, &got[(size_t)r * V + i], 4) != 0;
            kept2 += r == 2 && isfinite(got[(size_t)r * V + i]);
        }
    printf("    mask_logits: %zu of %d values differ from the reference; row 2 keeps %zu\n", bad, n * V, kept2);
    assert_int_equal(bad, 0);
    assert_int_equal(kept2, 1);
    assert_true(isfinite(got[2 * V + 33]));
    cudaFree(d_lg); cudaFree(d_mask); cudaFree(d_has);
    free(lg); free(got); free(mask);
}

/* ---- paged KV fixture -------------------------------------------------------------- */

#define MAXB 4            /* live slots; slot MAXB is the dummy */
typedef struct {
    int H, KVH, D, bs, max_blocks, n_layers, layer;
    int nblocks;
    size_t block_elems, layer_off;
    int32_t bt[(MAXB + 1) * 64];
    int32_t lens[(MAXB + 1) * 2];
    uint16_t *pool;       /* host image */
    /* g_kv_fp8 at kv_setup: an FP8 pool (E4M3 codes in pool8, K and V scales ks, vs) */
    int fp8;
    float ks, vs;
    uint8_t *pool8;
    uint16_t *d_pool, **d_pool_pp;
    int32_t *d_bt, *d_lens;
} kvfix;

/* Set: kv_setup builds an FP8 pool (--kv-cache-dtype fp8) with these K / V scales. */
static int g_kv_fp8;
#define KV_FP8_KS 0.37f
#define KV_FP8_VS 1.9f

static void kv_setup(kvfix *f, int H, int KVH, int D, int bs, int max_blocks) {
    memset(f, 0, sizeof *f);
    f->H = H; f->KVH = KVH; f->D = D; f->bs = bs; f->max_blocks = max_blocks;
    f->n_layers = 3;
    f->layer = 1;
    f->nblocks = 1 + MAXB * max_blocks;
    f->block_elems = (size_t)f->n_layers * 2 * KVH * bs * D;
    f->layer_off = (size_t)f->layer * 2 * KVH * bs * D;
    /* Distinct blocks per slot in a shuffled order, so wrong table lookups show. */
    int ids[1 + MAXB * 64];
    int nid = f->nblocks - 1;
    for (int i = 0; i < nid; i++) ids[i] = i + 1;
    for (int i = nid - 1; i > 0; i--) {
        int j = (int)(gu_next(&g_rng) % (uint64_t)(i + 1)), t = ids[i];
        ids[i] = ids[j]; ids[j] = t;
    }
    for (int s = 0; s < MAXB; s++)
        for (int b = 0; b < max_blocks; b++) f->bt[s * max_blocks + b] = ids[s * max_blocks + b];
    for (int b = 0; b < max_blocks; b++) f->bt[MAXB * max_blocks + b] = 0;
    f->pool = malloc((size_t)f->nblocks * f->block_elems * 2);
    for (size_t i = 0; i < (size_t)f->nblocks * f->block_elems; i++)
        f->pool[i] = gu_f2bf(gu_uniform(&g_rng, -1.5f, 1.5f));
    f->fp8 = g_kv_fp8;
    f->ks = KV_FP8_KS;
    f->vs = KV_FP8_VS;
    f->pool8 = malloc((size_t)f->nblocks * f->block_elems);
    /* the same spread of values, stored over the scale of their half (K or V) */
    for (size_t i = 0; i < (size_t)f->nblocks * f->block_elems; i++) {
        const int is_v = (i % f->block_elems) % ((size_t)2 * KVH * bs * D) >= (size_t)KVH * bs * D;
        f->pool8[i] = fp8_e4m3_from_f32(gu_uniform(&g_rng, -1.5f, 1.5f) / (is_v ? f->vs : f->ks));
    }
}

/* The value of pool element i as the kernels must read it. */
static float kv_val(const kvfix *f, size_t i, int is_v) {
    return f->fp8 ? fp8_e4m3_to_f32(f->pool8[i]) * (is_v ? f->vs : f->ks) : gu_bf2f(f->pool[i]);
}

static void kv_upload(kvfix *f) {
    f->d_pool = f->fp8 ? gu_upload(f->pool8, (size_t)f->nblocks * f->block_elems)
                       : gu_upload(f->pool, (size_t)f->nblocks * f->block_elems * 2);
    f->d_pool_pp = gu_upload(&f->d_pool, sizeof(void *));
    f->d_bt = gu_upload(f->bt, sizeof f->bt);
    f->d_lens = gu_upload(f->lens, sizeof f->lens);
}

static void kv_free(kvfix *f) {
    cudaFree(f->d_pool); cudaFree(f->d_pool_pp); cudaFree(f->d_bt); cudaFree(f->d_lens);
    free(f->pool);
    free(f->pool8);
}

static size_t kv_index(const kvfix *f, int slot, int pos, int kvh, int d, int is_v) {
    int b = f->bt[slot * f->max_blocks + pos / f->bs];
    return (size_t)b * f->block_elems + f->layer_off + (is_v ? (size_t)f->KVH * f->bs * f->D : 0) +
           ((size_t)kvh * f->bs + pos % f->bs) * f->D + d;
}

static k_kv_geom kv_geom_of(const kvfix *f, const int32_t *d_tok_slot, const int32_t *d_tok_j) {
    k_kv_geom g = {.tok_slot = d_tok_slot, .tok_j = d_tok_j, .lens = f->d_lens, .which = 0,
                   .bt = f->d_bt, .max_blocks = f->max_blocks, .block_size = f->bs,
                   .pool_pp = f->d_pool_pp, .block_elems = f->block_elems,
                   .layer_off = f->layer_off, .kv_fp8 = f->fp8, .k_scale = f->ks, .v_scale = f->vs};
    return g;
}

/* With g_rope_fp8 set, run_rope_case's input is an unscaled FP8 GEMM's output: the kernel
 * under test is k_qkv_rope_kv_fp8 over (T, sw, sx), which must write the same q and pool
 * bytes as k_fp8_scale_rows then k_qkv_rope_kv; the reference then checks the latter. */
static int g_rope_fp8;

static void run_rope_case(int H, int KVH, int D, int with_bias, int with_norm, int llama3ish) {
    kvfix f;
    kv_setup(&f, H, KVH, D, 16, 6);
    int nrow = 3, n_new[3] = {1, 5, 17}, n = 23;
    int32_t tok_slot[23], tok_j[23];
    int slots[3] = {2, 0, 3};
    int t = 0;
    for (int r = 0; r < nrow; r++) {
        f.lens[slots[r] * 2] = (int)(gu_next(&g_rng) % 60);
        for (int j = 0; j < n_new[r]; j++, t++) { tok_slot[t] = slots[r]; tok_j[t] = j; }
    }
    /* Poison the whole pool: after the kernel exactly the fed positions must be finite. */
    for (size_t i = 0; i < (size_t)f.nblocks * f.block_elems; i++) f.pool[i] = 0xffff;
    memset(f.pool8, 0x7f, (size_t)f.nblocks * f.block_elems);   /* E4M3 NaN */
    kv_upload(&f);
    int W = (H + 2 * KVH) * D;
    float *qkv = malloc((size_t)n * W * 4), *bias = malloc((size_t)W * 4), qn[128], kn[128], inv[64];
    for (size_t i = 0; i < (size_t)n * W; i++) qkv[i] = gu_uniform(&g_rng, -2, 2);
    for (int i = 0; i < W; i++) bias[i] = gu_uniform(&g_rng, -0.5f, 0.5f);
    for (int i = 0; i < D; i++) { qn[i] = gu_uniform(&g_rng, 0.5f, 1.5f); kn[i] = gu_uniform(&g_rng, 0.5f, 1.5f); }
    for (int i = 0; i < D / 2; i++) inv[i] = powf(llama3ish ? 500000.f : 10000.f, -2.f * i / D);
    float *d_qkv = gu_upload(qkv, (size_t)n * W * 4), *d_bias = gu_upload(bias, (size_t)W * 4);
    float *d_qn = gu_upload(qn, sizeof qn), *d_kn = gu_upload(kn, sizeof kn), *d_inv = gu_upload(inv, sizeof inv);
    int32_t *d_ts = gu_upload(tok_slot, sizeof tok_slot), *d_tj = gu_upload(tok_j, sizeof tok_j);
    float *d_q = gu_dev((size_t)n * H * D * 4);
    k_kv_geom g = kv_geom_of(&f, d_ts, d_tj);
    float eps = 1e-6f;
    const size_t pool_bytes = (size_t)f.nblocks * f.block_elems * (f.fp8 ? 1 : 2);
    uint8_t *fp8_pool = NULL;
    float *fp8_q = NULL;
    if (g_rope_fp8) {   /* T = qkv as it is, row scales sw [W], token scales sx [n] */
        float *sw = malloc((size_t)W * 4), sx[23];
        for (int i = 0; i < W; i++) sw[i] = gu_uniform(&g_rng, 0.002f, 0.02f);
        for (int i = 0; i < n; i++) sx[i] = gu_uniform(&g_rng, 0.005f, 0.05f);
        float *d_sw = gu_upload(sw, (size_t)W * 4), *d_sx = gu_upload(sx, sizeof sx);
        assert_int_equal(k_qkv_rope_kv_fp8(d_qkv, d_sw, d_sx, with_bias ? d_bias : NULL, with_norm ? d_qn : NULL,
                                           with_norm ? d_kn : NULL, d_inv, eps, d_q, n, H, KVH, D, &g, 0), 0);
        fp8_pool = malloc(pool_bytes), fp8_q = malloc((size_t)n * H * D * 4);
        gu_download(fp8_pool, f.d_pool, pool_bytes);
        gu_download(fp8_q, d_q, (size_t)n * H * D * 4);
        /* poisoned again, in place (the geometry holds the pool's address) */
        GPU_CHECK(cudaMemcpy(f.d_pool, f.fp8 ? (void *)f.pool8 : (void *)f.pool, pool_bytes, cudaMemcpyHostToDevice));
        assert_int_equal(k_fp8_scale_rows(d_qkv, d_sw, d_sx, d_qkv, n, W, 0, 0), 0);
        gu_download(qkv, d_qkv, (size_t)n * W * 4);   /* the reference's input */
        assert_int_equal(k_qkv_rope_kv_fp8(d_qkv, d_sw, NULL, NULL, NULL, NULL, d_inv, eps, d_q, n, H, KVH, D, &g, 0),
                         -1);
        cudaFree(d_sw), cudaFree(d_sx), free(sw);
    }
    assert_int_equal(k_qkv_rope_kv(d_qkv, with_bias ? d_bias : NULL, with_norm ? d_qn : NULL,
                                   with_norm ? d_kn : NULL, d_inv, eps, d_q, n, H, KVH, D, &g, 0), 0);
    float *q = malloc((size_t)n * H * D * 4);
    gu_download(q, d_q, (size_t)n * H * D * 4);
    if (g_rope_fp8) {
        uint8_t *pool = malloc(pool_bytes);
        gu_download(pool, f.d_pool, pool_bytes);
        const long dq = (long)(memcmp(q, fp8_q, (size_t)n * H * D * 4) != 0), dp = (long)(memcmp(pool, fp8_pool, pool_bytes) != 0);
        print_message("  qkv_rope_kv_fp8 H%d KVH%d D%d vs rescale then rope: q %s, pool %s\n", H, KVH, D,
                      dq ? "DIFFERS" : "identical", dp ? "DIFFERS" : "identical");
        assert_int_equal(dq + dp, 0);
        free(pool), free(fp8_pool), free(fp8_q);
    }
    if (f.fp8) gu_download(f.pool8, f.d_pool, (size_t)f.nblocks * f.block_elems);
    else gu_download(f.pool, f.d_pool, (size_t)f.nblocks * f.block_elems * 2);
    size_t codes_off = 0;   /* FP8: stored codes that are not e4m3(reference / scale) */

    size_t nq = (size_t)n * H * D, nkv = (size_t)n * KVH * D * 2;
    double *ref = malloc((nq + nkv) * 8);
    float *got = malloc((nq + nkv) * 4);
    size_t qi = 0, ki = nq;
    for (t = 0; t < n; t++) {
        int pos = f.lens[tok_slot[t] * 2] + tok_j[t];
        for (int hh = 0; hh < H + 2 * KVH; hh++) {
            double v[256];
            for (int i = 0; i < D; i++)
                v[i] = qkv[(size_t)t * W + hh * D + i] + (with_bias ? bias[hh * D + i] : 0);
            int is_q = hh < H, is_k = !is_q && hh < H + KVH;
            if ((is_q || is_k) && with_norm) {
                double ss = 0;
                for (int i = 0; i < D; i++) ss += v[i] * v[i];
                double s = 1 / sqrt(ss / D + eps);
                for (int i = 0; i < D; i++) v[i] *= s * (is_q ? qn[i] : kn[i]);
            }
            if (is_q || is_k)
                for (int i = 0; i < D / 2; i++) {
                    double a = v[i], b = v[i + D / 2], ang = (double)(float)((float)pos * inv[i]);
                    v[i] = a * cos(ang) - b * sin(ang);
                    v[i + D / 2] = b * cos(ang) + a * sin(ang);
                }
            for (int i = 0; i < D; i++) {
                if (is_q) {
                    ref[qi] = v[i];
                    got[qi++] = q[((size_t)t * H + hh) * D + i];
                } else {
                    int kvh = is_k ? hh - H : hh - H - KVH;
                    ref[ki] = v[i];
                    const size_t at = kv_index(&f, tok_slot[t], pos, kvh, i, !is_k);
                    got[ki++] = kv_val(&f, at, !is_k);
                    if (f.fp8) codes_off += f.pool8[at] != fp8_e4m3_from_f32((float)(v[i] / (is_k ? f.ks : f.vs)));
                }
            }
        }
    }
    size_t finite = 0;
    for (size_t i = 0; i < (size_t)f.nblocks * f.block_elems; i++) finite += !isnan(kv_val(&f, i, 0));
    char name[96];
    snprintf(name, sizeof name, "qkv_rope_kv H%d KVH%d D%d bias%d norm%d%s", H, KVH, D, with_bias, with_norm,
             f.fp8 ? " kv fp8" : "");
    double e = gu_rel_err(got, ref, nq + nkv);
    report(name, e);
    /* FP8: 3 mantissa bits (half an ulp is 1/16 of the value); every code but the odd
     * rounding tie between the fp32 kernel and this double reference is e4m3(x / scale) */
    assert_true(e < (f.fp8 ? 0.07 : 8e-3));
    if (f.fp8) {
        print_message("  FP8 codes off the reference's: %zu of %zu\n", codes_off, nkv);
        assert_true(codes_off * 200 <= nkv);
    }
    assert_int_equal(finite, nkv);   /* nothing but the fed positions was written */
    cudaFree(d_qkv); cudaFree(d_bias); cudaFree(d_qn); cudaFree(d_kn); cudaFree(d_inv);
    cudaFree(d_ts); cudaFree(d_tj); cudaFree(d_q);
    free(qkv); free(bias); free(q); free(ref); free(got);
    kv_free(&f);
}

static void test_qkv_rope_writes_q_and_paged_kv(void **state) {
    (void)state;
    run_rope_case(8, 2, 128, 1, 0, 1);
    run_rope_case(6, 2, 64, 0, 1, 0);
    run_rope_case(4, 4, 128, 1, 1, 0);
    run_rope_case(4, 2, 32, 0, 0, 1);
}

/* k_qkv_rope_kv_fp8 (the QKV scales applied by rotary) against k_fp8_scale_rows then
 * k_qkv_rope_kv: the same q and pool bytes (run_rope_case with g_rope_fp8), with bias,
 * q/k norms, bf16 and FP8 pools. */
static void test_qkv_rope_fp8_equals_rescale_then_rope(void **state) {
    (void)state;
    g_rope_fp8 = 1;
    run_rope_case(8, 2, 128, 1, 0, 1);
    run_rope_case(6, 2, 64, 0, 1, 0);
    g_kv_fp8 = 1;
    run_rope_case(8, 2, 128, 0, 1, 1);
    g_kv_fp8 = 0;
    g_rope_fp8 = 0;
}

/* With g_attn_x8 set the attention cases also pass w.x8 (the int8 rounding for an O
 * GEMV after attention) and check it against k_quant_x8 of their own bf16 output, bit for
 * bit (x8_check); x8_poisoned is that buffer filled with 0xff, so a code or pair left
 * unwritten shows. */
static int g_attn_x8;

static void *x8_poisoned(int n, int in) {
    const size_t sb = k_gemv_qi8_scratch(in, n);
    void *d = gu_dev(sb);
    GPU_CHECK(cudaMemset(d, 0xff, sb));
    return d;
}

static void x8_check(const uint16_t *d_out, const void *d_x8, int n, int in, const char *what) {
    const size_t sb = k_gemv_qi8_scratch(in, n);
    uint8_t *d_ref = gu_dev(sb);
    assert_int_equal(k_quant_x8(d_out, n, in, d_ref, 0), 0);
    assert_int_equal(x8_differences(d_out, d_out, d_ref, d_x8, (size_t)n * in, sb, what), 0);
    cudaFree(d_ref);
}

/* Attention over rows with n_new queries each; compares all of out with a reference. */
/* Sliding window of the next run_attention_case calls (0: full causal attention). */
static int g_attn_window;

static void run_attention_case(int H, int KVH, int D, const int *n_new, int nrow, int n_splits,
                               int split_len) {
    kvfix f;
    kv_setup(&f, H, KVH, D, 16, 24);
    int slots[MAXB] = {1, 3, 0, 2}, G = H / KVH;
    int32_t row_slot[MAXB], row_off[MAXB], row_n[MAXB], item_row[512], item_q0[512];
    int n = 0, ni = 0, max_new = 0;
    for (int r = 0; r < nrow; r++) if (n_new[r] > max_new) max_new = n_new[r];
    int cap_rows = D >= 128 ? 32 : 64, qt = cap_rows / G < 1 ? 1 : cap_rows / G;
    if (qt > max_new) qt = max_new;
    for (int r = 0; r < nrow; r++) {
        row_slot[r] = slots[r];
        row_off[r] = n;
        row_n[r] = n_new[r];
        int room = f.max_blocks * f.bs - n_new[r];
        f.lens[slots[r] * 2] = (int)(gu_next(&g_rng) % (uint64_t)(room < 300 ? room : 300));
        for (int q0 = 0; q0 < n_new[r]; q0 += qt) { item_row[ni] = r; item_q0[ni] = q0; ni++; }
        n += n_new[r];
    }
    kv_upload(&f);
    float *q = malloc((size_t)n * H * D * 4);
    for (size_t i = 0; i < (size_t)n * H * D; i++) q[i] = gu_uniform(&g_rng, -1.5f, 1.5f);
    float *d_q = gu_upload(q, (size_t)n * H * D * 4);
    uint16_t *d_out = gu_dev((size_t)n * H * D * 2);
    int32_t *d_rs = gu_upload(row_slot, sizeof row_slot), *d_ro = gu_upload(row_off, sizeof row_off);
    int32_t *d_rn = gu_upload(row_n, sizeof row_n), *d_ir = gu_upload(item_row, (size_t)ni * 4);
    int32_t *d_iq = gu_upload(item_q0, (size_t)ni * 4);
    float *d_wo = gu_dev((size_t)n_splits * n * H * D * 4), *d_wml = gu_dev((size_t)n_splits * n * H * 2 * 4);
    k_kv_geom g = kv_geom_of(&f, NULL, NULL);
    k_attn_work w = {.row_slot = d_rs, .row_tok_off = d_ro, .row_n_new = d_rn, .item_row = d_ir,
                     .item_q0 = d_iq, .n_items = ni, .qt = qt, .n_tok = n, .n_splits = n_splits,
                     .split_len = split_len, .ws_o = d_wo, .ws_ml = d_wml, .window = g_attn_window};
    float scale = 1.f / sqrtf((float)D);
    void *d_x8 = g_attn_x8 ? x8_poisoned(n, H * D) : NULL;
    if (d_x8) {
        w.x8 = (uint8_t *)d_x8 + 8;   /* refused: not 16-byte aligned */
        assert_int_equal(k_attention(d_q, d_out, H, KVH, D, scale, &g, &w, 0), -1);
        w.x8 = d_x8;
    }
    assert_int_equal(k_attention(d_q, d_out, H, KVH, D, scale, &g, &w, 0), 0);
    if (d_x8) {
        char what[96];
        snprintf(what, sizeof what, "attention x8 H%d KVH%d D%d rows%d splits%d", H, KVH, D, nrow, n_splits);
        x8_check(d_out, d_x8, n, H * D, what);
        cudaFree(d_x8);
    }
    uint16_t *o = malloc((size_t)n * H * D * 2);
    gu_download(o, d_out, (size_t)n * H * D * 2);

    double *ref = malloc((size_t)n * H * D * 8), *p = malloc(sizeof(double) * 2048);
    float *got = malloc((size_t)n * H * D * 4);
    for (int r = 0; r < nrow; r++) {
        int len = f.lens[row_slot[r] * 2];
        for (int j = 0; j < row_n[r]; j++) {
            int t = row_off[r] + j, qpos = len + j;
            const int k0 = g_attn_window > 0 && qpos >= g_attn_window ? qpos - g_attn_window + 1 : 0;
            for (int h = 0; h < H; h++) {
                int kvh = h / G;
                double mx = -INFINITY, sum = 0;
                for (int k = k0; k <= qpos; k++) {
                    double s = 0;
                    for (int d = 0; d < D; d++)
                        s += (double)q[((size_t)t * H + h) * D + d] *
                             kv_val(&f, kv_index(&f, row_slot[r], k, kvh, d, 0), 0);
                    p[k] = s * scale;
                    if (p[k] > mx) mx = p[k];
                }
                for (int k = k0; k <= qpos; k++) { p[k] = exp(p[k] - mx); sum += p[k]; }
                for (int d = 0; d < D; d++) {
                    double acc = 0;
                    for (int k = k0; k <= qpos; k++)
                        acc += p[k] * kv_val(&f, kv_index(&f, row_slot[r], k, kvh, d, 1), 1);
                    size_t i = ((size_t)t * H + h) * D + d;
                    ref[i] = acc / sum;
                    got[i] = gu_bf2f(o[i]);
                }
            }
        }
    }
    char name[96];
    snprintf(name, sizeof name, "attention H%d KVH%d D%d rows%d splits%d window%d%s", H, KVH, D, nrow, n_splits,
             g_attn_window, f.fp8 ? " kv fp8" : "");
    double e = gu_rel_err(got, ref, (size_t)n * H * D);
    report(name, e);
    assert_true(e < 1e-2);
    cudaFree(d_q); cudaFree(d_out); cudaFree(d_rs); cudaFree(d_ro); cudaFree(d_rn);
    cudaFree(d_ir); cudaFree(d_iq); cudaFree(d_wo); cudaFree(d_wml);
    free(q); free(o); free(ref); free(p); free(got);
    kv_free(&f);
}

static void test_attention_decode_rows_match_reference(void **state) {
    (void)state;
    int nn[4] = {1, 1, 1, 1};
    run_attention_case(8, 2, 128, nn, 4, 1, 384);
    run_attention_case(8, 2, 128, nn, 4, 3, 128);    /* flash-decoding splits */
    run_attention_case(12, 2, 64, nn, 3, 5, 64);     /* G = 6, D = 64 */
    run_attention_case(4, 2, 32, nn, 4, 2, 128);     /* the tiny fixtures' shape */
    run_attention_case(8, 2, 128, nn, 4, 7, 0);      /* splits sized on the device */
    run_attention_case(16, 8, 64, nn, 4, 33, 0);     /* more splits than tiles */
}

static void test_attention_verify_rows_are_causal_among_new_tokens(void **state) {
    (void)state;
    int nn[3] = {5, 5, 5};
    run_attention_case(8, 2, 128, nn, 3, 1, 384);
    run_attention_case(16, 8, 128, nn, 3, 2, 192);
}

static void test_attention_prefill_chunks_match_reference(void **state) {
    (void)state;
    int nn[3] = {37, 3, 70};
    run_attention_case(8, 2, 128, nn, 3, 1, 384);
    run_attention_case(12, 2, 64, nn, 3, 1, 384);
    run_attention_case(8, 8, 64, nn, 3, 4, 128);
    run_attention_case(4, 2, 32, nn, 3, 1, 384);
    run_attention_case(2, 1, 32, nn, 3, 2, 192);
}

/* A sliding window (Mistral, Gemma 3) on every kernel k_attention picks: the decode
 * kernel, the tiled SIMT kernel, the tensor-core kernel, with and without key splits, and
 * head_dim 256 (Gemma 3) with and without a window. The windows start inside a tile and
 * the contexts (up to ~370 keys) run past them. */
static void test_attention_sliding_window_matches_reference(void **state) {
    (void)state;
    int dec[4] = {1, 1, 1, 1}, pre[3] = {37, 3, 70}, ver[3] = {5, 5, 5};
    g_attn_window = 48;
    run_attention_case(8, 2, 128, dec, 4, 1, 384);   /* decode kernel */
    run_attention_case(8, 2, 128, dec, 4, 3, 0);     /* ... with splits sized on the device */
    run_attention_case(4, 2, 32, dec, 4, 2, 128);    /* SIMT decode rows, host splits */
    run_attention_case(8, 2, 128, pre, 3, 1, 384);   /* tensor cores */
    run_attention_case(8, 2, 64, pre, 3, 4, 128);    /* tensor cores, splits */
    run_attention_case(4, 2, 32, pre, 3, 1, 384);    /* SIMT prefill */
    run_attention_case(16, 8, 128, ver, 3, 2, 0);    /* verify rows */
    g_attn_window = 37;
    run_attention_case(4, 1, 256, dec, 4, 2, 0);     /* head_dim 256 */
    run_attention_case(4, 1, 256, pre, 3, 1, 384);
    run_attention_case(8, 1, 256, pre, 3, 3, 0);
    g_attn_window = 0;
    run_attention_case(4, 1, 256, pre, 3, 2, 0);     /* head_dim 256, full attention */
    run_attention_case(4, 1, 256, dec, 4, 1, 384);
}

/* Decode rows (one query each) with G = H / KVH small enough (qt * G < 16) that
 * k_attention runs the SIMT kernel, over splits of the keys: once without w.counters
 * (the combine kernel merges the splits) and three times with them (the last split block
 * of each item and KV head merges). Every run must match the double reference, the runs
 * must agree with each other, out's guard zone must stay poisoned, and the counters must
 * be back at 0 after each run (their own guard words untouched). lens[r] < 0: random. */
#define ATTN_GUARD 1024
/* nonzero: the tuning in force is k_tuning_default with attn_dec_pipe = g_attn_pipe_cmp - 1,
 * and run_attention_counters_case adds a run with it flipped, which must give the bits of
 * its first run */
static int g_attn_pipe_cmp;

static void run_attention_counters_case(int H, int KVH, int D, const int *lens, int nrow, int n_splits,
                                        int split_len) {
    kvfix f;
    kv_setup(&f, H, KVH, D, 16, 48);
    const int G = H / KVH, cap = f.max_blocks * f.bs, n = nrow, ni = nrow;
    int slots[MAXB] = {2, 0, 3, 1};
    int32_t row_slot[MAXB], row_off[MAXB], row_n[MAXB], item_row[MAXB], item_q0[MAXB];
    assert_true(nrow <= MAXB && G < 16);
    for (int r = 0; r < nrow; r++) {
        row_slot[r] = slots[r];
        row_off[r] = r;
        row_n[r] = 1;
        item_row[r] = r;
        item_q0[r] = 0;
        f.lens[slots[r] * 2] = lens[r] >= 0 ? lens[r] : (int)(gu_next(&g_rng) % 400);
        assert_true(f.lens[slots[r] * 2] < cap);
    }
    kv_upload(&f);
    const size_t nel = (size_t)n * H * D, ncnt = (size_t)ni * KVH;
    float *q = malloc(nel * 4);
    for (size_t i = 0; i < nel; i++) q[i] = gu_uniform(&g_rng, -1.5f, 1.5f);
    float *d_q = gu_upload(q, nel * 4);
    uint16_t *d_out = gu_dev((nel + ATTN_GUARD) * 2);
    int32_t *d_rs = gu_upload(row_slot, sizeof row_slot), *d_ro = gu_upload(row_off, sizeof row_off);
    int32_t *d_rn = gu_upload(row_n, sizeof row_n), *d_ir = gu_upload(item_row, sizeof item_row);
    int32_t *d_iq = gu_upload(item_q0, sizeof item_q0);
    float *d_wo = gu_dev((size_t)n_splits * nel * 4), *d_wml = gu_dev((size_t)n_splits * n * H * 2 * 4);
    unsigned *d_cnt = gu_dev((ncnt + 8) * sizeof(unsigned));   /* 8 guard words of 0xffffffff */
    GPU_CHECK(cudaMemset(d_cnt, 0, ncnt * sizeof(unsigned)));
    k_kv_geom g = kv_geom_of(&f, NULL, NULL);
    k_attn_work w = {.row_slot = d_rs, .row_tok_off = d_ro, .row_n_new = d_rn, .item_row = d_ir,
                     .item_q0 = d_iq, .n_items = ni, .qt = 1, .n_tok = n, .n_splits = n_splits,
                     .split_len = split_len, .ws_o = d_wo, .ws_ml = d_wml, .counters = NULL};
    const float scale = 1.f / sqrtf((float)D);

    double *ref = malloc(nel * 8), *p = malloc((size_t)cap * 8);
    for (int r = 0; r < nrow; r++) {
        int len = f.lens[row_slot[r] * 2];
        for (int h = 0; h < H; h++) {
            int kvh = h / G;
            const float *qr = q + ((size_t)r * H + h) * D;
            double mx = -INFINITY, sum = 0;
            for (int k = 0; k <= len; k++) {
                double s = 0;
                for (int d = 0; d < D; d++)
                    s += (double)qr[d] * kv_val(&f, kv_index(&f, row_slot[r], k, kvh, d, 0), 0);
                p[k] = s * scale;
                if (p[k] > mx) mx = p[k];
            }
            for (int k = 0; k <= len; k++) { p[k] = exp(p[k] - mx); sum += p[k]; }
            for (int d = 0; d < D; d++) {
                double acc = 0;
                for (int k = 0; k <= len; k++)
                    acc += p[k] * kv_val(&f, kv_index(&f, row_slot[r], k, kvh, d, 1), 1);
                ref[((size_t)r * H + h) * D + d] = acc / sum;
            }
        }
    }

    uint16_t *o = malloc((nel + ATTN_GUARD) * 2), *o0 = malloc(nel * 2);
    float *got = malloc(nel * 4);
    unsigned *cnt = malloc((ncnt + 8) * sizeof(unsigned));
    k_tuning t_pipe = k_tuning_default;
    for (int run = 0; run < (g_attn_pipe_cmp ? 5 : 4); run++) {
        w.counters = run > 0 && run < 4 ? d_cnt : NULL;
        if (run == 4) {   /* the other way of loading the chunks: the same bits as run 0 */
            t_pipe.attn_dec_pipe = g_attn_pipe_cmp == 1;
            k_set_tuning(&t_pipe);
        }
        GPU_CHECK(cudaMemset(d_out, 0xff, (nel + ATTN_GUARD) * 2));   /* re-poison */
        w.x8 = g_attn_x8 ? x8_poisoned(n, H * D) : NULL;
        assert_int_equal(k_attention(d_q, d_out, H, KVH, D, scale, &g, &w, 0), 0);
        if (w.x8) {
            char what[96];
            snprintf(what, sizeof what, "attn x8 H%d KVH%d D%d splits%d counters%d", H, KVH, D, n_splits, run > 0);
            x8_check(d_out, w.x8, n, H * D, what);
            cudaFree(w.x8);
        }
        gu_download(o, d_out, (nel + ATTN_GUARD) * 2);
        size_t guard_hit = 0, diff = 0, far = 0, cnt_bad = 0, cnt_guard = 0;
        for (size_t i = nel; i < nel + ATTN_GUARD; i++) guard_hit += o[i] != 0xffff;
        for (size_t i = 0; i < nel; i++) got[i] = gu_bf2f(o[i]);
        if (run == 0) {
            memcpy(o0, o, nel * 2);
        } else {
            /* the same partials merged by other code: equal, or a rare 1-ulp rounding flip */
            for (size_t i = 0; i < nel; i++) {
                int a = (o[i] & 0x8000) ? -(int)(o[i] & 0x7fff) : (int)o[i];
                int b = (o0[i] & 0x8000) ? -(int)(o0[i] & 0x7fff) : (int)o0[i];
                diff += a != b;
                far += abs(a - b) > 1;
            }
            gu_download(cnt, d_cnt, (ncnt + 8) * sizeof(unsigned));
            for (size_t i = 0; i < ncnt; i++) cnt_bad += cnt[i] != 0;
            for (size_t i = ncnt; i < ncnt + 8; i++) cnt_guard += cnt[i] != 0xffffffffu;
        }
        char name[128];
        snprintf(name, sizeof name, "attn H%d KVH%d D%d splits%d/%d counters%d", H, KVH, D, n_splits,
                 split_len, run > 0);
        double e = gu_rel_err(got, ref, nel);
        report(name, e);
        if (run) printf("      vs no counters: %zu differ (%zu by > 1 ulp); counters left nonzero %zu\n", diff, far, cnt_bad);
        if (run == 4) {
            printf("      attn_dec_pipe %d against %d: %zu of %zu outputs differ\n", g_attn_pipe_cmp == 1,
                   g_attn_pipe_cmp - 1, diff, nel);
            t_pipe.attn_dec_pipe = g_attn_pipe_cmp - 1;
            k_set_tuning(&t_pipe);
            assert_int_equal(diff, 0);
        }
        assert_true(e < 1e-2);
        assert_int_equal(guard_hit, 0);
        assert_int_equal(far, 0);
        assert_true(diff <= 2 + nel / 1000);
        assert_int_equal(cnt_bad, 0);
        assert_int_equal(cnt_guard, 0);
    }
    cudaFree(d_q); cudaFree(d_out); cudaFree(d_rs); cudaFree(d_ro); cudaFree(d_rn);
    cudaFree(d_ir); cudaFree(d_iq); cudaFree(d_wo); cudaFree(d_wml); cudaFree(d_cnt);
    free(q); free(ref); free(p); free(o); free(o0); free(got); free(cnt);
    kv_free(&f);
}

/* k_tuning.attn_dec_pipe: the batch-1 form of the decode kernel requesting a warp's next
 * chunk of keys before the current chunk's math gives the bits of loading each chunk in its
 * turn (each case's extra run) and matches the reference; long contexts, up to 12 chunks a
 * warp (one split of up to 768 keys), the split merged in-kernel or by the combine kernel,
 * head dims 64 and 128, bf16 and FP8 caches. */
static void test_attention_decode_pipe_same_bits(void **state) {
    (void)state;
    const int a[4] = {700, 0, 767, -1}, b[2] = {500, 767}, c[3] = {767, 130, 64};
    for (int fp8 = 0; fp8 < 2; fp8++) {
        g_kv_fp8 = fp8;
        for (int pipe = 0; pipe <= 1; pipe++) {
            k_tuning t = k_tuning_default;
            t.attn_dec_pipe = pipe;
            k_set_tuning(&t);
            g_attn_pipe_cmp = pipe + 1;
            run_attention_counters_case(32, 8, 128, a, 4, 1, 0);    /* Llama-3.1-8B, one split */
            run_attention_counters_case(32, 4, 128, b, 2, 3, 0);    /* Qwen3-30B-A3B, 3 splits */
            run_attention_counters_case(32, 8, 64, c, 3, 2, 128);   /* Llama-3.2-1B, fixed split length */
        }
    }
    g_attn_pipe_cmp = 0;
    g_kv_fp8 = 0;
    k_set_tuning(&k_tuning_default);
}

static void test_attention_decode_split_counters_merge_in_kernel(void **state) {
    (void)state;
    const int a[4] = {0, 700, 3, -1}, b[4] = {700, 1, -1, 0}, c[3] = {650, -1, 2};
    run_attention_counters_case(32, 8, 128, a, 4, 8, 0);   /* Llama-3.1-8B */
    run_attention_counters_case(32, 8, 64, b, 4, 8, 0);    /* Llama-3.2-1B */
    run_attention_counters_case(12, 2, 128, c, 3, 5, 128); /* Qwen2.5-1.5B, fixed split length */
    run_attention_counters_case(4, 2, 32, a, 4, 3, 0);     /* the tiny fixtures' shape */
    /* enough (row, KV head) pairs to fill an H200 (>= 132): the decode kernel's many-pairs
     * forms instead of its 4-lanes-per-key one, every one k_tuning.attn_dec can pick */
    const int forms[] = {0, 1, 2, 6, 7, 8};
    for (size_t i = 0; i < sizeof forms / sizeof forms[0]; i++) {
        k_tuning t = k_tuning_default;
        t.attn_dec = forms[i];
        k_set_tuning(&t);
        run_attention_counters_case(160, 40, 64, a, 4, 4, 0);
        run_attention_counters_case(128, 64, 128, b, 4, 2, 0);
        run_attention_counters_case(384, 48, 128, c, 3, 3, 0);   /* 8 query heads per KV head */
    }
    k_set_tuning(&k_tuning_default);
}

/* k_rope_attention with k_tuning.attn_rope on (the decode kernel norms and rotates q and
 * makes the new key itself) against k_qkv_rope_kv then k_attention (the two launches it
 * replaces, each checked against a double reference above): the same output and pool
 * bits, and q_out left as it was (poisoned), which shows the one-launch path ran. Rows of
 * one token at random lengths, the last one at the pool's last position (lens[r] < 0:
 * random); splits merged in-kernel (counters) or by the combine kernel. The one launch
 * again while asking L2 for an unrelated 16.8 MB range (k_attn_work.l2_next) must give
 * the same bits, and a misaligned range is refused. Also times the forms at this shape
 * (launch to launch, warm). */
static void run_rope_attention_case(int H, int KVH, int D, const int *lens, int nrow, int n_splits, int use_cnt,
                                    int with_bias, int with_norm, int window) {
    kvfix f;
    kv_setup(&f, H, KVH, D, 16, 24);
    const int cap = f.max_blocks * f.bs, n = nrow, W = (H + 2 * KVH) * D;
    int slots[MAXB] = {3, 1, 0, 2};
    int32_t row_slot[MAXB], row_off[MAXB], row_n[MAXB], item_q0[MAXB], tok_slot[MAXB];
    for (int r = 0; r < nrow; r++) {
        row_slot[r] = tok_slot[r] = slots[r];
        row_off[r] = r;
        row_n[r] = 1;
        item_q0[r] = 0;
        f.lens[slots[r] * 2] = lens[r] >= 0 ? lens[r] : (int)(gu_next(&g_rng) % (uint64_t)cap);
        assert_true(f.lens[slots[r] * 2] < cap);
    }
    kv_upload(&f);
    const size_t pool_bytes = (size_t)f.nblocks * f.block_elems * (f.fp8 ? 1 : 2), nel = (size_t)n * H * D;
    float *qkv = malloc((size_t)n * W * 4), *bias = malloc((size_t)W * 4), qn[128], kn[128], inv[64];
    for (size_t i = 0; i < (size_t)n * W; i++) qkv[i] = gu_uniform(&g_rng, -2, 2);
    for (int i = 0; i < W; i++) bias[i] = gu_uniform(&g_rng, -0.5f, 0.5f);
    for (int i = 0; i < D; i++) { qn[i] = gu_uniform(&g_rng, 0.5f, 1.5f); kn[i] = gu_uniform(&g_rng, 0.5f, 1.5f); }
    for (int i = 0; i < D / 2; i++) inv[i] = powf(1000000.f, -2.f * i / D);
    float *d_qkv = gu_upload(qkv, (size_t)n * W * 4), *d_bias = gu_upload(bias, (size_t)W * 4);
    float *d_qn = gu_upload(qn, sizeof qn), *d_kn = gu_upload(kn, sizeof kn), *d_inv = gu_upload(inv, sizeof inv);
    int32_t *d_ts = gu_upload(tok_slot, sizeof tok_slot), *d_tj = gu_upload(item_q0, sizeof item_q0);
    int32_t *d_rs = gu_upload(row_slot, sizeof row_slot), *d_ro = gu_upload(row_off, sizeof row_off);
    int32_t *d_rn = gu_upload(row_n, sizeof row_n), *d_iq = gu_upload(item_q0, sizeof item_q0);
    float *d_q = gu_dev(nel * 4), *d_wo = gu_dev((size_t)n_splits * nel * 4);
    float *d_wml = gu_dev((size_t)n_splits * n * H * 2 * 4);
    uint16_t *d_out = gu_dev(nel * 2);
    unsigned *d_cnt = gu_dev((size_t)n * KVH * sizeof(unsigned));
    GPU_CHECK(cudaMemset(d_cnt, 0, (size_t)n * KVH * sizeof(unsigned)));
    k_kv_geom g = kv_geom_of(&f, d_ts, d_tj);
    k_attn_work w = {.row_slot = d_rs, .row_tok_off = d_ro, .row_n_new = d_rn, .item_row = d_ro,
                     .item_q0 = d_iq, .n_items = n, .qt = 1, .n_tok = n, .n_splits = n_splits, .split_len = 0,
                     .ws_o = d_wo, .ws_ml = d_wml, .window = window, .counters = use_cnt ? d_cnt : NULL};
    const k_rope_in rp = {.qkv = d_qkv, .bias = with_bias ? d_bias : NULL, .q_norm = with_norm ? d_qn : NULL,
                          .k_norm = with_norm ? d_kn : NULL, .inv_freq = d_inv, .eps = 1e-6f, .q_out = d_q};
    const float scale = 1.f / sqrtf((float)D);
    uint16_t *o[3] = {malloc(nel * 2), malloc(nel * 2), malloc(nel * 2)};
    uint8_t *pool[3] = {malloc(pool_bytes), malloc(pool_bytes), malloc(pool_bytes)};
    float *q_after = malloc(nel * 4);
    float ms[3] = {0, 0, 0};
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    /* v 2: fused, and asking L2 for a 16.8 MB range meanwhile (the O projection of
     * Qwen3-30B-A3B's size: k_attn_work.l2_next, a hint that must change nothing) */
    const size_t pf_bytes = (size_t)2048 * 4096 * 2;
    void *d_pf = gu_dev(pf_bytes);
    for (int v = 0; v < 3; v++) {
        const int fused = v > 0;
        w.l2_next = v == 2 ? d_pf : NULL;
        w.l2_next_bytes = v == 2 ? pf_bytes : 0;
        k_tuning t = k_tuning_default;
        t.attn_rope = fused;
        k_set_tuning(&t);
        GPU_CHECK(cudaMemcpy(f.d_pool, f.fp8 ? (void *)f.pool8 : (void *)f.pool, pool_bytes, cudaMemcpyHostToDevice));
        GPU_CHECK(cudaMemset(d_q, 0xff, nel * 4));
        GPU_CHECK(cudaMemset(d_out, 0xff, nel * 2));
        assert_int_equal(k_rope_attention(&rp, d_out, H, KVH, D, scale, &g, &w, 0), 0);
        GPU_CHECK(cudaDeviceSynchronize());
        gu_download(o[v], d_out, nel * 2);
        gu_download(pool[v], f.d_pool, pool_bytes);
        gu_download(q_after, d_q, nel * 4);
        size_t q_written = 0;
        for (size_t i = 0; i < nel; i++) q_written += !isnan(q_after[i]);
        assert_int_equal(q_written, fused ? 0 : nel);   /* fused: the separate rotary did not run */
        /* timing: the same launch again (it rewrites the same K/V) */
        for (int it = 0; it < 3; it++) k_rope_attention(&rp, d_out, H, KVH, D, scale, &g, &w, 0);
        cudaEventRecord(e0, 0);
        for (int it = 0; it < 50; it++) k_rope_attention(&rp, d_out, H, KVH, D, scale, &g, &w, 0);
        cudaEventRecord(e1, 0);
        cudaEventSynchronize(e1);
        cudaEventElapsedTime(&ms[v], e0, e1);
    }
    w.l2_next = (const char *)d_pf + 8;   /* not 16-byte aligned: refused */
    assert_int_equal(k_rope_attention(&rp, d_out, H, KVH, D, scale, &g, &w, 0), -1);
    assert_int_equal(k_attention(d_q, d_out, H, KVH, D, scale, &g, &w, 0), -1);
    k_set_tuning(&k_tuning_default);
    size_t od = 0, pd = 0, finite = 0;
    for (size_t i = 0; i < nel; i++)
        od += (o[0][i] != o[1][i]) + (o[0][i] != o[2][i]), finite += !isnan(gu_bf2f(o[1][i]));
    for (size_t i = 0; i < pool_bytes; i++) pd += (pool[0][i] != pool[1][i]) + (pool[0][i] != pool[2][i]);
    printf("    rope+attention H%d KVH%d D%d rows%d splits%d cnt%d bias%d norm%d window%d%s: %zu of %zu outputs and "
           "%zu pool bytes differ from the two launches (fused, and fused asking L2 for 16.8 MB); %.2f us a call "
           "fused, %.2f with the L2 request, %.2f as two launches\n",
           H, KVH, D, nrow, n_splits, use_cnt, with_bias, with_norm, window, f.fp8 ? " kv fp8" : "", od, nel, pd,
           1000.0 * ms[1] / 50, 1000.0 * ms[2] / 50, 1000.0 * ms[0] / 50);
    assert_int_equal(finite, nel);
    assert_int_equal(od, 0);
    assert_int_equal(pd, 0);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaFree(d_qkv); cudaFree(d_bias); cudaFree(d_qn); cudaFree(d_kn); cudaFree(d_inv); cudaFree(d_ts);
    cudaFree(d_tj); cudaFree(d_rs); cudaFree(d_ro); cudaFree(d_rn); cudaFree(d_iq); cudaFree(d_q);
    cudaFree(d_wo); cudaFree(d_wml); cudaFree(d_out); cudaFree(d_cnt); cudaFree(d_pf);
    for (int v = 0; v < 3; v++) free(o[v]), free(pool[v]);
    free(q_after);
    kv_free(&f);
}

static void test_rope_attention_equals_two_launches(void **state) {
    (void)state;
    const int cap = 24 * 16;
    const int a[1] = {190}, b[4] = {-1, cap - 1, 63, 0}, c[3] = {127, -1, 64}, d[2] = {17, cap - 1};
    for (int fp8 = 0; fp8 < 2; fp8++) {
        g_kv_fp8 = fp8;
        run_rope_attention_case(32, 4, 128, a, 1, 8, 1, 0, 1, 0);   /* Qwen3-30B-A3B, batch 1 */
        run_rope_attention_case(32, 4, 128, b, 4, 8, 1, 0, 1, 0);
        run_rope_attention_case(32, 8, 128, b, 4, 4, 0, 0, 0, 0);   /* Llama-3.1-8B, the combine kernel */
        run_rope_attention_case(12, 2, 64, c, 3, 5, 1, 1, 0, 0);    /* G = 6, D = 64, Qwen2 bias */
        run_rope_attention_case(16, 8, 128, c, 3, 1, 0, 1, 1, 0);   /* one split, written directly */
        run_rope_attention_case(8, 2, 128, d, 2, 3, 1, 0, 1, 48);   /* a sliding window */
    }
    g_kv_fp8 = 0;
}

/* The tensor-core decode form (attention_tc.cu: k_tuning.attn_dec 6, and 7 with keys
 * asked of L2 ahead) over many (row, KV head) pairs: one split written directly (with and
 * without the int8 rounding for an O GEMV), splits merged by the combine kernel (sized on
 * the device and by the host), head dims 64 and 128, 2 / 4 / 8 query heads per KV head,
 * sliding windows. Its lanes load K and V in a permuted order that Q and the output must
 * undo: a wrong pairing of dims or keys is an O(1) error against the double reference. */
static void test_attention_decode_tc_matches_reference(void **state) {
    (void)state;
    const int a[4] = {0, 700, 3, -1}, b[4] = {700, 1, -1, 0}, c[3] = {650, -1, 2};
    int dec[4] = {1, 1, 1, 1};
    for (int v = 6; v <= 7; v++) {
        k_tuning t = k_tuning_default;
        t.attn_dec = v;
        k_set_tuning(&t);
        run_attention_counters_case(160, 40, 64, a, 4, 1, 0);    /* G 4, D 64, one split */
        run_attention_counters_case(384, 48, 128, c, 3, 1, 0);   /* G 8 */
        run_attention_counters_case(128, 64, 128, b, 4, 1, 0);   /* G 2 */
        run_attention_counters_case(256, 32, 128, a, 4, 5, 128); /* host splits, the last takes the rest */
        g_attn_x8 = 1;
        run_attention_counters_case(160, 40, 128, a, 4, 1, 0);
        run_attention_counters_case(160, 40, 64, b, 4, 3, 0);
        g_attn_x8 = 0;
        g_attn_window = 48;
        run_attention_case(160, 40, 128, dec, 4, 1, 0);
        run_attention_case(160, 40, 64, dec, 4, 3, 0);
        g_attn_window = 0;
    }
    k_set_tuning(&k_tuning_default);
}

/* k_attention with w.x8 (the rounding an int8 O GEMV reads): codes and (scale, sum) pairs
 * equal k_quant_x8 of its own bf16 output, bit for bit, on every path -- the decode kernel
 * writing directly, its splits merged by the combine kernel and in-kernel (counters; the
 * many-pairs forms too), head dims 64 and 128 -- and where a k_quant_x8 launch follows
 * (tensor cores for verify and prefill rows, the SIMT kernel at head dim 32). */
static void test_attention_x8_equals_attention_then_quant_x8(void **state) {
    (void)state;
    int dec[4] = {1, 1, 1, 1}, ver[3] = {5, 5, 5}, pre[3] = {37, 3, 70};
    const int a[4] = {0, 700, 3, -1};
    g_attn_x8 = 1;
    run_attention_case(8, 2, 128, dec, 4, 1, 384);   /* one split: written directly */
    run_attention_case(8, 2, 128, dec, 4, 3, 128);   /* splits, the combine kernel */
    run_attention_case(12, 2, 64, dec, 3, 5, 64);    /* D 64, G 6 */
    run_attention_case(4, 2, 32, dec, 4, 2, 128);    /* D 32: SIMT, then k_quant_x8 */
    run_attention_case(8, 2, 128, ver, 3, 1, 384);   /* verify rows: tensor cores */
    run_attention_case(8, 2, 64, pre, 3, 4, 128);    /* prefill chunks, splits */
    run_attention_counters_case(32, 8, 128, a, 4, 8, 0);   /* 8B: merged in-kernel */
    run_attention_counters_case(160, 40, 64, a, 4, 4, 0);  /* many pairs */
    g_attn_x8 = 0;
}

/* ---- tensor-core attention (k_attention_tc) ---------------------------------------- */

typedef int (*attn_fn)(const float *, uint16_t *, int, int, int, float, const k_kv_geom *,
                       const k_attn_work *, cudaStream_t);

/* One call: rows with n_new[r] new tokens on len[r] cached ones (-1: random), items of qt =
 * min(cap_rows / G, max n_new) tokens; skip_row >= 0 gets no items and must stay poisoned.
 * out sits between two poisoned guard zones that must stay poisoned too. */
typedef struct {
    int H, KVH, D, bs, max_blocks;
    int nrow, n_new[MAXB], len[MAXB];
    int cap_rows, n_splits, split_len, skip_row;
} tc_case;

#define TC_GUARD 4096   /* bf16 elements of poison on each side of out */

static void run_tc_case(attn_fn fn, const tc_case *c) {
    kvfix f;
    kv_setup(&f, c->H, c->KVH, c->D, c->bs, c->max_blocks);
    const int H = c->H, KVH = c->KVH, D = c->D, G = H / KVH, cap = c->max_blocks * c->bs;
    int slots[MAXB] = {1, 3, 0, 2};
    int32_t row_slot[MAXB], row_off[MAXB], row_n[MAXB], item_row[1024], item_q0[1024];
    int n = 0, ni = 0, max_new = 0;
    for (int r = 0; r < c->nrow; r++) if (c->n_new[r] > max_new) max_new = c->n_new[r];
    int qt = c->cap_rows / G < 1 ? 1 : c->cap_rows / G;
    if (qt > max_new) qt = max_new;
    for (int r = 0; r < c->nrow; r++) {
        int len = c->len[r];
        if (len < 0) {
            int room = cap - c->n_new[r];
            len = (int)(gu_next(&g_rng) % (uint64_t)(room < 400 ? room : 400));
        }
        row_slot[r] = slots[r];
        row_off[r] = n;
        row_n[r] = c->n_new[r];
        f.lens[slots[r] * 2] = len;
        if (r != c->skip_row)
            for (int q0 = 0; q0 < c->n_new[r]; q0 += qt) { item_row[ni] = r; item_q0[ni] = q0; ni++; }
        n += c->n_new[r];
    }
    assert_true(ni <= 1024);
    kv_upload(&f);
    size_t nel = (size_t)n * H * D;
    float *q = malloc(nel * 4);
    for (size_t i = 0; i < nel; i++) q[i] = gu_uniform(&g_rng, -1.5f, 1.5f);
    float *d_q = gu_upload(q, nel * 4);
    uint16_t *d_buf = gu_dev((nel + 2 * TC_GUARD) * 2), *d_out = d_buf + TC_GUARD;
    int32_t *d_rs = gu_upload(row_slot, sizeof row_slot), *d_ro = gu_upload(row_off, sizeof row_off);
    int32_t *d_rn = gu_upload(row_n, sizeof row_n), *d_ir = gu_upload(item_row, (size_t)ni * 4);
    int32_t *d_iq = gu_upload(item_q0, (size_t)ni * 4);
    float *d_wo = gu_dev((size_t)c->n_splits * nel * 4);
    float *d_wml = gu_dev((size_t)c->n_splits * n * H * 2 * 4);
    k_kv_geom g = kv_geom_of(&f, NULL, NULL);
    k_attn_work w = {.row_slot = d_rs, .row_tok_off = d_ro, .row_n_new = d_rn, .item_row = d_ir,
                     .item_q0 = d_iq, .n_items = ni, .qt = qt, .n_tok = n, .n_splits = c->n_splits,
                     .split_len = c->split_len, .ws_o = d_wo, .ws_ml = d_wml};
    float scale = 1.f / sqrtf((float)D);
    assert_int_equal(fn(d_q, d_out, H, KVH, D, scale, &g, &w, 0), 0);
    uint16_t *buf = malloc((nel + 2 * TC_GUARD) * 2), *o = buf + TC_GUARD;
    gu_download(buf, d_buf, (nel + 2 * TC_GUARD) * 2);

    size_t guard_hit = 0, stray = 0;
    for (int i = 0; i < TC_GUARD; i++) {
        guard_hit += buf[i] != 0xffff;
        guard_hit += o[nel + i] != 0xffff;
    }
    /* Reference in double over the row's keys (copied out of the pool once per KV head);
     * queries past the pool's capacity see keys up to the capacity, like the kernel. */
    double *ref = malloc(nel * 8), *p = malloc((size_t)cap * 8);
    float *got = malloc(nel * 4), *kf = malloc((size_t)cap * D * 4), *vf = malloc((size_t)cap * D * 4);
    size_t nref = 0;
    for (int r = 0; r < c->nrow; r++) {
        int len = f.lens[row_slot[r] * 2];
        int kmax = len + row_n[r] - 1 < cap - 1 ? len + row_n[r] - 1 : cap - 1;
        for (int kvh = 0; kvh < KVH; kvh++) {
            for (int k = 0; k <= kmax; k++)
                for (int d = 0; d < D; d++) {
                    kf[(size_t)k * D + d] = kv_val(&f, kv_index(&f, row_slot[r], k, kvh, d, 0), 0);
                    vf[(size_t)k * D + d] = kv_val(&f, kv_index(&f, row_slot[r], k, kvh, d, 1), 1);
                }
            for (int j = 0; j < row_n[r]; j++) {
                int t = row_off[r] + j, last = len + j < kmax ? len + j : kmax;
                for (int h = kvh * G; h < (kvh + 1) * G; h++) {
                    size_t base = ((size_t)t * H + h) * D;
                    if (r == c->skip_row) {
                        for (int d = 0; d < D; d++) stray += o[base + d] != 0xffff;
                        continue;
                    }
                    const float *qr = q + base;
                    double mx = -INFINITY, sum = 0;
                    for (int k = 0; k <= last; k++) {
                        double s = 0;
                        for (int d = 0; d < D; d++) s += (double)qr[d] * kf[(size_t)k * D + d];
                        p[k] = s * scale;
                        if (p[k] > mx) mx = p[k];
                    }
                    for (int k = 0; k <= last; k++) { p[k] = exp(p[k] - mx); sum += p[k]; }
                    for (int d = 0; d < D; d++) {
                        double acc = 0;
                        for (int k = 0; k <= last; k++) acc += p[k] * vf[(size_t)k * D + d];
                        ref[nref] = acc / sum;
                        got[nref++] = gu_bf2f(o[base + d]);   /* NaN (unwritten) -> inf error */
                    }
                }
            }
        }
    }
    char name[128];
    snprintf(name, sizeof name, "attn_tc H%d KVH%d D%d new%d%s qt%d splits%d", H, KVH, D,
             c->n_new[0], c->nrow > 1 ? "+" : "", qt, c->n_splits);
    double e = gu_rel_err(got, ref, nref);
    report(name, e);
    assert_true(e < 1e-2);
    assert_int_equal(guard_hit, 0);
    assert_int_equal(stray, 0);
    cudaFree(d_q); cudaFree(d_buf); cudaFree(d_rs); cudaFree(d_ro); cudaFree(d_rn);
    cudaFree(d_ir); cudaFree(d_iq); cudaFree(d_wo); cudaFree(d_wml);
    free(q); free(buf); free(ref); free(p); free(got); free(kf); free(vf);
    kv_free(&f);
}

/* G = 1, 4, 8: H / KVH = 8 / 8, 32 / 8, 16 / 2. */
static const int tc_shapes[3][2] = {{8, 8}, {32, 8}, {16, 2}};

static void test_attention_tc_prefill_from_empty_context_matches_reference(void **state) {
    (void)state;
    const int lens[4] = {1, 15, 64, 200};
    for (int li = 0; li < 4; li++)
        for (int s = 0; s < 3; s++)
            for (int D = 64; D <= 128; D += 64) {
                tc_case c = {.H = tc_shapes[s][0], .KVH = tc_shapes[s][1], .D = D, .bs = 16,
                             .max_blocks = 16, .nrow = 1, .n_new = {lens[li]}, .len = {0},
                             .cap_rows = 64, .n_splits = (li + s) % 2 ? 3 : 1, .split_len = 0,
                             .skip_row = -1};
                run_tc_case(k_attention_tc, &c);
            }
    /* A long prompt: many items per row, the engine's 32-row items for D = 128. */
    tc_case c = {.H = 32, .KVH = 8, .D = 128, .bs = 16, .max_blocks = 64, .nrow = 1,
                 .n_new = {777}, .len = {0}, .cap_rows = 32, .n_splits = 1, .split_len = 0,
                 .skip_row = -1};
    run_tc_case(k_attention_tc, &c);
    c = (tc_case){.H = 16, .KVH = 2, .D = 64, .bs = 16, .max_blocks = 64, .nrow = 1,
                  .n_new = {777}, .len = {0}, .cap_rows = 64, .n_splits = 3, .split_len = 0,
                  .skip_row = -1};
    run_tc_case(k_attention_tc, &c);
    c = (tc_case){.H = 8, .KVH = 8, .D = 128, .bs = 16, .max_blocks = 64, .nrow = 1,
                  .n_new = {777}, .len = {0}, .cap_rows = 64, .n_splits = 3, .split_len = 256,
                  .skip_row = -1};
    run_tc_case(k_attention_tc, &c);
}

static void test_attention_tc_chunk_on_existing_context_matches_reference(void **state) {
    (void)state;
    for (int s = 0; s < 3; s++)
        for (int D = 64; D <= 128; D += 64)
            for (int sp = 0; sp < 2; sp++) {
                tc_case c = {.H = tc_shapes[s][0], .KVH = tc_shapes[s][1], .D = D, .bs = 16,
                             .max_blocks = 32, .nrow = 1, .n_new = {100}, .len = {300},
                             .cap_rows = sp ? 32 : 64, .n_splits = sp ? 3 : 1,
                             .split_len = sp && D == 64 ? 128 : 0, .skip_row = -1};
                run_tc_case(k_attention_tc, &c);
            }
}

static void test_attention_tc_rows_of_different_lengths_match_reference(void **state) {
    (void)state;
    for (int s = 0; s < 3; s++)
        for (int D = 64; D <= 128; D += 64)
            for (int sp = 0; sp < 2; sp++) {
                tc_case c = {.H = tc_shapes[s][0], .KVH = tc_shapes[s][1], .D = D, .bs = 16,
                             .max_blocks = 40, .nrow = 4, .n_new = {37, 3, 70, 130},
                             .len = {-1, -1, 0, -1}, .cap_rows = 64, .n_splits = sp ? 3 : 1,
                             .split_len = 0, .skip_row = -1};
                run_tc_case(k_attention_tc, &c);
            }
}

static void test_attention_tc_verify_rows_match_reference(void **state) {
    (void)state;
    for (int s = 0; s < 3; s++)
        for (int D = 64; D <= 128; D += 64)
            for (int sp = 0; sp < 2; sp++) {
                tc_case c = {.H = tc_shapes[s][0], .KVH = tc_shapes[s][1], .D = D, .bs = 16,
                             .max_blocks = 40, .nrow = 4, .n_new = {5, 5, 5, 5},
                             .len = {500, 499, 3, 240}, .cap_rows = 64, .n_splits = sp ? 3 : 1,
                             .split_len = 0, .skip_row = -1};
                run_tc_case(k_attention_tc, &c);
            }
}

/* Items of rows 0 and 2 only: row 1's outputs (and everything around out) stay poisoned,
 * so padding rows of a partial item write nothing into the next row's tokens. */
static void test_attention_tc_writes_only_its_items(void **state) {
    (void)state;
    for (int s = 0; s < 3; s++)
        for (int D = 64; D <= 128; D += 64) {
            tc_case c = {.H = tc_shapes[s][0], .KVH = tc_shapes[s][1], .D = D, .bs = 16,
                         .max_blocks = 24, .nrow = 3, .n_new = {37, 21, 70}, .len = {-1, -1, -1},
                         .cap_rows = 64, .n_splits = 1, .split_len = 0, .skip_row = 1};
            run_tc_case(k_attention_tc, &c);
        }
}

/* Rows that run past max_blocks * block_size: keys are clamped to the pool like the SIMT
 * kernel (and qkv_rope_kv, which does not write there). */
static void test_attention_tc_clamps_keys_at_pool_capacity(void **state) {
    (void)state;
    for (int sp = 0; sp < 2; sp++) {
        tc_case c = {.H = 32, .KVH = 8, .D = 128, .bs = 32, .max_blocks = 4, .nrow = 2,
                     .n_new = {20, 30}, .len = {118, 100}, .cap_rows = 64,
                     .n_splits = sp ? 2 : 1, .split_len = sp ? 64 : 0, .skip_row = -1};
        run_tc_case(k_attention_tc, &c);
    }
}

static void test_attention_tc_rejects_unsupported_shapes(void **state) {
    (void)state;
    k_kv_geom g;
    memset(&g, 0, sizeof g);
    k_attn_work w = {.n_items = 1, .qt = 4, .n_tok = 4, .n_splits = 1};
    assert_int_equal(k_attention_tc(NULL, NULL, 8, 2, 32, 1.f, &g, &w, 0), -1);
    assert_int_equal(k_attention_tc(NULL, NULL, 8, 2, 96, 1.f, &g, &w, 0), -1);
    w.qt = 17;   /* 17 * 4 rows > 64 */
    assert_int_equal(k_attention_tc(NULL, NULL, 8, 2, 128, 1.f, &g, &w, 0), -1);
    w.qt = 4;
    w.split_len = 100;   /* not a multiple of the 64-key tile */
    assert_int_equal(k_attention_tc(NULL, NULL, 8, 2, 128, 1.f, &g, &w, 0), -1);
    w.split_len = 0;
    w.n_splits = 2;      /* splits need the partial workspace */
    assert_int_equal(k_attention_tc(NULL, NULL, 8, 2, 128, 1.f, &g, &w, 0), -1);
}

static void run_gemv_case(int out, int in, int n, int accumulate) {
    uint16_t *w = malloc((size_t)out * in * 2), *x = malloc((size_t)n * in * 2);
    float *y0 = malloc((size_t)n * out * 4);
    for (size_t i = 0; i < (size_t)out * in; i++) w[i] = gu_f2bf(gu_uniform(&g_rng, -1, 1));
    for (size_t i = 0; i < (size_t)n * in; i++) x[i] = gu_f2bf(gu_uniform(&g_rng, -1, 1));
    for (size_t i = 0; i < (size_t)n * out; i++) y0[i] = gu_uniform(&g_rng, -5, 5);
    uint16_t *d_w = gu_upload(w, (size_t)out * in * 2), *d_x = gu_upload(x, (size_t)n * in * 2);
    float *d_y = accumulate ? gu_upload(y0, (size_t)n * out * 4) : gu_dev((size_t)n * out * 4);
    assert_int_equal(k_gemv_bf16(d_w, d_x, d_y, out, in, n, accumulate, 0), 0);
    float *y = malloc((size_t)n * out * 4);
    gu_download(y, d_y, (size_t)n * out * 4);
    double *ref = malloc((size_t)n * out * 8);
    for (int t = 0; t < n; t++)
        for (int o = 0; o < out; o++) {
            double s = accumulate ? y0[(size_t)t * out + o] : 0;
            for (int k = 0; k < in; k++)
                s += (double)gu_bf2f(w[(size_t)o * in + k]) * gu_bf2f(x[(size_t)t * in + k]);
            ref[(size_t)t * out + o] = s;
        }
    char name[96];
    snprintf(name, sizeof name, "gemv out%d in%d n%d acc%d", out, in, n, accumulate);
    double e = gu_rel_err(y, ref, (size_t)n * out);
    report(name, e);
    assert_true(e < 1e-5);   /* fp32 accumulation of exact bf16 products */
    cudaFree(d_w); cudaFree(d_x); cudaFree(d_y);
    free(w); free(x); free(y0); free(y); free(ref);
}

static void test_gemv_matches_reference(void **state) {
    (void)state;
    run_gemv_case(1000, 4096, 1, 0);
    run_gemv_case(333, 1544, 3, 1);
    run_gemv_case(517, 136, 8, 0);
    run_gemv_case(64, 8, 5, 1);
}

/* ---- mixture of experts ------------------------------------------------------------ */

/* One MoE layer against a double reference: the router's logits, the routing (re-derived
 * on the host from the device's logits, so a near-tie cannot make the check flaky), each
 * pair's activation and the residual after the weighted sum. fold: the decode form's norm
 * fold on both sides (x = bf16(h * g) scaled by rsqrt(ss / hidden + eps), and the next
 * norm's xg / ss written by the down kernel). dec: the three decode launches, else the
 * general path (route, grouped GEMM or per-expert GEMV, combine). */
/* k_moe_gemm's tcv_rows for the general-path cases (experts of up to that many rows on the
 * tensor-core GEMV, the rest on the tiles) */
static int g_moe_tcv;
static size_t g_moe_l2pf;   /* k_moe_route_buf.l2_bytes of the decode launches (0: no L2 request) */

static void run_moe_case(int n, int E, int K, int hidden, int MF, int norm_topk, int dec, int fold) {
    const size_t gu_n = (size_t)E * 2 * MF * hidden, dn_n = (size_t)E * hidden * MF;
    uint16_t *wr = malloc((size_t)E * hidden * 2), *wgu = malloc(gu_n * 2), *wdn = malloc(dn_n * 2);
    uint16_t *x = malloc((size_t)n * hidden * 2);
    float *h0 = malloc((size_t)n * hidden * 4), *g = malloc((size_t)hidden * 4), *gnext = malloc((size_t)hidden * 4);
    for (size_t i = 0; i < (size_t)E * hidden; i++) wr[i] = gu_f2bf(gu_uniform(&g_rng, -0.2f, 0.2f));
    for (size_t i = 0; i < gu_n; i++) wgu[i] = gu_f2bf(gu_uniform(&g_rng, -0.08f, 0.08f));
    for (size_t i = 0; i < dn_n; i++) wdn[i] = gu_f2bf(gu_uniform(&g_rng, -0.08f, 0.08f));
    for (int i = 0; i < hidden; i++) {
        g[i] = gu_uniform(&g_rng, 0.5f, 1.5f);
        gnext[i] = gu_uniform(&g_rng, 0.5f, 1.5f);
    }
    for (size_t i = 0; i < (size_t)n * hidden; i++) h0[i] = gu_uniform(&g_rng, -3, 3);
    const float eps = 1e-6f;
    unsigned long long ss_h[K_MOE_DEC_MAX_N] = {0};
    double rs[128];
    assert_true(n <= 128 && (!fold || n <= K_MOE_DEC_MAX_N));
    for (int t = 0; t < n; t++) {
        double ss = 0;
        for (int i = 0; i < hidden; i++) {
            const float hv = h0[(size_t)t * hidden + i];
            ss += (double)hv * hv;
            /* fold: x = bf16(h * g); else x = bf16(rmsnorm(h) * g), computed here */
            x[(size_t)t * hidden + i] = gu_f2bf(hv * g[i]);
        }
        if (fold) {
            ss_h[t] = (unsigned long long)llround(ss * (double)(1ull << K_SS_FRAC_BITS));
            rs[t] = 1.0 / sqrt(K_SS_VALUE(ss_h[t]) / hidden + eps);
        } else {
            const double r = 1.0 / sqrt(ss / hidden + eps);
            for (int i = 0; i < hidden; i++)
                x[(size_t)t * hidden + i] = gu_f2bf((float)(h0[(size_t)t * hidden + i] * r) * g[i]);
            rs[t] = 1.0;
        }
    }
    uint16_t *d_wr = gu_upload(wr, (size_t)E * hidden * 2), *d_wgu = gu_upload(wgu, gu_n * 2);
    uint16_t *d_wdn = gu_upload(wdn, dn_n * 2), *d_x = gu_upload(x, (size_t)n * hidden * 2);
    float *d_resid = gu_upload(h0, (size_t)n * hidden * 4), *d_gnext = gu_upload(gnext, (size_t)hidden * 4);
    float *d_lg = gu_dev((size_t)n * E * 4), *d_w = gu_dev((size_t)n * K * 4), *d_out = gu_dev((size_t)n * K * hidden * 4);
    int32_t *d_ids = gu_dev((size_t)n * K * 4), *d_rows = gu_dev((size_t)E * n * 4), *d_cnt = gu_dev((2 * E + 2) * 4);
    uint16_t *d_act = gu_dev((size_t)n * K * MF * 2), *d_xg = gu_dev((size_t)n * hidden * 2);
    unsigned long long *d_ss = gu_upload(ss_h, sizeof ss_h), *d_ss_next = gu_dev(sizeof ss_h);
    GPU_CHECK(cudaMemset(d_ss_next, 0, sizeof ss_h));
    GPU_CHECK(cudaMemset(d_cnt, 0, 4));   /* the done counter; the rest stays NaN-poisoned */
    k_moe_route_buf b = {.logits = d_lg, .ids = d_ids, .w = d_w, .counts = d_cnt + 1, .rows = d_rows,
                         .active = d_cnt + 1 + E, .done = (unsigned *)d_cnt};
    if (dec && g_moe_l2pf) {   /* the routing asks L2 for the picks' gate and up rows: a hint */
        b.l2_gu = d_wgu;
        b.l2_F = MF;
        b.l2_bytes = 8;   /* not a 16-byte multiple: refused */
        assert_int_equal(k_moe_route_gemv(d_wr, d_x, NULL, n, hidden, E, K, norm_topk, &b, 0), -1);
        b.l2_bytes = g_moe_l2pf;
    }
    const k_norm_in nin = {d_ss, eps};
    const k_norm_out nout = {d_gnext, d_xg, d_ss_next};
    if (dec == 2) {   /* one launch (k_moe_decode1), twice: the same bits, the barrier counter back at 0 */
        assert_true(n == 1);
        float *d_part = gu_dev(k_moe_decode1_part_floats(hidden) * 4);
        unsigned *d_bar = gu_dev(4);
        GPU_CHECK(cudaMemset(d_bar, 0, 4));
        float *first = malloc((size_t)hidden * 4), *again = malloc((size_t)hidden * 4);
        for (int rep = 0; rep < 2; rep++) {
            if (rep) GPU_CHECK(cudaMemcpy(d_resid, h0, (size_t)hidden * 4, cudaMemcpyHostToDevice));
            if (rep) GPU_CHECK(cudaMemset(d_ss_next, 0, sizeof ss_h));
            assert_int_equal(k_moe_decode1(d_wr, d_wgu, d_wdn, d_x, fold ? &nin : NULL, hidden, E, K, MF, norm_topk, 0,
                                           &b, d_part, d_bar, d_resid, fold ? &nout : NULL, d_act, 0), 0);
            gu_download(rep ? again : first, d_resid, (size_t)hidden * 4);
        }
        assert_memory_equal(first, again, (size_t)hidden * 4);
        unsigned bar = 1;
        gu_download(&bar, d_bar, 4);
        assert_int_equal(bar, 0);
        /* the router's logits and the activations: the three launches' bits */
        float *lg1 = malloc((size_t)E * 4), *lg3 = malloc((size_t)E * 4);
        uint16_t *a1 = malloc((size_t)K * MF * 2), *a3 = malloc((size_t)K * MF * 2);
        float *d_r3 = gu_upload(h0, (size_t)hidden * 4);
        gu_download(lg1, d_lg, (size_t)E * 4);
        gu_download(a1, d_act, (size_t)K * MF * 2);
        assert_int_equal(k_moe_route_gemv(d_wr, d_x, fold ? &nin : NULL, n, hidden, E, K, norm_topk, &b, 0), 0);
        assert_int_equal(k_moe_gated_dec(d_wgu, d_x, fold ? &nin : NULL, &b, n, E, K, MF, hidden, 0, d_act, 0), 0);
        gu_download(lg3, d_lg, (size_t)E * 4);
        gu_download(a3, d_act, (size_t)K * MF * 2);
        assert_memory_equal(lg1, lg3, (size_t)E * 4);
        assert_memory_equal(a1, a3, (size_t)K * MF * 2);
        /* timing, us a call (after the warm-up above) */
        cudaEvent_t t0, t1;
        GPU_CHECK(cudaEventCreate(&t0));
        GPU_CHECK(cudaEventCreate(&t1));
        float ms1 = 0, ms3 = 0;
        for (int form = 0; form < 2; form++) {
            GPU_CHECK(cudaEventRecord(t0, 0));
            for (int i = 0; i < 20; i++) {
                if (form == 0)
                    assert_int_equal(k_moe_decode1(d_wr, d_wgu, d_wdn, d_x, fold ? &nin : NULL, hidden, E, K, MF,
                                                   norm_topk, 0, &b, d_part, d_bar, d_r3, fold ? &nout : NULL, NULL, 0), 0);
                else {
                    assert_int_equal(k_moe_route_gemv(d_wr, d_x, fold ? &nin : NULL, n, hidden, E, K, norm_topk, &b, 0), 0);
                    assert_int_equal(k_moe_gated_dec(d_wgu, d_x, fold ? &nin : NULL, &b, n, E, K, MF, hidden, 0, d_act, 0), 0);
                    assert_int_equal(k_moe_down_combine(d_wdn, d_act, &b, n, K, hidden, MF, d_r3, fold ? &nout : NULL, 0), 0);
                }
            }
            GPU_CHECK(cudaEventRecord(t1, 0));
            GPU_CHECK(cudaEventSynchronize(t1));
            GPU_CHECK(cudaEventElapsedTime(form ? &ms3 : &ms1, t0, t1));
        }
        printf("    moe one token E%d K%d %dx%d: one launch %.2f us, three launches %.2f us\n", E, K, hidden, MF,
               ms1 * 50.f, ms3 * 50.f);
        /* one clean run for the checks below */
        GPU_CHECK(cudaMemcpy(d_resid, h0, (size_t)hidden * 4, cudaMemcpyHostToDevice));
        GPU_CHECK(cudaMemset(d_ss_next, 0, sizeof ss_h));
        assert_int_equal(k_moe_decode1(d_wr, d_wgu, d_wdn, d_x, fold ? &nin : NULL, hidden, E, K, MF, norm_topk, 0, &b,
                                       d_part, d_bar, d_resid, fold ? &nout : NULL, d_act, 0), 0);
        gu_download(again, d_resid, (size_t)hidden * 4);
        assert_memory_equal(first, again, (size_t)hidden * 4);
        cudaEventDestroy(t0); cudaEventDestroy(t1);
        cudaFree(d_part); cudaFree(d_bar); cudaFree(d_r3);
        free(first); free(again); free(lg1); free(lg3); free(a1); free(a3);
    } else if (dec) {
        for (int rep = 0; rep < 2; rep++) {   /* twice: the done counter must come back to 0 */
            if (rep) GPU_CHECK(cudaMemcpy(d_resid, h0, (size_t)n * hidden * 4, cudaMemcpyHostToDevice));
            if (rep) GPU_CHECK(cudaMemset(d_ss_next, 0, sizeof ss_h));
            assert_int_equal(k_moe_route_gemv(d_wr, d_x, fold ? &nin : NULL, n, hidden, E, K, norm_topk, &b, 0), 0);
            assert_int_equal(k_moe_gated_dec(d_wgu, d_x, fold ? &nin : NULL, &b, n, E, K, MF, hidden, 0, d_act, 0), 0);
            assert_int_equal(k_moe_down_combine(d_wdn, d_act, &b, n, K, hidden, MF, d_resid, fold ? &nout : NULL, 0), 0);
        }
        unsigned done = 1;
        gu_download(&done, d_cnt, 4);
        assert_int_equal(done, 0);
    } else {
        /* the router's logits by the plain GEMV, K_GEMV_MAX_N tokens at a time */
        for (int t0 = 0; t0 < n; t0 += K_GEMV_MAX_N) {
            const int m = n - t0 < K_GEMV_MAX_N ? n - t0 : K_GEMV_MAX_N;
            assert_int_equal(k_gemv_bf16(d_wr, d_x + (size_t)t0 * hidden, d_lg + (size_t)t0 * E, E, hidden, m, 0, 0), 0);
        }
        GPU_CHECK(cudaMemset(b.counts, 0, (size_t)E * 4));
        assert_int_equal(k_moe_route(d_lg, n, E, K, norm_topk, d_ids, d_w, b.counts, d_rows, 0), 0);
        assert_int_equal(k_moe_gemm(d_wgu, d_x, K, d_rows, b.counts, n, E, MF, hidden, 1, 0, g_moe_tcv, NULL, d_act, 0), 0);
        assert_int_equal(k_moe_gemm(d_wdn, d_act, 1, d_rows, b.counts, n, E, hidden, MF, 0, 0, g_moe_tcv, d_out, NULL, 0),
                         0);
        assert_int_equal(k_moe_combine(d_out, d_w, n, K, hidden, d_resid, 0), 0);
    }
    float *lg = malloc((size_t)n * E * 4), *wk = malloc((size_t)n * K * 4), *resid = malloc((size_t)n * hidden * 4);
    int32_t *ids = malloc((size_t)n * K * 4), *cnt = malloc((size_t)(2 * E + 1) * 4);
    uint16_t *act = malloc((size_t)n * K * MF * 2);
    gu_download(lg, d_lg, (size_t)n * E * 4);
    gu_download(wk, d_w, (size_t)n * K * 4);
    gu_download(ids, d_ids, (size_t)n * K * 4);
    gu_download(resid, d_resid, (size_t)n * hidden * 4);
    gu_download(act, d_act, (size_t)n * K * MF * 2);
    gu_download(cnt, d_cnt + 1, (size_t)(2 * E + 1) * 4);
    /* logits */
    double *lref = malloc((size_t)n * E * 8);
    for (int t = 0; t < n; t++)
        for (int e = 0; e < E; e++) {
            double a = 0;
            for (int i = 0; i < hidden; i++)
                a += (double)gu_bf2f(wr[(size_t)e * hidden + i]) * gu_bf2f(x[(size_t)t * hidden + i]);
            lref[(size_t)t * E + e] = a * rs[t];
        }
    char name[128];
    snprintf(name, sizeof name, "moe %s%s n%d E%d K%d %dx%d router", dec == 2 ? "dec1" : dec ? "dec" : "gen", fold ? " fold" : "", n, E, K,
             hidden, MF);
    double el = gu_rel_err(lg, lref, (size_t)n * E);
    report(name, el);
    assert_true(el < 1e-5);
    /* routing from the device's logits: ids in k order, weights, row lists, active list */
    int per_e[512] = {0};
    for (int t = 0; t < n; t++) {
        const float *l = lg + (size_t)t * E;
        float mx = -INFINITY;
        for (int e = 0; e < E; e++) mx = l[e] > mx ? l[e] : mx;
        double sum = 0;
        for (int e = 0; e < E; e++) sum += exp((double)l[e] - mx);
        int taken[512] = {0};
        double cw[16], ws = 0;
        for (int k = 0; k < K; k++) {
            int be = -1;
            for (int e = 0; e < E; e++)
                if (!taken[e] && (be < 0 || l[e] > l[be])) be = e;
            taken[be] = 1;
            assert_int_equal(ids[t * K + k], be);
            per_e[be]++;
            cw[k] = exp((double)l[be] - mx) / sum;
            ws += cw[k];
        }
        for (int k = 0; k < K; k++) {
            const double want = norm_topk ? cw[k] / ws : cw[k];
            assert_true(fabs(wk[t * K + k] - want) <= 1e-4 * want + 1e-7);
        }
    }
    if (dec != 2)   /* (the one-launch form writes no row lists) */
        for (int e = 0; e < E; e++) assert_int_equal(cnt[e], per_e[e]);
    if (dec == 1) {   /* the active list names each expert with rows exactly once */
        int seen[512] = {0}, na = cnt[E], want = 0;
        for (int e = 0; e < E; e++) want += per_e[e] > 0;
        assert_int_equal(na, want);
        for (int i = 0; i < na; i++) {
            const int e = cnt[E + 1 + i];
            assert_true(e >= 0 && e < E && per_e[e] > 0 && !seen[e]);
            seen[e] = 1;
        }
    }
    /* activations and the combined residual */
    double *aref = malloc((size_t)n * K * MF * 8), *rref = malloc((size_t)n * hidden * 8);
    float *actf = malloc((size_t)n * K * MF * 4);
    for (int p = 0; p < n * K; p++) {
        const int t = p / K, e = ids[p];
        for (int j = 0; j < MF; j++) {
            double gs = 0, us = 0;
            const uint16_t *gr = wgu + ((size_t)e * 2 * MF + j) * hidden, *ur = gr + (size_t)MF * hidden;
            for (int i = 0; i < hidden; i++) {
                const double xv = gu_bf2f(x[(size_t)t * hidden + i]);
                gs += gu_bf2f(gr[i]) * xv;
                us += gu_bf2f(ur[i]) * xv;
            }
            gs *= rs[t];
            us *= rs[t];
            aref[(size_t)p * MF + j] = gs / (1 + exp(-gs)) * us;
            actf[(size_t)p * MF + j] = gu_bf2f(act[(size_t)p * MF + j]);
        }
    }
    double ea = gu_rel_err(actf, aref, (size_t)n * K * MF);
    snprintf(name, sizeof name, "moe %s%s n%d E%d K%d %dx%d act", dec == 2 ? "dec1" : dec ? "dec" : "gen", fold ? " fold" : "", n, E, K,
             hidden, MF);
    report(name, ea);
    assert_true(ea < 8e-3);   /* bf16 output */
    for (int t = 0; t < n; t++)
        for (int c = 0; c < hidden; c++) {
            double s = 0;
            for (int k = 0; k < K; k++) {
                const int p = t * K + k;
                const uint16_t *dr = wdn + ((size_t)ids[p] * hidden + c) * MF;
                double d = 0;
                for (int j = 0; j < MF; j++) d += (double)gu_bf2f(dr[j]) * gu_bf2f(act[(size_t)p * MF + j]);
                s += wk[p] * d;
            }
            rref[(size_t)t * hidden + c] = h0[(size_t)t * hidden + c] + s;
        }
    /* against the change, not the residual's size: the MoE output must be right */
    double num = 0, den = 0, big = 0;
    for (size_t i = 0; i < (size_t)n * hidden; i++) {
        assert_false(isnan(resid[i]));
        num = fmax(num, fabs(resid[i] - rref[i]));
        den = fmax(den, fabs(rref[i] - h0[i]));
        big = fmax(big, fabs(rref[i]));
    }
    snprintf(name, sizeof name, "moe %s%s n%d E%d K%d %dx%d out", dec == 2 ? "dec1" : dec ? "dec" : "gen", fold ? " fold" : "", n, E, K,
             hidden, MF);
    report(name, num / den);   /* the error against the size of the MoE's own output */
    assert_true(num <= 1e-5 * den + 2.4e-7 * big);   /* + the residual's fp32 rounding */
    if (dec && fold) {   /* the next layer's norm inputs */
        uint16_t *xg = malloc((size_t)n * hidden * 2);
        unsigned long long ssn[K_MOE_DEC_MAX_N];
        gu_download(xg, d_xg, (size_t)n * hidden * 2);
        gu_download(ssn, d_ss_next, sizeof ssn);
        for (int t = 0; t < n; t++) {
            double ss = 0;
            for (int c = 0; c < hidden; c++) {
                const float hv = resid[(size_t)t * hidden + c];
                ss += (double)hv * hv;
                assert_int_equal(xg[(size_t)t * hidden + c], gu_f2bf(hv * gnext[c]));
            }
            assert_true(fabs(K_SS_VALUE(ssn[t]) - ss) <= 1e-6 * ss + 1e-6);
        }
        free(xg);
    }
    cudaFree(d_wr); cudaFree(d_wgu); cudaFree(d_wdn); cudaFree(d_x); cudaFree(d_resid); cudaFree(d_gnext);
    cudaFree(d_lg); cudaFree(d_w); cudaFree(d_out); cudaFree(d_ids); cudaFree(d_rows); cudaFree(d_cnt);
    cudaFree(d_act); cudaFree(d_xg); cudaFree(d_ss); cudaFree(d_ss_next);
    free(wr); free(wgu); free(wdn); free(x); free(h0); free(g); free(gnext); free(lg); free(wk); free(resid);
    free(ids); free(cnt); free(act); free(lref); free(aref); free(rref); free(actf);
}

/* both forms of the single-token gate|up GEMV (k_tuning.moe_r1) */
static void test_moe_decode_launches_match_reference(void **state) {
    (void)state;
    for (int form = 0; form <= 1; form++) {
        k_tuning t = k_tuning_default;
        t.moe_r1 = form;
        k_set_tuning(&t);
        /* with the routing asking L2 for 16 KB, then 1 MB (more than the small cases'
         * whole rows) of each pick's gate and up rows: the same results */
        for (int pf = 0; pf < (form ? 3 : 1); pf++) {
            g_moe_l2pf = pf == 0 ? 0 : pf == 1 ? 16384 : 1 << 20;
            printf("    moe single-token form %d, L2 request %zu bytes\n", form, g_moe_l2pf);
            run_moe_case(1, 16, 4, 256, 96, 1, 1, 0);
            run_moe_case(1, 128, 8, 2048, 768, 1, 1, 1);  /* Qwen3-30B-A3B's widths, one token */
            run_moe_case(1, 8, 2, 512, 1408, 0, 1, 1);    /* Mixtral's top-2 of 8, one token */
            run_moe_case(1, 8, 2, 1000, 1400, 1, 1, 1);   /* widths that end inside a pass */
            run_moe_case(1, 4, 4, 1024, 200, 1, 1, 0);    /* every expert picked; no norm fold */
        }
        g_moe_l2pf = 0;
    }
    k_set_tuning(&k_tuning_default);
    /* several tokens: the 8-row form whatever moe_r1 says */
    run_moe_case(3, 16, 4, 256, 96, 0, 1, 1);
    run_moe_case(8, 64, 8, 2048, 768, 1, 1, 1);   /* Qwen3-30B-A3B's widths */
    run_moe_case(2, 8, 2, 512, 1408, 0, 1, 1);    /* Mixtral's top-2 of 8; rows longer than one pass */
}

/* one token's MoE layer in one launch (k_moe_decode1): the reference, the three launches'
 * logits and activations bit for bit, the same bits run to run */
static void test_moe_decode_one_launch(void **state) {
    (void)state;
    run_moe_case(1, 16, 4, 256, 96, 1, 2, 0);
    run_moe_case(1, 128, 8, 2048, 768, 1, 2, 1);   /* Qwen3-30B-A3B's widths: slices of 48, 128 blocks */
    run_moe_case(1, 8, 2, 512, 1408, 0, 2, 1);     /* Mixtral's top-2 of 8 */
    run_moe_case(1, 8, 2, 1000, 1400, 1, 2, 1);    /* widths that end inside a pass and a slice */
    run_moe_case(1, 4, 4, 1024, 200, 1, 2, 0);     /* every expert picked; no norm fold */
    run_moe_case(1, 8, 2, 4096, 1792, 0, 2, 1);    /* down columns in more chunks than the ring holds */
}

static void test_moe_general_path_matches_reference(void **state) {
    (void)state;
    for (int form = 0; form <= 1; form++) {   /* (moe_r1: the GEMV of a single token) */
        k_tuning t = k_tuning_default;
        t.moe_r1 = form;
        k_set_tuning(&t);
        run_moe_case(1, 16, 4, 256, 96, 1, 0, 0);
    }
    k_set_tuning(&k_tuning_default);
    run_moe_case(3, 16, 4, 256, 96, 1, 0, 0);     /* per-expert GEMV */
    /* above 8 tokens: the tiles, experts of up to 16 rows on the tensor-core GEMV and the
     * rest on the tiles, every expert on the GEMV (k_moe_gemm's tcv_rows) */
    const int tcvs[3] = {0, 16, 1000};
    for (int f = 0; f < 3; f++) {
        g_moe_tcv = tcvs[f];
        printf("    moe above 8 tokens, experts of up to %d rows on the tensor-core GEMV, the rest on the tiles\n",
               tcvs[f]);
        run_moe_case(40, 16, 4, 256, 96, 0, 0, 0);
        run_moe_case(64, 8, 2, 512, 256, 1, 0, 0);    /* experts of 16 rows and more */
        run_moe_case(72, 64, 8, 2048, 768, 1, 0, 0);  /* Qwen3-30B-A3B's widths */
        run_moe_case(24, 8, 2, 1000, 1400, 1, 0, 0);  /* widths that end inside a chunk, outputs not of 16 */
        run_moe_case(100, 4, 4, 1024, 200, 0, 0, 0);  /* every expert picked by all 100 tokens: 7 passes */
    }
    g_moe_tcv = 0;
}

/* ---- sampling ---------------------------------------------------------------------- */

static uint32_t key_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

static int cmp_desc(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* The documented algorithm in double precision; returns the token and, through margin,
 * how close u fell to a boundary of the chosen token's interval (relative to the mass). */
static int ref_sample(const float *x, int V, const k_sample_params *p, double *margin) {
    int am = 0;
    for (int i = 1; i < V; i++) if (x[i] > x[am]) am = i;
    *margin = 1;
    if (!(p->temperature > 0) || p->top_k == 1) return am;
    double T = p->temperature, xmax = x[am];
    float *s = malloc((size_t)V * 4);
    memcpy(s, x, (size_t)V * 4);
    qsort(s, (size_t)V, 4, cmp_desc);
    uint32_t thr = 0;
    if (p->top_k > 0 && p->top_k < V) thr = key_of(s[p->top_k - 1]);
    if (p->top_p > 0 && p->top_p < 1) {
        double zk = 0;
        for (int i = 0; i < V; i++) if (key_of(s[i]) >= thr) zk += exp((s[i] - xmax) / T);
        double c = 0;
        for (int i = 0; i < V; i++) {
            if (key_of(s[i]) < thr) break;
            c += exp((s[i] - xmax) / T);
            if (c >= p->top_p * zk) { if (key_of(s[i]) > thr) thr = key_of(s[i]); break; }
        }
    }
    free(s);
    double zmin = p->min_p > 0 ? log(p->min_p) : -INFINITY, tot = 0;
    for (int i = 0; i < V; i++) {
        double z = (x[i] - xmax) / T;
        if (key_of(x[i]) >= thr && z >= zmin) tot += exp(z);
    }
    double u = k_philox_uniform_host(p->seed, p->counter) * tot, c = 0;
    int last = am;
    for (int i = 0; i < V; i++) {
        double z = (x[i] - xmax) / T;
        if (!(key_of(x[i]) >= thr && z >= zmin)) continue;
        double m = exp(z);
        last = i;
        if (u < c + m) {
            double a = (u - c) / tot, b = (c + m - u) / tot;
            *margin = a < b ? a : b;
            return i;
        }
        c += m;
    }
    *margin = 0;
    return last;
}

static void test_philox_matches_known_answer(void **state) {
    (void)state;
    /* Random123 known answer: Philox4x32-10, counter 0, key 0 -> 0x6627e8d5 first word. */
    float want = (float)(0x6627e8d5u >> 8) / 16777216.0f;
    assert_true(k_philox_uniform_host(0, 0) == want);
}

static void test_sample_matches_reference_draws(void **state) {
    (void)state;
    const int V = 5003, n = 64;
    float *x = malloc((size_t)n * V * 4);
    for (size_t i = 0; i < (size_t)n * V; i++) x[i] = gu_uniform(&g_rng, -4, 4);
    k_sample_params sp[64];
    for (int r = 0; r < n; r++) {
        k_sample_params q = {0};
        switch (r % 8) {
        case 0: q.temperature = 0; break;
        case 1: q.temperature = 1; break;
        case 2: q.temperature = 0.7f; q.top_k = 20; break;
        case 3: q.temperature = 1.3f; q.top_p = 0.8f; break;
        case 4: q.temperature = 1; q.min_p = 0.2f; break;
        case 5: q.temperature = 0.9f; q.top_k = 100; q.top_p = 0.5f; q.min_p = 0.05f; break;
        case 6: q.temperature = 1; q.top_k = 1; break;
        case 7: q.temperature = 2; q.top_p = 0.95f; q.top_k = 3000; break;
        }
        q.seed = gu_next(&g_rng);
        q.counter = (uint64_t)r * 7;
        sp[r] = q;
    }
    float *d_x = gu_upload(x, (size_t)n * V * 4);
    k_sample_params *d_sp = gu_upload(sp, sizeof sp);
    int32_t *d_tok = gu_dev(n * 4);
    float *d_lp = gu_dev(n * 4);
    assert_int_equal(k_sample(d_x, n, V, d_sp, d_tok, d_lp, NULL, NULL, NULL, 0), 0);
    int32_t tok[64];
    float lp[64];
    gu_download(tok, d_tok, sizeof tok);
    gu_download(lp, d_lp, sizeof lp);
    int near = 0;
    double lp_err = 0;
    for (int r = 0; r < n; r++) {
        double margin;
        int want = ref_sample(x + (size_t)r * V, V, &sp[r], &margin);
        if (tok[r] != want) {
            /* Only a draw within float rounding of an interval edge may differ. */
            assert_true(margin < 1e-5);
            near++;
        }
        const float *xr = x + (size_t)r * V;
        double mx = -INFINITY, se = 0;
        for (int i = 0; i < V; i++) if (xr[i] > mx) mx = xr[i];
        for (int i = 0; i < V; i++) se += exp(xr[i] - mx);
        double d = fabs(lp[r] - (xr[tok[r]] - mx - log(se)));
        if (d > lp_err) lp_err = d;
    }
    printf("    sample: %d rows, %d edge draws, max logprob abs err %.2e\n", n, near, lp_err);
    assert_true(near <= 2);
    assert_true(lp_err < 1e-4);
    cudaFree(d_x); cudaFree(d_sp); cudaFree(d_tok); cudaFree(d_lp);
    free(x);
}

/* Device buffers of a k_sample comparison: n rows of V logits (x, copied into w before each
 * run, as k_sample adjusts rows in place), their parameters, and the outputs. */
typedef struct {
    float *x, *w, *lp, *tlp;
    int32_t *tok, *ids;
    const k_sample_params *sp;
    int n, V;
} sample_dev;

/* k_sample over a fresh copy of the rows under tuning t; tokens, logprobs, top ids (unset
 * entries -1) and top logprobs downloaded. */
static void sample_dev_run(const sample_dev *d, const k_tuning *t, int32_t *tok, float *lp, int32_t *ids,
                           float *tlp) {
    k_set_tuning(t);
    cudaMemset(d->ids, 0xff, (size_t)d->n * K_MAX_TOP * 4);
    cudaMemcpy(d->w, d->x, (size_t)d->n * d->V * 4, cudaMemcpyDeviceToDevice);
    assert_int_equal(k_sample(d->w, d->n, d->V, d->sp, d->tok, d->lp, d->ids, d->tlp, NULL, 0), 0);
    gu_download(tok, d->tok, (size_t)d->n * 4);
    gu_download(lp, d->lp, (size_t)d->n * 4);
    gu_download(ids, d->ids, (size_t)d->n * K_MAX_TOP * 4);
    gu_download(tlp, d->tlp, (size_t)d->n * K_MAX_TOP * 4);
}

/* k_tuning.sample_hist: the radix selects of top-k, top-p and top logprobs add into one
 * histogram per warp (a warp's equal buckets with one atomic in count mode). Counts are
 * integers, so every token, logprob and top logprob of the greedy, top-k and top-logprob
 * rows must equal the one-histogram form's bit for bit, on rows shaped like a real
 * vocabulary's logits (most in a few top-byte buckets; Llama 3's 128256 ids). Top-p rows
 * select by mass, which both forms add with float atomics (in no fixed order, so not
 * even one form repeats itself bit for bit): the kept set can gain or lose the token at
 * its edge when the 0.9 crossing lies within rounding of it, and the draw over a total
 * that moved by that token's mass can land on a neighbour. On the same rows (2026-12-06,
 * H100) one run drew another token in one top-p row and the next run in none: their
 * tokens may differ, in at most 2 of the 16; their top logprobs (count mode) may not. Both forms
 * are timed (a top-k row, a top-p row, 64 rows). */
static void test_sample_hist_aggregated_same_results(void **state) {
    (void)state;
    const int V = 128256, n = 64, NT = 20;
    float *x = malloc((size_t)n * V * 4);
    for (size_t i = 0; i < (size_t)n * V; i++) x[i] = gu_uniform(&g_rng, -3, 9) + (i % 977 == 0 ? 6.f : 0.f);
    k_sample_params sp[64];
    for (int r = 0; r < n; r++) {
        k_sample_params q = {0};
        q.temperature = r % 4 == 0 ? 0.f : 0.8f;
        q.top_k = r % 4 == 1 ? 40 : r % 4 == 2 ? 1000 : 0;
        q.top_p = r % 4 == 3 ? 0.9f : 0.f;
        q.n_top = 1 + r % NT;
        q.seed = 77 + (uint64_t)r;
        q.counter = (uint64_t)r;
        sp[r] = q;
    }
    float *d_x = gu_upload(x, (size_t)n * V * 4);
    float *d_w = gu_dev((size_t)n * V * 4);
    k_sample_params *d_sp = gu_upload(sp, sizeof sp);
    int32_t *d_tok = gu_dev(n * 4), *d_ids = gu_dev(n * K_MAX_TOP * 4);
    float *d_lp = gu_dev(n * 4), *d_tlp = gu_dev(n * K_MAX_TOP * 4);
    int32_t tok[2][64], ids[2][64 * K_MAX_TOP];
    float lp[2][64], tlp[2][64 * K_MAX_TOP];
    float ms[2][3];
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    const sample_dev dev = {d_x, d_w, d_lp, d_tlp, d_tok, d_ids, d_sp, n, V};
    for (int agg = 0; agg < 2; agg++) {
        k_tuning t = k_tuning_default;
        t.sample_hist = agg;
        sample_dev_run(&dev, &t, tok[agg], lp[agg], ids[agg], tlp[agg]);
        for (int j = 0; j < 3; j++) {   /* timing: row 1 alone (top-k), row 3 alone (top-p), all 64 */
            const int r0 = j == 0 ? 1 : j == 1 ? 3 : 0, rows = j == 2 ? n : 1;
            for (int w = 0; w < 3; w++)
                k_sample(d_w + (size_t)r0 * V, rows, V, d_sp + r0, d_tok, d_lp, d_ids, d_tlp, NULL, 0);
            cudaEventRecord(e0, 0);
            for (int it = 0; it < 20; it++)
                k_sample(d_w + (size_t)r0 * V, rows, V, d_sp + r0, d_tok, d_lp, d_ids, d_tlp, NULL, 0);
            cudaEventRecord(e1, 0);
            cudaEventSynchronize(e1);
            cudaEventElapsedTime(&ms[agg][j], e0, e1);
        }
    }
    k_set_tuning(&k_tuning_default);
    printf("    k_sample over %d logits with top logprobs, one histogram per block / per warp: top-k row %.1f / %.1f us, "
           "top-p row %.1f / %.1f us, %d rows %.1f / %.1f us\n", V, 1e3 * ms[0][0] / 20, 1e3 * ms[1][0] / 20,
           1e3 * ms[0][1] / 20, 1e3 * ms[1][1] / 20, n, 1e3 * ms[0][2] / 20, 1e3 * ms[1][2] / 20);
    int topp_moved = 0;
    for (int r = 0; r < n; r++) {
        if (sp[r].top_p > 0.f && tok[0][r] != tok[1][r]) {   /* (see above) */
            topp_moved++;
            continue;
        }
        assert_int_equal(tok[0][r], tok[1][r]);
        assert_memory_equal(&lp[0][r], &lp[1][r], 4);
    }
    printf("    top-p rows whose draw moved: %d of %d\n", topp_moved, n / 4);
    assert_true(topp_moved <= 2);
    for (int r = 0; r < n; r++) {
        assert_memory_equal(ids[0] + r * K_MAX_TOP, ids[1] + r * K_MAX_TOP, (size_t)sp[r].n_top * 4);
        assert_memory_equal(tlp[0] + r * K_MAX_TOP, tlp[1] + r * K_MAX_TOP, (size_t)sp[r].n_top * 4);
        assert_true(ids[0][r * K_MAX_TOP] >= 0 && ids[0][r * K_MAX_TOP] < V);
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaFree(d_x); cudaFree(d_w); cudaFree(d_sp); cudaFree(d_tok); cudaFree(d_ids); cudaFree(d_lp); cudaFree(d_tlp);
    free(x);
}

/* k_tuning.sample_vec: the row passes of k_sample and of the speculative argmax with four
 * 16-byte loads in flight per thread. Both forms must pick the same tokens (the argmax is
 * the lowest id of the largest value whatever order the threads visit the row in; top-k
 * and min-p keep the same set), the same top logprob ids, and logprobs within 1e-5 (the
 * log-sum-exp adds in another order); greedy rows must equal the host's argmax, in
 * k_sample and in k_spec_draft_pick. Rows of 151936 ids (16-byte aligned: the vector loop)
 * and of 5003 (rows 1-3 of every 4 misaligned: the scalar loop; row 0 the vector loop and
 * a 3-entry tail); every 4th row in steps of 0.25, so values tie. A greedy row with its
 * logprob, and one with 5 top logprobs, are timed in both forms. */
static void test_sample_vec_same_results(void **state) {
    (void)state;
    const int Vs[2] = {151936, 5003}, n = 16;
    for (int vi = 0; vi < 2; vi++) {
        const int V = Vs[vi];
        float *x = malloc((size_t)n * V * 4);
        for (int r = 0; r < n; r++)
            for (int i = 0; i < V; i++) {
                const float u = gu_uniform(&g_rng, -3, 9);
                x[(size_t)r * V + i] = r % 4 == 0 ? roundf(u * 4.f) / 4.f : u;
            }
        k_sample_params sp[16], greedy[16];
        for (int r = 0; r < n; r++) {
            k_sample_params q = {0};
            if (r % 4 == 1) q.n_top = 5;
            if (r % 4 == 2) { q.temperature = 0.8f; q.top_k = 40; q.n_top = 3; }
            if (r % 4 == 3) { q.temperature = 1.f; q.min_p = 0.1f; }
            q.seed = 991 + (uint64_t)r;
            q.counter = (uint64_t)r;
            sp[r] = q;
            greedy[r] = (k_sample_params){0};
        }
        float *d_x = gu_upload(x, (size_t)n * V * 4), *d_w = gu_dev((size_t)n * V * 4);
        k_sample_params *d_sp = gu_upload(sp, sizeof sp), *d_gp = gu_upload(greedy, sizeof greedy);
        int32_t *d_tok = gu_dev(n * 4), *d_ids = gu_dev(n * K_MAX_TOP * 4), *d_pick = gu_dev(n * 4);
        float *d_lp = gu_dev(n * 4), *d_tlp = gu_dev(n * K_MAX_TOP * 4);
        int32_t tok[2][16], ids[2][16 * K_MAX_TOP], pick[2][16];
        float lp[2][16], tlp[2][16 * K_MAX_TOP], ms[2], ms_top[2];
        cudaEvent_t e0, e1;
        cudaEventCreate(&e0);
        cudaEventCreate(&e1);
        const sample_dev dev = {d_x, d_w, d_lp, d_tlp, d_tok, d_ids, d_sp, n, V};
        for (int vec = 0; vec < 2; vec++) {
            k_tuning t = k_tuning_default;
            t.sample_vec = vec;
            sample_dev_run(&dev, &t, tok[vec], lp[vec], ids[vec], tlp[vec]);
            assert_int_equal(k_spec_draft_pick(d_x, d_x, n, V, d_gp, 0, 5, d_pick, 0), 0);
            gu_download(pick[vec], d_pick, sizeof pick[vec]);
            for (int w = 0; w < 3; w++) k_sample(d_w, 1, V, d_sp, d_tok, d_lp, NULL, NULL, NULL, 0);
            cudaEventRecord(e0, 0);
            for (int it = 0; it < 20; it++) k_sample(d_w, 1, V, d_sp, d_tok, d_lp, NULL, NULL, NULL, 0);
            cudaEventRecord(e1, 0);
            cudaEventSynchronize(e1);
            cudaEventElapsedTime(&ms[vec], e0, e1);
            cudaEventRecord(e0, 0);   /* row 1: greedy with 5 top logprobs */
            for (int it = 0; it < 20; it++)
                k_sample(d_w + V, 1, V, d_sp + 1, d_tok, d_lp, d_ids, d_tlp, NULL, 0);
            cudaEventRecord(e1, 0);
            cudaEventSynchronize(e1);
            cudaEventElapsedTime(&ms_top[vec], e0, e1);
        }
        k_set_tuning(&k_tuning_default);
        double lp_d = 0, tlp_d = 0;
        for (int r = 0; r < n; r++) {
            const float *xr = x + (size_t)r * V;
            int am = 0;
            for (int i = 1; i < V; i++) if (xr[i] > xr[am]) am = i;
            assert_int_equal(tok[0][r], tok[1][r]);
            assert_int_equal(pick[0][r], am);
            assert_int_equal(pick[1][r], am);
            if (r % 4 < 2) assert_int_equal(tok[1][r], am);
            lp_d = fmax(lp_d, fabs(lp[0][r] - lp[1][r]));
            assert_memory_equal(ids[0] + r * K_MAX_TOP, ids[1] + r * K_MAX_TOP, (size_t)sp[r].n_top * 4);
            for (int k = 0; k < sp[r].n_top; k++)
                tlp_d = fmax(tlp_d, fabs(tlp[0][r * K_MAX_TOP + k] - tlp[1][r * K_MAX_TOP + k]));
        }
        printf("    k_sample over %d logits, scalar / vector row passes: greedy row with its logprob %.1f / %.1f us, "
               "with 5 top logprobs %.1f / %.1f us; logprobs differ by %.1e, top logprobs by %.1e\n", V,
               1e3 * ms[0] / 20, 1e3 * ms[1] / 20, 1e3 * ms_top[0] / 20, 1e3 * ms_top[1] / 20, lp_d, tlp_d);
        assert_true(lp_d < 1e-5);
        assert_true(tlp_d < 1e-5);
        cudaEventDestroy(e0);
        cudaEventDestroy(e1);
        cudaFree(d_x); cudaFree(d_w); cudaFree(d_sp); cudaFree(d_gp); cudaFree(d_tok); cudaFree(d_ids);
        cudaFree(d_pick); cudaFree(d_lp); cudaFree(d_tlp);
        free(x);
    }
}

static void test_sample_same_seed_same_token_other_counter_varies(void **state) {
    (void)state;
    const int V = 2000, n = 48;
    float *x = malloc((size_t)n * V * 4);
    for (int i = 0; i < V; i++) x[i] = gu_uniform(&g_rng, -1, 1);
    for (int r = 1; r < n; r++) memcpy(x + (size_t)r * V, x, (size_t)V * 4);
    k_sample_params sp[48];
    for (int r = 0; r < n; r++) {
        k_sample_params q = {.temperature = 1.f, .seed = 1234, .counter = r < n / 2 ? 5 : (uint64_t)r};
        sp[r] = q;
    }
    float *d_x = gu_upload(x, (size_t)n * V * 4);
    k_sample_params *d_sp = gu_upload(sp, sizeof sp);
    int32_t *d_tok = gu_dev(n * 4);
    assert_int_equal(k_sample(d_x, n, V, d_sp, d_tok, NULL, NULL, NULL, NULL, 0), 0);
    int32_t tok[48];
    gu_download(tok, d_tok, sizeof tok);
    for (int r = 1; r < n / 2; r++) assert_int_equal(tok[r], tok[0]);
    int distinct = 0;
    for (int r = n / 2 + 1; r < n; r++) distinct += tok[r] != tok[n / 2];
    assert_true(distinct > 0);
    cudaFree(d_x); cudaFree(d_sp); cudaFree(d_tok);
    free(x);
}

/* ---- logit adjustments and top logprobs (k_sample_params.adj, n_top) -------------------- */

/* n rows of V random logits (every 4th row in steps of 0.25, so values tie) with each
 * row's adjustments and sampling mode; the host side of the test. */
typedef struct {
    int n, V;
    float *x;                  /* [n, V] raw logits */
    k_sample_params sp[40];
    k_logit_adj *adj;          /* all rows' entries, row r's at off[r] */
    int off[41];
} adj_case;

static void adj_case_make(adj_case *c, int n, int V) {
    assert_true(n <= 40);
    c->n = n;
    c->V = V;
    c->x = malloc((size_t)n * V * 4);
    c->adj = malloc(sizeof(k_logit_adj) * (size_t)n * 4000);
    int used = 0;
    for (int r = 0; r < n; r++) {
        float *xr = c->x + (size_t)r * V;
        for (int i = 0; i < V; i++) {
            float v = gu_uniform(&g_rng, -4, 4);
            xr[i] = r % 4 == 3 ? floorf(v * 4) / 4 : v;
        }
        int am = 0;
        for (int i = 1; i < V; i++) if (xr[i] > xr[am]) am = i;
        k_sample_params q = {0};
        switch (r % 5) {   /* greedy, and each filter */
        case 0: break;
        case 1: q.temperature = 1; break;
        case 2: q.temperature = 0.7f; q.top_k = 20; break;
        case 3: q.temperature = 1.3f; q.top_p = 0.8f; break;
        case 4: q.temperature = 0.9f; q.min_p = 0.1f; break;
        }
        q.seed = gu_next(&g_rng);
        q.counter = (uint64_t)r * 3;
        const int top_n[4] = {0, 1, 5, 20};
        q.n_top = top_n[r % 4];
        k_logit_adj *a = c->adj + used;
        int nb = r % 3 == 2 ? 0 : 1 + r % 6, ns = r % 3 == 0 ? 3 : 0, nst = r % 7 == 6 ? 3000 : (r * 37) % 400;
        for (int j = 0; j < nb; j++) {   /* a repeated id, ids outside the vocabulary, the argmax */
            int32_t id = j == 0 ? am : j == 3 ? a[1].id : j == 4 ? -1 : j == 5 ? V : (int32_t)(gu_next(&g_rng) % V);
            a[j] = (k_logit_adj){id, gu_uniform(&g_rng, -3, 3)};
        }
        for (int j = 0; j < ns; j++)   /* eos-like ids: the argmax (twice) and another */
            a[nb + j] = (k_logit_adj){j == 1 ? (am + 7) % V : am, 0.f};
        for (int j = 0; j < nst; j++)   /* distinct ids: a stride through the vocabulary */
            a[nb + ns + j] = (k_logit_adj){(int32_t)((am + 1 + (size_t)j * 7) % V), (float)(gu_next(&g_rng) % 4)};
        if (nst) {
            q.presence = r % 2 ? 0.5f : 0.f;
            q.frequency = r % 3 ? 0.3f : -0.2f;
            q.repetition = r % 4 ? 1.3f : 0.8f;
        }
        q.n_bias = nb;
        q.n_suppress = ns;
        q.n_stats = nst;
        c->off[r] = used;
        used += nb + ns + nst;
        c->sp[r] = q;
    }
    c->off[n] = used;
}

/* A row's adjustments q over its entries a (V logits xr) on the host, by
 * engine/core/sample.c, with fed (>= 0) counted once more in its statistics. */
static void adj_host(const k_sample_params *q, const k_logit_adj *a, int V, int32_t fed, float *xr) {
    int32_t ids[4000], cnt[4000], bias_ids[8], sup[4];
    float bias_vals[8];
    for (int j = 0; j < q->n_bias; j++) bias_ids[j] = a[j].id, bias_vals[j] = a[j].v;
    for (int j = 0; j < q->n_suppress; j++) sup[j] = a[q->n_bias + j].id;
    for (int j = 0; j < q->n_stats; j++) {
        ids[j] = a[q->n_bias + q->n_suppress + j].id;
        cnt[j] = (int32_t)a[q->n_bias + q->n_suppress + j].v;
    }
    sample_params sp = {.temperature = q->temperature, .presence_penalty = q->presence,
                        .frequency_penalty = q->frequency, .repetition_penalty = q->repetition,
                        .n_logit_bias = q->n_bias, .logit_bias_ids = bias_ids, .logit_bias_vals = bias_vals,
                        .suppress_eos = q->n_suppress > 0, .eos_ids = sup, .n_eos = q->n_suppress};
    sample_apply_penalties_fed(xr, V, &sp, ids, cnt, q->n_stats, fed);
}

/* Row r's adjustments on the host. */
static void adj_case_host(const adj_case *c, int r, float *xr) { adj_host(&c->sp[r], c->adj + c->off[r], c->V, -1, xr); }

/* Fresh device copies of the logits, the entries and the parameters (pointing into them). */
static void adj_case_upload(const adj_case *c, float **d_x, k_logit_adj **d_adj, k_sample_params **d_sp) {
    *d_x = gu_upload(c->x, (size_t)c->n * c->V * 4);
    *d_adj = gu_upload(c->adj, sizeof(k_logit_adj) * (size_t)(c->off[c->n] ? c->off[c->n] : 1));
    k_sample_params sp[40];
    for (int r = 0; r < c->n; r++) {
        sp[r] = c->sp[r];
        if (sp[r].n_bias + sp[r].n_suppress + sp[r].n_stats) sp[r].adj = *d_adj + c->off[r];
    }
    *d_sp = gu_upload(sp, sizeof(k_sample_params) * (size_t)c->n);
}

static void adj_case_free(adj_case *c) {
    free(c->x);
    free(c->adj);
}

/* k_logit_adjust writes exactly (bit for bit) the logits engine/core/sample.c's penalties
 * write: bias in order with a repeated id, ids outside the vocabulary skipped, suppressed
 * ids (one listed twice), repetition / presence / frequency over distinct statistics. */
static void test_logit_adjust_equals_host_penalties(void **state) {
    (void)state;
    adj_case c;
    adj_case_make(&c, 40, 5003);
    float *d_x;
    k_logit_adj *d_adj;
    k_sample_params *d_sp;
    adj_case_upload(&c, &d_x, &d_adj, &d_sp);
    assert_int_equal(k_logit_adjust(d_x, c.n, c.V, d_sp, 0), 0);
    float *got = malloc((size_t)c.n * c.V * 4), *want = malloc((size_t)c.V * 4);
    gu_download(got, d_x, (size_t)c.n * c.V * 4);
    int changed = 0;
    for (int r = 0; r < c.n; r++) {
        memcpy(want, c.x + (size_t)r * c.V, (size_t)c.V * 4);
        adj_case_host(&c, r, want);
        for (int i = 0; i < c.V; i++) {
            const float g = got[(size_t)r * c.V + i];
            if (memcmp(&g, &want[i], 4))
                fail_msg("row %d id %d: device %.9g, host %.9g (raw %.9g)", r, i, g, want[i], c.x[(size_t)r * c.V + i]);
            changed += want[i] != c.x[(size_t)r * c.V + i];
        }
    }
    printf("    logit adjust: %d rows, %d entries, %d logits changed, all bit-identical to the host\n", c.n,
           c.off[c.n], changed);
    assert_true(changed > 1000);
    cudaFree(d_x); cudaFree(d_adj); cudaFree(d_sp);
    free(got); free(want);
    adj_case_free(&c);
}

/* k_sample's forced rows (prompt positions: k_sample_params.force) beside ordinary ones,
 * over the adjustment case's rows (their adjustments, filters and seeds left in place, as
 * a forced row must ignore them): every third row forced to an id (some to the row's
 * largest logit, some to a suppressed or biased id, some to the last id). A forced row's
 * token is its id, its rank equals sample_rank, its logprob and top logprobs those of the
 * raw logits (top ids equal to sample_top_logprobs', logprobs within 1e-4); the other rows'
 * tokens equal a run without forced rows; the logits come back unchanged. */
static void test_sample_forced_rows_match_host(void **state) {
    (void)state;
    adj_case c;
    adj_case_make(&c, 40, 5003);
    const int n = c.n, V = c.V;
    float *d_x;
    k_logit_adj *d_adj;
    k_sample_params *d_sp;
    adj_case_upload(&c, &d_x, &d_adj, &d_sp);   /* the run without forced rows first */
    int32_t *d_tok = gu_dev(n * 4), *d_top = gu_dev((size_t)n * K_MAX_TOP * 4), *d_rank = gu_dev(n * 4);
    float *d_lp = gu_dev(n * 4), *d_tlp = gu_dev((size_t)n * K_MAX_TOP * 4);
    assert_int_equal(k_sample(d_x, n, V, d_sp, d_tok, d_lp, d_top, d_tlp, NULL, 0), 0);
    int32_t plain[40];
    gu_download(plain, d_tok, sizeof plain);
    cudaFree(d_sp);
    /* k_sample leaves in each applied entry the logit it replaced: the entries again */
    assert_int_equal(cudaMemcpy(d_adj, c.adj, sizeof(k_logit_adj) * (size_t)(c.off[n] ? c.off[n] : 1),
                                cudaMemcpyHostToDevice), cudaSuccess);
    k_sample_params sp[40];
    for (int r = 0; r < n; r++) {
        sp[r] = c.sp[r];
        if (sp[r].n_bias + sp[r].n_suppress + sp[r].n_stats) sp[r].adj = d_adj + c.off[r];
        if (r % 3) continue;
        const float *xr = c.x + (size_t)r * V;
        sp[r].force = 1;
        /* (every forced row has suppressed ids, the first of them the argmax, which is also
         * its first biased id when it has bias: r % 9 == 0 forces a suppressed, biased id) */
        sp[r].force_tok = r % 9 == 0 ? sample_argmax(xr, V) : r % 9 == 3 ? V - 1 : (int32_t)(gu_next(&g_rng) % V);
        if (sp[r].force_tok < 0 || sp[r].force_tok >= V) sp[r].force_tok = 1;
        sp[r].n_top = r % 2 ? 0 : 7;
    }
    d_sp = gu_upload(sp, sizeof sp);
    assert_int_equal(k_sample(d_x, n, V, d_sp, d_tok, d_lp, d_top, d_tlp, d_rank, 0), 0);
    int32_t tok[40], rank[40], top[40][K_MAX_TOP];
    float lp[40], tlp[40][K_MAX_TOP], *after = malloc((size_t)n * V * 4);
    gu_download(tok, d_tok, sizeof tok);
    gu_download(rank, d_rank, sizeof rank);
    gu_download(lp, d_lp, sizeof lp);
    gu_download(top, d_top, sizeof top);
    gu_download(tlp, d_tlp, sizeof tlp);
    gu_download(after, d_x, (size_t)n * V * 4);
    assert_memory_equal(after, c.x, (size_t)n * V * 4);
    int forced = 0, ranked_low = 0;
    double lp_err = 0;
    for (int r = 0; r < n; r++) {
        const float *xr = c.x + (size_t)r * V;
        if (!sp[r].force) {
            assert_int_equal(tok[r], plain[r]);
            continue;
        }
        forced++;
        assert_int_equal(tok[r], sp[r].force_tok);
        assert_int_equal(rank[r], sample_rank(xr, V, sp[r].force_tok));
        ranked_low += rank[r] > 100;
        lp_err = fmax(lp_err, fabs(lp[r] - sample_logprob(xr, V, sp[r].force_tok)));
        int32_t ids[K_MAX_TOP];
        float lps[K_MAX_TOP];
        const int k = sp[r].n_top ? sample_top_logprobs(xr, V, sp[r].n_top, ids, lps) : 0;
        for (int j = 0; j < k; j++) {
            if (top[r][j] != ids[j]) fail_msg("forced row %d top %d: device id %d, host %d", r, j, top[r][j], ids[j]);
            lp_err = fmax(lp_err, fabs(tlp[r][j] - lps[j]));
        }
    }
    printf("    forced rows: %d of %d (%d ranked below 100), ranks equal, max logprob abs err %.2e\n", forced, n,
           ranked_low, lp_err);
    assert_true(forced >= 13 && ranked_low > 0);
    assert_true(lp_err < 1e-4);
    cudaFree(d_x); cudaFree(d_adj); cudaFree(d_sp); cudaFree(d_tok); cudaFree(d_lp); cudaFree(d_top); cudaFree(d_tlp);
    cudaFree(d_rank);
    free(after);
    adj_case_free(&c);
}

/* k_sample_masked (grammar masks inside the sampling kernel) over the adjustment case's
 * rows, every other row masked (about a third of the vocabulary kept; in every fourth row
 * the raw argmax is left out): the tokens, and the logits left behind, equal the path it
 * replaces (k_mask_logits in place, then k_sample); unmasked rows' logprobs equal that
 * path's; a masked row's logprob and top logprobs are those of its logits before the mask
 * and the adjustments (top ids equal to sample_top_logprobs', logprobs within 1e-4). */
static void test_sample_masked_rows_report_raw_logprobs(void **state) {
    (void)state;
    adj_case c;
    adj_case_make(&c, 40, 5003);
    const int n = c.n, V = c.V, W = (V + 31) / 32;
    uint32_t *mask = calloc((size_t)n * W, 4);
    int32_t has[40];
    for (int r = 0; r < n; r++) {
        has[r] = r % 2;
        if (!has[r]) continue;
        const float *xr = c.x + (size_t)r * V;
        for (int i = 0; i < V; i++)
            if (gu_next(&g_rng) % 3 == 0) mask[(size_t)r * W + i / 32] |= 1u << (i % 32);
        if (r % 4 == 1) {   /* the raw argmax left out */
            const int am = sample_argmax(xr, V);
            mask[(size_t)r * W + am / 32] &= ~(1u << (am % 32));
        }
    }
    uint32_t *d_mask = gu_upload(mask, (size_t)n * W * 4);
    int32_t *d_has = gu_upload(has, sizeof has);
    int32_t tok[2][40], top[2][40][K_MAX_TOP];
    float lp[2][40], tlp[2][40][K_MAX_TOP], *after[2];
    for (int way = 0; way < 2; way++) {   /* 0: k_mask_logits + k_sample; 1: k_sample_masked */
        float *d_x;
        k_logit_adj *d_adj;
        k_sample_params *d_sp;
        adj_case_upload(&c, &d_x, &d_adj, &d_sp);
        int32_t *d_tok = gu_dev(n * 4), *d_top = gu_dev((size_t)n * K_MAX_TOP * 4);
        float *d_lp = gu_dev(n * 4), *d_tlp = gu_dev((size_t)n * K_MAX_TOP * 4);
        if (way == 0) {
            assert_int_equal(k_mask_logits(d_x, n, V, d_mask, d_has, 0), 0);
            assert_int_equal(k_sample(d_x, n, V, d_sp, d_tok, d_lp, d_top, d_tlp, NULL, 0), 0);
        } else {
            assert_int_equal(k_sample_masked(d_x, n, V, d_sp, d_mask, d_has, d_tok, d_lp, d_top, d_tlp, NULL, 0), 0);
        }
        gu_download(tok[way], d_tok, sizeof tok[way]);
        gu_download(lp[way], d_lp, sizeof lp[way]);
        gu_download(top[way], d_top, sizeof top[way]);
        gu_download(tlp[way], d_tlp, sizeof tlp[way]);
        after[way] = malloc((size_t)n * V * 4);
        gu_download(after[way], d_x, (size_t)n * V * 4);
        cudaFree(d_x); cudaFree(d_adj); cudaFree(d_sp); cudaFree(d_tok); cudaFree(d_lp); cudaFree(d_top);
        cudaFree(d_tlp);
    }
    assert_memory_equal(after[0], after[1], (size_t)n * V * 4);
    int masked_off_argmax = 0;
    double lp_err = 0;
    for (int r = 0; r < n; r++) {
        const float *xr = c.x + (size_t)r * V;
        assert_int_equal(tok[1][r], tok[0][r]);
        if (!has[r]) {
            assert_memory_equal(&lp[1][r], &lp[0][r], sizeof(float));
            continue;
        }
        assert_true((mask[(size_t)r * W + tok[1][r] / 32] >> (tok[1][r] % 32)) & 1u);   /* a kept token */
        masked_off_argmax += tok[1][r] != sample_argmax(xr, V);
        lp_err = fmax(lp_err, fabs(lp[1][r] - sample_logprob(xr, V, tok[1][r])));
        int32_t ids[K_MAX_TOP];
        float lps[K_MAX_TOP];
        const int k = c.sp[r].n_top ? sample_top_logprobs(xr, V, c.sp[r].n_top, ids, lps) : 0;
        for (int j = 0; j < k; j++) {
            if (top[1][r][j] != ids[j]) fail_msg("masked row %d top %d: device id %d, host %d", r, j, top[1][r][j], ids[j]);
            lp_err = fmax(lp_err, fabs(tlp[1][r][j] - lps[j]));
        }
    }
    printf("    masked rows: 20 of %d (%d not on the raw argmax), tokens and logits as k_mask_logits + k_sample, "
           "raw logprobs within %.2e\n", n, masked_off_argmax, lp_err);
    assert_true(masked_off_argmax >= 5);
    assert_true(lp_err < 1e-4);
    cudaFree(d_mask); cudaFree(d_has);
    free(mask); free(after[0]); free(after[1]);
    adj_case_free(&c);
}

/* k_sample with adjustments: greedy rows pick the host's argmax of the adjusted logits,
 * sampled rows the reference draw over them (but within rounding of an interval's edge);
 * the logprob and the top logprobs are of the raw logits (top ids equal to
 * sample_top_logprobs', ties to the lower id included; logprobs within 1e-4), and the
 * logits come back unchanged. */
static void test_sample_adjusted_matches_host_and_reports_raw_logprobs(void **state) {
    (void)state;
    adj_case c;
    adj_case_make(&c, 40, 5003);
    float *d_x;
    k_logit_adj *d_adj;
    k_sample_params *d_sp;
    adj_case_upload(&c, &d_x, &d_adj, &d_sp);
    const int n = c.n, V = c.V;
    int32_t *d_tok = gu_dev(n * 4), *d_top = gu_dev((size_t)n * K_MAX_TOP * 4);
    float *d_lp = gu_dev(n * 4), *d_tlp = gu_dev((size_t)n * K_MAX_TOP * 4);
    assert_int_equal(k_sample(d_x, n, V, d_sp, d_tok, d_lp, d_top, d_tlp, NULL, 0), 0);
    int32_t tok[40], top[40][K_MAX_TOP];
    float lp[40], tlp[40][K_MAX_TOP], *after = malloc((size_t)n * V * 4), *adj = malloc((size_t)V * 4);
    gu_download(tok, d_tok, sizeof tok);
    gu_download(lp, d_lp, sizeof lp);
    gu_download(top, d_top, sizeof top);
    gu_download(tlp, d_tlp, sizeof tlp);
    gu_download(after, d_x, (size_t)n * V * 4);
    assert_memory_equal(after, c.x, (size_t)n * V * 4);   /* the rows put back */
    int near = 0, tops = 0, ties = 0;
    double lp_err = 0;
    for (int r = 0; r < n; r++) {
        const float *xr = c.x + (size_t)r * V;
        memcpy(adj, xr, (size_t)V * 4);
        adj_case_host(&c, r, adj);
        double margin;
        int want = ref_sample(adj, V, &c.sp[r], &margin);
        if (!(c.sp[r].temperature > 0)) assert_int_equal(tok[r], sample_argmax(adj, V));
        if (tok[r] != want) {
            assert_true(margin < 1e-5);
            near++;
        }
        assert_true(adj[tok[r]] > -INFINITY);   /* never a suppressed id */
        double d = fabs(lp[r] - sample_logprob(xr, V, tok[r]));
        lp_err = d > lp_err ? d : lp_err;
        int32_t ids[K_MAX_TOP];
        float lps[K_MAX_TOP];
        int k = c.sp[r].n_top ? sample_top_logprobs(xr, V, c.sp[r].n_top, ids, lps) : 0;
        assert_int_equal(k, c.sp[r].n_top);
        for (int j = 0; j < k; j++, tops++) {
            if (top[r][j] != ids[j]) fail_msg("row %d top %d: device id %d, host %d", r, j, top[r][j], ids[j]);
            ties += j > 0 && xr[ids[j]] == xr[ids[j - 1]];
            d = fabs(tlp[r][j] - lps[j]);
            lp_err = d > lp_err ? d : lp_err;
        }
    }
    printf("    sample with adjustments: %d rows, %d edge draws, %d top logprobs (%d ties), max logprob abs err %.2e\n",
           n, near, tops, ties, lp_err);
    assert_true(near <= 2);
    assert_true(ties > 0);
    assert_true(lp_err < 1e-4);
    cudaFree(d_x); cudaFree(d_adj); cudaFree(d_sp); cudaFree(d_tok); cudaFree(d_lp); cudaFree(d_top); cudaFree(d_tlp);
    free(after); free(adj);
    adj_case_free(&c);
}

/* k_sample_params.fed (async scheduling: the token a row is fed, which its statistics
 * lack): the statistics get a placeholder entry, and the penalties must equal the host's
 * sample_apply_penalties_fed bit for bit, whether the fed token is listed (count + 1),
 * listed with count 0 (a prompt-only id), absent (a new id), suppressed, or outside the
 * vocabulary; k_sample puts every row back as it came, the placeholder's logit included. */
static void test_sample_counts_fed_token(void **state) {
    (void)state;
    adj_case c;
    adj_case_make(&c, 40, 5003);
    const int n = c.n, V = c.V;
    k_logit_adj *adj = malloc(sizeof(k_logit_adj) * (size_t)(c.off[n] + n));
    int off[41], used = 0, kinds[5] = {0}, has_fed[40] = {0};
    int32_t fed[40];
    k_sample_params sp[40];
    for (int r = 0; r < n; r++) {
        const k_sample_params *q = &c.sp[r];
        const int m = q->n_bias + q->n_suppress + q->n_stats, js = q->n_stats / 2;
        k_logit_adj *a = adj + used, *st = a + q->n_bias + q->n_suppress;
        memcpy(a, c.adj + c.off[r], sizeof(k_logit_adj) * (size_t)m);
        sp[r] = *q;
        off[r] = used;
        const int kind = r % 5;   /* listed, absent, suppressed, outside the vocabulary, listed with count 0 */
        if (kind == 0 || kind == 4) {
            fed[r] = q->n_stats ? st[js].id : 0;
            if (kind == 4 && q->n_stats) st[js].v = 0.f;   /* a prompt-only id */
        } else if (kind == 1 || (kind == 2 && !q->n_suppress)) {
            fed[r] = (int32_t)(gu_next(&g_rng) % V);   /* moved on until no entry lists it */
            for (int j = 0; j < q->n_stats; j++)
                if (st[j].id == fed[r]) fed[r] = (fed[r] + 1) % V, j = -1;
        } else {
            fed[r] = kind == 2 ? a[q->n_bias].id : V + 3;
        }
        if (q->n_stats && (q->presence != 0 || q->frequency != 0 || q->repetition != 1)) {
            a[m] = (k_logit_adj){-1, 0.f};   /* the placeholder */
            sp[r].n_stats++;
            has_fed[r] = 1;
            kinds[kind]++;
        }
        used += m + has_fed[r];
    }
    off[n] = used;
    float *d_x = gu_upload(c.x, (size_t)n * V * 4);
    k_logit_adj *d_adj = gu_upload(adj, sizeof(k_logit_adj) * (size_t)used);
    int32_t *d_fed = gu_upload(fed, sizeof fed);
    for (int r = 0; r < n; r++) {
        if (sp[r].n_bias + sp[r].n_suppress + sp[r].n_stats) sp[r].adj = d_adj + off[r];
        if (has_fed[r]) sp[r].fed = d_fed + r;
    }
    k_sample_params *d_sp = gu_upload(sp, sizeof sp);
    assert_int_equal(k_logit_adjust(d_x, n, V, d_sp, 0), 0);
    float *got = malloc((size_t)n * V * 4), *want = malloc((size_t)V * 4);
    gu_download(got, d_x, (size_t)n * V * 4);
    int fed_changed = 0;
    for (int r = 0; r < n; r++) {
        const k_sample_params *q = &c.sp[r];   /* (the statistics without the placeholder) */
        memcpy(want, c.x + (size_t)r * V, (size_t)V * 4);
        adj_host(q, adj + off[r], V, has_fed[r] ? fed[r] : -1, want);
        for (int i = 0; i < V; i++) {
            const float g = got[(size_t)r * V + i];
            if (memcmp(&g, &want[i], 4))
                fail_msg("row %d id %d (fed %d): device %.9g, host %.9g", r, i, fed[r], g, want[i]);
        }
        if (has_fed[r] && fed[r] >= 0 && fed[r] < V) {   /* the fed token's logit as the plain stats leave it */
            float plain[1];
            memcpy(want, c.x + (size_t)r * V, (size_t)V * 4);
            adj_host(q, adj + off[r], V, -1, want);
            plain[0] = want[fed[r]];
            fed_changed += memcmp(plain, &got[(size_t)r * V + fed[r]], 4) != 0;
        }
    }
    /* k_sample: the rows come back as they were */
    cudaFree(d_adj);
    d_adj = gu_upload(adj, sizeof(k_logit_adj) * (size_t)used);
    for (int r = 0; r < n; r++)
        if (sp[r].n_bias + sp[r].n_suppress + sp[r].n_stats) sp[r].adj = d_adj + off[r];
    cudaFree(d_sp);
    d_sp = gu_upload(sp, sizeof sp);
    cudaFree(d_x);
    d_x = gu_upload(c.x, (size_t)n * V * 4);
    int32_t *d_tok = gu_dev(n * 4);
    assert_int_equal(k_sample(d_x, n, V, d_sp, d_tok, NULL, NULL, NULL, NULL, 0), 0);
    gu_download(got, d_x, (size_t)n * V * 4);
    assert_memory_equal(got, c.x, (size_t)n * V * 4);
    printf("    fed token counted: listed %d, absent %d, suppressed %d, outside %d, listed with count 0 %d rows; the fed "
           "logit moved in %d rows, all bit-identical to the host\n", kinds[0], kinds[1], kinds[2], kinds[3],
           kinds[4], fed_changed);
    assert_true(fed_changed >= 8);
    cudaFree(d_x); cudaFree(d_adj); cudaFree(d_sp); cudaFree(d_fed); cudaFree(d_tok);
    free(got); free(want); free(adj);
    adj_case_free(&c);
}

static void test_advance_lens_skips_dummy_rows(void **state) {
    (void)state;
    int32_t lens[10] = {5, 1, 7, 2, 0, 0, 9, 3, 4, 4};   /* slots 0..4, dummy = 4 */
    int32_t rs[5] = {2, 4, 0, 4, 3}, rn[5] = {3, 1, 1, 1, 2};
    int32_t *d_l = gu_upload(lens, sizeof lens), *d_rs = gu_upload(rs, sizeof rs), *d_rn = gu_upload(rn, sizeof rn);
    assert_int_equal(k_advance_lens(d_l, d_rs, d_rn, 5, 0, 4, 0), 0);
    int32_t out[10];
    gu_download(out, d_l, sizeof out);
    int32_t want[10] = {6, 1, 7, 2, 3, 0, 11, 3, 4, 4};
    for (int i = 0; i < 10; i++) assert_int_equal(out[i], want[i]);
    cudaFree(d_l); cudaFree(d_rs); cudaFree(d_rn);
}

/* --kv-cache-dtype fp8: the KV writer stores e4m3(x / scale) (rotary, q/k norm, bias) and
 * every attention kernel k_attention picks -- the decode forms, the tiled SIMT kernel,
 * tensor cores, flash-decoding splits with and without the in-kernel merge, sliding
 * windows, head_dim 256 -- reads codes times the layer's K and V scales (0.37, 1.9 here:
 * not powers of two, so a scale applied twice or not at all shows). */
static void test_kv_fp8_writes_and_attention_match_reference(void **state) {
    g_kv_fp8 = 1;
    test_qkv_rope_writes_q_and_paged_kv(state);
    test_attention_decode_rows_match_reference(state);
    test_attention_verify_rows_are_causal_among_new_tokens(state);
    test_attention_prefill_chunks_match_reference(state);
    test_attention_sliding_window_matches_reference(state);
    test_attention_decode_split_counters_merge_in_kernel(state);
    test_attention_decode_tc_matches_reference(state);
    test_attention_tc_chunk_on_existing_context_matches_reference(state);
    test_attention_tc_rows_of_different_lengths_match_reference(state);
    g_kv_fp8 = 0;
}

/* argv[1], when given: run only the tests whose names match this cmocka filter pattern
 * (for compute-sanitizer runs of one part). */
int main(int argc, char **argv) {
    if (argc > 1) cmocka_set_test_filter(argv[1]);
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        printf("gpu kernel tests: skipped (no GPU)\n");
        return 77;
    }
    g_rng = gu_seed();
    printf("gpu kernel tests: seed %llu\n", (unsigned long long)g_rng);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_embed_copies_exact_rows),
        cmocka_unit_test(test_rmsnorm_gathered_rows_match_reference),
        cmocka_unit_test(test_rmsnorm_q8_equals_rmsnorm_then_quant_x8),
        cmocka_unit_test(test_gated_mul_q8_equals_gated_mul_then_quant_x8),
        cmocka_unit_test(test_rmsnorm_fp8_equals_rescale_norm_then_quant),
        cmocka_unit_test(test_gated_mul_fp8q_equals_gated_mul_then_quant),
        cmocka_unit_test(test_qkv_rope_fp8_equals_rescale_then_rope),
        cmocka_unit_test(test_silu_mul_matches_reference),
        cmocka_unit_test(test_qkv_rope_writes_q_and_paged_kv),
        cmocka_unit_test(test_rope_attention_equals_two_launches),
        cmocka_unit_test(test_attention_decode_rows_match_reference),
        cmocka_unit_test(test_attention_verify_rows_are_causal_among_new_tokens),
        cmocka_unit_test(test_attention_prefill_chunks_match_reference),
        cmocka_unit_test(test_attention_sliding_window_matches_reference),
        cmocka_unit_test(test_mask_logits_keeps_exactly_the_masked_ids),
        cmocka_unit_test(test_attention_decode_split_counters_merge_in_kernel),
        cmocka_unit_test(test_attention_decode_pipe_same_bits),
        cmocka_unit_test(test_attention_decode_tc_matches_reference),
        cmocka_unit_test(test_attention_x8_equals_attention_then_quant_x8),
        cmocka_unit_test(test_attention_tc_prefill_from_empty_context_matches_reference),
        cmocka_unit_test(test_attention_tc_chunk_on_existing_context_matches_reference),
        cmocka_unit_test(test_attention_tc_rows_of_different_lengths_match_reference),
        cmocka_unit_test(test_attention_tc_verify_rows_match_reference),
        cmocka_unit_test(test_attention_tc_writes_only_its_items),
        cmocka_unit_test(test_attention_tc_clamps_keys_at_pool_capacity),
        cmocka_unit_test(test_attention_tc_rejects_unsupported_shapes),
        cmocka_unit_test(test_kv_fp8_writes_and_attention_match_reference),
        cmocka_unit_test(test_gemv_matches_reference),
        cmocka_unit_test(test_moe_decode_launches_match_reference),
        cmocka_unit_test(test_moe_decode_one_launch),
        cmocka_unit_test(test_moe_general_path_matches_reference),
        cmocka_unit_test(test_philox_matches_known_answer),
        cmocka_unit_test(test_sample_matches_reference_draws),
        cmocka_unit_test(test_sample_hist_aggregated_same_results),
        cmocka_unit_test(test_sample_vec_same_results),
        cmocka_unit_test(test_sample_same_seed_same_token_other_counter_varies),
        cmocka_unit_test(test_logit_adjust_equals_host_penalties),
        cmocka_unit_test(test_sample_adjusted_matches_host_and_reports_raw_logprobs),
        cmocka_unit_test(test_sample_forced_rows_match_host),
        cmocka_unit_test(test_sample_masked_rows_report_raw_logprobs),
        cmocka_unit_test(test_sample_counts_fed_token),
        cmocka_unit_test(test_advance_lens_skips_dummy_rows),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
