/* FP8 GEMMs of the CUDA runner: projections held as E4M3 bytes with a scale per output row
 * (--dtype fp8 quantizes bf16 weights at load, an FP8 checkpoint brings its own) times
 * activations quantized per token as they come (k_quant_fp8_rows: dynamic scales, no
 * calibration), on Hopper's FP8 tensor cores through cuBLASLt with fp32 accumulation
 * and fp32 output, added into the residual where the bf16 path adds (beta 1).
 *
 * No fast accumulation by default: without cuBLASLt's periodic promotion the tensor
 * cores' narrower accumulator costs accuracy as the reduction grows (test_gpu_runner
 * "*fp8_gemm*", H100, 2026-12-07: relative error 2.1e-3 against 9.3e-5 at in 4096) for
 * 0.6% / 1.4% more decode tok/s at 64 / 256 rows on the 8B shape; SPECD_CUDA_FP8_FAST_ACCUM=1
 * turns it on.
 *
 * The scales: cuBLASLt's outer-vector mode multiplies element (o, t) of the product by
 * sw[o] * sx[t] in its epilogue. Where the library refuses that mode (found once at
 * start-up), the GEMM runs unscaled into d_f8tmp, CUDA_FP8_CHUNK tokens at a time, and
 * k_fp8_scale_rows applies the scales.
 *
 * Passes of up to K_GEMV_MAX_N tokens never come here: the GEMVs read the FP8 bytes
 * directly with bf16 activations (kernels/gemv.cu, k_wmat). Nor do matrices whose widths
 * are not multiples of 16 (cuBLASLt's FP8 layouts need them): the GEMV takes those too,
 * K_GEMV_MAX_N tokens at a time.
 *
 * Plans (the three matrix layouts and the heuristic's algorithm) are kept per (out, in,
 * n) in an open-addressed table, so a shape pays the heuristic once; a full table means
 * asking again, never a wrong plan. At the decode sizes, whose graphs fix the plan, the
 * heuristic's candidates are timed first (plan_tune; SPECD_CUDA_FP8_TUNE=0: its first
 * pick): on the 8B shape with an FP8 cache, H100, decode at 64 rows 12,836-12,840 against
 * 12,580-12,597 tok/s, at 256 rows no change (31,634-32,047 against 31,842-31,845). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/core/err.h"
#include "engine/cuda/cuda_internal.h"

#define FP8_PLANS 4096   /* a power of two */

typedef struct cuda_fp8_plan {
    int out, in, n;      /* out == 0: empty */
    cuda_lt_plan lt;
} cuda_fp8_plan;

static int lt_fail(cuda_runner *r, int line, const char *what, cublasStatus_t s) {
    cuda_fail(r, __FILE__, line, what, cublasGetStatusString(s));
    return SPECD_ECUDA;
}

static int desc_set(cuda_runner *r, cublasLtMatmulDescAttributes_t a, const void *v, size_t n) {
    cublasStatus_t s = cublasLtMatmulDescSetAttribute(r->lt_desc, a, v, n);
    return s == CUBLAS_STATUS_SUCCESS ? 0 : lt_fail(r, __LINE__, "cublasLtMatmulDescSetAttribute", s);
}

/* The matmul descriptor: D = A^T B with A the weights (K x M as stored), B the
 * activations (K x N), fp32 compute and scale type, per-vector scales when outer. */
