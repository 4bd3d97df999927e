/* Mixture-of-experts layer timing (kernels/moe.cu) at Qwen3-30B-A3B's widths (hidden
 * 2048, 128 experts of 768, top 8), or the widths given: for each token count, a CUDA
 * graph of LAYERS MoE layers (distinct weights, so nothing stays in L2) is replayed and
 * the time per layer printed next to the bytes it had to read (router + the experts that
 * got rows, counted from the routing) and the bandwidth that makes.
 *
 *   bench_moe [E K hidden moe_ffn]
 *
 * BENCH_MOE_STAGES=1 or 2 times only the routing, or the routing and gate|up (both forms);
 * BENCH_MOE_N=n only n tokens.
 *
 * Forms: "one" is one token's layer in one launch (k_moe_decode1, SPECD_CUDA_MOE_ONE), "dec"
 * the decode path (k_moe_route_gemv, k_moe_gated_dec, k_moe_down_combine:
 * what the runner launches up to K_MOE_DEC_MAX_N tokens), "gen" the general one (router
 * GEMM on cuBLAS as the runner runs it above 2 rows, k_moe_route, k_moe_gemm twice,
 * k_moe_combine). Expert weights are a constant (timing only); router weights and inputs
 * are random, so routing spreads as in a real model. */
#include <cublas_v2.h>

#include "kernels/specd_kernels.h"
#include "tests/gpu/gpu_util.h"

#define LAYERS 16
#define REPS 20

typedef struct {
    uint16_t *wr[LAYERS], *wgu[LAYERS], *wdn[LAYERS];
} weights;

static int g_E = 128, g_K = 8, g_H = 2048, g_MF = 768, g_stages = 3;

/* k_moe_gemm's tcv_rows as the runner picks it for a decode pass of n rows (the tokens
 * here are independent rows): SPECD_MOE_TCV < 0 (default) every expert on the tensor-core
 * GEMV up to 16 rows an expert on average (cuda_step.c MOE_TCV_DECODE_ROWS), else that
 * many rows an expert. */
static int g_tcv = -1;
static int tcv_rows(int n) { return g_tcv >= 0 ? g_tcv : (long)n * g_K <= 16L * g_E ? n : 0; }

static float *g_part;   /* k_moe_decode1's scratch and barrier counter */
static unsigned *g_bar;

static void layer(const weights *w, int l, int n, int dec, cublasHandle_t blas, uint16_t *x, float *resid,
                  uint16_t *act, float *out, const k_moe_route_buf *b, cudaStream_t s) {
    if (dec == 2) {
        if (k_moe_decode1(w->wr[l], w->wgu[l], w->wdn[l], x, NULL, g_H, g_E, g_K, g_MF, 1, 0, b, g_part, g_bar, resid,
                          NULL, NULL, s))
            abort();
        return;
    }
    if (dec) {   /* g_stages < 3: only the first stages (their differences time each) */
        if (k_moe_route_gemv(w->wr[l], x, NULL, n, g_H, g_E, g_K, 1, b, s) ||
            (g_stages > 1 && k_moe_gated_dec(w->wgu[l], x, NULL, b, n, g_E, g_K, g_MF, g_H, 0, act, s)) ||
            (g_stages > 2 && k_moe_down_combine(w->wdn[l], act, b, n, g_K, g_H, g_MF, resid, NULL, s)))
            abort();
        return;
    }
    if (n <= 2) {
        if (k_gemv_bf16(w->wr[l], x, b->logits, g_E, g_H, n, 0, s)) abort();
    } else {
        const float one = 1.f, zero = 0.f;
        if (cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, g_E, n, g_H, &one, w->wr[l], CUDA_R_16BF, g_H, x,
                         CUDA_R_16BF, g_H, &zero, b->logits, CUDA_R_32F, g_E, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS)
            abort();
    }
    GPU_CHECK(cudaMemsetAsync(b->counts, 0, (size_t)g_E * 4, s));
    if (k_moe_route(b->logits, n, g_E, g_K, 1, b->ids, b->w, b->counts, b->rows, s) ||
        (g_stages > 1 && k_moe_gemm(w->wgu[l], x, g_K, b->rows, b->counts, n, g_E, g_MF, g_H, 1, 0, tcv_rows(n), NULL,
                                    act, s)) ||
        (g_stages > 2 &&
         k_moe_gemm(w->wdn[l], act, 1, b->rows, b->counts, n, g_E, g_H, g_MF, 0, 0, tcv_rows(n), out, NULL, s)) ||
        (g_stages > 2 && k_moe_combine(out, b->w, n, g_K, g_H, resid, s)))
        abort();
}

