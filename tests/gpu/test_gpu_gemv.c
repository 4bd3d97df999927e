/* The decode GEMVs of kernels/gemv.cu. Random inputs fresh each run (SPECD_TEST_SEED
 * replays), outputs poisoned with NaN (0xff bytes) so an unwritten element fails, and a
 * guard zone after each output that must stay poisoned.
 * - k_gemv_gated_bf16: bf16(silu(gate) * up) against a double reference.
 * - k_gemv_qkv_rope: against the unfused path it replaces (k_gemv_bf16 into fp32, then
 *   k_qkv_rope_kv) on a copy of the same paged pool: q must match, the two pools must
 *   agree everywhere within 1 bf16 ulp (so no stray writes and no missed ones).
 * - the rejections the header promises (n > 2, in % 8, misaligned pointers, odd D).
 * - the plain GEMV (PDL launch path) for n = 1..8, and at batch 1-2 on projection shapes
 *   whose rows are split over several warps (split-K), accumulating and not.
 * - the RMSNorm fold: a producer GEMV's residual, bf16(h * g) and sum of h^2 against the
 *   host; consumers (plain, gated, rope) scaling by rsqrt(mean + eps) against the host and
 *   against the unfused path.
 * - k_gemv_q / k_dequant_q (GGUF blocks read in place: Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K)
 *   against the host decode, every type
 *   and token count, unaligned row starts; then a printed timing of k_gemv_q at batch 1
 *   (GB/s of weight bytes) next to k_gemv_bf16 on the same shapes.
 * - k_embed_q (the token embedding in its blocks) element for element against the host
 *   decode rounded to bf16.
 * - k_gemm_q (the same blocks on tensor cores, more token rows) against the host decode
 *   rounded to bf16, split and not; a printed timing next to dequantize + cuBLAS and
 *   cuBLAS on bf16 at 8B projection shapes.
 * - FP8 weights (k_wmat with row scales): the plain, accumulating, gated and norm-folded
 *   GEMVs for n = 1..8 against a double reference on the exact E4M3 values; the device
 *   quantizer k_quant_fp8_rows byte for byte against the host's fp8_quantize_row; a
 *   printed batch-1 timing next to bf16 on the same shape. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "kernels/specd_kernels.h"
#include "kernels/quant_blocks.h"
#include "engine/model/fp8.h"
#include "tests/gpu/gpu_util.h"
#include <cublas_v2.h>

#define GUARD 64   /* poisoned elements after every output */

static uint64_t g_seed;

static void fill(float *x, size_t n, float lo, float hi) {
    for (size_t i = 0; i < n; i++) x[i] = gu_uniform(&g_seed, lo, hi);
}

static void fill_bf(uint16_t *x, size_t n, float lo, float hi) {
    for (size_t i = 0; i < n; i++) x[i] = gu_f2bf(gu_uniform(&g_seed, lo, hi));
}

static double dot(const uint16_t *w, const float *x, int in) {
    double s = 0;
    for (int j = 0; j < in; j++) s += (double)gu_bf2f(w[j]) * x[j];
    return s;
}

static double dot_bf(const uint16_t *w, const uint16_t *x, int in) {
    double s = 0;
    for (int j = 0; j < in; j++) s += (double)gu_bf2f(w[j]) * gu_bf2f(x[j]);
    return s;
}

/* Distance in bf16 ulps between two bit patterns (sign-magnitude to a monotone integer). */
static int bf_ulps(uint16_t a, uint16_t b) {
    int ia = (a & 0x8000) ? -(int)(a & 0x7fff) : (int)a;
    int ib = (b & 0x8000) ? -(int)(b & 0x7fff) : (int)b;
    return abs(ia - ib);
}

/* ---- k_gemv_gated_bf16 --------------------------------------------------------------- */

static void check_gated(int F, int in, int n) {
    const size_t nw = (size_t)2 * F * in, na = (size_t)n * F;
    uint16_t *W = malloc(nw * 2), *X = malloc((size_t)n * in * 2), *A = malloc((na + GUARD) * 2);
    fill_bf(W, nw, -0.05f, 0.05f);
    fill_bf(X, (size_t)n * in, -1.f, 1.f);
    uint16_t *dW = gu_upload(W, nw * 2), *dX = gu_upload(X, (size_t)n * in * 2);
    uint16_t *dA = gu_dev((na + GUARD) * 2);
    assert_int_equal(k_gemv_gated_bf16(dW, dX, dA, F, in, n, NULL, 0), 0);
    gu_download(A, dA, (na + GUARD) * 2);
    double me = 0, mr = 0;
    int bad = 0, guard = 0;
    for (int b = 0; b < n; b++)
        for (int o = 0; o < F; o++) {
            double g = dot_bf(W + (size_t)o * in, X + (size_t)b * in, in);
            double u = dot_bf(W + (size_t)(F + o) * in, X + (size_t)b * in, in);
            double ref = g / (1.0 + exp(-g)) * u, got = gu_bf2f(A[(size_t)b * F + o]);
            if (isnan(got)) bad++;
            me = fmax(me, fabs(got - ref));
            mr = fmax(mr, fabs(ref));
        }
    for (size_t i = na; i < na + GUARD; i++) guard += A[i] != 0xffff;
    double rel = bad ? INFINITY : me / (mr > 0 ? mr : 1);
    printf("  gemv_gated F %d in %d n %d: rel err %.2e, unwritten %d, guard hits %d\n", F, in, n, rel, bad, guard);
    assert_int_equal(bad, 0);
    assert_true(rel < 8e-3);   /* output rounded to bf16 */
    assert_int_equal(guard, 0);
    cudaFree(dW), cudaFree(dX), cudaFree(dA);
    free(W), free(X), free(A);
}

static void test_gemv_gated_matches_silu_of_gate_times_up(void **state) {
    (void)state;
    check_gated(14336, 4096, 1);   /* Llama-3.1-8B gate|up */
    check_gated(8192, 2048, 2);    /* Llama-3.2-1B gate|up, two rows */
    check_gated(172, 128, 1);      /* a tiny model's ffn, F not a multiple of 8 */
    check_gated(172, 128, 2);
    check_gated(1536, 576, 5);     /* SmolLM2 gate|up, a verify step of 5 tokens */
    check_gated(8192, 2048, 8);
}

/* ---- k_gemv_qkv_rope ----------------------------------------------------------------- */

#define NSLOT 4     /* live slots; slot NSLOT is the dummy */
#define MAXBLK 48   /* blocks per slot: 768 positions with 16-token blocks */

/* A paged pool (one layer of several, shuffled block tables) in two identical device
 * copies: [0] for the fused kernel, [1] for the unfused path. */
typedef struct {
    int KVH, D, bs, max_blocks, nblocks, n;
    size_t block_elems, layer_off, pool_n;
    int32_t bt[(NSLOT + 1) * MAXBLK], lens[(NSLOT + 1) * 2];
    uint16_t *init;
    uint16_t *d_pool[2], **d_pp[2];
    int32_t *d_bt, *d_lens, *d_ts, *d_tj;
} kvpool;

static void pool_setup(kvpool *p, int KVH, int D, int n, const int32_t *slots, const int32_t *tok_j) {
    memset(p, 0, sizeof *p);
    p->KVH = KVH, p->D = D, p->bs = 16, p->max_blocks = MAXBLK, p->n = n;
    p->nblocks = 1 + NSLOT * MAXBLK;
    const int n_layers = 3, layer = 2;
    p->block_elems = (size_t)n_layers * 2 * KVH * p->bs * D;
    p->layer_off = (size_t)layer * 2 * KVH * p->bs * D;
    p->pool_n = (size_t)p->nblocks * p->block_elems;
    int ids[NSLOT * MAXBLK];
    for (int i = 0; i < NSLOT * MAXBLK; i++) ids[i] = i + 1;
    for (int i = NSLOT * MAXBLK - 1; i > 0; i--) {
        int j = (int)(gu_next(&g_seed) % (uint64_t)(i + 1)), t = ids[i];
        ids[i] = ids[j], ids[j] = t;
    }
    for (int s = 0; s < NSLOT; s++) {
        for (int b = 0; b < MAXBLK; b++) p->bt[s * MAXBLK + b] = ids[s * MAXBLK + b];
        /* positions ~500-700 so the rotation matters; draft lengths differ from target */
        p->lens[s * 2] = 500 + (int)(gu_next(&g_seed) % 200);
        p->lens[s * 2 + 1] = 450 + (int)(gu_next(&g_seed) % 200);
    }
    for (int b = 0; b < MAXBLK; b++) p->bt[NSLOT * MAXBLK + b] = 0;
    p->lens[NSLOT * 2] = p->lens[NSLOT * 2 + 1] = 0;
    p->init = malloc(p->pool_n * 2);
    fill_bf(p->init, p->pool_n, -1.5f, 1.5f);   /* a live pool: other tokens' K/V */
    for (int i = 0; i < 2; i++) {
        p->d_pool[i] = gu_upload(p->init, p->pool_n * 2);
        p->d_pp[i] = gu_upload(&p->d_pool[i], sizeof(void *));
    }
    p->d_bt = gu_upload(p->bt, sizeof p->bt);
    p->d_lens = gu_upload(p->lens, sizeof p->lens);
    p->d_ts = gu_upload(slots, sizeof(int32_t) * n);
    p->d_tj = gu_upload(tok_j, sizeof(int32_t) * n);
}

static k_kv_geom pool_geom(const kvpool *p, int i, int which) {
    k_kv_geom g = {.tok_slot = p->d_ts, .tok_j = p->d_tj, .lens = p->d_lens, .which = which,
                   .bt = p->d_bt, .max_blocks = p->max_blocks, .block_size = p->bs,
                   .pool_pp = p->d_pp[i], .block_elems = p->block_elems, .layer_off = p->layer_off};
    return g;
}

static void pool_free(kvpool *p) {
    for (int i = 0; i < 2; i++) cudaFree(p->d_pool[i]), cudaFree(p->d_pp[i]);
    cudaFree(p->d_bt), cudaFree(p->d_lens), cudaFree(p->d_ts), cudaFree(p->d_tj);
    free(p->init);
}

/* nin_ss: device sums of squares for the norm fold (both paths scale by them), or NULL. */
static void check_qkv_rope(int H, int KVH, int D, int in, int n, int with_bias, float theta, int which,
                           const int32_t *slots, const int32_t *tok_j, const unsigned long long *nin_ss) {
    kvpool p;
    pool_setup(&p, KVH, D, n, slots, tok_j);
    const int rows = (H + 2 * KVH) * D;
    const size_t nq = (size_t)n * H * D;
    uint16_t *W = malloc((size_t)rows * in * 2), *X = malloc((size_t)n * in * 2);
    float *bias = malloc(sizeof(float) * rows), *inv = malloc(sizeof(float) * (D / 2));
    fill_bf(W, (size_t)rows * in, -0.05f, 0.05f);
    fill_bf(X, (size_t)n * in, -1.f, 1.f);
    fill(bias, rows, -0.5f, 0.5f);
    for (int i = 0; i < D / 2; i++) inv[i] = powf(theta, -2.f * i / D);
    uint16_t *dW = gu_upload(W, (size_t)rows * in * 2), *dX = gu_upload(X, (size_t)n * in * 2);
    float *dB = with_bias ? gu_upload(bias, sizeof(float) * rows) : NULL;
    float *dI = gu_upload(inv, sizeof(float) * (D / 2));
    float *dQ[2] = {gu_dev(sizeof(float) * (nq + GUARD)), gu_dev(sizeof(float) * (nq + GUARD))};
    float *dQKV = gu_dev(sizeof(float) * (size_t)n * rows);
    k_kv_geom g0 = pool_geom(&p, 0, which), g1 = pool_geom(&p, 1, which);

    const k_norm_in nin = {.ss = nin_ss, .eps = 1e-5f};
    assert_int_equal(k_gemv_qkv_rope(dW, dX, dB, dI, dQ[0], n, H, KVH, D, in, &g0, nin_ss ? &nin : NULL, 0), 0);
    assert_int_equal(k_gemv_norm_bf16(dW, dX, dQKV, rows, in, n, 0, nin_ss ? &nin : NULL, NULL, 0), 0);
    assert_int_equal(k_qkv_rope_kv(dQKV, dB, NULL, NULL, dI, 1e-6f, dQ[1], n, H, KVH, D, &g1, 0), 0);

    float *q[2];
    uint16_t *pool[2];
    for (int i = 0; i < 2; i++) {
        q[i] = malloc(sizeof(float) * (nq + GUARD));
        pool[i] = malloc(p.pool_n * 2);
        gu_download(q[i], dQ[i], sizeof(float) * (nq + GUARD));
        gu_download(pool[i], p.d_pool[i], p.pool_n * 2);
    }
    double me = 0, mr = 0;
    int nan_q = 0, guard = 0;
    for (size_t i = 0; i < nq; i++) {
        if (isnan(q[0][i]) || isnan(q[1][i])) nan_q++;
        me = fmax(me, fabs((double)q[0][i] - q[1][i]));
        mr = fmax(mr, fabs((double)q[1][i]));
    }
    for (size_t i = nq; i < nq + GUARD; i++) guard += !isnan(q[0][i]);
    double rel = nan_q ? INFINITY : me / (mr > 0 ? mr : 1);
    /* Pools: equal everywhere up to 1 ulp; the unfused path wrote n * KVH * D * 2. */
    size_t far = 0, one_ulp = 0, written = 0;
    for (size_t i = 0; i < p.pool_n; i++) {
        int u = bf_ulps(pool[0][i], pool[1][i]);
        far += u > 1;
        one_ulp += u == 1;
        written += pool[1][i] != p.init[i];
    }
    printf("  qkv_rope H %d KVH %d D %d in %d n %d bias %d which %d norm %d: q rel err %.2e, pool: %zu at "
           "1 ulp, %zu beyond (reference wrote %zu of %zu)\n", H, KVH, D, in, n, with_bias, which, nin_ss != NULL,
           rel, one_ulp, far, written, (size_t)n * KVH * D * 2);
    assert_int_equal(nan_q, 0);
    assert_true(rel < 1e-4);   /* same fp32 products, maybe summed in another order */
    assert_int_equal(guard, 0);
    assert_int_equal(far, 0);
    assert_true(written > (size_t)n * KVH * D);   /* the comparison covered real writes */
    cudaFree(dW), cudaFree(dX), cudaFree(dB), cudaFree(dI), cudaFree(dQ[0]), cudaFree(dQ[1]), cudaFree(dQKV);
    for (int i = 0; i < 2; i++) free(q[i]), free(pool[i]);
    free(W), free(X), free(bias), free(inv);
    pool_free(&p);
}

