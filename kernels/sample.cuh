/* Block-wide pieces of token selection shared by sample.cu (k_sample, k_probs) and
 * spec.cu (the draft's pick and the acceptance kernel): the argmax, the kept set of a
 * sampled row (top-k / top-p key threshold by radix select, min-p bound), and the draw
 * in index order. One copy, so a seeded draw is the same arithmetic in every kernel.
 * The block-wide ones (argmax, radix select, threshold, kept set, draw) hold barriers:
 * every thread of the block calls them, with the same arguments. */
#ifndef SPECD_SAMPLE_CUH
#define SPECD_SAMPLE_CUH

#include <math.h>
#include <cub/block/block_scan.cuh>

#include "kernels/specd_kernels.h"
#include "kernels/kutil.h"

/* Order-preserving integer key of an fp32 value (larger float, larger key). */
__device__ __forceinline__ uint32_t f2key(float f) {
    uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* Radix select over keys of x (restricted to keys >= floor_key): with by_mass == 0 the
 * key of the target-th largest element; with by_mass == 1 the largest key whose
 * descending cumulative mass exp((x - xmax) * invT) reaches target.
 * Most of a row's logits share a few top-byte buckets, so one shared histogram that every
 * thread adds to serialises its atomics on those few addresses (an H100 with a 128k
 * vocabulary: about 0.4 ms a select at one row). agg (k_tuning.sample_hist) gives each warp
 * its own histogram (no contention between warps), RS_LOADS loads in flight per lane, and
 * one atomic per bucket a warp's lanes share (their count; in mass mode their masses summed
 * by shuffles, where they fall in at most RS_MASS_GROUPS buckets); the warps' histograms
 * are summed in warp order, and in count mode the digit is found by a warp scan over lanes
 * of 8 buckets. Counts are integers, so the key is the same as the one-histogram form's;
 * in mass mode the sums' order differs, so a threshold that lands exactly on a bucket
 * boundary may differ in the last bit of its mass. Needs blockDim.x a multiple of 32, at
 * most RS_MAX_WARPS warps. */