int main(int argc, char **argv) {
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        printf("bench_moe: no GPU\n");
        return 77;
    }
    if (getenv("BENCH_MOE_STAGES")) g_stages = atoi(getenv("BENCH_MOE_STAGES"));
    const int only_n = getenv("BENCH_MOE_N") ? atoi(getenv("BENCH_MOE_N")) : 0;   /* one token count only */
    k_tuning tune = k_tuning_default;   /* SPECD_MOE_R1 picks the single-token form, as for specd */
    if (getenv("SPECD_MOE_R1")) tune.moe_r1 = atoi(getenv("SPECD_MOE_R1"));
    if (getenv("SPECD_MOE_TCV")) g_tcv = atoi(getenv("SPECD_MOE_TCV"));   /* tcv_rows below */
    k_set_tuning(&tune);
    if (argc == 5) {
        g_E = atoi(argv[1]);
        g_K = atoi(argv[2]);
        g_H = atoi(argv[3]);
        g_MF = atoi(argv[4]);
    }
    const int NMAX = 256;
    uint64_t rng = 7;
    weights w;
    const size_t nr = (size_t)g_E * g_H, ngu = (size_t)g_E * 2 * g_MF * g_H, ndn = (size_t)g_E * g_H * g_MF;
    uint16_t *hr = malloc(nr * 2);
    for (int l = 0; l < LAYERS; l++) {
        for (size_t i = 0; i < nr; i++) hr[i] = gu_f2bf(gu_uniform(&rng, -0.1f, 0.1f));
        w.wr[l] = gu_upload(hr, nr * 2);
        GPU_CHECK(cudaMalloc((void **)&w.wgu[l], ngu * 2));
        GPU_CHECK(cudaMalloc((void **)&w.wdn[l], ndn * 2));
        GPU_CHECK(cudaMemset(w.wgu[l], 0x3c, ngu * 2));   /* bf16 0x3c3c: about 0.0115 */
        GPU_CHECK(cudaMemset(w.wdn[l], 0x3c, ndn * 2));
    }
    uint16_t *hx = malloc((size_t)NMAX * g_H * 2);
    for (size_t i = 0; i < (size_t)NMAX * g_H; i++) hx[i] = gu_f2bf(gu_uniform(&rng, -1, 1));
    uint16_t *x = gu_upload(hx, (size_t)NMAX * g_H * 2);
    float *resid = gu_dev((size_t)NMAX * g_H * 4), *out = gu_dev((size_t)NMAX * g_K * g_H * 4);
    uint16_t *act = gu_dev((size_t)NMAX * g_K * g_MF * 2);
    int32_t *cnt = gu_dev((size_t)(2 * g_E + 2) * 4);
    GPU_CHECK(cudaMemset(cnt, 0, (size_t)(2 * g_E + 2) * 4));
    k_moe_route_buf b = {.logits = gu_dev((size_t)NMAX * g_E * 4), .ids = gu_dev((size_t)NMAX * g_K * 4),
                         .w = gu_dev((size_t)NMAX * g_K * 4), .counts = cnt + 1, .rows = gu_dev((size_t)g_E * NMAX * 4),
                         .active = cnt + 1 + g_E, .done = (unsigned *)cnt};
    g_part = gu_dev(k_moe_decode1_part_floats(g_H) * 4);
    g_bar = gu_dev(4);
    GPU_CHECK(cudaMemset(g_bar, 0, 4));
    cublasHandle_t blas;
    cudaStream_t s;
    if (cublasCreate(&blas) != CUBLAS_STATUS_SUCCESS) abort();
    GPU_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cublasSetStream(blas, s);
    cudaEvent_t e0, e1;
    GPU_CHECK(cudaEventCreate(&e0));
    GPU_CHECK(cudaEventCreate(&e1));
    const double ebytes = 3.0 * g_MF * g_H * 2;   /* one expert's gate, up and down */
    printf("bench_moe: E %d, top %d, hidden %d, expert width %d, %d layers per graph, %d replays\n", g_E, g_K, g_H,
           g_MF, LAYERS, REPS);
    printf("%-4s %5s %10s %12s %10s %8s\n", "form", "n", "us/layer", "experts/lyr", "MB/layer", "GB/s");
    const int ns[] = {1, 2, 4, 8, 16, 64, 256};
    for (int dec = 2; dec >= 0; dec--)
        for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++) {
            const int n = ns[ni];
            if (dec && n > K_MOE_DEC_MAX_N) continue;
            if (dec == 2 && (n != 1 || k_moe_decode1_fits(g_H, g_E, g_K, g_MF))) continue;
            if (only_n && n != only_n) continue;
            /* distinct experts per layer, from one eager pass (counts of each layer) */
            double touched = 0;
            int32_t *hc = malloc((size_t)g_E * 4);
            for (int l = 0; l < LAYERS; l++) {
                layer(&w, l, n, dec, blas, x, resid, act, out, &b, s);
                GPU_CHECK(cudaStreamSynchronize(s));
                GPU_CHECK(cudaMemcpy(hc, b.counts, (size_t)g_E * 4, cudaMemcpyDeviceToHost));
                if (dec == 2) touched += g_K;   /* (no row lists: one token, K distinct experts) */
                else
                    for (int e = 0; e < g_E; e++) touched += hc[e] > 0;
            }
            free(hc);
            touched /= LAYERS;
            cudaGraph_t g;
            cudaGraphExec_t ge;
            GPU_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
            for (int l = 0; l < LAYERS; l++) layer(&w, l, n, dec, blas, x, resid, act, out, &b, s);
            GPU_CHECK(cudaStreamEndCapture(s, &g));
            GPU_CHECK(cudaGraphInstantiate(&ge, g, 0));
            GPU_CHECK(cudaGraphLaunch(ge, s));   /* warm-up */
            GPU_CHECK(cudaEventRecord(e0, s));
            for (int r = 0; r < REPS; r++) GPU_CHECK(cudaGraphLaunch(ge, s));
            GPU_CHECK(cudaEventRecord(e1, s));
            GPU_CHECK(cudaEventSynchronize(e1));
            float ms = 0;
            GPU_CHECK(cudaEventElapsedTime(&ms, e0, e1));
            const double us = ms * 1e3 / (REPS * LAYERS);
            const double mb = (touched * ebytes + (double)nr * 2) / 1e6;
            printf("%-4s %5d %10.2f %12.1f %10.1f %8.0f\n", dec == 2 ? "one" : dec ? "dec" : "gen", n, us, touched, mb,
                   mb / us * 1e3);
            GPU_CHECK(cudaGraphExecDestroy(ge));
            GPU_CHECK(cudaGraphDestroy(g));
        }
    return 0;
}