static void test_gemv_qkv_rope_matches_gemv_then_qkv_rope_kv(void **state) {
    (void)state;
    const int32_t s1[1] = {2}, j1[1] = {0};
    const int32_t s2[2] = {3, 0}, j2[2] = {0, 1};
    const int32_t ss[2] = {1, 1}, js[2] = {0, 1};
    check_qkv_rope(32, 8, 64, 2048, 1, 0, 500000.f, 0, s1, j1, NULL);    /* Llama-3.2-1B, batch 1 */
    check_qkv_rope(12, 2, 128, 1536, 2, 1, 1000000.f, 0, s2, j2, NULL);  /* Qwen2.5-1.5B, two slots */
    check_qkv_rope(32, 8, 64, 2048, 2, 1, 500000.f, 1, ss, js, NULL);    /* one slot's two draft tokens */
    check_qkv_rope(12, 2, 128, 1536, 1, 1, 1000000.f, 1, s1, j1, NULL);
    /* a verify step: one slot's last token and four drafts, and two slots of four tokens */
    const int32_t s5[5] = {1, 1, 1, 1, 1}, j5[5] = {0, 1, 2, 3, 4};
    const int32_t s8[8] = {0, 0, 0, 0, 3, 3, 3, 3}, j8[8] = {0, 1, 2, 3, 0, 1, 2, 3};
    check_qkv_rope(32, 8, 64, 2048, 5, 0, 500000.f, 0, s5, j5, NULL);
    check_qkv_rope(12, 2, 128, 1536, 8, 1, 1000000.f, 0, s8, j8, NULL);
    /* with the norm fold: sums of squares far from 1 so a missing or wrong scale shows */
    const unsigned long long hss[2] = {(unsigned long long)(2048.0 * 37.0 * (1ull << K_SS_FRAC_BITS)),
                                       (unsigned long long)(1536.0 * 0.02 * (1ull << K_SS_FRAC_BITS))};
    unsigned long long *d_ss = gu_upload(hss, sizeof hss);
    check_qkv_rope(32, 8, 64, 2048, 1, 0, 500000.f, 0, s1, j1, d_ss);
    check_qkv_rope(12, 2, 128, 1536, 2, 1, 1000000.f, 0, s2, j2, d_ss);
    cudaFree(d_ss);
    unsigned long long h5[5];
    for (int i = 0; i < 5; i++) h5[i] = (unsigned long long)(2048.0 * (0.5 + 9.0 * i) * (1ull << K_SS_FRAC_BITS));
    d_ss = gu_upload(h5, sizeof h5);
    check_qkv_rope(32, 8, 64, 2048, 5, 0, 500000.f, 0, s5, j5, d_ss);
    cudaFree(d_ss);
}

/* ---- rejections ---------------------------------------------------------------------- */

static void test_fused_gemvs_reject_what_they_cannot_do(void **state) {
    (void)state;
    uint16_t *d = gu_dev(1 << 22);
    float *f = gu_dev(1 << 22);
    /* k_gemv_gated_bf16 */
    assert_int_equal(k_gemv_gated_bf16(d, d + 65536, d + 131072, 64, 64, K_GEMV_FUSED_MAX_N + 1, NULL, 0), -1);
    assert_int_equal(k_gemv_gated_bf16(d, d + 65536, d + 131072, 64, 100, 1, NULL, 0), -1);
    assert_int_equal(k_gemv_gated_bf16(d + 1, d + 65536, d + 131072, 64, 64, 1, NULL, 0), -1);
    assert_int_equal(k_gemv_gated_bf16(d, d + 65537, d + 131072, 64, 64, 1, NULL, 0), -1);
    const k_norm_in no_ss = {.ss = NULL, .eps = 1e-5f};
    assert_int_equal(k_gemv_gated_bf16(d, d + 65536, d + 131072, 64, 64, 1, &no_ss, 0), -1);
    /* k_gemv_norm_bf16: the fold needs n <= K_GEMV_FUSED_MAX_N, accumulate, and every pointer */
    unsigned long long *u = (unsigned long long *)(f + 65536);
    const k_norm_out nout = {.g = f, .xg = d + 131072, .ss = u}, nout_nog = {.xg = d + 131072, .ss = u};
    assert_int_equal(k_gemv_norm_bf16(d, d + 65536, f + 1024, 64, 64, K_GEMV_FUSED_MAX_N + 1, 1, NULL, &nout, 0), -1);
    assert_int_equal(k_gemv_norm_bf16(d, d + 65536, f + 1024, 64, 64, 1, 0, NULL, &nout, 0), -1);
    assert_int_equal(k_gemv_norm_bf16(d, d + 65536, f + 1024, 64, 64, 1, 1, NULL, &nout_nog, 0), -1);
    assert_int_equal(k_gemv_norm_bf16(d, d + 65536, f + 1024, 64, 64, 1, 0, &no_ss, NULL, 0), -1);
    /* k_gemv_qkv_rope, on a valid pool so that a launch that should not happen is harmless */
    kvpool p;
    const int32_t sl[3] = {0, 1, 2}, tj[3] = {0, 0, 0};
    pool_setup(&p, 2, 64, 3, sl, tj);
    k_kv_geom g = pool_geom(&p, 0, 0);
    assert_int_equal(k_gemv_qkv_rope(d, d + 1048576, NULL, f, f + 65536, K_GEMV_FUSED_MAX_N + 1, 4, 2, 64, 64, &g, NULL, 0), -1);
    assert_int_equal(k_gemv_qkv_rope(d, d + 1048576, NULL, f, f + 65536, 1, 4, 2, 64, 100, &g, NULL, 0), -1);
    assert_int_equal(k_gemv_qkv_rope(d, d + 1048576, NULL, f, f + 65536, 1, 4, 2, 63, 64, &g, NULL, 0), -1);
    assert_int_equal(k_gemv_qkv_rope(d + 1, d + 1048576, NULL, f, f + 65536, 1, 4, 2, 64, 64, &g, NULL, 0), -1);
    assert_int_equal(k_gemv_qkv_rope(d, d + 1048576, NULL, f, f + 65536, 1, 4, 2, 64, 64, &g, &no_ss, 0), -1);
    GPU_CHECK(cudaDeviceSynchronize());
    pool_free(&p);
    cudaFree(d), cudaFree(f);
}

/* ---- plain GEMV ---------------------------------------------------------------------- */

static void test_plain_gemv_all_row_counts(void **state) {
    (void)state;
    const int out = 1000, in = 1024;
    uint16_t *W = malloc((size_t)out * in * 2), *X = malloc((size_t)8 * in * 2);
    for (size_t i = 0; i < (size_t)out * in; i++) W[i] = gu_f2bf(gu_uniform(&g_seed, -0.1f, 0.1f));
    for (size_t i = 0; i < (size_t)8 * in; i++) X[i] = gu_f2bf(gu_uniform(&g_seed, -1.f, 1.f));
    float *xf = malloc(sizeof(float) * 8 * in), *Y = malloc(sizeof(float) * 8 * out);
    for (size_t i = 0; i < (size_t)8 * in; i++) xf[i] = gu_bf2f(X[i]);
    void *dW = gu_upload(W, (size_t)out * in * 2), *dX = gu_upload(X, (size_t)8 * in * 2);
    for (int n = 1; n <= 8; n++) {
        void *dY = gu_dev(sizeof(float) * 8 * out);
        assert_int_equal(k_gemv_bf16(dW, dX, dY, out, in, n, 0, 0), 0);
        gu_download(Y, dY, sizeof(float) * 8 * out);
        double me = 0, mr = 0;
        for (int b = 0; b < n; b++)
            for (int o = 0; o < out; o++) {
                double ref = dot(W + (size_t)o * in, xf + (size_t)b * in, in);
                assert_false(isnan(Y[(size_t)b * out + o]));
                me = fmax(me, fabs(Y[(size_t)b * out + o] - ref));
                mr = fmax(mr, fabs(ref));
            }
        for (size_t i = (size_t)n * out; i < (size_t)8 * out; i++) assert_true(isnan(Y[i]));
        assert_true(me / mr < 2e-4);
        cudaFree(dY);
    }
    cudaFree(dW), cudaFree(dX);
    free(W), free(X), free(xf), free(Y);
}

/* Batch 1-2 on projection shapes (8B O / down, 1B O / down, an odd row count): the launcher
 * splits each row over 2-8 warps here, whose partial sums must add up exactly once, in
 * both the overwrite and the accumulate forms. */
static void check_plain_split(int out, int in, int n, int accumulate) {
    uint16_t *W = malloc((size_t)out * in * 2), *X = malloc((size_t)n * in * 2);
    fill_bf(W, (size_t)out * in, -0.05f, 0.05f);
    fill_bf(X, (size_t)n * in, -1.f, 1.f);
    const size_t guard = 64, outn = (size_t)n * out;
    float *y0 = malloc(sizeof(float) * (outn + guard)), *Y = malloc(sizeof(float) * (outn + guard));
    void *dW = gu_upload(W, (size_t)out * in * 2), *dX = gu_upload(X, (size_t)n * in * 2);
    void *dY = gu_dev(sizeof(float) * (outn + guard));   /* NaN-poisoned */
    if (accumulate) {
        fill(y0, outn, -1.f, 1.f);
        GPU_CHECK(cudaMemcpy(dY, y0, sizeof(float) * outn, cudaMemcpyHostToDevice));
    }
    assert_int_equal(k_gemv_bf16(dW, dX, dY, out, in, n, accumulate, 0), 0);
    gu_download(Y, dY, sizeof(float) * (outn + guard));
    double me = 0, mr = 0;
    for (int b = 0; b < n; b++)
        for (int o = 0; o < out; o++) {
            double ref = dot_bf(W + (size_t)o * in, X + (size_t)b * in, in) + (accumulate ? y0[(size_t)b * out + o] : 0.0);
            double got = Y[(size_t)b * out + o];
            assert_false(isnan(got));
            me = fmax(me, fabs(got - ref));
            mr = fmax(mr, fabs(ref));
        }
    for (size_t i = outn; i < outn + guard; i++) assert_true(isnan(Y[i]));
    printf("  split gemv out %d in %d n %d acc %d: rel err %.2e\n", out, in, n, accumulate, me / mr);
    assert_true(me / mr < 2e-4);
    cudaFree(dW), cudaFree(dX), cudaFree(dY);
    free(W), free(X), free(y0), free(Y);
}

static void test_plain_gemv_split_k_projection_shapes(void **state) {
    (void)state;
    check_plain_split(4096, 4096, 1, 1);    /* Llama-3.1-8B O projection into the residual */
    check_plain_split(4096, 14336, 1, 1);   /* 8B down */
    check_plain_split(2048, 2048, 2, 0);    /* Llama-3.2-1B O, two rows */
    check_plain_split(2048, 8192, 2, 1);    /* 1B down */
    check_plain_split(299, 2048, 1, 0);     /* rows not a multiple of the units per block */
}

/* ---- the RMSNorm fold -------------------------------------------------------------- */

/* Producer: h = h0 + Wp . xp (n rows of `hidden`), xg = bf16(h * g), ss += sum h^2; then
 * consumers on xg with rsqrt(ss / hidden + eps): the plain GEMV (the Qwen3 QKV) against
 * rs * (Wc . xg), the gated one against silu(rs * gate) * (rs * up), both from the device's
 * own xg and a double sum of the device's h (xg itself is checked bit for bit). */
