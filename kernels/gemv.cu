/* Skinny GEMM for decode (n <= 8 rows of activations): Y[t, o] (+)= sum_k W[o, k] X[t, k],
 * W [out, in] bf16, X [n, in] bf16, Y [n, out] fp32, fp32 accumulation. At batch 1-8 a
 * decode step is a stream over every weight once, so these kernels are written for memory
 * bandwidth: one warp per output row, 16-byte weight loads marked streaming (they are
 * read once per step and must not evict the activations), four loads in flight per lane
 * before any arithmetic, and the first of them issued before the programmatic-launch
 * wait, so a GEMV starts pulling its weights while the kernel before it finishes.
 *
 * Two fused forms for the batch-1/2 path (k_gemv_norm_bf16; the runner uses them only with
 * SPECD_CUDA_FUSE_NORM=1: on an H200 they were slower than the separate norm kernel, as the
 * norm prologue delays every block's weight stream):
 *   - the RMSNorm that feeds a projection is done in the GEMV's prologue: each block
 *     normalises the fp32 residual rows into shared memory as bf16 (the same rounding the
 *     separate k_rmsnorm does), so no norm kernel runs and no normalised copy is stored;
 *   - gated: W is the fused [2F, in] gate|up matrix and a warp computes gate row o and up
 *     row F + o together, writing bf16 silu(gate) * up -- the SiLU-and-mul kernel and the
 *     fp32 [n, 2F] intermediate disappear. */
#include "kernels/specd_kernels.h"
#include "kernels/kutil.h"

#define GEMV_WARPS 8
#define GEMV_UNROLL 4

__device__ __forceinline__ float dot8(uint4 w, uint4 x) {
    float s = 0.f;
    uint32_t wa[4] = {w.x, w.y, w.z, w.w}, xa[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        s = fmaf(__uint_as_float(wa[i] << 16), __uint_as_float(xa[i] << 16), s);
        s = fmaf(__uint_as_float(wa[i] & 0xffff0000u), __uint_as_float(xa[i] & 0xffff0000u), s);
    }
    return s;
}

/* acc[b] += W[row, :] . X[b, :] for one warp; w0 holds the first GEMV_UNROLL loads
 * (issued by the caller, possibly before the PDL wait). X may be global or shared. */
template <int NB, int U = GEMV_UNROLL>
__device__ __forceinline__ void warp_row_dot(const uint4 *__restrict__ w, const uint4 *X, int in8, int lane,
                                             uint4 (&w0)[U], float (&acc)[NB]) {
    int k = lane;
    bool first = true;
    for (; k + 32 * (U - 1) < in8; k += 32 * U) {
        uint4 wv[U];
        if (first) {
#pragma unroll
            for (int u = 0; u < U; u++) wv[u] = w0[u];
            first = false;
        } else {
#pragma unroll
            for (int u = 0; u < U; u++) wv[u] = __ldcs(w + k + 32 * u);
        }
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int b = 0; b < NB; b++) acc[b] += dot8(wv[u], X[(size_t)b * in8 + k + 32 * u]);
    }
    for (; k < in8; k += 32) {
        uint4 wv = __ldcs(w + k);
#pragma unroll
        for (int b = 0; b < NB; b++) acc[b] += dot8(wv, X[(size_t)b * in8 + k]);
    }
}

/* The first GEMV_UNROLL loads of a row (only when the row has a full first group). */
template <int U = GEMV_UNROLL>
__device__ __forceinline__ void prefetch_row(const uint4 *__restrict__ w, int in8, int lane, uint4 (&w0)[U]) {
    if (lane + 32 * (U - 1) < in8) {
#pragma unroll
        for (int u = 0; u < U; u++) w0[u] = __ldcs(w + lane + 32 * u);
    }
}

