/* Mixture-of-experts MLP on the device (Mixtral, Qwen3-MoE), in four launches per layer,
 * all with fixed grids so that a captured decode graph replays them for any routing:
 *
 *   1. k_moe_route: per token, softmax over the router logits, the top-K experts (ties to
 *      the lower id, as the CPU reference), weights renormalised when asked; each
 *      (token, k) pair p = t * K + k is appended to its expert's row list: rows [E][n]
 *      (counts [E] zeroed by the caller before the launch).
 *   2. k_moe_gemm, gated: for every expert, its rows' x (token p / K) times the expert's
 *      [gate; up] rows, act(gate) * up written as bf16 per pair.
 *   3. k_moe_gemm, plain: every pair's activation times its expert's down rows (fp32 per
 *      pair).
 *   4. k_moe_combine: resid[t] += sum over k, in k order, of w[t, k] * out[t * K + k]
 *      (a fixed order: the result does not depend on the order rows were appended).
 *
 * The grouped GEMM reads only the weights of experts that have rows: a block (expert e,
 * a tile of output columns, a tile of its rows) returns at once when e has no row in its
 * tile, so a decode step streams the selected experts' bytes and nothing else. Up to 8
 * tokens it is a GEMV per expert (each weight row read once for all of the expert's
 * rows); above, 64 x 64 tiles on tensor cores (bf16 mma, fp32 accumulate) with x rows
 * gathered per pair and two cp.async stages. */
#include <math.h>

#include "kernels/specd_kernels.h"
#include "kernels/kutil.h"
#include "kernels/tc.cuh"

#define MOE_NT 256   /* threads of the GEMV and routing blocks */

/* One warp per token: lanes hold experts lane, lane + 32, ...; the softmax and each of the
 * K picks are warp reductions (ties to the lower id, as the CPU reference). */
__global__ void moe_route_kernel(const float *logits, int n, int E, int K, int norm, int32_t *ids, float *w,
                                 int32_t *counts, int32_t *rows) {
    k_pdl_trigger();
    k_pdl_wait();
    const int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (t >= n) return;
    const float *lg = logits + (size_t)t * E;
    float mx = -INFINITY;
    for (int e = lane; e < E; e += 32) mx = fmaxf(mx, lg[e]);
    for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
    for (int e = lane; e < E; e += 32) sum += __expf(lg[e] - mx);
    for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    unsigned long long taken[8] = {};   /* E <= 512: bit e of the chosen set */
    float cw[16], wsum = 0.f;
    int chosen[16];
    for (int k = 0; k < K; k++) {
        float bv = -INFINITY;
        int be = E;
        for (int e = lane; e < E; e += 32)
            if (!((taken[e >> 6] >> (e & 63)) & 1) && (lg[e] > bv || (lg[e] == bv && e < be))) {
                bv = lg[e];
                be = e;
            }
        for (int o = 16; o; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oe = __shfl_xor_sync(0xffffffffu, be, o);
            if (ov > bv || (ov == bv && oe < be)) {
                bv = ov;
                be = oe;
            }
        }
        chosen[k] = be;
        taken[be >> 6] |= 1ull << (be & 63);
        cw[k] = __expf(bv - mx) / sum;
        wsum += cw[k];
    }
    if (lane < K) {
        float wk = 0.f;
        int ek = 0;
        for (int k = 0; k < K; k++)
            if (k == lane) {
                wk = cw[k];
                ek = chosen[k];
            }
        ids[t * K + lane] = ek;
        w[t * K + lane] = norm ? wk / wsum : wk;
        const int slot = atomicAdd(counts + ek, 1);
        rows[(size_t)ek * n + slot] = t * K + lane;   /* an expert gets at most one pair per token */
    }
}

extern "C" int k_moe_route(const float *logits, int n, int E, int K, int norm, int32_t *ids, float *w,
                           int32_t *counts, int32_t *rows, cudaStream_t s) {
    if (n < 0 || E <= 0 || E > 512 || K <= 0 || K > 16 || K > E) return -1;
    if (n == 0) return 0;
    return k_launch(moe_route_kernel, dim3((n + 7) / 8), dim3(256), 0, s, logits, n, E, K, norm, ids, w, counts,
                    rows);
}

