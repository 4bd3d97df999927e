/* Mixture-of-experts MLP on the device (Mixtral, Qwen3-MoE), all with fixed grids so that a
 * captured decode graph replays them for any routing. The general form, four launches per
 * layer after the router GEMM:
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
 * tile, so a step streams the selected experts' bytes and nothing else. Up to 8 tokens it
 * is a GEMV per expert (each weight row read once per 8 of the expert's rows); above,
 * 64 x 64 tiles on tensor cores (bf16 mma, fp32 accumulate) with x rows gathered per pair,
 * three cp.async stages, and the warps spread over the n-tiles when a tile has few rows.
 *
 * Decode steps (n <= K_MOE_DEC_MAX_N) take three launches instead (see the end of the
 * file): the router GEMV with the routing in its last block, gate|up over the listed
 * experts only, and down with the combine, the residual add and the norm fold. On the
 * H200 at Qwen3-30B-A3B's widths and batch 1 a layer's MoE went from 92.5 to 33.5 us
 * (tests/gpu/bench_moe). */
#include <math.h>

#include "kernels/specd_kernels.h"
#include "kernels/kutil.h"
#include "kernels/tc.cuh"

#define MOE_NT 256   /* threads of the GEMV and routing blocks */

/* acc + the dot of 8 bf16 weights with 8 bf16 activations (fp32 FMAs in order). */
__device__ __forceinline__ float moe_dot8(const uint4 &w, const uint4 &x, float acc) {
    const uint16_t *wh = (const uint16_t *)&w, *xh = (const uint16_t *)&x;
#pragma unroll
    for (int q = 0; q < 8; q++) acc = fmaf(k_bf2f(wh[q]), k_bf2f(xh[q]), acc);
    return acc;
}

/* The top K of one token's logits lg [E] (one warp): softmax over all E, the K largest
 * (ties to the lower id, as the CPU reference), weights renormalised when norm; lane k < K
 * gets pick k in e and w. The logits are read once (through L2 only: they may come from
 * other blocks of the same launch) into registers, lane holding experts lane, lane + 32,
 * ...; the K picks are warp reductions over them. */
#define MOE_E_PER_LANE 16   /* E <= 512 */
__device__ __forceinline__ void moe_topk(const float *lg, int E, int K, int norm, int &e_out, float &w_out) {
    const int lane = threadIdx.x & 31;
    float v[MOE_E_PER_LANE];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < MOE_E_PER_LANE; i++) {
        const int e = lane + 32 * i;
        v[i] = e < E ? __ldcg(lg + e) : -INFINITY;
        mx = fmaxf(mx, v[i]);
    }
    for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < MOE_E_PER_LANE; i++)
        if (lane + 32 * i < E) sum += __expf(v[i] - mx);
    for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    /* The K picks: a lane's best untaken expert as an ordered key (floats ordered as
     * unsigned integers, -0 as +0, NaN below every number, 0 for none), then two warp
     * reductions (redux.sync): the largest key, and the lowest id that holds it. */
    uint32_t key[MOE_E_PER_LANE];
#pragma unroll
    for (int i = 0; i < MOE_E_PER_LANE; i++) {
        const uint32_t u = v[i] == 0.f ? 0u : __float_as_uint(v[i]);
        key[i] = lane + 32 * i >= E ? 0u : v[i] != v[i] ? 1u : (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    }
    float my_w = 0.f, wsum = 0.f;
    int my_e = 0;
    unsigned taken = 0;   /* bit i: expert lane + 32 i already chosen */
    for (int k = 0; k < K; k++) {
        uint32_t bk = 0u;
        int bi = 0;
#pragma unroll
        for (int i = 0; i < MOE_E_PER_LANE; i++)   /* ascending ids: the first of equals stays */
            if (!((taken >> i) & 1u) && key[i] > bk) bk = key[i], bi = i;
        const uint32_t mk = __reduce_max_sync(0xffffffffu, bk);
        const int be = (int)__reduce_min_sync(0xffffffffu, bk == mk ? (uint32_t)(lane + 32 * bi) : 0xffffffffu);
        if ((be & 31) == lane) taken |= 1u << (be >> 5);   /* the owner takes it out */
        const float bv = (mk & 0x80000000u) ? __uint_as_float(mk & 0x7fffffffu) : __uint_as_float(~mk);
        const float cw = __expf(bv - mx) / sum;
        wsum += cw;
        if (lane == k) {
            my_w = cw;
            my_e = be;
        }
    }
    e_out = my_e;
    w_out = norm ? my_w / wsum : my_w;
}

/* Route token t (one warp): moe_topk, then each pair p = t * K + k appended to its
 * expert's row list, and an expert's first pair lists it in active (when given). */
__device__ void moe_route_token(const float *logits, int t, int n, int E, int K, int norm, int32_t *ids, float *w,
                                int32_t *counts, int32_t *rows, int32_t *active) {
    const int lane = threadIdx.x & 31;
    int my_e;
    float my_w;
    moe_topk(logits + (size_t)t * E, E, K, norm, my_e, my_w);
    if (lane < K) {
        ids[t * K + lane] = my_e;
        w[t * K + lane] = my_w;
        const int slot = atomicAdd(counts + my_e, 1);
        rows[(size_t)my_e * n + slot] = t * K + lane;   /* an expert gets at most one pair per token */
        if (active && slot == 0) active[1 + atomicAdd(active, 1)] = my_e;
    }
}