static void check_norm_fold(int hidden, int in_p, int F, int n) {
    const float eps = 1e-5f;
    const size_t nh = (size_t)n * hidden;
    uint16_t *Wp = malloc((size_t)hidden * in_p * 2), *Xp = malloc((size_t)n * in_p * 2);
    uint16_t *Wc = malloc((size_t)2 * F * hidden * 2), *xg = malloc((nh + GUARD) * 2);
    uint16_t *A = malloc(((size_t)n * F + GUARD) * 2);
    float *h0 = malloc(sizeof(float) * nh), *h = malloc(sizeof(float) * nh), *g = malloc(sizeof(float) * hidden);
    float *Y = malloc(sizeof(float) * ((size_t)n * F + GUARD));
    unsigned long long ss[K_GEMV_FUSED_MAX_N + 2], ss2[K_GEMV_FUSED_MAX_N + 2];
    fill_bf(Wp, (size_t)hidden * in_p, -0.05f, 0.05f);
    fill_bf(Xp, (size_t)n * in_p, -1.f, 1.f);
    fill_bf(Wc, (size_t)2 * F * hidden, -0.05f, 0.05f);
    fill(h0, nh, -3.f, 3.f);
    fill(g, hidden, 0.5f, 1.5f);
    uint16_t *dWp = gu_upload(Wp, (size_t)hidden * in_p * 2), *dXp = gu_upload(Xp, (size_t)n * in_p * 2);
    uint16_t *dWc = gu_upload(Wc, (size_t)2 * F * hidden * 2), *dxg = gu_dev((nh + GUARD) * 2);
    uint16_t *dA = gu_dev(((size_t)n * F + GUARD) * 2);
    float *dh = gu_upload(h0, sizeof(float) * nh), *dg = gu_upload(g, sizeof(float) * hidden);
    float *dY = gu_dev(sizeof(float) * ((size_t)n * F + GUARD));
    unsigned long long *dss = gu_dev(sizeof ss);
    GPU_CHECK(cudaMemset(dss, 0, sizeof ss));

    const k_norm_out nout = {.g = dg, .xg = dxg, .ss = dss};
    assert_int_equal(k_gemv_norm_bf16(dWp, dXp, dh, hidden, in_p, n, 1, NULL, &nout, 0), 0);
    gu_download(h, dh, sizeof(float) * nh);
    gu_download(xg, dxg, (nh + GUARD) * 2);
    gu_download(ss, dss, sizeof ss);
    double me = 0, mr = 0;
    int xg_bad = 0, guard = 0;
    for (int b = 0; b < n; b++) {
        double sq = 0;
        for (int o = 0; o < hidden; o++) {
            const size_t i = (size_t)b * hidden + o;
            const double ref = h0[i] + dot_bf(Wp + (size_t)o * in_p, Xp + (size_t)b * in_p, in_p);
            assert_false(isnan(h[i]));
            me = fmax(me, fabs(h[i] - ref));
            mr = fmax(mr, fabs(ref));
            xg_bad += xg[i] != gu_f2bf(h[i] * g[o]);
            sq += (double)h[i] * h[i];
        }
        const double ss_rel = fabs(K_SS_VALUE(ss[b]) - sq) / sq;
        printf("  norm fold hidden %d in %d n %d row %d: sum h^2 %.6e vs %.6e (rel %.1e)\n", hidden, in_p, n, b,
               K_SS_VALUE(ss[b]), sq, ss_rel);
        assert_true(ss_rel < 1e-5);
    }
    for (int b = n; b < K_GEMV_FUSED_MAX_N + 2; b++) assert_true(ss[b] == 0);   /* rows past n untouched */
    /* The sums must not depend on the order the blocks finish in: the same launch again
     * (from the same residual) gives the same bits, every time. */
    int differ = 0;
    for (int rep = 0; rep < 20; rep++) {
        GPU_CHECK(cudaMemcpy(dh, h0, sizeof(float) * nh, cudaMemcpyHostToDevice));
        GPU_CHECK(cudaMemset(dss, 0, sizeof ss2));
        assert_int_equal(k_gemv_norm_bf16(dWp, dXp, dh, hidden, in_p, n, 1, NULL, &nout, 0), 0);
        gu_download(ss2, dss, sizeof ss2);
        differ += memcmp(ss, ss2, sizeof ss) != 0;
    }
    printf("  norm fold: %d of 20 repeats changed the sums\n", differ);
    assert_int_equal(differ, 0);
    for (size_t i = nh; i < nh + GUARD; i++) guard += xg[i] != 0xffff;
    printf("  norm fold producer: residual rel err %.2e, xg mismatches %d, guard hits %d\n", me / mr, xg_bad, guard);
    assert_true(me / mr < 2e-4);
    assert_int_equal(xg_bad, 0);
    assert_int_equal(guard, 0);

    const k_norm_in nin = {.ss = dss, .eps = eps};
    assert_int_equal(k_gemv_norm_bf16(dWc, dxg, dY, F, hidden, n, 0, &nin, NULL, 0), 0);
    assert_int_equal(k_gemv_gated_bf16(dWc, dxg, dA, F, hidden, n, &nin, 0), 0);
    gu_download(Y, dY, sizeof(float) * ((size_t)n * F + GUARD));
    gu_download(A, dA, ((size_t)n * F + GUARD) * 2);
    double pe = 0, pr = 0, ge = 0, gr = 0;
    for (int b = 0; b < n; b++) {
        double sq = 0;
        for (int o = 0; o < hidden; o++) sq += (double)h[(size_t)b * hidden + o] * h[(size_t)b * hidden + o];
        const double rs = 1.0 / sqrt(sq / hidden + eps);
        for (int o = 0; o < F; o++) {
            const double gate = rs * dot_bf(Wc + (size_t)o * hidden, xg + (size_t)b * hidden, hidden);
            const double up = rs * dot_bf(Wc + (size_t)(F + o) * hidden, xg + (size_t)b * hidden, hidden);
            const double act = gate / (1.0 + exp(-gate)) * up;
            const double py = Y[(size_t)b * F + o], ga = gu_bf2f(A[(size_t)b * F + o]);
            assert_false(isnan(py) || isnan(ga));
            pe = fmax(pe, fabs(py - gate)), pr = fmax(pr, fabs(gate));
            ge = fmax(ge, fabs(ga - act)), gr = fmax(gr, fabs(act));
        }
    }
    guard = 0;
    for (size_t i = (size_t)n * F; i < (size_t)n * F + GUARD; i++) guard += !isnan(Y[i]) + (A[i] != 0xffff);
    printf("  norm fold consumers F %d: plain rel err %.2e, gated rel err %.2e, guard hits %d\n", F, pe / pr, ge / gr,
           guard);
    assert_true(pe / pr < 2e-4);
    assert_true(ge / gr < 8e-3);   /* output rounded to bf16 */
    assert_int_equal(guard, 0);
    cudaFree(dWp), cudaFree(dXp), cudaFree(dWc), cudaFree(dxg), cudaFree(dA), cudaFree(dh), cudaFree(dg);
    cudaFree(dY), cudaFree(dss);
    free(Wp), free(Xp), free(Wc), free(xg), free(A), free(h0), free(h), free(g), free(Y);
}

static void test_norm_fold_matches_rmsnorm_then_gemv(void **state) {
    (void)state;
    check_norm_fold(4096, 4096, 1536, 1);   /* 8B O into the residual, then a gate|up slice */
    check_norm_fold(2048, 8192, 1024, 2);   /* 1B down, two rows */
    check_norm_fold(296, 128, 172, 1);      /* rows not a multiple of the units per block */
    check_norm_fold(576, 1536, 576, 5);     /* SmolLM2 down, a verify step of 5 tokens */
    check_norm_fold(2048, 8192, 1024, 8);
}

/* ---- GEMV over quantized blocks (kernels/gemv_q.cu) ------------------------------------- */

/* A random finite half scale of magnitude ~2^-10..2^-6 (realistic block scales). */
static void put_scale(uint8_t *p) {
    uint16_t h = (uint16_t)((5 + gu_next(&g_seed) % 4) << 10 | (gu_next(&g_seed) & 0x3ff));
    if (gu_next(&g_seed) & 1) h |= 0x8000;
    p[0] = (uint8_t)h, p[1] = (uint8_t)(h >> 8);
}

/* Random blocks of type t: random bytes with realistic half scales. */
static void random_blocks(int t, uint8_t *W, size_t bytes) {
    const int S = qb_bytes(t);
    for (size_t i = 0; i < bytes; i++) W[i] = (uint8_t)gu_next(&g_seed);
    for (size_t b = 0; b < bytes / S; b++) {
        uint8_t *blk = W + b * S;
        if (t == QB_Q8_0 || t == QB_Q4_0) put_scale(blk);
        if (t == QB_Q4_K || t == QB_Q5_K || t == QB_Q4_1) put_scale(blk), put_scale(blk + 2);
        if (t == QB_Q6_K) put_scale(blk + 208);
    }
}

/* A quantized product to check: random blocks of type t (out rows of `in` elements), n
 * random token rows, a random prior Y for accumulation, and the reference: a double dot of
 * the host decode (quant_blocks.h, checked against ggml_dequantize by
 * tests/test_quant_blocks.c), each weight first rounded to bf16 when bf16w. */
typedef struct {
    int t, out, in, n;
    size_t wbytes, outn;
    uint8_t *W;
    uint16_t *X;
    float *y0, *Y;
    double *ref;
    void *dW, *dX;
} qprob;


static qprob qprob_make(int t, int out, int in, int n, int bf16w) {
    const int E = qb_elems(t), S = qb_bytes(t);
    qprob q = {.t = t, .out = out, .in = in, .n = n, .wbytes = (size_t)out * (in / E) * S, .outn = (size_t)n * out};
    q.W = malloc(q.wbytes);
    random_blocks(t, q.W, q.wbytes);
    q.X = malloc((size_t)n * in * 2);
    fill_bf(q.X, (size_t)n * in, -1.f, 1.f);
    float *w = malloc(sizeof(float) * (size_t)in);
    q.y0 = malloc(sizeof(float) * q.outn);
    q.Y = malloc(sizeof(float) * (q.outn + GUARD));
    q.ref = malloc(sizeof(double) * q.outn);
    for (int o = 0; o < out; o++) {
        for (int k = 0; k < in; k += 8) qb_decode8(t, q.W + ((size_t)o * (in / E) + k / E) * S, k % E, w + k);
        for (int k = 0; bf16w && k < in; k++) w[k] = gu_bf2f(gu_f2bf(w[k]));
        for (int b = 0; b < n; b++) {
            double acc = 0;
            for (int k = 0; k < in; k++) acc += (double)w[k] * gu_bf2f(q.X[(size_t)b * in + k]);
            q.ref[(size_t)b * out + o] = acc;
        }
    }
    free(w);
    fill(q.y0, q.outn, -1.f, 1.f);
    q.dW = gu_upload(q.W, q.wbytes);
    q.dX = gu_upload(q.X, (size_t)n * in * 2);
    return q;
}

static void qprob_free(qprob *q) {
    cudaFree(q->dW), cudaFree(q->dX);
    free(q->W), free(q->X), free(q->y0), free(q->Y), free(q->ref);
}

/* A NaN-poisoned output for one run (the prior Y in it when accumulating). */
static float *qprob_out(const qprob *q, int accumulate) {
    float *dY = gu_dev(sizeof(float) * (q->outn + GUARD));
    if (accumulate) GPU_CHECK(cudaMemcpy(dY, q->y0, sizeof(float) * q->outn, cudaMemcpyHostToDevice));
    return dY;
}

/* The run's output against the reference (plus the prior Y when accumulating): every
 * element written, the guard untouched, max error / max |reference| below 1e-4; frees
 * dY and returns that relative error. */
static double qprob_check(qprob *q, float *dY, int accumulate, const char *what) {
    gu_download(q->Y, dY, sizeof(float) * (q->outn + GUARD));
    cudaFree(dY);
    double me = 0, mr = 0;
    for (size_t i = 0; i < q->outn; i++) {
        double r = q->ref[i] + (accumulate ? q->y0[i] : 0.0);
        assert_false(isnan(q->Y[i]));
        me = fmax(me, fabs(q->Y[i] - r));
        mr = fmax(mr, fabs(r));
    }
    for (size_t i = q->outn; i < q->outn + GUARD; i++) assert_true(isnan(q->Y[i]));
    printf("  %s type %d out %d in %d n %d acc %d: rel err %.2e\n", what, q->t, q->out, q->in, q->n, accumulate,
           me / mr);
    assert_true(me / mr < 1e-4);
    return me / mr;
}

/* k_gemv_q, overwrite and accumulate, against the host decode; then k_dequant_q's bf16
 * copy element for element against the host decode rounded to bf16. */
static void check_gemv_q(int t, int out, int in, int n) {
    qprob q = qprob_make(t, out, in, n, 0);
    for (int accumulate = 0; accumulate < 2; accumulate++) {
        float *dY = qprob_out(&q, accumulate);
        assert_int_equal(k_gemv_q(t, q.dW, q.dX, dY, out, in, n, accumulate, 0), 0);
        qprob_check(&q, dY, accumulate, "gemv_q");
    }
    const int E = qb_elems(t), S = qb_bytes(t);
    uint16_t *dB = gu_dev((size_t)out * in * 2), *B = malloc((size_t)out * in * 2);
    float *w = malloc(sizeof(float) * (size_t)in);
    assert_int_equal(k_dequant_q(t, q.dW, dB, out, in, 0), 0);
    gu_download(B, dB, (size_t)out * in * 2);
    long bad = 0;
    for (int o = 0; o < out; o++) {
        for (int k = 0; k < in; k += 8) qb_decode8(t, q.W + ((size_t)o * (in / E) + k / E) * S, k % E, w + k);
        for (int k = 0; k < in; k++) bad += B[(size_t)o * in + k] != gu_f2bf(w[k]);
    }
    assert_int_equal(bad, 0);
    cudaFree(dB), free(B), free(w);
    qprob_free(&q);
}

static void test_gemv_q_matches_host_decode(void **state) {
    (void)state;
    check_gemv_q(QB_Q4_K, 2048, 2048, 1);   /* a 1B projection at batch 1 */
    check_gemv_q(QB_Q6_K, 2048, 8192, 2);   /* 1B down (Q4_K_M keeps some in Q6_K) */
    check_gemv_q(QB_Q8_0, 1000, 1024, 5);
    check_gemv_q(QB_Q4_K, 300, 512, 8);     /* rows not a multiple of the warps per block */
    check_gemv_q(QB_Q6_K, 77, 256, 3);
    check_gemv_q(QB_Q4_0, 2048, 2048, 1);   /* Q4_0 / Q4_1 files (SmolLM2's is Q4_1) */
    check_gemv_q(QB_Q4_1, 576, 1536, 2);    /* SmolLM2 down */
    check_gemv_q(QB_Q5_K, 2048, 8192, 1);   /* Q5_K_M */
    /* rejected: rows not whole blocks, too many tokens, an unsupported type, unaligned X or W */
    uint8_t *d = gu_dev(1 << 20);
    float *f = gu_dev(1 << 20);
    assert_int_equal(k_gemv_q(QB_Q4_K, d, (uint16_t *)(d + 65536), f, 8, 200, 1, 0, 0), -1);
    assert_int_equal(k_gemv_q(QB_Q8_0, d, (uint16_t *)(d + 65536), f, 8, 64, 9, 0, 0), -1);
    assert_int_equal(k_gemv_q(6, d, (uint16_t *)(d + 65536), f, 8, 64, 1, 0, 0), -1);   /* Q5_0 */
    assert_int_equal(k_gemv_q(QB_Q8_0, d, (uint16_t *)(d + 65538), f, 8, 64, 1, 0, 0), -1);
    assert_int_equal(k_gemv_q(QB_Q8_0, d + 2, (uint16_t *)(d + 65536), f, 8, 64, 1, 0, 0), -1);
    cudaFree(d), cudaFree(f);
}