/* ---- the tiled grouped GEMM on tensor cores ---------------------------------------------- */

#define MOE_TM 64     /* rows (pairs) per tile: 4 warps x 16 */
#define MOE_TN 64     /* output columns per tile: 8 mma n-tiles */
#define MOE_TK 32     /* reduction chunk: 2 mma k-steps */
#define MOE_LD (MOE_TK + 8)   /* padded smem row: ldmatrix's 8 rows hit 8 bank groups */
#define MOE_TC_NT 128

/* One tile: rows r0.. of expert e's list (pairs), columns c0.. of its output. GATED: the
 * weight is [2N][Kd] (gate rows, then up rows) and the output act(g) * u, bf16 [pairs][N];
 * else [N][Kd] and fp32 [pairs][N]. x row of pair p: p / x_div. Two smem stages filled by
 * cp.async; warp w owns rows 16w..16w+15 of the tile and all 64 columns. */
template <bool GATED>
__global__ void __launch_bounds__(MOE_TC_NT)
moe_gemm_kernel(const uint16_t *__restrict__ W, const uint16_t *__restrict__ X, int x_div,
                const int32_t *__restrict__ rows, const int32_t *__restrict__ counts, int cap, int N, int Kd,
                int gelu, float *__restrict__ Yf, uint16_t *__restrict__ Yb) {
    constexpr int NW = GATED ? 2 : 1;
    __shared__ __align__(16) uint16_t as[2][MOE_TM][MOE_LD];
    __shared__ __align__(16) uint16_t bs[2][NW][MOE_TN][MOE_LD];
    __shared__ int prow[MOE_TM];
    k_pdl_trigger();
    k_pdl_wait();
    const int e = blockIdx.y, c0 = blockIdx.x * MOE_TN, r0 = blockIdx.z * MOE_TM;
    const int cnt = counts[e];
    if (r0 >= cnt) return;
    const int nr = min(MOE_TM, cnt - r0), tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (tid < MOE_TM) prow[tid] = tid < nr ? rows[(size_t)e * cap + r0 + tid] : -1;
    __syncthreads();
    const uint16_t *We = W + (size_t)e * NW * N * Kd;
    /* loaders: 64 rows x 4 chunks of 8 per matrix = 256 chunks, 2 per thread */
    auto load = [&](int st, int k0) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int idx = tid + i * MOE_TC_NT, r = idx / 4, c = (idx % 4) * 8;
            const bool kok = k0 + c < Kd;
            const int p = prow[r];
            tc_cp16(tc_smem_addr(&as[st][r][c]), p >= 0 && kok ? X + (size_t)(p / x_div) * Kd + k0 + c : X,
                     p >= 0 && kok);
#pragma unroll
            for (int m = 0; m < NW; m++) {
                const int col = c0 + r;
                const bool ok = col < N && kok;
                tc_cp16(tc_smem_addr(&bs[st][m][r][c]), ok ? We + ((size_t)m * N + col) * Kd + k0 + c : We, ok);
            }
        }
        tc_commit();
    };
    float acc[NW][8][4];
#pragma unroll
    for (int m = 0; m < NW; m++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0.f;
    const int nk = (Kd + MOE_TK - 1) / MOE_TK;
    const bool active = warp * 16 < nr;
    load(0, 0);
    for (int it = 0; it < nk; it++) {
        const int st = it & 1;
        if (it + 1 < nk) load(st ^ 1, (it + 1) * MOE_TK);
        else tc_commit();
        tc_wait<1>();
        __syncthreads();
        if (active) {
            uint32_t a[2][4];
#pragma unroll
            for (int ks = 0; ks < 2; ks++)
                tc_ldsm4(tc_smem_addr(&as[st][warp * 16 + (lane & 15)][ks * 16 + (lane >> 4) * 8]), a[ks][0],
                          a[ks][1], a[ks][2], a[ks][3]);
#pragma unroll
            for (int m = 0; m < NW; m++)
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    uint32_t b0, b1, b2, b3;   /* n 8j + (lane & 7), k 8 (lane >> 3): k-steps 0 and 1 */
                    tc_ldsm4(tc_smem_addr(&bs[st][m][8 * j + (lane & 7)][(lane >> 3) * 8]), b0, b1, b2, b3);
                    tc_mma(acc[m][j], a[0], b0, b1);
                    tc_mma(acc[m][j], a[1], b2, b3);
                }
        }
        __syncthreads();
    }
    if (!active) return;
    const int gid = lane >> 2, tig = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int rr = warp * 16 + gid + 8 * h;
        if (rr >= nr) continue;
        const int p = prow[rr];
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int q = 0; q < 2; q++) {
                const int col = c0 + 8 * j + 2 * tig + q;
                if (col >= N) continue;
                const float g = acc[0][j][2 * h + q];
                if (GATED) {
                    const float u = acc[NW - 1][j][2 * h + q];
                    const float av = gelu ? k_gelu_tanh(g) : k_silu(g);
                    Yb[(size_t)p * N + col] = k_f2bf(av * u);
                } else {
                    Yf[(size_t)p * N + col] = g;
                }
            }
    }
}