#define RS_MAX_WARPS 16
#define RS_LOADS 8
#define RS_MASS_GROUPS 4
static __device__ uint32_t radix_select(const float *x, int vocab, uint32_t floor_key, float target,
                                        int by_mass, float xmax, float invT, float *hist, bool agg = false) {
    uint32_t prefix = 0, mask = 0;
    __shared__ uint32_t digit_s;
    __shared__ float remain_s;
    __shared__ float wh[RS_MAX_WARPS][256];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (threadIdx.x == 0) remain_s = target;
    for (int pass = 0; pass < 4; pass++) {
        const int shift = 24 - 8 * pass;
        if (agg) {
            for (int i = threadIdx.x; i < nw * 256; i += blockDim.x) wh[i >> 8][i & 255] = 0.f;
            __syncthreads();
            float *h = wh[warp];
            /* whole warps loop together; RS_LOADS loads in flight per lane before the
             * atomics (one block walks the whole row: latency, not bandwidth, binds) */
            for (int i0 = threadIdx.x - lane; i0 < vocab; i0 += blockDim.x * RS_LOADS) {
                float xv[RS_LOADS];
#pragma unroll
                for (int u = 0; u < RS_LOADS; u++) {
                    const int i = i0 + lane + u * (int)blockDim.x;
                    xv[u] = i < vocab ? x[i] : 0.f;
                }
#pragma unroll
                for (int u = 0; u < RS_LOADS; u++) {
                    const int i = i0 + lane + u * (int)blockDim.x;
                    uint32_t b = 0xffffffffu;
                    float v = 0.f;
                    if (i < vocab) {
                        const uint32_t key = f2key(xv[u]);
                        if (key >= floor_key && (key & mask) == prefix) {
                            b = (key >> shift) & 255u;
                            v = by_mass ? __expf((xv[u] - xmax) * invT) : 1.f;
                        }
                    }
                    const unsigned peers = __match_any_sync(0xffffffffu, b);
                    const bool lead = b != 0xffffffffu && lane == __ffs(peers) - 1;
                    if (!by_mass) {
                        if (lead) atomicAdd(&h[b], (float)__popc(peers));
                        continue;
                    }
                    /* mass: a few buckets (the common case: the top bytes): each one's
                     * masses summed across the warp (a shuffle tree), one atomic each;
                     * many: an atomic per lane */
                    unsigned leads = __ballot_sync(0xffffffffu, lead);
                    if (__popc(leads) > RS_MASS_GROUPS) {
                        if (b != 0xffffffffu) atomicAdd(&h[b], v);
                        continue;
                    }
                    while (leads) {
                        const int l = __ffs(leads) - 1;
                        const uint32_t bl = __shfl_sync(0xffffffffu, b, l);
                        float m = b == bl ? v : 0.f;
#pragma unroll
                        for (int o = 16; o > 0; o >>= 1) m += __shfl_xor_sync(0xffffffffu, m, o);
                        if (lane == l) atomicAdd(&h[bl], m);
                        leads &= leads - 1;
                    }
                }
            }
            __syncthreads();
            for (int i = threadIdx.x; i < 256; i += blockDim.x) {
                float t = 0.f;
                for (int w = 0; w < nw; w++) t += wh[w][i];
                hist[i] = t;
            }
        } else {
            for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0.f;
            __syncthreads();
            for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
                uint32_t key = f2key(x[i]);
                if (key < floor_key || (key & mask) != prefix) continue;
                float v = by_mass ? __expf((x[i] - xmax) * invT) : 1.f;
                atomicAdd(&hist[(key >> shift) & 255u], v);
            }
        }
        __syncthreads();
        if (agg && !by_mass) {
            /* warp 0: lane l holds buckets 255 - 8l down to 248 - 8l; integer counts, so
             * the scan's sums are exact and the digit is the serial loop's */
            if (warp == 0) {
                float c[8], own = 0.f;
#pragma unroll
                for (int e = 0; e < 8; e++) own += c[e] = hist[255 - 8 * lane - e];
                float incl = own;
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    const float t = __shfl_up_sync(0xffffffffu, incl, o);
                    if (lane >= o) incl += t;
                }
                const float rem = remain_s, before = incl - own;
                /* the first lane whose buckets reach rem (lane 31 at the latest: its last
                 * bucket, 0, is where the serial loop stops too) */
                const unsigned hit = __ballot_sync(0xffffffffu, incl >= rem) | 0x80000000u;
                if (lane == __ffs(hit) - 1) {
                    float cum = before;
                    int e = 0;
                    for (; e < 7; e++) {
                        if (cum + c[e] >= rem) break;
                        cum += c[e];
                    }
                    remain_s = rem - cum;
                    digit_s = (uint32_t)(255 - 8 * lane - e);
                }
            }
        } else if (threadIdx.x == 0) {
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

/* f over the four values of a 16-byte word whose first is x[i]. */
template <class F>
__device__ __forceinline__ void sample_visit4(const float4 &a, int i, F &f) {
    f(a.x, i);
    f(a.y, i + 1);
    f(a.z, i + 2);
    f(a.w, i + 3);
}

/* f(x[i], i) for the thread's share of a row, in increasing i. With vec (k_tuning.sample_vec)
 * and a 16-byte aligned row: 16-byte loads, four of them in flight before the first use
 * (a row is read by one block, so its passes are bound by load latency, not bandwidth:
 * an H100 profile timed the greedy sample of a 152k row with its logprob, two passes of
 * the scalar loop below, at ~28 us), then the last vocab % 4 entries; else one entry at
 * a time, the loop the kernels had before. */
template <int NT, class F>
__device__ __forceinline__ void sample_row_visit(const float *x, int vocab, bool vec, F f) {
    if (!vec || (uintptr_t)x % 16) {
        for (int i = threadIdx.x; i < vocab; i += NT) f(x[i], i);
        return;
    }
    const float4 *x4 = (const float4 *)x;
    const int v4 = vocab / 4;
    int j = threadIdx.x;
    for (; j + 3 * NT < v4; j += 4 * NT) {
        float4 a[4];
#pragma unroll
        for (int u = 0; u < 4; u++) a[u] = x4[j + u * NT];
#pragma unroll
        for (int u = 0; u < 4; u++) sample_visit4(a[u], (j + u * NT) * 4, f);
    }
    for (; j < v4; j += NT) sample_visit4(x4[j], 4 * j, f);
    for (int i = 4 * v4 + threadIdx.x; i < vocab; i += NT) f(x[i], i);
}

/* f(x[i], i) for i in [i0, i1) in order, one thread's contiguous chunk (top_n's): with v4
 * (x 16-byte aligned, i0 a multiple of 4) 16-byte loads, four in flight, then the
 * remaining entries one at a time; else one at a time throughout. */
template <class F>
__device__ __forceinline__ void sample_chunk_visit(const float *x, int i0, int i1, bool v4, F f) {
    int i = i0;
    if (v4) {
        for (; i + 16 <= i1; i += 16) {
            float4 a[4];
#pragma unroll
            for (int u = 0; u < 4; u++) a[u] = ((const float4 *)(x + i))[u];
#pragma unroll
            for (int u = 0; u < 4; u++) sample_visit4(a[u], i + 4 * u, f);
        }
    }
    for (; i < i1; i++) f(x[i], i);
}

/* Block-wide argmax of x (lowest index on ties, as engine/core/sample.c's sample_argmax),
 * and the max through *xmax unless it is NULL. wv and wi hold >= 32 entries of shared
 * memory; the leading barrier lets a caller reuse them in a loop. An all-NaN row returns
 * 0x7fffffff. */
template <int NT>
__device__ __forceinline__ int sample_block_argmax(const float *x, int vocab, float *wv, int *wi, float *xmax,
                                                   bool vec) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float best = -INFINITY;
    int bi = 0x7fffffff;
    /* a thread sees its entries in increasing index, so > keeps the first of equal ones */
    sample_row_visit<NT>(x, vocab, vec, [&](float v, int i) {
        if (v > best) { best = v; bi = i; }
    });
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
    }
    __syncthreads();
    if (lane == 0) { wv[warp] = best; wi[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        best = lane < NT / 32 ? wv[lane] : -INFINITY;
        bi = lane < NT / 32 ? wi[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
        }
        if (lane == 0) {
            if (xmax) wv[0] = best;
            wi[0] = bi;
        }
    }
    __syncthreads();
    if (xmax) *xmax = wv[0];
    const int r = wi[0];
    __syncthreads();
    return r;
}