/* k_embed_q: each token's row of a table kept in its blocks, decoded and rounded to bf16,
 * element for element what k_embed gives over the table dequantized to bf16 at load (the
 * host decode rounded to nearest even); ids outside the vocabulary read row 0; nothing
 * written past the n rows. */
static void check_embed_q(int t, int vocab, int hidden) {
    qprob q = qprob_make(t, vocab, hidden, 1, 0);
    const int E = qb_elems(t), S = qb_bytes(t), n = 7;
    int32_t ids[7] = {vocab - 1, 0, vocab / 2, -3, vocab, vocab / 2, 1 % vocab};
    int32_t *dids = gu_upload(ids, sizeof ids);
    float *dO = gu_dev(sizeof(float) * ((size_t)n * hidden + GUARD)), *O = malloc(sizeof(float) * ((size_t)n * hidden + GUARD));
    float *w = malloc(sizeof(float) * (size_t)hidden);
    assert_int_equal(k_embed_q(t, q.dW, dids, dO, n, hidden, vocab, 0), 0);
    gu_download(O, dO, sizeof(float) * ((size_t)n * hidden + GUARD));
    long bad = 0;
    for (int i = 0; i < n; i++) {
        const int id = ids[i] < 0 || ids[i] >= vocab ? 0 : ids[i];
        for (int k = 0; k < hidden; k += 8) qb_decode8(t, q.W + ((size_t)id * (hidden / E) + k / E) * S, k % E, w + k);
        for (int k = 0; k < hidden; k++) bad += O[(size_t)i * hidden + k] != gu_bf2f(gu_f2bf(w[k]));
    }
    for (size_t i = (size_t)n * hidden; i < (size_t)n * hidden + GUARD; i++) assert_true(isnan(O[i]));
    printf("  embed_q type %d vocab %d hidden %d: %ld of %d elements differ\n", t, vocab, hidden, bad, n * hidden);
    assert_int_equal(bad, 0);
    cudaFree(dids), cudaFree(dO), free(O), free(w);
    qprob_free(&q);
}

static void test_embed_q_matches_host_decode(void **state) {
    (void)state;
    const int types[6] = {QB_Q8_0, QB_Q4_K, QB_Q6_K, QB_Q4_0, QB_Q4_1, QB_Q5_K};
    for (int i = 0; i < 6; i++) check_embed_q(types[i], 1000, 2048);
    check_embed_q(QB_Q4_1, 4099, 576);    /* SmolLM2's width: 18 blocks, rows at odd 20-byte offsets */
    check_embed_q(QB_Q6_K, 517, 768);     /* 210-byte blocks: rows at every even offset mod 16 */
    check_embed_q(QB_Q8_0, 333, 4096 + 32);
    uint8_t *d = gu_dev(1 << 16);
    float *f = gu_dev(1 << 16);
    assert_int_equal(k_embed_q(QB_Q4_K, d, (int32_t *)d, f, 1, 200, 10, 0), -1);   /* not whole blocks */
    assert_int_equal(k_embed_q(6, d, (int32_t *)d, f, 1, 256, 10, 0), -1);         /* Q5_0: not read */
    assert_int_equal(k_embed_q(QB_Q4_K, d, (int32_t *)d, f, 0, 256, 10, 0), 0);    /* nothing to do */
    cudaFree(d), cudaFree(f);
}

/* Every type at every token count (overwrite and accumulate inside check_gemv_q), on odd
 * row counts and rows that are not whole 1024-element steps; Q8_0 rows of 3 blocks (102
 * bytes) and Q6_K rows of 3 or 10 blocks (630, 2100 bytes) start at every even offset mod
 * 16, and their matrices end inside a 16-byte word (the zero-filled last copy). The
 * larger shapes split K over 2-4 warps with a partial last step. */
static void every_type_and_token_count(void);

/* k_gemv_q's rows per warp (k_tuning.gemvq_rows), the other switches at their defaults
 * (as this test runs them). */
static void set_gemvq_rows(int rows) {
    k_tuning t = k_tuning_default;
    t.gemvq_rows = rows;
    k_set_tuning(&t);
}

/* ... at 2 rows per warp (SPECD_CUDA_GEMVQ_ROWS=2) and at 4 (the default). */
static void test_gemv_q_every_type_and_token_count(void **state) {
    (void)state;
    set_gemvq_rows(2);
    every_type_and_token_count();
    set_gemvq_rows(4);
    printf("  -- rows per warp 4\n");
    every_type_and_token_count();
    set_gemvq_rows(k_tuning_default.gemvq_rows);
}

static void every_type_and_token_count(void) {
    const int types[6] = {QB_Q8_0, QB_Q4_K, QB_Q6_K, QB_Q4_0, QB_Q4_1, QB_Q5_K};
    for (int i = 0; i < 6; i++)
        for (int n = 1; n <= K_GEMV_MAX_N; n++) check_gemv_q(types[i], 37 + 2 * n, qb_elems(types[i]) == 32 ? 96 : 768, n);
    check_gemv_q(QB_Q4_0, 257, 4160, 3);   /* 18-byte blocks: rows start at every even offset */
    check_gemv_q(QB_Q4_1, 129, 3328, 8);
    check_gemv_q(QB_Q5_K, 333, 2560, 5);
    check_gemv_q(QB_Q6_K, 333, 2560, 1);
    check_gemv_q(QB_Q6_K, 333, 2560, 7);
    check_gemv_q(QB_Q8_0, 257, 4160, 1);
    check_gemv_q(QB_Q8_0, 257, 4160, 4);
    check_gemv_q(QB_Q4_K, 129, 3328, 2);
    check_gemv_q(QB_Q4_K, 1, 256, 1);       /* one row: the warp's second row is past out */
}

/* k_gemv_qtc (the tensor-core GEMV over K-quant blocks), overwrite and accumulate, against
 * the host decode (exact codes, fp32 sums: the same 1e-4 bound as k_gemv_q). */
static void check_gemv_qtc(int t, int out, int in, int n) {
    qprob q = qprob_make(t, out, in, n, 0);
    for (int accumulate = 0; accumulate < 2; accumulate++) {
        float *dY = qprob_out(&q, accumulate);
        assert_int_equal(k_gemv_qtc(t, q.dW, q.dX, dY, out, in, n, accumulate, 0), 0);
        qprob_check(&q, dY, accumulate, "gemv_qtc");
    }
    qprob_free(&q);
}

/* Every K-quant type and Q8_0 at every token count 1..16 (a warp's 8 rows, tokens 8..15 in the
 * mma's upper half) on row counts that are not a multiple of 8; one block a row; rows of
 * Q6_K's 210-byte blocks starting at every even offset; split K over 2 and 4 warps with a
 * partial last step; a 1B down and an 8B-wide row. Then what it refuses. */
static void test_gemv_qtc_matches_host_decode(void **state) {
    (void)state;
    const int types[4] = {QB_Q4_K, QB_Q5_K, QB_Q6_K, QB_Q8_0};
    for (int i = 0; i < 4; i++) {
        for (int n = 1; n <= K_GEMV_QTC_MAX_N; n++) check_gemv_qtc(types[i], 37 + 2 * n, 768, n);
        check_gemv_qtc(types[i], 1, 256, 1);       /* one row: seven of the warp's rows past out */
        check_gemv_qtc(types[i], 333, 2560, 5);    /* 10 blocks (Q8_0: 80): partial steps */
        check_gemv_qtc(types[i], 129, 3328, 12);
    }
    check_gemv_qtc(QB_Q4_K, 2048, 8192, 1);   /* 1B down at batch 1 */
    check_gemv_qtc(QB_Q6_K, 2048, 8192, 8);
    check_gemv_qtc(QB_Q4_K, 4096, 14336, 16); /* 8B down */
    /* Q8_0: rows of 3 and 130 blocks (102, 4420 bytes) start at every even offset mod 16;
     * a row of one block; 8B down at 8 and 16 tokens */
    for (int n = 1; n <= K_GEMV_QTC_MAX_N; n += 5) check_gemv_qtc(QB_Q8_0, 41 + n, 96, n);
    check_gemv_qtc(QB_Q8_0, 257, 4160, 9);
    check_gemv_qtc(QB_Q8_0, 19, 32, 16);
    check_gemv_qtc(QB_Q8_0, 4096, 14336, 8);
    check_gemv_qtc(QB_Q8_0, 4096, 14336, 16);
    assert_int_equal(k_gemv_qtc_takes(QB_Q8_0), 1);
    assert_int_equal(k_gemv_qtc_takes(QB_Q4_K), 1);
    assert_int_equal(k_gemv_qtc_takes(QB_Q4_0), 0);
    uint8_t *d = gu_dev(1 << 20);
    float *f = gu_dev(1 << 20);
    assert_int_equal(k_gemv_qtc(QB_Q4_0, d, (uint16_t *)(d + 65536), f, 8, 256, 1, 0, 0), -1);   /* not taken */
    assert_int_equal(k_gemv_qtc(QB_Q4_K, d, (uint16_t *)(d + 65536), f, 8, 200, 1, 0, 0), -1);   /* not whole blocks */
    assert_int_equal(k_gemv_qtc(QB_Q4_K, d, (uint16_t *)(d + 65536), f, 8, 256, 17, 0, 0), -1);  /* too many tokens */
    assert_int_equal(k_gemv_qtc(QB_Q4_K, d, (uint16_t *)(d + 65536), f, 8, 256, 0, 0, 0), -1);
    assert_int_equal(k_gemv_qtc(QB_Q6_K, d, (uint16_t *)(d + 65538), f, 8, 256, 1, 0, 0), -1);   /* X unaligned */
    assert_int_equal(k_gemv_qtc(QB_Q6_K, d + 2, (uint16_t *)(d + 65536), f, 8, 256, 1, 0, 0), -1);
    cudaFree(d), cudaFree(f);
}

/* k_gemv_qi8 (int8 activations): the reference rounds X as the kernel is specified to
 * (per 32 elements d = max |x| / 127, codes x * (127 / max |x|) to nearest even) and
 * dots the host decode with d * code in double, so the only difference left is fp32
 * scaling and summation order: the same 1e-4 bound as k_gemv_q. Against the unrounded
 * activations the error is the int8 rounding's: printed, and bounded by 2e-2 of the
 * largest sum |w x| (a wrong scale or code would be of order 1). */
/* mode 0: k_gemv_qi8; 1: k_gemm_qi8 with the least scratch (no split); 2: k_gemm_qi8 with
 * room for split partial sums */
static void check_qi8(int t, int out, int in, int n, int mode) {
    qprob q = qprob_make(t, out, in, n, 0);
    const int E = qb_elems(t), S = qb_bytes(t);
    double *ref8 = malloc(sizeof(double) * q.outn), *sabs = malloc(sizeof(double) * q.outn);
    float *xr = malloc(sizeof(float) * (size_t)n * in), *w = malloc(sizeof(float) * (size_t)in);
    for (int b = 0; b < n; b++)
        for (int k0 = 0; k0 < in; k0 += 32) {
            const uint16_t *x = q.X + (size_t)b * in + k0;
            float a = 0.f;
            for (int e = 0; e < 32; e++) a = fmaxf(a, fabsf(gu_bf2f(x[e])));
            const float id = a > 0.f ? 127.f / a : 0.f, d = a / 127.f;
            for (int e = 0; e < 32; e++) xr[(size_t)b * in + k0 + e] = d * (float)lrintf(gu_bf2f(x[e]) * id);
        }
    for (int o = 0; o < out; o++) {
        for (int k = 0; k < in; k += 8) qb_decode8(t, q.W + ((size_t)o * (in / E) + k / E) * S, k % E, w + k);
        for (int b = 0; b < n; b++) {
            double acc = 0, aa = 0;
            for (int k = 0; k < in; k++) {
                acc += (double)w[k] * xr[(size_t)b * in + k];
                aa += fabs((double)w[k] * gu_bf2f(q.X[(size_t)b * in + k]));
            }
            ref8[(size_t)b * out + o] = acc, sabs[(size_t)b * out + o] = aa;
        }
    }
    const size_t sb = k_gemv_qi8_scratch(in, n) + (mode == 2 ? 16 * q.outn * sizeof(float) + 16 : 0);
    void *dS = gu_dev(sb);
    for (int accumulate = 0; accumulate < 2; accumulate++) {
        float *dY = qprob_out(&q, accumulate);
        if (mode) assert_int_equal(k_gemm_qi8(t, q.dW, q.dX, dY, out, in, n, accumulate, dS, sb, 0), 0);
        else assert_int_equal(k_gemv_qi8(t, q.dW, q.dX, dY, out, in, n, accumulate, dS, sb, 0), 0);
        gu_download(q.Y, dY, sizeof(float) * (q.outn + GUARD));
        cudaFree(dY);
        double me = 0, mr = 0, me0 = 0, mr0 = 0;
        for (size_t i = 0; i < q.outn; i++) {
            const double y0 = accumulate ? q.y0[i] : 0.0;
            assert_false(isnan(q.Y[i]));
            me = fmax(me, fabs(q.Y[i] - (ref8[i] + y0))), mr = fmax(mr, fabs(ref8[i] + y0));
            me0 = fmax(me0, fabs(q.Y[i] - (q.ref[i] + y0))), mr0 = fmax(mr0, sabs[i]);
        }
        for (size_t i = q.outn; i < q.outn + GUARD; i++) assert_true(isnan(q.Y[i]));
        printf("  %s type %d out %d in %d n %d acc %d: rel err %.2e against the int8-rounded X, %.2e against X\n",
               mode == 2 ? "gemm_qi8 (split)" : mode ? "gemm_qi8" : "gemv_qi8", t, out, in, n, accumulate, me / mr,
               me0 / mr0);
        assert_true(me / mr < 1e-4);
        assert_true(me0 / mr0 < 2e-2);
    }
    cudaFree(dS);
    free(ref8), free(sabs), free(xr), free(w);
    qprob_free(&q);
}