/* One warp per token. */
__global__ void moe_route_kernel(const float *logits, int n, int E, int K, int norm, int32_t *ids, float *w,
                                 int32_t *counts, int32_t *rows) {
    k_pdl_trigger();
    k_pdl_wait();
    const int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (t >= n) return;
    moe_route_token(logits, t, n, E, K, norm, ids, w, counts, rows, NULL);
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
/* (-DMOE_STAGES=2 -DMOE_TC_MINB=1 builds the earlier form, for A/B timing: BENCH.md) */
#ifndef MOE_STAGES
#define MOE_STAGES 3  /* cp.async stages: two chunks in flight while one is multiplied */
#endif
#ifndef MOE_TC_MINB
#define MOE_TC_MINB 4 /* blocks per SM the registers must allow: 8 chunks in flight */
#endif

/* One tile: rows r0.. of expert e's list (pairs), columns c0.. of its output (experts with
 * fewer than min_cnt rows are left to moe_tcv_kernel). GATED: the
 * weight is [2N][Kd] (gate rows, then up rows) and the output act(g) * u, bf16 [pairs][N];
 * else [N][Kd] and fp32 [pairs][N]. x row of pair p: p / x_div. MOE_STAGES smem stages
 * filled by cp.async. */
template <bool GATED>
__global__ void __launch_bounds__(MOE_TC_NT, MOE_TC_MINB)
moe_gemm_kernel(const uint16_t *__restrict__ W, const uint16_t *__restrict__ X, int x_div,
                const int32_t *__restrict__ rows, const int32_t *__restrict__ counts, int cap, int min_cnt, int N,
                int Kd, int gelu, float *__restrict__ Yf, uint16_t *__restrict__ Yb) {
    constexpr int NW = GATED ? 2 : 1;
    __shared__ __align__(16) uint16_t as[MOE_STAGES][MOE_TM][MOE_LD];
    __shared__ __align__(16) uint16_t bs[MOE_STAGES][NW][MOE_TN][MOE_LD];
    __shared__ int prow[MOE_TM];
    k_pdl_trigger();
    k_pdl_wait();
    const int e = blockIdx.y, c0 = blockIdx.x * MOE_TN, r0 = blockIdx.z * MOE_TM;
    const int cnt = counts[e];
    if (r0 >= cnt || cnt < min_cnt) return;   /* fewer rows: moe_tcv_kernel's */
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
    /* the tile's rows in 1, 2 or 4 groups of 16 (as few as hold them); the 4 warps split
     * the groups and then the 8 n-tiles between them, so a tile of a few rows (decode
     * batches: a handful of tokens per expert) keeps every warp multiplying */
    const int n_rg = nr <= 16 ? 1 : nr <= 32 ? 2 : 4, wpr = 4 / n_rg;
    const int rg = warp / wpr, nj = 8 / wpr, j0 = (warp % wpr) * nj;
    const bool active = rg * 16 < nr;
#pragma unroll
    for (int i = 0; i < MOE_STAGES - 1; i++) {
        if (i < nk) load(i, i * MOE_TK);
        else tc_commit();
    }
    for (int it = 0; it < nk; it++) {
        const int st = it % MOE_STAGES;
        tc_wait<MOE_STAGES - 2>();   /* chunk it has landed */
        __syncthreads();             /* ... for every thread, and chunk it - 1 is done with */
        const int nx = it + MOE_STAGES - 1;
        if (nx < nk) load(nx % MOE_STAGES, nx * MOE_TK);
        else tc_commit();
        if (active) {
            uint32_t a[2][4];
#pragma unroll
            for (int ks = 0; ks < 2; ks++)
                tc_ldsm4(tc_smem_addr(&as[st][rg * 16 + (lane & 15)][ks * 16 + (lane >> 4) * 8]), a[ks][0],
                          a[ks][1], a[ks][2], a[ks][3]);
#pragma unroll
            for (int m = 0; m < NW; m++)
#pragma unroll
                for (int jj = 0; jj < 8; jj++) {
                    if (jj >= nj) break;
                    const int j = j0 + jj;
                    uint32_t b0, b1, b2, b3;   /* n 8j + (lane & 7), k 8 (lane >> 3): k-steps 0 and 1 */
                    tc_ldsm4(tc_smem_addr(&bs[st][m][8 * j + (lane & 7)][(lane >> 3) * 8]), b0, b1, b2, b3);
                    tc_mma(acc[m][jj], a[0], b0, b1);
                    tc_mma(acc[m][jj], a[1], b2, b3);
                }
        }
    }
    if (!active) return;
    const int gid = lane >> 2, tig = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int rr = rg * 16 + gid + 8 * h;
        if (rr >= nr) continue;
        const int p = prow[rr];
#pragma unroll
        for (int jj = 0; jj < 8; jj++)
#pragma unroll
            for (int q = 0; q < 2; q++) {
                const int col = c0 + 8 * (j0 + jj) + 2 * tig + q;
                if (jj >= nj || col >= N) continue;
                const float g = acc[0][jj][2 * h + q];
                if (GATED) {
                    const float u = acc[NW - 1][jj][2 * h + q];
                    const float av = gelu ? k_gelu_tanh(g) : k_silu(g);
                    Yb[(size_t)p * N + col] = k_f2bf(av * u);
                } else {
                    Yf[(size_t)p * N + col] = g;
                }
            }
    }
}

/* Decode-sized batches (up to MOE_GEMV_MAX_CAP tokens, so at most that many rows per
 * expert): a GEMV per expert that streams each weight row once for all of its rows. A
 * block takes MOE_GEMV_COLS output columns of one expert (one per warp: 768 blocks for
 * Qwen3-30B-A3B's eight experts at batch 1, one wave); the expert's x rows sit in shared
 * memory as bf16;
 * a warp reads a weight row 512 bytes at a time (16 bytes a lane), MOE_GEMV_U loads in
 * flight per matrix, and reduces each row's dot product by shuffles. With active (the
 * router's list of experts that have rows), block y takes the y-th listed expert and the
 * grid needs only min(E, n * K) rows of blocks; without it, block y is expert y. ss_in
 * (the norm fold, specd_kernels.h): x rows are h * g and each dot is scaled by its
 * token's rsqrt(ss / Kd + eps). */
#define MOE_GEMV_ROWS 8
#define MOE_GEMV_MAX_CAP 8    /* k_moe_gemm: the GEMV up to this many tokens */
static_assert(MOE_GEMV_MAX_CAP <= MOE_GEMV_ROWS && K_MOE_DEC_MAX_N <= MOE_GEMV_ROWS,
              "the GEMV holds every row of an expert at once");
#define MOE_GEMV_COLS (MOE_NT / 32)
#define MOE_GEMV_U 8   /* 16-byte loads per lane in flight per matrix: a 4 KB row at once */

/* R: rows of x held (up to R tokens an expert), U: 16-byte loads per lane in flight per
 * matrix, MINB: blocks an SM asked of the register allocator (0: none asked) */

