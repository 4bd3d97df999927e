/* Skinny GEMM for decode (n <= 8 rows of activations): Y[t, o] (+)= sum_k W[o, k] X[t, k],
 * W [out, in] bf16 or FP8 E4M3 with a scale per row (k_wmat: 8-byte loads of 8 codes,
 * converted two per cvt; the scale multiplies the finished dot), X [n, in] bf16, Y [n, out]
 * fp32, fp32 accumulation. At batch 1-8 a
 * decode step is a stream over every weight once, so these kernels are written for memory
 * bandwidth: one warp per output row, 16-byte weight loads marked streaming (they are
 * read once per step and must not evict the activations), four loads in flight per lane
 * before any arithmetic, and the first of them issued before the programmatic-launch
 * wait, so a GEMV starts pulling its weights while the kernel before it finishes.
 *
 * At batch 1 the kernels between the GEMVs cost about as much as their own work (a launch,
 * a ramp and a drain each), so the batch-1/2 path folds two of them into GEMV epilogues:
 *   - gated: a warp computes gate row o and up row F + o and writes silu(gate) * up;
 *   - rope: a warp computes the rotate_half pair (i, i + D/2) of a q/k/v head, adds the
 *     bias, rotates and writes q (fp32) and k, v (into the paged pool).
 *   - norm (k_norm_out / k_norm_in, see specd_kernels.h): the GEMV that adds into the
 *     residual writes bf16(h * g) and atomically sums h^2 per row; the GEMV after it
 *     scales its dots by rsqrt(mean + eps), so no RMSNorm kernel runs between them. The
 *     sums are integers (fixed point): added in any order they give the same bits, so a
 *     step stays deterministic (float atomics made greedy runs differ after ~100 tokens).
 *     Two earlier forms were slower on an H200: normalising inside every block of the
 *     consuming GEMV before its loads (each block re-reads and re-reduces the residual)
 *     and in the last block of the producing one (a serial tail of a few microseconds). */
#include "kernels/specd_kernels.h"
#include "kernels/kutil.h"
#include "kernels/rope.cuh"
#include "kernels/tc.cuh"

#define GEMV_WARPS 8
#define GEMV_UNROLL 4

/* acc += (8 weights, unpacked) . (8 activations, packed) for the NB activation rows. */
template <int NB, bool TWO>
__device__ __forceinline__ void fma8(const float (&w1)[8], const float (&w2)[8], const uint4 *X, size_t xs8,
                                     float (&a1)[NB], float (&a2)[NB]) {
#pragma unroll
    for (int b = 0; b < NB; b++) {
        float x[8];
        k_bf16x8(X[b * xs8], x);   /* once per row of X, for both weight rows */
#pragma unroll
        for (int e = 0; e < 8; e++) {
            a1[b] = fmaf(w1[e], x[e], a1[b]);
            if (TWO) a2[b] = fmaf(w2[e], x[e], a2[b]);
        }
    }
}

/* Weight words of 8 elements: uint4 = 8 bf16, uint2 = 8 FP8 E4M3 (k_wmat with a scale per
 * row, applied to the finished dots in the epilogue). */
__device__ __forceinline__ void w_unpack(const uint4 &v, float (&f)[8]) { k_bf16x8(v, f); }
__device__ __forceinline__ void w_unpack(const uint2 &v, float (&f)[8]) { k_fp8x8(v, f); }
__device__ __forceinline__ uint4 w_bf16(const uint4 &v) { return v; }
__device__ __forceinline__ uint4 w_bf16(const uint2 &v) { return k_fp8x8_bf16(v); }

/* a1[b] += W1[0:len8) . X[b, 0:len8) (and a2 with W2 when TWO) for one warp (X rows xs8
 * uint4 apart). Both weight rows stream in the same loop, so each activation load and
 * its unpacking serve both (at batch 2 the unpacking, not the memory, was the limit).
 * p1 / p2 hold the first GEMV_UNROLL loads (issued by the caller, possibly before the
 * PDL wait). */