template <int NB, int U>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_kernel(const uint4 *__restrict__ W, const uint4 *__restrict__ X, float *__restrict__ Y,
            int out, int in8, int accumulate) {
    k_pdl_trigger();
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    uint4 w0[U];
    if (row < out) prefetch_row<U>(W + (size_t)row * in8, in8, lane, w0);
    k_pdl_wait();
    if (row >= out) return;
    float acc[NB];
#pragma unroll
    for (int b = 0; b < NB; b++) acc[b] = 0.f;
    warp_row_dot<NB, U>(W + (size_t)row * in8, X, in8, lane, w0, acc);
#pragma unroll
    for (int b = 0; b < NB; b++) {
        float v = k_warp_sum(acc[b]);
        if (lane == 0) {
            float *y = Y + (size_t)b * out + row;
            *y = accumulate ? *y + v : v;
        }
    }
}

/* Normalise NB fp32 rows of length in (= in8 * 8) into shared bf16 (RMSNorm with weight
 * nw), block-wide. */
template <int NB>
__device__ __forceinline__ void norm_to_smem(const float *__restrict__ x, const float *__restrict__ nw, float eps,
                                             int in8, uint16_t *xs, float *red) {
    const int in = in8 * 8;
    for (int b = 0; b < NB; b++) {
        const float4 *xr = (const float4 *)(x + (size_t)b * in);
        float ss = 0.f;
        for (int j = threadIdx.x; j < in / 4; j += blockDim.x) {
            float4 v = xr[j];
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
        ss = k_block_sum(ss, red);
        const float inv = rsqrtf(ss / (float)in + eps);
        const float4 *w4 = (const float4 *)nw;
        for (int j = threadIdx.x; j < in / 4; j += blockDim.x) {
            float4 v = xr[j], w = w4[j];
            uint2 o;
            o.x = (uint32_t)k_f2bf(v.x * inv * w.x) | ((uint32_t)k_f2bf(v.y * inv * w.y) << 16);
            o.y = (uint32_t)k_f2bf(v.z * inv * w.z) | ((uint32_t)k_f2bf(v.w * inv * w.w) << 16);
            ((uint2 *)(xs + (size_t)b * in))[j] = o;
        }
    }
    __syncthreads();
}

/* rows = out (plain: Y fp32 [NB, out] = W . norm(x)) or F (gated: W has 2F rows, act
 * [NB, F] bf16 = silu(W[o] . xn) * (W[F + o] . xn)). Grid-stride over rows so the norm
 * prologue runs once per block, not once per 8 rows. */
template <int NB, bool GATED>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
gemv_norm_kernel(const uint4 *__restrict__ W, const float *__restrict__ x, const float *__restrict__ nw, float eps,
                 float *__restrict__ Y, uint16_t *__restrict__ act, int rows, int in8) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ float red[32];
    uint16_t *xs = (uint16_t *)smem_raw;
    k_pdl_trigger();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int row = blockIdx.x * GEMV_WARPS + warp;
    const int stride = gridDim.x * GEMV_WARPS;
    uint4 wg0[GEMV_UNROLL], wu0[GEMV_UNROLL];
    if (row < rows) {
        prefetch_row(W + (size_t)row * in8, in8, lane, wg0);
        if (GATED) prefetch_row(W + (size_t)(rows + row) * in8, in8, lane, wu0);
    }
    k_pdl_wait();
    norm_to_smem<NB>(x, nw, eps, in8, xs, red);
    const uint4 *X = (const uint4 *)xs;
    bool first = true;
    for (; row < rows; row += stride) {
        const uint4 *wg = W + (size_t)row * in8, *wu = W + (size_t)(rows + row) * in8;
        if (!first) {
            prefetch_row(wg, in8, lane, wg0);
            if (GATED) prefetch_row(wu, in8, lane, wu0);
        }
        first = false;
        float g[NB], u[NB];
#pragma unroll
        for (int b = 0; b < NB; b++) g[b] = u[b] = 0.f;
        warp_row_dot<NB>(wg, X, in8, lane, wg0, g);
        if (GATED) warp_row_dot<NB>(wu, X, in8, lane, wu0, u);
#pragma unroll
        for (int b = 0; b < NB; b++) {
            float gv = k_warp_sum(g[b]);
            if (GATED) {
                float uv = k_warp_sum(u[b]);
                if (lane == 0) act[(size_t)b * rows + row] = k_f2bf(gv / (1.f + expf(-gv)) * uv);
            } else if (lane == 0) {
                Y[(size_t)b * rows + row] = gv;
            }
        }
    }
}