template <bool GATED, int R, int U, int MINB>
__global__ void __launch_bounds__(MOE_NT, MINB)
moe_gemv_kernel(const uint16_t *__restrict__ W, const uint16_t *__restrict__ X, int x_div,
                const int32_t *__restrict__ rows, const int32_t *__restrict__ counts, const int32_t *active,
                const int32_t *ids1, int cap, int N, int Kd, int gelu, const unsigned long long *ss_in, float eps,
                float *__restrict__ Yf, uint16_t *__restrict__ Yb) {
    constexpr int NW = GATED ? 2 : 1;
    extern __shared__ __align__(16) uint16_t xsm[];   /* [R][Kd] */
    __shared__ int prow[R];
    __shared__ float rsm[R];
    /* the launch after this one may start only once the routing before it has finished:
     * k_moe_down_combine reads the routing's expert ids before its own wait */
    k_pdl_wait();
    k_pdl_trigger();
    int e = blockIdx.y, cnt = 1;
    if (ids1) {   /* one token: block y is pick y, its expert's one pair */
        e = ids1[blockIdx.y];
    } else {
        if (active) {
            if ((int)blockIdx.y >= active[0]) return;
            e = active[1 + blockIdx.y];
        }
        cnt = min(counts[e], R);
        if (cnt == 0) return;
    }
    const int c0 = blockIdx.x * MOE_GEMV_COLS;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, col = c0 + warp;
    const uint16_t *We = W + (size_t)e * NW * N * Kd;
    /* the row's first chunks (both matrices when gated) go out before the x rows are
     * gathered: every load of a chunk is requested before any math (clamped addresses,
     * unconditional loads) */
    uint4 wv[NW][U];
    auto load = [&](int k0) {
#pragma unroll
        for (int m = 0; m < NW; m++)
#pragma unroll
            for (int u = 0; u < U; u++)
                wv[m][u] = __ldg((const uint4 *)(We + ((size_t)m * N + min(col, N - 1)) * Kd + min(k0 + u * 256, Kd - 8)));
    };
    load(lane * 8);
    if (tid < R) {
        prow[tid] = tid >= cnt ? -1 : ids1 ? (int)blockIdx.y : rows[(size_t)e * cap + tid];
        rsm[tid] = tid < cnt && ss_in ? rsqrtf(k_ss_value(ss_in[prow[tid] / x_div]) * (1.f / Kd) + eps) : 1.f;
    }
    __syncthreads();
    for (int i = tid; i < cnt * (Kd / 8); i += MOE_NT) {
        const int r = i / (Kd / 8), c = i % (Kd / 8);
        *(uint4 *)(xsm + (size_t)r * Kd + c * 8) = *(const uint4 *)(X + (size_t)(prow[r] / x_div) * Kd + c * 8);
    }
    __syncthreads();
    if (col >= N) return;
    float acc[NW][R];
#pragma unroll
    for (int m = 0; m < NW; m++)
#pragma unroll
        for (int r = 0; r < R; r++) acc[m][r] = 0.f;
    for (int k0 = lane * 8; k0 < Kd; k0 += 32 * 8 * U) {
        if (k0 != lane * 8) load(k0);
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int k = k0 + u * 256;
            if (k >= Kd) break;
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (r >= cnt) break;
                const uint4 xv = *(const uint4 *)(xsm + (size_t)r * Kd + k);
#pragma unroll
                for (int m = 0; m < NW; m++) acc[m][r] = moe_dot8(wv[m][u], xv, acc[m][r]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        if (r >= cnt) break;
        float g = k_warp_sum(acc[0][r]) * rsm[r], u = k_warp_sum(acc[NW - 1][r]) * rsm[r];
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

template <bool GATED, int R, int U, int MINB>
static int moe_gemv_launch_r(const uint16_t *W, const uint16_t *X, int x_div, const int32_t *rows,
                             const int32_t *counts, const int32_t *active, const int32_t *ids1, int cap, int grid_y,
                             int N, int Kd, int gelu, const unsigned long long *ss_in, float eps, float *Yf,
                             uint16_t *Yb, cudaStream_t s) {
    const size_t smem = (size_t)R * Kd * 2;
    if (smem > 48 * 1024 &&
        cudaFuncSetAttribute(moe_gemv_kernel<GATED, R, U, MINB>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             (int)smem))
        return -1;
    return k_launch(moe_gemv_kernel<GATED, R, U, MINB>, dim3((N + MOE_GEMV_COLS - 1) / MOE_GEMV_COLS, grid_y),
                    dim3(MOE_NT), smem, s, W, X, x_div, rows, counts, active, ids1, cap, N, Kd, gelu, ss_in, eps, Yf,
                    Yb);
}

/* One row per expert at most (cap 1: a single token) takes a form with room for one x row
 * and half a weight row in flight per matrix: 63 registers and 4 KB of shared memory
 * against 123 and 32 KB, so 4 blocks share an SM instead of 2 (k_tuning.moe_r1; 0: the
 * form for up to 8 rows). H100, Qwen3-30B-A3B widths, bench_moe: routing + gate|up at one
 * token 25.96 against 28.46 us a layer; `specd bench --shape qwen3-30b-a3b --batch 1`
 * 255.7-258.6 against 243.7 tok/s. 3 blocks an SM (69 registers) and 8 loads at 2 blocks
 * (99) measured between the two. */
template <bool GATED>
static int moe_gemv_launch(const uint16_t *W, const uint16_t *X, int x_div, const int32_t *rows,
                           const int32_t *counts, const int32_t *active, const int32_t *ids1, int cap, int grid_y,
                           int N, int Kd, int gelu, const unsigned long long *ss_in, float eps, float *Yf,
                           uint16_t *Yb, cudaStream_t s) {
    if (cap == 1 && k_tuning_get()->moe_r1)
        return moe_gemv_launch_r<GATED, 1, 4, 4>(W, X, x_div, rows, counts, active, ids1, cap, grid_y, N, Kd, gelu,
                                                 ss_in, eps, Yf, Yb, s);
    return moe_gemv_launch_r<GATED, MOE_GEMV_ROWS, MOE_GEMV_U, 0>(W, X, x_div, rows, counts, active, ids1, cap, grid_y,
                                                                 N, Kd, gelu, ss_in, eps, Yf, Yb, s);
}

/* A tensor-core GEMV for few rows an expert (k_tuning.moe_tcv): no shared memory and no
 * barrier, the weights go straight from memory into mma fragments. A warp owns 16 rows of
 * its expert's output (gate and up rows both when gated: the activation is its epilogue)
 * over the whole reduction, and holds 8 * NT of the expert's rows of x as the n side of
 * m16n8k16 (more rows: another pass over the same weights). The reduction is cut so that
 * each lane reads 16-byte words: lane (g, t) loads V words of weight rows g and g + 8 at
 * k = k0 + 8 * V * t .., the same words of its x row, and those words ARE its fragments
 * (the mma's k order is a permutation of memory order, the same one on both sides, so the
 * sum is the same dot). A row is read V * 64 contiguous bytes a chunk, every chunk's loads
 * in flight before its math. Only experts with at most max_cnt rows: an expert with many
 * rows (a prompt's tokens can crowd into a few) would take many passes here. */
template <bool GATED, int NT, int V, int MINB>
__global__ void __launch_bounds__(256, MINB)
moe_tcv_kernel(const uint16_t *__restrict__ W, const uint16_t *__restrict__ X, int x_div,
               const int32_t *__restrict__ rows, const int32_t *__restrict__ counts, int cap, int max_cnt, int N,
               int Kd, int gelu, float *__restrict__ Yf, uint16_t *__restrict__ Yb) {
    constexpr int NW = GATED ? 2 : 1, KC = 32 * V;   /* reduction elements a chunk */
    k_pdl_trigger();
    k_pdl_wait();
    const int e = blockIdx.y, cnt = counts[e];
    const int lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
    const int f0 = (blockIdx.x * 8 + (threadIdx.x >> 5)) * 16;
    if (cnt == 0 || cnt > max_cnt || f0 >= N) return;   /* more rows: the tiles' */
    const uint16_t *We = W + (size_t)e * NW * N * Kd;
    const size_t rl = (size_t)min(f0 + gid, N - 1) * Kd, rh = (size_t)min(f0 + gid + 8, N - 1) * Kd;
    const int32_t *er = rows + (size_t)e * cap;
    for (int g0 = 0; g0 < cnt; g0 += 8 * NT) {
        const int nt = min(NT, (cnt - g0 + 7) / 8);
        const uint16_t *xr[NT];   /* this lane's x row in n-tile j (NULL: none) */
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const int r = g0 + 8 * j + gid;
            xr[j] = r < cnt ? X + (size_t)(er[r] / x_div) * Kd : NULL;
        }
        float acc[NW][NT][4];
#pragma unroll
        for (int m = 0; m < NW; m++)
#pragma unroll
            for (int j = 0; j < NT; j++) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0.f;
        for (int k0 = 0; k0 < Kd; k0 += KC) {
            const int kb = k0 + tig * 8 * V;
            uint4 wl[NW][V], wh[NW][V], xv[NT][V];
            /* words past the row are zero on both sides (the mma is warp-wide: every lane
             * runs it, whatever its words) */
#pragma unroll
            for (int v = 0; v < V; v++) {
                const bool in = kb + 8 * v < Kd;
                const int k = in ? kb + 8 * v : 0;
#pragma unroll
                for (int m = 0; m < NW; m++) {
                    wl[m][v] = in ? __ldcs((const uint4 *)(We + (size_t)m * N * Kd + rl + k)) : make_uint4(0, 0, 0, 0);
                    wh[m][v] = in ? __ldcs((const uint4 *)(We + (size_t)m * N * Kd + rh + k)) : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
                for (int j = 0; j < NT; j++)
                    xv[j][v] = j < nt && xr[j] && in ? *(const uint4 *)(xr[j] + k) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int v = 0; v < V; v++) {
#pragma unroll
                for (int m = 0; m < NW; m++) {
                    const uint32_t a0[4] = {wl[m][v].x, wh[m][v].x, wl[m][v].y, wh[m][v].y};
                    const uint32_t a1[4] = {wl[m][v].z, wh[m][v].z, wl[m][v].w, wh[m][v].w};
#pragma unroll
                    for (int j = 0; j < NT; j++) {
                        if (j >= nt) break;
                        tc_mma(acc[m][j], a0, xv[j][v].x, xv[j][v].y);
                        tc_mma(acc[m][j], a1, xv[j][v].z, xv[j][v].w);
                    }
                }
            }
        }
        /* c[2h + q]: output row f0 + g + 8h, the tile's row 2t + q */
#pragma unroll
        for (int j = 0; j < NT; j++) {
            if (j >= nt) break;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int f = f0 + gid + 8 * h;
                if (f >= N) continue;
#pragma unroll
                for (int q = 0; q < 2; q++) {
                    const int r = g0 + 8 * j + 2 * tig + q;
                    if (r >= cnt) continue;
                    const size_t o = (size_t)er[r] * N + f;
                    const float g = acc[0][j][2 * h + q];
                    if (GATED) {
                        const float a = gelu ? k_gelu_tanh(g) : k_silu(g);
                        Yb[o] = k_f2bf(a * acc[NW - 1][j][2 * h + q]);
                    } else {
                        Yf[o] = g;
                    }
                }
            }
        }
    }
}

extern "C" int k_moe_gemm(const uint16_t *W, const uint16_t *X, int x_div, const int32_t *rows,
                          const int32_t *counts, int cap, int E, int N, int Kd, int gated, int gelu, int tcv_rows,
                          float *Yf, uint16_t *Yb, cudaStream_t s) {
    if (E <= 0 || N <= 0 || Kd <= 0 || Kd % 8 || cap < 0 || x_div <= 0) return -1;
    if (cap == 0) return 0;
    /* Up to MOE_GEMV_MAX_CAP tokens the GEMV. Above, the tensor-core tiles: the GEMV's fp32
     * FMAs bind it once experts get several rows (H200, Qwen3-30B-A3B widths at 64 tokens,
     * a layer's MoE: 696 us on the GEMV with row groups, 475 us on the tiles, whose gate|up
     * ran at 2.39 TB/s with 16 warps per SM under ncu) */
    if (cap <= MOE_GEMV_MAX_CAP) {
        if (gated)
            return moe_gemv_launch<true>(W, X, x_div, rows, counts, NULL, NULL, cap, E, N, Kd, gelu, NULL, 0.f, Yf, Yb,
                                         s);
        return moe_gemv_launch<false>(W, X, x_div, rows, counts, NULL, NULL, cap, E, N, Kd, gelu, NULL, 0.f, Yf, Yb,
                                      s);
    }
    /* Experts with up to tcv_rows rows on the tensor-core GEMV, the rest on the tiles (each
     * launch skips the other's experts; the runner's choice: k_tuning.moe_tcv). H100, Qwen3-30B-A3B widths,
     * bench_moe us a layer at 16 / 64 / 256 tokens with every expert on the GEMV: 298.1 /
     * 429.7 / 656.2 against the tiles' 409.2 / 612.6 / 653.8 (2.77 against 1.94 TB/s at
     * 64); `specd bench --shape qwen3-30b-a3b` decode at 16 / 64 / 256 rows 924 / 2,712 /
     * 6,717 tok/s against 705 / 1,949 / 6,303. But a 128-token prompt prefilled at 4.7k
     * tok/s on the GEMV against 9.8k on the tiles (likely: its tokens crowd into a few
     * experts, each a pass per 16 rows here): hence the row limit. */
    if (tcv_rows > 0) {
        const dim3 g((N + 127) / 128, E);   /* 16 output rows a warp, 8 warps a block */
        const int rc = gated ? k_launch(moe_tcv_kernel<true, 2, 2, 3>, g, dim3(256), 0, s, W, X, x_div, rows, counts,
                                        cap, tcv_rows, N, Kd, gelu, Yf, Yb)
                             : k_launch(moe_tcv_kernel<false, 2, 4, 2>, g, dim3(256), 0, s, W, X, x_div, rows, counts,
                                        cap, tcv_rows, N, Kd, gelu, Yf, Yb);
        if (rc || cap <= tcv_rows) return rc;   /* no expert holds more rows than the pass has tokens */
    }
    const int min_cnt = tcv_rows > 0 ? tcv_rows + 1 : 0;
    dim3 grid((N + MOE_TN - 1) / MOE_TN, E, (cap + MOE_TM - 1) / MOE_TM);
    if (gated)
        return k_launch(moe_gemm_kernel<true>, grid, dim3(MOE_TC_NT), 0, s, W, X, x_div, rows, counts, cap, min_cnt, N,
                        Kd, gelu, Yf, Yb);
    return k_launch(moe_gemm_kernel<false>, grid, dim3(MOE_TC_NT), 0, s, W, X, x_div, rows, counts, cap, min_cnt, N,
                    Kd, gelu, Yf, Yb);
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

/* ---- decode steps (n <= K_MOE_DEC_MAX_N tokens): three launches per layer -------------
 * k_moe_route_gemv (router GEMV, softmax, top-K, row lists and the list of experts that
 * have rows), k_moe_gated_dec (gate|up and the activation over the listed experts only)
 * and k_moe_down_combine (down, the weighted sum in k order, the residual add and, with
 * the norm fold, the next layer's xg and sums of squares). */

#define MOE_RT_WARPS 4   /* router GEMV: one expert's row per warp */

__global__ void __launch_bounds__(MOE_RT_WARPS * 32)
moe_route_gemv_kernel(const uint16_t *__restrict__ Wr, const uint16_t *__restrict__ X,
                      const unsigned long long *ss_in, float eps, int n, int hidden, int E, int K, int norm,
                      k_moe_route_buf b) {
    extern __shared__ __align__(16) uint16_t xsm[];   /* [n][hidden] */
    __shared__ int last;
    k_pdl_trigger();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int e = blockIdx.x * MOE_RT_WARPS + warp;
    /* the router row is a weight: requested before the wait */
    uint4 wv[MOE_GEMV_U];
#pragma unroll
    for (int u = 0; u < MOE_GEMV_U; u++) {
        const int k = lane * 8 + u * 256;
        wv[u] = e < E && k < hidden ? __ldg((const uint4 *)(Wr + (size_t)e * hidden + k)) : make_uint4(0, 0, 0, 0);
    }
    k_pdl_wait();
    /* the norm fold's sums of squares requested with x (not after the barrier and the dots) */
    unsigned long long ssr[K_MOE_DEC_MAX_N];
#pragma unroll
    for (int t = 0; t < K_MOE_DEC_MAX_N; t++) ssr[t] = ss_in && t < n ? ss_in[t] : 0ull;
    for (int i = tid; i < n * (hidden / 8); i += blockDim.x) ((uint4 *)xsm)[i] = ((const uint4 *)X)[i];
    __syncthreads();
    if (e < E) {
        float acc[K_MOE_DEC_MAX_N];
#pragma unroll
        for (int t = 0; t < K_MOE_DEC_MAX_N; t++) acc[t] = 0.f;
        for (int k0 = lane * 8; k0 < hidden; k0 += 256 * MOE_GEMV_U) {
#pragma unroll
            for (int u = 0; u < MOE_GEMV_U; u++) {
                const int k = k0 + u * 256;
                if (k >= hidden) break;
                if (k0 > lane * 8) wv[u] = __ldg((const uint4 *)(Wr + (size_t)e * hidden + k));
#pragma unroll
                for (int t = 0; t < K_MOE_DEC_MAX_N; t++) {
                    if (t >= n) break;
                    acc[t] = moe_dot8(wv[u], *(const uint4 *)(xsm + (size_t)t * hidden + k), acc[t]);
                }
            }
        }
#pragma unroll
        for (int t = 0; t < K_MOE_DEC_MAX_N; t++) {
            if (t >= n) break;
            const float v = k_warp_sum(acc[t]);
            const float rs = ss_in ? rsqrtf(k_ss_value(ssr[t]) * (1.f / hidden) + eps) : 1.f;
            if (lane == 0) b.logits[(size_t)t * E + e] = v * rs;
        }
    }
    /* the last block to finish routes every token (and leaves the counter at 0) */
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(b.done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int i = tid; i < E; i += blockDim.x) b.counts[i] = 0;
    if (tid == 0) {
        b.active[0] = n == 1 ? K : 0;
        *b.done = 0;
    }
    __syncthreads();
    /* One token: K distinct experts of one pair each, listed without atomics (each was a
     * round trip), and k_moe_gated_dec takes the picks from ids. H100, Qwen3-30B-A3B widths,
     * bench_moe at one token: the router launch 7.09 -> 6.23 us, the layer 38.07 -> 37.30;
     * `specd bench --shape qwen3-30b-a3b --batch 1`: 253.6-253.8 -> 256.4-256.5 tok/s. */
    if (n == 1) {
        __shared__ int pick[16];
        if (warp == 0) {
            int e;
            float w;
            moe_topk(b.logits, E, K, norm, e, w);
            if (lane < K) {
                b.ids[lane] = e;
                b.w[lane] = w;
                b.counts[e] = 1;
                b.rows[e] = lane;
                b.active[1 + lane] = e;
                pick[lane] = e;
            }
        }
        if (!b.l2_gu) return;
        /* the picks' first gate and up rows into L2, pick 0 first (the gated launch's
         * blocks start with it) */
        __syncthreads();
        const size_t half = (size_t)b.l2_F * hidden * 2, pb = min(b.l2_bytes, half);
        const size_t nch = (pb + K_L2PF_CHUNK - 1) / K_L2PF_CHUNK;
        for (size_t i = tid; i < (size_t)K * 2 * nch; i += blockDim.x) {
            const size_t c = i % nch, off = c * K_L2PF_CHUNK;
            const int k = (int)(i / (2 * nch)), h = (int)(i / nch % 2);
            const char *base = (const char *)(b.l2_gu + (size_t)pick[k] * 2 * b.l2_F * hidden) + h * half;
            k_l2_prefetch(base + off, (unsigned)min((size_t)K_L2PF_CHUNK, pb - off));
        }
        return;
    }
    for (int t = warp; t < n; t += MOE_RT_WARPS)
        moe_route_token(b.logits, t, n, E, K, norm, b.ids, b.w, b.counts, b.rows, b.active);
}

extern "C" int k_moe_route_gemv(const uint16_t *Wr, const uint16_t *X, const k_norm_in *nin, int n, int hidden,
                                int E, int K, int norm, const k_moe_route_buf *b, cudaStream_t s) {
    if (n < 1 || n > K_MOE_DEC_MAX_N || hidden <= 0 || hidden % 8 || E <= 0 || E > 512 || K <= 0 || K > 16 ||
        K > E || !b || !b->logits || !b->ids || !b->w || !b->counts || !b->rows || !b->active || !b->done ||
        (b->l2_gu && (b->l2_F <= 0 || b->l2_bytes % 16 || (uintptr_t)b->l2_gu % 16)) ||
        (nin && !nin->ss) || ((uintptr_t)Wr | (uintptr_t)X) % 16)
        return -1;
    const size_t smem = (size_t)n * hidden * 2;
    if (smem > 48 * 1024 &&
        cudaFuncSetAttribute(moe_route_gemv_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem))
        return -1;
    return k_launch(moe_route_gemv_kernel, dim3((E + MOE_RT_WARPS - 1) / MOE_RT_WARPS), dim3(MOE_RT_WARPS * 32), smem,
                    s, Wr, X, nin ? nin->ss : (const unsigned long long *)NULL, nin ? nin->eps : 0.f, n, hidden, E, K,
                    norm, *b);
}

extern "C" int k_moe_gated_dec(const uint16_t *W, const uint16_t *X, const k_norm_in *nin,
                               const k_moe_route_buf *b, int n, int E, int K, int N, int Kd, int gelu,
                               uint16_t *act, cudaStream_t s) {
    if (n < 1 || n > K_MOE_DEC_MAX_N || E <= 0 || K <= 0 || K > E || N <= 0 || Kd <= 0 || Kd % 8 || !b ||
        !b->active || !b->ids || (nin && !nin->ss) || ((uintptr_t)W | (uintptr_t)X) % 16)
        return -1;
    const int slots = n * K < E ? n * K : E;
    /* one token: block y takes pick y straight from ids (K distinct experts, one pair each),
     * not through the active list, its count and its row list: two dependent loads fewer */
    return moe_gemv_launch<true>(W, X, K, b->rows, b->counts, b->active, n == 1 ? b->ids : NULL, n, slots, N, Kd, gelu,
                                 nin ? nin->ss : NULL, nin ? nin->eps : 0.f, NULL, act, s);
}

/* Block (column group x, token t) owns MOE_DC_COLS output columns of token t: warp k takes
 * the token's pair t * K + k (and k + 8, ... when K > 8), its expert's MOE_DC_COLS down rows
 * against the pair's activation with every load of a pass in flight (a block barrier after
 * the loads keeps the compiler from sinking them into the math), the per-pair dots meet in
 * shared memory, and the epilogue sums them in k order with the routing weights, adds the
 * residual and writes the norm fold. */
#define MOE_DC_COLS 4
#define MOE_DC_U 4

/* A read-only 16-byte load that stays on its side of a barrier (volatile asm with a memory
 * clobber): with the math starting after the barrier, every load of a pass is in flight
 * before the first FMA waits on one. */
__device__ __forceinline__ uint4 moe_ld_pinned(const void *p) {
    uint4 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}

__global__ void __launch_bounds__(MOE_NT)
moe_down_combine_kernel(const uint16_t *__restrict__ W, const uint16_t *__restrict__ act, k_moe_route_buf b, int K,
                        int N, int Kd, float *resid, k_norm_out nout) {
    __shared__ float part[16][MOE_DC_COLS];
    __shared__ float zero_s;
    if (threadIdx.x == 0) zero_s = 0.f;   /* shared memory: no kernel before reads it */
    k_pdl_trigger();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, c0 = blockIdx.x * MOE_DC_COLS, t = blockIdx.y;
    uint4 wv[MOE_DC_COLS][MOE_DC_U], av[MOE_DC_U];
    auto load_w = [&](const uint16_t *We, int k0) {   /* unconditional (clamped) loads */
#pragma unroll
        for (int u = 0; u < MOE_DC_U; u++)
#pragma unroll
            for (int c = 0; c < MOE_DC_COLS; c++)
                wv[c][u] = moe_ld_pinned(We + (size_t)c * Kd + min(k0 + u * 256, Kd - 8));
    };
    /* The first pair's first pass of weights goes out before the wait: its expert id comes
     * from the routing two launches back, finished by now (k_moe_gated_dec lets this
     * launch start only after its own wait), and only act comes from the launch before. */
    int p = t * K + min(warp, K - 1);   /* warps past K load a real pair and drop it */
    const uint16_t *We = W + ((size_t)b.ids[p] * N + c0) * Kd;
    load_w(We, lane * 8);
    /* what warp 0's epilogue reads, requested early so the tail does not wait on it: the
     * next norm's weight (before the wait), the residual of its columns and the routing
     * weights (after) */
    const float g_own = nout.xg && warp == 0 && lane < MOE_DC_COLS ? nout.g[c0 + lane] : 0.f;
    k_pdl_wait();
    float h_own = 0.f, w_own = 0.f;   /* lane k < K: pick k's weight */
    if (warp == 0) {
        if (lane < MOE_DC_COLS) h_own = resid[(size_t)t * N + c0 + lane];
        if (lane < K) w_own = b.w[t * K + lane];
    }
    for (int k = warp; k < (K + MOE_NT / 32 - 1) / (MOE_NT / 32) * (MOE_NT / 32); k += MOE_NT / 32) {
        if (k != warp) {
            p = t * K + min(k, K - 1);
            We = W + ((size_t)b.ids[p] * N + c0) * Kd;
        }
        const uint16_t *a = act + (size_t)p * Kd;
        float acc[MOE_DC_COLS];
#pragma unroll
        for (int c = 0; c < MOE_DC_COLS; c++) acc[c] = 0.f;
        for (int k0 = 0; k0 < Kd; k0 += 256 * MOE_DC_U) {   /* the same passes for every lane */
            const int kb = k0 + lane * 8;
            if (k != warp || k0) load_w(We, kb);
#pragma unroll
            for (int u = 0; u < MOE_DC_U; u++) av[u] = moe_ld_pinned(a + min(kb + u * 256, Kd - 8));
            __syncthreads();   /* every warp runs the same passes: K and Kd are the block's */
            /* the math starts from a shared-memory zero read after the barrier, so none of
             * it can be scheduled between the loads */
#pragma unroll
            for (int c = 0; c < MOE_DC_COLS; c++) acc[c] += *(volatile float *)&zero_s;
#pragma unroll
            for (int u = 0; u < MOE_DC_U; u++)
                if (kb + u * 256 >= Kd) av[u] = make_uint4(0, 0, 0, 0);   /* past the row: adds 0 */
#pragma unroll
            for (int u = 0; u < MOE_DC_U; u++)
#pragma unroll
                for (int c = 0; c < MOE_DC_COLS; c++) acc[c] = moe_dot8(wv[c][u], av[u], acc[c]);
        }
#pragma unroll
        for (int c = 0; c < MOE_DC_COLS; c++) {
            const float v = k_warp_sum(acc[c]);
            if (lane == 0 && k < K) part[k][c] = v;
        }
    }
    __syncthreads();
    if (warp) return;
    /* warp 0: lane c < MOE_DC_COLS finishes column c0 + c */
    const int c = lane % MOE_DC_COLS, col = c0 + c;
    float hh = 0.f;
    float s = 0.f;
    for (int k = 0; k < K; k++) s = fmaf(__shfl_sync(0xffffffffu, w_own, k), part[k][c], s);
    if (lane < MOE_DC_COLS) {
        const float h = h_own + s;
        resid[(size_t)t * N + col] = h;
        if (nout.xg) {
            nout.xg[(size_t)t * N + col] = k_f2bf(h * g_own);
            hh = h * h;
        }
    }
    if (nout.xg) {   /* the block's share of the token's sum of h^2 (fixed point, specd_kernels.h) */
#pragma unroll
        for (int o = 1; o < MOE_DC_COLS; o <<= 1) hh += __shfl_xor_sync(0xffffffffu, hh, o);
        if (lane == 0) atomicAdd(nout.ss + t, k_ss_units(hh));
    }
}

extern "C" int k_moe_down_combine(const uint16_t *W, const uint16_t *act, const k_moe_route_buf *b, int n, int K,
                                  int N, int Kd, float *resid, const k_norm_out *nout, cudaStream_t s) {
    if (n < 1 || n > K_MOE_DEC_MAX_N || K <= 0 || K > 16 || N <= 0 || N % MOE_DC_COLS || Kd <= 0 || Kd % 8 || !b ||
        !b->ids || !b->w ||
        (nout && (!nout->g || !nout->xg || !nout->ss)) || ((uintptr_t)W | (uintptr_t)act) % 16)
        return -1;
    const k_norm_out no = nout ? *nout : k_norm_out{NULL, NULL, NULL};
    return k_launch(moe_down_combine_kernel, dim3(N / MOE_DC_COLS, n), dim3(MOE_NT), 0, s, W, act, *b, K, N, Kd,
                    resid, no);
}

/* ---- one token in one launch (k_moe_decode1) ------------------------------------------
 * The router, the routing, gate|up, down and the combine of a single token in one grid of
 * G blocks (at most one an SM, all resident together: they meet at two grid barriers).
 *   1. Each warp computes router logits (expert blockIdx.x + G * warp, ...) in
 *      k_moe_route_gemv's order of sums (the same bits); grid barrier; every block then
 *      takes the top K itself (moe_topk: the same picks and weights everywhere).
 *   2. The picks' intermediate rows are cut into units of `slice` rows (K * S units, S a
 *      pick): a block takes units blockIdx.x, + G, ... and for each computes its rows'
 *      act(gate) * up (moe_gemv_kernel's order of sums: the same bf16 values) and then that
 *      slice's share of down, W_down[:, slice] . act[slice], for every output column into
 *      its partial sum (scaled by the pick's weight). The down columns of the slice go
 *      global -> shared by cp.async in a ring of D1_NS chunks, the first ones requested when
 *      the unit starts, so they stream in while gate|up runs.
 *   3. Grid barrier; block b sums every block's partial for its share of the columns in
 *      block order, adds the residual and writes the norm fold's xg / ss.
 * Why: at batch 1 the three decode launches spent ~51 us a layer at Qwen3-30B-A3B's widths
 * on an H100 against ~25 us for their bytes at the copy roofline; this form has no launch
 * boundary between the router, gate|up and down, and no second wave of down blocks. */
#define D1_NT 512
#define D1_W (D1_NT / 32)
#define D1_NS 8          /* down chunks in flight (ring stages) */
#define D1_MAX_SLICE 64
#define D1_U 8           /* 16-byte loads per lane and matrix in flight: 2048 elements a pass */

/* All G blocks of the grid (every one resident) wait here for each other. Each barrier adds
 * 0x80000000 to the counter in all (block 0 adds that less G - 1, the rest 1 each), so its
 * top bit flips when the last block arrives and the counter needs no reset. A wait of 2^32
 * cycles (seconds; a barrier takes microseconds) means a block could not become resident
 * (another client holding SMs under MPS, say): the kernel traps, so the step fails with a
 * CUDA error instead of hanging. */
__device__ __forceinline__ void d1_grid_sync(unsigned *bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned add = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1) : 1u;
        __threadfence();
        const unsigned old = atomicAdd(bar, add);
        const long long t0 = clock64();
        unsigned cur;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(cur) : "l"(bar) : "memory");
            if (clock64() - t0 > (1ll << 32)) __trap();
        } while (((old ^ cur) & 0x80000000u) == 0);
        __threadfence();
    }
    __syncthreads();
}