template <int NB, bool TWO, typename WV, int U = GEMV_UNROLL>
__device__ __forceinline__ void warp_rows_dot(const WV *__restrict__ w1, const WV *__restrict__ w2,
                                              const uint4 *X, int len8, int xs8, int lane, WV (&p1)[U],
                                              WV (&p2)[U], float (&a1)[NB], float (&a2)[NB]) {
    int k = lane;
    bool first = true;
    float f1[8], f2[8];
    for (; k + 32 * (U - 1) < len8; k += 32 * U) {
        WV v1[U], v2[U];
        if (first) {
#pragma unroll
            for (int u = 0; u < U; u++) {
                v1[u] = p1[u];
                if (TWO) v2[u] = p2[u];
            }
            first = false;
        } else {
#pragma unroll
            for (int u = 0; u < U; u++) {
                v1[u] = __ldcs(w1 + k + 32 * u);
                if (TWO) v2[u] = __ldcs(w2 + k + 32 * u);
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            w_unpack(v1[u], f1);
            if (TWO) w_unpack(v2[u], f2);
            fma8<NB, TWO>(f1, f2, X + k + 32 * u, xs8, a1, a2);
        }
    }
    for (; k < len8; k += 32) {
        w_unpack(__ldcs(w1 + k), f1);
        if (TWO) w_unpack(__ldcs(w2 + k), f2);
        fma8<NB, TWO>(f1, f2, X + k, xs8, a1, a2);
    }
}

/* The first GEMV_UNROLL loads of a row (only when the row has a full first group). */
template <typename WV, int U = GEMV_UNROLL>
__device__ __forceinline__ void prefetch_row(const WV *__restrict__ w, int in8, int lane, WV (&w0)[U]) {
    if (lane + 32 * (U - 1) < in8) {
#pragma unroll
        for (int u = 0; u < U; u++) w0[u] = __ldcs(w + lane + 32 * u);
    }
}

enum { EPI_PLAIN, EPI_GATED, EPI_ROPE };

/* Everything an epilogue may need (passed by value; unused fields are zero). */
typedef struct {
    float *Y;
    int out, accumulate;
    const float *wscale;   /* FP8 weights: each matrix row's scale; NULL for bf16 */
    /* norm fold: consumer (ss_in: scale the dots) and producer (EPI_PLAIN + accumulate) */
    const unsigned long long *ss_in;
    float eps, inv_in;
    const float *g_out;
    uint16_t *xg;
    unsigned long long *ss_out;
    /* EPI_GATED */
    uint16_t *act;
    /* EPI_ROPE */
    const float *bias, *inv_freq;
    float *q_out;
    int H, KVH, D;
    k_kv_geom g;
} gemv_epi;

/* Output rows of unit u: plain u; gated (u, F + u); rope: the pair (i, i + D/2) of head
 * u / (D/2). */
template <int MODE>
__device__ __forceinline__ void unit_rows(const gemv_epi &e, int u, int &r1, int &r2) {
    if (MODE == EPI_GATED) {
        r1 = u;
        r2 = e.out + u;
    } else if (MODE == EPI_ROPE) {
        int half = e.D / 2;
        r1 = (u / half) * e.D + u % half;
        r2 = r1 + half;
    } else {
        r1 = r2 = u;
    }
}

/* n_units = out (plain), F (gated), (H + 2KVH) * D / 2 (rope). KS warps share a unit,
 * each dotting one contiguous KS-th of the input (split-K inside the block, summed through
 * shared memory): a projection with few rows (O, down, QKV at batch 1) still puts enough
 * warps -- and loads -- in flight to stream at full bandwidth. */
template <int NB, int MODE, int KS, typename WV>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_kernel(const WV *__restrict__ W, const uint4 *__restrict__ X, int n_units, int in8, gemv_epi e) {
    constexpr bool TWO = MODE != EPI_PLAIN;
    constexpr int UPB = GEMV_WARPS / KS;   /* units per block */
    k_pdl_trigger();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, ks = warp % KS;
    const int u = blockIdx.x * UPB + warp / KS;
    const bool live = u < n_units;
    const int len8 = in8 / KS, k0 = ks * len8;
    int r1 = 0, r2 = 0;
    if (live) unit_rows<MODE>(e, u, r1, r2);
    const WV *w1p = W + (size_t)r1 * in8 + k0, *w2p = W + (size_t)r2 * in8 + k0;
    WV w1[GEMV_UNROLL], w2[GEMV_UNROLL];
    /* what the epilogue of lane b < NB of the unit's first warp reads, loaded early so
     * the tail does not wait on L2: the next norm's weight (a weight: before the wait),
     * the residual row, the sum of squares and the rotary / KV-write inputs (after it) */
    const bool writer = live && ks == 0 && lane < NB;
    const int b_own = lane < NB ? lane : 0;
    float g_own = 0.f, y_own = 0.f, rs_own = 1.f;
    if (live) {
        prefetch_row(w1p, len8, lane, w1);
        if (TWO) prefetch_row(w2p, len8, lane, w2);
    }
    if (MODE == EPI_PLAIN && e.xg && writer) g_own = e.g_out[r1];
    float s1 = 1.f, s2 = 1.f;   /* FP8 row scales (constant weights: before the wait) */
    if (e.wscale && writer) {
        s1 = e.wscale[r1];
        if (TWO) s2 = e.wscale[r2];
    }
    k_pdl_wait();
    if (MODE == EPI_PLAIN && e.accumulate && writer) y_own = e.Y[(size_t)b_own * e.out + r1];
    if (e.ss_in && writer) rs_own = rsqrtf(k_ss_value(e.ss_in[b_own]) * e.inv_in + e.eps);
    rope_pair_pre rp;
    if (MODE == EPI_ROPE && writer)
        rope_pair_prepare(e.g, e.bias, e.inv_freq, e.H, e.KVH, e.D, b_own, r1 / e.D, r1 % e.D, rp);
    float a1[NB], a2[NB];
#pragma unroll
    for (int b = 0; b < NB; b++) a1[b] = a2[b] = 0.f;
    if (live) {
        warp_rows_dot<NB, TWO, WV>(w1p, w2p, X + k0, len8, in8, lane, w1, w2, a1, a2);
#pragma unroll
        for (int b = 0; b < NB; b++) {
            a1[b] = k_warp_sum(a1[b]);
            if (TWO) a2[b] = k_warp_sum(a2[b]);
        }
    }
    if (KS > 1) {   /* the unit's first warp gathers the other slices' sums */
        __shared__ float part[GEMV_WARPS][NB][2];
        if (lane == 0)
#pragma unroll
            for (int b = 0; b < NB; b++) {
                part[warp][b][0] = a1[b];
                part[warp][b][1] = a2[b];
            }
        __syncthreads();
        if (ks == 0)
#pragma unroll
            for (int b = 0; b < NB; b++)
#pragma unroll
                for (int j = 1; j < KS; j++) {
                    a1[b] += part[warp + j][b][0];
                    a2[b] += part[warp + j][b][1];
                }
    }
    float hh = 0.f;   /* h^2 of this lane's updated residual element (norm fold) */
    if (writer) {
        /* lane b writes token b's results */
#pragma unroll
        for (int b = 0; b < NB; b++) {
            if (lane != b) continue;
            a1[b] *= rs_own * s1;   /* bf16: s = 1, the same bits as rs_own alone */
            a2[b] *= rs_own * s2;
            if (MODE == EPI_PLAIN) {
                const float h = y_own + a1[b];
                e.Y[(size_t)b * e.out + r1] = h;
                if (e.xg) {
                    e.xg[(size_t)b * e.out + r1] = k_f2bf(h * g_own);
                    hh = h * h;
                }
            } else if (MODE == EPI_GATED) {
                e.act[(size_t)b * e.out + u] = k_f2bf(k_silu(a1[b]) * a2[b]);
            } else {
                rope_store_pair(rp, e.q_out, e.H, e.D, b, r1 / e.D, r1 % e.D, a1[b], a2[b]);
            }
        }
    }
    if (MODE == EPI_PLAIN && e.xg) {   /* the block's sums of h^2, one atomic per row (fixed point) */
        __shared__ float hs[GEMV_WARPS][NB];
        if (lane < NB) hs[warp][lane] = hh;
        __syncthreads();
        if (threadIdx.x < NB) {
            float t = 0.f;
#pragma unroll
            for (int j = 0; j < GEMV_WARPS; j++) t += hs[j][threadIdx.x];
            atomicAdd(e.ss_out + threadIdx.x, k_ss_units(t));
        }
    }
}

static int gemv_shape_ok(const void *W, const uint16_t *X, int in, int n, int max_n) {
    return in > 0 && in % 8 == 0 && n >= 1 && n <= max_n && ((uintptr_t)W | (uintptr_t)X) % 16 == 0;
}

/* Warps per unit: split K until there are about 32 warps per multiprocessor, as long as
 * each warp keeps a full group of GEMV_UNROLL loads per lane. Measured on an H200 (batch
 * 1, `specd bench`): no split 4.62 / 1.02 ms per 8B / 1B token, 32 warps per SM 4.45 /
 * 0.955, 96 warps per SM 4.55 / 0.99. */
static int gemv_ksplit(int n_units, int in8) {
    const long want = (long)k_sm_count() * 32;
    int ks = 1;
    while (ks < 8 && (long)n_units * ks < want && in8 % (2 * ks) == 0 && in8 / (2 * ks) >= 32 * GEMV_UNROLL) ks *= 2;
    return ks;
}

template <int NB, int MODE, typename WV>
static int gemv_launch_ks(const WV *w, const uint4 *x, int n_units, int in8, const gemv_epi &e, cudaStream_t s) {
    const dim3 block(GEMV_WARPS * 32);
#define GEMV_KS_CASE(K)                                                                                     \
    case K:                                                                                                 \
        return k_launch(gemv_kernel<NB, MODE, K, WV>, dim3((n_units + GEMV_WARPS / K - 1) / (GEMV_WARPS / K)), \
                        block, 0, s, w, x, n_units, in8, e)
    switch (gemv_ksplit(n_units, in8)) {
        GEMV_KS_CASE(8);
        GEMV_KS_CASE(4);
        GEMV_KS_CASE(2);
    default:
        return k_launch(gemv_kernel<NB, MODE, 1, WV>, dim3((n_units + GEMV_WARPS - 1) / GEMV_WARPS), block, 0, s, w,
                        x, n_units, in8, e);
    }
#undef GEMV_KS_CASE
}

/* ---- tensor-core form, 3..8 token rows ---------------------------------------------------
 * Past two rows the FMA form above is bound by its fp32 arithmetic, not by memory (an 8B
 * projection at 8 rows took twice cuBLAS's time), so 3..8 rows go through mma.sync
 * m16n8k16: a warp computes 16 output rows ("items") for all (up to 8) tokens, the
 * activations zero-padded to 8 columns. The loads stay 16-byte and streaming: k is
 * permuted inside each group of 32 (the same permutation for W and X, so the dot products
 * are unchanged): lane (g = lane / 4, q = lane % 4) loads 8 bf16 of W rows g and g + 8 and
 * of token g's X at offset 8q, which are its fragments for two mma steps (words x, y for
 * the first, z, w for the second). Units, split K and the epilogues (norm fold, gated,
 * rope) are those of the FMA form, per (item, token) of the accumulator fragment: lane
 * holds items g, g + 8 for tokens 2q, 2q + 1. Needs in % 32 == 0. */
#define TCG_ITEMS 16

/* Matrix rows of item j (which must be < items): first (and second, gated / rope). */
template <int MODE>
__device__ __forceinline__ void tc_item_rows(const gemv_epi &e, int j, int &r1, int &r2) {
    if (MODE == EPI_GATED) {
        r1 = j;
        r2 = e.out + j;
    } else if (MODE == EPI_ROPE) {
        const int half = e.D / 2;
        r1 = (j / half) * e.D + j % half;
        r2 = r1 + half;
    } else {
        r1 = r2 = j;
    }
}

__device__ __forceinline__ void tc_mma_group(float (&c)[4], const uint4 &wa, const uint4 &wb, const uint4 &x) {
    const uint32_t a0[4] = {wa.x, wb.x, wa.y, wb.y}, a1[4] = {wa.z, wb.z, wa.w, wb.w};
    tc_mma(c, a0, x.x, x.y);
    tc_mma(c, a1, x.z, x.w);
}

template <int MODE, int KS, typename WV>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_tc_kernel(const WV *__restrict__ W, const uint4 *__restrict__ X, int n, int items, int in8, gemv_epi e) {
    constexpr bool TWO = MODE != EPI_PLAIN;
    constexpr int UPB = GEMV_WARPS / KS, U = TWO ? 2 : 4;   /* 32-k groups in flight per lane */
    k_pdl_trigger();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, ks = warp % KS, g = lane >> 2, q = lane & 3;
    const int unit = blockIdx.x * UPB + warp / KS, j0 = unit * TCG_ITEMS;
    const bool oka = j0 + g < items, okb = j0 + g + 8 < items, okx = g < n;
    int ra1 = 0, ra2 = 0, rb1 = 0, rb2 = 0;
    if (oka) tc_item_rows<MODE>(e, j0 + g, ra1, ra2);
    if (okb) tc_item_rows<MODE>(e, j0 + g + 8, rb1, rb2);
    const int len8 = in8 / KS, k0 = ks * len8 + q, ngr = len8 / 4;
    const WV *wa = W + (size_t)ra1 * in8 + k0, *wb = W + (size_t)rb1 * in8 + k0;
    const WV *wa2 = W + (size_t)ra2 * in8 + k0, *wb2 = W + (size_t)rb2 * in8 + k0;
    const uint4 *xr = X + (size_t)(okx ? g : 0) * in8 + k0;
    const uint4 z = make_uint4(0, 0, 0, 0);
    const WV zw = WV();
    WV pa[U], pb[U], pa2[U], pb2[U];
#pragma unroll
    for (int u = 0; u < U; u++) {   /* weights only before the wait */
        const bool in = u < ngr;
        pa[u] = in && oka ? __ldcs(wa + 4 * u) : zw;
        pb[u] = in && okb ? __ldcs(wb + 4 * u) : zw;
        if (TWO) {
            pa2[u] = in && oka ? __ldcs(wa2 + 4 * u) : zw;
            pb2[u] = in && okb ? __ldcs(wb2 + 4 * u) : zw;
        }
    }
    k_pdl_wait();
    float c1[4] = {0.f, 0.f, 0.f, 0.f}, c2[4] = {0.f, 0.f, 0.f, 0.f};
    for (int gi = 0; gi < ngr; gi += U) {
        uint4 xs[U];
        WV na[U], nb[U], na2[U], nb2[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const bool cur = gi + u < ngr, nxt = gi + U + u < ngr;
            xs[u] = cur && okx ? xr[4 * (gi + u)] : z;
            na[u] = nxt && oka ? __ldcs(wa + 4 * (gi + U + u)) : zw;
            nb[u] = nxt && okb ? __ldcs(wb + 4 * (gi + U + u)) : zw;
            if (TWO) {
                na2[u] = nxt && oka ? __ldcs(wa2 + 4 * (gi + U + u)) : zw;
                nb2[u] = nxt && okb ? __ldcs(wb2 + 4 * (gi + U + u)) : zw;
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            tc_mma_group(c1, w_bf16(pa[u]), w_bf16(pb[u]), xs[u]);
            if (TWO) tc_mma_group(c2, w_bf16(pa2[u]), w_bf16(pb2[u]), xs[u]);
            pa[u] = na[u];
            pb[u] = nb[u];
            if (TWO) {
                pa2[u] = na2[u];
                pb2[u] = nb2[u];
            }
        }
    }
    if (KS > 1) {   /* the unit's first warp gathers the other slices' fragments */
        __shared__ float part[GEMV_WARPS][TWO ? 8 : 4][32];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            part[warp][i][lane] = c1[i];
            if (TWO) part[warp][4 + i][lane] = c2[i];
        }
        __syncthreads();
        if (ks == 0)
#pragma unroll
            for (int j = 1; j < KS; j++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    c1[i] += part[warp + j][i][lane];
                    if (TWO) c2[i] += part[warp + j][4 + i][lane];
                }
    }
    float hh[2] = {0.f, 0.f};   /* h^2 of tokens 2q, 2q + 1 over this lane's items (norm fold) */
    if (ks == 0) {
#pragma unroll
        for (int ri = 0; ri < 2; ri++) {
            const bool ok = ri ? okb : oka;
            const int j = j0 + g + 8 * ri, r1 = ri ? rb1 : ra1, r2 = ri ? rb2 : ra2;
            const float s1 = e.wscale && ok ? e.wscale[r1] : 1.f, s2 = e.wscale && ok && TWO ? e.wscale[r2] : 1.f;
#pragma unroll
            for (int ti = 0; ti < 2; ti++) {
                const int t = 2 * q + ti;
                if (!ok || t >= n) continue;
                const float rs = e.ss_in ? rsqrtf(k_ss_value(e.ss_in[t]) * e.inv_in + e.eps) : 1.f;
                const float v1 = c1[2 * ri + ti] * (rs * s1), v2 = c2[2 * ri + ti] * (rs * s2);
                if (MODE == EPI_PLAIN) {
                    const size_t o = (size_t)t * e.out + r1;
                    const float h = (e.accumulate ? e.Y[o] : 0.f) + v1;
                    e.Y[o] = h;
                    if (e.xg) {
                        e.xg[o] = k_f2bf(h * e.g_out[r1]);
                        hh[ti] += h * h;
                    }
                } else if (MODE == EPI_GATED) {
                    e.act[(size_t)t * e.out + j] = k_f2bf(k_silu(v1) * v2);
                } else {
                    rope_pair_pre rp;
                    rope_pair_prepare(e.g, e.bias, e.inv_freq, e.H, e.KVH, e.D, t, r1 / e.D, r1 % e.D, rp);
                    rope_store_pair(rp, e.q_out, e.H, e.D, t, r1 / e.D, r1 % e.D, v1, v2);
                }
            }
        }
    }
    if (MODE == EPI_PLAIN && e.xg) {   /* the block's sums of h^2, one atomic per token (fixed point) */
        __shared__ float hs[GEMV_WARPS][8];
#pragma unroll
        for (int ti = 0; ti < 2; ti++)
#pragma unroll
            for (int off = 4; off < 32; off <<= 1) hh[ti] += __shfl_xor_sync(0xffffffffu, hh[ti], off);
        if (g == 0) {
            hs[warp][2 * q] = hh[0];
            hs[warp][2 * q + 1] = hh[1];
        }
        __syncthreads();
        if ((int)threadIdx.x < n) {
            float t = 0.f;
#pragma unroll
            for (int w = 0; w < GEMV_WARPS; w++) t += hs[w][threadIdx.x];
            atomicAdd(e.ss_out + threadIdx.x, k_ss_units(t));
        }
    }
}

/* Warps per unit for the tensor-core form: split K until about 32 warps per multiprocessor,
 * as long as each slice keeps whole groups of 32 and a few of them. */
static int gemv_tc_ksplit(int n_units, int in8) {
    const long want = (long)k_sm_count() * 32;
    int ks = 1;
    while (ks < 8 && (long)n_units * ks < want && in8 % (8 * ks) == 0 && in8 / (2 * ks) >= 4 * 4) ks *= 2;
    return ks;
}

template <int MODE, typename WV>
static int gemv_tc_launch(const WV *w, const uint4 *x, int n, int items, int in8, const gemv_epi &e, cudaStream_t s) {
    const int n_units = (items + TCG_ITEMS - 1) / TCG_ITEMS;
    const dim3 block(GEMV_WARPS * 32);
#define GEMV_TC_CASE(K)                                                                                       \
    case K:                                                                                                   \
        return k_launch(gemv_tc_kernel<MODE, K, WV>, dim3((n_units + GEMV_WARPS / K - 1) / (GEMV_WARPS / K)), \
                        block, 0, s, w, x, n, items, in8, e)
    switch (gemv_tc_ksplit(n_units, in8)) {
        GEMV_TC_CASE(8);
        GEMV_TC_CASE(4);
        GEMV_TC_CASE(2);
        GEMV_TC_CASE(1);
    default:
        return -1;
    }
#undef GEMV_TC_CASE
}

template <int MODE, typename WV>
static int gemv_launch_t(const WV *w, const uint16_t *X, int n_units, int in, int n, const gemv_epi &e,
                         cudaStream_t s) {
    const uint4 *x = (const uint4 *)X;
    const int in8 = in / 8;
    if (n >= k_tuning_get()->gemv_tc_min && in8 % 4 == 0) return gemv_tc_launch<MODE, WV>(w, x, n, n_units, in8, e, s);
    switch (n) {   /* each row count its own kernel: the activations stay in registers */
    case 1: return gemv_launch_ks<1, MODE, WV>(w, x, n_units, in8, e, s);
    case 2: return gemv_launch_ks<2, MODE, WV>(w, x, n_units, in8, e, s);
    case 3: return gemv_launch_ks<3, MODE, WV>(w, x, n_units, in8, e, s);
    case 4: return gemv_launch_ks<4, MODE, WV>(w, x, n_units, in8, e, s);
    case 5: return gemv_launch_ks<5, MODE, WV>(w, x, n_units, in8, e, s);
    case 6: return gemv_launch_ks<6, MODE, WV>(w, x, n_units, in8, e, s);
    case 7: return gemv_launch_ks<7, MODE, WV>(w, x, n_units, in8, e, s);
    case 8: return gemv_launch_ks<8, MODE, WV>(w, x, n_units, in8, e, s);
    default: return -1;
    }
}

/* bf16 words, or FP8 ones with W.scale as the epilogue's row scales. */
template <int MODE>
static int gemv_launch(k_wmat W, const uint16_t *X, int n_units, int in, int n, gemv_epi e, cudaStream_t s) {
    e.wscale = W.scale;
    if (W.scale) return gemv_launch_t<MODE>((const uint2 *)W.w, X, n_units, in, n, e, s);
    return gemv_launch_t<MODE>((const uint4 *)W.w, X, n_units, in, n, e, s);
}

/* The consumer half of the norm fold (nin may be NULL). */
static void set_norm_in(gemv_epi &e, const k_norm_in *nin, int in) {
    if (!nin) return;
    e.ss_in = nin->ss;
    e.eps = nin->eps;
    e.inv_in = 1.f / (float)in;
}

extern "C" int k_gemv_w(k_wmat W, const uint16_t *X, float *Y, int out, int in, int n, int accumulate,
                        const k_norm_in *nin, const k_norm_out *nout, cudaStream_t s) {
    const int fold = nin || nout;
    if (out <= 0 || !gemv_shape_ok(W.w, X, in, n, fold ? K_GEMV_FUSED_MAX_N : K_GEMV_MAX_N)) return -1;
    if ((nin && !nin->ss) || (nout && (!accumulate || !nout->g || !nout->xg || !nout->ss))) return -1;
    gemv_epi e = {};
    e.Y = Y;
    e.out = out;
    e.accumulate = accumulate;
    set_norm_in(e, nin, in);
    if (nout) {
        e.g_out = nout->g;
        e.xg = nout->xg;
        e.ss_out = nout->ss;
    }
    return gemv_launch<EPI_PLAIN>(W, X, out, in, n, e, s);
}

extern "C" int k_gemv_norm_bf16(const uint16_t *W, const uint16_t *X, float *Y, int out, int in, int n,
                                int accumulate, const k_norm_in *nin, const k_norm_out *nout, cudaStream_t s) {
    return k_gemv_w(k_wmat{W, NULL}, X, Y, out, in, n, accumulate, nin, nout, s);
}

extern "C" int k_gemv_bf16(const uint16_t *W, const uint16_t *X, float *Y, int out, int in,
                           int n, int accumulate, cudaStream_t s) {
    return k_gemv_w(k_wmat{W, NULL}, X, Y, out, in, n, accumulate, NULL, NULL, s);
}

extern "C" int k_gemv_gated_w(k_wmat W, const uint16_t *X, uint16_t *act, int F, int in, int n,
                              const k_norm_in *nin, cudaStream_t s) {
    if (F <= 0 || !act || !gemv_shape_ok(W.w, X, in, n, K_GEMV_FUSED_MAX_N) || (nin && !nin->ss)) return -1;
    gemv_epi e = {};
    e.out = F;
    e.act = act;
    set_norm_in(e, nin, in);
    return gemv_launch<EPI_GATED>(W, X, F, in, n, e, s);
}

extern "C" int k_gemv_gated_bf16(const uint16_t *W, const uint16_t *X, uint16_t *act, int F, int in, int n,
                                 const k_norm_in *nin, cudaStream_t s) {
    return k_gemv_gated_w(k_wmat{W, NULL}, X, act, F, in, n, nin, s);
}

extern "C" int k_gemv_qkv_rope_w(k_wmat W, const uint16_t *X, const float *bias, const float *inv_freq,
                                 float *q_out, int n, int H, int KVH, int D, int in, const k_kv_geom *g,
                                 const k_norm_in *nin, cudaStream_t s) {
    if (H <= 0 || KVH <= 0 || D <= 0 || (D & 1) || !inv_freq || !q_out || !g ||
        !gemv_shape_ok(W.w, X, in, n, K_GEMV_FUSED_MAX_N) || (nin && !nin->ss))
        return -1;
    gemv_epi e = {};
    set_norm_in(e, nin, in);
    e.bias = bias;
    e.inv_freq = inv_freq;
    e.q_out = q_out;
    e.H = H;
    e.KVH = KVH;
    e.D = D;
    e.g = *g;
    return gemv_launch<EPI_ROPE>(W, X, (H + 2 * KVH) * D / 2, in, n, e, s);
}

extern "C" int k_gemv_qkv_rope(const uint16_t *W, const uint16_t *X, const float *bias, const float *inv_freq,
                               float *q_out, int n, int H, int KVH, int D, int in, const k_kv_geom *g,
                               const k_norm_in *nin, cudaStream_t s) {
    return k_gemv_qkv_rope_w(k_wmat{W, NULL}, X, bias, inv_freq, q_out, n, H, KVH, D, in, g, nin, s);
}