static int make_desc(cuda_runner *r, int outer) {
    if (r->lt_desc) cublasLtMatmulDescDestroy(r->lt_desc);
    r->lt_desc = NULL;
    cublasStatus_t s = cublasLtMatmulDescCreate(&r->lt_desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    if (s != CUBLAS_STATUS_SUCCESS) return lt_fail(r, __LINE__, "cublasLtMatmulDescCreate", s);
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const int8_t fast = r->tune.fp8_fast_accum ? 1 : 0;
    int rc;
    if ((rc = desc_set(r, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta)) ||
        (rc = desc_set(r, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb)) ||
        (rc = desc_set(r, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast)))
        return rc;
    if (outer) {
        const int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
        if ((rc = desc_set(r, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof mode)) ||
            (rc = desc_set(r, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof mode)))
            return rc;
    }
    return 0;
}

#define FP8_TUNE_ALGOS 16   /* candidates timed */
#define FP8_TUNE_REPS 4      /* timed runs each, after one untimed */

/* Time the heuristic's first FP8_TUNE_ALGOS candidates for p's shape on the pass's own
 * operands (W, X8; the scale pointers already set in lt_desc) into a scratch output, and
 * keep the fastest in p. The heuristic ranks by a model of the GPU; at decode sizes its
 * first tile can leave SMs idle (an out x n product of few tiles), which a timing sees.
 * Each timed run follows a write over twice the L2 so the weights come from HBM as they
 * do in a step (an 8B projection of FP8 bytes fits the 50 MB L2: timed back to back the
 * runs would rank algorithms by L2 reuse). Any failure leaves p as it was: tuning only
 * ever picks among algorithms that ran. The pick is a timing, so two starts may pick
 * differently (results differ in rounding only). */
static void plan_tune(cuda_runner *r, cuda_fp8_plan *p, const uint8_t *W, const uint8_t *X8) {
    enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(r->stream, &cs) != cudaSuccess || cs != cudaStreamCaptureStatusNone) return;
    int l2 = 0;
    if (cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, r->device) != cudaSuccess || l2 <= 0) return;
    const size_t outb = ((size_t)p->out * p->n * 4 + 255) / 256 * 256, flush = (size_t)l2 * 2, need = outb + flush;
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t res[FP8_TUNE_ALGOS];
    cudaEvent_t ev[2 * FP8_TUNE_REPS] = {0};
    int nres = 0, nev = 0;
    size_t ws = r->blas_ws_bytes;
    if (cudaStreamSynchronize(r->stream) != cudaSuccess) return;
    if (need > r->fp8_tune_bytes) {
        cudaFree(r->d_fp8_tune);
        r->fp8_tune_bytes = 0;
        if (cudaMalloc((void **)&r->d_fp8_tune, need) != cudaSuccess) {
            r->d_fp8_tune = NULL;
            (void)cudaGetLastError();
            return;
        }
        r->fp8_tune_bytes = need;
    }
    float *Y = r->d_fp8_tune;
    char *fl = (char *)r->d_fp8_tune + outb;
    if (cublasLtMatmulPreferenceCreate(&pref) ||
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws) ||
        cublasLtMatmulAlgoGetHeuristic(r->lt, r->lt_desc, p->lt.a, p->lt.b, p->lt.c, p->lt.c, pref, FP8_TUNE_ALGOS,
                                       res, &nres) != CUBLAS_STATUS_SUCCESS ||
        nres < 2)
        goto out;
    for (; nev < 2 * FP8_TUNE_REPS; nev++)
        if (cudaEventCreate(&ev[nev]) != cudaSuccess) goto out;
    const float alpha = 1.f, beta = 0.f;
    float best_ms = 0.f, first_ms = -1.f;
    int best = -1;
    for (int i = 0; i < nres; i++) {
        if (res[i].state != CUBLAS_STATUS_SUCCESS || res[i].workspaceSize > ws) continue;
        float ms = 0.f;
        int ok = 1;
        for (int k = -1; k < FP8_TUNE_REPS && ok; k++) {
            ok = cudaMemsetAsync(fl, k & 0xff, flush, r->stream) == cudaSuccess &&
                 (k < 0 || cudaEventRecord(ev[2 * k], r->stream) == cudaSuccess) &&
                 cublasLtMatmul(r->lt, r->lt_desc, &alpha, W, p->lt.a, X8, p->lt.b, &beta, Y, p->lt.c, Y, p->lt.c,
                                &res[i].algo, r->blas_ws, r->blas_ws_bytes, r->stream) == CUBLAS_STATUS_SUCCESS &&
                 (k < 0 || cudaEventRecord(ev[2 * k + 1], r->stream) == cudaSuccess);
        }
        ok = ok && cudaStreamSynchronize(r->stream) == cudaSuccess;
        for (int k = 0; k < FP8_TUNE_REPS && ok; k++) {
            float t = 0.f;
            ok = cudaEventElapsedTime(&t, ev[2 * k], ev[2 * k + 1]) == cudaSuccess;
            ms += t;
        }
        if (!ok) {   /* this candidate does not run here: the next one */
            (void)cudaGetLastError();
            if (cudaStreamSynchronize(r->stream) != cudaSuccess) goto out;
            continue;
        }
        if (i == 0) first_ms = ms;
        if (best < 0 || ms < best_ms) {
            best = i;
            best_ms = ms;
        }
    }
    if (best >= 0) {
        r->fp8_tuned++;
        if (best != 0 && first_ms >= 0.f) {   /* (the heuristic's pick is candidate 0) */
            r->fp8_tune_changed++;
            r->fp8_tune_us[0] += 1e3 * first_ms / FP8_TUNE_REPS;
            r->fp8_tune_us[1] += 1e3 * best_ms / FP8_TUNE_REPS;
        }
        p->lt.algo = res[best].algo;
    }
out:
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    for (int k = 0; k < nev; k++) cudaEventDestroy(ev[k]);
}