__global__ void __launch_bounds__(D1_NT, 1)
moe_decode1_kernel(const uint16_t *__restrict__ Wr, const uint16_t *__restrict__ Wgu, const uint16_t *__restrict__ Wd,
                   const uint16_t *__restrict__ X, const unsigned long long *ss_in, float eps, int hidden, int E, int K,
                   int F, int norm, int gelu, int slice, int S, int CR, k_moe_route_buf b, float *part, unsigned *bar,
                   float *resid, k_norm_out nout, uint16_t *act) {
    extern __shared__ __align__(16) unsigned char d1_smem[];
    uint16_t *xs = (uint16_t *)d1_smem;                          /* [hidden] x */
    float *ys = (float *)(d1_smem + (size_t)hidden * 2);         /* [hidden] this block's partial */
    uint16_t *ring = (uint16_t *)(d1_smem + (size_t)hidden * 6); /* [D1_NS][CR][slice] down columns */
    __shared__ float hs[D1_MAX_SLICE];
    __shared__ int pe[16];
    __shared__ float pw[16], red[D1_W];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, G = gridDim.x;
    /* before the wait: this warp's first router row (a weight) and the partial zeroed */
    const int e_first = blockIdx.x + G * warp;
    uint4 wr[D1_U];
#pragma unroll
    for (int u = 0; u < D1_U; u++) {
        const int k = lane * 8 + u * 256;
        wr[u] = e_first < E && k < hidden ? __ldg((const uint4 *)(Wr + (size_t)e_first * hidden + k))
                                          : make_uint4(0, 0, 0, 0);
    }
    for (int i = tid; i < hidden; i += D1_NT) ys[i] = 0.f;
    k_pdl_wait();
    const float rs = ss_in ? rsqrtf(k_ss_value(*ss_in) * (1.f / hidden) + eps) : 1.f;
    for (int i = tid; i < hidden / 8; i += D1_NT) ((uint4 *)xs)[i] = ((const uint4 *)X)[i];
    __syncthreads();
    /* 1. router logits, one warp an expert (k_moe_route_gemv's lanes and order) */
    for (int e = e_first; e < E; e += G * D1_W) {
        float acc = 0.f;
        for (int k0 = lane * 8; k0 < hidden; k0 += 256 * D1_U) {
#pragma unroll
            for (int u = 0; u < D1_U; u++) {
                const int k = k0 + u * 256;
                if (k >= hidden) break;
                if (e != e_first || k0 > lane * 8) wr[u] = __ldg((const uint4 *)(Wr + (size_t)e * hidden + k));
                acc = moe_dot8(wr[u], *(const uint4 *)(xs + k), acc);
            }
        }
        const float v = k_warp_sum(acc);
        if (lane == 0) b.logits[e] = v * rs;
    }
    d1_grid_sync(bar);
    /* every block is resident now: the next launch may start (it waits for this one) */
    k_pdl_trigger();
    if (warp == 0) {
        int e;
        float w;
        moe_topk(b.logits, E, K, norm, e, w);
        if (lane < K) {
            pe[lane] = e;
            pw[lane] = w;
            if (blockIdx.x == 0) {
                b.ids[lane] = e;
                b.w[lane] = w;
            }
        }
    }
    __syncthreads();
    /* 2. units: gate|up of `slice` intermediate rows, then their share of down */
    const int lpr = slice / 8, rpw = 32 / lpr, ci = lane % lpr, rl = lane / lpr;
    for (int unit = blockIdx.x; unit < K * S; unit += G) {
        const int k = unit / S, j0 = (unit % S) * slice, nj = min(F - j0, slice), e = pe[k];
        const float wk = pw[k];
        const uint16_t *dn = Wd + (size_t)e * hidden * F + j0;   /* row n of the slice at n * F */
        const int nch = (hidden + CR - 1) / CR, words = nj / 8;
        /* chunk c (rows c * CR ..) into stage c % D1_NS; one commit a chunk, empty past the end */
        auto issue = [&](int c) {
            if (c < nch) {
                const int r0 = c * CR, nr = min(CR, hidden - r0);
                uint16_t *st = ring + (size_t)(c % D1_NS) * CR * slice;
                for (int i = tid; i < nr * words; i += D1_NT) {
                    const int r = i / words, wd = i % words;
                    tc_cp16(tc_smem_addr(st + (size_t)r * slice + wd * 8), dn + (size_t)(r0 + r) * F + wd * 8, true);
                }
            }
            tc_commit();
        };
        for (int c = 0; c < D1_NS; c++) issue(c);
        /* gate|up: warp w takes rows j0 + w, + D1_W, ... (moe_gemv_kernel's lanes and order) */
        const uint16_t *gu = Wgu + (size_t)e * 2 * F * hidden;
        for (int jj = warp; jj < nj; jj += D1_W) {
            const uint16_t *gr = gu + (size_t)(j0 + jj) * hidden, *ur = gr + (size_t)F * hidden;
            float ag = 0.f, au = 0.f;
            for (int k0 = lane * 8; k0 < hidden; k0 += 256 * D1_U) {
                uint4 wg[D1_U], wu[D1_U];
#pragma unroll
                for (int u = 0; u < D1_U; u++) {
                    const int kk = min(k0 + u * 256, hidden - 8);   /* clamped: unconditional loads */
                    wg[u] = __ldcs((const uint4 *)(gr + kk));
                    wu[u] = __ldcs((const uint4 *)(ur + kk));
                }
#pragma unroll
                for (int u = 0; u < D1_U; u++) {
                    const int kk = k0 + u * 256;
                    if (kk >= hidden) break;
                    const uint4 xv = *(const uint4 *)(xs + kk);
                    ag = moe_dot8(wg[u], xv, ag);
                    au = moe_dot8(wu[u], xv, au);
                }
            }
            const float g = k_warp_sum(ag) * rs, uu = k_warp_sum(au) * rs;
            if (lane == 0) {
                const uint16_t h = k_f2bf((gelu ? k_gelu_tanh(g) : k_silu(g)) * uu);
                hs[jj] = k_bf2f(h);
                if (act) act[(size_t)k * F + j0 + jj] = h;
            }
        }
        __syncthreads();
        /* down: lane (rl, ci) holds act of columns 8 ci .. 8 ci + 7 of the slice; lpr lanes
         * a row, rpw rows a warp at a time */
        const bool on = rl < rpw && ci < words;
        float hv[8];
#pragma unroll
        for (int i = 0; i < 8; i++) hv[i] = on ? hs[ci * 8 + i] : 0.f;
        for (int c = 0; c < nch; c++) {
            tc_wait<D1_NS - 1>();
            __syncthreads();   /* chunk c landed for every thread */
            const int r0 = c * CR, nr = min(CR, hidden - r0);
            const uint16_t *st = ring + (size_t)(c % D1_NS) * CR * slice;
            for (int r = warp * rpw + rl; r - rl < nr; r += D1_W * rpw) {
                float p = 0.f;
                if (on && r < nr) {
                    const uint4 wv = *(const uint4 *)(st + (size_t)r * slice + ci * 8);
                    const uint16_t *wh = (const uint16_t *)&wv;
#pragma unroll
                    for (int i = 0; i < 8; i++) p = fmaf(hv[i], k_bf2f(wh[i]), p);
                }
                float sum = 0.f;   /* the row's lanes in order */
                for (int i = 0; i < lpr; i++) sum += __shfl_sync(0xffffffffu, p, (rl * lpr + i) & 31);
                if (ci == 0 && rl < rpw && r < nr) ys[r0 + r] = fmaf(wk, sum, ys[r0 + r]);
            }
            __syncthreads();   /* stage free again */
            issue(c + D1_NS);
        }
    }
    __syncthreads();
    for (int i = tid; i < hidden; i += D1_NT) part[(size_t)blockIdx.x * hidden + i] = ys[i];
    d1_grid_sync(bar);
    /* 3. block b's columns: every block's partial in block order, the residual, the fold */
    const int n0 = (int)((long)hidden * blockIdx.x / G), n1 = (int)((long)hidden * (blockIdx.x + 1) / G);
    float hh = 0.f;
    for (int n = n0 + warp; n < n1; n += D1_W) {
        float y = 0.f;
        for (int bb = lane; bb < G; bb += 32) y += __ldcg(part + (size_t)bb * hidden + n);
        y = k_warp_sum(y);
        if (lane == 0) {
            const float h = resid[n] + y;
            resid[n] = h;
            if (nout.xg) {
                nout.xg[n] = k_f2bf(h * nout.g[n]);
                hh += h * h;
            }
        }
    }
    if (nout.xg) {   /* the block's share of the sum of h^2 (fixed point), warps in order */
        if (lane == 0) red[warp] = hh;
        __syncthreads();
        if (tid == 0) {
            float s = 0.f;
            for (int w = 0; w < D1_W; w++) s += red[w];
            atomicAdd(nout.ss, k_ss_units(s));
        }
    }
}

