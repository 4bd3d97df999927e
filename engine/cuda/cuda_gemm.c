/* bf16 GEMMs past the GEMV: Y [n, out] (row stride ldy) = X [n, in] . W [out, in]^T
 * (+ Y where beta is 1), fp32 accumulation and output.
 *
 * By default cuBLAS (cublasGemmEx) chooses an algorithm for each exact token count n at its
 * first use. On an H100 a first prompt of a length not seen before cost 10-15 ms more than
 * the next one of that length, with module loading eager or lazy (tests/gpu/BENCH.md,
 * twenty-third session); prompt chunks beside decode rows give every step a new n. With
 * tune.gemm_band = B (SPECD_CUDA_GEMM_BAND; 0 = off, the default: on an H100 the bands
 * took a first 1,100-token request on the 1B shape from 17.1 to 6.8 ms, but left warm
 * requests 3-11% slower at some lengths, tests/gpu/BENCH.md twenty-fourth session) passes
 * of more than B tokens go through cuBLASLt instead, with
 * the algorithm chosen once per band of B token counts, for the band's largest count, and
 * used for every count of the band that cuBLASLt accepts it for (checked once per count;
 * a count it refuses falls back to cublasGemmEx). So a shape meets at most one algorithm
 * per band, and the start-up warm-up, which runs every multiple of 64 tokens, chooses
 * them all before the first request. Plans live in an open-addressed table keyed by
 * (out, in, ldy, band); a full table falls back to cublasGemmEx, never to a wrong plan. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/err.h"
#include "engine/cuda/cuda_internal.h"

#define GEMM_PLANS 1024   /* a power of two */

typedef struct cuda_gemm_plan {
    int out, in, ldy, top;   /* top: the band's largest token count; out == 0: empty */
    cuda_lt_plan lt;
    uint64_t checked, ok;    /* per count of the band (bit top - n): asked, and accepted */
} cuda_gemm_plan;

void cuda_lt_plan_release(cuda_lt_plan *p) {
    if (p->a) cublasLtMatrixLayoutDestroy(p->a);
    if (p->b) cublasLtMatrixLayoutDestroy(p->b);
    if (p->c) cublasLtMatrixLayoutDestroy(p->c);
    memset(p, 0, sizeof *p);
}

int cuda_lt_plan_make(const cuda_runner *r, cublasLtHandle_t lt, cublasLtMatmulDesc_t desc, cudaDataType_t ab,
                      int out, int in, int n, int ldc, cuda_lt_plan *p) {
    memset(p, 0, sizeof *p);
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t res;
    int nres = 0, rc = -1;
    size_t ws = r->blas_ws_bytes;
    if (cublasLtMatrixLayoutCreate(&p->a, ab, (uint64_t)in, (uint64_t)out, in) ||
        cublasLtMatrixLayoutCreate(&p->b, ab, (uint64_t)in, (uint64_t)n, in) ||
        cublasLtMatrixLayoutCreate(&p->c, CUDA_R_32F, (uint64_t)out, (uint64_t)n, ldc) ||
        cublasLtMatmulPreferenceCreate(&pref) ||
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws))
        goto out;
    if (cublasLtMatmulAlgoGetHeuristic(lt, desc, p->a, p->b, p->c, p->c, pref, 1, &res, &nres) ==
            CUBLAS_STATUS_SUCCESS && nres > 0) {
        p->algo = res.algo;
        rc = 0;
    }
out:
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (rc) cuda_lt_plan_release(p);
    return rc;
}

/* A band's plan: layouts for top tokens. Returns 0 or -1 (no plan: the caller uses
 * cublasGemmEx). */
static int plan_make(cuda_runner *r, cuda_gemm_plan *p, int out, int in, int ldy, int top) {
    memset(p, 0, sizeof *p);
    if (cuda_lt_plan_make(r, r->gemm_lt, r->gemm_desc, CUDA_R_16BF, out, in, top, ldy, &p->lt)) return -1;
    p->out = out;
    p->in = in;
    p->ldy = ldy;
    p->top = top;
    r->gemm_lt_plans++;
    return 0;
}

/* The plan of (out, in, ldy, top), made on first use (without an algorithm it refuses
 * every count); NULL: the table is full there. */