/* Every type at every token count, on rows that start at every even offset mod 16 (34-,
 * 18-, 20-, 210-byte blocks), split K over warps with partial steps, an all-zero token row
 * (its scale 0), 8B shapes; then what it refuses. */
static void test_gemv_qi8_matches_host(void **state) {
    (void)state;
    const int types[6] = {QB_Q8_0, QB_Q4_0, QB_Q4_1, QB_Q4_K, QB_Q5_K, QB_Q6_K};
    for (int i = 0; i < 6; i++) {
        const int E = qb_elems(types[i]);
        for (int n = 1; n <= K_GEMV_MAX_N; n++) check_qi8(types[i], 37 + 2 * n, E == 32 ? 96 : 768, n, 0);
        check_qi8(types[i], 257, E == 32 ? 4160 : 2560, 3, 0);   /* split K, partial steps */
        check_qi8(types[i], 1, E, 1, 0);
    }
    check_qi8(QB_Q8_0, 4096, 14336, 8, 0);
    check_qi8(QB_Q4_K, 14336, 4096, 2, 0);   /* 8B gate, down */
    check_qi8(QB_Q6_K, 4096, 14336, 5, 0);
    check_qi8(QB_Q4_1, 576, 1536, 5, 0);     /* SmolLM2 down */
    {   /* a token row of zeros between two others */
        qprob q = qprob_make(QB_Q8_0, 300, 512, 3, 0);
        memset(q.X + 512, 0, 512 * 2);
        GPU_CHECK(cudaMemcpy(q.dX, q.X, (size_t)3 * 512 * 2, cudaMemcpyHostToDevice));
        const size_t sb = k_gemv_qi8_scratch(512, 3);
        void *dS = gu_dev(sb);
        float *dY = qprob_out(&q, 0);
        assert_int_equal(k_gemv_qi8(QB_Q8_0, q.dW, q.dX, dY, 300, 512, 3, 0, dS, sb, 0), 0);
        gu_download(q.Y, dY, sizeof(float) * q.outn);
        for (int o = 0; o < 300; o++) assert_true(q.Y[300 + o] == 0.f);
        for (int o = 0; o < 300; o++) assert_false(isnan(q.Y[o]) || isnan(q.Y[600 + o]));
        cudaFree(dS), cudaFree(dY);
        qprob_free(&q);
    }
    uint8_t *d = gu_dev(1 << 20);
    float *f = gu_dev(1 << 20);
    const size_t sb = k_gemv_qi8_scratch(256, 8);
    assert_int_equal(k_gemv_qi8_takes(QB_Q4_K), 1);
    assert_int_equal(k_gemv_qi8_takes(6), 0);   /* Q5_0: not read in place */
    assert_int_equal(k_gemv_qi8(6, d, (uint16_t *)(d + 65536), f, 8, 256, 1, 0, d + 131072, sb, 0), -1);
    assert_int_equal(k_gemv_qi8(QB_Q4_K, d, (uint16_t *)(d + 65536), f, 8, 224, 1, 0, d + 131072, sb, 0), -1);
    assert_int_equal(k_gemv_qi8(QB_Q8_0, d, (uint16_t *)(d + 65536), f, 8, 256, 9, 0, d + 131072, sb, 0), -1);
    assert_int_equal(k_gemv_qi8(QB_Q8_0, d, (uint16_t *)(d + 65536), f, 8, 256, 8, 0, d + 131072, sb - 1, 0), -1);
    assert_int_equal(k_gemv_qi8(QB_Q8_0, d, (uint16_t *)(d + 65536), f, 8, 256, 8, 0, d + 131080, sb, 0), -1);
    assert_int_equal(k_gemv_qi8(QB_Q8_0, d, (uint16_t *)(d + 65536), f, 8, 256, 8, 0, NULL, sb, 0), -1);
    assert_int_equal(k_gemv_qi8(QB_Q8_0, d, (uint16_t *)(d + 65536), f, 8, 200, 1, 0, d + 131072, sb, 0), -1);
    cudaFree(d), cudaFree(f);
}

/* k_tuning.gemvq_stream (2: the streaming form gemv_qs_kernel for every shape and token
 * count, 1: where it pays, 0: never) and gemvq_rows_q6k, the other switches at their
 * defaults. */
static void set_stream(int on, int rows_q6k) {
    k_tuning t = k_tuning_default;
    t.gemvq_stream = on;
    t.gemvq_rows_q6k = rows_q6k;
    k_set_tuning(&t);
}

/* Row 0 of k_gemv_qi8's output for n = 1..8 tokens (X's row 0 the same each time) is bit
 * for bit the same, and a second call gives the same bits: the cut of the work between
 * warps depends on the shape only. Returns how many outputs differed. */
static long stream_invariance(int t, int out, int in) {
    qprob q = qprob_make(t, out, in, K_GEMV_MAX_N, 0);
    const size_t sb = k_gemv_qi8_scratch(in, K_GEMV_MAX_N);
    void *dS = gu_dev(sb);
    float *dY = gu_dev(sizeof(float) * q.outn), *y1 = malloc(sizeof(float) * out), *y = malloc(sizeof(float) * out);
    long bad = 0;
    for (int n = 1; n <= K_GEMV_MAX_N + 1; n++) {   /* the last pass: n = 1 again */
        const int nn = n > K_GEMV_MAX_N ? 1 : n;
        assert_int_equal(k_gemv_qi8(t, q.dW, q.dX, dY, out, in, nn, 0, dS, sb, 0), 0);
        gu_download(n == 1 ? y1 : y, dY, sizeof(float) * out);
        if (n > 1)
            for (int o = 0; o < out; o++) bad += memcmp(&y[o], &y1[o], sizeof(float)) != 0;
    }
    printf("  gemv_qs type %d out %d in %d: row 0 at 2..8 tokens and again at 1: %ld of %d outputs differ\n", t, out,
           in, bad, out * K_GEMV_MAX_N);
    cudaFree(dS), cudaFree(dY), free(y1), free(y);
    qprob_free(&q);
    return bad;
}

/* The streaming form against the host, as the unit-per-warp form is checked above: every
 * type and token count with bf16 and int8 activations; units cut between the warps of a
 * block (8B gate|up and down: 13-14 units of 4-14 steps per block), a block of one unit
 * whose steps are spread over all eight warps (8 and 5 rows of 14336), a grid smaller than
 * the blocks per SM; Q6_K at 2 rows per warp; then the same bits at every token count. */
static void test_gemv_q_stream_matches_host(void **state) {
    (void)state;
    set_stream(2, 0);
    every_type_and_token_count();
    const int types[6] = {QB_Q8_0, QB_Q4_0, QB_Q4_1, QB_Q4_K, QB_Q5_K, QB_Q6_K};
    for (int i = 0; i < 6; i++) {
        const int E = qb_elems(types[i]);
        for (int n = 1; n <= K_GEMV_MAX_N; n++) check_qi8(types[i], 37 + 2 * n, E == 32 ? 96 : 768, n, 0);
        check_qi8(types[i], 257, E == 32 ? 4160 : 2560, 3, 0);
        check_qi8(types[i], 1, E, 1, 0);
        check_qi8(types[i], 8, 14336, 2, 0);
    }
    check_qi8(QB_Q6_K, 5, 14336, 1, 0);
    check_qi8(QB_Q4_K, 28672, 4096, 1, 0);   /* 8B gate|up, down */
    check_qi8(QB_Q4_K, 4096, 14336, 3, 0);
    check_qi8(QB_Q6_K, 4096, 14336, 8, 0);
    check_qi8(QB_Q4_1, 576, 1536, 5, 0);     /* SmolLM2 down */
    set_stream(2, 2);
    printf("  -- Q6_K at 2 rows per warp\n");
    check_qi8(QB_Q6_K, 4096, 14336, 1, 0);
    check_qi8(QB_Q6_K, 333, 2560, 7, 0);
    check_qi8(QB_Q6_K, 5, 14336, 4, 0);
    check_gemv_q(QB_Q6_K, 333, 2560, 5);
    long bad = stream_invariance(QB_Q6_K, 4096, 14336);
    set_stream(2, 0);
    bad += stream_invariance(QB_Q4_K, 14336, 4096) + stream_invariance(QB_Q6_K, 1024, 4096) +
           stream_invariance(QB_Q8_0, 8, 14336) + stream_invariance(QB_Q4_1, 576, 1536);
    k_set_tuning(&k_tuning_default);
    assert_int_equal(bad, 0);
}

/* A matrix in two types (Q4_K_M's Q|K in Q4_K, V in Q6_K): the _ld forms of k_gemv_q,
 * k_gemv_qi8, k_gemv_qtc and k_gemm_q write each part's columns of one [n, rows1 + rows2]
 * output (row stride ldy), bit for bit what the one-type call gives for that part alone,
 * every element written, the guard past the output untouched; accumulating adds to what
 * was there (as the one-type call adds to the same values); the int8 call with x_ready reuses the codes the first part's call left in
 * scratch; k_gemm_q's split reduction (a workspace) writes through the stride too. */
static const char *const two_type_kind[4] = {"gemv_q", "gemv_qi8", "gemv_qtc", "gemm_q"};

static int two_type_call(int kind, int ld, int t, const uint8_t *W, const uint16_t *X, float *Y, int ldy, int out,
                         int in, int n, int acc, void *dS, size_t sb, int x_ready) {
    if (!ld) ldy = out;
    switch (kind) {
    case 0: return ld ? k_gemv_q_ld(t, W, X, Y, ldy, out, in, n, acc, 0) : k_gemv_q(t, W, X, Y, out, in, n, acc, 0);
    case 1:
        return ld ? k_gemv_qi8_ld(t, W, X, Y, ldy, out, in, n, acc, dS, sb, x_ready, 0)
                  : k_gemv_qi8(t, W, X, Y, out, in, n, acc, dS, sb, 0);
    case 2: return ld ? k_gemv_qtc_ld(t, W, X, Y, ldy, out, in, n, acc, 0) : k_gemv_qtc(t, W, X, Y, out, in, n, acc, 0);
    default:
        return ld ? k_gemm_q_ld(t, W, X, Y, ldy, out, in, n, acc, dS, sb, 0)
                  : k_gemm_q(t, W, X, Y, out, in, n, acc, dS, sb, 0);
    }
}

static void check_gemv_q_two_types(int t1, int rows1, int t2, int rows2, int in, int n) {
    qprob a = qprob_make(t1, rows1, in, n, 0), b = qprob_make(t2, rows2, in, n, 0);
    GPU_CHECK(cudaMemcpy(b.dX, a.dX, (size_t)n * in * 2, cudaMemcpyDeviceToDevice));   /* one X for both */
    const int ldy = rows1 + rows2;
    const size_t tot = (size_t)n * ldy;
    size_t sb = k_gemv_qi8_scratch(in, n);
    if (sb < 16 * tot * sizeof(float)) sb = 16 * tot * sizeof(float);   /* k_gemm_q's split partials */
    void *dS = gu_dev(sb);
    float *part[2] = {malloc(sizeof(float) * a.outn), malloc(sizeof(float) * b.outn)};
    float *y0 = malloc(sizeof(float) * tot), *Y = malloc(sizeof(float) * (tot + GUARD));
    fill(y0, tot, -1.f, 1.f);
    for (int kind = 0; kind < 4; kind++) {
        if (kind < 2 && n > K_GEMV_MAX_N) continue;
        if (kind == 2 && (n > K_GEMV_QTC_MAX_N || !k_gemv_qtc_takes(t1) || !k_gemv_qtc_takes(t2))) continue;
        for (int accumulate = 0; accumulate < 2; accumulate++) {
            for (int p = 0; p < 2; p++) {   /* each part alone (accumulating onto its columns of y0) */
                qprob *q = p ? &b : &a;
                float *dP = qprob_out(q, 0);
                if (accumulate) {
                    for (int t = 0; t < n; t++)
                        memcpy(part[p] + (size_t)t * q->out, y0 + (size_t)t * ldy + (p ? rows1 : 0),
                               sizeof(float) * q->out);
                    GPU_CHECK(cudaMemcpy(dP, part[p], sizeof(float) * q->outn, cudaMemcpyHostToDevice));
                }
                assert_int_equal(
                    two_type_call(kind, 0, q->t, q->dW, a.dX, dP, 0, q->out, in, n, accumulate, dS, sb, 0), 0);
                gu_download(part[p], dP, sizeof(float) * q->outn);
                cudaFree(dP);
            }
            float *dY = gu_dev(sizeof(float) * (tot + GUARD));   /* NaN-poisoned */
            if (accumulate) GPU_CHECK(cudaMemcpy(dY, y0, sizeof(float) * tot, cudaMemcpyHostToDevice));
            assert_int_equal(two_type_call(kind, 1, t1, a.dW, a.dX, dY, ldy, rows1, in, n, accumulate, dS, sb, 0), 0);
            assert_int_equal(two_type_call(kind, 1, t2, b.dW, a.dX, dY + rows1, ldy, rows2, in, n, accumulate, dS, sb, 1),
                             0);
            gu_download(Y, dY, sizeof(float) * (tot + GUARD));
            cudaFree(dY);
            long bad = 0;
            for (int t = 0; t < n; t++)
                for (int o = 0; o < ldy; o++) {
                    const float want = o < rows1 ? part[0][(size_t)t * rows1 + o] : part[1][(size_t)t * rows2 + o - rows1];
                    bad += !(Y[(size_t)t * ldy + o] == want);
                }
            for (size_t i = tot; i < tot + GUARD; i++) assert_true(isnan(Y[i]));
            printf("  %s, types %d | %d, rows %d | %d, in %d, n %d, acc %d: %ld of %zu differ\n", two_type_kind[kind],
                   t1, t2, rows1, rows2, in, n, accumulate, bad, tot);
            assert_int_equal(bad, 0);
        }
        /* a row stride below the part's rows is refused */
        assert_int_equal(two_type_call(kind, 1, t1, a.dW, a.dX, Y, rows1 - 1, rows1, in, n, 0, dS, sb, 0), -1);
    }
    cudaFree(dS);
    free(part[0]), free(part[1]), free(y0), free(Y);
    qprob_free(&a), qprob_free(&b);
}