/* The slice (rows of a pick's intermediate a unit, a multiple of 8 in 32..64) that leaves
 * the fewest rows on the busiest block of min(K * S, SMs), the larger one on ties. */
static int d1_slice(int K, int F, int sms, int *S_out) {
    int best = 0, best_cost = 0;
    for (int sl = 32; sl <= D1_MAX_SLICE; sl += 8) {
        const int S = (F + sl - 1) / sl, units = K * S, G = units < sms ? units : sms;
        const int cost = (units + G - 1) / G * sl;
        if (!best || cost <= best_cost) best = sl, best_cost = cost, *S_out = S;
    }
    return best;
}

extern "C" size_t k_moe_decode1_part_floats(int hidden) { return (size_t)k_sm_count() * (size_t)hidden; }

/* The launch's shape: slice, S, G, the ring's rows a chunk CR and the dynamic shared
 * memory; -1 when the form does not apply (then nothing is launched). The last widths'
 * plan is kept: an eager step asks once a layer, and the attribute and occupancy queries
 * are host calls of microseconds (one engine thread and one device a process). */
static int d1_plan_new(int hidden, int E, int K, int F, int *slice, int *S, int *G, int *CR, size_t *smem);
static int d1_plan(int hidden, int E, int K, int F, int *slice, int *S, int *G, int *CR, size_t *smem) {
    static int key[4] = {-1, -1, -1, -1}, rc, c_slice, c_S, c_G, c_CR;
    static size_t c_smem;
    if (key[0] != hidden || key[1] != E || key[2] != K || key[3] != F) {
        rc = d1_plan_new(hidden, E, K, F, &c_slice, &c_S, &c_G, &c_CR, &c_smem);
        key[0] = hidden, key[1] = E, key[2] = K, key[3] = F;
    }
    *slice = c_slice, *S = c_S, *G = c_G, *CR = c_CR, *smem = c_smem;
    return rc;
}

