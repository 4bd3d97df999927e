/* On-device token selection: greedy argmax or seeded sampling with temperature, top-k,
 * top-p and min-p, one block per row. Thresholds are found without sorting: top-k and
 * top-p by a 4-pass 8-bit radix select over an order-preserving integer key of the fp32
 * logit (the k-th largest key, and the key where the descending mass crosses top_p),
 * min-p directly. The draw is u * (kept mass) located by a block-wide prefix sum in index
 * order, with u from Philox4x32-10 at (seed, counter), so a request with a fixed seed
 * draws the same tokens on every run and batch composition. */
#include <math.h>
#include <cub/block/block_scan.cuh>

#include "kernels/specd_kernels.h"
#include "kernels/kutil.h"

#define SAMPLE_NT 512

__device__ __forceinline__ uint32_t f2key(float f) {
    uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* Radix select over keys of x (restricted to keys >= floor_key): with by_mass == 0 the
 * key of the target-th largest element; with by_mass == 1 the largest key whose
 * descending cumulative mass exp((x - xmax) * invT) reaches target. */
__device__ uint32_t radix_select(const float *x, int vocab, uint32_t floor_key, float target,
                                 int by_mass, float xmax, float invT, float *hist) {
    uint32_t prefix = 0, mask = 0;
    __shared__ uint32_t digit_s;
    __shared__ float remain_s;
    if (threadIdx.x == 0) remain_s = target;
    for (int pass = 0; pass < 4; pass++) {
        int shift = 24 - 8 * pass;
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0.f;
        __syncthreads();
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            uint32_t key = f2key(x[i]);
            if (key < floor_key || (key & mask) != prefix) continue;
            float v = by_mass ? __expf((x[i] - xmax) * invT) : 1.f;
            atomicAdd(&hist[(key >> shift) & 255u], v);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float cum = 0.f, rem = remain_s;
            int d = 255;
            for (; d > 0; d--) {
                if (cum + hist[d] >= rem) break;
                cum += hist[d];
            }
            remain_s = rem - cum;
            digit_s = (uint32_t)d;
        }
        __syncthreads();
        prefix |= digit_s << shift;
        mask |= 255u << shift;
    }
    return prefix;
}