static void test_gemv_q_two_types_one_output(void **state) {
    (void)state;
    check_gemv_q_two_types(QB_Q4_K, 5120, QB_Q6_K, 1024, 4096, 1);    /* the 8B shape's Q|K and V */
    check_gemv_q_two_types(QB_Q4_K, 5120, QB_Q6_K, 1024, 4096, 8);
    check_gemv_q_two_types(QB_Q4_K, 5120, QB_Q6_K, 1024, 4096, 16);
    check_gemv_q_two_types(QB_Q4_K, 5120, QB_Q6_K, 1024, 4096, 64);   /* tensor-core GEMM tiles */
    check_gemv_q_two_types(QB_Q4_K, 300, QB_Q6_K, 77, 512, 3);        /* rows not a multiple of a block's */
    check_gemv_q_two_types(QB_Q4_0, 96, QB_Q8_0, 40, 256, 5);
}

/* k_gemm_q (kernels/gemm_q.cu), overwrite and accumulate, with a workspace (the
 * reduction split where the tiles are few) and without, against the host decode rounded
 * to bf16 (as the kernel rounds each weight). Returns the worst relative error. */
static double check_gemm_q(int t, int out, int in, int n) {
    qprob q = qprob_make(t, out, in, n, 1);
    const size_t ws_bytes = 16 * q.outn * sizeof(float);
    float *dws = gu_dev(ws_bytes);
    double worst = 0;
    for (int with_ws = 0; with_ws < 2; with_ws++)
        for (int accumulate = 0; accumulate < 2; accumulate++) {
            float *dY = qprob_out(&q, accumulate);
            assert_int_equal(k_gemm_q(t, q.dW, q.dX, dY, out, in, n, accumulate, with_ws ? dws : NULL,
                                      with_ws ? ws_bytes : 0, 0), 0);
            worst = fmax(worst, qprob_check(&q, dY, accumulate, with_ws ? "gemm_q (workspace)" : "gemm_q"));
        }
    cudaFree(dws);
    qprob_free(&q);
    return worst;
}

/* Every type; token counts just past the GEMV's, one and several row tiles, a partial last
 * tile; columns not a multiple of the tile; a long reduction (split when a workspace is
 * given: 2048 columns make 32 tiles); rows of 18- and 34-byte blocks starting at every
 * even offset. Also the shapes k_gemm_q refuses. */
static void test_gemm_q_matches_host_decode(void **state) {
    (void)state;
    const int types[6] = {QB_Q8_0, QB_Q4_K, QB_Q6_K, QB_Q4_0, QB_Q4_1, QB_Q5_K};
    const int ns[5] = {9, 16, 33, 64, 100};
    for (int i = 0; i < 6; i++)
        for (int j = 0; j < 5; j++) check_gemm_q(types[i], 37 + 30 * j, qb_elems(types[i]) == 32 ? 96 : 768, ns[j]);
    check_gemm_q(QB_Q4_K, 2048, 8192, 16);   /* 1B down at a decode batch: split */
    check_gemm_q(QB_Q6_K, 2048, 8192, 64);
    check_gemm_q(QB_Q8_0, 2050, 4160, 9);    /* 130 blocks of 34 bytes a row */
    check_gemm_q(QB_Q4_0, 257, 4160, 200);
    check_gemm_q(QB_Q5_K, 576, 1536, 256);
    uint8_t *d = gu_dev(1 << 20);
    float *f = gu_dev(1 << 20);
    assert_int_equal(k_gemm_q(QB_Q4_K, d, (uint16_t *)(d + 65536), f, 8, 200, 16, 0, NULL, 0, 0), -1);   /* not whole blocks */
    assert_int_equal(k_gemm_q(6, d, (uint16_t *)(d + 65536), f, 8, 64, 16, 0, NULL, 0, 0), -1);          /* Q5_0 */
    assert_int_equal(k_gemm_q(QB_Q8_0, d, (uint16_t *)(d + 65538), f, 8, 64, 16, 0, NULL, 0, 0), -1);    /* X unaligned */
    assert_int_equal(k_gemm_q(QB_Q8_0, d, (uint16_t *)(d + 65536), f, 8, 64, 0, 0, NULL, 0, 0), -1);     /* no rows */
    cudaFree(d), cudaFree(f);
}

/* `copies` device copies of one [out, in] matrix of random blocks of `type`, to rotate so
 * that the L2 holds none between timed uses; returns its bytes. */
static size_t random_copies(int type, int out, int in, uint8_t **Q, int copies) {
    const size_t bytes = (size_t)out * (size_t)(in / qb_elems(type)) * (size_t)qb_bytes(type);
    uint8_t *h = malloc(bytes);
    random_blocks(type, h, bytes);
    for (int k = 0; k < copies; k++) Q[k] = gu_upload(h, bytes);
    free(h);
    return bytes;
}

/* SPECD_GEMV_BENCH=0 (under compute-sanitizer: timing is meaningless and slow) turns the
 * printed timings off; says so for report `what`. */
static int bench_off(const char *what) {
    const char *on = getenv("SPECD_GEMV_BENCH");
    if (!(on && !strcmp(on, "0"))) return 0;
    printf("  %s: not timed (SPECD_GEMV_BENCH=0)\n", what);
    return 1;
}

/* Mean microseconds of fn over rotating matrix copies, at least min_iters calls (two
 * passes, the first warms up). */
typedef void (*gq_fn)(void *ctx, const uint8_t *W);
static double time_copies(gq_fn fn, void *ctx, uint8_t *const *W, int copies, int min_iters) {
    cudaEvent_t a, b;
    GPU_CHECK(cudaEventCreate(&a));
    GPU_CHECK(cudaEventCreate(&b));
    const int iters = copies * (copies < min_iters ? (min_iters + copies - 1) / copies : 1);
    for (int pass = 0; pass < 2; pass++) {
        GPU_CHECK(cudaEventRecord(a, 0));
        for (int i = 0; i < iters; i++) fn(ctx, W[i % copies]);
        GPU_CHECK(cudaEventRecord(b, 0));
        GPU_CHECK(cudaEventSynchronize(b));
    }
    float ms = 0;
    GPU_CHECK(cudaEventElapsedTime(&ms, a, b));
    cudaEventDestroy(a), cudaEventDestroy(b);
    return 1e3 * ms / iters;
}

typedef struct {
    int type, out, in, n;
    const uint16_t *X;
    float *Y, *ws;
    size_t ws_bytes;
    uint16_t *scratch;
    cublasHandle_t blas;
} gq_ctx;

/* c's inputs at its shape for up to `rows` token rows: X random bf16 in [-1, 1), Y an output. */
static void gq_inputs(gq_ctx *c, int rows) {
    uint16_t *X = malloc((size_t)rows * c->in * 2);
    fill_bf(X, (size_t)rows * c->in, -1.f, 1.f);
    c->X = gu_upload(X, (size_t)rows * c->in * 2);
    c->Y = gu_dev(sizeof(float) * (size_t)rows * (size_t)c->out);
    free(X);
}

static void run_tc(void *p, const uint8_t *W) {
    gq_ctx *c = p;
    assert_int_equal(k_gemm_q(c->type, W, c->X, c->Y, c->out, c->in, c->n, 0, c->ws, c->ws_bytes, 0), 0);
}

static void blas_bf16(gq_ctx *c, const uint16_t *B) {
    const float alpha = 1.f, beta = 0.f;
    assert_int_equal(cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, c->out, c->n, c->in, &alpha, B, CUDA_R_16BF, c->in,
                                  c->X, CUDA_R_16BF, c->in, &beta, c->Y, CUDA_R_32F, c->out, CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT),
                     CUBLAS_STATUS_SUCCESS);
}

static void run_gemm_qi8(void *p, const uint8_t *W) {
    gq_ctx *c = p;
    assert_int_equal(k_gemm_qi8(c->type, W, c->X, c->Y, c->out, c->in, c->n, 0, c->ws, c->ws_bytes, 0), 0);
}

static void run_scratch(void *p, const uint8_t *W) {   /* the path k_gemm_q replaces */
    gq_ctx *c = p;
    assert_int_equal(k_dequant_q(c->type, W, c->scratch, c->out, c->in, 0), 0);
    blas_bf16(c, c->scratch);
}

static void run_bf16(void *p, const uint8_t *W) { blas_bf16(p, (const uint16_t *)W); }

/* A printed timing on Llama-3.1-8B projection shapes at decode batch sizes: k_gemm_q, the
 * dequantize + cuBLAS path it replaces, and cuBLAS on a bf16 matrix of the same shape. */
static void test_gemm_q_speed_report(void **state) {
    (void)state;
    if (bench_off("bench gemm_q")) return;
    const int shapes[3][2] = {{14336, 4096}, {4096, 14336}, {6144, 4096}};   /* gate, down, qkv (out, in) */
    const int types[3] = {QB_Q4_K, QB_Q6_K, QB_Q8_0}, ns[4] = {16, 64, 128, 256};
    gq_ctx c = {0};
    assert_int_equal(cublasCreate(&c.blas), CUBLAS_STATUS_SUCCESS);
    for (int si = 0; si < 3; si++) {
        c.out = shapes[si][0], c.in = shapes[si][1];
        gq_inputs(&c, 256);
        c.scratch = gu_dev((size_t)c.out * c.in * 2);
        c.ws = (float *)c.scratch, c.ws_bytes = (size_t)c.out * c.in * 2;
        const size_t bbytes = (size_t)c.out * c.in * 2;
        uint8_t *hb = malloc(bbytes), *B[4];
        for (size_t i = 0; i < bbytes / 2; i++) ((uint16_t *)hb)[i] = gu_f2bf(gu_uniform(&g_seed, -0.05f, 0.05f));
        for (int k = 0; k < 4; k++) B[k] = gu_upload(hb, bbytes);
        for (int ti = 0; ti < 3; ti++) {
            c.type = types[ti];
            uint8_t *Q[4];
            const size_t qbytes = random_copies(c.type, c.out, c.in, Q, 4);
            for (int ni = 0; ni < 4; ni++) {
                c.n = ns[ni];
                const double tc = time_copies(run_tc, &c, Q, 4, 50), sc = time_copies(run_scratch, &c, Q, 4, 50);
                const double bf = time_copies(run_bf16, &c, B, 4, 50);
                const double flops = 2.0 * c.n * c.out * c.in;
                printf("  bench gemm_q out %5d in %5d type %2d n %3d: tc %8.2f us (%5.1f TFLOP/s, %6.1f GB/s of blocks)"
                       "  dequant+cublas %8.2f us  bf16 cublas %8.2f us  tc/bf16 %.2fx",
                       c.out, c.in, c.type, c.n, tc, flops / (tc * 1e6), (double)qbytes / (tc * 1e3), sc, bf, tc / bf);
                for (int bps = 2; c.type == QB_Q8_0 && bps <= 16; bps *= 2) {   /* k_tuning.gemm_qi8_bps */
                    k_tuning kt = k_tuning_default;
                    kt.gemm_qi8_bps = bps;
                    k_set_tuning(&kt);
                    const double i8 = time_copies(run_gemm_qi8, &c, Q, 4, 50);
                    printf("  qi8 bps %2d %8.2f us (%6.1f GB/s, %.2fx)", bps, i8, (double)qbytes / (i8 * 1e3), sc / i8);
                }
                k_set_tuning(&k_tuning_default);
                printf("\n");
            }
            for (int k = 0; k < 4; k++) cudaFree(Q[k]);
        }
        for (int k = 0; k < 4; k++) cudaFree(B[k]);
        cudaFree((void *)c.X), cudaFree(c.Y), cudaFree(c.scratch);
        free(hb);
    }
    cublasDestroy(c.blas);
}

static void run_qtc(void *p, const uint8_t *W) {
    gq_ctx *c = p;
    assert_int_equal(k_gemv_qtc(c->type, W, c->X, c->Y, c->out, c->in, c->n, 0, 0), 0);
}

static void run_gemvq(void *p, const uint8_t *W) {
    gq_ctx *c = p;
    assert_int_equal(k_gemv_q(c->type, W, c->X, c->Y, c->out, c->in, c->n, 0, 0), 0);
}

/* A printed timing of k_gemv_qtc at 1-16 tokens on Llama-3.1-8B / 3.2-1B projection shapes
 * for the K-quant types and Q8_0, beside k_gemv_q (n <= 8), dequantize + cuBLAS and cuBLAS on a bf16
 * matrix of the same shape; bandwidth on the quantized bytes. 8 copies of each matrix
 * rotate, so the L2 holds none between uses. */
