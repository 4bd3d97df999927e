/* On-device token selection: greedy argmax or seeded sampling with temperature, top-k,
 * top-p and min-p, one block per row. Thresholds are found without sorting: top-k and
 * top-p by a 4-pass 8-bit radix select over an order-preserving integer key of the fp32
 * logit (the k-th largest key, and the key where the descending mass crosses top_p),
 * min-p directly. The draw is u * (kept mass) located by a block-wide prefix sum in index
 * order, with u from Philox4x32-10 at (seed, counter), so a request with a fixed seed
 * draws the same tokens on every run and batch composition. The block-wide pieces (argmax,
 * thresholds, draw) are in sample.cuh, which spec.cu's draft pick and acceptance share. */
#include <math.h>

#include "kernels/specd_kernels.h"
#include "kernels/kutil.h"
#include "kernels/sample.cuh"

#define SAMPLE_NT 512

__global__ void __launch_bounds__(SAMPLE_NT)
sample_kernel(const float *logits, int vocab, const k_sample_params *params,
              int32_t *out_tok, float *out_logprob) {
    __shared__ float hist[256];
    __shared__ float red[32];
    __shared__ float wv[32];
    __shared__ int wi[32];

    const int row = blockIdx.x, tid = threadIdx.x;
    const float *x = logits + (size_t)row * vocab;
    const k_sample_params p = params[row];

    /* 1. max + argmax (lowest index on ties), then log-sum-exp for the logprob. */
    float xmax;
    const int argmax = sample_block_argmax<SAMPLE_NT>(x, vocab, wv, wi, &xmax);

    int tok = argmax;
    const int greedy = !(p.temperature > 0.f) || p.top_k == 1;
    if (!greedy) {
        const sample_keep keep = sample_kept_set<SAMPLE_NT>(x, vocab, p, xmax, hist, red);
        float total;
        tok = sample_block_draw<SAMPLE_NT>(vocab, keep, k_philox_u01(p.seed, p.counter), argmax, &total);
    }

    if (out_logprob) {
        float se = 0.f;
        for (int i = tid; i < vocab; i += SAMPLE_NT) se += __expf(x[i] - xmax);
        se = k_block_sum(se, red);
        if (tid == 0) out_logprob[row] = x[tok] - xmax - logf(se);
    }
    if (tid == 0) out_tok[row] = tok;
}

extern "C" int k_sample(const float *logits, int n, int vocab, const k_sample_params *p,
                        int32_t *out_tok, float *out_logprob, cudaStream_t s) {
    if (n < 0 || vocab <= 0) return -1;
    if (n == 0) return 0;
    sample_kernel<<<n, SAMPLE_NT, 0, s>>>(logits, vocab, p, out_tok, out_logprob);
    return K_LAUNCH_RESULT();
}

/* The distribution sample_kernel draws from, written out: probs[r, i] = exp((x_i -
 * xmax) / T) / kept mass for kept tokens, else 0. Rows whose parameters are greedy are
 * left untouched (the speculative step reads their logits with an argmax). probs may
 * alias logits: each block reads its row fully before it writes. */
__global__ void __launch_bounds__(SAMPLE_NT)
probs_kernel(const float *logits, float *probs, int vocab, const k_sample_params *params,
             int rows_per_param) {
    __shared__ float hist[256];
    __shared__ float red[32];
    const int row = blockIdx.x, tid = threadIdx.x;
    const k_sample_params p = params[row / rows_per_param];
    if (!(p.temperature > 0.f) || p.top_k == 1) return;
    const float *x = logits + (size_t)row * vocab;
    float *y = probs + (size_t)row * vocab;
    float m = -INFINITY;
    for (int i = tid; i < vocab; i += SAMPLE_NT) m = fmaxf(m, x[i]);
    m = k_warp_max(m);
    __syncthreads();
    if ((tid & 31) == 0) red[tid >> 5] = m;
    __syncthreads();
    m = (tid & 31) < SAMPLE_NT / 32 ? red[tid & 31] : -INFINITY;
    const float xmax = k_warp_max(m);
    __syncthreads();
    const sample_keep keep = sample_kept_set<SAMPLE_NT>(x, vocab, p, xmax, hist, red);
    float tot = 0.f;
    for (int i = tid; i < vocab; i += SAMPLE_NT) {
        float z = keep.z(x[i]);
        if (keep.kept(x[i], z)) tot += __expf(z);
    }
    tot = k_block_sum(tot, red);
    __syncthreads();
    const float inv = 1.f / tot;
    for (int i = tid; i < vocab; i += SAMPLE_NT) {
        float xi = x[i], z = keep.z(xi);
        y[i] = keep.kept(xi, z) ? __expf(z) * inv : 0.f;
    }
}

extern "C" int k_probs(const float *logits, float *probs, int n, int vocab,
                       const k_sample_params *p, int rows_per_param, cudaStream_t s) {
    if (n < 0 || vocab <= 0 || rows_per_param < 1) return -1;
    if (n == 0) return 0;
    probs_kernel<<<n, SAMPLE_NT, 0, s>>>(logits, probs, vocab, p, rows_per_param);
    return K_LAUNCH_RESULT();
}