__global__ void __launch_bounds__(SAMPLE_NT)
sample_kernel(const float *logits, int vocab, const k_sample_params *params,
              int32_t *out_tok, float *out_logprob) {
    typedef cub::BlockScan<float, SAMPLE_NT> Scan;
    __shared__ typename Scan::TempStorage scan_tmp;
    __shared__ float hist[256];
    __shared__ float red[32];
    __shared__ float wv[32];
    __shared__ int wi[32];
    __shared__ int pick_s;

    const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float *x = logits + (size_t)row * vocab;
    const k_sample_params p = params[row];

    /* 1. max + argmax (lowest index on ties), then log-sum-exp for the logprob. */
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = tid; i < vocab; i += SAMPLE_NT) {
        float v = x[i];
        if (v > best) { best = v; bi = i; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
    }
    if (lane == 0) { wv[warp] = best; wi[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        best = lane < SAMPLE_NT / 32 ? wv[lane] : -INFINITY;
        bi = lane < SAMPLE_NT / 32 ? wi[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
        }
        if (lane == 0) { wv[0] = best; wi[0] = bi; }
    }
    __syncthreads();
    const float xmax = wv[0];
    const int argmax = wi[0];
    __syncthreads();

    int tok = argmax;
    const int greedy = !(p.temperature > 0.f) || p.top_k == 1;
    if (!greedy) {
        const float invT = 1.f / p.temperature;
        uint32_t thr = 0;
        if (p.top_k > 0 && p.top_k < vocab)
            thr = radix_select(x, vocab, 0, (float)p.top_k, 0, xmax, invT, hist);
        if (p.top_p > 0.f && p.top_p < 1.f) {
            float zk = 0.f;
            for (int i = tid; i < vocab; i += SAMPLE_NT)
                if (f2key(x[i]) >= thr) zk += __expf((x[i] - xmax) * invT);
            zk = k_block_sum(zk, red);
            uint32_t tp = radix_select(x, vocab, thr, p.top_p * zk, 1, xmax, invT, hist);
            if (tp > thr) thr = tp;
        }
        /* min_p: p_i >= min_p * p_max  <=>  (x_i - xmax) / T >= log(min_p). */
        const float zmin = p.min_p > 0.f ? logf(p.min_p) : -INFINITY;

        /* Kept mass over contiguous chunks, prefix-summed in index order. */
        const int chunk = (vocab + SAMPLE_NT - 1) / SAMPLE_NT;
        const int i0 = tid * chunk, i1 = min(vocab, i0 + chunk);
        float local = 0.f;
        int last_kept = -1;
        for (int i = i0; i < i1; i++) {
            float z = (x[i] - xmax) * invT;
            if (f2key(x[i]) >= thr && z >= zmin) { local += __expf(z); last_kept = i; }
        }
        float excl, total;
        Scan(scan_tmp).ExclusiveSum(local, excl, total);
        if (tid == 0) pick_s = -1;
        __syncthreads();
        const float u = k_philox_u01(p.seed, p.counter) * total;
        if (local > 0.f && u >= excl && u < excl + local) {
            float c = excl;
            int pick = last_kept;
            for (int i = i0; i < i1; i++) {
                float z = (x[i] - xmax) * invT;
                if (!(f2key(x[i]) >= thr && z >= zmin)) continue;
                c += __expf(z);
                if (u < c) { pick = i; break; }
            }
            pick_s = pick;
        }
        __syncthreads();
        if (pick_s < 0) {
            /* u fell past the float total by rounding: take the last kept token. */
            int lk = last_kept;
            for (int o = 16; o > 0; o >>= 1) lk = max(lk, __shfl_xor_sync(0xffffffffu, lk, o));
            if (lane == 0) wi[warp] = lk;
            __syncthreads();
            if (tid == 0) {
                int m = -1;
                for (int w = 0; w < SAMPLE_NT / 32; w++) m = max(m, wi[w]);
                pick_s = m >= 0 ? m : argmax;
            }
            __syncthreads();
        }
        tok = pick_s;
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
    const float invT = 1.f / p.temperature;
    uint32_t thr = 0;
    if (p.top_k > 0 && p.top_k < vocab)
        thr = radix_select(x, vocab, 0, (float)p.top_k, 0, xmax, invT, hist);
    if (p.top_p > 0.f && p.top_p < 1.f) {
        float zk = 0.f;
        for (int i = tid; i < vocab; i += SAMPLE_NT)
            if (f2key(x[i]) >= thr) zk += __expf((x[i] - xmax) * invT);
        zk = k_block_sum(zk, red);
        uint32_t tp = radix_select(x, vocab, thr, p.top_p * zk, 1, xmax, invT, hist);
        if (tp > thr) thr = tp;
    }
    const float zmin = p.min_p > 0.f ? logf(p.min_p) : -INFINITY;
    float tot = 0.f;
    for (int i = tid; i < vocab; i += SAMPLE_NT) {
        float z = (x[i] - xmax) * invT;
        if (f2key(x[i]) >= thr && z >= zmin) tot += __expf(z);
    }
    tot = k_block_sum(tot, red);
    __syncthreads();
    const float inv = 1.f / tot;
    for (int i = tid; i < vocab; i += SAMPLE_NT) {
        float xi = x[i], z = (xi - xmax) * invT;
        y[i] = f2key(xi) >= thr && z >= zmin ? __expf(z) * inv : 0.f;
    }
}

extern "C" int k_probs(const float *logits, float *probs, int n, int vocab,
                       const k_sample_params *p, int rows_per_param, cudaStream_t s) {
    if (n < 0 || vocab <= 0 || rows_per_param < 1) return -1;
    if (n == 0) return 0;
    probs_kernel<<<n, SAMPLE_NT, 0, s>>>(logits, probs, vocab, p, rows_per_param);
    return K_LAUNCH_RESULT();
}
