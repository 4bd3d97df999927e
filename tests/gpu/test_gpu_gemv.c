/* The fused batch-1/2 GEMVs (kernels/gemv.cu) against a host reference built the way the
 * unfused path computes: bf16(rmsnorm(x) * w) as the activation, fp32 dot products with
 * the bf16 weights, then (gated) bf16(silu(gate) * up). Random inputs fresh each run
 * (SPECD_TEST_SEED replays), outputs poisoned with NaN so an unwritten element fails, and
 * a guard zone after the output that must stay poisoned. Shapes cover rows that are not
 * a multiple of 8 and more rows than the grid has warps (the grid-stride loop). Also the
 * plain GEMV (PDL launch path) for n = 1..8. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "kernels/specd_kernels.h"
#include "tests/gpu/gpu_util.h"

static uint64_t g_seed;

static void fill(float *x, size_t n, float lo, float hi) {
    for (size_t i = 0; i < n; i++) x[i] = gu_uniform(&g_seed, lo, hi);
}

/* Reference activation: bf16(x * inv_rms * w) as k_rmsnorm writes it. */
static void ref_norm(const float *x, const float *w, int n, int in, float eps, float *xn) {
    for (int b = 0; b < n; b++) {
        double ss = 0;
        for (int j = 0; j < in; j++) ss += (double)x[(size_t)b * in + j] * x[(size_t)b * in + j];
        float inv = 1.f / sqrtf((float)(ss / in) + eps);
        for (int j = 0; j < in; j++) xn[(size_t)b * in + j] = gu_round_bf(x[(size_t)b * in + j] * inv * w[j]);
    }
}

static double dot(const uint16_t *w, const float *x, int in) {
    double s = 0;
    for (int j = 0; j < in; j++) s += (double)gu_bf2f(w[j]) * x[j];
    return s;
}

static void check_norm_gemv(int rows, int in, int n, int gated) {
    const float eps = 1e-5f;
    int wrows = gated ? 2 * rows : rows;
    size_t nw = (size_t)wrows * in;
    uint16_t *W = malloc(nw * 2);
    float *x = malloc(sizeof(float) * (size_t)n * in), *g = malloc(sizeof(float) * (size_t)in);
    float *xn = malloc(sizeof(float) * (size_t)n * in);
    for (size_t i = 0; i < nw; i++) W[i] = gu_f2bf(gu_uniform(&g_seed, -0.05f, 0.05f));
    fill(x, (size_t)n * in, -2.f, 2.f);
    fill(g, (size_t)in, 0.5f, 1.5f);
    ref_norm(x, g, n, in, eps, xn);

    const size_t guard = 64, outn = (size_t)n * rows;
    void *dW = gu_upload(W, nw * 2), *dx = gu_upload(x, sizeof(float) * (size_t)n * in);
    void *dg = gu_upload(g, sizeof(float) * (size_t)in);
    void *dout = gu_dev((outn + guard) * (gated ? 2 : 4));   /* NaN-poisoned */
    int rc = k_gemv_norm_bf16(dW, dx, dg, eps, gated ? NULL : dout, gated ? dout : NULL, rows, in, n, 0);
    assert_int_equal(rc, 0);
    double max_err = 0, max_ref = 0;
    int bad = 0;
    if (gated) {
        uint16_t *o = malloc((outn + guard) * 2);
        gu_download(o, dout, (outn + guard) * 2);
        for (int b = 0; b < n; b++)
            for (int r = 0; r < rows; r++) {
                double gv = dot(W + (size_t)r * in, xn + (size_t)b * in, in);
                double uv = dot(W + (size_t)(rows + r) * in, xn + (size_t)b * in, in);
                double ref = gv / (1.0 + exp(-gv)) * uv, got = gu_bf2f(o[(size_t)b * rows + r]);
                if (isnan(got)) bad++;
                max_err = fmax(max_err, fabs(got - ref));
                max_ref = fmax(max_ref, fabs(ref));
            }
        for (size_t i = outn; i < outn + guard; i++) assert_int_equal(o[i], 0xffff);
        free(o);
    } else {
        float *o = malloc((outn + guard) * 4);
        gu_download(o, dout, (outn + guard) * 4);
        for (int b = 0; b < n; b++)
            for (int r = 0; r < rows; r++) {
                double ref = dot(W + (size_t)r * in, xn + (size_t)b * in, in), got = o[(size_t)b * rows + r];
                if (isnan(got)) bad++;
                max_err = fmax(max_err, fabs(got - ref));
                max_ref = fmax(max_ref, fabs(ref));
            }
        for (size_t i = outn; i < outn + guard; i++) assert_true(isnan(o[i]));
        free(o);
    }
    double rel = max_err / (max_ref > 0 ? max_ref : 1);
    printf("  norm gemv rows %d in %d n %d %s: rel err %.2e, unwritten %d\n", rows, in, n, gated ? "gated" : "plain",
           rel, bad);
    assert_int_equal(bad, 0);
    /* fp32 accumulation in a different order; gated output is rounded to bf16 */
    assert_true(rel < (gated ? 8e-3 : 2e-4));
    cudaFree(dW), cudaFree(dx), cudaFree(dg), cudaFree(dout);
    free(W), free(x), free(g), free(xn);
}

static void test_norm_gemv_plain_matches_rmsnorm_then_gemv(void **state) {
    (void)state;
    check_norm_gemv(6144, 4096, 1, 0);   /* Llama-3.1-8B QKV */
    check_norm_gemv(2560, 2048, 2, 0);   /* Llama-3.2-1B QKV, two rows */
    check_norm_gemv(37, 64, 1, 0);       /* rows not a multiple of 8, in < 32 * 4 * 8 */
    check_norm_gemv(8 * 4 * 132 * 3 + 5, 256, 2, 0);   /* more rows than the grid's warps */
}

static void test_norm_gemv_gated_matches_silu_of_gate_times_up(void **state) {
    (void)state;
    check_norm_gemv(14336, 4096, 1, 1);   /* Llama-3.1-8B gate|up */
    check_norm_gemv(8192, 2048, 2, 1);    /* Llama-3.2-1B gate|up, two rows */
    check_norm_gemv(172, 128, 1, 1);      /* a tiny model's ffn */
}

static void test_norm_gemv_rejects_what_it_cannot_do(void **state) {
    (void)state;
    void *d = gu_dev(1 << 20);
    assert_int_equal(k_gemv_norm_bf16(d, d, d, 1e-5f, d, NULL, 8, 100, 1, 0), -1);   /* in % 8 */
    assert_int_equal(k_gemv_norm_bf16(d, d, d, 1e-5f, d, NULL, 8, 64, 3, 0), -1);    /* n > 2 */
    assert_int_equal(k_gemv_norm_bf16(d, d, d, 1e-5f, d, d, 8, 64, 1, 0), -1);       /* both outputs */
    assert_int_equal(k_gemv_norm_bf16(d, d, d, 1e-5f, NULL, NULL, 8, 64, 1, 0), -1); /* none */
    cudaFree(d);
}

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

int main(void) {
    g_seed = gu_seed();
    printf("test_gpu_gemv: seed %llu (SPECD_TEST_SEED replays)\n", (unsigned long long)g_seed);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_norm_gemv_plain_matches_rmsnorm_then_gemv),
        cmocka_unit_test(test_norm_gemv_gated_matches_silu_of_gate_times_up),
        cmocka_unit_test(test_norm_gemv_rejects_what_it_cannot_do),
        cmocka_unit_test(test_plain_gemv_all_row_counts),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