/* Layouts and the heuristic's first algorithm for (out, in, n) into p, tuned on W and X8
 * while r->fp8_tune_now is set. Returns 0, or SPECD_EUNSUPPORTED when cuBLASLt has no
 * algorithm (quiet: the probe asks this). */
static int plan_make(cuda_runner *r, cuda_fp8_plan *p, int out, int in, int n, const uint8_t *W, const uint8_t *X8) {
    memset(p, 0, sizeof *p);
    if (cuda_lt_plan_make(r, r->lt, r->lt_desc, CUDA_R_8F_E4M3, out, in, n, out, &p->lt)) return SPECD_EUNSUPPORTED;
    p->out = out;
    p->in = in;
    p->n = n;
    if (W && r->fp8_tune_now && r->tune.fp8_tune) plan_tune(r, p, W, X8);
    return 0;
}

/* The plan of (out, in, n): from the table, or made (and kept when there is room; only a
 * kept plan is tuned). tmp holds one that could not be kept; the caller releases it. */
static int plan_get(cuda_runner *r, int out, int in, int n, const uint8_t *W, const uint8_t *X8, cuda_fp8_plan **pp,
                    cuda_fp8_plan *tmp) {
    unsigned h = ((unsigned)out * 2654435761u) ^ ((unsigned)in * 40503u) ^ ((unsigned)n * 2246822519u);
    for (int i = 0; i < 16; i++) {
        cuda_fp8_plan *p = &r->fp8_plans[(h + (unsigned)i) & (FP8_PLANS - 1)];
        if (p->out == out && p->in == in && p->n == n) {
            *pp = p;
            return 0;
        }
        if (!p->out) {
            int rc = plan_make(r, p, out, in, n, W, X8);
            *pp = p;
            return rc;
        }
    }
    *pp = tmp;
    return plan_make(r, tmp, out, in, n, NULL, NULL);
}

void cuda_fp8_tune_done(cuda_runner *r) {
    cudaFree(r->d_fp8_tune);
    r->d_fp8_tune = NULL;
    r->fp8_tune_bytes = 0;
}

int cuda_fp8_init(cuda_runner *r, size_t xbw, size_t outw, int T) {
    cublasStatus_t s = cublasLtCreate(&r->lt);
    if (s != CUBLAS_STATUS_SUCCESS) return lt_fail(r, __LINE__, "cublasLtCreate", s);
    if (!(r->fp8_plans = calloc(FP8_PLANS, sizeof *r->fp8_plans))) return SPECD_ENOMEM;
    /* Does this cuBLASLt scale by vectors on this GPU? Ask for a plan of a small shape. */
    int rc = make_desc(r, 1);
    if (rc) return rc;
    cuda_fp8_plan probe;
    r->lt_outer = plan_make(r, &probe, 256, 256, 16, NULL, NULL) == 0;
    if (r->lt_outer) cuda_lt_plan_release(&probe.lt);
    else if ((rc = make_desc(r, 0))) return rc;
    size_t b = (size_t)T * xbw;
    if (cudaMalloc((void **)&r->d_xq, b) != cudaSuccess || cudaMalloc((void **)&r->d_xs, (size_t)T * 4) != cudaSuccess ||
        (!r->lt_outer && cudaMalloc((void **)&r->d_f8tmp, (size_t)CUDA_FP8_CHUNK * outw * 4) != cudaSuccess)) {
        cuda_fail(r, __FILE__, __LINE__, "cudaMalloc(fp8 activations)", "out of device memory");
        return SPECD_ECUDA;
    }
    r->work_bytes += b + (size_t)T * 4 + (r->lt_outer ? 0 : (size_t)CUDA_FP8_CHUNK * outw * 4);
    if (!r->opts.quiet)
        fprintf(stderr, "cuda runner: FP8 projections: cuBLASLt E4M3 GEMMs, scales %s\n",
                r->lt_outer ? "in its epilogue (outer-vector mode)" : "by a kernel after it (no outer-vector mode)");
    return 0;
}

void cuda_fp8_free(cuda_runner *r) {
    if (r->fp8_plans)
        for (int i = 0; i < FP8_PLANS; i++) cuda_lt_plan_release(&r->fp8_plans[i].lt);
    free(r->fp8_plans);
    r->fp8_plans = NULL;
    if (r->lt_desc) cublasLtMatmulDescDestroy(r->lt_desc);
    if (r->lt) cublasLtDestroy(r->lt);
    r->lt_desc = NULL;
    r->lt = NULL;
    cudaFree(r->d_xq);
    cudaFree(r->d_xs);
    cudaFree(r->d_f8tmp);
    cuda_fp8_tune_done(r);
    r->d_xq = NULL;
    r->d_xs = r->d_f8tmp = NULL;
}