static void test_gemv_qtc_speed_report(void **state) {
    (void)state;
    if (bench_off("bench gemv_qtc")) return;
    const int shapes[4][2] = {{14336, 4096}, {4096, 14336}, {6144, 4096}, {2048, 8192}};
    const int types[4] = {QB_Q4_K, QB_Q6_K, QB_Q5_K, QB_Q8_0}, ns[5] = {1, 2, 4, 8, 16};
    enum { C = 8 };
    gq_ctx c = {0};
    assert_int_equal(cublasCreate(&c.blas), CUBLAS_STATUS_SUCCESS);
    for (int si = 0; si < 4; si++) {
        c.out = shapes[si][0], c.in = shapes[si][1];
        gq_inputs(&c, 16);
        c.scratch = gu_dev((size_t)c.out * c.in * 2);
        const size_t bbytes = (size_t)c.out * c.in * 2;
        uint8_t *hb = malloc(bbytes), *B[C];
        for (size_t i = 0; i < bbytes / 2; i++) ((uint16_t *)hb)[i] = gu_f2bf(gu_uniform(&g_seed, -0.05f, 0.05f));
        for (int k = 0; k < C; k++) B[k] = gu_upload(hb, bbytes);
        for (int ti = 0; ti < 4; ti++) {
            c.type = types[ti];
            uint8_t *Q[C];
            const size_t qbytes = random_copies(c.type, c.out, c.in, Q, C);
            for (int ni = 0; ni < 5; ni++) {
                c.n = ns[ni];
                const double tc = time_copies(run_qtc, &c, Q, C, 200);
                const double gv = c.n <= K_GEMV_MAX_N ? time_copies(run_gemvq, &c, Q, C, 200) : 0;
                const double sc = time_copies(run_scratch, &c, Q, C, 100), bf = time_copies(run_bf16, &c, B, C, 100);
                printf("  bench gemv_qtc out %5d in %5d type %2d n %2d: qtc %7.2f us (%6.1f GB/s of blocks)  gemv_q %7.2f us"
                       "  dequant+cublas %7.2f us  bf16 cublas %7.2f us\n",
                       c.out, c.in, c.type, c.n, tc, (double)qbytes / (tc * 1e3), gv, sc, bf);
            }
            for (int k = 0; k < C; k++) cudaFree(Q[k]);
        }
        for (int k = 0; k < C; k++) cudaFree(B[k]);
        cudaFree((void *)c.X), cudaFree(c.Y), cudaFree(c.scratch);
        free(hb);
    }
    cublasDestroy(c.blas);
}

/* k_gemm_qi8 (Q8_0): token counts past the GEMV's, one and several 64-row tiles with a
 * partial last one, column counts not a multiple of 64, one and several chunks, with and
 * without the split reduction (2048 columns: 32 tiles), an 8B gate at 64 tokens; then
 * what it refuses. */
static void test_gemm_qi8_matches_host(void **state) {
    (void)state;
    const int ns[6] = {9, 16, 31, 64, 65, 130};
    for (int i = 0; i < 6; i++) check_qi8(QB_Q8_0, 100 + 7 * i, 64 * (1 + i), ns[i], 1);
    check_qi8(QB_Q8_0, 2048, 2048, 17, 1);
    check_qi8(QB_Q8_0, 2048, 2048, 17, 2);
    check_qi8(QB_Q8_0, 333, 4160, 40, 2);
    check_qi8(QB_Q8_0, 14336, 4096, 64, 2);
    check_qi8(QB_Q8_0, 4096, 14336, 33, 2);
    uint8_t *d = gu_dev(1 << 20);
    float *f = gu_dev(1 << 20);
    const size_t sb = k_gemv_qi8_scratch(256, 16);
    assert_int_equal(k_gemm_qi8_takes(QB_Q8_0, 256), 1);
    assert_int_equal(k_gemm_qi8_takes(QB_Q8_0, 96), 0);    /* not whole 64-element chunks */
    assert_int_equal(k_gemm_qi8_takes(QB_Q4_0, 256), 0);
    assert_int_equal(k_gemm_qi8(QB_Q8_0, d, (uint16_t *)(d + 65536), f, 8, 96, 16, 0, d + 131072, sb, 0), -1);
    assert_int_equal(k_gemm_qi8(QB_Q4_K, d, (uint16_t *)(d + 65536), f, 8, 256, 16, 0, d + 131072, sb, 0), -1);
    assert_int_equal(k_gemm_qi8(QB_Q8_0, d, (uint16_t *)(d + 65536), f, 8, 256, 16, 0, d + 131072, sb - 1, 0), -1);
    assert_int_equal(k_gemm_qi8(QB_Q8_0, d + 2, (uint16_t *)(d + 65536), f, 8, 256, 16, 0, d + 131072, sb, 0), -1);
    assert_int_equal(k_gemm_qi8(QB_Q8_0, d, (uint16_t *)(d + 65538), f, 8, 256, 16, 0, d + 131072, sb, 0), -1);
    assert_int_equal(k_gemm_qi8(QB_Q8_0, d, (uint16_t *)(d + 65536), f, 8, 256, 0, 0, d + 131072, sb, 0), -1);
    cudaFree(d), cudaFree(f);
}

static void run_qi8(void *p, const uint8_t *W) {
    gq_ctx *c = p;
    assert_int_equal(k_gemv_qi8(c->type, W, c->X, c->Y, c->out, c->in, c->n, 0, c->ws, c->ws_bytes, 0), 0);
}

/* A printed timing of k_gemv_qi8 against k_gemv_q at 1-8 tokens on the 8B and 1B
 * projection shapes, every type, the activations' rounding included; 8 copies of
 * each matrix rotate so the L2 holds none between uses. */
static void test_gemv_qi8_speed_report(void **state) {
    (void)state;
    if (bench_off("bench gemv_qi8")) return;
    const int shapes[4][2] = {{14336, 4096}, {4096, 14336}, {6144, 4096}, {2048, 8192}};
    const int types[6] = {QB_Q8_0, QB_Q4_0, QB_Q4_1, QB_Q4_K, QB_Q5_K, QB_Q6_K}, ns[5] = {1, 2, 3, 4, 8};
    enum { C = 8 };
    gq_ctx c = {0};
    for (int si = 0; si < 4; si++) {
        c.out = shapes[si][0], c.in = shapes[si][1];
        gq_inputs(&c, 8);
        c.ws_bytes = k_gemv_qi8_scratch(c.in, 8);
        c.ws = gu_dev(c.ws_bytes);
        for (int ti = 0; ti < 6; ti++) {
            c.type = types[ti];
            uint8_t *Q[C];
            const size_t qbytes = random_copies(c.type, c.out, c.in, Q, C);
            for (int ni = 0; ni < 5; ni++) {
                c.n = ns[ni];
                const double i8 = time_copies(run_qi8, &c, Q, C, 200), gv = time_copies(run_gemvq, &c, Q, C, 200);
                printf("  bench gemv_qi8 out %5d in %5d type %2d n %d: qi8 %7.2f us (%6.1f GB/s of blocks)  gemv_q %7.2f us"
                       " (%6.1f GB/s)  %.2fx\n",
                       c.out, c.in, c.type, c.n, i8, (double)qbytes / (i8 * 1e3), gv, (double)qbytes / (gv * 1e3),
                       gv / i8);
            }
            for (int k = 0; k < C; k++) cudaFree(Q[k]);
        }
        cudaFree((void *)c.X), cudaFree(c.Y), cudaFree(c.ws);
    }
}

/* A printed timing of k_gemv_qi8 on the 8B shape's projections and the 8B / 1B output
 * matrices at 1-8 tokens: a unit of rows per warp, the streaming form everywhere (Q6_K at 4
 * rows a warp), and the default (the streaming form where gq_stream_pays, Q6_K at 2 rows);
 * 8 rotating copies of each matrix. */
static void test_gemv_qs_speed_report(void **state) {
    (void)state;
    if (bench_off("bench gemv_qs")) return;
    const int shapes[9][3] = {{28672, 4096, QB_Q4_K}, {4096, 14336, QB_Q4_K}, {4096, 14336, QB_Q6_K},
                              {4096, 4096, QB_Q4_K},  {6144, 4096, QB_Q4_K},  {1024, 4096, QB_Q6_K},
                              {128256, 4096, QB_Q6_K}, {128256, 2048, QB_Q6_K}, {128256, 2048, QB_Q4_1}};
    const int ns[4] = {1, 2, 4, 8};
    enum { C = 8 };
    gq_ctx c = {0};
    for (int si = 0; si < 9; si++) {
        c.out = shapes[si][0], c.in = shapes[si][1], c.type = shapes[si][2];
        gq_inputs(&c, 8);
        c.ws_bytes = k_gemv_qi8_scratch(c.in, 8);
        c.ws = gu_dev(c.ws_bytes);
        uint8_t *Q[C];
        const size_t qbytes = random_copies(c.type, c.out, c.in, Q, C);
        for (int ni = 0; ni < 4; ni++) {
            c.n = ns[ni];
            double us[3];
            for (int v = 0; v < 3; v++) {   /* unit per warp; streaming everywhere; the default */
                if (v < 2) set_stream(2 * v, 0);
                else k_set_tuning(&k_tuning_default);
                us[v] = time_copies(run_qi8, &c, Q, C, 200);
            }
            printf("  bench gemv_qs out %5d in %5d type %2d n %d: unit per warp %7.2f us (%6.1f GB/s)  stream %7.2f us"
                   " (%6.1f GB/s)  default %7.2f us (%6.1f GB/s)  %.2fx\n",
                   c.out, c.in, c.type, c.n, us[0], (double)qbytes / (us[0] * 1e3), us[1],
                   (double)qbytes / (us[1] * 1e3), us[2], (double)qbytes / (us[2] * 1e3), us[0] / us[2]);
        }
        k_set_tuning(&k_tuning_default);
        for (int k = 0; k < C; k++) cudaFree(Q[k]);
        cudaFree((void *)c.X), cudaFree(c.Y), cudaFree(c.ws);
    }
}

/* A printed sweep of the K-split targets (k_tuning.gemvq_split for k_gemv_q at 1 token,
 * gemvq_tc_split for k_gemv_qtc at 8 and 16) on the 8B gate / down / qkv shapes, Q4_K and
 * Q6_K; the defaults are 32 and 32. */
static void test_gemv_q_split_report(void **state) {
    (void)state;
    if (bench_off("bench split")) return;
    const int shapes[3][2] = {{14336, 4096}, {4096, 14336}, {6144, 4096}};
    const int types[2] = {QB_Q4_K, QB_Q6_K}, splits[5] = {8, 16, 32, 64, 128};
    enum { C = 8 };
    gq_ctx c = {0};
    for (int si = 0; si < 3; si++) {
        c.out = shapes[si][0], c.in = shapes[si][1];
        gq_inputs(&c, 16);
        for (int ti = 0; ti < 2; ti++) {
            c.type = types[ti];
            uint8_t *Q[C];
            const size_t qbytes = random_copies(c.type, c.out, c.in, Q, C);
            for (int sp = 0; sp < 5; sp++) {
                k_tuning t = k_tuning_default;
                t.gemvq_split = t.gemvq_tc_split = splits[sp];
                k_set_tuning(&t);
                c.n = 1;
                const double g1 = time_copies(run_gemvq, &c, Q, C, 48);
                c.n = 8;
                const double t8 = time_copies(run_qtc, &c, Q, C, 48), g8 = time_copies(run_gemvq, &c, Q, C, 48);
                c.n = 16;
                const double t16 = time_copies(run_qtc, &c, Q, C, 48);
                printf("  bench split %3d out %5d in %5d type %2d: gemv_q n 1 %7.2f us (%6.1f GB/s)  n 8 %7.2f us"
                       "  qtc n 8 %7.2f us  n 16 %7.2f us\n", splits[sp], c.out, c.in, c.type, g1,
                       (double)qbytes / (g1 * 1e3), g8, t8, t16);
            }
            k_set_tuning(&k_tuning_default);
            for (int k = 0; k < C; k++) cudaFree(Q[k]);
        }
        cudaFree((void *)c.X), cudaFree(c.Y);
    }
}

/* ---- timing (read from the log; asserts only that the launches succeed) ---------------- */

static void run_gemv1(void *p, const uint8_t *W) {   /* batch 1; type 0: k_gemv_bf16 */
    const gq_ctx *c = p;
    assert_int_equal(c->type ? k_gemv_q(c->type, W, c->X, c->Y, c->out, c->in, 1, 0, 0)
                             : k_gemv_bf16((const uint16_t *)W, c->X, c->Y, c->out, c->in, 1, 0, 0),
                     0);
}

/* Mean microseconds per batch-1 launch (type 0: k_gemv_bf16), rotating over `copies`
 * copies of the matrix (so the 50 MB L2 holds none of them between uses). */
static double time_gemv(int type, uint8_t *const *W, int copies, const uint16_t *X, float *Y, int out, int in) {
    gq_ctx c = {.type = type, .out = out, .in = in, .n = 1, .X = X, .Y = Y};
    return time_copies(run_gemv1, &c, W, copies, 100);
}

static double bench_one(int type, int out, int in, const uint16_t *dX, float *dY, double bf16_us) {
    const size_t bytes = type ? (size_t)out * (in / qb_elems(type)) * qb_bytes(type) : (size_t)out * in * 2;
    int copies = (int)(512e6 / (double)bytes) + 1;
    if (copies < 2) copies = 2;
    if (copies > 64) copies = 64;
    uint8_t *h = malloc(bytes), *W[64];
    if (type) {
        random_blocks(type, h, bytes);
    } else {
        uint16_t *hb = (uint16_t *)h;
        for (size_t i = 0; i < bytes / 2; i++) hb[i] = gu_f2bf(gu_uniform(&g_seed, -0.05f, 0.05f));
    }
    for (int c = 0; c < copies; c++) {
        GPU_CHECK(cudaMalloc((void **)&W[c], bytes));
        GPU_CHECK(cudaMemcpy(W[c], h, bytes, cudaMemcpyHostToDevice));
    }
    const double us = time_gemv(type, W, copies, dX, dY, out, in), gbs = (double)bytes / (us * 1e3);
    const char *name = type == QB_Q8_0 ? "Q8_0" : type == QB_Q4_K ? "Q4_K" : type == QB_Q6_K ? "Q6_K"
                     : type == QB_Q4_0 ? "Q4_0" : type == QB_Q4_1 ? "Q4_1" : type == QB_Q5_K ? "Q5_K" : "bf16";
    printf("  bench gemv out %5d in %5d n 1 %s: %8.2f us  %7.1f GB/s  (%4.1f%% of 4.8 TB/s)", out, in, name, us, gbs,
           gbs / 48.0);
    if (bf16_us > 0) printf("  time %.2fx bf16's", us / bf16_us);
    printf("\n");
    for (int c = 0; c < copies; c++) cudaFree(W[c]);
    free(h);
    return us;
}