/* Key threshold of the top-k and top-p filters (0: neither applies): the key of the
 * top_k-th largest logit, raised to the key where the descending mass of the tokens
 * that top-k keeps crosses top_p of their total. hist: 256 floats, red: 32 floats of
 * shared memory. */
template <int NT>
__device__ __forceinline__ uint32_t sample_threshold(const float *x, int vocab, const k_sample_params &p,
                                                     float xmax, float invT, float *hist, float *red, bool agg) {
    uint32_t thr = 0;
    if (p.top_k > 0 && p.top_k < vocab)
        thr = radix_select(x, vocab, 0, (float)p.top_k, 0, xmax, invT, hist, agg);
    if (p.top_p > 0.f && p.top_p < 1.f) {
        float zk = 0.f;
        for (int i = threadIdx.x; i < vocab; i += NT)
            if (f2key(x[i]) >= thr) zk += __expf((x[i] - xmax) * invT);
        zk = k_block_sum(zk, red);
        uint32_t tp = radix_select(x, vocab, thr, p.top_p * zk, 1, xmax, invT, hist, agg);
        if (tp > thr) thr = tp;
    }
    return thr;
}

/* The kept set of a sampled row: token i is kept when its key reaches thr and z = (x_i -
 * xmax) / T reaches the min-p bound zmin; its unnormalised weight is exp(z). */