/* One cuBLASLt call: D [out, n] = (scaled) W^T X8 (+ beta C), C = D = Y. */
static int lt_matmul(cuda_runner *r, const uint8_t *W, const uint8_t *X8, int out, int in, int n, float *Y,
                     float beta) {
    cuda_fp8_plan tmp, *p = NULL;
    memset(&tmp, 0, sizeof tmp);
    int rc = plan_get(r, out, in, n, W, X8, &p, &tmp);
    if (rc) {
        cuda_fail(r, __FILE__, __LINE__, "cublasLtMatmulAlgoGetHeuristic", "no FP8 GEMM algorithm for this shape");
        return SPECD_ECUDA;
    }
    const float alpha = 1.f;
    const cuda_lt_plan *l = &p->lt;
    cublasStatus_t s = cublasLtMatmul(r->lt, r->lt_desc, &alpha, W, l->a, X8, l->b, &beta, Y, l->c, Y, l->c, &l->algo,
                                      r->blas_ws, r->blas_ws_bytes, r->stream);
    cuda_lt_plan_release(&tmp.lt);
    return s == CUBLAS_STATUS_SUCCESS ? 0 : lt_fail(r, __LINE__, "cublasLtMatmul", s);
}

/* cuBLASLt's FP8 layouts need widths that are 16-byte multiples (real models' are). */
static int lt_shape(int out, int in) { return in % 16 == 0 && out % 16 == 0; }

int cuda_fp8_gemm(cuda_runner *r, const uint8_t *W, const float *sw, int out, int in, const uint16_t *X, int n,
                  float *Y, float beta) {
    int rc;
    if (!lt_shape(out, in)) {
        /* the GEMV, K_GEMV_MAX_N tokens at a time, bf16 activations (tiny test models) */
        for (int t0 = 0; t0 < n; t0 += K_GEMV_MAX_N) {
            const int nc = n - t0 < K_GEMV_MAX_N ? n - t0 : K_GEMV_MAX_N;
            K_CHECK(r, k_gemv_w((k_wmat){W, sw}, X + (size_t)t0 * in, Y + (size_t)t0 * out, out, in, nc, beta != 0.f,
                                NULL, NULL, r->stream));
        }
        return 0;
    }
    K_CHECK(r, k_quant_fp8_rows(X, n, in, r->d_xq, r->d_xs, r->stream));
    if (r->lt_outer) {
        const void *pa = sw, *pb = r->d_xs;
        if ((rc = desc_set(r, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &pa, sizeof pa)) ||
            (rc = desc_set(r, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &pb, sizeof pb)))
            return rc;
        return lt_matmul(r, W, r->d_xq, out, in, n, Y, beta);
    }
    for (int t0 = 0; t0 < n; t0 += CUDA_FP8_CHUNK) {
        const int nc = n - t0 < CUDA_FP8_CHUNK ? n - t0 : CUDA_FP8_CHUNK;
        if ((rc = lt_matmul(r, W, r->d_xq + (size_t)t0 * in, out, in, nc, r->d_f8tmp, 0.f))) return rc;
        K_CHECK(r, k_fp8_scale_rows(r->d_f8tmp, sw, r->d_xs + t0, Y + (size_t)t0 * out, nc, out, beta != 0.f,
                                    r->stream));
    }
    return 0;
fail:
    return SPECD_ECUDA;
}

int cuda_fp8_chain_ok(const cuda_runner *r, int n, int out, int in) {
    return !r->lt_outer && n > K_GEMV_MAX_N && !r->tune.no_gemv && lt_shape(out, in);
}

int cuda_fp8_gemm_raw(cuda_runner *r, const uint8_t *W, int out, int in, const uint16_t *X, int n, float *Y,
                      int chunked) {
    if (X) K_CHECK(r, k_quant_fp8_rows(X, n, in, r->d_xq, r->d_xs, r->stream));
    const int step = chunked ? CUDA_FP8_CHUNK : n;
    for (int t0 = 0; t0 < n; t0 += step) {
        const int nc = n - t0 < step ? n - t0 : step, rc =
            lt_matmul(r, W, r->d_xq + (size_t)t0 * in, out, in, nc, Y + (size_t)t0 * out, 0.f);
        if (rc) return rc;
    }
    return 0;
fail:
    return SPECD_ECUDA;
}

int cuda_fp8_gemm_unscaled(cuda_runner *r, const uint8_t *W, int out, int in, const uint16_t *X, int n, float *Y) {
    return cuda_fp8_chain_ok(r, n, out, in) ? cuda_fp8_gemm_raw(r, W, out, in, X, n, Y, 0) : 1;
}