static int d1_plan_new(int hidden, int E, int K, int F, int *slice, int *S, int *G, int *CR, size_t *smem) {
    if (hidden <= 0 || hidden % 8 || F <= 0 || F % 8 || E <= 0 || E > 512 || K <= 0 || K > 16 || K > E) return -1;
    const int sms = k_sm_count();
    *slice = d1_slice(K, F, sms, S);
    *G = K * *S < sms ? K * *S : sms;
    /* a ring of D1_NS chunks in what shared memory is left after x and the partial */
    int dev = 0, smem_max = 0;
    if (cudaGetDevice(&dev) || cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev))
        return -1;
    const size_t fixed = (size_t)hidden * 6, stat = 1024;
    if ((size_t)smem_max < fixed + stat + (size_t)D1_NS * 8 * *slice * 2) return -1;
    *CR = (int)(((size_t)smem_max - fixed - stat) / ((size_t)D1_NS * *slice * 2));
    const int want = (hidden + D1_NS - 1) / D1_NS;   /* the whole slice staged at once where it fits */
    if (*CR > want) *CR = want;
    *smem = fixed + (size_t)D1_NS * *CR * *slice * 2;
    if (cudaFuncSetAttribute(moe_decode1_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)*smem)) return -1;
    /* the grid barriers need every block resident at once: one an SM at least */
    int per_sm = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, moe_decode1_kernel, D1_NT, *smem) || per_sm < 1)
        return -1;
    return 0;
}