static cuda_gemm_plan *plan_get(cuda_runner *r, int out, int in, int ldy, int top) {
    unsigned h = ((unsigned)out * 2654435761u) ^ ((unsigned)in * 40503u) ^ ((unsigned)ldy * 97u) ^
                 ((unsigned)top * 2246822519u);
    for (int i = 0; i < 16; i++) {
        cuda_gemm_plan *p = &r->gemm_plans[(h + (unsigned)i) & (GEMM_PLANS - 1)];
        if (p->out == out && p->in == in && p->ldy == ldy && p->top == top) return p;
        if (p->out) continue;
        if (plan_make(r, p, out, in, ldy, top)) {   /* kept as refusing every count, so the
                                                     * heuristic is not asked again each call */
            *p = (cuda_gemm_plan){.out = out, .in = in, .ldy = ldy, .top = top, .checked = ~0ull};
        }
        return p;
    }
    return NULL;
}

int cuda_gemm_init(cuda_runner *r) {
    if (r->tune.gemm_band <= 0) return 0;
    if (r->tune.gemm_band > 64) r->tune.gemm_band = 64;   /* (the plans' bit masks) */
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    if (cublasLtCreate(&r->gemm_lt) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulDescCreate(&r->gemm_desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulDescSetAttribute(r->gemm_desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta) ||
        cublasLtMatmulDescSetAttribute(r->gemm_desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb)) {
        cuda_fail(r, __FILE__, __LINE__, "cuBLASLt", "could not set up the banded bf16 GEMM");
        return SPECD_ECUDA;
    }
    if (!(r->gemm_plans = calloc(GEMM_PLANS, sizeof *r->gemm_plans))) return SPECD_ENOMEM;
    return 0;
}

void cuda_gemm_free(cuda_runner *r) {
    if (r->gemm_plans)
        for (int i = 0; i < GEMM_PLANS; i++) cuda_lt_plan_release(&r->gemm_plans[i].lt);
    free(r->gemm_plans);
    r->gemm_plans = NULL;
    if (r->gemm_desc) cublasLtMatmulDescDestroy(r->gemm_desc);
    if (r->gemm_lt) cublasLtDestroy(r->gemm_lt);
    r->gemm_desc = NULL;
    r->gemm_lt = NULL;
}

/* The band's plan with its layouts set to n tokens, if its algorithm takes n. */
static cuda_gemm_plan *band_plan(cuda_runner *r, int out, int in, int n, int ldy) {
    const int band = r->tune.gemm_band, top = (n + band - 1) / band * band;
    cuda_gemm_plan *p = plan_get(r, out, in, ldy, top);
    const uint64_t cols = (uint64_t)n, bit = 1ull << (top - n);
    if (!p || (p->checked & ~p->ok & bit)) return NULL;   /* (no plan, or a count it refused) */
    if (cublasLtMatrixLayoutSetAttribute(p->lt.b, CUBLASLT_MATRIX_LAYOUT_COLS, &cols, sizeof cols) ||
        cublasLtMatrixLayoutSetAttribute(p->lt.c, CUBLASLT_MATRIX_LAYOUT_COLS, &cols, sizeof cols))
        return NULL;
    if (!(p->checked & bit)) {
        cublasLtMatmulHeuristicResult_t res;
        p->checked |= bit;
        if (cublasLtMatmulAlgoCheck(r->gemm_lt, r->gemm_desc, p->lt.a, p->lt.b, p->lt.c, p->lt.c, &p->lt.algo, &res) ==
                CUBLAS_STATUS_SUCCESS && res.workspaceSize <= r->blas_ws_bytes)
            p->ok |= bit;
    }
    return p->ok & bit ? p : NULL;
}

int cuda_gemm_bf16(cuda_runner *r, const uint16_t *W, int out, int in, const uint16_t *X, int n, float *Y, int ldy,
                   float beta) {
    const float alpha = 1.f;
    cuda_gemm_plan *p = r->gemm_plans && n > r->tune.gemm_band ? band_plan(r, out, in, n, ldy) : NULL;
    if (p) {
        const cuda_lt_plan *l = &p->lt;
        cublasStatus_t s = cublasLtMatmul(r->gemm_lt, r->gemm_desc, &alpha, W, l->a, X, l->b, &beta, Y, l->c, Y, l->c,
                                          &l->algo, r->blas_ws, r->blas_ws_bytes, r->stream);
        r->gemm_lt_calls++;
        if (s == CUBLAS_STATUS_SUCCESS) return 0;
        cuda_fail(r, __FILE__, __LINE__, "cublasLtMatmul", cublasGetStatusString(s));
        return SPECD_ECUDA;
    }
    /* Row-major Y[n, out] = X[n, in] . W[out, in]^T is column-major Y^T = W^T' X^T'. */
    BLAS_CHECK(r, cublasGemmEx(r->blas, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &alpha, W, CUDA_R_16BF, in, X,
                               CUDA_R_16BF, in, &beta, Y, CUDA_R_32F, ldy, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return 0;
fail:
    return SPECD_ECUDA;
}