extern "C" int k_gemv_bf16(const uint16_t *W, const uint16_t *X, float *Y, int out, int in,
                           int n, int accumulate, cudaStream_t s) {
    if (out <= 0 || in <= 0 || in % 8 || n < 1 || n > K_GEMV_MAX_N ||
        ((uintptr_t)W | (uintptr_t)X) % 16)
        return -1;
    dim3 grid((out + GEMV_WARPS - 1) / GEMV_WARPS), block(GEMV_WARPS * 32);
    const uint4 *w = (const uint4 *)W, *x = (const uint4 *)X;
    int in8 = in / 8;
    switch (n) {
    case 1: return k_launch(gemv_kernel<1, 4>, grid, block, 0, s, w, x, Y, out, in8, accumulate);
    case 2: return k_launch(gemv_kernel<2, 4>, grid, block, 0, s, w, x, Y, out, in8, accumulate);
    case 3: return k_launch(gemv_kernel<3, 4>, grid, block, 0, s, w, x, Y, out, in8, accumulate);
    case 4: return k_launch(gemv_kernel<4, 4>, grid, block, 0, s, w, x, Y, out, in8, accumulate);
    case 5: return k_launch(gemv_kernel<5, 4>, grid, block, 0, s, w, x, Y, out, in8, accumulate);
    case 6: return k_launch(gemv_kernel<6, 4>, grid, block, 0, s, w, x, Y, out, in8, accumulate);
    case 7: return k_launch(gemv_kernel<7, 4>, grid, block, 0, s, w, x, Y, out, in8, accumulate);
    default: return k_launch(gemv_kernel<8, 4>, grid, block, 0, s, w, x, Y, out, in8, accumulate);
    }
}

extern "C" int k_gemv_norm_bf16(const uint16_t *W, const float *x, const float *norm_w, float eps, float *Y,
                                uint16_t *act, int rows, int in, int n, cudaStream_t s) {
    if (rows <= 0 || in <= 0 || in % 8 || n < 1 || n > K_GEMV_NORM_MAX_N || (!Y == !act) ||
        ((uintptr_t)W | (uintptr_t)x | (uintptr_t)norm_w) % 16)
        return -1;
    size_t smem = (size_t)n * in * 2;
    if (smem > 96 * 1024) return -1;
    static int attr_set = 0;
    if (!attr_set) {   /* room for hidden sizes up to 24576 at n = 2 */
        cudaFuncSetAttribute(gemv_norm_kernel<1, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024);
        cudaFuncSetAttribute(gemv_norm_kernel<1, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024);
        cudaFuncSetAttribute(gemv_norm_kernel<2, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024);
        cudaFuncSetAttribute(gemv_norm_kernel<2, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024);
        attr_set = 1;
    }
    /* one row per warp (a grid of 4 blocks per SM striding over the rows, so the norm
     * prologue ran fewer times, measured slower on an H200) */
    dim3 grid((rows + GEMV_WARPS - 1) / GEMV_WARPS), block(GEMV_WARPS * 32);
    const uint4 *w = (const uint4 *)W;
    int in8 = in / 8;
    if (act) {
        return n == 1 ? k_launch(gemv_norm_kernel<1, true>, grid, block, smem, s, w, x, norm_w, eps, Y, act, rows, in8)
                      : k_launch(gemv_norm_kernel<2, true>, grid, block, smem, s, w, x, norm_w, eps, Y, act, rows, in8);
    }
    return n == 1 ? k_launch(gemv_norm_kernel<1, false>, grid, block, smem, s, w, x, norm_w, eps, Y, act, rows, in8)
                  : k_launch(gemv_norm_kernel<2, false>, grid, block, smem, s, w, x, norm_w, eps, Y, act, rows, in8);
}