extern "C" int k_moe_decode1_fits(int hidden, int E, int K, int F) {
    int slice, S, G, CR;
    size_t smem;
    return d1_plan(hidden, E, K, F, &slice, &S, &G, &CR, &smem);
}

extern "C" int k_moe_decode1(const uint16_t *Wr, const uint16_t *Wgu, const uint16_t *Wd, const uint16_t *X,
                             const k_norm_in *nin, int hidden, int E, int K, int F, int norm, int gelu,
                             const k_moe_route_buf *b, float *part, unsigned *bar, float *resid,
                             const k_norm_out *nout, uint16_t *act, cudaStream_t s) {
    int slice, S, G, CR;
    size_t smem;
    if (!b || !b->logits || !b->ids || !b->w || !part || !bar || !resid || (nin && !nin->ss) ||
        (nout && (!nout->g || !nout->xg || !nout->ss)) ||
        ((uintptr_t)Wr | (uintptr_t)Wgu | (uintptr_t)Wd | (uintptr_t)X) % 16 ||
        d1_plan(hidden, E, K, F, &slice, &S, &G, &CR, &smem))
        return -1;
    const k_norm_out no = nout ? *nout : k_norm_out{NULL, NULL, NULL};
    return k_launch(moe_decode1_kernel, dim3(G), dim3(D1_NT), smem, s, Wr, Wgu, Wd, X,
                    nin ? nin->ss : (const unsigned long long *)NULL, nin ? nin->eps : 0.f, hidden, E, K, F, norm, gelu,
                    slice, S, CR, *b, part, bar, resid, no, act);
}