/* Decode-sized batches (at most MOE_GEMV_ROWS rows per expert, i.e. that many tokens):
 * a GEMV per expert that streams each weight row once for all of its rows. A block takes
 * MOE_GEMV_COLS output columns of one expert (4 per warp); the expert's x rows sit in
 * shared memory as bf16; a warp reads a weight row 512 bytes at a time (16 bytes a lane),
 * 4 loads in flight, and reduces each row's dot product by shuffles. */
#define MOE_GEMV_ROWS 8
#define MOE_GEMV_COLS 32
#define MOE_GEMV_U 8   /* 16-byte loads per lane in flight per matrix: a 4 KB row at once */

template <bool GATED>
__global__ void __launch_bounds__(MOE_NT)
moe_gemv_kernel(const uint16_t *__restrict__ W, const uint16_t *__restrict__ X, int x_div,
                const int32_t *__restrict__ rows, const int32_t *__restrict__ counts, int cap, int N, int Kd,
                int gelu, float *__restrict__ Yf, uint16_t *__restrict__ Yb) {
    constexpr int NW = GATED ? 2 : 1;
    extern __shared__ __align__(16) uint16_t xsm[];   /* [MOE_GEMV_ROWS][Kd] */
    __shared__ int prow[MOE_GEMV_ROWS];
    k_pdl_trigger();
    k_pdl_wait();
    const int e = blockIdx.y, c0 = blockIdx.x * MOE_GEMV_COLS;
    const int cnt = min(counts[e], MOE_GEMV_ROWS);
    if (cnt == 0) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (tid < MOE_GEMV_ROWS) prow[tid] = tid < cnt ? rows[(size_t)e * cap + tid] : -1;
    __syncthreads();
    for (int i = tid; i < cnt * (Kd / 8); i += MOE_NT) {
        const int r = i / (Kd / 8), c = i % (Kd / 8);
        *(uint4 *)(xsm + (size_t)r * Kd + c * 8) = *(const uint4 *)(X + (size_t)(prow[r] / x_div) * Kd + c * 8);
    }
    __syncthreads();
    const uint16_t *We = W + (size_t)e * NW * N * Kd;
    for (int cc = 0; cc < 4; cc++) {
        const int col = c0 + warp * 4 + cc;
        if (col >= N) break;
        float acc[NW][MOE_GEMV_ROWS];
#pragma unroll
        for (int m = 0; m < NW; m++)
#pragma unroll
            for (int r = 0; r < MOE_GEMV_ROWS; r++) acc[m][r] = 0.f;
        /* every chunk of the row (both matrices when gated) requested before any math */
        for (int k0 = lane * 8; k0 < Kd; k0 += 32 * 8 * MOE_GEMV_U) {
            uint4 wv[NW][MOE_GEMV_U];
#pragma unroll
            for (int m = 0; m < NW; m++)
#pragma unroll
                for (int u = 0; u < MOE_GEMV_U; u++) {
                    const int k = k0 + u * 256;
                    wv[m][u] = k < Kd ? __ldg((const uint4 *)(We + ((size_t)m * N + col) * Kd + k))
                                      : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
            for (int u = 0; u < MOE_GEMV_U; u++) {
                const int k = k0 + u * 256;
                if (k >= Kd) break;
#pragma unroll
                for (int r = 0; r < MOE_GEMV_ROWS; r++) {
                    if (r >= cnt) break;
                    const uint4 xv = *(const uint4 *)(xsm + (size_t)r * Kd + k);
                    const uint16_t *xh = (const uint16_t *)&xv;
#pragma unroll
                    for (int m = 0; m < NW; m++) {
                        const uint16_t *wh = (const uint16_t *)&wv[m][u];
                        float a = acc[m][r];
#pragma unroll
                        for (int q = 0; q < 8; q++) a = fmaf(k_bf2f(wh[q]), k_bf2f(xh[q]), a);
                        acc[m][r] = a;
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < MOE_GEMV_ROWS; r++) {
            if (r >= cnt) break;
            float g = k_warp_sum(acc[0][r]), u = k_warp_sum(acc[NW - 1][r]);
            if (lane == 0) {
                const int p = prow[r];
                if (GATED) {
                    const float a = gelu ? k_gelu_tanh(g) : k_silu(g);
                    Yb[(size_t)p * N + col] = k_f2bf(a * u);
                } else {
                    Yf[(size_t)p * N + col] = g;
                }
            }
        }
    }
}

extern "C" int k_moe_gemm(const uint16_t *W, const uint16_t *X, int x_div, const int32_t *rows,
                          const int32_t *counts, int cap, int E, int N, int Kd, int gated, int gelu, float *Yf,
                          uint16_t *Yb, cudaStream_t s) {
    if (E <= 0 || N <= 0 || Kd <= 0 || Kd % 8 || cap < 0 || x_div <= 0) return -1;
    if (cap == 0) return 0;
    if (cap <= MOE_GEMV_ROWS) {   /* an expert has at most cap rows: the GEMV holds them all */
        size_t smem = (size_t)MOE_GEMV_ROWS * Kd * 2;
        dim3 grid((N + MOE_GEMV_COLS - 1) / MOE_GEMV_COLS, E);
        if (gated) {
            if (smem > 48 * 1024 &&
                cudaFuncSetAttribute(moe_gemv_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem))
                return -1;
            return k_launch(moe_gemv_kernel<true>, grid, dim3(MOE_NT), smem, s, W, X, x_div, rows, counts, cap, N,
                            Kd, gelu, Yf, Yb);
        }
        if (smem > 48 * 1024 &&
            cudaFuncSetAttribute(moe_gemv_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem))
            return -1;
        return k_launch(moe_gemv_kernel<false>, grid, dim3(MOE_NT), smem, s, W, X, x_div, rows, counts, cap, N, Kd,
                        gelu, Yf, Yb);
    }
    dim3 grid((N + MOE_TN - 1) / MOE_TN, E, (cap + MOE_TM - 1) / MOE_TM);
    if (gated)
        return k_launch(moe_gemm_kernel<true>, grid, dim3(MOE_TC_NT), 0, s, W, X, x_div, rows, counts, cap, N, Kd,
                        gelu, Yf, Yb);
    return k_launch(moe_gemm_kernel<false>, grid, dim3(MOE_TC_NT), 0, s, W, X, x_div, rows, counts, cap, N, Kd,
                    gelu, Yf, Yb);
}

__global__ void moe_combine_kernel(const float *out, const float *w, int K, int hidden, float *resid) {
    k_pdl_trigger();
    k_pdl_wait();
    const int t = blockIdx.x;
    for (int d = threadIdx.x; d < hidden; d += blockDim.x) {
        float s = 0.f;
        for (int k = 0; k < K; k++) s = fmaf(w[t * K + k], out[((size_t)t * K + k) * hidden + d], s);
        resid[(size_t)t * hidden + d] += s;
    }
}

extern "C" int k_moe_combine(const float *out, const float *w, int n, int K, int hidden, float *resid,
                             cudaStream_t s) {
    if (n < 0 || K <= 0 || hidden <= 0) return -1;
    if (n == 0) return 0;
    return k_launch(moe_combine_kernel, dim3(n), dim3(256), 0, s, out, w, K, hidden, resid);
}