static void test_gemv_q_bandwidth_report(void **state) {
    (void)state;
    if (bench_off("bench gemv")) return;
    const int shapes[2][2] = {{2048, 8192}, {14336, 4096}};   /* 1B down, 8B gate (out, in) */
    for (int i = 0; i < 2; i++) {
        const int out = shapes[i][0], in = shapes[i][1];
        uint16_t *X = malloc((size_t)in * 2);
        fill_bf(X, in, -1.f, 1.f);
        uint16_t *dX = gu_upload(X, (size_t)in * 2);
        float *dY = gu_dev(sizeof(float) * out);
        const double bf = bench_one(0, out, in, dX, dY, 0);
        for (int rows = 2; rows <= 4; rows += 2) {   /* k_tuning.gemvq_rows: 2, then 4 (the default) */
            set_gemvq_rows(rows);
            printf("  (rows per warp %d)\n", rows);
            bench_one(QB_Q8_0, out, in, dX, dY, bf);
            bench_one(QB_Q4_K, out, in, dX, dY, bf);
            bench_one(QB_Q6_K, out, in, dX, dY, bf);
            bench_one(QB_Q4_0, out, in, dX, dY, bf);
            bench_one(QB_Q4_1, out, in, dX, dY, bf);
            bench_one(QB_Q5_K, out, in, dX, dY, bf);
        }
        set_gemvq_rows(k_tuning_default.gemvq_rows);
        cudaFree(dX), cudaFree(dY);
        free(X);
    }
}

/* ---- FP8 weights ----------------------------------------------------------------------- */

/* A random [rows, cols] matrix quantized per row on the host: bytes, scales and the exact
 * values they stand for (double). */
static void fp8_matrix(int rows, int cols, uint8_t *q, float *sc, double *val) {
    float *row = malloc(sizeof(float) * (size_t)cols);
    for (int r = 0; r < rows; r++) {
        fill(row, (size_t)cols, -0.05f, 0.05f);
        fp8_quantize_row(row, cols, q + (size_t)r * cols, &sc[r]);
        for (int c = 0; c < cols; c++)
            val[(size_t)r * cols + c] = (double)fp8_e4m3_to_f32(q[(size_t)r * cols + c]) * sc[r];
    }
    free(row);
}

static double dot_val(const double *w, const uint16_t *x, int in) {
    double s = 0;
    for (int j = 0; j < in; j++) s += w[j] * gu_bf2f(x[j]);
    return s;
}

/* mode 0: plain, 1: accumulate, 2: gated (out = F) */
static void check_fp8(int out, int in, int n, int mode) {
    const int rows = mode == 2 ? 2 * out : out;
    uint8_t *q = malloc((size_t)rows * in);
    float *sc = malloc(sizeof(float) * rows);
    double *val = malloc(sizeof(double) * (size_t)rows * in);
    fp8_matrix(rows, in, q, sc, val);
    uint16_t *X = malloc((size_t)n * in * 2);
    fill_bf(X, (size_t)n * in, -1.f, 1.f);
    const size_t no = (size_t)n * out;
    void *dq = gu_upload(q, (size_t)rows * in), *ds = gu_upload(sc, sizeof(float) * rows);
    void *dX = gu_upload(X, (size_t)n * in * 2);
    double me = 0, mr = 0;
    int bad = 0, guard = 0;
    const k_wmat W = {dq, ds};
    if (mode == 2) {
        uint16_t *A = malloc((no + GUARD) * 2), *dA = gu_dev((no + GUARD) * 2);
        assert_int_equal(k_gemv_gated_w(W, dX, dA, out, in, n, NULL, 0), 0);
        gu_download(A, dA, (no + GUARD) * 2);
        for (int b = 0; b < n; b++)
            for (int o = 0; o < out; o++) {
                double g = dot_val(val + (size_t)o * in, X + (size_t)b * in, in);
                double u = dot_val(val + (size_t)(out + o) * in, X + (size_t)b * in, in);
                double ref = g / (1.0 + exp(-g)) * u, got = gu_bf2f(A[(size_t)b * out + o]);
                bad += isnan(got);
                me = fmax(me, fabs(got - ref));
                mr = fmax(mr, fabs(ref));
            }
        for (size_t i = no; i < no + GUARD; i++) guard += A[i] != 0xffff;
        cudaFree(dA), free(A);
    } else {
        float *y0 = malloc(sizeof(float) * (no + GUARD)), *Y = malloc(sizeof(float) * (no + GUARD));
        float *dY = gu_dev(sizeof(float) * (no + GUARD));
        if (mode == 1) {
            fill(y0, no, -1.f, 1.f);
            GPU_CHECK(cudaMemcpy(dY, y0, sizeof(float) * no, cudaMemcpyHostToDevice));
        }
        assert_int_equal(k_gemv_w(W, dX, dY, out, in, n, mode == 1, NULL, NULL, 0), 0);
        gu_download(Y, dY, sizeof(float) * (no + GUARD));
        for (int b = 0; b < n; b++)
            for (int o = 0; o < out; o++) {
                double ref = dot_val(val + (size_t)o * in, X + (size_t)b * in, in) + (mode == 1 ? y0[(size_t)b * out + o] : 0);
                double got = Y[(size_t)b * out + o];
                bad += isnan(got);
                me = fmax(me, fabs(got - ref));
                mr = fmax(mr, fabs(ref));
            }
        for (size_t i = no; i < no + GUARD; i++) guard += !isnan(Y[i]);
        cudaFree(dY), free(Y), free(y0);
    }
    double rel = bad ? INFINITY : me / (mr > 0 ? mr : 1);
    printf("  fp8 gemv %s out %d in %d n %d: rel err %.2e, unwritten %d, guard hits %d\n",
           mode == 2 ? "gated" : mode ? "accumulate" : "plain", out, in, n, rel, bad, guard);
    assert_int_equal(bad, 0);
    assert_int_equal(guard, 0);
    assert_true(rel < (mode == 2 ? 8e-3 : 2e-4));   /* gated: its output is bf16 */
    cudaFree(dq), cudaFree(ds), cudaFree(dX);
    free(q), free(sc), free(val), free(X);
}

static void test_fp8_gemv_matches_exact_values(void **state) {
    (void)state;
    for (int n = 1; n <= 8; n++) check_fp8(1000, 1024, n, n % 2);   /* FMA form (1, 2), mma form (3..8) */
    check_fp8(4096, 14336, 1, 1);   /* 8B down, split K */
    check_fp8(1024, 4096, 2, 0);    /* 8B k|v rows */
    check_fp8(172, 128, 3, 0);      /* rows no multiple of 16, in no multiple of 32: FMA form */
    check_fp8(14336, 4096, 1, 2);   /* 8B gate|up */
    check_fp8(8192, 2048, 5, 2);
}

/* The device quantizer gives the host's bytes and scales: ordinary rows, a zero row, a row
 * with one large value (most of it in E4M3's subnormals), rows at the top of bf16's range. */
static void test_fp8_quantizer_matches_host(void **state) {
    (void)state;
    const int rows = 64, cols = 4104;   /* cols % 8 == 0, not a multiple of the block's stride */
    uint16_t *X = malloc((size_t)rows * cols * 2);
    float *xf = malloc(sizeof(float) * (size_t)rows * cols);
    fill_bf(X, (size_t)rows * cols, -3.f, 3.f);
    for (int c = 0; c < cols; c++) X[(size_t)1 * cols + c] = 0;   /* row 1: zeros */
    for (int c = 0; c < cols; c++) X[(size_t)2 * cols + c] = gu_f2bf(gu_uniform(&g_seed, -1e-3f, 1e-3f));
    X[(size_t)2 * cols + 17] = gu_f2bf(1000.f);                     /* row 2: one outlier */
    for (int c = 0; c < cols; c++) X[(size_t)3 * cols + c] = gu_f2bf(gu_uniform(&g_seed, -3e38f, 3e38f));
    for (size_t i = 0; i < (size_t)rows * cols; i++) xf[i] = gu_bf2f(X[i]);
    uint8_t *q = malloc((size_t)rows * cols), *gq = malloc((size_t)rows * cols + GUARD);
    float *sc = malloc(sizeof(float) * rows), *gs = malloc(sizeof(float) * (rows + GUARD));
    for (int r = 0; r < rows; r++) fp8_quantize_row(xf + (size_t)r * cols, cols, q + (size_t)r * cols, &sc[r]);
    void *dX = gu_upload(X, (size_t)rows * cols * 2);
    uint8_t *dq = gu_dev((size_t)rows * cols + GUARD);
    float *ds = gu_dev(sizeof(float) * (rows + GUARD));
    assert_int_equal(k_quant_fp8_rows(dX, rows, cols, dq, ds, 0), 0);
    gu_download(gq, dq, (size_t)rows * cols + GUARD);
    gu_download(gs, ds, sizeof(float) * (rows + GUARD));
    size_t diff = 0;
    for (size_t i = 0; i < (size_t)rows * cols; i++) diff += q[i] != gq[i];
    for (int r = 0; r < rows; r++) assert_memory_equal(&sc[r], &gs[r], sizeof(float));
    for (size_t i = 0; i < GUARD; i++) assert_int_equal(gq[(size_t)rows * cols + i], 0xff);
    printf("  fp8 quantizer: %zu of %zu bytes differ from the host's; scales equal\n", diff, (size_t)rows * cols);
    assert_int_equal(diff, 0);
    assert_true(sc[1] == 1.f && q[cols] == 0);
    assert_int_equal(k_quant_fp8_rows(dX, rows, 100, dq, ds, 0), -1);   /* cols % 8 */
    cudaFree(dX), cudaFree(dq), cudaFree(ds);
    free(X), free(xf), free(q), free(gq), free(sc), free(gs);
}

/* Batch-1 time of the FP8 GEMV next to bf16 on the 8B gate|up shape (printed, not asserted). */
static void test_fp8_gemv_bandwidth_report(void **state) {
    (void)state;
    if (bench_off("bench fp8 gemv")) return;
    const int out = 28672, in = 4096, copies = 8;
    const size_t nw = (size_t)out * in;
    void *w8[copies], *w16[copies], *ds = gu_dev(sizeof(float) * out);
    GPU_CHECK(cudaMemset(ds, 0, sizeof(float) * out));
    for (int c = 0; c < copies; c++) {
        w8[c] = gu_dev(nw);
        w16[c] = gu_dev(nw * 2);
        GPU_CHECK(cudaMemset(w8[c], 0x11, nw));
        GPU_CHECK(cudaMemset(w16[c], 0x11, nw * 2));
    }
    uint16_t *X = gu_dev((size_t)in * 2);
    float *Y = gu_dev(sizeof(float) * out);
    GPU_CHECK(cudaMemset(X, 0, (size_t)in * 2));
    cudaEvent_t a, b;
    GPU_CHECK(cudaEventCreate(&a));
    GPU_CHECK(cudaEventCreate(&b));
    for (int pass = 0; pass < 2; pass++) {
        float ms[2];
        for (int f8 = 0; f8 < 2; f8++) {
            const int iters = 64;
            GPU_CHECK(cudaEventRecord(a, 0));
            for (int i = 0; i < iters; i++) {
                const k_wmat W = {f8 ? w8[i % copies] : w16[i % copies], f8 ? ds : NULL};
                assert_int_equal(k_gemv_w(W, X, Y, out, in, 1, 0, NULL, NULL, 0), 0);
            }
            GPU_CHECK(cudaEventRecord(b, 0));
            GPU_CHECK(cudaEventSynchronize(b));
            GPU_CHECK(cudaEventElapsedTime(&ms[f8], a, b));
            ms[f8] /= iters;
        }
        if (pass)
            printf("  batch-1 GEMV %d x %d: bf16 %.1f us (%.0f GB/s), fp8 %.1f us (%.0f GB/s)\n", out, in,
                   ms[0] * 1e3, nw * 2 / (ms[0] * 1e6), ms[1] * 1e3, nw / (ms[1] * 1e6));
    }
    for (int c = 0; c < copies; c++) cudaFree(w8[c]), cudaFree(w16[c]);
    cudaFree(ds), cudaFree(X), cudaFree(Y);
}

/* argv[1], when given: run only the tests whose names match this cmocka filter pattern
 * (e.g. "*gemm_q*"). */
int main(int argc, char **argv) {
    if (argc > 1) cmocka_set_test_filter(argv[1]);
    g_seed = gu_seed();
    printf("test_gpu_gemv: seed %llu (SPECD_TEST_SEED replays)\n", (unsigned long long)g_seed);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gemv_gated_matches_silu_of_gate_times_up),
        cmocka_unit_test(test_gemv_qkv_rope_matches_gemv_then_qkv_rope_kv),
        cmocka_unit_test(test_fused_gemvs_reject_what_they_cannot_do),
        cmocka_unit_test(test_plain_gemv_all_row_counts),
        cmocka_unit_test(test_plain_gemv_split_k_projection_shapes),
        cmocka_unit_test(test_norm_fold_matches_rmsnorm_then_gemv),
        cmocka_unit_test(test_gemv_q_matches_host_decode),
        cmocka_unit_test(test_gemv_q_every_type_and_token_count),
        cmocka_unit_test(test_embed_q_matches_host_decode),
        cmocka_unit_test(test_gemv_q_bandwidth_report),
        cmocka_unit_test(test_gemm_q_matches_host_decode),
        cmocka_unit_test(test_gemv_qtc_matches_host_decode),
        cmocka_unit_test(test_gemv_qtc_speed_report),
        cmocka_unit_test(test_gemv_qi8_matches_host),
        cmocka_unit_test(test_gemv_q_two_types_one_output),
        cmocka_unit_test(test_gemv_q_stream_matches_host),
        cmocka_unit_test(test_gemv_qs_speed_report),
        cmocka_unit_test(test_gemm_qi8_matches_host),
        cmocka_unit_test(test_gemv_qi8_speed_report),
        cmocka_unit_test(test_gemv_q_split_report),
        cmocka_unit_test(test_gemm_q_speed_report),
        cmocka_unit_test(test_fp8_gemv_matches_exact_values),
        cmocka_unit_test(test_fp8_quantizer_matches_host),
        cmocka_unit_test(test_fp8_gemv_bandwidth_report),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