struct sample_keep {
    const float *x;
    float xmax, invT, zmin;
    uint32_t thr;
    __device__ __forceinline__ float z(float xi) const { return (xi - xmax) * invT; }
    __device__ __forceinline__ bool kept(float xi, float z) const { return f2key(xi) >= thr && z >= zmin; }
    /* As sample_block_draw takes it: whether token i is kept; w is its weight, 0 when it
     * is not. */
    __device__ __forceinline__ bool operator()(int i, float &w) const {
        const float xi = x[i], zi = z(xi);
        if (kept(xi, zi)) {
            w = __expf(zi);
            return true;
        }
        w = 0.f;
        return false;
    }
};

/* The kept set of row x (max xmax) under p, which samples (temperature > 0). */
template <int NT>
__device__ __forceinline__ sample_keep sample_kept_set(const float *x, int vocab, const k_sample_params &p,
                                                       float xmax, float *hist, float *red, bool agg = false) {
    sample_keep k;
    k.x = x;
    k.xmax = xmax;
    k.invT = 1.f / p.temperature;
    k.thr = sample_threshold<NT>(x, vocab, p, xmax, k.invT, hist, red, agg);
    /* min_p: p_i >= min_p * p_max  <=>  (x_i - xmax) / T >= log(min_p). */
    k.zmin = p.min_p > 0.f ? logf(p.min_p) : -INFINITY;
    return k;
}

/* Draw one index of [0, n) at u * (total weight), u in [0, 1), locating it by a
 * block-wide prefix sum in index order over contiguous chunks. weight(i, w) says whether
 * i is kept and sets its weight w, which is 0 for an index not kept: the locating pass
 * adds the weight of every index of its chunk. The total goes to *total_out. */
template <int NT, typename W>
__device__ __forceinline__ int sample_block_draw(int n, const W &weight, float u, int none, float *total_out) {
    typedef cub::BlockScan<float, NT> Scan;
    __shared__ typename Scan::TempStorage scan_tmp;
    __shared__ int pick_s;
    __shared__ int lk_s[NT / 32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int chunk = (n + NT - 1) / NT;
    const int i0 = tid * chunk, i1 = min(n, i0 + chunk);
    float local = 0.f;
    int last = -1;
    for (int i = i0; i < i1; i++) {   /* last: the last index of positive weight (a kept
                                        * index may weigh 0: a grammar's -inf, an underflow) */
        float w;
        if (weight(i, w) && w > 0.f) { local += w; last = i; }
    }
    float excl, total;
    __syncthreads();   /* scan_tmp and pick_s may still be read by a previous call */
    Scan(scan_tmp).ExclusiveSum(local, excl, total);
    if (tid == 0) pick_s = -1;
    __syncthreads();
    *total_out = total;
    const float ut = u * total;
    if (local > 0.f && ut >= excl && ut < excl + local) {
        float c = excl;
        int pick = last;
        for (int i = i0; i < i1; i++) {
            float w;
            weight(i, w);
            c += w;
            if (ut < c) { pick = i; break; }
        }
        pick_s = pick;
    }
    __syncthreads();
    if (pick_s < 0) {
        /* u * total fell past the float sum by rounding: the last index of positive
         * weight, or `none` when there is none. */
        int lk = last;
        for (int o = 16; o > 0; o >>= 1) lk = max(lk, __shfl_xor_sync(0xffffffffu, lk, o));
        if (lane == 0) lk_s[warp] = lk;
        __syncthreads();
        if (tid == 0) {
            int m = -1;
            for (int v = 0; v < NT / 32; v++) m = max(m, lk_s[v]);
            pick_s = m >= 0 ? m : none;
        }
    }
    __syncthreads();
    const int r = pick_s;
    __syncthreads();
    return r;
}

#endif
